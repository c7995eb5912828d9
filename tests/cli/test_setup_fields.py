"""The setup's fields are declared once (memfit.fields): every field has a section, a label and --keep names (or is
explicitly never pinned), every command-line option is generated from a field and parses back to it, the sections
view and replace the setup, and the one dtype table matches torch's element sizes."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from memfit import fields
from memfit.cli.app import app
from memfit.cli.options import SETUP_FIELD_OPTIONS, SetupOptions, _finetune_options, option_parameters
from memfit.errors import ConfigError
from memfit.finetune import Finetune, Method
from memfit.setup import (FIELD_LABELS, KEEP_NAMES, Precision, TrainingSetup, field_names, keep_name, parse_keep,
                          setup_changes)
from memfit.units import DTYPE_BYTES

NO_OPTION = {"num_gpus": "--gpus / --nodes (the hardware's options)", "zero_knobs": "only a --config file",
             "notes": "memfit's own", "finetune": "Finetune's fields carry the options"}
"""The setup fields no option of their own sets, and why."""


def test_every_field_declares_its_section_label_and_keep_names():
    sections = tuple(fields.TECHNIQUE_SECTIONS.values())  # a technique module's own fields (memfit.fields)
    assert sections, "memfit.techniques registers its sections"
    for cls in (TrainingSetup, Finetune, *sections):
        for f in dataclasses.fields(cls):
            if f.name == getattr(cls, "TECHNIQUES_FIELD", None):  # the holder of the technique sections
                continue
            meta = f.metadata.get(fields.KEY)
            assert meta is not None, f"{cls.__name__}.{f.name} has no declaration"
            assert meta.section in fields.SECTIONS
            assert meta.label or f.name == "notes", f.name
    assert not fields.meta(TrainingSetup, "notes").keepable  # the one field never printed or pinned
    assert set(FIELD_LABELS) == set(field_names()) - {"notes"}
    for name, pinned in KEEP_NAMES.items():
        assert pinned and set(pinned) <= set(FIELD_LABELS), name


def test_keep_names_pin_what_they_pinned_before_the_declarations():
    """The table --keep read before it was derived from the fields (main at f7d7b9a), as an independent contract."""
    before = {
        "precision": ("precision",), "optimizer": ("optimizer",), "engine": ("engine",), "sharding": ("sharding",),
        "zero": ("sharding",), "checkpointing": ("checkpointing",), "attention": ("attention",),
        "micro_batch": ("micro_batch_size",), "batch": ("micro_batch_size",), "accum": ("grad_accum_steps",),
        "seq": ("seq_len",), "offload": ("offload",), "gpus": ("num_gpus",), "tp": ("tp", "sequence_parallel"),
        "method": ("finetune",), "finetune": ("finetune",), "lora": ("finetune",), "ep": ("expert_parallel",),
        "expert_parallel": ("expert_parallel",), "capacity": ("capacity_factor",), "loss": ("loss",),
        "optimizer_in_backward": ("optimizer_in_backward",), "in_backward": ("optimizer_in_backward",),
        "activation_offload": ("activation_offload",), "compile": ("compile",),
        "padding": ("padding", "longest_sample_len"), "pp": ("pp", "pp_schedule", "pp_virtual_stages"),
        "dp_shard": ("dp_shard",), "hsdp": ("dp_shard",), "cp": ("cp", "cp_rotate"),
        "float8": ("float8", "float8_all_gather"),
        "model_code": ("model_code",)}  # added with the field (memfit.estimate.litgpt)
    assert KEEP_NAMES == before
    renamed = {f: keep_name(f) for f in FIELD_LABELS if keep_name(f) != f}
    assert renamed == {"micro_batch_size": "micro_batch", "seq_len": "seq", "grad_accum_steps": "accum",
                       "num_gpus": "gpus", "capacity_factor": "capacity"}
    for field in FIELD_LABELS:  # the name a skipped rung's message gives pins the field again
        assert field in parse_keep(keep_name(field))


def test_options_cover_every_setup_field_once():
    optioned = [name for name, _ in SETUP_FIELD_OPTIONS]
    assert len(optioned) == len(set(optioned))
    top = {name for name in optioned if "." not in name}
    assert top | set(NO_OPTION) == set(field_names())
    assert {n.partition(".")[2] for n in optioned if n.startswith("finetune.")} == {
        f.name for f in dataclasses.fields(Finetune)}
    names = [p.name for p in option_parameters()]
    assert {o.name for _, o in SETUP_FIELD_OPTIONS} <= set(names)
    assert {o.name for _, o in SETUP_FIELD_OPTIONS} <= {f.name for f in dataclasses.fields(SetupOptions)}


def _command() -> typer.main.TyperCommand:
    def page(**values):  # pragma: no cover - parsed with make_context, never invoked
        return values

    page.__signature__ = inspect.Signature(option_parameters())
    page.__annotations__ = {p.name: p.annotation for p in page.__signature__.parameters.values()}
    one = typer.Typer()
    one.command()(page)
    return typer.main.get_command(one)


def _other_value(option: fields.Option) -> tuple[list[str], object]:
    """A value other than the default, as the command line spells it, and the field value it must give."""
    flag = option.flags[0]
    if option.parser == "choice":
        member = next(m for m in option.kind if m != option.default and "every" not in m.value)
        return [flag, member.value], member
    if option.parser == "flag":
        return ([f"--no-{flag[2:]}"], False) if option.default in (True, None) else ([flag], True)
    text, value = {"whole": ("3", 3), "fraction": ("0.25", 0.25), "capacity": ("1.5", 1.5),
                   "number": ("16", 16.0), "text": ("q_proj,v_proj", ("q_proj", "v_proj"))}[option.parser]
    return [flag, text], value


@pytest.mark.parametrize("name,option", SETUP_FIELD_OPTIONS, ids=[n for n, _ in SETUP_FIELD_OPTIONS])
def test_each_generated_option_parses_to_its_field(name, option):
    argv, expected = _other_value(option)
    field = name.partition(".")[2]
    if name.startswith("finetune.") and field != "method":
        argv += ["--method", "qlora" if field in ("kbit_prep", "double_quant") else "lora"]
    with _command().make_context("page", argv) as ctx:
        opts = SetupOptions(**{k: v for k, v in ctx.params.items() if k != "keep"})
    if "." not in name:
        assert opts._setup_fields()[name] == expected
        assert opts.explicit == {name}
        return
    ft = opts.finetune()
    assert getattr(ft, field) == expected
    if ft.adapters:  # a Finetune read from a config file gives these options back, and they give it again
        cleared = {o.name: None for n, o in SETUP_FIELD_OPTIONS if n.startswith("finetune.")}
        again = dataclasses.replace(opts, **{**cleared, **_finetune_options(ft)})
        assert again.finetune() == ft


def test_the_help_lists_every_generated_option_with_its_help():
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
    assert result.exit_code == 0
    flat = " ".join(result.output.replace("│", " ").split())
    for _, option in SETUP_FIELD_OPTIONS:
        assert option.flags[0] in flat
        assert " ".join(option.help_text.split()[:6]) in flat


def test_sections_view_and_replace_the_setup():
    setup = TrainingSetup()
    seen = [f for s in fields.SECTIONS for f in setup.section(s)]
    assert sorted(seen) == sorted(field_names())
    precision = setup.section("precision")
    assert precision.precision is setup.precision and precision.float8 is setup.float8
    changed = setup.with_section("precision", precision="bf16")
    assert changed.precision is Precision.BF16
    assert {c.section for c in setup_changes(setup, changed)} == {"precision"}
    with pytest.raises(ConfigError, match="seq_len"):
        setup.with_section("precision", seq_len=1024)
    assert setup.section("finetune").to_dict() == {"finetune": Finetune().to_dict()}
    assert Finetune(method=Method.LORA).to_dict()["method"] == "lora"


def test_the_one_dtype_table_matches_torch():
    torch = pytest.importorskip("torch")
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16, "int8": torch.int8, "uint8": torch.uint8,
             "fp8": torch.float8_e4m3fn, "int64": torch.int64, "bool": torch.bool}
    for name, dtype in names.items():
        assert DTYPE_BYTES[name] == torch.empty((), dtype=dtype).element_size(), name
    for precision in Precision:
        assert precision.param_bytes == {"fp32": 4, "bf16": 2}[precision.param_dtype]
        assert precision.compute_bytes == torch.empty((), dtype=names[precision.compute_dtype]).element_size()
