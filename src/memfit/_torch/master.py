"""bf16 parameters trained through an fp32 master copy: what DeepSpeed's bf16 mode (BF16_Optimizer) and Megatron
(Float16OptimizerWithFloat16Params) do, in a few lines.

The model holds bf16 parameters and produces bf16 gradients. This optimizer holds an fp32 copy of every parameter
(4 B/param) and runs the inner optimizer on the copies, so its states are fp32 too (8 B/param for AdamW). In `step`,
each bf16 gradient is upcast into its master's `.grad` and the bf16 gradient released as it goes, so during the step
gradients cost 4 B/param instead of 2 (DeepSpeed keeps a persistent fp32 gradient buffer, 4 B/param, next to the bf16
one); then the inner optimizer steps, the fp32 gradients are dropped and the masters are copied back, rounded to bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer built on fp32 copies of `params`. `param_groups` and `state` are the inner optimizer's, so
    LR schedulers and HF's Trainer work on it unchanged."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.model_params = list(params)
        self.master_params = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.model_params]
        inner = make_inner(self.master_params)
        super().__init__(self.master_params, dict(inner.defaults))
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for model_param, master in zip(self.model_params, self.master_params):
            master.grad = None if model_param.grad is None else model_param.grad.to(torch.float32)
            model_param.grad = None
        self.inner.step()
        for model_param, master in zip(self.model_params, self.master_params):
            master.grad = None
            model_param.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in (*self.model_params, *self.master_params):
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        state["memfit_master_params"] = [m.detach() for m in self.master_params]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("memfit_master_params", None)
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        if masters is not None:
            with torch.no_grad():
                for master, saved, model_param in zip(self.master_params, masters, self.model_params):
                    master.copy_(saved)
                    model_param.copy_(saved)

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer(fp32 master copy, inner={self.inner.__class__.__name__})"
