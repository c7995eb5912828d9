"""The typed Python API: the same objects the CLI prints, from whatever the user has in hand."""

from __future__ import annotations

from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .hardware import Hardware, check_precision, make_hardware
from .model_spec import ModelSpec
from .plan import Plan, plan
from .setup import Engine, Precision, TrainingSetup, field_names, needs_bf16, parse_keep

ModelRef = Any
"""A catalog name, a config.json path, a hub id, an HF config dict/PretrainedConfig, an nn.Module or a ModelSpec."""


def as_spec(model: ModelRef) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from .sources import resolve_model

    return resolve_model(model)


def as_hardware(hardware: Hardware | str, *, gpus_per_node: int = 1, num_nodes: int = 1) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    return make_hardware(hardware, gpus_per_node=gpus_per_node, num_nodes=num_nodes)


_ASSUMED_LABELS = (("micro_batch_size", "micro-batch"), ("seq_len", "seq"), ("grad_accum_steps", "accum"),
                   ("precision", "precision"), ("optimizer", "optimizer"), ("checkpointing", "checkpointing"),
                   ("attention", "attention"))


def typical_setup(spec: ModelSpec, hardware: Hardware, **given: Any) -> TrainingSetup:
    """The TrainingSetup with the fields the user `given` (None counts as not given), TrainingSetup()'s defaults (a
    typical fine-tune) for the rest, the default sequence clamped to the model's context and the world size taken
    from the hardware. On a GPU without bf16 (T4, V100) the default precision is amp-fp16, and a given bf16
    precision is a ConfigError. `notes` say what was assumed, so the output can state it."""
    given = {name: value for name, value in given.items() if value is not None}
    from .derive.stacks_estimate import check_given  # decoder length, image size: refused where not taken

    given = check_given(spec, given)
    if spec.finetune is not None and "finetune" not in given:
        given["finetune"] = spec.finetune  # a live LoRA model trains what it has
    defaults, notes = TrainingSetup(), []
    if "precision" in given:
        check_precision(given["precision"], hardware.gpu)
    elif needs_bf16(defaults.precision) and not hardware.gpu.bf16:
        defaults = defaults.replace(precision=Precision.AMP_FP16)
        notes.append(f"precision amp-fp16: {hardware.gpu.name} has no bf16, so fp16 autocast with loss scaling "
                     f"replaces the usual {TrainingSetup.precision}")
    if given.get("tp", 1) > 1 and "engine" not in given:
        given["engine"] = Engine.TORCH
        notes.append(f"engine torch: tensor parallelism (tp={given['tp']}) runs on torch DTensor, not DeepSpeed")
    for name, what in (("pp", "pipeline parallelism (torch.distributed.pipelining)"),
                       ("cp", "context parallelism (torch context_parallel ring attention)")):
        if given.get(name, 1) > 1 and "engine" not in given:
            given["engine"] = Engine.TORCH
            notes.append(f"engine torch: {what} with {name}={given[name]} runs on torch, not DeepSpeed")
    if "attention" not in given and spec.extra.get("supports_sdpa") is False:
        from .setup import Attention

        defaults = defaults.replace(attention=Attention.EAGER)
        notes.append(f"attention eager: transformers has no sdpa attention for {spec.model_type}")
    max_positions = spec.max_position_embeddings
    if "seq_len" not in given and 0 < max_positions < defaults.seq_len:
        notes.append(f"seq {max_positions}: the default {defaults.seq_len} clamped to the model's "
                     "max_position_embeddings")
    elif 0 < max_positions < given.get("seq_len", 0):
        notes.append(f"seq {given['seq_len']} is longer than the model's max_position_embeddings ({max_positions})")
    seq = given.get("seq_len", min(defaults.seq_len, max_positions or defaults.seq_len))
    assumed = [f"{label} {seq if name == 'seq_len' else getattr(defaults, name)}"
               for name, label in _ASSUMED_LABELS if name not in given]
    if assumed:
        notes.insert(0, "assumed: " + ", ".join(assumed) + " (a typical fine-tune; set them with options)")
    return TrainingSetup(**{"num_gpus": hardware.world_size, "precision": defaults.precision,
                            "attention": defaults.attention, **given,
                            "seq_len": seq}, notes=tuple(notes))


def estimate_memory(model: ModelRef, setup: TrainingSetup | None = None,
                    hardware: Hardware | str = "A100-80GB") -> MemoryEstimate:
    """Per-device peak of one training step, broken into named terms."""
    spec, hw = as_spec(model), as_hardware(hardware)
    return estimate(spec, setup or typical_setup(spec, hw), hw)


def diagnose_memory(model: ModelRef, setup: TrainingSetup | None = None, hardware: Hardware | str = "A100-80GB",
                    *, margin: float = DEFAULT_MARGIN) -> Diagnosis:
    hw = as_hardware(hardware)
    return diagnose(estimate_memory(model, setup, hw), hw, margin=margin)


def plan_memory(model: ModelRef, setup: TrainingSetup | None = None, hardware: Hardware | str = "A100-80GB",
                *, margin: float = DEFAULT_MARGIN, keep: str | frozenset[str] | None = None) -> Plan:
    """Walk the seed's ladder until the step fits (or say what would). A `setup` given counts as set by the user
    field by field (rungs change its fields only as a last resort, saying so); `keep` ('precision,optimizer', or
    TrainingSetup field names) pins fields no rung may change."""
    spec, hw = as_spec(model), as_hardware(hardware)
    default = TrainingSetup()  # every field, the technique sections' included (setup.field_names)
    explicit = frozenset() if setup is None else frozenset(
        name for name in field_names() if name != "notes" and getattr(setup, name) != getattr(default, name))
    return plan(spec, setup or typical_setup(spec, hw), hw, margin=margin, explicit=explicit, keep=parse_keep(keep))
