"""The memfit command line: what it prints, that it fits 80 columns, that --json carries the library's numbers, and
that every user mistake is one `error:` line with exit code 2 (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.hardware import get_gpu, gpu_catalog, make_hardware
from memfit.plan import plan
from memfit.sources import catalog_names, resolve_model
from memfit.setup import TrainingSetup

NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
TINY_CONFIG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 1000,
               "max_position_embeddings": 512}


def invoke(*args: str):
    return CliRunner(env=NARROW).invoke(app, list(args))


def ok(*args: str):
    result = invoke(*args)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def widest_line(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def bytes_fields(node, path=""):
    """Every (path, value) whose key ends in 'bytes' anywhere in a JSON document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "bytes" or key.endswith("_bytes"):
                yield f"{path}.{key}", value
            yield from bytes_fields(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from bytes_fields(value, f"{path}[{i}]")


def test_plan_prints_header_breakdown_diagnosis_and_ladder():
    out = ok("plan", "llama-3.1-8b", "--gpu", "A100-80GB").stdout
    expected = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), make_hardware("A100-80GB"))
    assert "llama-3.1-8b" in out and "A100-80GB" in out and "79.15 GiB usable" in out
    assert "assumed: micro-batch 8, seq 2048" in out
    assert f"{expected.initial_estimate.total_bytes / 2**30:.2f}" in out  # the breakdown's total, in GiB
    assert "diagnosis" in out and "the bottleneck is" in out
    assert "Ladder" in out and "Verdict" in out
    assert expected.steps, "llama-3.1-8b at micro-batch 8 should not fit an A100 as given"
    for step in expected.steps:
        assert step.title in out
        assert f"{step.estimate.total_bytes / 2**30:.2f}" in out
    assert "TrainingArguments(" in out
    assert " GB" not in out.replace("80 GB HBM2e", "")  # binary sizes are labelled GiB


def test_plan_default_seq_is_clamped_to_the_model_and_says_so():
    data = json.loads(ok("plan", "gpt2", "--json").stdout)
    setup = data["initial_setup"]
    assert setup["seq_len"] == 1024 and setup["micro_batch_size"] == 8
    assert any("clamped" in note for note in setup["notes"])
    assert any(note.startswith("assumed:") for note in setup["notes"])
    given = json.loads(ok("plan", "gpt2", "-s", "512", "-b", "2", "--json").stdout)["initial_setup"]
    assert given["seq_len"] == 512 and not any("seq" in n for n in given["notes"])


@pytest.mark.parametrize("args", [
    ("plan", "llama-3.1-8b"),
    ("plan", "llama-3.1-8b", "--verbose", "--optimize"),
    ("plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8"),
    ("plan", "llama-2-70b", "--gpu", "T4"),
    ("estimate", "llama-3.1-8b", "-v"),
    ("models",), ("gpus",), ("gpus", "--verbose"),
    ("--help",), ("plan", "--help"), ("estimate", "--help"), ("models", "--help"), ("gpus", "--help"),
])
def test_every_line_fits_80_columns(args):
    out = ok(*args).stdout
    assert out.strip() and widest_line(out) <= 80, max(out.splitlines(), key=len)


def test_json_is_only_json_with_integer_bytes_that_add_up():
    result = ok("plan", "llama-3.1-8b", "--json")
    data = json.loads(result.stdout)
    assert result.stderr == ""
    found = list(bytes_fields(data))
    assert len(found) > 20 and all(type(v) is int for _, v in found), [p for p, v in found if type(v) is not int]
    estimates = [data["initial_estimate"]] + [step["estimate"] for step in data["steps"]]
    for est in estimates:
        assert sum(term["bytes"] for term in est["terms"]) == est["total_bytes"]
    expected = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), make_hardware("A100-80GB"))
    assert data["initial_estimate"]["total_bytes"] == expected.initial_estimate.total_bytes
    assert [s["technique"] for s in data["steps"]] == [s.technique for s in expected.steps]
    assert "optimized" not in data


def test_optimize_shows_the_throughput_optimal_setup():
    out = ok("plan", "llama-3.1-8b", "--optimize").stdout
    assert "Throughput-optimal setup" in out
    data = json.loads(ok("plan", "llama-3.1-8b", "--optimize", "--json").stdout)
    optimized = data["optimized"]
    assert optimized is not None and isinstance(optimized["total_bytes"], int)
    assert optimized["total_bytes"] <= data["final_diagnosis"]["budget_bytes"]
    for line in optimized["differences"]:
        assert line.split(":")[0] in out


def test_estimate_prints_breakdown_and_diagnosis():
    out = ok("estimate", "mistral-7b", "--gpu", "24GiB", "-b", "1", "--checkpointing", "full").stdout
    assert "Peak memory per GPU" in out and "diagnosis" in out and "Ladder" not in out
    data = json.loads(ok("estimate", "mistral-7b", "--gpu", "24GiB", "-b", "1", "--json").stdout)
    assert data["gpu_memory_bytes"] == 24 * 2**30
    assert sum(t["bytes"] for t in data["estimate"]["terms"]) == data["estimate"]["total_bytes"]
    assert data["diagnosis"]["required_bytes"] == data["estimate"]["total_bytes"]


def test_models_lists_the_whole_catalog():
    out = ok("models").stdout
    for name in catalog_names():
        assert name in out
    data = json.loads(ok("models", "--json").stdout)
    assert [m["name"] for m in data["models"]] == catalog_names()


def test_gpus_lists_the_whole_catalog():
    out = ok("gpus").stdout
    for name, gpu in gpu_catalog().items():
        assert name in out and f"{gpu.memory_bytes / 2**30:.2f}" in out
    data = json.loads(ok("gpus", "--json").stdout)
    assert {g["name"]: g["memory_bytes"] for g in data["gpus"]} == {n: g.memory_bytes for n, g in gpu_catalog().items()}


def test_multi_gpu_sets_num_gpus_and_zero_is_honoured():
    data = json.loads(ok("plan", "llama-3.1-8b", "--gpus", "4", "--nodes", "2", "--zero", "zero3", "--json").stdout)
    assert data["world_size"] == 8
    assert data["initial_setup"]["num_gpus"] == 8 and data["initial_setup"]["sharding"] == "zero3"


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_unknown_model_suggests_close_names():
    line = one_error_line(invoke("plan", "llama-3.1-8x"))
    assert "Did you mean" in line and "llama-3.1-8b" in line


@pytest.mark.parametrize("args, says", [
    (("plan", "llama-3.1-8b", "--batch", "0"), "--batch"),
    (("plan", "llama-3.1-8b", "--batch", "abc"), "not a whole number"),
    (("plan", "llama-3.1-8b", "-b", "-4"), "--batch"),
    (("plan", "llama-3.1-8b", "--seq", "1.5"), "--seq"),
    (("plan", "llama-3.1-8b", "--gpu", "nonsense"), "unknown gpu"),
    (("plan", "llama-3.1-8b", "--gpu", "0GiB"), "positive"),
    (("plan", "llama-3.1-8b", "--cpu-ram", "lots"), "--cpu-ram"),
    (("plan", "llama-3.1-8b", "--margin", "nan"), "--margin"),
    (("plan", "llama-3.1-8b", "--precision", "fp7"), "amp-bf16"),
    (("plan", "llama-3.1-8b", "--zero", "zero3"), "at least 2"),
    (("plan", "llama-3.1-8b", "--offload", "optimizer+params"), "zero3"),
    (("estimate", "llama-3.1-8b", "--no-such-option"), "No such option"),
    (("plan",), "Missing argument"),
    (("frobnicate",), "No such command"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, says):
    assert says in one_error_line(invoke(*args))


def test_malformed_config_json_is_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    assert "config.json" in one_error_line(invoke("plan", str(bad)))
    bad.write_text(json.dumps({"model_type": "llama"}))
    assert "missing" in one_error_line(invoke("estimate", str(tmp_path)))


def test_local_config_json_and_its_folder_work(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    for ref in (str(tmp_path / "config.json"), str(tmp_path)):
        data = json.loads(ok("plan", ref, "--gpu", "16GiB", "--json").stdout)
        assert data["fits"] and data["initial_setup"]["seq_len"] == 512  # clamped to max_position_embeddings
    assert "fits" in ok("plan", str(tmp_path), "--gpu", "16GiB").stdout


def test_emit_writes_engine_files(tmp_path):
    out_dir = tmp_path / "configs"
    out = ok("plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8", "--emit", str(out_dir)).stdout
    assert (out_dir / "training_args.json").is_file() and (out_dir / "deepspeed.json").is_file()
    assert json.loads((out_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] >= 1
    assert "Written" in out
    data = json.loads(ok("plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8", "--emit", str(out_dir),
                         "--json").stdout)
    assert all(Path(p).is_file() for p in data["emitted"])
    (out_dir / "training_args.json").write_text("{}\n")  # the user's edit is never overwritten silently
    assert "not written by memfit" in one_error_line(invoke("plan", "llama-3.1-8b", "--emit", str(out_dir)))


# --- the installed console script, in real processes --------------------------------------------------------------

def memfit_exe() -> str:
    exe = Path(sys.executable).with_name("memfit")
    if not exe.exists():
        pytest.skip("the memfit console script is not installed next to this interpreter")
    return str(exe)


def run_memfit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **NARROW}
    return subprocess.run([memfit_exe(), *args], capture_output=True, text=True, env=env, timeout=60)


def test_console_script_plans_llama_70b_in_80_columns():
    # Speed is shown by bench/speed.py (ratios against Python's start-up), not asserted here: a loaded CI core
    # would make a wall-clock assertion flaky.
    proc = run_memfit("plan", "llama-2-70b", "--gpu", "H100")
    assert proc.returncode == 0, proc.stderr
    assert "Verdict" in proc.stdout and widest_line(proc.stdout) <= 80


def test_console_script_error_is_one_line_without_traceback():
    proc = run_memfit("plan", "llama-3.1-8x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_console_script_json_parses():
    proc = run_memfit("estimate", "gpt2", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["model"] == "gpt2"


def test_cli_import_stays_light():
    code = ("import sys, memfit.cli, memfit.cli.app; heavy = [m for m in ('torch', 'transformers', 'plotly') "
            "if m in sys.modules]; print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# --- any option values: an answer or one error line, never a traceback -------------------------------------------

def _values(valid: list[str]) -> st.SearchStrategy[str]:
    junk = st.sampled_from(["0", "-1", "abc", "1.5", "nan", "inf", "", " ", "1e3", "99999999999", "0x10", "--"])
    good = st.sampled_from(valid)
    return st.one_of(good, good, good, good, junk, st.text(max_size=6))  # mostly valid, so plans run too


OPTION_VALUES = {
    "--gpu": _values(["A100-80GB", "H100", "T4", "24GiB", "512MiB", "0.5TB"]),
    "--gpus": _values(["1", "2", "8"]),
    "--nodes": _values(["1", "2"]),
    "--cpu-ram": _values(["64GiB", "1TiB"]),
    "--margin": _values(["0", "0.05", "0.3"]),
    "--batch": _values(["1", "3", "8", "12"]),
    "--seq": _values(["128", "1000", "4096"]),
    "--accum": _values(["1", "4"]),
    "--precision": _values(["fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master", "fp16"]),
    "--optimizer": _values(["adamw", "adamw-foreach", "adamw-fused", "adamw-8bit", "sgd", "adafactor"]),
    "--checkpointing": _values(["none", "full"]),
    "--attention": _values(["eager", "sdpa"]),
    "--zero": _values(["none", "zero1", "zero2", "zero3"]),
    "--offload": _values(["none", "optimizer", "optimizer+params"]),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(["plan", "estimate"]),
       model=st.sampled_from(["gpt2", "llama-3.1-8b", "qwen2.5-7b", "bert-base-uncased", "llama-3.1-8x"]),
       options=st.dictionaries(st.sampled_from(sorted(OPTION_VALUES)), st.just(None), max_size=5).flatmap(
           lambda keys: st.fixed_dictionaries({k: OPTION_VALUES[k] for k in keys})),
       json_output=st.booleans())
def test_any_options_give_an_answer_or_one_error_line(command, model, options, json_output):
    args = [command, model] + [part for key, value in options.items() for part in (key, value)]
    result = invoke(*args, *(["--json"] if json_output else []))
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), (args, result.stderr)
    elif json_output:
        json.loads(result.stdout)
    else:
        assert widest_line(result.stdout) <= 80
