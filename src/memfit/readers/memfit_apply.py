"""memfit_apply.json (memfit.emit.apply_file): the sized settings TrainingArguments cannot carry, which
memfit.apply_ puts on the loaded model. Read back like the engine files, so the emitted set re-sizes to the plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..techniques.convert import alone, apply_items
from ._reader import NOT_RELEVANT, Reader

APPLY_KEY = "memfit_apply"  # memfit.emit.apply_file.APPLY_KEY (the readers import nothing from emit)


def map_memfit_apply(read: Reader, data: dict, ctx: Any) -> None:
    items = data.get(APPLY_KEY)
    if not isinstance(items, Mapping):
        read.unmappable("checkpointing", APPLY_KEY, items, "a mapping of setup items ({'checkpointing': ...})")
        return
    with read.scope(read.file, APPLY_KEY + "."):
        registered = {item.name: item for item in apply_items()}  # memfit.techniques.convert.ApplyItem
        for key, value in items.items():
            item = registered.get(key)
            if item is None:
                read.unmappable(str(key), key, value, f"memfit.apply_ takes {' and '.join(alone())}")
                continue
            try:
                parsed = item.parse(value)
            except ValueError as error:
                read.unmappable(key, key, value, str(error))
                continue
            read.set(key, parsed, key, value, "applied by memfit.apply_")
    for key, value in data.items():
        if key != APPLY_KEY:
            read.ignore(str(key), value, f"{NOT_RELEVANT} (memfit.apply_ reads only {APPLY_KEY})")
