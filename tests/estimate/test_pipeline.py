"""Pipeline parallelism (memfit.estimate.pipeline): the formulas against real 2-rank gloo runs of the tiny Llama cut
into two stages with torch.distributed.pipelining (GPipe and 1F1B, 4 micro-batches; peak within 2% per rank, the
p2p bytes per step equal to the communication model's), the schedules' micro-batches in flight against torch's own
schedule tables and Narayanan et al. / Korthikanti et al., static memory per stage on paper, the CLI and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.errors import ConfigError
from memfit.estimate import pipeline as ppm
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume, pipeline_collectives
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from tiny_configs import TINY_BERT, TINY_LLAMA, TINY_QWEN2
from torchrun_job import rank_results, run_ranks

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "pp_worker.py"
RANKS, STEPS, MICRO, SEQ, CHUNKS = 2, 2, 2, 128, 4
SCHEDULES = ("gpipe", "1f1b")
SPEC = resolve_model(TINY_LLAMA)
HARDWARE = make_hardware(cpu_device(64 * 1024**3), gpus_per_node=RANKS)
PEAK_TOLERANCE = 0.02


def _setup(schedule: str = "1f1b", **changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=MICRO, seq_len=SEQ, grad_accum_steps=CHUNKS, precision="fp32",
                         optimizer="adamw", engine="torch", num_gpus=RANKS, pp=RANKS,
                         pp_schedule=schedule).replace(**changes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One torchrun job: both schedules, one after the other, on a fresh model each."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = run_ranks(WORKER, TINY_LLAMA, tmp_path_factory.mktemp("pp"), ",".join(SCHEDULES), str(STEPS), str(MICRO),
                    str(SEQ), str(CHUNKS), ranks=RANKS)
    return {name: rank_results(out, RANKS, prefix=f"{name}_") for name in SCHEDULES}


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_gloo_stages_peak_within_two_percent_of_the_formulas(runs, schedule):
    """Each rank's measured peak (the interval PeakMeter allows for buffers gloo's thread freed unseen) against
    that rank's stage estimate; its parameters, optimizer states and receive buffers exactly."""
    setup = _setup(schedule)
    stages = ppm.stage_memories(SPEC, setup, on_cpu=True)
    for rank, stage in zip(runs[schedule], stages):
        high, unseen = rank["peak_bytes"], rank["unseen_at_peak_bytes"]
        low, predicted = high - unseen, stage.tensor_bytes
        print(f"{schedule} rank {rank['rank']}: measured {low:,}..{high:,} B, predicted {predicted:,} B "
              f"({low / predicted - 1:+.2%}..{high / predicted - 1:+.2%}) at its {stage.moment}")
        assert low <= predicted * (1 + PEAK_TOLERANCE), (low, predicted)
        assert high >= predicted * (1 - PEAK_TOLERANCE), (high, predicted)
        own = ppm.stage_spec(SPEC, stage.held)
        assert rank["num_params"] == own.num_params
        scalars = 4 * sum(p.count for p in own.params)  # AdamW's 0-d 'step' tensors, left out of the worker's count
        terms = {t.name: t.num_bytes for t in stage.terms}
        assert rank["optimizer_bytes"] == terms["optimizer/states"] - scalars
        assert rank["recv_buffer_bytes"] == terms["activations/p2p_buffers"]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_p2p_bytes_per_step_are_the_communication_model(runs, schedule):
    setup = _setup(schedule)
    for rank in runs[schedule]:
        sends = pipeline_collectives(SPEC, setup, rank["rank"])
        assert rank["sent_bytes"] == [sum(c.payload_bytes for c in sends)] * STEPS
    assert comm_volume(SPEC, setup).pipeline_parallel_bytes == CHUNKS * MICRO * SEQ * TINY_LLAMA["hidden_size"] * 4


@pytest.mark.slow
@pytest.mark.processes
def test_schedules_give_the_same_losses(runs):
    """The two schedules compute the same step (same data, same initial weights): their losses agree."""
    for gpipe, one_f_one_b in zip(runs["gpipe"][1]["losses"], runs["1f1b"][1]["losses"]):
        assert gpipe == pytest.approx(one_f_one_b, rel=1e-5)
    assert len(runs["gpipe"][1]["losses"][0]) == CHUNKS


def _torch_interleaved_in_flight(pp: int, v: int, m: int, rank: int) -> tuple[int, list[int]]:
    """Most stage-micro-batches rank `rank` holds, and how they fall on its stages, walking torch's own
    ScheduleInterleaved1F1B action table (_calculate_single_rank_operations: forwards add, backwards release)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    table = object.__new__(ScheduleInterleaved1F1B)
    table.pp_group_size, table.n_local_stages, table._n_microbatches = pp, v, m
    table.microbatches_per_round = m // max(1, m // pp)
    alive = {rank + k * pp: 0 for k in range(v)}
    most, at_most = 0, []
    for action in table._calculate_single_rank_operations(rank):
        if action is None:
            continue
        alive[action.stage_index] += 1 if action.computation_type is _ComputationType.FORWARD else -1
        if sum(alive.values()) > most:
            most, at_most = sum(alive.values()), list(alive.values())
    return most, at_most


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 4), (8, 2, 16), (4, 2, 6), (2, 3, 1)])
def test_interleaved_in_flight_is_torchs_schedule_table_and_korthikanti(pp, v, m):
    setup = TrainingSetup(engine="torch", num_gpus=pp, pp=pp, pp_schedule="interleaved-1f1b",
                          pp_virtual_stages=v, grad_accum_steps=m)
    for rank in range(pp):
        most, per_stage = _torch_interleaved_in_flight(pp, v, m, rank)
        assert ppm.in_flight(setup, rank) == most
        assert ppm.in_flight_by_stage(setup, rank) == per_stage
    layers = 8 * pp * v  # rank 0 holds L (1 + (p - 1) / (p v)) layers' worth (Korthikanti et al. 2022 sec. 4.2.3)
    paper = ppm.korthikanti_interleaved_layers(layers, pp, v)
    if m % pp == 0 and m * v >= v * pp + pp - 1:  # the paper's steady state: rounds of pp micro-batches
        assert ppm.in_flight(setup, 0) * layers / (pp * v) == paper
    elif m * v < v * pp + pp - 1:  # fewer micro-batches than the warm-up: all of them are in flight
        assert ppm.in_flight(setup, 0) == m * v


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 2), (8, 8)])
def test_gpipe_and_1f1b_in_flight(pp, m):
    """GPipe holds all m micro-batches (Huang et al. 2019); 1F1B at most pp on the first stage, one on the last
    (Narayanan et al. 2021 sec. 2.2.1: 'stashes at most p micro-batches')."""
    gpipe = TrainingSetup(engine="torch", num_gpus=pp, pp=pp, pp_schedule="gpipe", grad_accum_steps=m)
    ofob = gpipe.replace(pp_schedule="1f1b")
    assert [ppm.in_flight(gpipe, r) for r in range(pp)] == [m] * pp
    assert [ppm.in_flight(ofob, r) for r in range(pp)] == [min(m, pp - r) for r in range(pp)]


def test_static_memory_per_stage_on_paper_for_many_nodes():
    """Llama-3.1-8B on 8 nodes x 8 GPUs, tp 2 x pp 4 x dp 8, FSDP2 (zero3): every stage's parameters sum to one
    tensor-parallel rank's model, the embedding on rank 0, the head on rank 3, each sharded over the 8 dp ranks."""
    from memfit.estimate import tensor_parallel as tpm

    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=8192, grad_accum_steps=8, precision="bf16", engine="torch",
                          num_gpus=64, tp=2, pp=4, sharding="zero3", checkpointing="full")
    assert setup.dp_size == 8 and setup.effective_batch_size == 64
    local = tpm.rank_spec(spec, setup)
    stages = [ppm.stage_spec(local, ppm.rank_stages(local, setup, r)) for r in range(4)]
    assert sum(s.num_params for s in stages) == local.num_params
    vh = local.vocab_size * local.hidden_size
    assert stages[0].num_params - stages[1].num_params == vh == stages[3].num_params - stages[1].num_params - 4096
    hw = make_hardware("H100", gpus_per_node=8, num_nodes=8)
    memories = ppm.stage_memories(local, setup)
    for memory, own in zip(memories, stages):
        params = next(t for t in memory.terms if t.name == "parameters").num_bytes
        assert params == 2 * own.num_params // 8
    est = estimate(spec, setup, hw)
    assert est.tensor_bytes == max(m.tensor_bytes for m in memories)
    assert any("pipeline rank" in note for note in est.notes)
    volume = comm_volume(spec, setup, hw)
    boundary = 8192 * 4096 * 2  # B x T x h in bf16
    assert volume.pipeline_parallel_bytes == 2 * 8 * boundary  # a middle stage sends both ways, 8 micro-batches
    assert volume.dp_size == 8


@pytest.mark.parametrize("changes,message", [
    ({"pp": 3}, "must divide the GPU count"),
    ({"engine": "deepspeed"}, "engine torch"),
    ({"pp_schedule": "interleaved-1f1b"}, "stages per rank"),
    ({"pp_virtual_stages": 2}, "interleaved-1f1b"),
    ({"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2, "grad_accum_steps": 5}, "multiple of its 2 rounds"),
    ({"sharding": "zero1"}, "ZeroRedundancyOptimizer"),
    ({"loss": "chunked"}, "loss standard"),
    ({"pp": 1, "pp_virtual_stages": 2}, "pp > 1"),
])
def test_bad_pipeline_setups_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as info:
        _setup(**changes)
    assert "\n" not in str(info.value)


def test_more_stages_than_layers_is_one_line():
    setup = TrainingSetup(engine="torch", num_gpus=4, pp=4, grad_accum_steps=4)
    with pytest.raises(ConfigError, match="at least as many layers") as info:
        estimate(SPEC, setup, make_hardware(cpu_device(64 * 1024**3), gpus_per_node=4))
    assert "\n" not in str(info.value)


def _cli(*args: str):
    from typer.testing import CliRunner

    from memfit.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_cli_pipeline_options_json_and_torchtitan_keys(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    base = ["estimate", str(config), "--gpu", "H100", "--gpus", "2", "-b", "2", "-s", "128", "--accum", "4", "--json"]
    result = _cli(*base, "--pp", "2", "--pp-schedule", "gpipe")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["setup"]["pp"] == 2 and data["setup"]["pp_schedule"] == "gpipe" and data["setup"]["engine"] == "torch"
    plan = _cli("plan", str(config), "--gpu", "H100", "--gpus", "2", "-b", "2", "-s", "128", "--accum", "4",
                "--pp", "2", "--json")
    launch = json.loads(plan.output)["launch"]
    # 4 micro-batches x B x T x h, fp32: under autocast (amp-bf16, the default) the residual stream stays fp32
    assert launch["communication"]["pipeline_parallel_bytes"] == 4 * 2 * 128 * 64 * 4
    note = next(n for n in launch["notes"] if "pipeline_parallel_degree = 2" in n)
    assert 'pipeline_parallel_schedule = "1F1B"' in note and "pipeline_parallel_layers_per_stage = 1" in note


def test_torchtitan_toml_parses():
    import tomllib

    from memfit.emit.torchtitan import torchtitan_toml

    setup = TrainingSetup(micro_batch_size=2, grad_accum_steps=8, engine="torch", num_gpus=32, tp=2, pp=4,
                          pp_schedule="interleaved-1f1b", pp_virtual_stages=2, sharding="zero3")
    parsed = tomllib.loads(torchtitan_toml(setup, num_layers=32))
    assert parsed["parallelism"] == {
        "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4, "tensor_parallel_degree": 2,
        "disable_loss_parallel": False, "fsdp_reshard_after_forward": "always", "pipeline_parallel_degree": 4,
        "pipeline_parallel_schedule": "Interleaved1F1B", "pipeline_parallel_microbatch_size": 2,
        "pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0,
        "pipeline_parallel_layers_per_stage": 4}
    assert parsed["training"] == {"local_batch_size": 16, "seq_len": 2048}


@pytest.mark.parametrize("args,message", [
    (["--gpus", "2", "--pp", "4"], "must divide the GPU count"),
    (["--gpus", "4", "--pp", "4"], "at least as many layers"),
    (["--gpus", "2", "--pp", "2", "--engine", "deepspeed"], "engine torch"),
    (["--gpus", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b"], "stages per rank"),
])
def test_cli_bad_pipeline_input_exits_2_in_one_line(args, message, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    result = _cli("estimate", str(config), "--gpu", "H100", "-b", "2", "-s", "128", "--accum", "4", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error:"), result.output


def test_fsdp2_under_a_pipeline_keeps_gradients_unsharded_across_micro_batches():
    """torch's PipelineStage runs every micro-batch's backward but the last with FSDP2's gradient sync and
    resharding off: from the second backward on, the stage's gradients accumulate unsharded (P x reduce dtype) and
    its parameters stay gathered, so sharding saves on parameters and states, not on those."""
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=4096, grad_accum_steps=8, precision="bf16", engine="torch",
                          num_gpus=16, pp=4, sharding="zero3", checkpointing="full")
    for memory in ppm.stage_memories(spec, setup):
        own = ppm.stage_spec(spec, memory.held)
        terms = {t.name: t.num_bytes for t in memory.terms}
        assert memory.moment.startswith("second backward")
        assert terms["gradients/unsharded_accumulated"] == 2 * own.num_params
        assert terms["parameters/gathered"] == 2 * own.num_params
        assert terms["parameters"] == 2 * own.num_params // 4  # the shards, over the 4 data-parallel ranks


def test_a_tied_head_is_a_copy_on_the_last_stage_and_encoders_are_refused():
    """A tied embedding / LM head lives on both ends (Megatron-LM keeps a copy on the last stage and all-reduces
    its gradient with the first's): the stages together hold one V x h matrix more than the model."""
    spec = resolve_model(TINY_QWEN2)
    setup = TrainingSetup(engine="torch", num_gpus=2, pp=2, grad_accum_steps=2)
    stages = [ppm.stage_spec(spec, ppm.rank_stages(spec, setup, r)) for r in range(2)]
    assert sum(s.num_params for s in stages) == spec.num_params + spec.vocab_size * spec.hidden_size
    with pytest.raises(ConfigError, match="causal LMs") as info:
        estimate(resolve_model(TINY_BERT), setup, make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2))
    assert "\n" not in str(info.value)
