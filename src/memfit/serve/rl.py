"""The page's RL phase bars (issue 23), with no web framework: `memfit rl`'s arguments parsed by that command's own
options (click's make_context on the real command: the same parsers and one-line errors), the recipe built as the
command builds it (memfit.rl.rl_inputs), and the answer: the `memfit rl --json` estimate, one bar per phase
(stacked by category, never summed across phases) as plotly's JSON, and the equivalent command line.

Like the plan page it answers catalog models only and reads no file (`--config` is refused)."""

from __future__ import annotations

import functools
import shlex
from collections.abc import Sequence

from ..errors import MemfitError
from ..rl import estimate_rl, rl_inputs
from .core import InputError, _catalog_model, _catalog_spec, _one_line

REFUSED = {"--config": "the page reads no files: run `memfit rl --config FILE` itself",
           "--plan": None, "--max": None, "--fewest-gpus": None, "--json": None, "--verbose": None, "-v": None}
"""Options the phase bars do not take (None: an output or solver option of the command line, ignored)."""
MAX_ARGS = 80
CATEGORY_COLOURS = {"parameters": "#4C78A8", "optimizer": "#F58518", "gradients": "#E45756", "activations": "#72B7B2",
                    "temporaries": "#54A24B", "overhead": "#B279A2"}


@functools.lru_cache(maxsize=1)
def _command():
    """`memfit rl` as a click command of its own (typer builds it from the same function and annotations as the
    CLI's; the CLI's app is not imported, so the page and the CLI do not import each other)."""
    import typer
    import typer.main

    from ..cli.rl import rl_command

    one = typer.Typer()
    one.command("rl")(rl_command)
    return typer.main.get_command(one)


def _parse(argv: Sequence[str]) -> dict:
    from ..cli.common import CommandLineError

    if len(argv) > MAX_ARGS:
        raise InputError(f"more than {MAX_ARGS} arguments")
    kept = []
    for word in argv:
        if not isinstance(word, str):
            raise InputError("the arguments are strings, as on the command line")
        flag = word.split("=", 1)[0]
        if flag in REFUSED and REFUSED[flag]:
            raise InputError(REFUSED[flag], field=flag.lstrip("-"))
        kept.append(word)
    try:
        with _command().make_context("rl", list(kept)) as ctx:
            return dict(ctx.params)
    except CommandLineError as error:
        param = getattr(error, "param", None)
        raise InputError(_one_line(error.format_message()), field=getattr(param, "name", None)) from None


def phase_figure(result) -> dict:
    """One stacked bar per phase (GiB by category), the GPU's memory as a line: plotly's {data, layout}."""
    gib = float(1 << 30)
    names = [p.name + (" (peak)" if p is result.peak else "") for p in result.phases]
    data = []
    for category, colour in CATEGORY_COLOURS.items():
        values = [p.by_category().get(category, 0) / gib for p in result.phases]
        if any(values):
            data.append({"type": "bar", "name": category, "x": names, "y": [round(v, 3) for v in values],
                         "marker": {"color": colour}, "hovertemplate": "%{y:.2f} GiB<extra>" + category + "</extra>"})
    layout = {"barmode": "stack", "title": {"text": f"{result.model} · {result.setup.trainer.upper()} · {result.gpu}"},
              "yaxis": {"title": {"text": "GiB per GPU"}}, "xaxis": {"title": {"text": "phase"}},
              "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": result.gpu_memory_bytes / gib,
                          "y1": result.gpu_memory_bytes / gib, "line": {"color": "#333", "dash": "dash"}}],
              "annotations": [{"xref": "paper", "x": 1, "y": result.gpu_memory_bytes / gib, "xanchor": "right",
                               "yanchor": "bottom", "showarrow": False,
                               "text": f"{result.gpu} {result.gpu_memory_bytes / gib:.1f} GiB"}]}
    return {"data": data, "layout": layout}


def rl_for(argv: Sequence[str]) -> dict:
    """{"command": the `memfit rl` line, "estimate": what it prints with --json, "figure": the phase bars}.
    A mistake in the arguments raises InputError with the command line's own line."""
    params = _parse(argv)
    if params.get("model") is None:
        raise InputError("give a model (a catalog name, see `memfit models`)", field="model")
    _catalog_model(params["model"])
    wanted = {k: v for k, v in params.items() if k not in ("plan", "max_field", "fewest_gpus", "json_output",
                                                           "verbose", "config")}
    try:
        inputs = rl_inputs(**wanted, resolve=_catalog_spec)
        result = estimate_rl(inputs.spec, inputs.rl, inputs.hardware, margin=inputs.margin)
    except MemfitError as error:
        raise InputError(_one_line(str(error))) from None
    return {"command": shlex.join(["memfit", "rl", *argv]), "estimate": result.to_dict(),
            "figure": phase_figure(result)}
