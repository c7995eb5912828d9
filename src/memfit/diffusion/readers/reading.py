"""Read a diffusion trainer's config: the file's format from its content and name, its reader, and what it set,
read with no effect, and left out (and why), in memfit.readers' ReadEntry / IgnoredEntry records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...readers._mapper import ConfigFile
from ...readers._reader import IgnoredEntry, ReadEntry, Reader, jsonable
from ...readers.files import display_path, load_mapping, read_config_bytes, resolve_reference
from . import ai_toolkit, diffusers_scripts, kohya
from .commandline import Command, parse, split_text
from ..presets import catalog_names, resolve_model
from .common import LEVERS, OPTIONS, load_toml

FORMATS = {"kohya": "kohya sd-scripts arguments", "diffusers": "diffusers DreamBooth script arguments",
           "ai-toolkit": "ai-toolkit job config"}
MUSUBI = ("musubi-tuner trains video models (HunyuanVideo, Wan, FramePack) and image models (FLUX.1 Kontext, whose "
          "reference image doubles the image tokens; FLUX.2, Qwen-Image, Z-Image, HiDream-O1 and more): none is in "
          "memfit's diffusion catalog yet")
MUSUBI_SCRIPTS = ("hv_", "wan_", "fpack_", "flux_kontext_", "flux_2_", "qwen_image_", "zimage_", "hidream_",
                  "kandinsky5_", "krea2_", "ideogram4_")
"""musubi-tuner's training scripts (src/musubi_tuner/*_train_network.py, *_train.py) by their name's start."""


@dataclass(frozen=True)
class DiffusionReading:
    """What a config gives `memfit diffusion`: `kwargs` for memfit.diffusion.api.size_run (resolution as
    (height, width); base_dtype / blocks_to_swap only when set), the model it names (a catalog name; None when it
    names a local checkpoint: MODEL then), and every field read or left out."""

    files: tuple[ConfigFile, ...]
    format: str
    model: str | None
    kwargs: dict[str, Any]
    read: tuple[ReadEntry, ...]
    ignored: tuple[IgnoredEntry, ...]
    notes: tuple[str, ...] = ()
    family: str | None = None
    """The family the script / network / model says it trains (flux, sd3, sdxl; None: not said)."""

    @property
    def levers(self) -> dict[str, Any]:
        """The keywords of levers size_run does not take yet (LEVERS) that the config sets."""
        return {k: v for k, v in self.kwargs.items() if k in LEVERS}

    def to_dict(self) -> dict:
        return {"files": [f.to_dict() for f in self.files], "format": self.format, "model": self.model,
                "kwargs": jsonable(self.kwargs), "read": [e.to_dict() for e in self.read],
                "ignored": [e.to_dict() for e in self.ignored], "notes": list(self.notes),
                "family": self.family}


def read_diffusion_config(path: str | Path | None = None, *, command: list[str] | None = None,
                          overridden: dict[str, str] | None = None) -> DiffusionReading:
    """A kohya sd-scripts TOML, an ai-toolkit YAML, or a command line (a .sh / .txt file, or `command`'s words)
    running a kohya or diffusers training script -> DiffusionReading. `overridden`: size_run keywords the caller
    gives itself ({keyword: '--option'}): the config's value is recorded as overridden and never refused."""
    if path is None and not command:
        raise ConfigError("give a config file or a command line")
    notes: list[str] = []
    if command:
        shown = "the command line"
        return _command(parse(list(command), shown), shown, overridden, notes, [])
    file = Path(path).expanduser()
    shown = display_path(file)
    suffix = file.suffix.lower()
    if suffix == ".toml":
        data = load_toml(file, shown)
        if isinstance(data.get("datasets"), list):
            raise ConfigError(f"{shown} is a dataset config (sd-scripts / musubi-tuner --dataset_config): give the "
                              "training arguments' TOML (--config_file), which names it")
        read = Reader(file=shown, strict=True, overridden=overridden)
        files = [ConfigFile(shown, "kohya")]
        family = kohya.map_kohya(read, kohya.namespace(data), "", notes, file, files)
        return _reading(read, files, "kohya", notes, family)
    if suffix in (".yaml", ".yml", ".json"):
        data = load_mapping(file, shown)
        if isinstance(data.get("config"), dict) and "process" in data["config"]:
            read = Reader(file=shown, strict=True, overridden=overridden)
            family = ai_toolkit.map_ai_toolkit(read, data, notes)
            return _reading(read, [ConfigFile(shown, "ai-toolkit")], "ai-toolkit", notes, family)
        if any(str(k).startswith("--") for k in data):
            raise ConfigError(f"{shown} looks like SimpleTuner's config.json: not read yet (memfit reads "
                              + ", ".join(FORMATS.values()) + ")")
        keys = ", ".join(list(map(str, data))[:5]) or "none"
        raise ConfigError(f"{shown}: unknown diffusion config (keys: {keys}): memfit reads "
                          + ", ".join(FORMATS.values()))
    try:
        text = read_config_bytes(file, shown).decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(f"cannot read {shown}: {error}") from None
    return _command(parse(split_text(text, shown), shown), shown, overridden, notes, [ConfigFile(shown, "")], file)


def _command(cmd: Command, shown: str, overridden, notes: list[str], files: list[ConfigFile],
             path: Path | None = None) -> DiffusionReading:
    kind = _kind(cmd, shown)
    files = [ConfigFile(f.path, kind) for f in files] or [ConfigFile(shown, kind)]
    read = Reader(file=files[0].path, strict=True, overridden=overridden)
    base = Path(path) if path is not None else Path("command-line")
    if kind == "kohya":
        args = dict(cmd.args)
        if isinstance(args.get("config_file"), str):
            name = args["config_file"] if args["config_file"].endswith(".toml") else args["config_file"] + ".toml"
            toml = resolve_reference(name, base, files[0].path, "--config_file")
            shown_toml = display_path(toml)
            read.defer("config_file", args.pop("config_file"), f"reads {shown_toml}; the command line wins")
            files.append(ConfigFile(shown_toml, "kohya", via=f"{files[0].path}: --config_file"))
            args = {**kohya.namespace(load_toml(toml, shown_toml)), **args}
        family = kohya.map_kohya(read, args, cmd.script, notes, base, files)
        if cmd.launcher.get("mixed_precision"):
            notes.append("accelerate launch --mixed_precision is not what sd-scripts uses: it passes its own "
                         "--mixed_precision (default no) to Accelerator")
    else:
        family = diffusers_scripts.map_diffusers(read, dict(cmd.args), cmd.script, cmd.launcher, notes)
    return _reading(read, files, kind, notes, family)


def _kind(cmd: Command, shown: str) -> str:
    if cmd.script in kohya.SCRIPTS:
        return "kohya"
    if cmd.script in diffusers_scripts.SCRIPTS:
        return "diffusers"
    if cmd.script:
        if cmd.script.startswith(MUSUBI_SCRIPTS):
            raise ConfigError(f"{shown}: {cmd.script}: {MUSUBI}")
        raise ConfigError(f"{shown}: {cmd.script} is not a script memfit reads ("
                          + ", ".join([*kohya.SCRIPTS, *diffusers_scripts.SCRIPTS]) + ")")
    keys = set(cmd.args)
    if keys & kohya.OWN_KEYS:
        return "kohya"
    if keys & diffusers_scripts.OWN_KEYS:
        return "diffusers"
    raise ConfigError(f"{shown}: name the training script (e.g. flux_train_network.py, "
                      "train_dreambooth_lora_flux.py): its arguments alone do not say which")


def _reading(read: Reader, files: list[ConfigFile], kind: str, notes: list[str],
             family: str | None) -> DiffusionReading:
    fields = dict(read.fields)
    model = fields.pop("model", None) or (read.model[0] if read.model else None)
    return DiffusionReading(tuple(files), kind, model, fields, tuple(read.entries()), tuple(read.skipped),
                            tuple(dict.fromkeys(notes)), family)


def with_config(values: dict[str, Any], given: set[str], model: str | None, path: str | Path | None,
                command: list[str] | None) -> tuple[dict[str, Any], str, DiffusionReading]:
    """`memfit diffusion --config`: the command's `values` (size_run's keywords) with the config's filled in where
    the option was not `given` on the command line; MODEL, else the catalog model the config names."""
    if path is not None and command:
        raise ConfigError("give --config FILE or a command line after --, not both")
    overridden = {k: OPTIONS[k] for k in given if k in OPTIONS}
    if model:
        overridden["model"] = "MODEL"
    reading = read_diffusion_config(path, command=command, overridden=overridden)
    merged = {**values, **{k: v for k, v in reading.kwargs.items() if k not in given}}
    if model and reading.family and resolve_model(model).family != reading.family:
        raise ConfigError(f"{reading.files[0].path} trains a {reading.family} model; MODEL '{model}' is "
                          f"{resolve_model(model).family}")
    chosen = model or reading.model
    if not chosen:
        named = next((e.value for e in reading.read if e.field.endswith(("pretrained_model_name_or_path",
                                                                         "name_or_path"))), None)
        raise ConfigError(f"{reading.files[0].path} names " + (f"'{named}', not a catalog model" if named else
                          "no model") + ": give MODEL (" + ", ".join(catalog_names()) + ", or a denoiser "
                          "config.json)")
    return merged, chosen, reading


def split_words(model: str | None, words: list[str] | None) -> tuple[str | None, list[str]]:
    """`memfit diffusion [MODEL] -- COMMAND...`: click hands the first word after `--` to MODEL when no MODEL
    comes before it; a launcher, a script or an --argument there starts the command line instead."""
    words = list(words or [])
    if model is not None and (model in LAUNCHERS or model.endswith(".py") or model.startswith("--")):
        return None, [model, *words]
    return model, words


LAUNCHERS = ("accelerate", "python", "python3", "torchrun")
