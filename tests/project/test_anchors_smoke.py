"""bench/anchors.py cannot rot: one small case through the measurement and every tool adapter, and the table renders.

The full comparison (12 cases, a mid-size Llama) is `python bench/anchors.py`; this runs one step of a tiny Llama.
"""

from __future__ import annotations


import pytest
from bench_scripts import load_bench  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_every_adapter_answers_one_small_case():
    anchors = load_bench("anchors")
    case = anchors.SMOKE_CASE
    measured, seconds = anchors.measure_case(case)
    assert measured > 0 and seconds > 0
    rows = [anchors.run_tool(fn, case, budget_s=0.0, max_repeats=1) for _, fn, _ in anchors.TOOLS]
    assert [row.tool for row in rows] == [name for name, _, _ in anchors.TOOLS]
    optional = {"llm-analysis"}  # its PyPI release cannot be installed next to transformers 5 without --no-deps
    for row in rows:
        assert row.note, row
        if row.tool in optional and row.peak_bytes is None:
            assert row.note.startswith("not installed"), row
            continue
        assert row.peak_bytes is not None and row.peak_bytes > 0, row
        assert row.seconds is not None and row.seconds > 0, row
    by_tool = {row.tool: row for row in rows}
    # The two exact tools see the same fake-tensor step; the analytic model is within its 5% target.
    assert by_tool["memfit traced"].peak_bytes == by_tool["torch MemTracker"].peak_bytes
    assert abs(by_tool["memfit analytic"].error_pct(measured)) < 5.0
    table = anchors.render_case(case, measured, seconds, rows)
    assert all(f"| {row.tool} |" in table for row in rows)
    summary = anchors.render_summary([(case, measured, seconds, rows)])
    assert summary.count("\n") == len(anchors.TOOLS) + 2
