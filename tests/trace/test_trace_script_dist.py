"""`memfit trace -- torchrun ... / accelerate launch ... / deepspeed ...`: a multi-rank script traced as rank 0 of a
fake process group, checked against rank 0 of a real gloo job (bench/frameworks.py's rank meter), and the launchers'
command lines read with their own parsers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit import ConfigError  # noqa: E402
from memfit.trace.script import parse_command, trace_script  # noqa: E402
from memfit.trace.script_launch import read_launcher  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "data" / "scripts"
REPO = Path(__file__).resolve().parents[2]
DDP = str(SCRIPTS / "ddp_loop.py")


def _terms(result) -> dict:
    return {term.name: term.num_bytes for term in result.terms}


def _param_bytes() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
    with torch.device("meta"):
        return sum(p.numel() * 4 for p in LlamaForCausalLM(config).parameters())


def test_ddp_holds_one_bucket_set_as_gradients():
    """DDP's Reducer runs on the fake group: its flat buckets (the size of the trainable parameters, fp32) are the
    gradients term; with gradient_as_bucket_view the .grad tensors are views of them, so nothing more."""
    traced = trace_script(["torchrun", "--nproc_per_node", "2", DDP], device="cpu")
    view = trace_script(["torchrun", "--nproc_per_node", "2", DDP, "--gradient-as-bucket-view"], device="cpu")
    assert _terms(traced)["gradients"] == _terms(view)["gradients"] == _param_bytes()
    assert any("gradient buckets (" + f"{_param_bytes():,} B" in note for note in traced.notes)


@pytest.mark.processes
def test_ddp_trace_equals_rank_0_of_a_real_gloo_job(tmp_path):
    """The same script under a real 2-rank torchrun on gloo, rank 0 measured by memfit's rank meter: the trace lies
    in [peak - what is still counted at the end, peak] (a block gloo's thread frees stays counted: DDP's init
    broadcast buffer, when that thread drops it last); bench/results/frameworks.md has all variants."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "bench" / "frameworks.py"), "--rank", str(tmp_path), DDP, "--find-unused-parameters"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    traced = trace_script(["torchrun", "--nproc_per_node", "2", DDP, "--find-unused-parameters"], device="cpu")
    slack = 0.001 * traced.tensor_bytes
    assert rank0["peak"] - rank0["at_end"] - slack <= traced.tensor_bytes <= rank0["peak"] + slack, rank0


def test_a_ddp_comm_hook_is_refused_in_one_line(tmp_path):
    script = tmp_path / "hooked.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
        "dist.init_process_group('gloo')\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
        "model.register_comm_hook(None, default_hooks.fp16_compress_hook)\n")
    with pytest.raises(ConfigError, match=r"register_comm_hook\(fp16_compress_hook\)"):
        trace_script(["torchrun", "--nproc_per_node", "2", str(script)], device="cpu")


def test_accelerate_launch_is_read_with_accelerates_parser(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 4\n"
                      "mixed_precision: bf16\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                      "  fsdp_version: 1\n")
    launch = read_launcher(["accelerate", "launch", "--config_file", str(config), DDP, "--lr", "1"])
    env = dict(launch.env)
    assert launch.argv == ("python", DDP, "--lr", "1") and launch.world_size == 4
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    command = parse_command(["accelerate", "launch", "--num_processes", "2", "--multi_gpu", DDP])
    assert (command.world_size, command.launched, command.path) == (2, True, DDP)


def test_deepspeed_launcher_passes_local_rank():
    launch = read_launcher(["deepspeed", "--num_gpus", "2", DDP, "--deepspeed", "ds.json"])
    assert launch.argv == ("python", DDP, "--deepspeed", "ds.json", "--local_rank=0") and launch.world_size == 2


@pytest.mark.parametrize("argv, says", [
    (["deepspeed", DDP], "--num_gpus"), (["deepspeed", "--num_nodes", "2", "--num_gpus", "2", DDP], "one node"),
    (["accelerate", "launch", "--num_machines", "2", "--num_processes", "4", "--multi_gpu", DDP], "one node"),
    (["accelerate", "launch", "--bogus", DDP], "accelerate launch: .*bogus"),
    (["lightning", "run", "model", DDP], "not traced yet")])
def test_bad_launcher_commands(argv, says):
    with pytest.raises(ConfigError, match=says):
        parse_command(argv)
