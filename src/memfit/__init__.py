"""memfit: know before you run where GPU memory goes in a training step, and the cheapest ordered fix.

    >>> import memfit
    >>> p = memfit.plan_memory("llama-3.1-8b", hardware="A100-80GB")
    >>> p.initial_diagnosis.bottleneck, [s.title for s in p.steps]
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import ConfigError, MemfitError, ModelSourceError, UnknownNameError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `import memfit` stays a few modules

if TYPE_CHECKING:
    from typing import Any

    from .measure import measure
    from .api import as_hardware, as_spec, diagnose_memory, estimate_memory, plan_memory, typical_setup
    from .apply import AppliedChanges, apply_
    from .callbacks import CheckResult, check
    from .diagnose import Bottleneck, Diagnosis
    from .estimate.result import Category, MemoryEstimate, Phase, Term
    from .fit import FitLoop, FitOutOfMemoryError, fit_steps
    from .hardware import GPU, Hardware, get_gpu, make_hardware
    from .launch import launch_plan, prepare, shard
    from .model_spec import ModelSpec, ParamTensor
    from .plan import Plan, PlanStep, optimize
    from .setup import Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup
    from .solve import cheapest_gpu, fewest_gpus, max_micro_batch, max_seq_len, sweep

_LAZY = {
    "api": ("as_hardware", "as_spec", "diagnose_memory", "estimate_memory", "plan_memory", "typical_setup"),
    "apply": ("AppliedChanges", "apply_"),
    "callbacks": ("CheckResult", "check"),
    "diagnose": ("Bottleneck", "Diagnosis"),
    "estimate.result": ("Category", "MemoryEstimate", "Phase", "Term"),
    "fit": ("FitLoop", "FitOutOfMemoryError", "fit_steps"),
    "hardware": ("GPU", "Hardware", "get_gpu", "make_hardware"),
    "launch": ("launch_plan", "prepare", "shard"),
    "model_spec": ("ModelSpec", "ParamTensor"),
    "plan": ("Plan", "PlanStep", "optimize"),
    "setup": ("Attention", "Checkpointing", "Engine", "Offload", "Optimizer", "Precision", "Sharding",
              "TrainingSetup"),
    "solve": ("cheapest_gpu", "fewest_gpus", "max_micro_batch", "max_seq_len", "sweep"),
}
"""Where each public name lives: imported on first use (PEP 562), so `import memfit` and every CLI command load
only the modules they use (the planner, readers and callbacks are most of memfit's import time)."""
_HOME = {name: module for module, names in _LAZY.items() for name in names}


class _Package(ModuleType):
    """memfit itself. `memfit.measure` is the function, never the submodule of the same name: importing the
    submodule binds its name on the package (importlib, after the module ran), and that binding is turned into the
    function here. So the submodule (estimate.result, setup: a third of import time) loads on first use, and the
    console script installs its Ctrl-C handler before it (memfit.cli.main)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "measure" and isinstance(value, ModuleType):
            value = value.measure
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """A public name from its module; a submodule (memfit.plan, memfit.estimate...) imported on first access."""
    if name == "measure":
        importlib.import_module(f"{__name__}.measure")  # binds the function (_Package.__setattr__)
        return globals()["measure"]
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME) | {"measure"})


from ._version import __version__  # noqa: E402  (one definition: the derivation cache keys on it)

__all__ = [
    "AppliedChanges", "FitLoop", "FitOutOfMemoryError", "apply_", "fit_steps", "launch_plan", "measure", "prepare",
    "shard", "Attention", "Bottleneck", "Category", "Checkpointing", "Engine", "ConfigError", "Diagnosis", "GPU", "Hardware",
    "MemfitError", "MemoryEstimate", "ModelSourceError", "ModelSpec", "Offload", "Optimizer", "ParamTensor", "Phase",
    "Plan", "PlanStep", "Precision", "Sharding", "Term", "TrainingSetup", "UnknownNameError", "as_hardware", "as_spec",
    "diagnose_memory", "estimate_memory", "get_gpu", "make_hardware", "optimize", "plan_memory", "typical_setup",
    "CheckResult", "check", "cheapest_gpu", "fewest_gpus", "max_micro_batch", "max_seq_len", "sweep",
]

# Submodules keep their names (memfit.plan, memfit.diagnose, memfit.estimate): the functions of the same name live
# there (memfit.plan.plan, memfit.diagnose.diagnose, memfit.estimate.analytic.estimate).
