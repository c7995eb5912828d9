"""EmittedConfig: one engine file, the reason for each of its settings, and what it cannot say by itself."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Mapping

from ..setup import Engine, Offload, Sharding, TrainingSetup

WARNING_KEY = "_memfit_warning"
"""The top-level key that carries the warning in a JSON file whose reader ignores unknown keys (deepspeed.json)."""

_FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".py": "python", ".md": "markdown"}


@dataclass(frozen=True)
class EmittedConfig:
    """A file memfit writes for an engine. `content` is a dict for JSON/YAML and text for Python/Markdown."""

    filename: str
    content: dict | str
    comments: Mapping[str, str] = field(default_factory=dict)
    """Dotted key ('zero_optimization.offload_optimizer') -> why the setting is there."""
    notes: tuple[str, ...] = ()
    """What the file cannot express: steps the user takes in code (load the model in bf16, pass an optimizer...)."""
    summary: str = ""
    """One line: what reads this file and what it is for."""
    warning: str = ""
    """Stamped at the top of the file when set (memfit writes "does not fit" here for a plan that does not fit):
    a comment in YAML and Python, a quote in Markdown, a top-level WARNING_KEY in JSON whose reader ignores
    unknown keys."""
    unmarkable: str = ""
    """For a JSON file whose reader refuses unknown keys: why the warning cannot be written into it."""

    @property
    def format(self) -> str:
        return _FORMATS.get(PurePath(self.filename).suffix, "text")

    @property
    def carries_warning(self) -> bool:
        """Whether `render()` shows `warning` (every format but a JSON file whose reader refuses unknown keys)."""
        return bool(self.warning) and not (self.format == "json" and self.unmarkable)

    def render(self) -> str:
        """The file's text. JSON carries no comments (engines parse it strictly); YAML carries them inline."""
        if isinstance(self.content, str):
            text = self.content if self.content.endswith("\n") else self.content + "\n"
            return self._header() + text
        if self.format == "yaml":
            return self._header() + "".join(_yaml_lines(self.content, self.comments, prefix="", indent=0))
        content = self.content
        if self.carries_warning:
            content = {WARNING_KEY: self.warning, **content}
        return json.dumps(content, indent=2) + "\n"

    def _header(self) -> str:
        if not self.warning:
            return ""
        if self.format == "markdown":
            return f"> **WARNING: {self.warning}**\n\n"
        if self.format in ("yaml", "python"):
            return "".join(f"# {line}\n" for line in textwrap.wrap(f"WARNING: {self.warning}", width=110)) + "\n"
        return ""

    def explain(self) -> str:
        """A Markdown section for the README: the file, why each setting, and the steps it cannot take itself."""
        lines = [f"## {self.filename}", ""]
        if self.summary:
            lines += [self.summary, ""]
        lines += [f"- `{key}`: {reason}" for key, reason in self.comments.items()]
        if self.notes:
            lines += ["", "Also needed:", ""] if self.comments else []
            lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def uses_deepspeed(setup: TrainingSetup) -> bool:
    """DeepSpeed runs the plan when it shards or offloads and the setup's engine is DeepSpeed (the default: it also
    expresses ZeRO-1, optimizer-only offload, sharded pure-bf16 states and 8-bit AdamW, which FSDP2 cannot)."""
    return setup.engine is Engine.DEEPSPEED and (setup.sharding is not Sharding.NONE or setup.offload is not Offload.NONE)


def uses_fsdp(setup: TrainingSetup) -> bool:
    """torch's FSDP2 runs the plan: engine torch with ZeRO-2/3 (TrainingSetup refuses what FSDP2 cannot express)."""
    return setup.engine is Engine.TORCH and setup.sharding.stage >= 2


def engine_work(setup: TrainingSetup) -> str:
    """What the engine is there for, e.g. 'zero3 sharding with optimizer+params offload to CPU'."""
    parts = [f"{setup.sharding} sharding"] if setup.sharding is not Sharding.NONE else []
    if setup.offload is not Offload.NONE:
        parts.append(f"{setup.offload} offload to CPU")
    return " with ".join(parts) or "plain data parallelism"


def describe(setup: TrainingSetup) -> str:
    """The plan in one line, for file headers and the README."""
    parts = [f"micro batch {setup.micro_batch_size} x seq {setup.seq_len}", f"grad accum {setup.grad_accum_steps}",
             f"{setup.num_gpus} GPU(s)", str(setup.precision), str(setup.optimizer),
             f"checkpointing {setup.checkpointing}", f"attention {setup.attention}", f"sharding {setup.sharding}",
             f"offload {setup.offload}"] + ([str(setup.finetune)] if setup.finetune.adapters else []) + (
                 [f"loss {setup.loss}"] if setup.loss.value != "standard" else []) + (
                 ["optimizer in backward"] if setup.optimizer_in_backward else []) + (
                 [words for section in setup.techniques if (words := section.plan_words())]) + (
                 ["torch.compile per block"] if setup.compile else [])
    return ", ".join(parts)


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string or list is a valid YAML flow scalar and quotes 'no', 'on', '1' that YAML would retype.
    return json.dumps(value)


def _yaml_lines(data: Mapping, comments: Mapping[str, str], *, prefix: str, indent: int):
    pad = " " * indent
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in comments:
            for line in textwrap.wrap(comments[dotted], width=max(40, 110 - indent)):
                yield f"{pad}# {line}\n"
        if isinstance(value, Mapping) and value:
            yield f"{pad}{key}:\n"
            yield from _yaml_lines(value, comments, prefix=f"{dotted}.", indent=indent + 2)
        else:
            yield f"{pad}{key}: {'{}' if isinstance(value, Mapping) else _yaml_scalar(value)}\n"
