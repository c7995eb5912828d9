"""A training command line (`accelerate launch sdxl_train_network.py --resolution 1024,1024 ...`, saved in a
file or given after `--`) -> the launcher's options, the script's name and its arguments as a mapping."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError


@dataclass(frozen=True)
class Command:
    script: str
    """The training script's file name ('' when the line holds arguments only)."""
    args: dict[str, Any]
    launcher: dict[str, Any] = field(default_factory=dict)
    """`accelerate launch` / `torchrun` options before the script."""


def split_text(text: str, shown: str) -> list[str]:
    """The words of the one command in `text` that runs a .py script (continuation backslashes and carets joined,
    comments dropped); a file without one is arguments only."""
    joined = text.replace("\\\r\n", " ").replace("\\\n", " ").replace("^\r\n", " ").replace("^\n", " ")
    lines = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError as error:
            raise ConfigError(f"{shown}: cannot split the command line: {error}") from None
        if words:
            lines.append(words)
    runs = [words for words in lines if any(w.endswith(".py") for w in words)]
    if len(runs) > 1:
        raise ConfigError(f"{shown} runs {len(runs)} training scripts: give a file with one command")
    if runs:
        return runs[0]
    return [word for words in lines for word in words]


def parse(words: list[str], shown: str) -> Command:
    scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
    if scripts:
        at = scripts[0]
        launcher = _arguments(words[:at], shown, strict=False)  # accelerate launch / torchrun options
        return Command(Path(words[at]).name, _arguments(words[at + 1:], shown), launcher)
    return Command("", _arguments(words, shown))


def _arguments(words: list[str], shown: str, *, strict: bool = True) -> dict[str, Any]:
    """'--name value', '--name=value', '--flag' and '--name v1 v2' (nargs='*') -> {name: value}; a dash in a name
    reads as an underscore, as argparse stores it."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or word == "--":
            if strict:
                raise ConfigError(f"{shown}: '{word}' is not an --argument")
            i += 1
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("-", "_")
        if eq:
            values, i = [value], i + 1
        else:
            j = i + 1
            while j < len(words) and not words[j].startswith("--"):
                j += 1
            values, i = words[i + 1:j], j
        out[name] = True if not values else scalar(values[0]) if len(values) == 1 else [scalar(v) for v in values]
    return out


def scalar(text: str) -> Any:
    """A word as argparse's type= would give it: whole numbers and decimals as numbers, the rest as text."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
