"""memfit_apply.json (memfit.emit.apply_file): the sized settings TrainingArguments cannot carry, which
memfit.apply_ puts on the loaded model. Read back like the engine files, so the emitted set re-sizes to the plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..setup import Checkpointing
from ._reader import NOT_RELEVANT, Reader

APPLY_KEY = "memfit_apply"  # memfit.emit.apply_file.APPLY_KEY (the readers import nothing from emit)


def map_memfit_apply(read: Reader, data: dict, ctx: Any) -> None:
    items = data.get(APPLY_KEY)
    if not isinstance(items, Mapping):
        read.unmappable("checkpointing", APPLY_KEY, items, "a mapping of setup items ({'checkpointing': ...})")
        return
    with read.scope(read.file, APPLY_KEY + "."):
        for key, value in items.items():
            if key == "checkpointing":
                try:
                    mode = Checkpointing.parse(str(value))
                except (ConfigError, ValueError):
                    read.unmappable("checkpointing", key, value, "not a checkpointing mode memfit sizes")
                    continue
                read.set("checkpointing", mode, key, value, "applied by memfit.apply_")
            elif key == "activation_offload":
                if not isinstance(value, bool):
                    read.unmappable("activation_offload", key, value, "true or false")
                    continue
                read.set("activation_offload", value, key, value, "applied by memfit.apply_")
            else:
                read.unmappable(str(key), key, value, "memfit.apply_ takes checkpointing and activation_offload")
    for key, value in data.items():
        if key != APPLY_KEY:
            read.ignore(str(key), value, f"{NOT_RELEVANT} (memfit.apply_ reads only {APPLY_KEY})")
