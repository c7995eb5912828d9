"""RL post-training (issue 23): an RL step as phases with several models, each phase's memory on one GPU, the vLLM
utilization that leaves the trainer room, the readers of TRL / verl / OpenRLHF configs and the RL ladder. Imports
nothing from memfit.cli; `measure` (torch, trl) is imported by whoever measures."""

from . import frameworks, ladder, reader, render, workload
from .inputs import RLInputs, rl_inputs
from .phases import estimate_rl
from .workload import Phase, RLEstimate, RLSetup, VllmAdvice

__all__ = ["Phase", "RLEstimate", "RLInputs", "RLSetup", "VllmAdvice", "estimate_rl", "frameworks", "ladder",
           "reader", "render", "rl_inputs", "workload"]
