"""What each field of the training setup is, declared once on the field (`setting`): its section, the label memfit
prints for a change of it, the `--keep` names that pin it, and the command-line option that sets it (flags, help,
parser, bounds). memfit.setup derives FIELD_LABELS, KEEP_NAMES and keep_name from it; memfit.cli.options builds
the setup's typer options from it, so a new field is one declaration, not four.

The setup stays flat (`setup.precision`, not `setup.precision.precision`): a section is declared metadata plus a
view (TrainingSetup.section / with_section). Nesting the storage would rewrite some 300 attribute reads across the
estimator, the techniques, the emitters and the readers for no number that moves.

A technique that lives in one module declares its own fields there instead (`TechniqueSection`): a frozen dataclass
of `setting` fields, registered with `technique_section`. TrainingSetup keeps the registered sections in one field
(`techniques`, a `Techniques` value holding the sections that differ from their defaults) and takes, shows and
serialises their fields flat like its own (`setup.replace(name=...)`, `setup.name`, `to_dict`): a technique field
sits after its section's own fields (`declared`), so --help, `setup_changes` and to_dict keep one order. The
section's methods are the technique's hooks into the core (its checks, its change to the static layout and the
optimizer step, its text), which the core calls for every registered section without naming one.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Iterator, Mapping

SECTIONS: tuple[str, ...] = ("batch", "precision", "optimizer", "memory", "parallel", "finetune", "moe", "notes")
"""The setup's sections, in the order `--help` lists their options (fields in declaration order within each)."""

KEY = "memfit"

MISSING = object()
"""A value no field holds (a default to compare with where a field has none)."""
"""The key of a field's FieldMeta in its dataclasses metadata."""

# Upper bounds that no real step reaches; they keep the ladder's divisor search and --optimize's enumeration short.
MAX_MICRO_BATCH = 65_536
MAX_SEQ_LEN = 16 * 1024 * 1024
MAX_ACCUM = 65_536
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 65_536
MAX_DEGREE = MAX_GPUS_PER_NODE * MAX_NODES
"""A parallel degree: at most every GPU of the largest cluster the options describe."""

PARSERS = {"whole": int, "fraction": float, "capacity": float, "number": float, "choice": None, "flag": bool,
           "text": str}
"""How an option's text becomes the field's value (the CLI's parsers, memfit.cli.options, implement each), and
the Python type it yields (a choice: its enum)."""


@dataclass(frozen=True)
class Option:
    """How the command line spells one field. `help` may name `{default}` (the field's default) and `{choices}`
    (a choice's values, comma-separated)."""

    flags: tuple[str, ...]
    """The option's names, long first (`--batch`, `-b`); a flag's `--no-` form is added to its first."""
    help: str
    parser: str = "whole"
    """One of PARSERS."""
    maximum: int | None = None
    """whole: the largest value accepted (the smallest is 1)."""
    metavar: str | None = None
    """None: N for a whole number, the flag upper-cased for a choice, none for a flag."""
    kind: Any = None
    """choice: the Choice enum (the field's default's type)."""
    default: Any = None
    section: str = ""
    """The field's section (setting fills it in, with `kind` and `default`): the CLI's help panel follows it."""
    page: str | None = None
    """The fold of `memfit serve`'s page that shows it (a technique section's field; memfit.serve.core.SECTIONS lists
    the setup's own)."""

    @property
    def name(self) -> str:
        """The option's Python name: `--longest-sample` -> longest_sample (memfit.cli.options.SetupOptions)."""
        return self.flags[0].lstrip("-").replace("-", "_")

    @property
    def declarations(self) -> tuple[str, ...]:
        if self.parser == "flag":
            return (f"{self.flags[0]}/--no-{self.flags[0][2:]}", *self.flags[1:])
        return self.flags

    @property
    def value_type(self) -> Any:
        return self.kind if self.parser == "choice" else PARSERS[self.parser]

    @property
    def shown_metavar(self) -> str | None:
        if self.metavar is not None or self.parser == "flag":
            return self.metavar
        return self.flags[0].lstrip("-").upper() if self.parser == "choice" else "N"

    @property
    def help_text(self) -> str:
        choices = ", ".join(m.value for m in self.kind) if self.kind is not None else ""
        return self.help.format(default=self.default, choices=choices)


@dataclass(frozen=True)
class FieldMeta:
    """One setup field's declaration. `keep`: the --keep names that pin it besides its own field name (a name
    shared by several fields pins them together, `tp` pins tp and sequence_parallel)."""

    section: str
    label: str | None
    """How a change of it is printed ("micro-batch 8 -> 4"); None: never printed (notes), never pinned."""
    keep: tuple[str, ...] = ()
    option: Option | None = None
    nested: Any = None
    """A field holding a dataclass whose own fields carry the options (finetune: memfit.finetune.Finetune)."""
    quiet_default: bool = False
    """Left out of the setup's JSON while it holds its default: a field added after answers were published (the
    FSDP version, the model code), so that an answer which never names it reads as it did before."""

    @property
    def keepable(self) -> bool:
        return self.label is not None


def setting(default: Any, *, section: str, label: str | None = None, keep: tuple[str, ...] = (),
            option: Option | None = None, nested: Any = None, quiet_default: bool = False,
            **field_options: Any) -> Any:
    """A dataclass field with its FieldMeta: `micro_batch_size: int = setting(8, section="batch", ...)`."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}")
    if option is not None:
        kind = type(default) if option.parser == "choice" else None
        option = dataclasses.replace(option, default=default, kind=kind, section=section)
    meta = FieldMeta(section=section, label=label, keep=keep, option=option, nested=nested,
                     quiet_default=quiet_default)
    return dataclasses.field(default=default, metadata={KEY: meta}, **field_options)


def field_default(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name`."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def meta(cls: type, name: str) -> FieldMeta:
    return next(m for field, m in declared(cls) if field == name)


def declared(cls: type) -> tuple[tuple[str, FieldMeta], ...]:
    """(field name, FieldMeta) of every declared field of `cls`, in declaration order. A class that holds the
    technique sections (its `TECHNIQUES_FIELD` names the field) lists their fields too, each section's after the
    last of `cls`'s own fields of the same section (at the end where it has none), or after the field its section's
    `after` names."""
    own = [(f.name, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata]
    if getattr(cls, "TECHNIQUES_FIELD", None) is None:
        return tuple(own)
    out, previous = list(own), (None, None)
    for name, m in technique_fields_declared():
        if any(field == name for field, _ in own):
            raise ValueError(f"technique field {name} is a field of {cls.__name__} already")
        owner = technique_field_owner(name)
        after = owner.after and (previous[1] if previous[0] is owner else owner.after)  # its fields in their order
        previous = (owner, name)
        last = next((i for i, (field, _) in enumerate(out) if field == after), None)
        if last is None:
            last = max((i for i, (_, other) in enumerate(out) if other.section == m.section), default=len(out) - 1)
        out.insert(last + 1, (name, m))
    return tuple(out)


def by_section(cls: type) -> tuple[tuple[str, FieldMeta], ...]:
    """declared(cls) in SECTIONS order, declaration order within a section."""
    return tuple(sorted(declared(cls), key=lambda item: SECTIONS.index(item[1].section)))


def section_fields(cls: type, section: str) -> tuple[str, ...]:
    if section not in SECTIONS:
        raise KeyError(f"unknown section {section!r}: choose one of {', '.join(SECTIONS)}")
    return tuple(name for name, m in declared(cls) if m.section == section)


def labels(cls: type) -> dict[str, str]:
    """Field -> label, in declaration order (what setup_changes walks)."""
    return {name: m.label for name, m in declared(cls) if m.label is not None}


def keep_names(cls: type) -> dict[str, tuple[str, ...]]:
    """--keep name -> the fields it pins, in the order the fields declare the names."""
    out: dict[str, tuple[str, ...]] = {}
    for name, m in declared(cls):
        for keep in m.keep:
            out[keep] = (*out.get(keep, ()), name)
    return out


def keep_name_of(cls: type, field: str) -> str:
    """The --keep name a message gives for `field`: the field's own name when it declares it, else the first
    declared name that pins it alone (micro_batch_size -> micro_batch), else the field name (which --keep takes
    too)."""
    names = keep_names(cls)
    own = meta(cls, field).keep
    if field in own:
        return field
    return next((k for k in own if names[k] == (field,)), field)


def options(cls: type) -> tuple[tuple[str, Option], ...]:
    """(field, Option) of every field of `cls` the command line sets, nested dataclasses' fields at their
    parent's place (`finetune` -> Finetune's), in --help order (by_section)."""
    out: list[tuple[str, Option]] = []
    for name, m in by_section(cls):
        if m.option is not None:
            out.append((name, m.option))
        if m.nested is not None:
            out += [(f"{name}.{inner}", o) for inner, o in options(m.nested)]
    return tuple(out)


@dataclass(frozen=True, eq=True)
class Section:
    """A read-only view of one section of a setup: `setup.section("precision").precision`. What a reader or emitter
    that owns a section reads, and hands back through TrainingSetup.with_section."""

    name: str
    values: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def __getattr__(self, field: str) -> Any:
        if field.startswith("__"):
            raise AttributeError(field)
        try:
            return self.values[field]
        except KeyError:
            raise AttributeError(f"section {self.name!r} has no field {field!r}: it holds "
                                 f"{', '.join(self.values)}") from None

    def __iter__(self):
        return iter(self.values)

    def to_dict(self) -> dict[str, Any]:
        """The section's fields as JSON holds them (enums by value, nested setups by their to_dict)."""
        return {name: plain(value) for name, value in self.values.items()}


def plain(value: Any) -> Any:
    """A field's value as JSON holds it: an enum by its value, a tuple as a list, a nested setup by its to_dict."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value.to_dict() if hasattr(value, "to_dict") else value


# ---- technique sections: a technique's own fields, declared in its module --------------------------------------

class TechniqueSection:
    """A technique's config section. Subclass it as a frozen dataclass whose fields are declared with `setting`
    (their defaults are the technique off; a Choice field takes its values' text) and register the class with
    `technique_section`. The methods are the hooks the core calls for each section a setup holds, in registration
    order; each default says "not this technique's business". `spec` is a memfit.model_spec.ModelSpec, `full` and
    `sharded` memfit.estimate.static's StaticBytes and ShardedStatic (typed loosely: fields sits below them)."""

    key: ClassVar[str]
    """The section's name in TrainingSetup.techniques and in messages."""
    classifier_sized: ClassVar[bool] = True
    """Whether memfit sizes a sequence classifier's step with the technique on (memfit.estimate.heads.check refuses
    it otherwise, naming it by `describe`)."""
    after: ClassVar[str | None] = None
    """The setup field its fields follow in declaration order (so `--help`, to_dict and setup_changes keep the order
    they had when the field was the setup's own); None: after the last of their section's own fields."""

    turned_back: ClassVar[tuple[str, ...]] = ()
    """Its fields that TrainingSetup.replace turns back to their defaults, in this order (after the setup's own),
    when a change that does not name them cannot combine with them."""
    checked_late: ClassVar[bool] = False
    """Whether `problems` is asked only once the setup's own checks pass, after its combination checks (a technique
    whose refusals assume a valid parallel layout); False: with the setup's own field checks."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a Choice field takes its text and aliases (memfit.choice.Choice.parse)
            parse = getattr(type(f.default), "parse", None)
            if isinstance(f.default, Enum) and parse is not None:
                object.__setattr__(self, f.name, parse(getattr(self, f.name)))

    def problems(self, setup: Any) -> list[str]:
        """What the technique cannot run or memfit does not size with the rest of `setup` (TrainingSetup's
        validation joins them to its own, one ConfigError for all)."""
        return []

    def fsdp1_sized(self) -> bool:
        """Whether memfit sizes the section's setting under FSDP1 (TrainingSetup refuses the pair otherwise, in
        the words it has for torch.compile)."""
        return True

    def describe(self) -> str:
        """Its part of memfit.render.describe_setup (", torchao CPU offload grads"); "" says nothing."""
        return ""

    def step_temp_bytes(self, spec: Any, setup: Any) -> tuple[int, str] | None:
        """The optimizer step's device temporaries and their formula where the technique decides them
        (memfit.estimate.static.optimizer_step_temp_bytes); None: the optimizer's own."""
        return None

    def static_layout(self, spec: Any, setup: Any, full: Any, sharded: Any) -> Any:
        """The per-rank static layout where the technique decides where parameters, gradients and optimizer states
        live (memfit.estimate.static.shard, after the engine's layout); None: the engine's offload rules."""
        return None

    # ---- its change to the step's activations (memfit.estimate.analytic calls these for every section held) ----

    def check_model(self, spec: Any, setup: Any) -> None:
        """Raise a one-line memfit.errors.ConfigError where the technique is not sized on this model (the setup
        alone passed `problems`); called once the adapters are on the spec, before the engine's per-rank spec."""

    def step_moments(self, moments: Any, spec: Any, setup: Any, acts: Any, on_cpu: bool) -> Any:
        """The step's moments (memfit.estimate.moments.StepMoments) as the technique changes them on the device,
        given the activation terms alive at the end of forward without it (`acts`), after the step model built
        every moment; `moments` itself: no change."""
        return moments

    def host_activations(self, spec: Any, setup: Any, acts: Any, on_cpu: bool) -> Any:
        """What the technique moves off the device per micro-step, or None: a value with `host_bytes` (added to the
        estimate's host RAM), `offloaded_bytes` and `in_flight_bytes` (the device buffers its copies allocate, which
        memfit.estimate.device replays: a HostMoves), as activation offloading's sizing returns. `acts()` gives the activation terms alive at the end of forward without it
        (a call, as only a technique that moves activations needs them)."""
        return None

    def host_notes(self, host: Any) -> tuple[str, ...]:
        """Notes on what `host_activations` returned (how exactly it was counted)."""
        return ()

    def plan_words(self) -> str:
        """Its words in the emitted files' one-line plan (memfit.emit.emitted.describe); "" says nothing."""
        return ""

    def trace_note(self) -> str:
        """What a trace of the step (memfit.trace, fake tensors) does not see of the technique; "" when it sees all."""
        return ""


SectionClass = type  # a registered TechniqueSection subclass (a frozen dataclass)

TECHNIQUE_SECTIONS: dict[str, SectionClass] = {}
"""Registered technique sections by key, in registration order (memfit.techniques imports their modules)."""
_FIELD_OWNER: dict[str, SectionClass] = {}
_LISTENERS: list[Callable[[], None]] = []

SECTION_PACKAGE = "memfit.techniques"
"""The registry of the technique modules (its __init__ imports each). The core loads it by name the first time it
needs the registered sections (`load_sections`), so a setup built from `memfit.setup` alone knows every section,
whatever was imported first. By name, not by an import statement: the techniques sit a layer above and import the
core (docs/design.md, "Layers"); loading them imports only core modules and theirs (tests/techniques/
test_registration.py), the torch side stays unloaded."""
_loaded = False


def load_sections() -> None:
    """Import SECTION_PACKAGE, which registers every technique section (a no-op once it is imported). Called again
    while it imports (its modules build setups), it returns at once; another thread waits for the import to end."""
    global _loaded
    if not _loaded:
        package = importlib.import_module(SECTION_PACKAGE)
        _loaded = not getattr(package.__spec__, "_initializing", False)


def technique_section(cls: SectionClass) -> SectionClass:
    """Register `cls` (a TechniqueSection dataclass) so TrainingSetup takes its fields: its module's one line."""
    if not (dataclasses.is_dataclass(cls) and issubclass(cls, TechniqueSection)):
        raise TypeError(f"{cls.__name__} must be a frozen TechniqueSection dataclass")
    for f in dataclasses.fields(cls):
        if KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with memfit.fields.setting")
        owner = _FIELD_OWNER.get(f.name)
        if owner is not None and owner is not cls:
            raise ValueError(f"{cls.__name__}.{f.name}: {owner.__name__} declares that field already")
    TECHNIQUE_SECTIONS[cls.key] = cls
    _FIELD_OWNER.update((f.name, cls) for f in dataclasses.fields(cls))
    for listener in _LISTENERS:
        listener()
    return cls


def unregister_section(cls: SectionClass) -> None:
    """Take a registered section out again (what a test does to show the rest knows nothing of it)."""
    TECHNIQUE_SECTIONS.pop(cls.key, None)
    for name in [name for name, owner in _FIELD_OWNER.items() if owner is cls]:
        del _FIELD_OWNER[name]
    for listener in _LISTENERS:
        listener()


def on_sections_changed(listener: Callable[[], None]) -> None:
    """Call `listener` whenever a section is registered or taken out (memfit.setup refreshes its field tables)."""
    _LISTENERS.append(listener)


def technique_field_owner(name: str) -> SectionClass | None:
    """The registered section that declares field `name`, or None."""
    if name not in _FIELD_OWNER:
        load_sections()
    return _FIELD_OWNER.get(name)


def technique_fields_declared() -> tuple[tuple[str, FieldMeta], ...]:
    """(field, FieldMeta) of every registered section's fields, sections in registration order."""
    load_sections()
    return tuple(item for cls in TECHNIQUE_SECTIONS.values() for item in declared(cls))


_DEFAULT_SECTIONS: dict[type, Any] = {}
"""Each registered section class's default value, made once (a setup's every read of an unset section's field
asked for a new one)."""


class Techniques:
    """The technique sections of one setup: an immutable value holding only those that differ from their defaults
    (so a setup built before a section was registered equals one built after). Iterating yields them, in
    registration order; `get(cls)` gives a section's value, its default when not held."""

    __slots__ = ("_held",)

    def __init__(self, sections: "Mapping[str, Any] | None" = None):
        held = {key: value for key, value in (sections or {}).items() if value != type(value)()}
        order = list(TECHNIQUE_SECTIONS)
        object.__setattr__(self, "_held", MappingProxyType(dict(sorted(
            held.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Techniques is immutable")

    def get(self, cls: SectionClass) -> Any:
        held = self._held.get(cls.key)
        if held is not None:
            return held
        default = _DEFAULT_SECTIONS.get(cls)
        if default is None:  # a frozen dataclass: one default value per section class serves every setup
            default = _DEFAULT_SECTIONS[cls] = cls()
        return default

    def with_fields(self, changes: Mapping[str, Any]) -> "Techniques":
        """A copy with `changes` (field -> value) applied to the sections that declare the fields."""
        by_section: dict[SectionClass, dict[str, Any]] = {}
        for name, value in changes.items():
            by_section.setdefault(_FIELD_OWNER[name], {})[name] = value
        held = dict(self._held)
        for cls, values in by_section.items():
            held[cls.key] = dataclasses.replace(self.get(cls), **values)
        return Techniques(held)

    def __iter__(self) -> Iterator[Any]:
        return iter(tuple(v for k, v in self._held.items() if k in TECHNIQUE_SECTIONS))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Techniques) and dict(self._held) == dict(other._held)

    def __hash__(self) -> int:
        return hash(frozenset(self._held.items()))

    def __repr__(self) -> str:
        return f"Techniques({dict(self._held)!r})"

    def __reduce__(self):
        return (Techniques, (dict(self._held),))
