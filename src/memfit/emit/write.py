"""Write every engine file for a plan into one directory, with a README saying what each file is for.

memfit records what it wrote (name and SHA-256) in a manifest, so a later run may replace its own untouched
files but never a file the user wrote or edited."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError
from ..hardware import Hardware
from ..setup import TrainingSetup
from .accelerate import accelerate_file
from .apply_file import APPLY_FILE, apply_file
from .deepspeed import deepspeed_file
from .emitted import EmittedConfig, describe, uses_deepspeed
from .fsdp import fsdp2_file, fsdp2_unsupported
from .hf_trainer import hf_model_file, hf_trainer_file
from .peft import peft_file

MANIFEST = ".memfit-emit.json"


def config_path(directory: str | Path, filename: str) -> str:
    """How one emitted file names another: relative to the directory memfit runs in (`configs/deepspeed.json`),
    where the launch normally happens too, so the files name no absolute path of this machine. An absolute
    directory is made relative when it lies under the current directory and is otherwise kept as the user gave it."""
    directory = Path(directory).expanduser()
    if directory.is_absolute():
        try:
            directory = directory.relative_to(Path.cwd())
        except (ValueError, OSError):
            return str(directory / filename)
    return (directory / filename).as_posix()


def emitted_files(setup: TrainingSetup, hardware: Hardware, directory: Path, *, warning: str | None = None,
                  auto_class: str = "AutoModelForCausalLM") -> tuple[list[EmittedConfig], dict]:
    """The files for the plan, and {filename: why it is not written} for the ones that do not apply. With
    `warning` (e.g. "does not fit"), every file that can carry it starts with it; see EmittedConfig.warning.
    `auto_class`: the transformers class that loads the model (ModelSpec.auto_class)."""
    deepspeed_path = config_path(directory, "deepspeed.json")
    files = [hf_trainer_file(setup, deepspeed_path=deepspeed_path), hf_model_file(setup, auto_class=auto_class)]
    skipped: dict[str, str] = {}
    adapters = peft_file(setup)
    if adapters is not None:
        files.append(adapters)
    applied = apply_file(setup, path=config_path(directory, APPLY_FILE))
    if applied is not None:  # what TrainingArguments cannot carry (selective checkpointing, activation offload)
        files.append(applied)
    if uses_deepspeed(setup):
        try:
            files.append(deepspeed_file(setup))
        except ConfigError as error:  # a plan DeepSpeed cannot run is an error only on the DeepSpeed route
            raise ConfigError(f"cannot write deepspeed.json: {error}") from error
    else:
        skipped["deepspeed.json"] = "the plan neither shards nor offloads, so DeepSpeed is not needed"
    files.append(accelerate_file(setup, hardware, deepspeed_path=deepspeed_path))
    reason = fsdp2_unsupported(setup)
    if reason:
        skipped["fsdp2_shard.py"] = skipped["accelerate_fsdp2.yaml"] = reason
    else:
        files += [fsdp2_file(setup), accelerate_file(setup, hardware, backend="fsdp", filename="accelerate_fsdp2.yaml")]
    if warning:
        files = [replace(f, warning=warning) for f in files]
    files.append(_readme(setup, files, skipped, deepspeed_path, warning))
    return files, skipped


def unmarked_files(files: list[EmittedConfig]) -> dict[str, str]:
    """{filename: why} for the files that carry a warning only in the README (JSON read by a strict parser)."""
    return {f.filename: f.unmarkable for f in files if f.warning and not f.carries_warning}


def write_all(setup: TrainingSetup, hardware: Hardware, directory: str | Path, *, force: bool = False,
              warning: str | None = None, auto_class: str = "AutoModelForCausalLM") -> list[Path]:
    """Write the plan's engine files into `directory` (created if missing) and return their paths.

    Replaces files memfit wrote there before and nobody changed since; refuses, naming every such file, to replace
    anything else unless `force`. `warning` is stamped into every file that can carry it (emitted_files)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} is a file, not a directory: choose a directory for the engine configs")
    files, _ = emitted_files(setup, hardware, directory, warning=warning, auto_class=auto_class)
    written = _read_manifest(directory)
    if not force:
        _refuse_foreign_files(directory, [f.filename for f in files], written)
    _remove_stale(directory, {f.filename for f in files}, written)
    directory.mkdir(parents=True, exist_ok=True)
    paths, manifest = [], {}
    for emitted in files:
        text = emitted.render()
        path = directory / emitted.filename
        path.write_text(text, encoding="utf-8")
        paths.append(path)
        manifest[emitted.filename] = _digest(text)
    (directory / MANIFEST).write_text(json.dumps({"files": manifest}, indent=2) + "\n", encoding="utf-8")
    return paths


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_manifest(directory: Path) -> dict[str, str]:
    try:
        data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        return {str(k): str(v) for k, v in data.get("files", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _ours(path: Path, written: dict[str, str]) -> bool:
    """Written by memfit and unchanged since."""
    try:
        return path.is_file() and written.get(path.name) == _digest(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False


def _refuse_foreign_files(directory: Path, names: list[str], written: dict[str, str]) -> None:
    foreign = [name for name in names if (directory / name).exists() and not _ours(directory / name, written)]
    if foreign:
        raise ConfigError(f"{directory} already has {', '.join(foreign)} not written by memfit (or edited since): "
                          "choose another directory or pass force=True (--force) to overwrite")


def _remove_stale(directory: Path, names: set[str], written: dict[str, str]) -> None:
    """Files an earlier plan wrote that this plan does not (e.g. deepspeed.json), if nobody edited them."""
    for name in written:
        path = directory / name
        if name not in names and Path(name).name == name and _ours(path, written):
            path.unlink()


def _readme(setup: TrainingSetup, files: list[EmittedConfig], skipped: dict[str, str], deepspeed_path: str,
            warning: str | None) -> EmittedConfig:
    lines = ["# Engine configs written by memfit", "", f"Plan: {describe(setup)}.", ""]
    unmarked = unmarked_files(files)
    if warning and unmarked:
        lines += ["These files cannot say so themselves (their readers refuse unknown keys), so the warning above is "
                  "only here:", ""] + [f"- `{name}`: {why}" for name, why in unmarked.items()] + [""]
    lines += ["| File | What it is for |", "| --- | --- |"]
    lines += [f"| `{f.filename}` | {f.summary} |" for f in files]
    if skipped:
        lines += ["", "Not written:", ""] + [f"- `{name}`: {why}" for name, why in skipped.items()]
    lines += ["", "JSON cannot hold comments, so the reason for each setting is listed here. memfit records what it "
              f"wrote in `{MANIFEST}`: a rerun replaces its own untouched files and refuses to touch any other.", ""]
    if any(f.filename == "deepspeed.json" for f in files):
        lines += [f"The other files name deepspeed.json as `{deepspeed_path}`, relative to the directory memfit ran "
                  "in: launch from there, or change the path where you keep the files.", ""]
    text = "\n".join(lines) + "\n" + "\n".join(f.explain() for f in files)
    return EmittedConfig("README.md", text, summary="this file", warning=warning or "")
