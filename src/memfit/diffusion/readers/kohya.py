"""kohya-ss sd-scripts (flux_train_network.py, sdxl_train_network.py, sd3_train_network.py, sdxl_train.py, flux_train.py,
sd3_train.py): its --config_file TOML (every table's keys merged into one namespace, as
library/train_util.py read_config_from_file does) or the same arguments on a command line -> size_run's keywords.
Names and defaults from library/train_util.py and train_network.py's argparse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...readers._mapper import LOADING, SAVING, ConfigFile, finish
from ...readers._reader import NOT_RELEVANT, NOT_SIZED, Reader
from ...readers.files import display_path, resolve_reference
from .common import (BLOCK_LINEARS, KOHYA_FUSED, as_int, catalog_model, load_toml, optimizer_name, positive,
                     resolution, truthy)

SCRIPTS = {"flux_train_network.py": ("flux", "lora"), "sdxl_train_network.py": ("sdxl", "lora"),
           "sd3_train_network.py": ("sd3", "lora"), "flux_train.py": ("flux", "full"),
           "sdxl_train.py": ("sdxl", "full"), "sd3_train.py": ("sd3", "full")}
"""The sd-scripts training scripts of memfit's catalog families: (family, method)."""
NETWORKS = {"networks.lora_flux": "flux", "networks.lora_sd3": "sd3", "networks.lora": "sdxl"}
OWN_KEYS = frozenset({"network_module", "network_dim", "optimizer_type", "full_bf16", "full_fp16", "fp8_base",
                      "cache_text_encoder_outputs", "blocks_to_swap", "train_batch_size", "config_file",
                      "cache_latents_to_disk", "network_train_unet_only", "t5xxl", "clip_l", "ae"})
"""Arguments only sd-scripts takes (memfit.diffusion.readers tells a bare argument list by them)."""

SWITCHES = ("fp8_base", "fp8_base_unet", "full_bf16", "full_fp16", "cache_latents", "cache_latents_to_disk",
            "cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk", "use_8bit_adam", "use_lion_optimizer")
"""Switches memfit reads when on; off, they are listed as 'off: nothing to size'."""
TABLE = {
    **{key: f"{NOT_SIZED} (off)" for key in SWITCHES},
    "network_args": f"{NOT_SIZED} (network_args: per-block ranks, conv_dim, LoRA variants)",
    "network_dropout": f"{NOT_SIZED} (dropout on the adapters)",
    "cpu_offload_checkpointing": f"{NOT_SIZED} (checkpointed block inputs offloaded to the CPU)",
    "fused_backward_pass": f"{NOT_SIZED} (Adafactor steps each parameter in backward)",
    "split_mode": f"{NOT_SIZED} (Flux split mode)",
    "t5xxl_max_token_length": f"{NOT_SIZED} (memfit sizes the pipeline's T5 tokens: Flux 512, SD3 256)",
    "max_token_length": f"{NOT_SIZED} (CLIP tokens beyond 77)",
    "vae_batch_size": f"{NOT_SIZED} (the VAE's caching batch: memfit encodes `batch` images at once)",
    "text_encoder_batch_size": f"{NOT_SIZED} (the text encoders' caching batch)",
    "gradient_accumulation_steps": f"{NOT_SIZED} (gradients kept across micro-steps)",
    "sample_": f"{NOT_SIZED} (sampling during training)",
    "sample_prompts": f"{NOT_SIZED} (sampling during training)",
    "highvram": f"{NOT_RELEVANT} (host memory)", "lowram": f"{NOT_RELEVANT} (host memory)",
    "lowvram": f"{NOT_RELEVANT} (host memory)",
    "ae": LOADING, "clip_l": LOADING, "clip_g": LOADING, "t5xxl": LOADING, "vae": LOADING,
    "save_": SAVING, "output_": SAVING, "huggingface_": SAVING,
    "xformers": f"{NOT_RELEVANT} (memfit sizes a fused attention kernel, as xformers / SDPA run it)",
    "sdpa": f"{NOT_RELEVANT} (memfit sizes a fused attention kernel, as xformers / SDPA run it)",
    "mem_eff_attn": f"{NOT_RELEVANT} (memfit sizes a fused attention kernel, as xformers / SDPA run it)",
}


CACHING = ("sd-scripts caches before it moves the denoiser to the GPU (train_network.py: the VAE and text encoders "
           "go to the GPU, encode, go back to the CPU; the denoiser is placed at accelerator.prepare): memfit's "
           "caching phase counts the denoiser's weights too, as the diffusers scripts hold them, so when caching is "
           "the peak, sd-scripts' own peak is the training step")
DATASET_TABLE = {
    "enable_bucket": f"{NOT_RELEVANT} (buckets keep each image's pixels at most the resolution's)",
    "min_bucket_reso": f"{NOT_RELEVANT} (buckets keep each image's pixels at most the resolution's)",
    "max_bucket_reso": f"{NOT_RELEVANT} (buckets keep each image's pixels at most the resolution's)",
}


def namespace(data: dict) -> dict:
    """sd-scripts merges every table's keys into one namespace (train_util.read_config_from_file)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def family_of(script: str, data: dict, model: str | None) -> str | None:
    """The family a sd-scripts run trains: its script, else its network module, else the Flux-only keys (ae,
    t5xxl with no clip_g), else SD3's clip_g."""
    if script in SCRIPTS:
        return SCRIPTS[script][0]
    module = str(data.get("network_module") or "")
    if module in ("networks.lora_flux", "networks.lora_sd3"):
        return NETWORKS[module]
    if "clip_g" in data:
        return "sd3"
    if "ae" in data or "t5xxl" in data:
        return "flux"
    if module == "networks.lora" or "sdxl" in str(model or "").lower():
        return "sdxl"
    return None


def map_kohya(read: Reader, data: dict, script: str, notes: list[str], base: Path,
              files: list[ConfigFile]) -> str | None:
    """`data`: the run's arguments (TOML tables merged, the command line over them); `base`: the file they came
    from (a --dataset_config is looked up next to it, then in the current directory). Returns the family it
    trains (None: not known)."""
    family = family_of(script, data, data.get("pretrained_model_name_or_path"))
    if "pretrained_model_name_or_path" in data:
        catalog_model(read, "pretrained_model_name_or_path", data["pretrained_model_name_or_path"], family)
    if "resolution" in data:
        resolution(read, "resolution", data["resolution"], width_first=True)
    if "train_batch_size" in data:
        positive(read, "batch", "train_batch_size", data["train_batch_size"])
    lora = _method(read, data, script, family, notes)
    _precision(read, data, lora)
    if "fp8_base" in data or "fp8_base_unet" in data:
        key = "fp8_base" if truthy(data.get("fp8_base")) or "fp8_base_unet" not in data else "fp8_base_unet"
        if truthy(data[key]):
            read.set("base_dtype", "fp8", key, data[key], "the denoiser's frozen weights in float8_e4m3fn")
        if key == "fp8_base" and not any(truthy(data.get(k)) for k in ("cache_text_encoder_outputs",
                                                                       "cache_text_encoder_outputs_to_disk")):
            notes.append("--fp8_base also stores the text encoders in float8 (train_network.py te_weight_dtype); "
                         "memfit sizes them in the weight dtype, above what they hold")
    if "gradient_checkpointing" in data:
        read.set("checkpointing", truthy(data["gradient_checkpointing"]), "gradient_checkpointing",
                 data["gradient_checkpointing"])
    for key in ("cache_latents", "cache_latents_to_disk"):
        if truthy(data.get(key)):
            read.set("cache_latents", True, key, data[key], "the VAE leaves the GPU after caching")
    for key in ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk"):
        if truthy(data.get(key)):
            read.set("cache_text", True, key, data[key], "the text encoders leave the GPU after caching")
    _optimizer(read, data)
    if data.get("blocks_to_swap") is not None:
        number = as_int(data["blocks_to_swap"])
        if number is None or number < 0:
            read.unmappable("blocks_to_swap", "blocks_to_swap", data["blocks_to_swap"], "not a whole number")
        elif number:
            read.set("blocks_to_swap", number, "blocks_to_swap", data["blocks_to_swap"])
    if family == "sdxl" and not any(truthy(data.get(k)) for k in ("sdpa", "xformers", "mem_eff_attn")):
        notes.append("sd-scripts' SDXL UNet without --sdpa / --xformers / --mem_eff_attn computes attention "
                     "unfused (the tokens x tokens matrix); memfit sizes a fused kernel: add --sdpa to match")
    if read.fields.get("cache_latents") or read.fields.get("cache_text"):
        notes.append(CACHING)
    if isinstance(data.get("dataset_config"), str):
        _dataset_config(read, data, base, files)
    finish(read, data, TABLE)
    return family


def _dataset_config(read: Reader, data: dict, base: Path, files: list[ConfigFile]) -> None:
    """--dataset_config: [general] and each [[datasets]] may set resolution ([width, height] or one side) and
    batch_size, over the arguments' --resolution / --train_batch_size (library/config_util.py: dataset, then
    general, then argparse). The dataset with the most pixels per batch sets the peak."""
    path = resolve_reference(data["dataset_config"], base, files[0].path, "dataset_config")
    shown = display_path(path)
    read.defer("dataset_config", data["dataset_config"], f"reads {shown}")
    files.append(ConfigFile(shown, "kohya dataset config", via=f"{files[0].path}: dataset_config"))
    config = load_toml(path, shown)
    general = config.get("general") if isinstance(config.get("general"), dict) else {}
    datasets = [d for d in config.get("datasets") or [] if isinstance(d, dict)] or [{}]
    with read.scope(shown):
        best, keys = None, []
        for i, dataset in enumerate(datasets):
            size = _where(dataset, general, "resolution", f"datasets.{i}")
            batch = _where(dataset, general, "batch_size", f"datasets.{i}")
            side = size[1] if size[0] else data.get("resolution")
            sides = side if isinstance(side, (list, tuple)) else str(side or 0).split(",")
            count = batch[1] if batch[0] else data.get("train_batch_size", 1)
            pixels = (as_int(count) or 0) * (as_int(sides[0]) or 0) * (as_int(sides[-1]) or 0)
            keys += [(k, v) for k, v in (size, batch) if k]
            if best is None or pixels > best[0]:
                best = (pixels, size, batch)
        assert best is not None
        _, (key, value), (batch_key, batch) = best
        for other, raw in keys:
            if other not in (key, batch_key):
                read.defer(other, raw, "another dataset's batch holds more pixels: it sets the peak")
        if key:
            resolution(read, key, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value,
                       width_first=True)
        if batch_key:
            positive(read, "batch", batch_key, batch)
    for i, dataset in enumerate(datasets):
        finish(read, dataset, DATASET_TABLE, file=shown, prefix=f"datasets.{i}.")
    finish(read, general, DATASET_TABLE, file=shown, prefix="general.")


def _where(dataset: dict, general: dict, key: str, at: str) -> tuple[str, Any]:
    if key in dataset:
        return f"{at}.{key}", dataset[key]
    if key in general:
        return f"general.{key}", general[key]
    return "", None


def _method(read: Reader, data: dict, script: str, family: str | None, notes: list[str]) -> bool:
    """LoRA through sd-scripts' networks (rank network_dim, default 4: networks/lora*.py create_network), or the
    whole denoiser when no network_module is given (sdxl_train.py, flux_train.py)."""
    module = data.get("network_module")
    if module is None and SCRIPTS.get(script, ("", ""))[1] != "lora":
        read.set("method", "full", "network_module", None, "none: the whole denoiser trains")
        return False
    if module is not None and module not in NETWORKS:
        read.unmappable("method", "network_module", module, "memfit sizes LoRA by networks.lora, networks.lora_flux "
                        "and networks.lora_sd3 (LyCORIS, OFT and DyLoRA are not sized yet; musubi-tuner's "
                        "networks.lora_* train models outside memfit's catalog)")
        return True
    read.set("method", "lora", "network_module", module)
    rank = data.get("network_dim", 4)
    if "network_dim" in data:
        positive(read, "rank", "network_dim", rank)
    else:
        read.set("rank", 4, "network_dim", None, "absent: sd-scripts' default dim 4")
    if "network_alpha" in data:
        read.defer("network_alpha", data["network_alpha"], "scales the update; no memory")
    if family in BLOCK_LINEARS:
        targets = BLOCK_LINEARS[family]
        read.set("targets", targets if isinstance(targets, str) else ",".join(targets), "network_module", module,
                 "every Linear of the blocks, as sd-scripts' network adapts them")
        if family != "sdxl":
            notes.append(KOHYA_FUSED)
    if truthy(data.get("network_train_unet_only")):
        read.defer("network_train_unet_only", data["network_train_unet_only"], "only the denoiser trains")
    elif not truthy(data.get("cache_text_encoder_outputs")) and not truthy(
            data.get("cache_text_encoder_outputs_to_disk")):
        read.ignore("network_train_unet_only", data.get("network_train_unet_only", False),
                    f"{NOT_SIZED} (the text encoders' LoRA trains too: memfit sizes the denoiser's training only)")
    return True


def _precision(read: Reader, data: dict, lora: bool) -> None:
    """mixed_precision (default 'no') with full_bf16 / full_fp16 (train_network.py: the network cast to the weight
    dtype; sdxl_train.py: the U-Net's weights in it), the run still under accelerate's autocast."""
    mixed = str(data.get("mixed_precision", "no")).lower()
    full = {"bf16": "full_bf16", "fp16": "full_fp16"}.get(mixed, "")
    whole = bool(full) and truthy(data.get(full))
    if mixed not in ("no", "bf16", "fp16"):
        read.unmappable("precision", "mixed_precision", data.get("mixed_precision"), "no, fp16 or bf16")
        return
    key, raw = "mixed_precision", data.get("mixed_precision", "no")
    if mixed == "no":
        read.set("precision", "fp32", key, raw, "" if "mixed_precision" in data else "absent: sd-scripts' default")
    elif lora:
        read.set("precision", "amp-" + mixed, key, raw, f"the frozen weights in {mixed}, under autocast")
        read.set("lora_dtype", mixed if whole else "fp32", full if whole else key, data.get(full, raw),
                 f"the network cast to {mixed}" if whole else "the network stays fp32")
    elif whole and mixed == "bf16":
        read.set("precision", "bf16", full, data[full], "the U-Net's weights, gradients and states in bf16")
        read.defer(key, raw, f"{full} decides")
    elif whole:
        read.unmappable("precision", full, data[full], "a pure fp16 full fine-tune is not sized yet")
    else:
        read.set("precision", "amp-" + mixed, key, raw, "fp32 weights under autocast")


def _optimizer(read: Reader, data: dict) -> None:
    """optimizer_type (default AdamW), or the older use_8bit_adam / use_lion_optimizer switches
    (train_util.get_optimizer)."""
    given: Any = data.get("optimizer_type") or ""
    if truthy(data.get("use_8bit_adam")):
        read.set("optimizer", "adamw-8bit", "use_8bit_adam", data["use_8bit_adam"])
    elif truthy(data.get("use_lion_optimizer")):
        read.set("optimizer", "lion", "use_lion_optimizer", data["use_lion_optimizer"])
    elif given:
        optimizer_name(read, "optimizer_type", given)
    elif "optimizer_type" in data:
        read.set("optimizer", "adamw-foreach", "optimizer_type", given, "empty: AdamW")
