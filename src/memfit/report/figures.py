"""What the report draws, as plain data (shared by the HTML and PNG renderers), and the plotly figures.

plotly is imported inside the figure functions only, so that importing memfit.report stays light.
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass

from ..diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from ..errors import MemfitError, MissingDependencyError
from ..estimate.result import Category, MemoryEstimate, Phase, TimelinePoint
from ..hardware import Hardware, make_hardware
from ..plan import Plan
from ..units import GiB, KiB, MiB, format_bytes

CATEGORY_COLORS: dict[Category, str] = {
    Category.PARAMETERS: "#4c72b0",
    Category.GRADIENTS: "#dd8452",
    Category.OPTIMIZER: "#8172b3",
    Category.ACTIVATIONS: "#55a868",
    Category.TEMPORARIES: "#c4ad3a",
    Category.OVERHEAD: "#8c8c8c",
}
PHASE_COLORS: dict[Phase, str] = {Phase.FORWARD: "#4c9be8", Phase.BACKWARD: "#e8804c", Phase.OPTIMIZER: "#9b6ad6"}
CAPACITY_COLOR, BUDGET_COLOR = "#c0392b", "#e67e22"
TOP_MODULES_SHOWN = 20


@dataclass(frozen=True)
class Column:
    """One stacked bar: the setup before the plan, or the setup after one step of it."""

    label: str
    estimate: MemoryEstimate
    diagnosis: Diagnosis | None


@dataclass(frozen=True)
class ReportData:
    title: str
    columns: tuple[Column, ...]
    plan: Plan | None
    trace: MemoryEstimate | None
    """The estimate whose timeline and top modules are drawn (a traced or measured one), if any."""
    hardware: Hardware | None
    margin: float

    @property
    def capacity_bytes(self) -> int | None:
        return self.hardware.gpu.memory_bytes if self.hardware else None

    @property
    def budget_bytes(self) -> int | None:
        return int(self.hardware.gpu.memory_bytes * (1 - self.margin)) if self.hardware else None

    @property
    def limits_on_scale(self) -> bool:
        """Draw the capacity and budget lines only when they do not squash the bars to slivers (a tiny traced
        model against an 80 GB GPU); otherwise the chart says where they are."""
        top = max(c.estimate.total_bytes for c in self.columns)
        return bool(self.capacity_bytes) and self.capacity_bytes <= 10 * top

    def limits_text(self) -> str:
        return (f"capacity {format_bytes(self.capacity_bytes)}, budget {format_bytes(self.budget_bytes)} "
                f"({self.margin:.0%} margin)")

    @property
    def has_timeline(self) -> bool:
        return bool(self.trace and self.trace.timeline)

    @property
    def has_modules(self) -> bool:
        return bool(self.trace and self.trace.top_modules)


def report_data(obj: Plan | MemoryEstimate, *, trace: MemoryEstimate | None = None,
                hardware: Hardware | None = None, margin: float | None = None) -> ReportData:
    """Gather what to show for a Plan or a MemoryEstimate. A MemoryEstimate gets a capacity line and a diagnosis
    when `hardware` is given or its `device_name` is a GPU of the catalog."""
    if isinstance(obj, Plan):
        margin = obj.margin if margin is None else margin
        columns = [Column("initial", obj.initial_estimate, obj.initial_diagnosis)]
        columns += [Column(f"{i}. {s.title}", s.estimate, s.diagnosis) for i, s in enumerate(obj.steps, 1)]
        world = f"{obj.hardware.world_size} x " if obj.hardware.world_size > 1 else ""
        title = f"{obj.spec.name} on {world}{obj.hardware.gpu.name}"
        return ReportData(title, tuple(columns), obj, trace, hardware or obj.hardware, margin)
    if not isinstance(obj, MemoryEstimate):
        raise TypeError(f"a report is drawn for a memfit Plan or MemoryEstimate, not a {type(obj).__name__}")
    margin = DEFAULT_MARGIN if margin is None else margin
    hardware = hardware or _hardware_named(obj.device_name)
    diag = diagnose(obj, hardware, margin=margin) if hardware else None
    title = " on ".join(part for part in (obj.model_name or "model", hardware.gpu.name if hardware else "") if part)
    column = Column(f"{obj.method} peak", obj, diag)
    return ReportData(title, (column,), None, trace or obj, hardware, margin)


def _hardware_named(name: str) -> Hardware | None:
    if not name:
        return None
    try:
        return make_hardware(name)
    except MemfitError:
        return None


# ---- plain data behind the charts -------------------------------------------------------------------------------

def breakdown_categories(columns: tuple[Column, ...]) -> list[Category]:
    """The categories that hold memory in at least one column, in Category order."""
    totals = [c.estimate.by_category() for c in columns]
    return [cat for cat in Category if any(t[cat] for t in totals)]


def column_range(num_columns: int, min_slots: int = 4) -> tuple[float, float]:
    """x range (in column slots) that centres a few bars instead of stretching one bar across the chart."""
    pad = max(0, min_slots - num_columns) / 2
    return -0.5 - pad, num_columns - 0.5 + pad


def display_unit(max_bytes: int | float) -> tuple[str, int]:
    """('GiB', 2**30) or a smaller binary unit so that the largest value reads well."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if max_bytes >= size:
            return unit, size
    return "B", 1


def terms_text(estimate: MemoryEstimate, category: Category) -> list[str]:
    """'name: size' for each term of `category`, largest first."""
    terms = sorted((t for t in estimate.terms if t.category is category), key=lambda t: -t.num_bytes)
    return [f"{t.name}: {format_bytes(t.num_bytes)}" for t in terms]


def phase_spans(timeline: tuple[TimelinePoint, ...]) -> list[tuple[Phase, int, int]]:
    """(phase, first x, last x) for each run of consecutive points in one phase; a span ends where the next begins."""
    spans: list[tuple[Phase, int, int]] = []
    for point in timeline:
        if spans and spans[-1][0] is point.phase:
            spans[-1] = (point.phase, spans[-1][1], point.index)
        else:
            if spans:
                spans[-1] = (spans[-1][0], spans[-1][1], point.index)
            spans.append((point.phase, point.index, point.index))
    return spans


def timeline_categories(timeline: tuple[TimelinePoint, ...]) -> list[Category]:
    return [cat for cat in Category if any(p.by_category.get(cat, 0) for p in timeline)]


def shown_modules(trace: MemoryEstimate, limit: int = TOP_MODULES_SHOWN) -> list[tuple[str, int]]:
    return sorted(trace.top_modules, key=lambda item: -item[1])[:limit]


def wrap_label(text: str, width: int = 16) -> list[str]:
    return textwrap.wrap(text, width=width) or [text]


# ---- plotly figures ----------------------------------------------------------------------------------------------

def _plotly():
    try:
        import plotly.graph_objects as go
    except ImportError as error:
        raise MissingDependencyError("the HTML report needs plotly: pip install 'memfit[report]'") from error
    return go


def _layout(title: str, **extra) -> dict:
    return dict(title=dict(text=html.escape(title), x=0.01), template="plotly_white", margin=dict(l=70, r=30, t=60),
                legend=dict(orientation="h", y=-0.15), hoverlabel=dict(align="left"), **extra)


def breakdown_figure(data: ReportData):
    """Stacked bars by category for each column, with the capacity and the margin (budget) lines."""
    return _plotly().Figure(breakdown_spec(data))


def breakdown_spec(data: ReportData) -> dict:
    """breakdown_figure as plotly's plain {data, layout} (layout.template by name): what `memfit serve` sends the
    page, built without plotly's per-property validation (most of a page update's time otherwise)."""
    top = max([c.estimate.total_bytes for c in data.columns] + [data.capacity_bytes if data.limits_on_scale else 0])
    unit, size = display_unit(top)
    labels = ["<br>".join(html.escape(part) for part in wrap_label(c.label)) for c in data.columns]
    traces = []
    for cat in breakdown_categories(data.columns):
        values = [c.estimate.by_category()[cat] for c in data.columns]
        hover = [_bar_hover(c, cat, v) for c, v in zip(data.columns, values)]
        traces.append(dict(type="bar", name=cat.value, x=labels, y=[v / size for v in values],
                           marker=dict(color=CATEGORY_COLORS[cat]), hovertext=hover, hoverinfo="text"))
    annotations = [dict(x=label, y=column.estimate.total_bytes / size, text=format_bytes(column.estimate.total_bytes),
                        showarrow=False, yshift=10) for label, column in zip(labels, data.columns)]
    shapes = []
    if data.capacity_bytes and not data.limits_on_scale:
        annotations.append(dict(xref="paper", yref="paper", x=1.0, y=1.0, xanchor="right", showarrow=False,
                                text=f"off the scale: {data.limits_text()}", font=dict(color=CAPACITY_COLOR)))
    elif data.capacity_bytes:
        for num_bytes, color, dash, yanchor, text in (
                (data.capacity_bytes, CAPACITY_COLOR, "solid", "bottom", f"capacity {format_bytes(data.capacity_bytes)}"),
                (data.budget_bytes, BUDGET_COLOR, "dash", "top",
                 f"budget {format_bytes(data.budget_bytes)}<br>({data.margin:.0%} margin)")):
            shape, label = _limit_line(num_bytes / size, color, dash, yanchor, text)
            shapes.append(shape)
            annotations.append(label)
    layout = _layout("Memory per device: breakdown at the peak", barmode="stack", yaxis=dict(title=dict(
        text=f"{unit} per device")), height=520, annotations=annotations, shapes=shapes)
    layout["margin"] = {**layout["margin"], "r": 150}
    layout["xaxis"] = dict(range=list(column_range(len(labels))))
    return {"data": traces, "layout": layout}


def _limit_line(y: float, color: str, dash: str, yanchor: str, text: str) -> tuple[dict, dict]:
    """A horizontal line across the plot (plotly's add_hline shape), labelled in the right margin (clear of the
    bars' own labels)."""
    shape = dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=y, y1=y,
                 line=dict(color=color, dash=dash, width=2))
    label = dict(xref="paper", x=1.005, xanchor="left", y=y, yanchor=yanchor, text=text, showarrow=False,
                 font=dict(color=color), align="left")
    return shape, label


def _bar_hover(column: Column, category: Category, num_bytes: int) -> str:
    head = f"<b>{html.escape(column.label)}</b><br>{category.value}: {format_bytes(num_bytes)}"
    return "<br>".join([head] + [html.escape(line) for line in terms_text(column.estimate, category)])


def timeline_figure(trace: MemoryEstimate):
    """Live bytes by category over the traced step(s), stacked, with the phases shaded and labelled."""
    go = _plotly()
    points = trace.timeline
    unit, size = display_unit(max(p.total for p in points))
    x = [p.index for p in points]
    fig = go.Figure()
    for cat in timeline_categories(points):
        hover = [f"{html.escape(p.label or p.phase.value)}<br>{cat.value}: {format_bytes(p.by_category.get(cat, 0))}"
                 for p in points]
        fig.add_trace(go.Scatter(name=cat.value, x=x, y=[p.by_category.get(cat, 0) / size for p in points],
                                 stackgroup="live", mode="lines", line=dict(width=0.8, color=CATEGORY_COLORS[cat]),
                                 fillcolor=CATEGORY_COLORS[cat], hovertext=hover, hoverinfo="text"))
    for phase, x0, x1 in phase_spans(points):
        fig.add_vrect(x0=x0, x1=x1, fillcolor=PHASE_COLORS[phase], opacity=0.12, layer="below", line_width=0,
                      annotation_text=phase.value, annotation_position="top left")
    peak = max(points, key=lambda p: p.total)
    fig.add_annotation(x=peak.index, y=peak.total / size, text=f"peak {format_bytes(peak.total)} ({peak.phase.value})",
                       showarrow=True, arrowhead=2, ax=-70, ay=-12, xanchor="right")
    fig.update_layout(**_layout("Live memory over the step by category", height=460, xaxis_title="allocation event",
                                yaxis=dict(title=unit, range=[0, 1.15 * peak.total / size])))
    return fig


def modules_figure(trace: MemoryEstimate):
    """Horizontal bars: the modules whose saved activations weigh most, largest at the top."""
    go = _plotly()
    modules = shown_modules(trace)
    unit, size = display_unit(modules[0][1])
    names = [html.escape(name) for name, _ in modules]
    fig = go.Figure(go.Bar(x=[b / size for _, b in modules], y=names, orientation="h",
                           marker_color=CATEGORY_COLORS[Category.ACTIVATIONS],
                           hovertext=[f"{n}: {format_bytes(b)}" for n, (_, b) in zip(names, modules)],
                           hoverinfo="text", name="saved activations"))
    fig.update_layout(**_layout("Modules whose activations dominate (saved for backward)",
                                height=max(260, 80 + 26 * len(modules)), xaxis_title=unit,
                                yaxis=dict(autorange="reversed", automargin=True)))
    return fig


def sweep_figure(sweep):
    """One heat map per method of a memfit.solve.Sweep: micro-batch across, sequence length down, each cell the
    GiB per GPU (its text) coloured by the share of the usable budget it needs (green fits, red does not); a cell
    the method cannot run is blank with its reason on hover."""
    go = _plotly()
    from plotly.subplots import make_subplots

    methods = list(sweep.methods)
    fig = make_subplots(rows=1, cols=len(methods), shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[html.escape(m.title) for m in methods])
    for col, method in enumerate(methods, 1):
        z, text, hover = [], [], []
        for seq in sweep.seqs:
            z_row, t_row, h_row = [], [], []
            for batch in sweep.batches:
                cell = sweep.cell(seq, batch, method.key)
                if cell.total_bytes is None:
                    z_row.append(None)
                    t_row.append("n/a")
                    h_row.append(html.escape(cell.note))
                    continue
                z_row.append(cell.total_bytes / sweep.budget_bytes)
                t_row.append(f"{cell.total_bytes / GiB:.1f}" + ("" if cell.fits else " no"))
                h_row.append(f"seq {seq}, micro-batch {batch}: {cell.total_bytes / GiB:.2f} GiB "
                             f"({'fits' if cell.fits else 'does not fit'})")
            z.append(z_row)
            text.append(t_row)
            hover.append(h_row)
        fig.add_trace(go.Heatmap(
            z=z, x=[str(b) for b in sweep.batches], y=[str(s) for s in sweep.seqs], text=text,
            texttemplate="%{text}", hovertext=hover, hoverinfo="text", zmin=0, zmax=2, zmid=1,
            colorscale=[[0.0, "#1a9850"], [0.45, "#d9ef8b"], [0.5, "#fee08b"], [1.0, "#d73027"]],
            showscale=col == len(methods), colorbar=dict(title="x budget"), name=method.key), row=1, col=col)
        fig.update_xaxes(title_text="micro-batch", type="category", row=1, col=col)
    fig.update_yaxes(title_text="sequence length", type="category", row=1, col=1)
    fig.update_layout(**_layout(sweep.title(), height=140 + 60 * len(sweep.seqs)))
    return fig
