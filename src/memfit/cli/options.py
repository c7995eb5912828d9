"""The options every sizing command shares, parsed into library values at the command-line boundary.

The setup's options are generated from the fields' declarations (memfit.fields: flags, help, parser, bounds, in
the order of the setup's sections); the others (model, hardware, --config, --keep, output) are `Annotated` aliases
written here. `with_setup_options` adds the whole set to a command in place of its `opts: SetupOptions` parameter,
so a new command (trace, measure, launch) takes the same options by writing one parameter; a parameter of the
command's own named like a shared option replaces it (vlm's --image-size). Values are checked here, so a bad number
is one line naming the option, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import json
import math
import os
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from ..diagnose import DEFAULT_MARGIN
from ..errors import ConfigError, MemfitError
from ..fields import MAX_ACCUM, MAX_GPUS_PER_NODE, MAX_MICRO_BATCH, MAX_NODES, MAX_SEQ_LEN, SECTIONS, Option
from ..fields import declared
from ..fields import options as options_of
from ..finetune import Finetune, Method
from ..hardware import DEFAULT_GPU, GPU, Hardware, get_gpu, make_hardware
from ..model_spec import ModelSpec
from ..setup import KEEP_NAMES, TrainingSetup, _Choice, field_names, parse_keep
from .. import techniques as _techniques  # noqa: F401  (registers the technique sections: their options too)
from ..units import parse_size
from .progress import hidden

MODEL_PANEL, SETUP_PANEL, HARDWARE_PANEL, OUTPUT_PANEL = "Model", "Training setup", "Hardware", "Output"

__all__ = ["MAX_ACCUM", "MAX_MICRO_BATCH", "MAX_SEQ_LEN"]  # the bounds live with the fields (memfit.fields)


def whole_number(maximum: int) -> Callable[[str], int]:
    """A parser for a whole number in [1, maximum]: '0', '-3', '1.5' and 'abc' are rejected with one line."""

    def parse(value: str | int) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                raise typer.BadParameter(f"'{value}' is not a whole number") from None
        if not 1 <= number <= maximum:
            raise typer.BadParameter(f"{number} must be a whole number from 1 to {maximum:,}")
        return number

    return parse


def fraction(value: str | float) -> float:
    """A finite number in [0, 1)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"'{value}' is not a number: give a fraction such as 0.05") from None
    if not (math.isfinite(number) and 0 <= number < 1):
        raise typer.BadParameter(f"{value} must be a fraction from 0 (keep nothing free) up to, not including, 1")
    return number


def size(value: str | int) -> int:
    """A memory size: 512GiB, 1.5TB, 64G (bare numbers are GiB)."""
    if isinstance(value, int):
        return value
    try:
        return parse_size(str(value))
    except MemfitError as error:
        raise typer.BadParameter(str(error)) from None


def gpu(value: str | GPU) -> GPU:
    """A catalog GPU name or alias, or a memory size for a GPU that is not in the catalog."""
    if isinstance(value, GPU):
        return value
    text = str(value).strip()
    try:
        return get_gpu(text)
    except MemfitError as error:
        message = str(error)
    if text[:1].isdigit() or text[:1] in "+-.":
        try:  # a size parse_size rejects: say why in its words rather than 'unknown gpu'
            parse_size(text)
        except MemfitError as size_error:
            message = str(size_error)
    raise typer.BadParameter(message)


def choice(kind: type[_Choice]) -> Callable[[str], _Choice]:
    """A parser for one of a setup enum's values, or an alias it accepts (e.g. 'flash' for sdpa)."""

    def parse(value: str | _Choice) -> _Choice:
        try:
            return kind.parse(value)
        except MemfitError as error:
            raise typer.BadParameter(str(error)) from None

    return parse


def keep_fields(value: str | frozenset[str]) -> frozenset[str]:
    """--keep: a comma list of setup fields to pin; an unknown name is one line listing the valid ones."""
    try:
        return parse_keep(value)
    except MemfitError as error:
        raise typer.BadParameter(str(error)) from None


def _option(*decls: str, panel: str, help: str, parser: Callable | None = None, metavar: str | None = None,
            **extra) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=panel, parser=parser, metavar=metavar,
                        show_default=False, **extra)


ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, "
         "or a Hugging Face hub id (org/name).")]

OptionalModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, "
         "or a Hugging Face hub id (org/name). Optional when --config names the model (axolotl base_model, "
         "LLaMA-Factory model_name_or_path, torchtune model).")]
"""What commands taking ModelArg get from with_setup_options: MODEL may come from --config."""

ConfigOpt = Annotated[Optional[list[str]], _option(
    "--config", panel=SETUP_PANEL, metavar="FILE",
    help="Read the setup from the config you already have: HF TrainingArguments (JSON/YAML), DeepSpeed JSON, "
         "accelerate YAML, axolotl, LLaMA-Factory or torchtune YAML (the format comes from the keys; the DeepSpeed "
         "file a config names is read too). Repeat it or give a comma list to combine files. The fields it sets "
         "count as given; options given here override them.")]

GpuOpt = Annotated[Optional[GPU], _option(
    "--gpu", panel=HARDWARE_PANEL, parser=gpu, metavar="NAME|SIZE",
    help=f"GPU: a catalog name (see `memfit gpus`) or a memory size such as 24GiB. Default: {DEFAULT_GPU}.")]
GpusOpt = Annotated[Optional[int], _option(
    "--gpus", panel=HARDWARE_PANEL, parser=whole_number(MAX_GPUS_PER_NODE), metavar="N",
    help="GPUs per node. Default: 1. With more than one, the plan may shard with ZeRO.")]
NodesOpt = Annotated[Optional[int], _option(
    "--nodes", panel=HARDWARE_PANEL, parser=whole_number(MAX_NODES), metavar="N", help="Nodes. Default: 1.")]
CpuRamOpt = Annotated[Optional[int], _option(
    "--cpu-ram", panel=HARDWARE_PANEL, parser=size, metavar="SIZE",
    help="Host RAM per node for CPU offload, e.g. 512GiB. Default: 256GiB.")]
MarginOpt = Annotated[Optional[float], _option(
    "--margin", panel=HARDWARE_PANEL, parser=fraction, metavar="FRACTION",
    help=f"Fraction of GPU memory kept free for kernels' workspaces and spikes. Default: {DEFAULT_MARGIN}.")]

TaskOpt = Annotated[Optional[str], _option(
    "--task", panel=MODEL_PANEL, metavar="TASK",
    help="lm or sequence-classification: train the model's own head (causal LM; BERT: masked LM), or a sequence "
         "classifier over --num-labels classes (BertForSequenceClassification's pooler + classifier, "
         "LlamaForSequenceClassification's score on the last token; bert, llama, mistral, qwen2, qwen3). "
         "Default: lm, or what the config's architectures name.")]
NumLabelsOpt = Annotated[Optional[int], _option(
    "--num-labels", panel=MODEL_PANEL, parser=whole_number(1_000_000), metavar="N",
    help="Classes of --task sequence-classification (given alone, it implies that task). Default: 2.")]


def capacity(value: str | float) -> float:
    """0 (dropless) or a finite number >= 1."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"'{value}' is not a number: give 0 (dropless) or a factor such as 1.25") from None
    if not math.isfinite(number) or number < 0 or 0 < number < 1:
        raise typer.BadParameter(f"{value} must be 0 (dropless routing) or a capacity factor >= 1")
    return number


_PARSERS: dict[str, Callable[[Option], Callable | None]] = {
    "whole": lambda o: whole_number(o.maximum), "fraction": lambda o: fraction, "capacity": lambda o: capacity,
    "choice": lambda o: choice(o.kind), "flag": lambda o: None, "number": lambda o: None, "text": lambda o: None}
"""The parser of each memfit.fields parser kind (a flag, a plain number and text: typer's own conversion)."""


SECTION_PANELS: dict[str, str] = dict.fromkeys(SECTIONS, SETUP_PANEL)
"""The --help panel of each setup section's options: one "Training setup" panel today (what users know); a
section gets its own panel by changing its entry."""


def _setup_option(option: Option) -> Any:
    """The typer parameter of one setup field, as its FieldMeta declares it."""
    return Annotated[Optional[option.value_type], _option(
        *option.declarations, panel=SECTION_PANELS[option.section], parser=_PARSERS[option.parser](option),
        metavar=option.shown_metavar, help=option.help_text)]


SETUP_FIELD_OPTIONS: tuple[tuple[str, Option], ...] = options_of(TrainingSetup)
"""(field, Option) of every setup field the command line sets, in --help order: `finetune.rank` for a field of
the setup's Finetune. Generated from the fields' declarations (memfit.fields)."""
_SETUP_OPTIONS: dict[str, object] = {option.name: _setup_option(option) for _, option in SETUP_FIELD_OPTIONS}

def setup_option(field_name: str) -> Any:
    """The generated option of one setup field (`micro_batch_size`, `finetune.rank`, ...): what a command with its
    own setup (memfit rl) declares to take the sizing commands' spellings of the fields it shares."""
    return _SETUP_OPTIONS[dict(SETUP_FIELD_OPTIONS)[field_name].name]


KeepOpt = Annotated[Optional[frozenset], _option(
    "--keep", panel=SETUP_PANEL, parser=keep_fields, metavar="FIELDS",
    help="Pin these fields (comma list: " + ", ".join(n for n in KEEP_NAMES if n not in ("zero", "batch"))
         + "): the plan never changes them and says which rung it passed over for that. Without --keep, "
         "options you give are changed only when nothing else fits, and the step says why.")]

JsonOpt = Annotated[bool, _option("--json", panel=OUTPUT_PANEL,
                                  help="Print JSON only (sizes as integer bytes), for scripts.")]
VerboseOpt = Annotated[bool, _option("--verbose", "-v", panel=OUTPUT_PANEL,
                                     help="Show each term's formula and source.")]


@dataclass(frozen=True)
class _GivenOptions:
    """The options that set no setup field (hardware, task, --keep, --config): None where not given."""

    gpu: GPU | None = None
    gpus: int | None = None
    nodes: int | None = None
    cpu_ram: int | None = None
    margin: float | None = None
    task: str | None = None
    num_labels: int | None = None
    keep: frozenset[str] | None = None
    """TrainingSetup fields pinned with --keep (planning commands only)."""
    config: tuple[str, ...] | None = None
    """--config files, as given."""
    reading: Any = field(default=None, compare=False)
    """The memfit.readers.ConfigReading of --config, once read (with_config)."""

    @property
    def margin_fraction(self) -> float:
        return DEFAULT_MARGIN if self.margin is None else self.margin

    def with_task(self, spec: ModelSpec) -> ModelSpec:
        """`spec` as --task / --num-labels ask (memfit.sources.task); unchanged when neither was given."""
        if self.task is None and self.num_labels is None:
            return spec
        from ..sources.task import SEQUENCE_CLASSIFICATION, with_task

        return with_task(spec, self.task or SEQUENCE_CLASSIFICATION, self.num_labels or 2)

    def resolve(self, model: str) -> tuple[ModelSpec, TrainingSetup, Hardware]:
        """(ModelSpec, TrainingSetup, Hardware) for MODEL (a catalog name, config.json or hub id) and these
        options: what every sizing command and the page compute from."""
        from ..sources import resolve_model

        spec = self.with_task(resolve_model(model))
        hardware = self.hardware()
        return spec, self.setup(spec, hardware), hardware

    def hardware(self) -> Hardware:
        return make_hardware(self.gpu or DEFAULT_GPU, gpus_per_node=self.gpus or 1, num_nodes=self.nodes or 1,
                             cpu_ram=self.cpu_ram)

    def setup(self, spec: ModelSpec, hardware: Hardware) -> TrainingSetup:
        """The TrainingSetup the options describe; defaults are a typical fine-tune, stated in `notes`."""
        from ..api import typical_setup

        try:
            return typical_setup(spec, hardware, **self._setup_fields())
        except ConfigError as error:
            if self.reading is None:
                raise
            files = ", ".join(f.path for f in self.reading.files)
            raise ConfigError(f"{error} (with the setup read from {files}; an option overrides a field)") from None

    def with_config(self) -> "_GivenOptions":
        """These options with the --config files' fields filled in where no option was given (so they count as
        given), and `reading` set; unchanged without --config."""
        paths = [part.strip() for item in (self.config or ()) for part in str(item).split(",") if part.strip()]
        if not paths:
            return self
        from ..readers import read_config

        given = {name: value for name, value in self._setup_fields().items() if value is not None}
        overridden = {field: _OPTION_OF_FIELD[field] for field in given}
        world = None
        if self.gpus is not None or self.nodes is not None:
            overridden["num_gpus"] = "--gpus" if self.gpus is not None else "--nodes"
            world = (self.gpus or 1) * (self.nodes or 1)
        reading = read_config(*paths, num_gpus=world, overridden=overridden)
        fill: dict[str, Any] = {name: reading.overrides[field] for name, field in _FIELD_OF_OPTION.items()
                                if getattr(self, name) is None and field in reading.overrides}
        if "finetune" in reading.overrides and self.finetune() is None:
            fill.update(_finetune_options(reading.overrides["finetune"]))
        if world is None and "num_gpus" in reading.overrides:
            per_node, nodes = reading.layout()
            fill.update(gpus=per_node, nodes=nodes if nodes > 1 else None)
        return replace(self, reading=reading, **fill)

    def _setup_fields(self) -> dict[str, Any]:
        """The setup fields these options give (None where not given), in TrainingSetup's order."""
        values = {name: getattr(self, option.name) for name, option in SETUP_FIELD_OPTIONS if "." not in name}
        values["finetune"] = self.finetune()
        return {**{name: values[name] for name in _FIELD_NAMES if name in values}, **self._read_only_fields()}

    def _read_only_fields(self) -> dict[str, Any]:
        """Setup fields only a --config file sets (no option spells them): DeepSpeed's ZeRO buffer sizes."""
        if self.reading is None:
            return {}
        return {name: self.reading.overrides[name] for name in _READ_ONLY_FIELDS if name in self.reading.overrides}

    def finetune(self) -> Finetune | None:
        """The Finetune the --method / --lora-* / --base options describe (None when none was given). LoRA
        options without --method mean LoRA (QLoRA when --base is quantized)."""
        given = {name.partition(".")[2]: getattr(self, option.name) for name, option in _FINETUNE_OPTIONS}
        given = {name: value for name, value in given.items() if value is not None}
        if self.method is None and not given:
            return None
        method = self.method
        if method is None:
            method = Method.QLORA if given.get("base") is not None and given["base"].four_bit else Method.LORA
        if method is Method.FULL and given:
            raise ConfigError(f"{', '.join('--' + n.replace('_', '-') for n in given)} set LoRA details: "
                              "add --method lora (or qlora)")
        return Finetune(method=method, **given)

    def given_setup(self, hardware: Hardware, **defaults: Any) -> TrainingSetup:
        """The TrainingSetup of the fields given (and --config's), `defaults` for the others and TrainingSetup()'s
        beyond those, on `hardware`'s world size: for a command that sizes no catalog text model (vlm), where no
        model's typical choices (typical_setup) apply."""
        given = {name: value for name, value in self._setup_fields().items() if value is not None}
        return TrainingSetup(**{**defaults, **given, "num_gpus": hardware.world_size})

    @property
    def explicit(self) -> frozenset[str]:
        """The TrainingSetup fields given on the command line (--gpus / --nodes set num_gpus)."""
        given = {name for name, value in self._setup_fields().items() if value is not None}
        if self.gpus is not None or self.nodes is not None:
            given.add("num_gpus")
        return frozenset(given)


_READ_ONLY_FIELDS = tuple(name for name, m in declared(TrainingSetup)
                          if m.option is None and m.nested is None and m.label is not None and name != "num_gpus")
"""Setup fields only a --config file sets (no option spells them; --gpus / --nodes set num_gpus): zero_knobs."""
_FIELD_NAMES = field_names()
_FINETUNE_OPTIONS = tuple((name, o) for name, o in SETUP_FIELD_OPTIONS if name.startswith("finetune.")
                          and name != "finetune.method")
"""The --lora-* / --base / ... options: the Finetune fields besides the method."""


def _finetune_options(ft: Finetune) -> dict[str, Any]:
    """The --method / --lora-* option values that give `ft` (a Finetune read from a config file)."""
    out: dict[str, Any] = {"method": ft.method}
    if ft.adapters:
        for name, option in _FINETUNE_OPTIONS:
            value = getattr(ft, name.partition(".")[2])
            out[option.name] = (",".join(value) or None) if isinstance(value, tuple) else value
    return out


_FIELD_OF_OPTION = {option.name: name for name, option in SETUP_FIELD_OPTIONS if "." not in name}
"""SetupOptions name -> the TrainingSetup field it sets (zero -> sharding)."""
_OPTION_OF_FIELD = {**{name: option.flags[0] for name, option in SETUP_FIELD_OPTIONS if "." not in name},
                    "finetune": "--method"}
"""TrainingSetup field -> the option that sets it, as the --config reading names it (overridden by --zero)."""

SetupOptions = dataclasses.make_dataclass(
    "SetupOptions", [(option.name, Optional[option.value_type], field(default=None))
                     for _, option in SETUP_FIELD_OPTIONS],
    bases=(_GivenOptions,), frozen=True, namespace={"__module__": __name__, "__doc__": (
        "What the user gave on the command line; None where an option was not given. One attribute per setup "
        "option, named after its flag (--longest-sample -> longest_sample), generated from the fields' "
        "declarations (memfit.fields), besides the hand-written ones of _GivenOptions.")})

_SHARED_OPTIONS: dict[str, object] = {  # in --help order: the training setup panel, then the hardware panel
    "config": ConfigOpt, **_SETUP_OPTIONS,
    "gpu": GpuOpt, "gpus": GpusOpt, "nodes": NodesOpt, "cpu_ram": CpuRamOpt, "margin": MarginOpt,
    "task": TaskOpt, "num_labels": NumLabelsOpt,
}
_PLANNING_OPTIONS: dict[str, object] = {"keep": KeepOpt}
"""Options only the commands that walk the ladder take."""
_PLANNING_COMMANDS = frozenset({"plan_command"})


def option_parameters(*, planning: bool = False) -> list[inspect.Parameter]:
    """The shared options (and, with `planning`, --keep) as keyword parameters, in --help order: what
    with_setup_options adds to a command, and the fields of `memfit serve`'s form."""
    options = {**_SHARED_OPTIONS, **(_PLANNING_OPTIONS if planning else {})}
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
            for name, annotation in options.items()]


def with_setup_options(command: Callable) -> Callable:
    """Replace the command's `opts: SetupOptions` parameter by the shared options, and call it with them collected
    into a SetupOptions. Typer reads the signature, so `--help` lists the options in their panels. A shared option
    whose name is one of the command's own parameters is left out (the command's replaces it; its SetupOptions
    attribute stays None)."""
    signature = inspect.signature(command)
    names = list(signature.parameters)
    if "opts" not in names:
        raise TypeError(f"{command.__name__} needs an `opts: SetupOptions` parameter")
    at = names.index("opts")
    before = [p.replace(annotation=OptionalModelArg, default=None) if _is_model_argument(p) else p
              for p in list(signature.parameters.values())[:at]]
    positional_model = any(_is_model_argument(p) for p in list(signature.parameters.values())[:at])
    after = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in list(signature.parameters.values())[at + 1:]]
    shared = [p for p in option_parameters(planning=command.__name__ in _PLANNING_COMMANDS) if p.name not in names]
    options = [p.name for p in shared]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with hidden(bool(kwargs.get("json_output"))):  # --json: stdout is for scripts, keep stderr clean too
            return _run(*args, **kwargs)

    def _run(*args, **kwargs):
        collected = {name: kwargs.pop(name) for name in options}
        if collected.get("config") is not None:
            collected["config"] = tuple(collected["config"]) or None
        opts = SetupOptions(**collected).with_config()
        reading = opts.reading
        if "model" in kwargs and kwargs["model"] is None and reading is not None and reading.model:
            kwargs["model"] = reading.model
        if positional_model and kwargs.get("model") is None:
            raise ConfigError("Missing argument 'MODEL': give a model (a catalog name, a config.json or a hub id), "
                              "or a --config that names one")
        if reading is None:
            return command(*args, opts=opts, **kwargs)
        return _run_with_reading(command, args, kwargs, opts)

    wrapper.__signature__ = signature.replace(parameters=before + shared + after)
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}
    return wrapper


def _is_model_argument(parameter: inspect.Parameter) -> bool:
    return parameter.name == "model" and (parameter.annotation is ModelArg or parameter.annotation == "ModelArg")


def _run_with_reading(command: Callable, args: tuple, kwargs: dict, opts: SetupOptions):
    """Run the command, then say what --config read: in --json under "config" (the command's object, captured
    from stdout), else a short section after the output (on stderr when stdout carries CSV or Markdown). A command
    that fails prints nothing from the reading, so a mistake stays one error line."""
    if kwargs.get("json_output"):
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                result = command(*args, opts=opts, **kwargs)
        except typer.Exit:
            _emit_json(buffer.getvalue(), opts.reading)
            raise
        _emit_json(buffer.getvalue(), opts.reading)
        return result
    machine = str(getattr(kwargs.get("format_"), "value", kwargs.get("format_") or "")) in ("csv", "markdown")
    try:
        result = command(*args, opts=opts, **kwargs)
    except typer.Exit:
        typer.echo("\n".join(config_section(opts.reading)), err=machine)
        raise
    typer.echo("\n".join(config_section(opts.reading)), err=machine)
    return result


def _emit_json(text: str, reading) -> None:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        typer.echo(text, nl=False)
        return
    full = reading.to_dict()
    data["config"] = {key: full[key] for key in ("files", "model", "read", "ignored")}
    typer.echo(json.dumps(data, indent=2))


def config_section(reading, width: int | None = None) -> list[str]:
    """What --config read and what it left out, for the end of a command's output."""
    from ..readers import NOT_RELEVANT, NOT_SIZED

    width = width or max(60, min(100, int(os.environ.get("COLUMNS", "80") or 80)))

    def wrap(text: str, indent: str = "  ") -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + "    ",
                             break_on_hyphens=False)

    files = "; ".join(f"{f.path} ({f.format}{', named by ' + f.via if f.via else ''})" for f in reading.files)
    lines = ["", *textwrap.wrap(f"Read from --config: {files}", width=width)]
    for entry in reading.read:
        if entry.sets:
            lines += wrap(entry.text)
    deferred = [e.field for e in reading.read if not e.sets]
    if deferred:
        lines += wrap("read, set nothing themselves ('auto', or another field decides): " + ", ".join(deferred))
    quiet = [e for e in reading.ignored if e.why.startswith((NOT_RELEVANT, "off"))]
    loud: dict[str, list[str]] = {}
    for entry in reading.ignored:
        if entry not in quiet:
            loud.setdefault(entry.why, []).append(entry.field)
    if loud:
        lines.append(f"Ignored ({NOT_SIZED}, or nothing to shard):")
        for why, names in loud.items():
            lines += wrap(f"{', '.join(dict.fromkeys(names))}: {why}")
    if quiet:
        lines += wrap("not memory-relevant or off: " + ", ".join(dict.fromkeys(e.field for e in quiet)), indent="")
    return lines


ReportOpt = Annotated[Optional[Path], _option(
    "--report", panel=OUTPUT_PANEL, metavar="FILE.html",
    help="Also write a self-contained HTML report (charts work offline).")]
PngOpt = Annotated[Optional[Path], _option(
    "--png", panel=OUTPUT_PANEL, metavar="FILE.png", help="Also write the report's charts as a PNG image.")]
