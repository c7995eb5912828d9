"""Techniques, one module each, registered by key. Importing the package registers them all."""

from . import (attention, checkpointing, lora, loss, micro_batch, offload, optimizer8bit, precision,  # noqa: F401
               zero)
from .base import LADDERS, REGISTRY, Context, Proposal, Skip, Technique

__all__ = ["LADDERS", "REGISTRY", "Context", "Proposal", "Skip", "Technique"]
