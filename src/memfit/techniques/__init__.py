"""Techniques, one module each, registered by key. Importing the package registers them all: a technique that
declares its own setup section, hooks and fragments (docs/design.md, "Adding a technique") is one line below."""

from . import (activation_offload, attention, checkpointing, compile, float8, lora, loss, micro_batch,  # noqa: F401
               offload, optimizer8bit, precision, zero)
from . import torchao_offload  # noqa: F401
from .base import LADDERS, REGISTRY, Context, Proposal, Skip, Technique

__all__ = ["LADDERS", "REGISTRY", "Context", "Proposal", "Skip", "Technique"]
