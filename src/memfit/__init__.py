"""memfit: know before you run where GPU memory goes in a training step, and the cheapest ordered fix.

    >>> import memfit
    >>> p = memfit.plan_memory("llama-3.1-8b", hardware="A100-80GB")
    >>> p.initial_diagnosis.bottleneck, [s.title for s in p.steps]
"""

from .apply import AppliedChanges, apply_
from .fit import FitLoop, FitOutOfMemoryError, fit_steps
from .launch import launch_plan, prepare, shard
from .measure import measure
from .callbacks import CheckResult, check
from .solve import cheapest_gpu, fewest_gpus, max_micro_batch, max_seq_len, sweep
from .api import as_hardware, as_spec, diagnose_memory, estimate_memory, plan_memory, typical_setup
from .diagnose import Bottleneck, Diagnosis
from .errors import ConfigError, MemfitError, ModelSourceError, UnknownNameError
from .estimate.result import Category, MemoryEstimate, Phase, Term
from .hardware import GPU, Hardware, get_gpu, make_hardware
from .model_spec import ModelSpec, ParamTensor
from .plan import Plan, PlanStep, optimize
from .setup import Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup

__version__ = "0.1.0"

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
