"""memfit_apply.json: the sized settings that neither TrainingArguments nor the engine files can carry, as data that
`memfit.apply_(model, path)` applies to the loaded model and memfit's readers read back.

TrainingArguments checkpoints whole blocks only (transformers' gradient_checkpointing / activation_checkpointing),
and has no activation offloading (TRL's SFTConfig, axolotl and torchtune have their own switch). A plan that sized
selective checkpointing or activation offloading without them would run a different step from the one sized, so
the emitter writes them here, and every route that prints the config names the one line that applies them."""

from __future__ import annotations

from ..setup import TrainingSetup
from ..techniques.convert import apply_items as registered_items
from .emitted import EmittedConfig

APPLY_KEY = "memfit_apply"
"""The one top-level key of memfit_apply.json: {setup field: value} (what memfit.readers detects the format by)."""
APPLY_FILE = "memfit_apply.json"


def apply_items(setup: TrainingSetup) -> dict:
    """{TrainingSetup field: JSON value} of what only memfit.apply_ can put on the model (empty when nothing): each
    registered memfit.techniques.convert.ApplyItem's value."""
    values = ((item.name, item.value(setup)) for item in registered_items())
    return {name: value for name, value in values if value is not None}


def apply_call(setup: TrainingSetup, path: str | None = None) -> str | None:
    """The line that applies apply_items to a loaded model: with `path`, the emitted file; else the items inline."""
    items = apply_items(setup)
    if not items:
        return None
    target = repr(path) if path is not None else "{" + ", ".join(
        f"{k!r}: {v!r}" for k, v in items.items()) + "}"
    return f"memfit.apply_(model, {target})"


def apply_summary(setup: TrainingSetup) -> str:
    """'checkpointing selective-op and activation offloading': what the file holds, for notes."""
    items = apply_items(setup)
    return " and ".join(item.summary(items[item.name]) for item in registered_items() if item.name in items)


def apply_file(setup: TrainingSetup, *, path: str = APPLY_FILE) -> EmittedConfig | None:
    """The file, or None when TrainingArguments and the engine files carry the whole setup. `path`: how the
    other files name it (relative to where memfit ran)."""
    items = apply_items(setup)
    if not items:
        return None
    comments = {f"{APPLY_KEY}.{item.name}": item.comment for item in registered_items() if item.name in items}
    notes = (f"`{apply_call(setup, path)}` on the loaded model (after get_peft_model, before Trainer(...)): "
             f"memfit sized {apply_summary(setup)}, which TrainingArguments cannot express; without this line the "
             "step is not the one memfit sized.",)
    return EmittedConfig(APPLY_FILE, {APPLY_KEY: items}, comments, notes,
                         summary="`memfit.apply_(model, path)`: what training_args.json cannot express, applied "
                                 "to the loaded model")
