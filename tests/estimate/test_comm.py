"""The one communication model (memfit.estimate.comm) against the ZeRO paper (Rajbhandari et al. 2020, sec. 7: data
parallelism 2 Psi, ZeRO-1/2 2 Psi, ZeRO-3 3 Psi per rank per step), with each engine's departures from it, the
micro-steps of gradient accumulation and the dtype each collective travels in. The model's numbers on real 2-rank
gloo jobs are checked in tests/engines/test_launch.py; the counter those jobs use is checked here on a 1-rank gloo group."""

from __future__ import annotations

import pytest

from memfit.estimate.comm import (PAPER_PSI_MULTIPLE, Runtime, comm_volume, data_parallel_bytes, runtime_of)
from memfit.hardware import make_hardware
from memfit.launch import launch_plan
from memfit.setup import Engine, Sharding, TrainingSetup
from memfit.sources import resolve_model
from memfit.techniques.costs import zero_traffic_bytes
from memfit.units import GiB

SPEC_8B = resolve_model("llama-3.1-8b")
P = SPEC_8B.num_params  # 8,030,261,248
STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}


def _setup(stage: int, engine: str, precision: str = "amp-bf16", **fields) -> TrainingSetup:
    return TrainingSetup(precision=precision, optimizer="adamw", sharding=STAGES[stage], num_gpus=8, engine=engine,
                         **fields)


@pytest.mark.parametrize("engine,precision", [("torch", "fp32"), ("torch", "bf16"), ("deepspeed", "fp32")])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_paper_where_the_engine_does_what_the_paper_does_and_its_departures(engine, precision, stage):
    """Psi in the one dtype everything travels in (fp32, or pure bf16). Departures, each with its reason in
    estimate/comm.py: torch's ZeRO-1 all-reduces whole gradients and broadcasts the parameters (+1 Psi); DeepSpeed's
    ZeRO-1/2 all-reduce gradient buckets (+1 Psi); DeepSpeed's ZeRO-3 keeps 5e8 elements gathered into backward."""
    setup = _setup(stage, engine, precision)
    dtype_bytes = 4 if precision == "fp32" else 2
    volume = comm_volume(SPEC_8B, setup)
    extra_elements = {("torch", 1): P, ("deepspeed", 1): P, ("deepspeed", 2): P,
                      ("deepspeed", 3): -5 * 10**8}.get((engine, stage), 0)
    assert volume.per_rank_bytes == (PAPER_PSI_MULTIPLE[stage] * P + extra_elements) * dtype_bytes
    assert volume.psi_multiple == pytest.approx(PAPER_PSI_MULTIPLE[stage] + extra_elements / P, rel=1e-12)
    assert all(c.dtype_bytes == dtype_bytes for c in volume.collectives)


def test_llama_3_1_8b_on_8_gpus_amp_bf16_both_engines():
    """The table of the issue, now from one model (GiB per rank per step, the paper's convention):
    FSDP2 gathers bf16 and reduce-scatters fp32 (MixedPrecisionPolicy reduce_dtype); torch DDP and
    ZeroRedundancyOptimizer move fp32 gradients and weights; DeepSpeed communicates in bf16."""
    table = {engine: [round(comm_volume(SPEC_8B, _setup(stage, engine)).per_rank_bytes / GiB, 2) for stage in STAGES]
             for engine in ("torch", "deepspeed")}
    assert table == {"torch": [59.83, 89.75, 44.87, 59.83], "deepspeed": [29.92, 44.87, 44.87, 43.94]}
    zero2 = comm_volume(SPEC_8B, _setup(2, "torch"))
    assert [(c.name, c.dtype_bytes, c.num_bytes) for c in zero2.collectives] == [
        ("all-gather", 2, 2 * P), ("reduce-scatter", 4, 4 * P)]
    zero3 = comm_volume(SPEC_8B, _setup(3, "deepspeed"))
    assert [c.num_elements for c in zero3.collectives] == [P, P - 5 * 10**8, P]
    # techniques/costs.py and memfit.launch show the same numbers: there is no second model.
    hardware = make_hardware("H100", gpus_per_node=8)
    for engine in ("torch", "deepspeed"):
        for stage in STAGES:
            setup = _setup(stage, engine)
            assert zero_traffic_bytes(SPEC_8B, setup) == comm_volume(SPEC_8B, setup).per_rank_bytes
            assert launch_plan(setup, hardware, spec=SPEC_8B).comm == comm_volume(SPEC_8B, setup, hardware)


def test_gradient_accumulation_counts_what_each_engine_does_per_micro_step():
    """4 micro-steps, fp32: DDP (all-reduce after the last micro-step, as under no_sync) and DeepSpeed ZeRO-0/1
    (at the boundary) reduce once; FSDP2 gathers and reduce-scatters in every micro-step; DeepSpeed ZeRO-2
    all-reduces in every backward but all-gathers once after the step; ZeRO-3 does everything per micro-step."""
    def multiple(stage: int, engine: str) -> float:
        return comm_volume(SPEC_8B, _setup(stage, engine, "fp32", grad_accum_steps=4)).psi_multiple

    assert [multiple(stage, "torch") for stage in STAGES] == [2, 3, 4 * 2, 4 * 3]
    kept = 5 * 10**8 / P
    assert [multiple(stage, "deepspeed") for stage in STAGES] == pytest.approx([2, 3, 4 * 2 + 1, 4 * (3 - kept)])
    notes = comm_volume(SPEC_8B, _setup(2, "torch", "fp32", grad_accum_steps=4)).notes
    assert any("each of the 4 micro-steps" in note for note in notes)


def test_reduce_dtype_follows_the_precision():
    def dtypes(stage: int, engine: str, precision: str) -> dict[str, int]:
        return {c.name: c.dtype_bytes for c in comm_volume(SPEC_8B, _setup(stage, engine, precision)).collectives}

    for precision in ("amp-bf16", "amp-fp16", "bf16-master"):  # MixedPrecisionPolicy(reduce_dtype=float32)
        assert dtypes(2, "torch", precision) == {"all-gather": 2, "reduce-scatter": 4}
    assert dtypes(2, "torch", "bf16") == {"all-gather": 2, "reduce-scatter": 2}
    assert dtypes(0, "torch", "amp-bf16") == {"all-reduce": 4}  # autocast keeps fp32 weights, so fp32 gradients
    assert dtypes(0, "torch", "bf16-master") == {"all-reduce": 2}  # bf16 gradients; the fp32 copy stays local
    assert dtypes(2, "deepspeed", "amp-bf16") == {"all-reduce": 2, "all-gather": 2}  # communication_data_type


def test_conventions_runtime_and_one_gpu():
    volume = comm_volume(SPEC_8B, _setup(0, "torch", "fp32"))
    (all_reduce,) = volume.collectives
    assert all_reduce.payload_bytes == 4 * P and all_reduce.num_bytes == 2 * 4 * P  # ring all-reduce = RS + AG
    assert volume.ring_bytes_per_rank == 2 * 4 * P * 7 // 8
    assert volume.payload_bytes() == {"all-reduce": 4 * P}
    assert data_parallel_bytes(SPEC_8B, _setup(3, "torch", "fp32")) == 8 * P
    single = TrainingSetup(engine="torch", num_gpus=1)
    assert comm_volume(SPEC_8B, single).per_rank_bytes == 0 and data_parallel_bytes(SPEC_8B, single) == 0
    assert [runtime_of(Engine.TORCH, s) for s in Sharding] == [
        Runtime.DDP, Runtime.ZERO_REDUNDANCY, Runtime.FSDP2_NO_RESHARD, Runtime.FSDP2_RESHARD]
    assert runtime_of(Engine.TORCH, Sharding.NONE, world_size=1) is Runtime.SINGLE
    assert {runtime_of(Engine.DEEPSPEED, s) for s in Sharding} == {Runtime.DEEPSPEED}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch 2.13 renames all_gather_into_tensor & co.
def test_the_counter_reads_each_collectives_payload_through_the_dispatcher(tmp_path):
    """memfit._torch.comm_count on a 1-rank gloo group: payload = the tensor of an all-reduce or broadcast, the
    gathered output of an all-gather, the input of a reduce-scatter; scalars are bookkeeping, left out."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from memfit._torch.comm_count import CollectiveCounter

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with CollectiveCounter() as counter:
            dist.all_reduce(torch.ones(10))
            dist.all_gather_into_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16))
            dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
            dist.broadcast(torch.ones(5, dtype=torch.float16), src=0)
            dist.all_reduce(torch.ones(1))  # a gradient norm: bookkeeping
            dist.broadcast(torch.arange(40), src=0)  # int64 ids: bookkeeping
    finally:
        dist.destroy_process_group()
    assert counter.payload_bytes() == {"all-reduce": 40, "all-gather": 12, "reduce-scatter": 24, "broadcast": 10}
    assert len(counter.calls) == 6
