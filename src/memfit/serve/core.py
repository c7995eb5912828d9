"""What the page computes, with no web framework: the form's fields and one plan.

The fields and their parsers are the options `memfit plan` declares (memfit.cli.options: flag, help, default,
parser, help panel), so the page cannot drift from the command line: an option added there appears on the page
with no edit here. The page parses its values with those same parsers (the same one-line messages), collects them
into SetupOptions and computes with the library, as `memfit plan --json` does: `SetupOptions.resolve`,
`memfit.plan.plan`, `memfit.plan_output.plan_json`, `memfit.config_snippets` and the report's breakdown chart as
plain data. It never runs a CLI command.

The form's order: model, GPU and method first, then GPUs, micro-batch and sequence length; every other option is
folded into a section, grouped as `memfit plan --help` groups them (its Training setup panel split by what the
options change).
"""

from __future__ import annotations

import functools
import inspect
import re
import shlex
import threading
import typing
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import fields
from enum import Enum
from typing import Any

from ..errors import MemfitError, suggest
from ..fields import technique_fields_declared
from ..hardware import gpu_catalog
from ..plan import plan as make_plan
from ..plan_output import plan_json
from ..report.figures import breakdown_spec, report_data
from ..sources import catalog_entry, catalog_names, resolve_model
from ..sources.catalog import find_entry
from ..units import format_bytes

MODEL_FIELD = "model"
LEFT_OUT = frozenset({"config"})
"""Options of those panels the page does not offer: --config reads files named by the caller."""
MAX_VALUE_CHARS = 200
DEFAULT_MODEL = "llama-3.1-8b"

MAIN_SECTION = "Model, GPU and method"
FIRST_FIELDS = ("model", "gpu", "method", "gpus", "batch", "seq")
"""What most questions change, in this order and always shown."""
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Precision and memory", ("precision", "optimizer", "checkpointing", "attention", "accum", "loss",
                              "optimizer_in_backward", "keep_zeroed_grads", "compile")),
    ("Sharding, offload and parallelism", ("zero", "offload", "engine", "tp", "sequence_parallel", "pp",
                                           "pp_schedule", "pp_virtual_stages", "dp_shard", "cp", "cp_rotate")),
    ("LoRA / QLoRA", ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "modules_to_save", "base",
                      "double_quant", "rslora", "dora", "lora_recipe", "kbit_prep")),
    ("Sequence shape", ("padding", "longest_sample", "target_len", "image_size")),
    ("Mixture of experts", ("ep", "capacity_factor")),
)
"""The folded sections, each a part of `memfit plan --help`'s Training setup panel (a technique section's option
names its fold itself: memfit.fields.Option.page). An option in none of them
(and not first) is folded under its own help panel's name (Training setup, Hardware, Model)."""


class InputError(ValueError):
    """A mistake in the page's inputs: `message` is the one line the command line would print after 'error: '."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


# ---- the form ----------------------------------------------------------------------------------------------------

def _parameters() -> list[inspect.Parameter]:
    """MODEL, then the options of `memfit plan` that set the model, setup and hardware, in --help order."""
    from ..cli.options import ModelArg, option_parameters

    model = inspect.Parameter(MODEL_FIELD, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=ModelArg)
    return [model, *option_parameters(planning=True)]


@functools.lru_cache(maxsize=1)
def _command():
    """A click command over exactly those parameters, built by typer as it builds `memfit plan`: its parsers and
    its error lines are the command line's own."""
    import typer
    import typer.main

    def page(**values):  # pragma: no cover - parsed with make_context, never invoked
        return values

    page.__signature__ = inspect.Signature(_parameters())
    page.__annotations__ = {p.name: p.annotation for p in page.__signature__.parameters.values()}
    app = typer.Typer()
    app.command()(page)
    return typer.main.get_command(app)


def _panels() -> tuple[str, ...]:
    from ..cli.options import HARDWARE_PANEL, MODEL_PANEL, SETUP_PANEL

    return MODEL_PANEL, SETUP_PANEL, HARDWARE_PANEL


def _value_type(annotation: Any) -> Any:
    """int for Annotated[Optional[int], ...], Precision for Annotated[Optional[Precision], ...]."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is not None and len(args) == 1:  # Optional[X] / X | None
        return args[0]
    return annotation


def _default_text(help_text: str) -> str:
    """'amp-bf16' from '... Default: amp-bf16.', '2048' from 'Default: 2048, or the model's maximum if shorter.',
    'the compute dtype for LoRA' from 'Default: the compute dtype for LoRA, nf4 for QLoRA.'"""
    match = re.search(r"Default: (.+?)(?:\.\s|\.?$)", help_text or "")
    if not match:
        return ""
    return re.split(r" \(|[;,]", match.group(1), maxsplit=1)[0].strip()


def _suggestions(name: str) -> list[dict] | None:
    """Values to offer in a free-text field: the model and GPU catalogs."""
    if name == MODEL_FIELD:
        return [{"value": n, "label": f"{catalog_entry(n)['num_params'] / 1e9:.2f} B params"} for n in catalog_names()]
    if name == "gpu":
        gpus = sorted(gpu_catalog().values(), key=lambda g: (g.memory_bytes, g.name))
        return [{"value": g.name, "label": f"{format_bytes(g.memory_bytes)} usable"} for g in gpus]
    return None


def _section(name: str, panel: str) -> str:
    if name in FIRST_FIELDS:
        return MAIN_SECTION
    pages = {m.option.name: m.option.page for _, m in technique_fields_declared() if m.option and m.option.page}
    return next((title for title, names in SECTIONS if name in names), pages.get(name, panel))


def section_names() -> list[str]:
    """The form's sections in page order: the main one (shown), SECTIONS, then the help panels (folded)."""
    return [MAIN_SECTION, *(title for title, _ in SECTIONS), *_panels()]


@functools.lru_cache(maxsize=1)
def _form_fields() -> tuple[dict, ...]:
    annotations = {p.name: p.annotation for p in _parameters()}
    out = []
    panels = _panels()
    for param in _command().params:
        if getattr(param, "rich_help_panel", None) not in panels or param.name in LEFT_OUT:
            continue
        kind = _value_type(annotations.get(param.name))
        choices = [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, Enum) else None
        flag = next((o for o in param.opts if o.startswith("--")), None)
        help_text = _one_line(getattr(param, "help", "") or "")
        out.append({
            "name": param.name,
            "flag": flag,
            "label": (flag or param.name).lstrip("-").replace("-", " ").replace("_", " "),
            "panel": param.rich_help_panel,
            "section": _section(param.name, param.rich_help_panel),
            "kind": ("flag" if getattr(param, "is_flag", False) else "choice" if choices else "text"),
            "choices": choices,
            "numeric": kind in (int, float),
            "default": _default_text(help_text),
            "help": help_text,
            "suggestions": _suggestions(param.name),
        })
    order = {name: i for i, name in enumerate(section_names())}
    first = {name: i for i, name in enumerate(FIRST_FIELDS)}
    # a stable sort: within a folded section, --help order
    return tuple(sorted(out, key=lambda f: (order[f["section"]], first.get(f["name"], 0))))


def form_fields() -> list[dict]:
    """The page's inputs, in the page's order (FIRST_FIELDS, then each section's in `memfit plan --help` order):
    name, flag, label, panel (its --help panel), section, kind ('text', 'choice' with its `choices`, or 'flag'),
    numeric, default (as the help states it), help, and suggestions (for model and gpu)."""
    return [dict(f) for f in _form_fields()]


def options() -> dict:
    """What /api/options serves: the fields, the sections they fall in (only the first shown open) and the
    starting model."""
    names = catalog_names()
    used = {f["section"] for f in _form_fields()}
    return {"fields": form_fields(), "panels": list(_panels()),
            "sections": [{"name": s, "open": s == MAIN_SECTION} for s in section_names() if s in used],
            "initial": {MODEL_FIELD: DEFAULT_MODEL if DEFAULT_MODEL in names else names[0]}}


# ---- one plan ----------------------------------------------------------------------------------------------------

def _text(name: str, value: Any) -> str | None:
    """A value as the command line would get it; None when left empty. Only JSON scalars are values."""
    if value is None or value is False:
        return None
    if value is True:
        return "true"
    if isinstance(value, (int, float)):
        value = repr(value)
    if not isinstance(value, str):
        raise InputError(f"{name}: give a text value, not a {type(value).__name__}", field=name)
    text = value.strip()
    if len(text) > MAX_VALUE_CHARS:
        raise InputError(f"{name}: at most {MAX_VALUE_CHARS} characters", field=name)
    return text or None


def command_line(values: Mapping[str, Any]) -> list[str]:
    """`memfit plan`'s arguments for the page's values ({field name: text}); empty values are left out (the CLI's
    default, stated in the plan's notes). Unknown names, values that are not text and oversized values are an
    InputError."""
    by_name = {f["name"]: f for f in _form_fields()}
    unknown = sorted(set(values) - set(by_name), key=str)
    if unknown:
        shown = ", ".join(repr(str(u)[:40]) for u in unknown[:5])
        raise InputError(f"unknown field(s) {shown}: the page sends " + ", ".join(by_name), field=None)
    model = None
    args: list[str] = []
    for name, spec in by_name.items():
        text = _text(spec["flag"] or name, values.get(name))
        if text is None:
            continue
        if spec["flag"] is None:
            model = text
        elif spec["kind"] == "flag":
            if text.lower() in ("true", "on", "1", "yes"):
                args.append(spec["flag"])
        else:
            args += [spec["flag"], text]
    if model is None:
        raise InputError("choose a model: a catalog name (see `memfit models`)", field=MODEL_FIELD)
    return [model, *args]


def shell_command(argv: list[str]) -> str:
    return shlex.join(["memfit", "plan", *argv])


def _parse(argv: list[str]) -> dict[str, Any]:
    """The plan command's parameters, parsed by its options' own parsers and error lines."""
    from ..cli.common import CommandLineError

    model, rest = argv[0], argv[1:]
    # --flag=value keeps a value such as '-3' a value; '--' keeps a model such as '-x' the argument
    tokens = [flag if value is None else f"{flag}={value}" for flag, value in _pairs(rest)]
    try:
        with _command().make_context("plan", [*tokens, "--", model]) as ctx:
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
    if find_entry(text) is not None:
        return text
    if "/" in text or "\\" in text or text.endswith(".json") or text.startswith((".", "~")):
        raise InputError(f"the page plans catalog models (see `memfit models`); for '{text[:80]}' run "
                         "`memfit plan` itself", field=MODEL_FIELD)
    shown = text if len(text) <= 80 else text[:77] + "..."
    raise InputError(str(suggest(shown, catalog_names(), "model")), field=MODEL_FIELD)


@functools.lru_cache(maxsize=64)
def _catalog_spec(name: str):
    """The catalog model's ModelSpec, read once per name: a spec is a frozen value, and one object per model lets
    what is remembered per spec (the plan's estimate memo, memfit.estimate's kept steps and per-graph answers)
    serve every plan of that model instead of reading the catalog and building its graph again for each update."""
    return resolve_model(name)


def plan_page(values: Mapping[str, Any]) -> dict:
    """One plan for the page's values: {"command": the equivalent `memfit plan` line, "plan": exactly what that
    line prints with --json, "view": the same plan as display text, "figure": the --report breakdown chart}.
    A mistake in the values raises InputError with the CLI's line."""
    return plan_for(command_line(values))


def plan_for(argv: list[str]) -> dict:
    """plan_page for `memfit plan`'s arguments (command_line's answer)."""
    from ..cli.options import SetupOptions

    params = _parse(argv)
    _catalog_model(params[MODEL_FIELD])
    given = {f.name: params.get(f.name) for f in fields(SetupOptions) if f.init and f.name not in ("reading", "config")}
    try:
        opts = SetupOptions(**given)
        spec, setup, hardware = opts.resolve(_catalog_spec(params[MODEL_FIELD]))
        result = make_plan(spec, setup, hardware, margin=opts.margin_fraction, explicit=opts.explicit, keep=opts.keep)
    except MemfitError as error:
        raise InputError(_one_line(str(error))) from None
    except RecursionError:  # a value nested past what the parsers walk: still the caller's mistake
        raise InputError("a value is nested too deeply") from None
    return {"command": shell_command(argv), "plan": plan_json(result), "view": view(result),
            "figure": figure(result)}


def view(result) -> dict:
    """The plan as the terminal shows it, in the CLI's own words and number formats (render.gib, summaries)."""
    from .. import render
    from ..config_snippets import config_snippets

    initial, final = result.initial_diagnosis, result.final_diagnosis
    rungs = [{"number": "", "title": "as given", "gib": render.gib(result.initial_estimate.total_bytes),
              "fits": initial.fits, "bottleneck": initial.bottleneck.value, "cost": "", "change": "", "why": ""}]
    rungs += [{"number": str(n), "title": s.title, "gib": render.gib(s.estimate.total_bytes), "fits": s.diagnosis.fits,
               "bottleneck": s.diagnosis.bottleneck.value, "cost": s.cost, "change": s.change, "why": s.why}
              for n, s in enumerate(result.steps, 1)]
    changes = len(result.steps)
    verdict = ("fits " if result.fits else "does not fit: ") + render.verdict_text(result)
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
        "snippets": config_snippets(result.final_setup, auto_class=result.spec.auto_class,
                                    hub_id=result.spec.extra.get("hub_id"), model_type=result.spec.model_type)
        if result.fits else {},
    }


@functools.lru_cache(maxsize=4)
def _template(name: str) -> dict:
    """A plotly template as plotly.py writes it into a figure's JSON (plotly.js knows no template names)."""
    import plotly.io

    return plotly.io.templates[name].to_plotly_json()


def figure(result) -> dict:
    """The breakdown chart of `memfit plan --report` (memfit.report), as plotly's JSON {data, layout}: the same
    JSON as the report's plotly figure, built from plain data (plotly's validation took most of an update)."""
    spec = breakdown_spec(report_data(result))
    layout = dict(spec["layout"])
    if isinstance(layout.get("template"), str):
        layout["template"] = _template(layout["template"])
    return {"data": spec["data"], "layout": layout}


# ---- answers, computed once --------------------------------------------------------------------------------------

class Answers:
    """The page's answers by command line, computed once each by `compute` (plan_for, or its JSON bytes): an LRU
    of the last `size`, and a request for a command line already being computed waits for that computation instead
    of starting a second one. A plan depends on its command line only (catalog models, no files), so a kept answer
    is the answer; an InputError is not kept."""

    def __init__(self, compute: Callable[[list[str]], Any] = plan_for, *, size: int = 256):
        self._compute, self._size = compute, size
        self._done: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._running: dict[tuple[str, ...], Future] = {}
        self._lock = threading.Lock()

    def get(self, values: Mapping[str, Any]) -> Any:
        key = tuple(command_line(values))
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            future, mine = self._running.get(key), False
            if future is None:
                future, mine = Future(), True
                self._running[key] = future
        if not mine:
            return future.result()
        try:
            answer = self._compute(list(key))
        except BaseException as error:
            future.set_exception(error)
            with self._lock:
                del self._running[key]
            raise
        with self._lock:
            self._done[key] = answer
            while len(self._done) > self._size:
                self._done.popitem(last=False)
            del self._running[key]
        future.set_result(answer)
        return answer
