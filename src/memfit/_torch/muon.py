"""torch.optim.Muon as it is meant to be used (torch's Muon docstring: hidden weight matrices only; embeddings, the
output layer, gains and biases with a standard method): Muon over the 2-D parameters of the repeated blocks, AdamW
(foreach, torch's CUDA default) over every other trainable parameter, stepped one after the other.
memfit.estimate.muon sizes the same split from the model graph (the Linear nodes of the stacks)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .blocks import find_blocks


def split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the blocks' trainable 2-D parameters, every other trainable parameter), each in module order."""
    inside = {id(p) for block in find_blocks(model) for p in block.parameters() if p.ndim == 2}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in inside], [p for p in params if id(p) not in inside]


class MuonWithAdamW:
    """Two optimizers stepped as one (step, zero_grad, state, param_groups: what the training loop, the GradScaler
    and memfit.measure use)."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        matrices, rest = split(model)
        if not matrices:
            raise ConfigError("muon found no 2-D weights inside repeated blocks: use an AdamW variant")
        self.parts = [torch.optim.Muon(matrices, lr=lr)]
        if rest:
            self.parts.append(torch.optim.AdamW(rest, lr=lr, foreach=True))

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> dict:
        return {key: value for part in self.parts for key, value in part.state.items()}

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)
