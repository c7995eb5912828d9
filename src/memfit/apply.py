"""apply_(): make a live model train the way a setup (or a Plan's final setup) says. The only in-process mutation in
memfit. Every item of the setup is reported as a Change: what was done, or why nothing was (already so, not
applicable, the caller's job) -- never silent.

What it changes on the model: each item through its technique's one conversion (memfit.techniques.convert.ORDER:
the dtype, adapters, Linear swaps, attention, checkpointing, saved-tensor hooks, compile), the path the trace, the
model builder and the engines take too.
What it hands back for the training loop: `autocast()` for amp-*, `make_optimizer(model)`, the micro-batch size and
accumulation steps. What needs an engine (sharding) is only reported.

torch is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from .change import Change
from .errors import ConfigError
from .setup import TrainingSetup

@dataclass(frozen=True)
class AppliedChanges:
    """What apply_ did to the model and what the training loop must do with the rest."""

    setup: TrainingSetup
    changes: tuple[Change, ...]
    autocast: Callable[[], contextlib.AbstractContextManager]
    """`with applied.autocast(): loss = ...` -- torch.autocast for amp-* precisions, a no-op otherwise."""

    @property
    def micro_batch_size(self) -> int:
        return self.setup.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.setup.grad_accum_steps

    @property
    def changed(self) -> tuple[str, ...]:
        """Names of the items that modified the model."""
        return tuple(c.name for c in self.changes if c.changed)

    def __getitem__(self, name: str) -> Change:
        for change in self.changes:
            if change.name == name:
                return change
        raise KeyError(name)

    def make_optimizer(self, model, *, lr: float | None = None):
        """The setup's optimizer over `model`'s trainable parameters (bf16-master: behind an fp32 master copy)."""
        from ._torch.step import make_optimizer

        return make_optimizer(model, self.setup, lr=lr)

    def summary(self) -> str:
        return "\n".join(str(change) for change in self.changes)


def apply_(model, plan_or_setup) -> AppliedChanges:
    """Change `model` (an HF PreTrainedModel or any nn.Module) in place to train as the setup says.

    `plan_or_setup`: a Plan (its final setup), a TrainingSetup (every item), or only some items: a mapping of
    setup fields that only code can put on a model (memfit.techniques.convert.alone()) or the path of the
    memfit_apply.json `memfit plan --emit` writes for what TrainingArguments cannot express; then only those items
    are applied and the rest of the model is left as it is.

    Each item is its technique's registered conversion (memfit.techniques.convert), the same path the trace, the
    measurement's model builder and the engines take."""
    import torch

    from ._torch import step as torch_step
    from .techniques.convert import Target, convert_model

    setup, items = _what_to_apply(plan_or_setup)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"apply_ changes an nn.Module, got {type(model).__name__}")
    changes = convert_model(model, setup, Target(is_hf=torch_step.is_hf_model(model)), items)
    autocast = torch_step.autocast_factory(setup, torch_step.model_device(model).type)
    return AppliedChanges(setup, changes, autocast)


def _what_to_apply(given) -> tuple[TrainingSetup, tuple[str, ...] | None]:
    """(setup, items): every item (None) for a Plan / TrainingSetup; the named items for a mapping or a file."""
    import os
    from collections.abc import Mapping

    from .techniques.convert import alone

    setup = getattr(given, "final_setup", given)
    if isinstance(setup, TrainingSetup):
        return setup, None
    if isinstance(given, (str, os.PathLike)):
        from .readers import read_config

        given = {name: value for name, value in read_config(given).overrides.items() if name != "num_gpus"}
    if not isinstance(given, Mapping):
        raise ConfigError(f"apply_ needs a TrainingSetup, a Plan, a mapping of setup items or the path of "
                          f"memfit_apply.json, got {type(given).__name__}")
    names = alone()
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(f"apply_ takes {', '.join(names)} alone, not {', '.join(unknown)}: pass the whole "
                          "TrainingSetup for the rest")
    return TrainingSetup(**given), tuple(name for name in names if name in given)

