"""What each field of the training setup is, declared once on the field (`setting`): its section, the label memfit
prints for a change of it, the `--keep` names that pin it, and the command-line option that sets it (flags, help,
parser, bounds). memfit.setup derives FIELD_LABELS, KEEP_NAMES and keep_name from it; memfit.cli.options builds
the setup's typer options from it, so a new field is one declaration, not four.

The setup stays flat (`setup.precision`, not `setup.precision.precision`): a section is declared metadata plus a
view (TrainingSetup.section / with_section). Nesting the storage would rewrite some 300 attribute reads across the
estimator, the techniques, the emitters and the readers for no number that moves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping

SECTIONS: tuple[str, ...] = ("batch", "precision", "optimizer", "memory", "parallel", "finetune", "moe", "notes")
"""The setup's sections, in the order `--help` lists their options (fields in declaration order within each)."""

KEY = "memfit"
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

    @property
    def keepable(self) -> bool:
        return self.label is not None


def setting(default: Any, *, section: str, label: str | None = None, keep: tuple[str, ...] = (),
            option: Option | None = None, nested: Any = None, **field_options: Any) -> Any:
    """A dataclass field with its FieldMeta: `micro_batch_size: int = setting(8, section="batch", ...)`."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}")
    if option is not None:
        kind = type(default) if option.parser == "choice" else None
        option = dataclasses.replace(option, default=default, kind=kind, section=section)
    meta = FieldMeta(section=section, label=label, keep=keep, option=option, nested=nested)
    return dataclasses.field(default=default, metadata={KEY: meta}, **field_options)


def meta(cls: type, name: str) -> FieldMeta:
    return next(f.metadata[KEY] for f in dataclasses.fields(cls) if f.name == name)


def declared(cls: type) -> tuple[tuple[str, FieldMeta], ...]:
    """(field name, FieldMeta) of every declared field of `cls`, in declaration order."""
    return tuple((f.name, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata)


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
    """A read-only view of one section of a setup: `setup.section("precision").float8`. What a reader or emitter
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
