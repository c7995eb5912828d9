"""A static PNG of the report's charts, drawn with matplotlib's Agg renderer.

matplotlib rather than plotly + kaleido: kaleido 1.x renders through a Chrome it finds or downloads at run time,
so a PNG would need a browser on the user's machine; Agg needs nothing but the wheel, works offline and gives the
same pixels everywhere. The size is fixed by the layout: WIDTH_IN x (HEADER_IN + PANEL_IN x panels) at `dpi`.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import write_files
from ..errors import MissingDependencyError
from ..estimate.result import Category, MemoryEstimate
from ..hardware import Hardware
from ..plan import Plan
from ..units import format_bytes
from .figures import (BUDGET_COLOR, CAPACITY_COLOR, CATEGORY_COLORS, PHASE_COLORS, ReportData, breakdown_categories,
                      column_range, display_unit, phase_spans, report_data, shown_modules, timeline_categories, wrap_label)

WIDTH_IN = 12.0
HEADER_IN = 1.0
PANEL_IN = 4.5


def png_size(obj: Plan | MemoryEstimate, *, trace: MemoryEstimate | None = None, dpi: int = 100) -> tuple[int, int]:
    """(width, height) in pixels of the PNG that write_png draws for these arguments."""
    data = report_data(obj, trace=trace)
    return round(WIDTH_IN * dpi), round(_height_in(data) * dpi)


def write_png(obj: Plan | MemoryEstimate, path: str | Path, *, trace: MemoryEstimate | None = None,
              hardware: Hardware | None = None, margin: float | None = None, dpi: int = 100) -> Path:
    """Write the report's charts as one PNG: the breakdown per plan step against capacity and budget, and, with a
    trace, the timeline over the phases and the modules whose activations dominate."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingDependencyError("the PNG report needs matplotlib: pip install 'memfit[report]'") from error
    data = report_data(obj, trace=trace, hardware=hardware, margin=margin)
    height_in = _height_in(data)
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    for i, draw in enumerate(_panels(data)):
        draw(fig.add_axes(_panel_rect(i, height_in, wide_labels=draw is _draw_modules)), data)
    fig.text(0.01, 1 - 0.12 / height_in, _plain(_headline(data)), ha="left", va="top", fontsize=12)
    if not data.has_timeline:
        fig.text(0.01, 0.1 / height_in, "No trace: the timeline and per-module charts need a traced step "
                 "(memfit trace).", fontsize=9, color="#555", style="italic")
    import io

    image = io.BytesIO()
    fig.savefig(image, dpi=dpi, format="png")
    path = Path(path)
    write_files([(path, image.getvalue())])  # all or nothing
    return path


def _panels(data: ReportData) -> list:
    panels = [_draw_breakdown]
    if data.has_timeline:
        panels.append(_draw_timeline)
    if data.has_modules:
        panels.append(_draw_modules)
    return panels


def _panel_rect(index: int, height_in: float, *, wide_labels: bool) -> list[float]:
    """[left, bottom, width, height] in figure fractions of panel `index` (0 at the top); legends go on the right."""
    top_in = HEADER_IN + PANEL_IN * index + 0.35  # room for the panel's title
    plot_in = PANEL_IN - 1.2  # the rest is tick labels and the axis title below
    left = 0.25 if wide_labels else 0.07
    return [left, 1 - (top_in + plot_in) / height_in, 0.83 - left, plot_in / height_in]


def _height_in(data: ReportData) -> float:
    return HEADER_IN + PANEL_IN * len(_panels(data))


def _headline(data: ReportData) -> str:
    diag = data.columns[-1].diagnosis
    verdict = diag.summary() if diag else f"peak {format_bytes(data.columns[-1].estimate.total_bytes)} per device"
    return f"memfit: {data.title}\n{verdict}"


def _plain(text: str) -> str:
    """matplotlib reads $...$ as math: show dollar signs as they are."""
    return text.replace("$", r"\$")


def _draw_breakdown(ax, data: ReportData) -> None:
    top = max([c.estimate.total_bytes for c in data.columns] + [data.capacity_bytes if data.limits_on_scale else 0])
    unit, size = display_unit(top)
    x = range(len(data.columns))
    bottoms = [0.0] * len(data.columns)
    for cat in breakdown_categories(data.columns):
        values = [c.estimate.by_category()[cat] / size for c in data.columns]
        ax.bar(x, values, bottom=bottoms, color=CATEGORY_COLORS[cat], label=cat.value, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, column in enumerate(data.columns):
        ax.annotate(format_bytes(column.estimate.total_bytes), (i, bottoms[i]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    if data.capacity_bytes and not data.limits_on_scale:
        ax.text(1.0, 1.01, f"off the scale: {data.limits_text()}", transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8, color=CAPACITY_COLOR)
    elif data.capacity_bytes:
        ax.axhline(data.capacity_bytes / size, color=CAPACITY_COLOR, linewidth=1.6,
                   label=f"capacity {format_bytes(data.capacity_bytes)}")
        ax.axhline(data.budget_bytes / size, color=BUDGET_COLOR, linewidth=1.6, linestyle="--",
                   label=f"budget ({data.margin:.0%} margin)")
    ax.set_xlim(*column_range(len(data.columns)))
    ax.set_xticks(list(x), [_plain("\n".join(wrap_label(c.label))) for c in data.columns], fontsize=8)
    ax.set_ylabel(f"{unit} per device")
    ax.set_title("Breakdown at the peak", loc="left", fontsize=10)
    ax.set_ylim(0, max(bottoms + [data.capacity_bytes / size if data.limits_on_scale else 0]) * 1.1)
    _legend(ax)


def _draw_timeline(ax, data: ReportData) -> None:
    points = data.trace.timeline
    unit, size = display_unit(max(p.total for p in points))
    cats = timeline_categories(points)
    x = [p.index for p in points]
    ys = [[p.by_category.get(cat, 0) / size for p in points] for cat in cats]
    ax.stackplot(x, ys, labels=[c.value for c in cats], colors=[CATEGORY_COLORS[c] for c in cats], zorder=2)
    for phase, x0, x1 in phase_spans(points):
        ax.axvspan(x0, x1, color=PHASE_COLORS[phase], alpha=0.15, linewidth=0, zorder=0)
        ax.text(x0, 1.0, phase.value, transform=ax.get_xaxis_transform(), fontsize=7, va="bottom", color="#444")
    ax.set_ylabel(unit)
    ax.set_xlabel("allocation event")
    ax.set_ylim(0, max(p.total for p in points) / size * 1.08)
    ax.set_title("Live memory over the step", loc="left", fontsize=10, pad=14)
    _legend(ax)


def _draw_modules(ax, data: ReportData) -> None:
    modules = shown_modules(data.trace)
    unit, size = display_unit(modules[0][1])
    names = [_plain(name) for name, _ in modules]
    ax.barh(range(len(modules)), [b / size for _, b in modules], color=CATEGORY_COLORS[Category.ACTIVATIONS])
    ax.set_yticks(range(len(modules)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} saved for backward")
    ax.set_title("Modules whose activations dominate", loc="left", fontsize=10)


def _legend(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
