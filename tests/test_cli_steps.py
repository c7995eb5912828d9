"""`memfit trace`, `memfit measure`, `plan --verify` and `--report/--png` on tiny real configs (CPU, offline)."""

import json

import pytest
from typer.testing import CliRunner

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
