"""Techniques, one module each, registered by key. Importing the package registers them all: a technique that
declares its own setup section, hooks and fragments (docs/design.md, "Adding a technique") is one line below."""

from . import (activation_offload, attention, checkpointing, compile, lora, loss, micro_batch,  # noqa: F401
               offload, optimizer8bit, precision, zero)
from . import torchao_offload  # noqa: F401
from . import float8  # noqa: F401  (last: its words follow the other sections' and torch.compile's, as before)
from .base import LADDERS, REGISTRY, Context, Proposal, Skip, Technique

__all__ = ["LADDERS", "REGISTRY", "Context", "Proposal", "Skip", "Technique"]
