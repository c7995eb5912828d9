"""What the diffusion config readers share: the keyword arguments of `memfit.diffusion.api.size_run` they set (the
names, the CLI option of each, and their defaults), a base model reference turned into a catalog name, a trainer's
optimizer name turned into memfit's, and a resolution. Torch-free: the CLI imports it at module level."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...optimizers import config_class_names
from ...readers._reader import Reader
from ...readers.files import check_shape, read_config_bytes
from ..presets import catalog_names, resolve_model

OPTIONS = {"resolution": "--resolution", "batch": "--batch", "method": "--method", "rank": "--rank",
           "targets": "--lora-targets", "lora_dtype": "--lora-dtype", "precision": "--precision",
           "checkpointing": "--checkpointing", "optimizer": "--optimizer", "cache_latents": "--cache-latents",
           "cache_text": "--cache-text", "base_dtype": "--base-dtype", "blocks_to_swap": "--blocks-to-swap"}
"""size_run keyword -> the `memfit diffusion` option that gives it (an option given overrides the config)."""

LEVERS = ("base_dtype", "blocks_to_swap")
"""Keywords for the levers size_run does not take yet (fp8 / NF4 base weights, block swap): passed only when set."""

BLOCK_LINEARS = {
    "flux": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
             "ff_context.net.2", "norm1.linear", "norm1_context.linear", "proj_mlp", "proj_out", "norm.linear"),
    "sd3": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
            "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
            "ff_context.net.2", "norm1.linear", "norm1_context.linear", "attn2.to_k", "attn2.to_q", "attn2.to_v",
            "attn2.to_out.0"),
    "sdxl": "all",
}
"""Every Linear inside the denoiser's blocks, as diffusers names them: what kohya's networks.lora_flux /
lora_sd3 (all Linears of the Double / Single stream and joint blocks, the modulation ones included) and ai-toolkit's
LoRASpecialNetwork (every Linear whose name holds `transformer_blocks`) adapt; SD3.5 Medium's second attention
(attn2) too where a model has it. For SDXL kohya's networks.lora adapts
the Linears of each Transformer2DModel, which is memfit's `--lora-targets all`."""

KOHYA_FUSED = ("kohya's own Flux / SD3 modules fuse q, k, v (and a single block's MLP input) into one Linear with one "
               "adapter; diffusers' split them, so memfit's adapters hold a few more `A` weights (rank x width per "
               "split projection)")


def catalog_model(read: Reader, key: str, value: Any, family: str | None) -> None:
    """The base model a config names -> read.model when it is a catalog name or hub id of `family`; a local
    checkpoint or folder, or another repository, is left to MODEL (the entry says so)."""
    if not isinstance(value, str) or not value.strip():
        read.ignore(key, value, "no base model named: give MODEL")
        return
    try:  # a local checkpoint is never opened here (resolve_model would read a path as a config.json)
        spec = None if Path(value).expanduser().exists() else resolve_model(value)
    except (ConfigError, OSError):
        spec = None
    if spec is None or spec.name not in catalog_names():
        read.defer(key, value, "not in memfit's catalog (" + ", ".join(catalog_names()) + "): give MODEL")
        return
    if family and spec.family != family:
        raise ConfigError(f"{read.file}: {key}={value!r} is a {spec.family} model, but the script trains {family}")
    if "model" in read.overridden:
        read.defer(key, value, f"{spec.name}; overridden by {read.overridden['model']}")
        return
    read.set_model(spec.name, key, value)


def load_toml(file: Path, shown: str) -> dict:
    """A TOML file's tables (sd-scripts' --config_file and --dataset_config); one ConfigError line when it is
    missing, not a regular file, too large or not TOML (memfit.readers.files' bounds)."""
    raw = read_config_bytes(file, shown)
    try:
        data = tomllib.loads(raw.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{shown} is not valid TOML: {error}") from None
    check_shape(data, shown)
    return data


KOHYA_OPTIMIZERS = {
    "adamw": "adamw-foreach", "adamw8bit": "adamw-8bit", "pagedadamw8bit": "paged-adamw-8bit",
    "pagedadamw": "paged-adamw", "pagedadamw32bit": "paged-adamw", "lion": "lion", "lion8bit": "lion-8bit",
    "sgdnesterov": "sgd", "adafactor": "adafactor",
}
"""sd-scripts' optimizer_type (library/train_util.py get_optimizer, lower-cased as it compares them) -> memfit's:
AdamW is torch.optim.AdamW with torch's default kernel (foreach on CUDA); AdamW8bit / PagedAdamW8bit /
PagedAdamW(32bit) / Lion8bit bitsandbytes'; Lion lion_pytorch's (one momentum, as memfit's Lion); SGDNesterov
torch.optim.SGD(momentum=0.9); Adafactor transformers'. The same names ai-toolkit's get_optimizer takes."""


def optimizer_name(read: Reader, key: str, value: Any, names: dict[str, str] = KOHYA_OPTIMIZERS) -> None:
    """A trainer's optimizer name (its own short names, or a class path such as bitsandbytes.optim.AdEMAMix) ->
    read's `optimizer`; one it names that memfit does not size is unmappable (--optimizer overrides)."""
    text = str(value).strip().lower()
    found = names.get(text) or config_class_names().get(text)
    if found:
        read.set("optimizer", found, key, value)
        return
    read.unmappable("optimizer", key, value, "memfit sizes " + ", ".join(sorted(set(names))) + " (Prodigy, "
                    "D-Adaptation and schedule-free are not sized yet: give --optimizer for the nearest)")


def resolution(read: Reader, key: str, value: Any, *, width_first: bool) -> None:
    """'1024', 1024 or '1024,768' -> read's resolution as (height, width) (sd-scripts writes 'width,height': its
    argparse help); a list ([512, 768, 1024]: ai-toolkit's bucket sizes) -> the largest, square: it sets the peak."""
    if isinstance(value, (list, tuple)):
        sides = [as_int(v) for v in value]
        if sides and all(s and s > 0 for s in sides):
            side = max(sides)  # type: ignore[type-var]
            read.set("resolution", (side, side), key, value, "the largest size sets the peak" if len(sides) > 1
                     else "")
            return
    else:
        sides = [as_int(p.strip()) for p in value.split(",")] if isinstance(value, str) else [as_int(value)]
        if len(sides) in (1, 2) and all(s and s > 0 for s in sides):
            if len(sides) == 1:
                size = (sides[0], sides[0])
            else:
                size = (sides[1], sides[0]) if width_first else (sides[0], sides[1])
            read.set("resolution", size, key, value, "width,height" if width_first and len(sides) == 2 else "")
            return
    read.unmappable("resolution", key, value, "not a resolution in pixels (one side, or width,height)")


def positive(read: Reader, field: str, key: str, value: Any) -> None:
    number = as_int(value)
    if number is None or number < 1:
        read.unmappable(field, key, value, "not a positive whole number")
        return
    read.set(field, number, key, value)


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value.strip())
    return None


def truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes")) or (
        isinstance(value, int) and not isinstance(value, bool) and value > 0)
