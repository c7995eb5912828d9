"""docs/accuracy.md's table is generated from bench/results: a bench table that moves without the page failing here
would leave the manual quoting stale figures."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import accuracy_page  # noqa: E402


def test_the_page_is_current():
    page = accuracy_page.PAGE.read_text()
    assert accuracy_page.render(page) == page, "run python scripts/accuracy_page.py"


def test_every_source_reads_every_case_row():
    """Each row counts the cases of its bench table: the figures come from the rows, not from a summary line."""
    lora = accuracy_page.errors(accuracy_page.Source("lora_accuracy.md", "error", "", ""))
    measured = [line for line in (ROOT / "bench/results/lora_accuracy.md").read_text().splitlines()
                if line.startswith("| ") and line.rstrip().endswith("% |")]
    assert len(lora) == len(measured) > 100
    for source in accuracy_page.SOURCES:
        assert accuracy_page.errors(source), source.results


def test_table_parsing_on_a_small_page():
    text = "x\n\n| case | error |\n|---|---:|\n| a | +1.50% |\n| b | refused |\n| c | -3.00% |\n"
    [(header, rows)] = accuracy_page.tables(text)
    assert header == ["case", "error"] and [r[1] for r in rows] == ["+1.50%", "refused", "-3.00%"]
