"""RL post-training (issue 23): an RL step as phases with several models, each phase's memory on one GPU, and the
vLLM utilization that leaves the trainer room. Imports nothing from memfit.cli."""

from .phases import estimate_rl
from .workload import Phase, RLEstimate, RLSetup, VllmAdvice

__all__ = ["Phase", "RLEstimate", "RLSetup", "VllmAdvice", "estimate_rl"]
