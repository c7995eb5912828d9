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


COMMAND_LABEL = "(one line, paste it whole):"


def widest_prose_line(text: str) -> int:
    """The widest line that is not a command printed for copying (those run past the width, never wrapped)."""
    lines = text.splitlines()
    prose = [line for i, line in enumerate(lines) if not (i and lines[i - 1].endswith(COMMAND_LABEL))]
    return max((len(line) for line in prose), default=0)


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
    result = invoke(*args)
    assert result.exit_code in ((0, 1) if args[0] == "plan" else (0,)), (result.output, result.exception)
    out = result.stdout  # every line but a command printed for copying, which is never wrapped
    assert out.strip() and widest_prose_line(out) <= 80, max(out.splitlines(), key=len)


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
    (("plan", "llama-3.1-8b", "--zero", "zero3", "--engine", "torch"), "at least 2"),  # DeepSpeed runs it on one GPU
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


@pytest.mark.processes
def test_console_script_plans_llama_70b_in_80_columns():
    # Speed is shown by bench/speed.py (ratios against Python's start-up), not asserted here: a loaded CI core
    # would make a wall-clock assertion flaky.
    proc = run_memfit("plan", "llama-2-70b", "--gpu", "H100")
    assert proc.returncode in (0, 1), proc.stderr  # 1: the plan does not fit on one H100
    assert "Verdict" in proc.stdout and widest_prose_line(proc.stdout) <= 80


@pytest.mark.processes
def test_console_script_error_is_one_line_without_traceback():
    proc = run_memfit("plan", "llama-3.1-8x")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


@pytest.mark.processes
def test_console_script_json_parses():
    proc = run_memfit("estimate", "gpt2", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["model"] == "gpt2"


@pytest.mark.processes
def test_cli_import_stays_light():
    code = ("import sys, memfit.cli, memfit.cli.app, memfit.cli.common; "
            "heavy = [m for m in ('torch', 'transformers', 'plotly', 'rich') if m in sys.modules]; print(heavy)")
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
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output, result.exception)
    assert result.exit_code != 1 or command == "plan"  # 1 is a plan that does not fit, nothing else
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), (args, result.stderr)
    elif json_output:
        data = json.loads(result.stdout)
        assert command != "plan" or data["fits"] == (result.exit_code == 0)
    else:
        assert widest_prose_line(result.stdout) <= 80


# --- exit codes, emitted files, the one JSON document -------------------------------------------------------------

NO_FIT = ("plan", "llama-3.1-70b", "--gpu", "T4")
NO_FIT_SHARDED = ("plan", "llama-3.1-70b", "--gpu", "T4", "--gpus", "2", "--zero", "zero3")


def test_a_plan_that_does_not_fit_exits_1_with_its_report_or_json():
    result = invoke(*NO_FIT)
    assert result.exit_code == 1 and "nothing on the ladder makes it fit" in result.stdout and result.stderr == ""
    result = invoke(*NO_FIT, "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["fits"] is False and result.stderr == ""
    assert invoke("plan", "llama-3.1-8b", "--json").exit_code == 0
    assert invoke("estimate", "llama-3.1-70b", "--gpu", "T4").exit_code == 0  # a diagnosis, not a plan


def test_emit_for_a_plan_that_does_not_fit_marks_the_files_and_exits_1(tmp_path):
    out_dir = tmp_path / "configs"
    result = invoke(*NO_FIT_SHARDED, "--emit", str(out_dir))
    assert result.exit_code == 1, (result.output, result.exception)
    files = {p.name: p.read_text() for p in out_dir.iterdir() if p.name != ".memfit-emit.json"}
    assert {"training_args.json", "model_kwargs.json", "deepspeed.json", "README.md"} <= set(files)
    for name, text in files.items():
        if name.endswith((".yaml", ".py")):
            assert text.startswith("# WARNING: memfit plan: does not fit"), name
    assert files["README.md"].startswith("> **WARNING: memfit plan: does not fit")
    assert json.loads(files["deepspeed.json"])["_memfit_warning"].startswith("memfit plan: does not fit")
    for name in ("training_args.json", "model_kwargs.json"):
        assert "_memfit_warning" not in json.loads(files[name])
        assert f"`{name}`" in files["README.md"].split("| File |")[0]  # named in the warning part
    out = " ".join(result.stdout.split())
    assert "DOES NOT FIT" in out and "training_args.json (TrainingArguments(**kwargs) refuses unknown keys)" in out
    data = json.loads(invoke(*NO_FIT_SHARDED, "--emit", str(out_dir), "--json").stdout)
    assert data["fits"] is False and data["emitted_warning"].startswith("memfit plan: does not fit")


def _plan_inputs(*options: str):
    """The library's plan for the same model and options the CLI is given (parsed by the same option parsers)."""
    from memfit.cli.options import SetupOptions, gpu, whole_number

    values = dict(zip(options[::2], options[1::2]))
    opts = SetupOptions(gpu=gpu(values["--gpu"]) if "--gpu" in values else None,
                        gpus=whole_number(1024)(values["--gpus"]) if "--gpus" in values else None)
    spec = resolve_model("llama-3.1-8b")
    hardware = opts.hardware()
    return spec, opts.setup(spec, hardware), hardware, {"explicit": opts.explicit, "keep": opts.keep}


def test_optimize_emit_writes_the_optimized_setup_and_says_so(tmp_path):
    from memfit import emit
    from memfit.plan import optimize

    out_dir = tmp_path / "configs"
    result = ok("plan", "llama-3.1-8b", "--gpus", "8", "--optimize", "--emit", str(out_dir))
    spec, setup, hardware, asked = _plan_inputs("--gpus", "8")
    ladder = plan(spec, setup, hardware, **asked)
    choice = optimize(spec, setup, hardware, reference=ladder.final_setup, **asked)
    assert choice.setup != ladder.final_setup  # otherwise this test could not tell them apart
    written = json.loads((out_dir / "training_args.json").read_text())
    assert written == emit.hf_trainer_kwargs(choice.setup, deepspeed_path=emit.config_path(out_dir, "deepspeed.json"))
    assert written != emit.hf_trainer_kwargs(ladder.final_setup,
                                             deepspeed_path=emit.config_path(out_dir, "deepspeed.json"))
    assert "these files hold the --optimize setup" in " ".join(result.stdout.split())
    data = json.loads(ok("plan", "llama-3.1-8b", "--gpus", "8", "--optimize", "--emit", str(out_dir), "--json").stdout)
    assert data["emitted_setup"] == "optimized"
    assert data["launch"]["setup"]["micro_batch_size"] == choice.setup.micro_batch_size
    plain = json.loads(ok("plan", "llama-3.1-8b", "--gpus", "8", "--emit", str(tmp_path / "b"), "--json").stdout)
    assert plain["emitted_setup"] == "final"


@pytest.mark.parametrize("options", [(), ("--gpus", "8"), ("--gpu", "T4")])
def test_json_is_exactly_plan_json(options, tmp_path):
    from memfit.emit import config_path
    from memfit.plan import optimize
    from memfit.plan_output import NOT_SEARCHED, plan_json

    spec, setup, hardware, asked = _plan_inputs(*options)
    ladder = plan(spec, setup, hardware, **asked)
    for extra in ((), ("--optimize",), ("--optimize", "--emit", str(tmp_path / "out"))):
        result = invoke("plan", "llama-3.1-8b", *options, *extra, "--json")
        assert result.exit_code in (0, 1), (result.output, result.exception)
        choice = optimize(spec, setup, hardware, reference=ladder.final_setup, **asked) if extra else NOT_SEARCHED
        emitted = json.loads(result.stdout).get("emitted")  # the paths come from the run
        setup_file = next((config_path(tmp_path / "out", "memfit_setup.json") for path in emitted or ()
                           if path.endswith("memfit_setup.json")), None)  # the launch commands name it
        expected = plan_json(ladder, optimized=choice, emitted=emitted,
                             emitted_setup="optimized" if choice not in (None, NOT_SEARCHED) else "final",
                             emitted_warning=json.loads(result.stdout).get("emitted_warning"), setup_file=setup_file)
        assert json.loads(result.stdout) == json.loads(json.dumps(expected)), extra
        assert ("emitted" in expected) == ("--emit" in extra) and ("optimized" in expected) == bool(extra)


def test_plan_json_adds_only_the_runs_extras_to_plan_to_dict():
    from memfit.plan_output import plan_json

    ladder = plan(resolve_model("llama-3.1-8b"), TrainingSetup(), make_hardware("A100-80GB"))
    data = plan_json(ladder)
    assert set(data) - set(ladder.to_dict()) == {"launch"} and data["launch"] is None
    assert {k: data[k] for k in ladder.to_dict()} == ladder.to_dict()
    assert plan_json(ladder, optimized=None)["optimized"] is None  # searched, nothing fits
    assert plan_json(ladder, reports=["r.html"])["reports"] == ["r.html"]


# --- copyable commands, report paths, host RAM ---------------------------------------------------------------------

def test_launch_commands_print_whole_on_an_80_column_console():
    args = ("plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8", "--nodes", "2")
    result = ok(*args)  # COLUMNS=80
    lines = [line.strip() for line in result.stdout.splitlines()]
    commands = [c["shell"] for c in json.loads(ok(*args, "--json").stdout)["launch"]["commands"]]
    assert len(commands) == 2
    for command in commands:
        assert command.startswith("MEMFIT_ENGINE=") and " MEMFIT_SETUP_FILE=memfit_setup.json " in command
        assert len(command) > 80
        assert command in lines, command  # on one line, not wrapped mid-token
    assert widest_prose_line(result.stdout) <= 80  # everything else still fits


def test_many_nodes_print_three_commands_and_say_how_the_rest_differ():
    result = ok("plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8", "--nodes", "64", "--zero", "zero3")
    assert result.stdout.count(COMMAND_LABEL) == 3 and "nodes 2 to 62: the same command" in result.stdout


@pytest.mark.parametrize("command", ["plan", "trace"])
@pytest.mark.parametrize("option,name", [("--png", "x.txt"), ("--png", "x"), ("--report", "x.txt"),
                                         ("--report", "x.png")])
def test_report_paths_must_say_their_format(command, option, name, tmp_path):
    target, emit_dir = tmp_path / name, tmp_path / "configs"
    extra = ["--emit", str(emit_dir)] if command == "plan" else []
    line = one_error_line(invoke(command, "gpt2", option, str(target), *extra))
    assert option in line and (".png" in line if option == "--png" else ".html" in line)
    assert not target.exists() and not emit_dir.exists()  # refused before anything is written


def _measure_module():
    import importlib

    return importlib.import_module("memfit.measure")  # `memfit.measure` the attribute is the function


def test_measure_refuses_a_model_larger_than_the_free_host_ram(monkeypatch):
    monkeypatch.setattr(_measure_module(), "available_host_ram", lambda: 2 * 2**30)
    line = one_error_line(invoke("measure", "gpt2", "-b", "1", "-s", "128", "--device", "cpu"))
    assert "needs ~" in line and "GiB of host RAM, 2.0 GiB available" in line and "memfit trace" in line
    line = one_error_line(invoke("measure", "llama-3.1-70b", "-b", "1", "-s", "128", "--device", "cpu"))
    assert "llama-3.1-70b" in line and "host RAM" in line


def test_host_ram_check_and_its_fallbacks(monkeypatch):
    import builtins

    measure = _measure_module()
    spec = resolve_model("gpt2")
    setup = TrainingSetup(micro_batch_size=1, seq_len=128)
    monkeypatch.setattr(measure, "available_host_ram", lambda: 2**50)
    needed = measure.check_host_ram(spec, setup)
    assert 0 < needed < 2**50
    monkeypatch.setattr(measure, "available_host_ram", lambda: needed - 1)
    with pytest.raises(measure.ConfigError, match="host RAM"):
        measure.check_host_ram(spec, setup)
    monkeypatch.setattr(measure, "available_host_ram", lambda: None)  # no reading: no refusal
    assert measure.check_host_ram(spec, setup) == needed
    monkeypatch.undo()
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    available = measure.available_host_ram()  # /proc/meminfo (or sysconf) without psutil
    assert available is None or available > 0


# --- module structure ----------------------------------------------------------------------------------------------

@pytest.mark.processes
def test_cli_modules_do_not_import_app():
    """steps.py and launch.py register on common.app and import nothing from app.py: no cycle."""
    import ast

    cli = Path(__file__).resolve().parents[2] / "src" / "memfit" / "cli"
    for path in cli.glob("*.py"):
        if path.name in ("__init__.py", "app.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module not in ("app", "cli.app"), path.name
                assert node.module is not None or "app" not in {a.name for a in node.names}, path.name
    code = ("import sys, memfit.cli.steps, memfit.cli.launch; print('memfit.cli.app' in sys.modules, "
            "sorted(c.name for c in memfit.cli.common.app.registered_commands))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False ['launch', 'measure', 'trace']", proc.stderr
    assert sorted(c.name for c in app.registered_commands) == ["diffusion", "estimate", "fit", "gpus", "launch",
                                                               "measure", "models", "plan", "rl", "serve", "trace",
                                                               "vlm"]
