"""`memfit trace`, `memfit measure`, `plan --verify` and `--report/--png` on tiny real configs (CPU, offline)."""

import json

import pytest
from typer.testing import CliRunner

from memfit import Optimizer, Precision, TrainingSetup
from memfit.cli.app import app
from tiny_configs import TINY_LLAMA

pytest.importorskip("torch")
RUNNER = CliRunner()
SETUP = ["-b", "2", "-s", "64", "--precision", "fp32", "--optimizer", "adamw", "--gpu", "1GiB"]


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _json(args):
    result = RUNNER.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_trace_matches_analytic_on_tiny_llama(tiny_config):
    data = _json(["trace", tiny_config, *SETUP, "--json"])
    traced, analytic = data["traced"], data["analytic"]
    assert traced["method"] == "traced" and traced["timeline"] and traced["top_modules"]
    assert abs(analytic["tensor_bytes"] - traced["tensor_bytes"]) <= 0.05 * traced["tensor_bytes"]
    assert sum(t["bytes"] for t in traced["terms"]) == traced["total_bytes"]


def test_measure_prints_measured_next_to_analytic(tiny_config):
    data = _json(["measure", tiny_config, *SETUP, "--device", "cpu", "--json"])
    assert data["measured"]["method"] == "measured" and data["device"] == "cpu"
    assert abs(data["error"]) < 0.05
    text = RUNNER.invoke(app, ["measure", tiny_config, *SETUP, "--device", "cpu"], env={"COLUMNS": "80"})
    assert text.exit_code == 0 and "measured" in text.stdout and "analytic" in text.stdout


def test_plan_verify_and_reports(tiny_config, tmp_path):
    html, png = tmp_path / "plan.html", tmp_path / "plan.png"
    data = _json(["plan", tiny_config, *SETUP, "--verify", "--report", str(html), "--png", str(png), "--json"])
    assert abs(data["verified"]["error"]) < 0.05
    assert html.stat().st_size > 100_000 and "plotly" in html.read_text()[:2_000_000]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(data["reports"]) == sorted([str(html), str(png)])


def test_trace_report_files(tiny_config, tmp_path):
    html = tmp_path / "trace.html"
    result = RUNNER.invoke(app, ["trace", tiny_config, *SETUP, "--report", str(html)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert html.exists() and "Side by side" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_step_commands_reject_bad_input_in_one_line(tiny_config):
    for args in (["measure", tiny_config, "--device", "tpu"], ["trace", tiny_config, "--steps", "0"],
                 ["trace", "no-such-model-x"]):
        result = RUNNER.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


# --- quiet stderr, progress, threads -----------------------------------------------------------------------------

@pytest.mark.processes
def test_a_command_that_imports_torch_writes_nothing_on_stderr_unless_verbose(tiny_config):
    """torchao's `.so` load failures, torch's pytree deprecations, transformers' notes and kineto's profiler lines
    stay off stderr (a subprocess: the libraries are imported fresh, as a user's shell does)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    memfit = str(Path(sys.executable).parent / "memfit")
    env = {**os.environ, "COLUMNS": "100"}
    for env_var in ("TRANSFORMERS_VERBOSITY", "KINETO_LOG_LEVEL"):
        env.pop(env_var, None)
    for command in (["trace", tiny_config, *SETUP], ["measure", tiny_config, *SETUP, "--device", "cpu"]):
        done = subprocess.run([memfit, *command], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Peak memory" in done.stdout and done.stderr == "", done.stderr
    verbose = subprocess.run([memfit, "--verbose", "trace", tiny_config, *SETUP], capture_output=True, text=True,
                             env=env, timeout=300)
    assert verbose.returncode == 0 and "Peak memory" in verbose.stdout, verbose.stderr[-2000:]


def test_progress_is_drawn_on_a_terminal_only_and_never_under_json_or_quiet(monkeypatch):
    import io

    from memfit.cli import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    with progress.progress_bar("measuring") as bar:
        assert callable(bar)
        bar("measuring step 1 of 2: forward", 0.25)
    with progress.hidden(True), progress.progress_bar("measuring") as bar:
        assert bar is None
    progress.hide(True)
    try:
        with progress.progress_bar("measuring") as bar:
            assert bar is None
    finally:
        progress.hide(False)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal (a pipe, a CI log)
    with progress.progress_bar("measuring") as bar:
        assert bar is None


def test_measure_reports_building_then_every_phase_of_every_step(torch_cpu):
    from memfit.measure import measure

    setup = TrainingSetup(micro_batch_size=2, seq_len=32, precision=Precision.FP32, optimizer=Optimizer.ADAMW)
    seen = []
    measured = measure(dict(TINY_LLAMA), setup, steps=2, device="cpu",
                       progress=lambda message, fraction: seen.append((message, fraction)))
    messages = [message for message, _ in seen]
    assert messages[0].startswith("building the model")
    assert messages[1:7] == [f"measuring step {s} of 2: {p}" for s in (1, 2) for p in ("forward", "backward",
                                                                                        "optimizer")]
    fractions = [fraction for _, fraction in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert measured.tensor_bytes == measure(dict(TINY_LLAMA), setup, steps=2, device="cpu").tensor_bytes


def test_a_cpu_step_runs_on_a_fixed_thread_count_whatever_the_load_or_the_environment(torch_cpu, monkeypatch):
    from memfit._torch import threads

    assert threads.free_cpus(cpus=2, load=0.3) == 2
    assert threads.free_cpus(cpus=2, load=0.6) == 1  # another process keeps one core busy
    assert threads.free_cpus(cpus=2, load=12.0) == 1  # a loaded shared machine: one thread, never zero
    assert threads.free_cpus(cpus=16, load=3.4) == 13
    torch_cpu.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # per-thread scratch would move the peak: the count is memfit's
    with threads.step_threads() as used:
        assert used == torch_cpu.get_num_threads() == threads.MEASURE_THREADS == 1
    assert torch_cpu.get_num_threads() == 2


@pytest.mark.processes
def test_the_library_reports_progress_through_callbacks_and_never_imports_rich():
    import subprocess
    import sys

    code = ("import sys, memfit, memfit.measure, memfit.derive.cache, memfit.derive.progress, memfit.derive.fit, "
            "memfit.trace.run, memfit._torch.measure_cpu; print('rich' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]
