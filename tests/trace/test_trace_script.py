"""`memfit trace -- python train.py`: scripts written for their frameworks, not for memfit, run on fake tensors.

Each accuracy case runs the same script twice on the CPU: for real under the profiler's memory events
(`measured_script_peak`, as tests/trace/test_trace.py measures memfit's own step) and traced with CPU semantics; the
two peaks agree. The CUDA target is checked against figures computed from the scripts' own arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from memfit import ConfigError  # noqa: E402
from memfit.cli.app import app  # noqa: E402
from memfit.trace.script import measured_script_peak, parse_command, trace_script  # noqa: E402
from tiny_configs import TINY_LLAMA  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "data" / "scripts"
TOLERANCE = 0.01  # the goal for a script trace; the cases below agree to a few bytes


def _script(name: str, *args: str) -> list[str]:
    return ["python", str(SCRIPTS / name), *args]


@pytest.mark.parametrize("name", ["plain_loop.py", "hf_trainer.py", "lightning_module.py", "lightning_fabric.py"])
def test_script_trace_equals_the_real_cpu_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # HF Trainer's output_dir, Lightning's logs
    argv = _script(name)
    real = measured_script_peak(argv, steps=2)
    traced = trace_script(argv, steps=2, device="cpu")
    assert traced.method == "traced"
    assert abs(traced.tensor_bytes - real) <= TOLERANCE * real, (traced.tensor_bytes, real)
    terms = {term.name: term.num_bytes for term in traced.terms}
    assert terms["parameters"] == 4 * _llama_numel()  # fp32 weights of the script's tiny Llama


def test_a_measured_run_after_an_interrupted_one_is_the_same(tmp_path, monkeypatch):
    """A run stopped after one step leaves its Trainer to the garbage collector, which frees it during the next
    profiled run: those frees are of blocks the next run never counted, so they must not lower its peak (a full
    -n 2 suite measured 2,765,148 B instead of 3,873,200 this way)."""
    monkeypatch.chdir(tmp_path)
    argv = _script("hf_trainer.py")
    first = measured_script_peak(argv, steps=2)
    measured_script_peak(argv, steps=1)
    assert abs(measured_script_peak(argv, steps=2) - first) <= 0.001 * first


def _llama_numel() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_cuda_target_keeps_host_data_off_the_device():
    """plain_loop.py makes its token table on the CPU (steps x batch x seq int64) and copies one batch to the
    device per step: the CUDA trace holds that batch instead of the table."""
    argv = _script("plain_loop.py", "--steps", "10", "--batch-size", "2", "--seq-len", "64")
    cpu = trace_script(argv, device="cpu").tensor_bytes
    cuda = trace_script(argv, device="cuda").tensor_bytes
    assert cpu - cuda == 10 * 2 * 64 * 8 - 2 * 64 * 8


def test_stops_after_the_asked_optimizer_steps(capsys):
    trace_script(_script("plain_loop.py"), steps=3, device="cpu")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert printed == ["step 0 loss 0.0000", "step 1 loss 0.0000"]  # step 3 ends inside optimizer.step()


def test_from_pretrained_builds_from_the_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_LLAMA, architectures=["LlamaForCausalLM"])))
    traced = trace_script(_script("from_pretrained.py", "--model", str(tmp_path)), device="cuda")
    terms = {term.name: term.num_bytes for term in traced.terms}
    assert terms["parameters"] == 4 * _llama_numel()
    assert terms["optimizer"] >= 2 * terms["parameters"]  # AdamW's exp_avg and exp_avg_sq (+ step counters)
    assert any("built from its config" in note for note in traced.notes)


def test_an_op_fake_tensors_cannot_run_is_one_line(tmp_path):
    script = tmp_path / "nonzero.py"
    script.write_text("import torch\nx = torch.randn(8)\nprint(torch.nonzero(x > 0).shape)\n")
    with pytest.raises(ConfigError, match=r"nonzero.py:3 .*aten\.nonzero"):
        trace_script(["python", str(script)])


@pytest.mark.parametrize("argv, says", [
    ([], "no script"), (["python", "-m"], "module name"), (["lightning", "run", "model", "x.py"], "not traced yet"),
    (["python", "missing.py"], "not found"), (["torchrun", "--nnodes", "2", "x.py"], "one node"),
    (["torchrun", "--max-restarts", "3", "x.py"], "not supported")])
def test_bad_commands(argv, says):
    with pytest.raises(ConfigError, match=says):
        parse_command(argv)


def test_module_form_is_parsed():
    command = parse_command(["python3", "-m", "pkg.train", "--lr", "1e-4"])
    assert (command.module, command.args) == ("pkg.train", ("--lr", "1e-4"))
    command = parse_command(["python", "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "pkg.train"])
    assert (command.module, command.world_size, command.launched) == ("pkg.train", 4, True)


def test_torchrun_fsdp2_script_is_rank_0_of_a_fake_group():
    """fsdp2_loop.py shards each decoder layer and the root with fully_shard: on 2 ranks rank 0 holds half of
    every parameter (the tiny Llama's dims are even) and half of AdamW's moments."""
    one = trace_script(["torchrun", "--nproc_per_node=1", str(SCRIPTS / "fsdp2_loop.py")], device="cuda")
    two = trace_script(["torchrun", "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "fsdp2_loop.py")],
                       device="cuda")
    terms_one = {term.name: term.num_bytes for term in one.terms}
    terms_two = {term.name: term.num_bytes for term in two.terms}
    assert terms_one["parameters"] == 4 * _llama_numel() == 2 * terms_two["parameters"]
    assert terms_two["optimizer"] - terms_two["parameters"] * 2 == terms_one["optimizer"] - terms_one["parameters"] * 2
    assert any("fake process group of 2 ranks" in note for note in two.notes)


def test_cli_traces_a_script_after_the_double_dash():
    result = CliRunner().invoke(app, ["trace", "--gpu", "A100-80GB", "--json", "--", *_script("plain_loop.py")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    direct = trace_script(_script("plain_loop.py"), device="cuda")
    assert data["gpu"] == "A100-80GB"
    tensors = sum(t["bytes"] for t in data["traced"]["terms"] if t["category"] != "overhead")
    assert tensors == direct.tensor_bytes


@pytest.mark.parametrize("args", [["trace", "gpt2", "extra"], ["trace", "gpt2", "--", "python", "x.py"],
                                  ["trace", "-b", "4", "--", "python", "x.py"]])
def test_cli_mistakes_exit_2_with_one_line(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")


def test_loader_workers_load_in_process(tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(16, 16)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = torch.utils.data.DataLoader(torch.randn(8, 16), batch_size=4, num_workers=2, pin_memory=True)\n"
        "for batch in loader:\n"
        "    model(batch).sum().backward()\n"
        "    optimizer.step()\n")
    traced = trace_script(["python", str(script)], steps=2, device="cuda")
    terms = {term.name: term.num_bytes for term in traced.terms}
    assert terms["parameters"] == (16 * 16 + 16) * 4


def test_torch_compile_is_traced_eager_and_said(tmp_path):
    body = ("import sys, torch\n"
            "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))\n"
            "model = torch.compile(model) if 'compile' in sys.argv else model\n"
            "optimizer = torch.optim.AdamW(model.parameters())\n"
            "for _ in range(3):\n"
            "    model(torch.randn(4, 16)).sum().backward()\n"
            "    optimizer.step()\n")
    (tmp_path / "c.py").write_text(body)
    eager = trace_script(["python", str(tmp_path / "c.py")], device="cpu")
    compiled = trace_script(["python", str(tmp_path / "c.py"), "compile"], device="cpu")
    assert compiled.tensor_bytes == eager.tensor_bytes
    assert any("torch.compile was called 1 time" in note for note in compiled.notes)
