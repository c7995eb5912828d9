"""The one runtime path from a TrainingSetup to a live model: each technique module registers its `convert(model,
setup, target)` (the one place its change is applied to an nn.Module) and `convert_model` runs them in ORDER.

`memfit.apply_`, `memfit._torch.step.build_hf_model` (so every measurement and every trace of an HF model), the
trace's plain-module session and the engines (`memfit._torch.engine.prepare` / `shard`) all call `convert_model`,
so a trace checks what `apply_` does to a user's model. Items that need the training loop or an engine (the
optimizer, batching, sharding) register a conversion too: it changes nothing and says what the caller does.

The order (torchtitan's: model converters such as float8 first, then activation checkpointing, then compile):
precision and the LoRA / QLoRA base before anything wraps a Linear; float8 swaps Linears before checkpointing wraps
the blocks; compile last, over the wrapped blocks. Adapters and float8 never meet (TrainingSetup refuses the pair), and
adapters commute with checkpointing (peft replaces Linears inside a block; the checkpoint wrapper replaces the
block's forward; HF's switch flags the layers).

torch is imported inside the conversions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..setup import TrainingSetup

USER_LOOP, MEMFIT_LOOP = "user", "memfit"


@dataclass(frozen=True)
class Target:
    """What the conversions know about the model and who trains it."""

    is_hf: bool
    """A transformers PreTrainedModel: HF's own switches (checkpointing, attention) apply."""
    loop: str = USER_LOOP
    """USER_LOOP (apply_: the caller's loop or the HF Trainer calls model(**batch)); MEMFIT_LOOP (memfit's one loop,
    memfit._torch.step.training_step, which wraps forward and loss in activation offloading itself)."""
    blocks: Sequence[Any] | None = None
    """The blocks to checkpoint (the engine's FSDP units); None: memfit._torch.blocks' finder."""
    compile_backend: Any = "inductor"
    """torch.compile's backend for `setup.compile` ("partitioned": memfit._torch.compiled, no codegen)."""


Conversion = Callable[[Any, TrainingSetup, Target], Any]
"""(model, setup, target) -> memfit.apply.Change, or None when the setup does not use the technique."""

ORDER: tuple[str, ...] = ("precision", "finetune", "float8", "attention", "checkpointing", "optimizer", "batching",
                          "engine", "compile")
"""The order conversions run in, which is also the order of apply_'s report. A technique module whose item is not
here places it with `conversion(item, after=...)`."""

CONVERSIONS: dict[str, tuple[Conversion, ...]] = {}
"""Each item's conversions, in registration order: its technique module's, then any other module's that adds to the
item (an optimizer wrapper says how to wrap the loop's optimizer)."""


@dataclass(frozen=True)
class ApplyItem:
    """A setup field that only code can put on a model, since TrainingArguments cannot say it: `memfit plan --emit`
    writes it to memfit_apply.json (memfit.emit.apply_file), memfit's reader reads it back
    (memfit.readers.memfit_apply) and apply_ takes it alone. Its name is its conversion item (one of ORDER) and the
    setup field it sets."""

    name: str
    value: Callable[[TrainingSetup], Any]
    """The JSON value memfit_apply.json holds for the setup, or None when the file does not need it."""
    comment: str
    """The emitted file's comment on the item."""
    summary: Callable[[Any], str]
    """Its JSON value in the words of the notes ("activation offloading")."""
    parse: Callable[[Any], Any]
    """Its JSON value as the setup field's value; ValueError (its text: what the item takes) when it is none."""


_APPLY_ITEMS: dict[str, ApplyItem] = {}


def apply_item(item: ApplyItem) -> ApplyItem:
    """Register a technique module's ApplyItem (its item must be one of ORDER)."""
    if item.name not in ORDER:
        raise ValueError(f"{item.name} is not in memfit.techniques.convert.ORDER")
    _APPLY_ITEMS[item.name] = item
    return item


def apply_items() -> tuple[ApplyItem, ...]:
    """The registered ApplyItems in ORDER (the order of memfit_apply.json and of apply_'s report)."""
    return tuple(_APPLY_ITEMS[name] for name in ORDER if name in _APPLY_ITEMS)


def alone() -> tuple[str, ...]:
    """The items apply_ takes alone (a mapping, or the memfit_apply.json `memfit plan --emit` writes)."""
    return tuple(item.name for item in apply_items())


def conversion(item: str, *, after: str | None = None) -> Callable[[Conversion], Conversion]:
    """Register a technique module's `convert` as a conversion of `item`: one of ORDER, or a new item that runs
    right after the item `after` names."""
    global ORDER
    if item not in ORDER:
        if after not in ORDER:
            raise ValueError(f"{item} is not in memfit.techniques.convert.ORDER: place it with after=")
        at = ORDER.index(after) + 1
        ORDER = (*ORDER[:at], item, *ORDER[at:])

    def register(convert: Conversion) -> Conversion:
        CONVERSIONS[item] = (*CONVERSIONS.get(item, ()), convert)
        return convert

    return register


LoopContext = Callable[[Any, TrainingSetup], contextlib.AbstractContextManager]
"""(model, setup) -> the context memfit's own loop wraps a micro-step's forward and loss in (a nullcontext when the
setup does not use the technique)."""

LOOP_CONTEXTS: list[LoopContext] = []
"""What memfit's own training loop (MEMFIT_LOOP: memfit._torch.step.training_step) wraps each forward and loss in,
for a technique that acts there rather than on the model (activation offloading's saved-tensor hooks), in
registration order."""


def loop_context(function: LoopContext) -> LoopContext:
    """Register a technique module's LoopContext (its conversion says "memfit's loop does it" for MEMFIT_LOOP)."""
    LOOP_CONTEXTS.append(function)
    return function


@contextlib.contextmanager
def loop_contexts(model, setup: TrainingSetup) -> Iterator[None]:
    """Every registered LoopContext entered, in registration order (what training_step's forward runs in)."""
    with contextlib.ExitStack() as stack:
        for make in LOOP_CONTEXTS:
            stack.enter_context(make(model, setup))
        yield


def convert_model(model, setup: TrainingSetup, target: Target, items: Sequence[str] | None = None) -> tuple:
    """Run the registered conversions of `items` (default: all) on `model` in ORDER; their Changes, None dropped.
    Importing memfit.techniques registers every technique module's conversion."""
    wanted = ORDER if items is None else tuple(item for item in ORDER if item in items)
    changes = (convert(model, setup, target) for item in wanted for convert in CONVERSIONS.get(item, ()))
    return tuple(change for change in changes if change is not None)
