"""ZeRO with CPU offload on one GPU: DeepSpeed's ZeRO-2 + offload_optimizer and ZeRO-3 + offload_param +
offload_optimizer on a single rank. Setup validation, the per-device / host formulas (memfit.estimate.static), the
ladder's offload rung with its PCIe and CPU-step cost, the emitted DeepSpeed config and launch command, and real
1-rank DeepSpeed runs on CPU (gloo) whose buffers, sorted by where DeepSpeed puts them, equal the formulas.

On a CPU-only run the 'device' is host memory too, so the comparison reads DeepSpeed's own buffers by the device it
allocates them on (memfit._torch.rank_memory.offload_inventory). DeepSpeedCPUAdam's C++ op is built once by the test
command (scripts/build_deepspeed_ops.py; else JIT-compiled on first use, minutes); the runs are skipped when it cannot
be built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.launch import launch_plan, local_command
from memfit.plan import plan
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.techniques.costs import offload_traffic_bytes
from tiny_configs import TINY_LLAMA

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "sharded_train.py"
SPEC = resolve_model(TINY_LLAMA)
P = SPEC.num_params
LARGEST = max(p.numel for p in SPEC.params)  # embed_tokens / lm_head: larger than the reduce bucket, as at 8B
BUCKET = TINY_LLAMA["hidden_size"] ** 2  # reduce_bucket_size "auto" = hidden^2
BASE = TrainingSetup(micro_batch_size=2, seq_len=128, precision="bf16-master", optimizer="adamw", num_gpus=1,
                     engine="deepspeed")
ZERO2 = BASE.replace(sharding="zero2", offload="optimizer")
ZERO3 = BASE.replace(sharding="zero3", offload="optimizer+params")
RTX4090 = make_hardware("RTX-4090")
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}


# --- setup validation ------------------------------------------------------------------------------------------

def test_one_gpu_allows_zero_with_offload_on_deepspeed_only():
    assert ZERO2.num_gpus == 1 and ZERO3.num_gpus == 1
    with pytest.raises(ConfigError, match="needs at least 2 .*saves nothing unless it offloads"):
        TrainingSetup(sharding="zero2", num_gpus=1, engine="torch")
    # DeepSpeed runs ZeRO at world size 1 without offload too (tests/engines/test_deepspeed_knobs.py)
    assert TrainingSetup(sharding="zero2", num_gpus=1, engine="deepspeed").sharding.stage == 2
    with pytest.raises(ConfigError, match="use --engine deepspeed"):
        TrainingSetup(sharding="zero3", offload="optimizer+params", num_gpus=1, engine="torch")
    with pytest.raises(ConfigError, match="needs zero3"):
        TrainingSetup(sharding="zero2", offload="optimizer+params", num_gpus=1)


def test_cli_refusals_stay_one_line_and_exit_2():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--zero", "zero2", "--engine", "torch"])
    assert result.exit_code == 2 and "saves nothing" in result.output and "Traceback" not in result.output


# --- formulas --------------------------------------------------------------------------------------------------

def test_zero2_offload_keeps_16bit_params_on_the_device_and_the_rest_on_the_host():
    est = estimate(SPEC, ZERO2, make_hardware(cpu_device(64 * 1024**3)))
    assert est.term("parameters").num_bytes == 2 * P
    assert est.term("gradients/comm_buffers").num_bytes == 2 * BUCKET + 2 * LARGEST
    # states 8 + master 4 + its gradient 4 + 16-bit upload copy 2 per parameter, + the largest-parameter buffer
    assert est.cpu_bytes == 18 * P + 2 * LARGEST
    assert not any(t.name.startswith("optimizer") for t in est.terms)


def test_zero3_param_offload_leaves_only_buckets_and_gathered_modules_on_the_device():
    est = estimate(SPEC, ZERO3, make_hardware(cpu_device(64 * 1024**3)))
    persistent = 2 * sum(p.numel * p.count for p in SPEC.params if p.numel < 10 * TINY_LLAMA["hidden_size"])
    assert est.term("parameters").num_bytes == persistent
    assert est.term("gradients/comm_buffers").num_bytes == 2 * BUCKET
    # states 8 + master 4 + fp32 gradient 4 + 16-bit gradient partition 2 + 16-bit parameter partition 2
    assert est.cpu_bytes == 20 * P


def test_8b_on_a_4090_sizes_host_ram_and_the_device():
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, grad_accum_steps=8, precision="bf16-master",
                          optimizer="adamw", checkpointing="full", sharding="zero3", offload="optimizer+params")
    est = estimate(spec, setup, RTX4090)
    assert est.term("parameters").num_bytes < 2**20  # only the norms stay (persistence threshold)
    assert est.cpu_bytes == 20 * spec.num_params + 0  # 160 GB of host RAM
    assert est.total_bytes < RTX4090.gpu.memory_bytes


def test_offload_traffic_follows_what_deepspeed_copies():
    spec = resolve_model("llama-3.1-8b")
    p = spec.num_params
    one = TrainingSetup(precision="bf16-master", optimizer="adamw", sharding="zero2", offload="optimizer")
    assert offload_traffic_bytes(spec, one) == 4 * p + 2 * p  # fp32 gradients down, bf16 partition up
    assert offload_traffic_bytes(spec, one.replace(grad_accum_steps=4)) == 4 * p + 2 * p * 4 + 2 * p * 4
    assert offload_traffic_bytes(spec, one.replace(sharding="none", grad_accum_steps=4)) == 6 * p  # once, at the end
    three = one.replace(sharding="zero3", offload="optimizer+params")
    assert offload_traffic_bytes(spec, three) == (2 * p + 4 * p) + (2 * p + 2 * 2 * p)


# --- the ladder ------------------------------------------------------------------------------------------------

def test_full_fine_tune_of_8b_on_a_4090_reaches_the_offload_rung_and_fits():
    result = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), RTX4090)
    assert result.fits
    final = result.final_setup
    assert (final.engine.value, final.num_gpus, final.offload.value) == ("deepspeed", 1, "optimizer")
    assert final.sharding.value in ("zero2", "zero3")
    (step,) = [s for s in result.steps if s.technique == "cpu_offload"]
    cost = step.typed_cost  # what the ladder prints (step.cost), as numbers
    assert cost.host_link_bytes == offload_traffic_bytes(resolve_model("llama-3.1-8b"), step.setup) > 0
    assert cost.cpu_step_seconds > 0
    assert step.cost == cost.text
    assert "offload_optimizer.device=cpu" in step.change
    assert 0 < result.final_estimate.cpu_bytes <= RTX4090.cpu_ram_bytes


def test_offload_rung_says_when_host_ram_is_the_limit():
    hw = make_hardware("RTX-4090", cpu_ram="32GiB")
    result = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), hw)
    reason = dict(result.skipped)["CPU offload of optimizer states"]
    assert reason.startswith("host RAM is the limit") and "--cpu-ram" in reason


def test_the_explicit_zero3_offload_plan_reports_host_ram():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--zero", "zero3", "--offload",
                                      "optimizer+params"])
    assert result.exit_code in (0, 1), result.output
    assert "CPU RAM for offloaded tensors" in result.output and "needs at least 2" not in result.output


# --- emitted config and launch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("setup", [ZERO2, ZERO3], ids=["zero2-offload", "zero3-offload"])
def test_deepspeed_parses_the_one_gpu_offload_config(setup, monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    from memfit import emit

    monkeypatch.setattr(ds_comm, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *args, **kwargs: 1)
    parsed = DeepSpeedConfig(emit.deepspeed_config(setup), mpu=None)
    assert parsed.world_size == 1 and parsed.zero_optimization_stage == setup.sharding.stage
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    params = parsed.zero_config.offload_param
    assert (params.device if params else "none") == ("cpu" if setup.sharding.stage == 3 else "none")
    assert "one GPU" in emit.deepspeed_file(setup).comments["zero_optimization.stage"]


def test_launch_is_one_process():
    section = launch_plan(ZERO3, RTX4090, "train.py", spec=resolve_model("llama-3.1-8b"))
    (node,) = section.commands
    assert node.argv[:4] == ("torchrun", "--standalone", "--nproc-per-node", "1")
    ds = launch_plan(ZERO3, RTX4090, "train.py", spec=resolve_model("llama-3.1-8b"), launcher="deepspeed")
    assert ds.commands[0].argv[:3] == ("deepspeed", "--num_gpus", "1")
    from memfit.launch import launch_section

    fitted = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), RTX4090)
    assert launch_section(fitted) is not None  # the plan's one-GPU offload setup gets its command too


# --- real 1-rank DeepSpeed runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_adam():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()  # JIT build on first use, then cached
    except Exception as error:  # noqa: BLE001 - any build failure means the runs cannot happen here
        pytest.skip(f"DeepSpeedCPUAdam cannot be built here: {error}")


def _run(tmp_path: Path, setup: TrainingSetup) -> dict:
    out, config = tmp_path / "out", tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    command = local_command(setup, 1, str(SCRIPT), ["--config", str(config), "--steps", "3", "--out", str(out)],
                            engine="deepspeed", python=sys.executable)
    done = subprocess.run(list(command.argv), cwd=tmp_path, env={**os.environ, **ENV, **dict(command.env)},
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # DeepSpeed on CPU may abort at exit after training: only a completed run counts
        assert (out / "rank0.done").exists(), done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((out / "rank0.json").read_text())


RUNS = {"zero2": ZERO2, "zero3": ZERO3, "zero2-accum2": ZERO2.replace(grad_accum_steps=2),
        "zero2-fp32": ZERO2.replace(precision="fp32"),
        "offload-only-accum2": BASE.replace(offload="optimizer", grad_accum_steps=2)}  # DeepSpeed runs it as ZeRO-1


@pytest.fixture(scope="module")
def runs(cpu_adam, tmp_path_factory) -> dict:
    return {name: _run(tmp_path_factory.mktemp(name), setup) for name, setup in RUNS.items()}


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("name", list(RUNS))
def test_one_rank_buffers_equal_the_formulas(name, runs):
    setup = RUNS[name]
    rank = runs[name]
    assert rank["world_size"] == 1 and rank["setup"]["sharding"] == setup.sharding.value
    predicted = estimate(SPEC, setup, make_hardware(cpu_device(64 * 1024**3)))
    host, device = rank["offload_host"], rank["offload_device"]
    print(f"{name}: host {host}, device {device}, peak {rank['peak_bytes']:,} B")
    assert sum(host.values()) == predicted.cpu_bytes  # every host buffer, to the byte
    assert host["optimizer_states"] == 8 * P and host["fp32_master"] == 4 * P and host["fp32_grads"] == 4 * P
    if setup.sharding.stage <= 2:
        # on the device after the step: the flat 16-bit (fp32: 32-bit) parameters and the largest-parameter staging
        # buffer (the reduce bucket is released with the step; it is counted during backward)
        pb = 4 if setup.precision.value == "fp32" else 2
        assert device == {"bit16_params": pb * P, "gpu_offload_grad_buffer": pb * LARGEST}
        assert predicted.term("gradients/comm_buffers").num_bytes == pb * LARGEST + pb * BUCKET
        assert host["bit16_param_copy"] == pb * P
        # ZeRO-2 accumulates in CPU buffers between micro-steps; ZeRO-1 keeps accumulating on the device
        accumulated = pb * P if setup.grad_accum_steps > 1 and setup.sharding.stage == 2 else 0
        assert host.get("accumulated_grads", 0) == accumulated
    else:
        # ZeRO-3 keeps its ipg bucket from start-up; the parameters live on the host (on one rank the persistent
        # ones are views of their host partition, so only a GPU shows their device copies)
        assert device == {"reduce_buckets": 2 * BUCKET}
        assert host["bit16_param_partitions"] == 2 * P and host["grad_partitions"] == 2 * P
    # the whole job's peak (device and host are one memory here) against device tensors + host bytes
    whole = predicted.tensor_bytes + predicted.cpu_bytes
    error = (rank["peak_bytes"] - whole) / whole
    print(f"{name}: measured peak {rank['peak_bytes']:,} B, predicted {whole:,} B ({error:+.1%})")
    assert abs(error) <= 0.10


@pytest.mark.slow
@pytest.mark.processes
def test_the_offload_runs_train_the_same_model(runs):
    zero2 = runs["zero2"]["losses"]
    assert all(loss == loss for loss in zero2)
    for name in ("zero3", "zero2-accum2", "zero2-fp32", "offload-only-accum2"):  # same weights and data; accumulation splits the batch
        assert runs[name]["losses"] == pytest.approx(zero2, rel=1e-4), name
