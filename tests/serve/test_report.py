"""memfit.report: the HTML page, checked in a real headless Chromium (offline, no console errors, each chart drawn
with the expected number of bars), and the PNG, checked with PIL.

The browser tests need Debian's chromium (`sudo bash scripts/install_test_browser.sh`). Without it they fail under
CI (CI=true, or MEMFIT_REQUIRE_BROWSER=1) and are skipped with that hint elsewhere."""

from __future__ import annotations

import html
import io
import subprocess
import sys

import pytest

from memfit.diagnose import diagnose
from memfit.estimate.result import Category, MemoryEstimate, Phase, Term, TimelinePoint
from memfit.hardware import make_hardware
from memfit.plan import Plan, plan
from memfit.report import png_size, render_html, write_html, write_png
from memfit.report.figures import CATEGORY_COLORS
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.units import MiB

from browser_check import browser_for

UNIT = 64 * MiB
HOSTILE_MODULE = "</script><img src=x onerror=alert('module')>"
HOSTILE_TERM = "activations/<script>alert('term')</script>&co"


# ---- inputs ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_8b() -> Plan:
    """llama-3.1-8b on one A100-80GB from the default setup: a few ladder steps to a fit."""
    return plan(resolve_model("llama-3.1-8b"), TrainingSetup(), make_hardware("A100-80GB"))


@pytest.fixture(scope="module")
def plan_70b() -> Plan:
    """llama-3.1-70b on one A100-80GB as a full fine-tune (the method pinned: QLoRA would fit): does not fit;
    rungs skipped, suggestions made."""
    return plan(resolve_model("llama-3.1-70b"), TrainingSetup(), make_hardware("A100-80GB"),
                keep=frozenset({"finetune"}))


def synthetic_trace() -> MemoryEstimate:
    """A hand-made traced result of ~22 GiB: twelve timeline points over forward, backward and the optimizer step."""
    phases = [Phase.FORWARD] * 5 + [Phase.BACKWARD] * 5 + [Phase.OPTIMIZER] * 2
    points = []
    for i, phase in enumerate(phases):
        activations = (i + 1) * 40 * UNIT if i < 5 else (10 - i) * 40 * UNIT
        points.append(TimelinePoint(index=10 * i, phase=phase, label=f"moment {i}", by_category={
            Category.PARAMETERS: 100 * UNIT,
            Category.GRADIENTS: 0 if i < 5 else min(i - 4, 4) * 25 * UNIT,
            Category.OPTIMIZER: 200 * UNIT if i >= 10 else 0,
            Category.ACTIVATIONS: activations,
            Category.TEMPORARIES: 30 * UNIT if phase is Phase.BACKWARD else 0}))
    terms = (Term("parameters", Category.PARAMETERS, 100 * UNIT), Term("gradients", Category.GRADIENTS, 25 * UNIT),
             Term("activations", Category.ACTIVATIONS, 150 * UNIT), Term(HOSTILE_TERM, Category.ACTIVATIONS, 50 * UNIT),
             Term("temporaries", Category.TEMPORARIES, 30 * UNIT))
    modules = (("layers.*.mlp", 90 * UNIT), ("layers.*.self_attn", 60 * UNIT), (HOSTILE_MODULE, 30 * UNIT),
               ("lm_head", 12 * UNIT), ("embed_tokens", 4 * UNIT))
    return MemoryEstimate(terms=terms, peak_phase=Phase.FORWARD, method="traced", timeline=tuple(points),
                          top_modules=modules, model_name="synthetic", device_name="A100-80GB")


def nonzero_categories(estimates) -> list[Category]:
    return [c for c in Category if any(e.by_category()[c] for e in estimates)]


def plan_estimates(p: Plan) -> list[MemoryEstimate]:
    return [p.initial_estimate] + [s.estimate for s in p.steps]


# ---- library behaviour (no browser) -----------------------------------------------------------------------------

@pytest.mark.processes
def test_importing_the_report_loads_no_plotting_library():
    code = ("import sys, memfit, memfit.report; "
            "print(sorted(m for m in ('plotly', 'matplotlib', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_html_is_one_offline_file_with_the_plan_as_text(plan_70b):
    page = render_html(plan_70b)
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert page.count("Plotly.newPlot(") == 1  # only the breakdown: no trace given
    assert "No trace in this report" in page
    assert html.escape(plan_70b.final_diagnosis.summary()) in page
    for step in plan_70b.steps:
        assert html.escape(step.cost) in page and html.escape(step.change) in page
    assert plan_70b.skipped and plan_70b.suggestions
    for title, reason in plan_70b.skipped:
        assert f"<td>{html.escape(title)}</td><td>{html.escape(reason)}</td>" in page
    for suggestion in plan_70b.suggestions:
        assert f"<li>{html.escape(suggestion)}</li>" in page


def test_html_shows_the_emitted_configs_of_the_final_setup():
    emit = pytest.importorskip("memfit.emit")
    hw = make_hardware("A100-80GB", gpus_per_node=8)
    p = plan(resolve_model("llama-3.1-70b"), TrainingSetup(num_gpus=8), hw)
    assert emit.uses_deepspeed(p.final_setup), "expected a ZeRO plan"
    page = render_html(p)
    for config in (emit.hf_trainer_file(p.final_setup), emit.deepspeed_file(p.final_setup)):
        assert f"<code>{config.filename}</code>" in page
        assert html.escape(config.render().rstrip("\n")) in page


def test_html_escapes_names_from_the_model(tmp_path):
    page = write_html(synthetic_trace(), tmp_path / "r.html").read_text(encoding="utf-8")
    assert HOSTILE_TERM not in page and html.escape(HOSTILE_TERM) in page
    assert HOSTILE_MODULE not in page  # plotly's JSON writes '<' as \u003c inside <script>


def test_report_refuses_other_objects(tmp_path):
    with pytest.raises(TypeError, match="Plan or MemoryEstimate"):
        write_html({"total": 1}, tmp_path / "x.html")


# ---- PNG ---------------------------------------------------------------------------------------------------------

def color_counts(png: bytes | str, colors: dict) -> dict:
    """How many pixels of each named '#rrggbb' the image holds, and the image's mean channel spread."""
    from PIL import Image, ImageStat

    with Image.open(io.BytesIO(png) if isinstance(png, bytes) else png) as opened:
        image = opened.convert("RGB")
    histogram = dict((rgb, n) for n, rgb in image.getcolors(maxcolors=1 << 24))
    counts = {name: histogram.get(tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)), 0) for name, c in colors.items()}
    counts["_stddev"] = sum(ImageStat.Stat(image).stddev) / 3
    return counts


def assert_painted(png, categories, what: str) -> None:
    counts = color_counts(png, {c.value: CATEGORY_COLORS[c] for c in categories})
    assert counts.pop("_stddev") > 15, f"{what}: the image is (nearly) blank"
    missing = [name for name, n in counts.items() if n < 100]
    assert not missing, f"{what}: no area painted for {missing} ({counts})"


@pytest.mark.parametrize("with_trace", [False, True], ids=["plan", "plan+trace"])
def test_png_of_a_plan(plan_8b, tmp_path, with_trace):
    from PIL import Image

    trace = synthetic_trace() if with_trace else None
    path = write_png(plan_8b, tmp_path / "plan.png", trace=trace)
    panels = 3 if with_trace else 1
    with Image.open(path) as image:
        assert image.size == (1200, 100 + 450 * panels) == png_size(plan_8b, trace=trace)
    assert_painted(str(path), nonzero_categories(plan_estimates(plan_8b)), "plan PNG")


def test_png_of_a_trace_at_another_dpi(tmp_path):
    from PIL import Image

    trace = synthetic_trace()
    path = write_png(trace, tmp_path / "trace.png", dpi=50)
    with Image.open(path) as image:
        assert image.size == (600, 50 + 225 * 3) == png_size(trace, dpi=50)
    assert_painted(str(path), nonzero_categories([trace]), "trace PNG")


# ---- in a real browser ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    yield from browser_for("the report's browser tests")


def open_report(browser, tmp_path, obj, **kwargs):
    path = write_html(obj, tmp_path / "report.html", **kwargs)
    page = browser.open(path)
    assert page.problems == [], "the page did not load cleanly offline"
    assert page.img_count == 0 and page.dialogs == []
    return page


def check_breakdown(page, estimates, num_limit_lines: int) -> None:
    cats = nonzero_categories(estimates)
    plot = page.plots["memfit-breakdown"]
    assert plot["bar_traces"] == plot["legend_items"] == len(cats)
    assert plot["bars"] == len(cats) * len(estimates)  # one bar per category and column, zero-height ones included
    assert plot["bars_drawn"] == sum(1 for e in estimates for c in cats if e.by_category()[c])
    assert plot["shapes"] == num_limit_lines
    assert_painted(page.screenshots["memfit-breakdown"], cats, "breakdown chart")


def check_trace_charts(page, trace: MemoryEstimate) -> None:
    cats = [c for c in Category if any(p.by_category.get(c, 0) for p in trace.timeline)]
    timeline = page.plots["memfit-timeline"]
    num_spans = 1 + sum(1 for a, b in zip(trace.timeline, trace.timeline[1:]) if a.phase is not b.phase)
    assert timeline["scatter_traces"] == timeline["fills"] == len(cats)
    assert timeline["shapes"] == num_spans  # one shaded band per run of a phase
    for phase in {p.phase for p in trace.timeline}:
        assert phase.value in timeline["text"]
    assert_painted(page.screenshots["memfit-timeline"], cats, "timeline chart")
    modules = page.plots["memfit-modules"]
    assert modules["bars"] == modules["bars_drawn"] == min(len(trace.top_modules), 20)
    assert_painted(page.screenshots["memfit-modules"], [Category.ACTIVATIONS], "modules chart")


def test_plan_page_in_browser(browser, tmp_path, plan_8b):
    page = open_report(browser, tmp_path, plan_8b)
    assert set(page.plots) == {"memfit-breakdown"}
    check_breakdown(page, plan_estimates(plan_8b), num_limit_lines=2)  # capacity and budget
    assert "No trace in this report" in page.text
    for step in plan_8b.steps:
        assert step.cost in page.text and step.title in page.text
    assert plan_8b.final_diagnosis.summary() in page.text


def test_trace_page_in_browser(browser, tmp_path):
    trace = synthetic_trace()
    page = open_report(browser, tmp_path, trace)
    assert set(page.plots) == {"memfit-breakdown", "memfit-timeline", "memfit-modules"}
    check_breakdown(page, [trace], num_limit_lines=2)  # device_name A100-80GB gives capacity and budget
    check_trace_charts(page, trace)
    assert HOSTILE_MODULE in page.plots["memfit-modules"]["text"]  # shown as text, never run
    assert HOSTILE_TERM in page.text
    assert diagnose(trace, make_hardware("A100-80GB")).summary() in page.text


def test_plan_with_a_trace_in_browser(browser, tmp_path, plan_8b):
    trace = synthetic_trace()
    page = open_report(browser, tmp_path, plan_8b, trace=trace)
    check_breakdown(page, plan_estimates(plan_8b), num_limit_lines=2)
    check_trace_charts(page, trace)
    assert "No trace in this report" not in page.text


def test_real_trace_of_a_tiny_module_in_browser(browser, tmp_path):
    try:
        import torch
        from torch import nn

        from memfit.trace import trace
    except ImportError as error:
        pytest.skip(f"the tracer is not importable here: {error}")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(32, 64)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
                                        for _ in range(3))
            self.head = nn.Linear(64, 8)

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    setup = TrainingSetup(micro_batch_size=4, seq_len=16)
    traced = trace(Tiny, setup, input_builder=lambda s: torch.randn(s.micro_batch_size, s.seq_len, 32))
    assert traced.timeline and traced.top_modules
    assert {p.phase for p in traced.timeline} == set(Phase)
    page = open_report(browser, tmp_path, traced, hardware=make_hardware("A100-80GB"))
    check_breakdown(page, [traced], num_limit_lines=0)  # ~1 MiB against 80 GB: the lines would flatten the bars
    assert "off the scale: capacity 79.15 GiB" in page.plots["memfit-breakdown"]["text"]
    check_trace_charts(page, traced)
