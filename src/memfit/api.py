"""The typed Python API: the same objects the CLI prints, from whatever the user has in hand."""

from __future__ import annotations

from typing import Any

from .diagnose import DEFAULT_MARGIN, Diagnosis, diagnose
from .estimate.analytic import estimate
from .estimate.result import MemoryEstimate
from .hardware import Hardware, make_hardware
from .model_spec import ModelSpec
from .plan import Plan, plan
from .setup import TrainingSetup, field_names, parse_keep
from .typical import typical_setup  # noqa: F401  (re-exported: memfit.typical_setup)

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
