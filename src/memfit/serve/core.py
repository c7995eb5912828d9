"""What the page computes, with no web framework: the form's fields and one plan.

Both come from the command line itself, so the page cannot drift from it:

- the fields are the options of `memfit plan` in its Model, Training setup and Hardware panels, read from the
  click command typer builds (flag, help, default) and from the option's annotation (a setup enum gives its
  values). An option added to those panels (a new enum field such as a fine-tuning method) appears on the page
  with no edit here;
- a plan is the command line `memfit plan MODEL --flag value ...`, parsed by that same click command (the same
  parsers and the same one-line messages), collected into the CLI's SetupOptions and computed with `resolve`,
  `memfit.plan.plan` and `plan_json`, the calls `memfit plan --json` makes; `plan_page` also returns that
  command, which prints the same JSON with --json.
"""

from __future__ import annotations

import functools
import inspect
import re
import shlex
import typing
from collections.abc import Mapping
from dataclasses import fields
from enum import Enum
from typing import Any

from ..errors import MemfitError, suggest

MODEL_FIELD = "model"
LEFT_OUT = frozenset({"config"})
"""Options of those panels the page does not offer: --config reads files named by the caller."""
MAX_VALUE_CHARS = 200
DEFAULT_MODEL = "llama-3.1-8b"


class InputError(ValueError):
    """A mistake in the page's inputs: `message` is the one line the command line would print after 'error: '."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


@functools.lru_cache(maxsize=1)
def _plan_command():
    """The click command behind `memfit plan`, as typer builds it for the command line."""
    import typer.main

    from ..cli.app import app

    return typer.main.get_command(app).commands["plan"]


def _panels() -> tuple[str, ...]:
    from ..cli.options import HARDWARE_PANEL, MODEL_PANEL, SETUP_PANEL

    return MODEL_PANEL, SETUP_PANEL, HARDWARE_PANEL


def _form_params() -> list:
    panels = _panels()
    return [p for p in _plan_command().params
            if getattr(p, "rich_help_panel", None) in panels and p.name not in LEFT_OUT]


def _value_type(annotation: Any) -> Any:
    """int for Annotated[Optional[int], ...], Precision for Annotated[Optional[Precision], ...]."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is not None and len(args) == 1:  # Optional[X] / X | None
        return args[0]
    return annotation


def _annotations() -> dict[str, Any]:
    from ..cli.app import plan_command

    return {name: p.annotation for name, p in inspect.signature(plan_command).parameters.items()}


def _default_text(help_text: str) -> str:
    """'amp-bf16' from '... Default: amp-bf16.', '2048' from 'Default: 2048, or the model's maximum if shorter.'"""
    match = re.search(r"Default: (.+?)\.?(?:\s|$)", help_text or "")
    if not match:
        return ""
    return re.split(r" \(|[;,]", match.group(1), maxsplit=1)[0].strip()


def _suggestions(name: str) -> list[dict] | None:
    """Values to offer in a free-text field: the model and GPU catalogs."""
    if name == MODEL_FIELD:
        from ..sources import catalog_entry, catalog_names

        return [{"value": n, "label": f"{catalog_entry(n)['num_params'] / 1e9:.2f} B params"} for n in catalog_names()]
    if name == "gpu":
        from ..hardware import gpu_catalog
        from ..units import format_bytes

        gpus = sorted(gpu_catalog().values(), key=lambda g: (g.memory_bytes, g.name))
        return [{"value": g.name, "label": f"{format_bytes(g.memory_bytes)} usable"} for g in gpus]
    return None


@functools.lru_cache(maxsize=1)
def _form_fields() -> tuple[dict, ...]:
    annotations = _annotations()
    out = []
    for param in _form_params():
        kind = _value_type(annotations.get(param.name))
        choices = [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, Enum) else None
        flag = next((o for o in param.opts if o.startswith("--")), None)
        help_text = _one_line(getattr(param, "help", "") or "")
        out.append({
            "name": param.name,
            "flag": flag,
            "label": (flag or param.name).lstrip("-").replace("-", " ").replace("_", " "),
            "panel": param.rich_help_panel,
            "kind": ("flag" if getattr(param, "is_flag", False) else "choice" if choices else "text"),
            "choices": choices,
            "numeric": kind in (int, float),
            "default": _default_text(help_text),
            "help": help_text,
            "suggestions": _suggestions(param.name),
        })
    return tuple(out)


def form_fields() -> list[dict]:
    """The page's inputs, in `memfit plan --help` order: name, flag, label, panel, kind ('text', 'choice' with its
    `choices`, or 'flag'), numeric, default (as the help states it), help, and suggestions (for model and gpu)."""
    return [dict(f) for f in _form_fields()]


def options() -> dict:
    """What /api/options serves: the fields, grouped by panel, and the starting model."""
    from ..sources import catalog_names

    names = catalog_names()
    return {"fields": form_fields(), "panels": list(_panels()),
            "initial": {MODEL_FIELD: DEFAULT_MODEL if DEFAULT_MODEL in names else names[0]}}


def command_line(values: Mapping[str, Any]) -> list[str]:
    """`memfit plan`'s arguments for the page's values ({field name: text}); empty values are left out (the CLI's
    default, stated in the plan's notes). Unknown names and oversized values are an InputError."""
    by_name = {f["name"]: f for f in _form_fields()}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(map(repr, unknown))}: the page sends "
                         + ", ".join(by_name), field=unknown[0])
    model = None
    args: list[str] = []
    for name, spec in by_name.items():
        value = values.get(name)
        if value is None or value is False:
            continue
        text = str(value).strip()
        if len(text) > MAX_VALUE_CHARS:
            raise InputError(f"{spec['flag'] or name}: at most {MAX_VALUE_CHARS} characters", field=name)
        if not text:
            continue
        if spec["flag"] is None:
            model = text
        elif spec["kind"] == "flag":
            if value is True or text.lower() in ("true", "on", "1", "yes"):
                args.append(spec["flag"])
        else:
            args += [spec["flag"], text]
    if model is None:
        raise InputError("choose a model: a catalog name (see `memfit models`)", field=MODEL_FIELD)
    return [model, *args]


def shell_command(argv: list[str]) -> str:
    return shlex.join(["memfit", "plan", *argv])


def _parse(argv: list[str]) -> dict[str, Any]:
    """The plan command's parameters, parsed by its click command: the CLI's own parsers and error lines."""
    from ..cli.common import CommandLineError

    model, rest = argv[0], argv[1:]
    # --flag=value keeps a value such as '-3' a value; '--' keeps a model such as '-x' the argument
    tokens = [flag if value is None else f"{flag}={value}" for flag, value in _pairs(rest)]
    try:
        with _plan_command().make_context("plan", [*tokens, "--", model]) as ctx:
            return dict(ctx.params)
    except CommandLineError as error:
        param = getattr(error, "param", None)
        raise InputError(_one_line(error.format_message()), field=getattr(param, "name", None)) from None


def _pairs(args: list[str]):
    flags = {f["flag"] for f in _form_fields() if f["kind"] == "flag"}
    i = 0
    while i < len(args):
        if args[i] in flags:
            yield args[i], None
            i += 1
        else:
            yield args[i], args[i + 1]
            i += 2


def _catalog_model(text: str) -> str:
    """The model, when the catalog has it; else memfit's own unknown-model line. The page plans catalog models
    only: it never reads a path or asks the Hub."""
    from ..sources import catalog_names
    from ..sources.catalog import find_entry

    if find_entry(text) is not None:
        return text
    if "/" in text or "\\" in text or text.endswith(".json") or text.startswith((".", "~")):
        raise InputError(f"the page plans catalog models (see `memfit models`); for '{text[:80]}' run "
                         "`memfit plan` itself", field=MODEL_FIELD)
    shown = text if len(text) <= 80 else text[:77] + "..."
    raise InputError(str(suggest(shown, catalog_names(), "model")), field=MODEL_FIELD)


def plan_page(values: Mapping[str, Any]) -> dict:
    """One plan for the page's values: {"command": the equivalent `memfit plan` line, "plan": exactly what that
    line prints with --json, "view": the same plan as display text, "figure": the --report breakdown chart}.
    A mistake in the values raises InputError with the CLI's line."""
    from ..cli.common import resolve
    from ..cli.options import SetupOptions
    from ..plan import plan as make_plan
    from ..plan_output import plan_json

    argv = command_line(values)
    params = _parse(argv)
    _catalog_model(params[MODEL_FIELD])
    given = {f.name: params.get(f.name) for f in fields(SetupOptions) if f.init and f.name not in ("reading", "config")}
    try:
        opts = SetupOptions(**given).with_config()
        spec, setup, hardware = resolve(params[MODEL_FIELD], opts)
        result = make_plan(spec, setup, hardware, margin=opts.margin_fraction, explicit=opts.explicit, keep=opts.keep)
    except MemfitError as error:
        raise InputError(_one_line(str(error))) from None
    return {"command": shell_command(argv), "plan": plan_json(result), "view": view(result),
            "figure": figure(result)}


def view(result) -> dict:
    """The plan as the terminal shows it, in the CLI's own words and number formats (render.gib, summaries)."""
    from .. import render
    from ..cli.app import _snippets

    initial, final = result.initial_diagnosis, result.final_diagnosis
    rungs = [{"number": "", "title": "as given", "gib": render.gib(result.initial_estimate.total_bytes),
              "fits": initial.fits, "bottleneck": initial.bottleneck.value, "cost": "", "change": "", "why": ""}]
    rungs += [{"number": str(n), "title": s.title, "gib": render.gib(s.estimate.total_bytes), "fits": s.diagnosis.fits,
               "bottleneck": s.diagnosis.bottleneck.value, "cost": s.cost, "change": s.change, "why": s.why}
              for n, s in enumerate(result.steps, 1)]
    changes = len(result.steps)
    if result.fits:
        lead = "as given" if not changes else f"after {changes} change{'s' if changes > 1 else ''}"
        verdict = f"fits {lead}: {final.summary().removeprefix('fits: ')}"
    else:
        verdict = "does not fit: nothing on the ladder makes it fit: " + final.summary().removeprefix("does not fit: ")
    world = f"{result.hardware.world_size} x " if result.hardware.world_size > 1 else ""
    return {
        "title": f"{result.spec.name} on {world}{result.hardware.gpu.name}",
        "fits": result.fits,
        "verdict": verdict,
        "initial": initial.summary(),
        "final": final.summary(),
        "final_setup": render.describe_setup(result.final_setup) if changes else "",
        "rungs": rungs,
        "skipped": [f"{title}: {reason}" for title, reason in result.skipped],
        "suggestions": list(result.suggestions) if not result.fits else [],
        "setup_notes": list(result.initial_setup.notes),
        "notes": list(result.initial_estimate.notes),
        "snippets": _snippets(result.final_setup, render, emitted=None,
                                 auto_class=result.spec.auto_class) if result.fits else {},
    }


def figure(result) -> dict:
    """The breakdown chart of `memfit plan --report` (memfit.report), as plotly's JSON {data, layout}."""
    import json

    from ..report.figures import breakdown_figure, report_data

    return json.loads(breakdown_figure(report_data(result)).to_json())
