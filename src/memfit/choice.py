"""Choice: a string enum whose value is what the user types (setup options, fine-tuning methods)."""

from __future__ import annotations

from enum import Enum

from .errors import ConfigError


class Choice(str, Enum):
    """A string enum whose value is what the user types on the command line."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, text: "str | Choice") -> "Choice":
        if isinstance(text, cls):
            return text
        key = str(text).strip().lower().replace("_", "-")
        for member in cls:
            if key == member.value or key in member.aliases():
                return member
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"unknown {cls.label()} '{text}': choose one of {choices}")

    def aliases(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def label(cls) -> str:
        return cls.__name__.lower()
