"""memfit: know before you run where GPU memory goes in a training step, and the cheapest ordered fix."""

from .errors import ConfigError, MemfitError, ModelSourceError, UnknownNameError
from .estimate.result import Category, MemoryEstimate, Phase, Term
from .hardware import GPU, Hardware, get_gpu, make_hardware
from .model_spec import ModelSpec, ParamTensor
from .setup import Attention, Checkpointing, Offload, Optimizer, Precision, Sharding, TrainingSetup

__version__ = "0.1.0"

__all__ = [
    "Attention", "Category", "Checkpointing", "ConfigError", "GPU", "Hardware", "MemfitError", "MemoryEstimate",
    "ModelSourceError", "ModelSpec", "Offload", "Optimizer", "ParamTensor", "Phase", "Precision", "Sharding", "Term",
    "TrainingSetup", "UnknownNameError", "get_gpu", "make_hardware",
]
