"""The diffusers DreamBooth scripts (examples/dreambooth/train_dreambooth_lora_flux.py, ..._lora_sd3.py,
..._lora_sdxl.py, train_dreambooth_flux.py, train_dreambooth_sd3.py) as a command line -> size_run's keywords.
Names and defaults from their parse_args; what each switch does from their main()."""

from __future__ import annotations

from ...readers._mapper import finish
from ...readers._reader import NOT_RELEVANT, NOT_SIZED, Reader
from .common import catalog_model, optimizer_name, positive, resolution, truthy

SCRIPTS = {"train_dreambooth_lora_flux.py": ("flux", "lora"), "train_dreambooth_lora_sd3.py": ("sd3", "lora"),
           "train_dreambooth_lora_sdxl.py": ("sdxl", "lora"), "train_dreambooth_flux.py": ("flux", "full"),
           "train_dreambooth_sd3.py": ("sd3", "full")}
DEFAULTS = {"resolution": 512, "train_batch_size": 4, "rank": 4}
"""The scripts' argparse defaults that differ from memfit's (the SDXL LoRA script's resolution is 1024)."""
SEQUENCE = {"train_dreambooth_lora_flux.py": 512, "train_dreambooth_flux.py": 77, "train_dreambooth_lora_sd3.py": 77,
            "train_dreambooth_sd3.py": 77}
"""--max_sequence_length's default per script (T5 tokens)."""
CATALOG_T5 = {"flux": 512, "sd3": 256}
"""The T5 tokens memfit's catalog sizes (the pipelines' max_sequence_length)."""
OWN_KEYS = frozenset({"rank", "use_8bit_adam", "lora_layers", "instance_prompt", "instance_data_dir",
                      "with_prior_preservation", "train_text_encoder", "caption_column"})
DIFFUSERS_OPTIMIZERS = {"adamw": "adamw-foreach"}
"""--optimizer: AdamW (torch.optim.AdamW, or bitsandbytes' AdamW8bit with --use_8bit_adam) or prodigy."""

TABLE = {
    **{key: f"{NOT_SIZED} (off)" for key in ("cache_latents", "use_8bit_adam", "with_prior_preservation",
                                              "train_text_encoder")},
    "pretrained_vae_model_name_or_path": f"{NOT_SIZED} (a VAE kept in the weight dtype: memfit holds SDXL's in "
                                         "fp32, as the script does with the base VAE)",
    "revision": f"{NOT_RELEVANT} (model loading)", "variant": f"{NOT_RELEVANT} (model loading)",
    "lora_dropout": f"{NOT_SIZED} (dropout on the adapters)",
    "gradient_accumulation_steps": f"{NOT_SIZED} (gradients kept across micro-steps)",
    "validation_": f"{NOT_SIZED} (validation runs the whole pipeline)",
    "num_class_images": f"{NOT_RELEVANT} (prior images are generated before training)",
    "sample_batch_size": f"{NOT_RELEVANT} (prior images are generated before training)",
    "upcast_before_saving": f"{NOT_RELEVANT} (saving)",
    "enable_npu_flash_attention": f"{NOT_RELEVANT} (NPU)",
}


def map_diffusers(read: Reader, data: dict, script: str, launcher: dict, notes: list[str]) -> str | None:
    family, method = SCRIPTS.get(script, (None, "lora"))
    if "pretrained_model_name_or_path" in data:
        catalog_model(read, "pretrained_model_name_or_path", data["pretrained_model_name_or_path"], family)
    default = 1024 if script == "train_dreambooth_lora_sdxl.py" else DEFAULTS["resolution"]
    if "resolution" in data:
        resolution(read, "resolution", data["resolution"], width_first=False)
    else:
        read.set("resolution", (default, default), "resolution", None, "absent: the script's default")
    batch = data.get("train_batch_size", DEFAULTS["train_batch_size"])
    prior = truthy(data.get("with_prior_preservation"))
    if "train_batch_size" in data:
        positive(read, "batch", "train_batch_size", batch)
    else:
        read.set("batch", batch, "train_batch_size", None, "absent: the script's default")
    if prior and isinstance(read.fields.get("batch"), int):
        read.set("batch", 2 * read.fields["batch"], "with_prior_preservation", True,
                 "instance and class images in one batch: twice train_batch_size")
    read.set("method", method, "script", script, "")
    if method == "lora":
        if "rank" in data:
            positive(read, "rank", "rank", data["rank"])
        else:
            read.set("rank", DEFAULTS["rank"], "rank", None, "absent: the script's default")
        if data.get("lora_layers"):
            read.set("targets", str(data["lora_layers"]), "lora_layers", data["lora_layers"])
        if "lora_alpha" in data:
            read.defer("lora_alpha", data["lora_alpha"], "scales the update; no memory")
    _precision(read, data, launcher, method)
    if "gradient_checkpointing" in data:
        read.set("checkpointing", truthy(data["gradient_checkpointing"]), "gradient_checkpointing",
                 data["gradient_checkpointing"])
    if truthy(data.get("use_8bit_adam")):
        read.set("optimizer", "adamw-8bit", "use_8bit_adam", data["use_8bit_adam"], "bitsandbytes AdamW8bit")
        if "optimizer" in data:
            read.defer("optimizer", data["optimizer"], "use_8bit_adam decides")
    elif "optimizer" in data:
        optimizer_name(read, "optimizer", data["optimizer"], DIFFUSERS_OPTIMIZERS)
    if truthy(data.get("cache_latents")):
        read.set("cache_latents", True, "cache_latents", data["cache_latents"], "the VAE leaves the GPU after caching")
        if data.get("validation_prompt"):
            notes.append("with --validation_prompt the scripts keep the VAE after caching the latents (its weights "
                         "are not counted)")
    _text(read, data)
    tokens = data.get("max_sequence_length", SEQUENCE.get(script))
    if family in CATALOG_T5 and tokens is not None and tokens != CATALOG_T5[family]:
        notes.append(f"the script encodes {tokens} T5 tokens (--max_sequence_length); memfit sizes "
                     f"{CATALOG_T5[family]}, the pipeline's: the step's text tokens are fewer than memfit's")
        if "max_sequence_length" in data:
            read.ignore("max_sequence_length", tokens, f"{NOT_SIZED} (memfit sizes {CATALOG_T5[family]} T5 tokens)")
    nodes = launcher.get("num_processes")
    if isinstance(nodes, int) and nodes > 1:
        notes.append(f"accelerate launch --num_processes {nodes}: memfit sizes one GPU's step (DDP's gradient "
                     "buckets are not added)")
    finish(read, data, TABLE)
    return family


def _precision(read: Reader, data: dict, launcher: dict, method: str) -> None:
    """--mixed_precision (else accelerate launch's, else 'no'): the frozen weights and inputs in weight_dtype.
    The LoRA scripts cast the adapters to fp32 only under fp16 (cast_training_params); under bf16 they stay bf16."""
    if data.get("mixed_precision") is not None:
        key, raw, note = "mixed_precision", data["mixed_precision"], ""
    elif launcher.get("mixed_precision") is not None:
        key, raw, note = "mixed_precision", launcher["mixed_precision"], "accelerate launch's"
    else:
        key, raw, note = "mixed_precision", None, "absent: accelerate's default 'no'"
    mixed = str(raw or "no").lower()
    if mixed not in ("no", "fp16", "bf16"):
        read.unmappable("precision", key, raw, "no, fp16 or bf16")
        return
    read.set("precision", "fp32" if mixed == "no" else "amp-" + mixed, key, raw, note)
    if method == "lora":
        dtype = "bf16" if mixed == "bf16" else "fp32"
        read.set("lora_dtype", dtype, key, raw, "adapters cast to fp32 (cast_training_params)" if mixed == "fp16"
                 else "adapters left in bf16 (no cast_training_params)" if mixed == "bf16" else "")


def _text(read: Reader, data: dict) -> None:
    """The scripts compute the prompt embeddings once and delete the text encoders unless they train them or
    each image has its own caption (--dataset_name with --caption_column)."""
    if truthy(data.get("train_text_encoder")):
        read.unmappable("train_text_encoder", "train_text_encoder", data["train_text_encoder"],
                        "training the text encoders is not sized yet")
        return
    if data.get("caption_column") and data.get("dataset_name"):
        read.set("cache_text", False, "caption_column", data["caption_column"],
                 "a caption per image: the text encoders stay and run every step")
    else:
        read.set("cache_text", True, "instance_prompt", data.get("instance_prompt"),
                 "one prompt, embedded once: the text encoders leave the GPU")
