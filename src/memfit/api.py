"""The typed Python API: the same objects the CLI prints, from whatever the user has in hand."""

from __future__ import annotations

from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .hardware import Hardware, make_hardware
from .model_spec import ModelSpec
from .plan import Plan, plan
from .setup import TrainingSetup

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


def typical_setup(spec: ModelSpec, hardware: Hardware, **overrides: Any) -> TrainingSetup:
    """TrainingSetup() defaults (a typical fine-tune), the sequence clamped to the model's context, the world size
    taken from the hardware; `notes` say what was assumed."""
    notes = []
    defaults = TrainingSetup()
    if "seq_len" not in overrides and spec.max_position_embeddings and spec.max_position_embeddings < defaults.seq_len:
        overrides["seq_len"] = spec.max_position_embeddings
        notes.append(f"seq_len clamped to the model's max_position_embeddings ({spec.max_position_embeddings})")
    overrides.setdefault("num_gpus", hardware.world_size)
    assumed = [f"{name}={getattr(defaults, name)}" for name in
               ("micro_batch_size", "seq_len", "precision", "optimizer", "attention") if name not in overrides]
    if assumed:
        notes.insert(0, "assumed a typical fine-tune: " + ", ".join(assumed))
    return TrainingSetup(**overrides, notes=tuple(notes))


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
                *, margin: float = DEFAULT_MARGIN) -> Plan:
    """Walk the seed's ladder until the step fits (or say what would)."""
    spec, hw = as_spec(model), as_hardware(hardware)
    return plan(spec, setup or typical_setup(spec, hw), hw, margin=margin)
