"""Techniques, one module each, registered by key. Importing the package registers them all."""

from . import (activation_offload, attention, checkpointing, compile, float8, lora, loss, micro_batch,  # noqa: F401
               offload, optimizer8bit, precision, zero)
from .base import LADDERS, REGISTRY, Context, Proposal, Skip, Technique

__all__ = ["LADDERS", "REGISTRY", "Context", "Proposal", "Skip", "Technique"]
