"""Write every engine file for a plan into one directory, with a README saying what each file is for.

memfit records what it wrote (name and SHA-256) in a manifest, so a later run may replace its own untouched
files but never a file the user wrote or edited."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from ..atomic import write_files
from ..errors import ConfigError
from ..hardware import Hardware
from ..setup import ModelCode, TrainingSetup
from .accelerate import accelerate_file
from .apply_file import APPLY_FILE, apply_file
from .deepspeed import deepspeed_file
from .emitted import EmittedConfig, describe, uses_deepspeed
from .fsdp import fsdp2_file, fsdp2_unsupported
from .hf_trainer import hf_model_file, hf_trainer_file
from .litgpt import litgpt_file
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
                  auto_class: str = "AutoModelForCausalLM", hub_id: str | None = None,
                  model_type: str = "") -> tuple[list[EmittedConfig], dict]:
    """The files for the plan, and {filename: why it is not written} for the ones that do not apply. With
    `warning` (e.g. "does not fit"), every file that can carry it starts with it; see EmittedConfig.warning.
    `auto_class`: the transformers class that loads the model (ModelSpec.auto_class); `hub_id` / `model_type`:
    the checkpoint and its family, for a LitGPT config. A setup sized with LitGPT's own model (model code litgpt)
    gets LitGPT's config alone: the other files would run the Hugging Face model, which is sized differently."""
    if setup.model_code is ModelCode.LITGPT:
        litgpt = _litgpt_files(setup, hub_id, model_type)
        if litgpt is not None:
            files, skipped = litgpt
            if warning:
                files = [replace(f, warning=warning) for f in files]
            return files + [_readme(setup, files, skipped, "", warning)], skipped
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
    launch_setup = _launch_setup_file(setup)
    if launch_setup is not None:
        files.append(launch_setup)
    if warning:
        files = [replace(f, warning=warning) for f in files]
    files.append(_readme(setup, files, skipped, deepspeed_path, warning))
    return files, skipped


def _litgpt_files(setup: TrainingSetup, hub_id: str | None,
                  model_type: str) -> tuple[list[EmittedConfig], dict[str, str]] | None:
    """LitGPT's config and why the rest is not written; None when LitGPT's scripts cannot run the setup (its
    other files are written then, for the setup as sized)."""
    try:
        litgpt = litgpt_file(setup, hub_id=hub_id, model_type=model_type or "llama")
    except ConfigError:
        return None
    why = ("sized with LitGPT's own model (model code litgpt): litgpt.yaml runs it; this file would run the Hugging "
           "Face model, which memfit sizes differently")
    return [litgpt], {name: why for name in ("training_args.json", "model_kwargs.json", "deepspeed.json",
                                             "accelerate.yaml")}


def _launch_setup_file(setup: TrainingSetup) -> EmittedConfig | None:
    """memfit_setup.json when `memfit plan` prints launch commands for the setup: they name it (MEMFIT_SETUP_FILE)
    instead of repeating ~1,000 characters of JSON on every node's line."""
    from ..launch import ENV_SETUP_FILE, SETUP_FILE, launches, setup_file_text

    if not launches(setup, setup.num_gpus):
        return None
    # The text, not a dict: its keys are TrainingSetup's fields (README and `memfit plan` say what each is).
    return EmittedConfig(SETUP_FILE, setup_file_text(setup),
                         summary=f"the setup every rank reads: the launch commands `memfit plan` prints name it "
                                 f"({ENV_SETUP_FILE}; memfit.launch.prepare reads it)",
                         unmarkable="memfit.launch reads it as TrainingSetup fields, which has no warning field")


def unmarked_files(files: list[EmittedConfig]) -> dict[str, str]:
    """{filename: why} for the files that carry a warning only in the README (JSON read by a strict parser)."""
    return {f.filename: f.unmarkable for f in files if f.warning and not f.carries_warning}


def write_all(setup: TrainingSetup, hardware: Hardware, directory: str | Path, *, force: bool = False,
              warning: str | None = None, auto_class: str = "AutoModelForCausalLM", hub_id: str | None = None,
              model_type: str = "") -> list[Path]:
    """Write the plan's engine files into `directory` (created if missing) and return their paths.

    Replaces files memfit wrote there before and nobody changed since; refuses, naming every such file, to replace
    anything else unless `force`. Never writes through a symbolic link or into anything but a regular file of
    `directory` (refused even with `force`). All or nothing (memfit.atomic): every file and the manifest are
    written under temporary names first, so a full disk or a Ctrl-C leaves the directory as it was.
    `warning` is stamped into every file that can carry it (emitted_files)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} is a file, not a directory: choose a directory for the engine configs")
    files, _ = emitted_files(setup, hardware, directory, warning=warning, auto_class=auto_class, hub_id=hub_id,
                             model_type=model_type)
    _refuse_non_regular(directory, [f.filename for f in files] + [MANIFEST])
    written = _read_manifest(directory)
    if not force:
        _refuse_foreign_files(directory, [f.filename for f in files], written)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    texts = {emitted.filename: emitted.render() for emitted in files}
    manifest = json.dumps({"files": {name: _digest(text) for name, text in texts.items()}}, indent=2) + "\n"
    try:
        write_files([(directory / name, text.encode("utf-8")) for name, text in texts.items()]
                    + [(directory / MANIFEST, manifest.encode("utf-8"))])
    except BaseException:
        if created:
            _remove_empty(directory)
        raise
    _remove_stale(directory, set(texts), written)
    return [directory / name for name in texts]


def _refuse_non_regular(directory: Path, names: list[str]) -> None:
    """A symbolic link (or a folder, a FIFO...) where memfit writes a file: refused, --force or not; writing
    through a link would change a file outside `directory`."""
    for name in names:
        path = directory / name
        if path.is_symlink():
            raise ConfigError(f"{path} is a symbolic link: memfit writes only regular files inside {directory}; "
                              "remove the link or choose another directory")
        if path.exists() and not path.is_file():
            raise ConfigError(f"{path} is not a regular file: remove it or choose another directory")


def _remove_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_MAX_OWN_BYTES = 4 * 1024 * 1024
"""memfit's files are a few kB: a larger file of the same name is not one it wrote (and is not read whole)."""


def _regular_text(path: Path) -> str | None:
    """The text of a regular file of memfit's size (never through a link, never a FIFO or device), else None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_OWN_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _read_manifest(directory: Path) -> dict[str, str]:
    try:
        data = json.loads(_regular_text(directory / MANIFEST) or "{}")
        return {str(k): str(v) for k, v in data.get("files", {}).items()}
    except (ValueError, AttributeError, RecursionError):
        return {}


def _ours(path: Path, written: dict[str, str]) -> bool:
    """Written by memfit and unchanged since."""
    text = _regular_text(path)
    return text is not None and written.get(path.name) == _digest(text)


def _refuse_foreign_files(directory: Path, names: list[str], written: dict[str, str]) -> None:
    foreign = [name for name in names if (directory / name).exists() and not _ours(directory / name, written)]
    if foreign:
        raise ConfigError(f"{directory} already has {', '.join(foreign)} not written by memfit (or edited since): "
                          "choose another directory or pass force=True (--force) to overwrite")


def _remove_stale(directory: Path, names: set[str], written: dict[str, str]) -> None:
    """Files an earlier plan wrote that this plan does not (e.g. deepspeed.json), if nobody edited them."""
    for name in written:
        path = directory / name
        if name not in names and Path(name).name == name and name != MANIFEST and _ours(path, written):
            try:
                path.unlink()
            except OSError:
                pass  # the new files are written; a stale one left behind is listed in no manifest


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
