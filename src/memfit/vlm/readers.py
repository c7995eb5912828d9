"""`memfit vlm --config FILE`: the VLM settings of the trainer config you already have, beside its training step.

- LLaMA-Factory YAML: the step as memfit.readers reads it, plus its processor arguments (image_max_pixels /
  image_min_pixels: LLaMA-Factory's own resize of every image before the model's processor, defaults 768 x 768 and
  32 x 32; mm_plugin._preprocess_image) and its freezing (freeze_vision_tower, freeze_multi_modal_projector: both
  default true).
- ms-swift: a `swift sft ...` command line (a shell script or a text file holding one), with its environment
  (MAX_PIXELS / MIN_PIXELS, which qwen_vl_utils' smart_resize reads: the processor's rule with that ceiling).
- TRL's VLM SFT: an SFTConfig (TrainingArguments) YAML / JSON as memfit.readers reads it, plus the processor's
  max_pixels / min_pixels keys the script hands to AutoProcessor.from_pretrained.

Every key is reported as memfit.readers does: read (and what it set), or left out with why. The cutoff / max length
keys cap the text sequence: a VLM step's sequence here is --text-len plus the images' tokens, so they are left out."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, Finetune, Method
from ..readers import NOT_RELEVANT, NOT_SIZED, IgnoredEntry, ReadEntry, read_config
from ..readers.files import display_path, load_mapping
from ..setup import Checkpointing, Precision

LF_IMAGE_MAX_PIXELS = 768 * 768
LF_IMAGE_MIN_PIXELS = 32 * 32
"""LLaMA-Factory hparams/model_args.py ProcessorArguments defaults."""
VIDEO = f"{NOT_SIZED} (video: frames and fps)"
SEQUENCE = "caps the text; memfit vlm sizes --text-len plus the images' tokens"


@dataclass(frozen=True)
class VlmReading:
    """What a trainer config says about a VLM step: the TrainingSetup fields (`setup`), the model, the processor's
    pixel bounds, a trainer's own resize before the processor (`pre_resize`: LLaMA-Factory's (max, min) pixels),
    how the vision side trains (`tower`), and each key read or left out."""

    file: str
    format: str
    model: str | None = None
    setup: dict[str, Any] = field(default_factory=dict)
    max_pixels: int | None = None
    min_pixels: int | None = None
    pre_resize: tuple[int, int] | None = None
    tower: str | None = None
    read: tuple[ReadEntry, ...] = ()
    ignored: tuple[IgnoredEntry, ...] = ()

    def to_dict(self) -> dict:
        return {"file": self.file, "format": self.format, "model": self.model,
                "max_pixels": self.max_pixels, "min_pixels": self.min_pixels,
                "pre_resize": list(self.pre_resize) if self.pre_resize else None, "tower": self.tower,
                "read": [e.to_dict() for e in self.read], "ignored": [e.to_dict() for e in self.ignored]}


def read_vlm_config(path: str | Path) -> VlmReading:
    """The VlmReading of an ms-swift command line, a LLaMA-Factory YAML or a TRL SFTConfig YAML / JSON."""
    path = Path(path).expanduser()
    shown = display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read '{shown}': {error}") from None
    if re.search(r"\bswift\s+sft\b", text):
        return read_swift(text, shown)
    data = load_mapping(path, shown)
    return _read_mapping(path, shown, data)


# ---- LLaMA-Factory and TRL: memfit.readers' step plus the processor's keys -----------------------------------------

_LF_KEYS = frozenset({"finetuning_type", "template", "cutoff_len", "image_max_pixels", "freeze_vision_tower",
                      "freeze_multi_modal_projector", "stage"})
"""Keys only a LLaMA-Factory YAML has (its model_args / data_args / finetuning_args), not TRL's SFTConfig."""


def _read_mapping(path: Path, shown: str, data: Mapping) -> VlmReading:
    llamafactory = bool(_LF_KEYS & set(data))
    ours = _LF_VLM if llamafactory else _TRL_VLM
    base = read_config(path)
    read = [e for e in base.read if e.field not in ours and not _sets_sequence(e)]
    ignored = [e for e in base.ignored if e.field not in ours]
    ignored += [IgnoredEntry(e.file, e.field, e.value, SEQUENCE) for e in base.read if _sets_sequence(e)]
    setup = {k: v for k, v in base.overrides.items() if k not in ("seq_len", "num_gpus")}
    model = base.model or (str(data["model_name_or_path"]) if data.get("model_name_or_path") else None)
    if model and not any(e.field == "model_name_or_path" for e in read):
        read.append(ReadEntry(shown, "model_name_or_path", model, (("model", model),)))
    reading = VlmReading(shown, "llamafactory" if llamafactory else "trl", model, setup)
    return (_llamafactory(reading, data, read, ignored) if llamafactory else _trl(reading, data, read, ignored))


def _sets_sequence(entry: ReadEntry) -> bool:
    return any(name == "seq_len" for name, _ in entry.sets)


_LF_VLM = frozenset({"image_max_pixels", "image_min_pixels", "freeze_vision_tower", "freeze_multi_modal_projector",
                     "freeze_language_model", "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen",
                     "image_do_pan_and_scan", "lora_target"})


def _llamafactory(reading: VlmReading, data: Mapping, read: list, ignored: list) -> VlmReading:
    file = reading.file
    limits = []
    for key, default in (("image_max_pixels", LF_IMAGE_MAX_PIXELS), ("image_min_pixels", LF_IMAGE_MIN_PIXELS)):
        value = _whole(data.get(key, default), key, file)
        limits.append(value)
        read.append(ReadEntry(file, key, data.get(key), (("pre_resize." + key.split("_")[1], value),),
                              "LLaMA-Factory resizes every image to at most / least this many pixels before the "
                              "processor" + ("" if key in data else f" (absent: its default {default:,})")))
    frozen_tower = _flag(data, "freeze_vision_tower", True)
    frozen_projector = _flag(data, "freeze_multi_modal_projector", True)
    lora = reading.setup.get("finetune") is not None and reading.setup["finetune"].adapters
    tower = "frozen" if frozen_tower else "lora" if lora else "trained"
    read.append(ReadEntry(file, "freeze_vision_tower", data.get("freeze_vision_tower"), (("tower", tower),),
                          "" if "freeze_vision_tower" in data else "absent: LLaMA-Factory's default true"))
    if frozen_projector != frozen_tower:
        ignored.append(IgnoredEntry(file, "freeze_multi_modal_projector", frozen_projector,
                                    f"{NOT_SIZED} (the projector trained apart from the tower: sized with the tower)"))
    elif "freeze_multi_modal_projector" in data:
        read.append(ReadEntry(file, "freeze_multi_modal_projector", frozen_projector, (("tower", tower),)))
    if "freeze_language_model" in data:
        ignored.append(IgnoredEntry(file, "freeze_language_model", data["freeze_language_model"], NOT_SIZED))
    for key in ("video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen"):
        if key in data:
            ignored.append(IgnoredEntry(file, key, data[key], VIDEO))
    if "image_do_pan_and_scan" in data:
        ignored.append(IgnoredEntry(file, "image_do_pan_and_scan", data["image_do_pan_and_scan"],
                                    f"{NOT_SIZED} (Gemma 3 pan and scan)"))
    setup = _lm_targets(reading.setup, data.get("lora_target"), read, file, "lora_target")
    return _with(reading, setup=setup, pre_resize=(limits[0], limits[1]), tower=tower, read=read, ignored=ignored)


_TRL_VLM = frozenset({"max_pixels", "min_pixels", "freeze_vision_tower", "model_name_or_path"})


def _trl(reading: VlmReading, data: Mapping, read: list, ignored: list) -> VlmReading:
    file = reading.file
    found: dict[str, int] = {}
    for key in ("max_pixels", "min_pixels"):
        if key in data:
            found[key] = _whole(data[key], key, file)
            read.append(ReadEntry(file, key, data[key], ((key, found[key]),), "the processor's"))
    tower = None
    if "freeze_vision_tower" in data:
        tower = "frozen" if _flag(data, "freeze_vision_tower", True) else "trained"
        read.append(ReadEntry(file, "freeze_vision_tower", data["freeze_vision_tower"], (("tower", tower),)))
    setup = _lm_targets(reading.setup, None, read, file, "lora_target_modules")
    return _with(reading, setup=setup, tower=tower, read=read, ignored=ignored, **found)


def _lm_targets(setup: dict, given: Any, read: list, file: str, key: str) -> dict:
    """'all' / all-linear LoRA targets on a VLM: the language model's Linears (memfit.vlm.model.lora_targets), as
    LLaMA-Factory (its forbidden modules: the frozen tower and projector) and ms-swift (freeze_vit) apply them."""
    ft = setup.get("finetune")
    if ft is None or not ft.adapters or ft.targets not in ((ALL_LINEAR,), ()):
        return setup
    if given is not None:
        read.append(ReadEntry(file, key, given, (("finetune.targets", "the language model's Linears"),),
                              "every Linear of the language model (and of the tower when it trains with LoRA)"))
    return {**setup, "finetune": dataclasses.replace(ft, targets=())}


def _with(reading: VlmReading, **changes) -> VlmReading:
    changes["read"] = tuple(changes.get("read", reading.read))
    changes["ignored"] = tuple(changes.get("ignored", reading.ignored))
    return VlmReading(**{**reading.__dict__, **changes})


def _flag(data: Mapping, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _whole(value: Any, key: str, file: str) -> int:
    try:
        number = int(str(value).replace("_", ""))
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{file}: {key} is a positive whole number of pixels, got {value!r}")
    return number


# ---- ms-swift ---------------------------------------------------------------------------------------------------

SWIFT_DTYPES = {"bfloat16": Precision.BF16, "bf16": Precision.BF16, "float32": Precision.FP32, "fp32": Precision.FP32}
"""--torch_dtype: ms-swift loads the weights in it and trains them so (no fp32 master copy; float16 weights trained
as they are have no memfit precision: refused)."""
SWIFT_NOT_RELEVANT = ("dataset", "val_dataset", "output_dir", "num_train_epochs", "learning_rate", "logging_steps",
                      "save_steps", "eval_steps", "save_total_limit", "warmup_ratio", "dataloader_num_workers",
                      "system", "model_author", "model_name", "seed", "report_to", "split_dataset_ratio",
                      "dataset_num_proc", "lr_scheduler_type", "weight_decay", "max_grad_norm", "save_only_model",
                      "lora_dropout", "lora_alpha", "add_version", "streaming", "use_hf", "load_from_cache_file")


def read_swift(text: str, file: str = "ms-swift") -> VlmReading:
    """An ms-swift `swift sft` command line (its defaults: train_type lora, lora_rank 8 on all-linear, freeze_vit /
    freeze_aligner true, gradient_checkpointing true, per_device_train_batch_size 1) and the MAX_PIXELS /
    MIN_PIXELS its environment sets."""
    text = text.replace("\\\n", " ")
    env: dict[str, str] = {}
    for name, value in re.findall(r"\b(MAX_PIXELS|MIN_PIXELS|NPROC_PER_NODE)=(\S+)", text):
        env[name] = value.strip("'\"")
    line = next(line for line in text.splitlines() if re.search(r"\bswift\s+sft\b", line))
    try:
        words = shlex.split(line[re.search(r"\bswift\s+sft\b", line).end():], comments=True)
    except ValueError as error:
        raise ConfigError(f"{file}: cannot read the swift sft command line: {error}") from None
    args: dict[str, str] = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key, _, value = word[2:].partition("=")
            args[key] = value if value else "true"
            key = None if value else key
        elif key is not None:
            args[key] = word if args[key] == "true" else f"{args[key]} {word}"
            key = None
    return _swift(args, env, file)


@dataclass
class _Swift:
    """One ms-swift command line being read: what each argument set, what was left out, the setup so far."""

    args: dict[str, str]
    file: str
    read: list[ReadEntry] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def take(self, key: str, sets: tuple, note: str = "") -> None:
        self.read.append(ReadEntry(self.file, f"--{key}", self.args.get(key), sets, note))
        self.done.add(key)

    def leave(self, key: str, why: str) -> None:
        self.ignored.append(IgnoredEntry(self.file, f"--{key}", self.args.get(key), why))
        self.done.add(key)


def _swift(args: dict[str, str], env: dict[str, str], file: str) -> VlmReading:
    swift = _Swift(args, file)
    model = args.get("model")
    if model:
        swift.take("model", (("model", model),))
    _swift_method(swift)
    _swift_step(swift)
    tower = _swift_tower(swift)
    pixels = _swift_pixels(swift, env)
    for key in ("max_length", "truncation_strategy"):
        if key in args:
            swift.leave(key, SEQUENCE)
    for key in ("deepspeed", "fsdp"):
        if key in args:
            swift.leave(key, f"{NOT_SIZED} (multi-GPU VLM steps)")
    for key in [key for key in args if key not in swift.done]:
        swift.leave(key, NOT_RELEVANT if key in SWIFT_NOT_RELEVANT else "not read by memfit vlm")
    return VlmReading(file, "ms-swift", model, swift.setup, pixels.get("max_pixels"), pixels.get("min_pixels"), None,
                      tower, tuple(swift.read), tuple(swift.ignored))


def _swift_method(swift: _Swift) -> None:
    """--train_type / --lora_rank / --quant_bits / --target_modules -> the setup's finetune."""
    args = swift.args
    train = args.get("train_type", "lora")
    quant = args.get("quant_bits")
    if "target_modules" in args:
        if args["target_modules"] == "all-linear":
            swift.take("target_modules", (("finetune.targets", "the language model's Linears"),),
                       "every Linear of the language model (and of the tower when it trains with LoRA)")
        else:
            swift.leave("target_modules", f"{NOT_SIZED} (sized as all-linear)")
    if train not in ("lora", "full"):
        swift.leave("train_type", f"{NOT_SIZED} (sized as LoRA)")
        return
    method = Method.FULL if train == "full" else Method.QLORA if quant == "4" else Method.LORA
    rank = int(args.get("lora_rank", 8)) if method is not Method.FULL else None
    ft = Finetune(method=method, rank=rank) if rank else Finetune(method=method)
    swift.setup["finetune"] = ft
    swift.take("train_type", (("finetune", ft),), "" if "train_type" in args else "absent: ms-swift's default lora")
    if "lora_rank" in args:
        swift.take("lora_rank", (("finetune.rank", rank),))
    if quant is not None:
        swift.take("quant_bits", (("finetune.method", method.value),))


def _swift_step(swift: _Swift) -> None:
    """Batch, accumulation, dtype, checkpointing and attention."""
    args, setup = swift.args, swift.setup
    for key, field_ in (("per_device_train_batch_size", "micro_batch_size"),
                        ("gradient_accumulation_steps", "grad_accum_steps")):
        if key in args:
            setup[field_] = _positive(args[key], key, swift.file)
            swift.take(key, ((field_, setup[field_]),))
    if "torch_dtype" in args:
        precision = SWIFT_DTYPES.get(args["torch_dtype"].lower())
        if precision is None:
            raise ConfigError(f"{swift.file}: memfit vlm sizes --torch_dtype {', '.join(SWIFT_DTYPES)}, got "
                              f"{args['torch_dtype']!r}")
        setup["precision"] = precision
        swift.take("torch_dtype", (("precision", precision),))
    on = _flag(args, "gradient_checkpointing", True)
    setup["checkpointing"] = Checkpointing.FULL if on else Checkpointing.NONE
    swift.take("gradient_checkpointing", (("checkpointing", setup["checkpointing"]),),
               "" if "gradient_checkpointing" in args else "absent: ms-swift's default true")
    if "attn_impl" in args:
        attention = "sdpa" if args["attn_impl"] in ("flash_attn", "flash_attention_2", "sdpa") else "eager"
        setup["attention"] = attention
        swift.take("attn_impl", (("attention", attention),))


def _swift_tower(swift: _Swift) -> str:
    """--freeze_vit / --freeze_aligner -> how the vision tower trains."""
    args = swift.args
    frozen = _flag(args, "freeze_vit", True)
    lora = swift.setup.get("finetune") is not None and swift.setup["finetune"].adapters
    tower = "frozen" if frozen else "lora" if lora else "trained"
    swift.take("freeze_vit", (("tower", tower),), "" if "freeze_vit" in args else "absent: ms-swift's default true")
    if _flag(args, "freeze_aligner", True) != frozen:
        swift.ignored.append(IgnoredEntry(swift.file, "--freeze_aligner", args.get("freeze_aligner"),
                                          f"{NOT_SIZED} (the aligner trained apart from the tower: sized with the "
                                          "tower)"))
    swift.done.add("freeze_aligner")
    return tower


def _swift_pixels(swift: _Swift, env: dict[str, str]) -> dict[str, int]:
    """--max_pixels / --min_pixels, else ms-swift's MAX_PIXELS / MIN_PIXELS environment."""
    pixels: dict[str, int] = {}
    for key, name in (("max_pixels", "MAX_PIXELS"), ("min_pixels", "MIN_PIXELS")):
        if key in swift.args:
            pixels[key] = _whole(swift.args[key], f"--{key}", swift.file)
            swift.take(key, ((key, pixels[key]),), "the processor's")
        elif name in env:
            pixels[key] = _whole(env[name], name, swift.file)
            swift.read.append(ReadEntry(swift.file, name, env[name], ((key, pixels[key]),),
                                        "environment: qwen_vl_utils' smart_resize ceiling / floor"))
    return pixels


def _positive(value: str, key: str, file: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{file}: --{key} is a positive whole number, got {value!r}")
    return number


# ---- LLaMA-Factory's resize before the processor -------------------------------------------------------------------

def pre_resized(image_size: tuple[int, int], pre_resize: tuple[int, int] | None) -> tuple[int, int]:
    """(height, width) after LLaMA-Factory's own resize (mm_plugin._preprocess_image: scaled by sqrt(max / pixels)
    when above image_max_pixels, by sqrt(min / pixels) when below image_min_pixels, each side truncated to int);
    `image_size` unchanged without one."""
    if pre_resize is None:
        return image_size
    height, width = image_size
    most, least = pre_resize
    if height * width > most:
        factor = (most / (height * width)) ** 0.5
        height, width = int(height * factor), int(width * factor)
    if height * width < least:
        factor = (least / (height * width)) ** 0.5
        height, width = int(height * factor), int(width * factor)
    return max(height, 1), max(width, 1)


# ---- the processor setting that makes a plan fit, in the config's own words ----------------------------------------

def pixel_setting(reading: VlmReading | None, max_pixels: int, image_size: tuple[int, int], tokens: int,
                  image_tokens) -> str:
    """The line to paste for `max_pixels` (the processor's ceiling the plan found): ms-swift's MAX_PIXELS, TRL's /
    transformers' processor argument, or LLaMA-Factory's image_max_pixels (its own resize comes first: the largest
    value, a step of 28 x 28 at a time below `max_pixels`, whose resized image makes no more than `tokens` tokens;
    `image_tokens(size)` counts them)."""
    if reading is not None and reading.format == "ms-swift":
        return f"MAX_PIXELS={max_pixels} swift sft ..."
    if reading is not None and reading.format == "llamafactory":
        least = reading.pre_resize[1] if reading.pre_resize else LF_IMAGE_MIN_PIXELS
        value = max_pixels
        while value > 28 * 28 and image_tokens(pre_resized(image_size, (value, least))) > tokens:
            value -= 28 * 28
        return f"image_max_pixels: {value}"
    return f"AutoProcessor.from_pretrained(..., max_pixels={max_pixels})"
