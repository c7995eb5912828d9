"""ostris ai-toolkit's job YAML (config.process[0]: model, network, train, datasets) -> size_run's keywords.
Names and defaults from toolkit/config_modules.py (ModelConfig, NetworkConfig, TrainConfig, DatasetConfig)."""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import ConfigError
from ...readers._mapper import finish
from ...readers._reader import NOT_RELEVANT, NOT_SIZED, Reader
from .common import BLOCK_LINEARS, catalog_model, optimizer_name, positive, resolution, truthy

ARCH = {"flux": "flux", "sd3": "sd3", "sdxl": "sdxl", "is_flux": "flux", "is_v3": "sd3", "is_xl": "sdxl"}
OPTIMIZERS = {"adamw": "adamw-foreach", "adam": "adamw-foreach", "adamw8bit": "adamw-8bit", "adam8bit": "adamw-8bit",
              "lion8bit": "lion-8bit", "lion": "lion", "adafactor": "adafactor"}
"""train.optimizer (toolkit/optimizer.py get_optimizer): torch's AdamW / Adam (two moments, torch's default kernel),
bitsandbytes' AdamW8bit / Adam8bit / Lion8bit, lion_pytorch's Lion, its own Adafactor (factored second moment, no
first moment by default). Prodigy, D-Adaptation, its own adam8 / automagic: not sized yet."""
QTYPES = {"qfloat8": "fp8", "float8": "fp8"}
"""model.qtype (optimum-quanto's qfloat8, or float8 with layer offloading): 8-bit float weights."""
TABLE = {
    "model.quantize_te": f"{NOT_SIZED} (quantized text encoders: memfit sizes them in the weight dtype)",
    "model.low_vram": f"{NOT_SIZED} (parts kept on the CPU while loading and quantizing)",
    "model.layer_offloading": f"{NOT_SIZED} (layer offloading)",
    "network.conv": f"{NOT_SIZED} (adapters on convolutions)",
    "network.dropout": f"{NOT_SIZED} (dropout on the adapters)",
    "train.ema_config": f"{NOT_SIZED} (an EMA copy of the trained weights)",
    "train.gradient_accumulation_steps": f"{NOT_SIZED} (gradients kept across micro-steps)",
    "sample": f"{NOT_SIZED} (sampling during training runs the whole pipeline)",
    "save": f"{NOT_RELEVANT} (saving)",
}


def process(data: Mapping) -> Mapping:
    """The first process of `config.process` (the one training job a file holds)."""
    procs = data.get("config", {}).get("process") if isinstance(data.get("config"), Mapping) else None
    if not isinstance(procs, list) or not procs or not isinstance(procs[0], Mapping):
        raise ConfigError("an ai-toolkit job needs config.process: a list holding the training process")
    return procs[0]


def map_ai_toolkit(read: Reader, data: dict, notes: list[str]) -> str | None:
    proc = process(data)
    prefix = "config.process.0."
    model = proc.get("model") if isinstance(proc.get("model"), Mapping) else {}
    train = proc.get("train") if isinstance(proc.get("train"), Mapping) else {}
    network = proc.get("network") if isinstance(proc.get("network"), Mapping) else {}
    datasets = [d for d in proc.get("datasets") or [] if isinstance(d, Mapping)]
    family = next((ARCH[k] for k in ("is_flux", "is_v3", "is_xl") if truthy(model.get(k))),
                  ARCH.get(str(model.get("arch", "")).split(":")[0]))
    with read.scope(read.file, prefix):
        if "name_or_path" in model:
            catalog_model(read, "model.name_or_path", model["name_or_path"], family)
        if truthy(model.get("quantize")):
            qtype = str(model.get("qtype", "qfloat8"))
            if qtype in QTYPES:
                read.set("base_dtype", QTYPES[qtype], "model.quantize", True, f"qtype {qtype}: 8-bit float weights")
                if "qtype" in model:
                    read.defer("model.qtype", qtype, "the base weights' type")
                if model.get("quantize_te", True) and not text_cached(train, datasets):
                    notes.append("ai-toolkit quantizes the text encoders too (model.quantize_te follows "
                                 "model.quantize): memfit sizes them in the weight dtype, above what they hold")
            else:
                read.unmappable("base_dtype", "model.qtype", qtype, "memfit sizes 8-bit float bases (qfloat8)")
        sized = [(i, d["resolution"]) for i, d in enumerate(datasets) if "resolution" in d]
        if sized:  # every dataset's bucket sizes: the largest sets the peak
            flat = [s for _, size in sized for s in (size if isinstance(size, list) else [size])]
            resolution(read, f"datasets.{sized[0][0]}.resolution", flat if len(flat) > 1 else flat[0],
                       width_first=False)
            for i, size in sized[1:]:
                read.defer(f"datasets.{i}.resolution", size, "the largest size of every dataset sets the peak")
        else:
            read.set("resolution", (512, 512), "datasets.resolution", None, "absent: ai-toolkit's default 512")
        for i, d in enumerate(datasets):
            for key in ("cache_latents", "cache_latents_to_disk"):
                if key in d:
                    read.defer(f"datasets.{i}.{key}", d[key], "every dataset must cache for the VAE to leave")
        if datasets and all(truthy(d.get("cache_latents")) or truthy(d.get("cache_latents_to_disk"))
                            for d in datasets):
            read.set("cache_latents", True, "datasets.0.cache_latents_to_disk", True, "the VAE leaves the GPU")
        text = [k for k in ("unload_text_encoder", "cache_text_embeddings") if truthy(train.get(k))]
        for i, d in enumerate(datasets):
            if truthy(d.get("cache_text_embeddings")):
                read.defer(f"datasets.{i}.cache_text_embeddings", True, "every dataset caches: ai-toolkit unloads "
                           "the text encoders")
        if text or text_cached(train, datasets):
            text = text or ["cache_text_embeddings"]
            read.set("cache_text", True, f"train.{text[0]}", True, "embeddings made once, the text encoders unloaded")
        positive(read, "batch", "train.batch_size", train.get("batch_size", 1))
        checkpointing = train.get("gradient_checkpointing", True)
        read.set("checkpointing", truthy(checkpointing), "train.gradient_checkpointing", checkpointing,
                 "" if "gradient_checkpointing" in train else "absent: ai-toolkit's default on")
        optimizer_name(read, "train.optimizer", train.get("optimizer", "adamw"), OPTIMIZERS)
        dtype = str(train.get("dtype", "fp32")).lower()
        mixed = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}.get(dtype)
        read.set("precision", f"amp-{mixed}" if mixed else "fp32", "train.dtype", train.get("dtype", "fp32"),
                 "the model in it")
        if truthy(train.get("train_text_encoder")):
            read.unmappable("train_text_encoder", "train.train_text_encoder", True,
                            "training the text encoders is not sized yet")
        if network:
            kind = str(network.get("type", "lora")).lower()
            if kind not in ("lora", "locon"):
                read.unmappable("method", "network.type", network.get("type"), "memfit sizes LoRA adapters only")
            read.set("method", "lora", "network.type", network.get("type", "lora"))
            rank_key = "network.linear" if "linear" in network else "network.rank"
            if "linear" in network or "rank" in network:
                positive(read, "rank", rank_key, network.get("linear", network.get("rank")))
            else:
                read.set("rank", 4, "network.linear", None, "absent: ai-toolkit's default 4")
            read.set("lora_dtype", "fp32", "network.type", network.get("type", "lora"), "the network forced to fp32")
            if "linear_alpha" in network:
                read.defer("network.linear_alpha", network["linear_alpha"], "scales the update; no memory")
            if family in BLOCK_LINEARS:
                targets = BLOCK_LINEARS[family]
                read.set("targets", targets if isinstance(targets, str) else ",".join(targets), "network.type",
                         network.get("type", "lora"), "every Linear of the transformer blocks")
        else:
            read.set("method", "full", "network", None, "no network: the whole model trains")
    finish(read, {k: v for k, v in proc.items() if k != "datasets"}, TABLE, prefix=prefix)
    for i, d in enumerate(datasets):
        finish(read, d, TABLE, prefix=f"{prefix}datasets.{i}.")
    return family


def text_cached(train: Mapping, datasets: list) -> bool:
    """ai-toolkit unloads the text encoders when train.unload_text_encoder or cache_text_embeddings is on (train's
    or every dataset's: BaseSDTrainProcess)."""
    return truthy(train.get("unload_text_encoder")) or truthy(train.get("cache_text_embeddings")) or bool(
        datasets) and all(truthy(d.get("cache_text_embeddings")) for d in datasets)
