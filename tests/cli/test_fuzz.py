"""bench/fuzz.py, short and seeded: a couple hundred random command lines over every command (valid and invalid
values mixed) give no traceback, valid JSON under --json and exit codes in {0, 1, 2}; and the fuzzer itself does
report a traceback, malformed JSON and a wrong error output when a command produces one."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import load_bench  # noqa: E402


fuzz = load_bench("fuzz")


def test_seeded_fuzz_finds_no_traceback_bad_json_or_exit_code():
    report = fuzz.run(300, seed=2024)
    text = fuzz.format_report(report, seed=2024, heavy=False)
    assert report.cases == 300
    assert not report.tracebacks, text
    assert not report.bad_json, text
    assert not report.bad_exit and set(report.exit_codes) <= {0, 1, 2}, text
    assert not report.bad_error_output, text
    # The run is not all errors: answers, plans that do not fit and user mistakes all occur, on every command.
    assert report.exit_codes[0] >= 40 and report.exit_codes[1] >= 1 and report.exit_codes[2] >= 40, text
    assert set(report.by_command) == {"plan", "estimate", "models", "gpus", "launch", "fit", "trace", "measure"}, text


def test_cases_are_reproducible_from_the_seed(tmp_path):
    import random

    ws = fuzz.Workspace.create(tmp_path)

    def cases(seed: int) -> list[list[str]]:
        ws.emit_count = 0
        rng = random.Random(seed)
        return [fuzz.make_case(rng, ws) for _ in range(100)]

    assert cases(6) == cases(6) != cases(7)


def test_the_fuzzer_reports_what_it_is_there_to_find(monkeypatch):
    """A traceback (grouped by type and memfit frame), stdout that is not JSON under --json, and a user error
    that is not one line are each counted: the zero counts above are a real check."""
    import memfit.cli.app
    import memfit.cli.common
    import memfit.sources

    def broken_resolve(ref, **kwargs):
        raise OSError(36, "File name too long")

    monkeypatch.setattr(memfit.sources, "resolve_model", broken_resolve)
    monkeypatch.setattr(memfit.cli.app, "print_json", lambda data: print("{not json"))
    real_report = memfit.cli.common.report_error

    def two_lines(message, hint=""):
        print("first line", file=sys.stderr)
        return real_report(message, hint)

    monkeypatch.setattr(memfit.cli.common, "report_error", two_lines)
    report = fuzz.run(60, seed=3)
    # grouped under the innermost memfit frame (the patched function lives in this test file; the CLI resolves the
    # model in SetupOptions.resolve)
    assert any(key.startswith("OSError at memfit/cli/options.py:") and key.endswith(" in resolve")
               for key in report.tracebacks), report.tracebacks
    assert report.bad_json and report.bad_error_output
    assert report.problems > 0
    assert "tracebacks: " in fuzz.format_report(report, seed=3, heavy=False)


@pytest.mark.parametrize("args", [["plan", "a" * 300], ["plan", "./" + "a" * 300], ["estimate", "a/" * 200],
                                  ["plan", "llama\x00-7b"], ["plan", "~nosuchuser/config.json"],
                                  ["trace", "b" * 300], ["measure", "c" * 300, "--device", "cpu"]])
def test_unreadable_model_names_are_one_error_line(args):
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner(env=fuzz.ENV).invoke(app, args)
    assert result.exit_code == 2, (result.exception, result.output)
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
    assert len(result.stderr) < 300  # the name is shortened, not echoed whole
