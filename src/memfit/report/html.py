"""A self-contained HTML report: plotly.js is inlined, so the file opens offline and sends no request."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from ..atomic import write_text
from ..errors import ConfigError
from ..estimate.result import MemoryEstimate
from ..hardware import Hardware
from ..plan import Plan
from ..units import format_bytes
from .figures import ReportData, report_data

_PLOT_CONFIG = {"displaylogo": False, "responsive": True}
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1200px;padding:1em 2em;
color:#222}
h1{font-size:1.6em;margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}th,td{border:1px solid #ddd;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.num{text-align:right;white-space:nowrap}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.9em}pre{background:#f7f7f7;padding:.8em;
overflow-x:auto;border:1px solid #e4e4e4}.verdict{display:inline-block;padding:.2em .7em;border-radius:4px;
font-weight:600;color:#fff}.fits{background:#2e8b57}.nofit{background:#c0392b}.note{color:#555;font-style:italic}
tr.changed td{background:#fff8e1}.chart{margin:.5em 0}table.plan{width:100%}table.plan td:nth-child(3){width:34%}
td code{white-space:pre-wrap;overflow-wrap:anywhere}
"""


def render_html(obj: Plan | MemoryEstimate, *, trace: MemoryEstimate | None = None,
                hardware: Hardware | None = None, margin: float | None = None) -> str:
    """The report as one HTML document (see write_html)."""
    from plotly.offline import get_plotlyjs

    data = report_data(obj, trace=trace, hardware=hardware, margin=margin)
    title = f"memfit report: {data.title}"
    body = [f"<h1>{escape(title)}</h1>", _verdict(data)]
    body += _breakdown_section(data)
    if data.plan is not None:
        body += _plan_sections(data.plan)
    body += _timeline_section(data) + _modules_section(data) + _terms_section(data)
    if data.plan is not None:
        body += _configs_section(data.plan)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_html(obj: Plan | MemoryEstimate, path: str | Path, *, trace: MemoryEstimate | None = None,
               hardware: Hardware | None = None, margin: float | None = None) -> Path:
    """Write a single-file HTML report for a Plan or a MemoryEstimate (an analytic, traced or measured result).

    `trace`: a traced estimate whose timeline and top modules are shown next to a Plan. `hardware` gives a bare
    MemoryEstimate its capacity line and diagnosis."""
    return write_text(path, render_html(obj, trace=trace, hardware=hardware, margin=margin))  # all or nothing


def render_sweep_html(sweep, *, model: str) -> str:
    """A memfit.solve.Sweep as one offline HTML page: the heat maps, then the same table as Markdown gives."""
    from plotly.offline import get_plotlyjs

    from .figures import sweep_figure

    title = f"memfit fit --sweep: {model}"
    rows = [[str(seq), str(batch)] + [("n/a" if c.gib is None else f"{c.gib:.2f} {'fits' if c.fits else 'no'}")
                                      for c in cells] for seq, batch, cells in sweep.rows()]
    table = _table(["seq", "micro-batch"] + [m.title for m in sweep.methods], rows)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in sweep.notes)
    body = [f"<h1>{escape(title)}</h1>", _chart(sweep_figure(sweep), "sweep"), table, notes]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# ---- sections -----------------------------------------------------------------------------------------------------

def _chart(fig, div_id: str) -> str:
    inner = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOT_CONFIG,
                        default_width="100%", default_height=f"{fig.layout.height or 460}px")
    return f'<div class="chart">{inner}</div>'


def _verdict(data: ReportData) -> str:
    diag = data.columns[-1].diagnosis
    if diag is None:
        total = data.columns[-1].estimate.total_bytes
        return (f"<p>Peak per device: <b>{escape(format_bytes(total))}</b> "
                "<span class=\"note\">(no GPU given: no capacity line or diagnosis)</span></p>")
    css, word = ("fits", "fits") if diag.fits else ("nofit", "does not fit")
    lines = [f'<p><span class="verdict {css}">{word}</span> {escape(diag.summary())}</p>']
    if data.plan is not None and data.plan.steps:
        lines.append(f"<p>Before the plan: {escape(data.plan.initial_diagnosis.summary())}</p>")
    return "\n".join(lines)


def _breakdown_section(data: ReportData) -> list[str]:
    from .figures import breakdown_figure

    what = ("the initial setup and after each step of the plan" if data.plan is not None
            else f"this {data.columns[0].estimate.method} result")
    return ["<h2>Breakdown</h2>",
            f"<p>Memory per device at the peak by category, for {what}. Hover a bar for its terms.</p>",
            _chart(breakdown_figure(data), "memfit-breakdown")]


def _plan_sections(plan: Plan) -> list[str]:
    out = ["<h2>Diagnosis</h2>", _table(["", "needs", "budget", "static", "activations", "bottleneck"],
                                       [_diag_row("initial", plan.initial_diagnosis)]
                                       + ([_diag_row("final", plan.final_diagnosis)] if plan.steps else []))]
    out.append("<h2>Plan</h2>")
    if not plan.steps:
        out.append("<p class=\"note\">No step needed: the initial setup fits.</p>" if plan.fits else
                   "<p class=\"note\">No rung of the ladder applies.</p>")
    else:
        rows, before = [], plan.initial_estimate.total_bytes
        for i, step in enumerate(plan.steps, 1):
            after = step.estimate.total_bytes
            rows.append([str(i), escape(step.title), f"<code>{escape(step.change)}</code>", escape(step.cost),
                         escape(step.why), _num(format_bytes(after)), _num(format_bytes(after - before, signed=True)),
                         escape(step.diagnosis.bottleneck.value)])
            before = after
        headers = ["#", "step", "change", "cost", "why", "needs after", "vs previous", "bottleneck after"]
        out.append(_table(headers, rows, css="plan"))
    if plan.skipped:
        out += ["<h3>Skipped rungs</h3>",
                _table(["technique", "why not"], [[escape(t), escape(r)] for t, r in plan.skipped])]
    if plan.suggestions:
        out += ["<h3>What would make it fit</h3>", _list(plan.suggestions)]
    out += ["<h3>Setup</h3>", _setup_table(plan)]
    return out


def _diag_row(label: str, diag) -> list[str]:
    return [label, _num(format_bytes(diag.required_bytes)), _num(format_bytes(diag.budget_bytes)),
            _num(format_bytes(diag.static_bytes)), _num(format_bytes(diag.activation_bytes)),
            escape(diag.bottleneck.value)]


def _setup_table(plan: Plan) -> str:
    initial, final = plan.initial_setup.to_dict(), plan.final_setup.to_dict()
    rows = []
    for key in initial:
        if key == "notes" and not initial[key] and not final[key]:
            continue
        changed = initial[key] != final[key]
        cells = [escape(key), escape(str(initial[key])), escape(str(final[key]))]
        rows.append((cells, "changed" if changed else ""))
    head = "<tr><th>setting</th><th>initial</th><th>final</th></tr>"
    body = "".join(f'<tr class="{css}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" for cells, css in rows)
    return f"<table>{head}{body}</table>"


def _timeline_section(data: ReportData) -> list[str]:
    from .figures import timeline_figure

    out = ["<h2>Timeline</h2>"]
    if data.has_timeline:
        out += ["<p>Live bytes by category over forward, backward and the optimizer step, from the trace.</p>",
                _chart(timeline_figure(data.trace), "memfit-timeline")]
    else:
        out.append(f"<p class=\"note\" id=\"no-timeline\">{_missing(data, 'a timeline')}</p>")
    return out


def _modules_section(data: ReportData) -> list[str]:
    from .figures import modules_figure

    out = ["<h2>Modules whose activations dominate</h2>"]
    if data.has_modules:
        out.append(_chart(modules_figure(data.trace), "memfit-modules"))
    else:
        out.append(f"<p class=\"note\" id=\"no-modules\">{_missing(data, 'per-module activations')}</p>")
    return out


def _missing(data: ReportData, what: str) -> str:
    if data.trace is None:
        return ("No trace in this report: the timeline and the per-module activations come from a traced step "
                "(<code>memfit trace</code>, or <code>write_html(plan, path, trace=memfit.trace.trace(...))</code>); "
                "the plan's estimates are analytic.")
    return f"This {escape(data.trace.method)} result has no {what}."


def _terms_section(data: ReportData) -> list[str]:
    est = data.columns[-1].estimate
    rows = [[escape(t.name), escape(t.category.value), _num(format_bytes(t.num_bytes)), escape(t.formula),
             escape(t.source)] for t in est.terms]
    rows.append(["<b>total</b>", "", _num(format_bytes(est.total_bytes), bold=True), "", ""])
    out = [f"<h2>Terms ({escape(data.columns[-1].label)})</h2>",
           _table(["term", "category", "bytes", "formula", "source"], rows)]
    if est.notes:
        out += ["<h3>Notes</h3>", _list(est.notes)]
    return out


def _configs_section(plan: Plan) -> list[str]:
    try:
        from .. import emit
    except ImportError:
        return []
    setup = plan.final_setup
    out = ["<h2>Engine configs for the final setup</h2>"]
    makers = [lambda: emit.hf_trainer_file(setup), lambda: emit.hf_model_file(setup, auto_class=plan.spec.auto_class)]
    if emit.uses_deepspeed(setup):
        makers.append(lambda: emit.deepspeed_file(setup))
    else:
        out.append("<p class=\"note\">deepspeed.json: not needed, the plan neither shards nor offloads.</p>")
    for make in makers:
        try:
            out += _emitted(make())
        except ConfigError as error:
            out.append(f"<p class=\"note\">{escape(str(error))}</p>")
    return out


def _emitted(config) -> list[str]:
    out = [f"<h3><code>{escape(config.filename)}</code></h3>"]
    if config.summary:
        out.append(f"<p>{escape(config.summary)}</p>")
    text = json.dumps(config.content, indent=2) if isinstance(config.content, dict) else config.render()
    out.append(f"<pre>{escape(text)}</pre>")
    if config.comments:
        out.append(_table(["setting", "why"], [[f"<code>{escape(k)}</code>", escape(v)]
                                               for k, v in config.comments.items()]))
    if config.notes:
        out.append(_list(config.notes))
    return out


# ---- HTML helpers (every cell is escaped by the caller; these only assemble) ---------------------------------------

def _table(headers: list[str], rows: list[list[str]], *, css: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{css}"><tr>{head}</tr>{body}</table>'


def _num(text: str, *, bold: bool = False) -> str:
    """A right-aligned cell holding `text` (escaped here)."""
    return f'<td class="num">{f"<b>{escape(text)}</b>" if bold else escape(text)}</td>'


def _list(items) -> str:
    return "<ul>" + "".join(f"<li>{escape(item)}</li>" for item in items) + "</ul>"
