"""What applying one item of a setup to a live model did: memfit.apply_ reports one per item, and the torch side's
conversions return them too. A module of its own, below both, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Change:
    """One item of the setup: `changed` says whether the model was modified; `detail` says what or why not."""

    name: str
    changed: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {'changed' if self.changed else 'unchanged'} - {self.detail}"
