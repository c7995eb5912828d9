"""Techniques, one module each, registered by key. Importing the package registers them all."""

from . import (attention, checkpointing, compile, lora, loss, micro_batch, offload, optimizer8bit,  # noqa: F401
               precision, zero)
from .base import LADDERS, REGISTRY, Context, Proposal, Skip, Technique

__all__ = ["LADDERS", "REGISTRY", "Context", "Proposal", "Skip", "Technique"]
