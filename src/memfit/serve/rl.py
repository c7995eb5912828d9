"""The page's RL phase bars (issue 23), with no web framework: `memfit rl`'s arguments parsed by that command's own
options (click's make_context on the real command: the same parsers and one-line errors), the recipe built as the
command builds it (memfit.rl.rl_inputs), and the answer: the `memfit rl --json` estimate, one bar per phase
(stacked by category, never summed across phases) as plotly's JSON, and the equivalent command line.

Like the plan page it answers catalog models only and reads no file (`--config` is refused). `form_fields` is the
RL section's form, read off the same command's options (flags, choices from their metavars, defaults from their
help), so the page lists no option a third time."""

from __future__ import annotations

import functools
import shlex
from collections.abc import Sequence

from ..errors import MemfitError
from ..rl import estimate_rl, rl_inputs
from .core import InputError, _catalog_model, _catalog_spec, _default_text, _one_line, _suggestions

REFUSED = {"--config": "the page reads no files: run `memfit rl --config FILE` itself",
           "--plan": None, "--max": None, "--fewest-gpus": None, "--json": None, "--verbose": None, "-v": None}
"""Options the phase bars do not take (None: an output or solver option of the command line, ignored)."""
MAX_ARGS = 80
FORM_FIELDS = ("model", "trainer", "gpu", "gpus", "num_generations", "prompt_len", "completion_len", "vllm",
               "vllm_util", "vllm_mode", "lora", "precompute_ref")
"""`memfit rl`'s options the RL section shows as inputs, in the page's order (the rest go in its free-text line):
the trainer, the rollout's shape, the generation backend and its utilization, colocated or not, the reference
(online, precomputed, or a LoRA policy's base) and the GPUs."""
FORM_INITIAL = {"model": "qwen2.5-7b", "trainer": "grpo", "gpu": "H100", "vllm": "--vllm", "vllm_util": "0.3",
                "lora": "--lora"}
"""The section's first recipe: GRPO on a LoRA Qwen2.5-7B with a colocated vLLM at 0.3, on one H100."""
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


@functools.lru_cache(maxsize=1)
def _form_fields() -> tuple[dict, ...]:
    by_name = {param.name: param for param in _command().params}
    out = []
    for name in FORM_FIELDS:
        param = by_name[name]
        flag = next((o for o in param.opts if o.startswith("--")), None)
        help_text = _one_line(getattr(param, "help", "") or "")
        metavar = getattr(param, "metavar", None) or ""
        if getattr(param, "secondary_opts", None):  # --vllm/--no-vllm: either flag, or neither (the default)
            kind, choices = "switch", [param.opts[0], param.secondary_opts[0]]
        elif "|" in metavar and metavar.islower():  # grpo|rloo|...: values; NAME|SIZE: placeholders
            kind, choices = "choice", metavar.split("|")
        else:
            kind, choices = "text", None
        out.append({"name": name, "flag": flag, "label": (flag or name).lstrip("-").replace("-", " "),
                    "kind": kind, "choices": choices, "default": _default_text(help_text), "help": help_text,
                    "suggestions": _suggestions(name), "initial": FORM_INITIAL.get(name, "")})
    return tuple(out)


def form_fields() -> list[dict]:
    """The RL section's inputs: name, flag (None: the positional model), label, kind ('text', 'choice' with its
    `choices` from the option's metavar, or 'switch': one of the option's two flags or neither), default (as the
    help states it), help, suggestions (model, gpu) and the initial value. The page builds `memfit rl`'s arguments
    from them: a switch's value is the flag itself, any other `flag value`."""
    return [dict(f) for f in _form_fields()]


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
