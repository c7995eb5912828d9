"""LitGPT's finetune configs (`litgpt finetune_lora --config lora.yaml`, config_hub/finetune/<model>/{lora,qlora,
full}.yaml) -> TrainingSetup fields. From litgpt 0.5.13: finetune/lora.py and finetune/full.py `setup` (their
arguments are the YAML's top-level keys), args.py TrainArgs (`train:`), utils.py instantiate_bnb_optimizer /
instantiate_torch_optimizer / get_default_supported_precision, and lightning's BitsandbytesPrecision.

What LitGPT does that the mapping follows:
- `precision` is a Lightning precision (memfit.readers.lightning); left out, LitGPT picks bf16-mixed on a GPU with
  bf16. `--quantize bnb.*` runs Lightning's BitsandbytesPrecision plugin in the `-true` dtype: LitGPT refuses it
  with a mixed precision (and so with no precision given) and with more than one device.
- `quantize`: bnb.nf4 / bnb.fp4 (Linear4bit, compress_statistics=False), bnb.nf4-dq / bnb.fp4-dq (double
  quantization), bnb.int8-training (Linear8bitLt). Nothing calls peft's prepare_model_for_kbit_training: norms and
  embeddings stay in the training dtype (Finetune.kbit_prep False). The optimizer is then always bitsandbytes'
  PagedAdamW (32-bit states in unified memory), whatever the config names, and LitGPT refuses a non-AdamW one.
- LoRA flags lora_query / key / value / projection / mlp / head (defaults True, False, True, False, False, False;
  r 8, alpha 16, dropout 0.05) -> the module names of memfit's Hugging Face graph of the same checkpoint.
  LitGPT's LoRALinear keeps A and B in the model's dtype and upcasts nothing (memfit's torchtune recipe keeps the
  same tensors: --lora-recipe torchtune).
- `train.micro_batch_size`, `train.global_batch_size` / (devices x num_nodes) / micro = accumulation,
  `train.max_seq_length` (LitGPT truncates to it and pads each batch to its longest sample: the length memfit sizes is
  the longest a batch can be).
- More than one device: finetune_lora runs ModelParallelStrategy (FSDP2 fully_shard per Linear and block, each block
  checkpointed); finetune_full runs FSDPStrategy (FSDP1 FULL_SHARD, each Block checkpointed).

LitGPT's own GPT module (fused qkv, its LoRA zero-padding of the q/k/v update, fp32 RMSNorm, the loss over Fabric's
fp32 copies of 128-token head chunks) is sized with model_code litgpt (memfit.estimate.litgpt, measured in
bench/results/litgpt.md) on the Hugging Face model of the checkpoint's shape; under --quantize Lightning's plugin
also packs the output head (memfit keeps it 16-bit) and LitGPT's adapters are 16-bit (memfit's peft recipe sizes them
fp32).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from ..finetune import BaseWeights, LoraRecipe, Method
from ..optimizers import config_class_names
from ..setup import Checkpointing, ModelCode, Optimizer, Precision
from ..sources.catalog import find_entry
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive
from .hf import read_fsdp_plan
from .lightning import canonical, read_lightning_precision
from .lora import HEAD_REFUSED, LoraParts, _on, _run

LORA_FLAGS = ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head")
FLAG_DEFAULTS = {"lora_query": True, "lora_key": False, "lora_value": True, "lora_projection": False,
                 "lora_mlp": False, "lora_head": False}

_LLAMA = {"lora_query": ("q_proj",), "lora_key": ("k_proj",), "lora_value": ("v_proj",),
          "lora_projection": ("o_proj",), "lora_mlp": ("gate_proj", "up_proj", "down_proj")}
_NEOX = {"lora_projection": ("dense",), "lora_mlp": ("dense_h_to_4h", "dense_4h_to_h")}
NAMES: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    # model_type -> (LitGPT flag -> the Hugging Face module names, the fused q/k/v Linear or '')
    **{t: (_LLAMA, "") for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")},
    "phi": ({"lora_query": ("q_proj",), "lora_key": ("k_proj",), "lora_value": ("v_proj",),
             "lora_projection": ("dense",), "lora_mlp": ("fc1", "fc2")}, ""),
    "phi3": ({"lora_projection": ("o_proj",), "lora_mlp": ("gate_up_proj", "down_proj")}, "qkv_proj"),
    "falcon": (_NEOX, "query_key_value"),
    "gpt_neox": (_NEOX, "query_key_value"),
}
"""The families whose LitGPT LoRA flags memfit maps. Where Hugging Face fuses q, k and v in one Linear, LitGPT's
per-part flags map only when all three are on (the same adapter tensors) or all off."""

QUANTIZE = {"bnb.nf4": (BaseWeights.NF4, False), "bnb.nf4-dq": (BaseWeights.NF4, True),
            "bnb.fp4": (BaseWeights.FP4, False), "bnb.fp4-dq": (BaseWeights.FP4, True),
            "bnb.int8-training": (BaseWeights.INT8, False)}

TABLE = {"out_dir": f"{NOT_RELEVANT} (where checkpoints are saved)", "data": f"{NOT_RELEVANT} (the dataset)",
         "eval": f"{NOT_RELEVANT} (evaluation, not the training step)", "log": NOT_RELEVANT,
         "logger_name": NOT_RELEVANT, "seed": NOT_RELEVANT, "resume": NOT_RELEVANT, "access_token": NOT_RELEVANT,
         "optimizer.init_args": f"{NOT_RELEVANT} (optimizer hyperparameters)",
         "train.save_interval": NOT_RELEVANT, "train.log_interval": NOT_RELEVANT,
         "train.lr_warmup_steps": NOT_RELEVANT, "train.lr_warmup_fraction": NOT_RELEVANT,
         "train.epochs": NOT_RELEVANT, "train.max_tokens": NOT_RELEVANT, "train.max_steps": NOT_RELEVANT,
         "train.max_time": NOT_RELEVANT, "train.min_lr": NOT_RELEVANT,
         "train.max_norm": f"{NOT_RELEVANT} (gradient clipping works in place)",
         "train.tie_embeddings": f"{NOT_SIZED} (tying the head to the embedding the checkpoint does not tie)"}


def model_of(checkpoint_dir: Any) -> tuple[str, str] | None:
    """checkpoints/meta-llama/Llama-2-7b-hf -> ('llama-2-7b', 'llama'): the catalog entry of the hub id LitGPT's
    download names the folder after, and its model_type; None when the catalog has no such model."""
    parts = PurePosixPath(str(checkpoint_dir).replace("\\", "/").rstrip("/")).parts
    for hub in (["/".join(parts[-2:])] if len(parts) >= 2 else []) + ([parts[-1]] if parts else []):
        entry = find_entry(hub)
        if entry:
            return entry["name"], str(entry["config"].get("model_type", ""))
    return None


def map_litgpt(read: Reader, data: dict, ctx: Any) -> None:
    """The fields the config sets (memfit.readers.formats lists the rest as ignored, with TABLE's reasons)."""
    found = model_of(data["checkpoint_dir"]) if data.get("checkpoint_dir") else None
    if found:
        read.set_model(found[0], "checkpoint_dir", data["checkpoint_dir"], "the catalog model of that hub id")
    elif "checkpoint_dir" in data:
        read.ignore("checkpoint_dir", data["checkpoint_dir"], "not a model in memfit's catalog: give MODEL")
    model_type = found[1] if found else ""
    read.set("model_code", ModelCode.LITGPT, "checkpoint_dir", data.get("checkpoint_dir"),
             "LitGPT's own GPT (litgpt.model / litgpt.lora), stepped with 128-token head chunks",
             text="a LitGPT finetune config")
    lora = bool({*LORA_FLAGS, "lora_r", "lora_alpha", "lora_dropout"} & set(data))
    quantize = data.get("quantize")
    if quantize is not None and not lora:
        read.unmappable("finetune", "quantize", quantize, "a quantized base without LoRA flags is LitGPT's adapter "
                                                          "recipe (LLaMA-Adapter prefixes), which memfit does not size")
    world = _world(read, data)
    _precision(read, data, quantize)
    if lora:
        _run(lambda: _lora(read, data, model_type, quantize, LoraParts(read)))
    _optimizer(read, data, quantize)
    _train(read, data, world)
    if world and world > 1:
        if quantize is not None:
            read.unmappable("num_gpus", "devices", data.get("devices"), "LitGPT refuses --quantize on more than one "
                                                                        "device: set devices 1")
        read_fsdp_plan(read, 3, "devices", data.get("devices"), world)
        read.set("checkpointing", Checkpointing.FULL, "devices", data.get("devices"),
                 ("finetune_lora's parallelize_fn wraps each block in checkpoint_wrapper" if lora else
                  "finetune_full's FSDPStrategy(activation_checkpointing_policy={Block}); FSDP1 FULL_SHARD, "
                  "sized as FSDP2"))


def _world(read: Reader, data: Mapping) -> int | None:
    devices, nodes = data.get("devices", 1), data.get("num_nodes", 1)
    if devices in ("auto", -1, "-1"):
        read.ignore("devices", devices, "'auto' is every GPU of the machine: give --gpus")
        return None
    if not _positive(devices) or not _positive(nodes):
        bad = "devices" if not _positive(devices) else "num_nodes"
        read.unmappable("num_gpus", bad, data.get(bad), "not a positive whole number")
        return None
    world = devices * nodes
    if "devices" in data or "num_nodes" in data:
        read.set("num_gpus", world, "devices", devices, f"devices x num_nodes = {world}")
        if "num_nodes" in data:
            read.consume("num_nodes")
        if nodes > 1 and "num_gpus" not in read.overridden:
            read.num_nodes = nodes
    return world


def _precision(read: Reader, data: Mapping, quantize: Any) -> None:
    raw = data.get("precision")
    if raw is None:
        if quantize is not None:
            read.unmappable("precision", "precision", raw, "LitGPT refuses --quantize with its default precision "
                                                           "(bf16-mixed): set precision bf16-true")
            return
        read.set("precision", Precision.AMP_BF16, "precision", raw, "LitGPT's default on a GPU with bf16 "
                                                                     "(get_default_supported_precision)")
        return
    if quantize is not None and "mixed" in canonical(raw):
        read.unmappable("precision", "precision", raw, "LitGPT refuses --quantize with a mixed precision: the "
                                                       "bitsandbytes plugin runs in the -true dtype")
        return
    read_lightning_precision(read, raw, "precision")


def _lora(read: Reader, data: Mapping, model_type: str, quantize: Any, parts: LoraParts):
    if _on(data.get("lora_head", False)):
        parts.refuse("lora_head", data["lora_head"], HEAD_REFUSED)
    flags = {}
    for flag in LORA_FLAGS:
        flags[flag] = _on(data[flag]) if flag in data else FLAG_DEFAULTS[flag]
        if flags[flag] is None:
            parts.refuse(flag, data[flag], "not true or false")
        if flag in data:
            read.defer(flag, data[flag], "a LoRA target" if flags[flag] else "no LoRA there")
    names, fused = NAMES.get(model_type, NAMES["llama"])
    targets: list[str] = []
    qkv = [flags[f] for f in ("lora_query", "lora_key", "lora_value")]
    if fused and any(qkv):
        if not all(qkv):
            parts.refuse("lora_key" if not flags["lora_key"] else "lora_query", data.get("lora_key", False),
                         f"{model_type} fuses q, k and v in {fused} (Hugging Face's module): LitGPT's LoRA on a part "
                         "of it is not sized; set lora_query, lora_key and lora_value alike")
        targets.append(fused)
    for flag in LORA_FLAGS[:5]:
        if flags[flag] and flag in names:
            targets += names[flag]
    if not targets:
        parts.refuse("lora_query", data.get("lora_query", False), "every LoRA flag is off: nothing is trained")
    note = "" if model_type in NAMES else "Llama module names (the model is not in memfit's catalog)"
    parts.targets(tuple(targets), "lora_query" if "lora_query" in data else "lora_r", data.get("lora_query", True),
                  note)
    for part, key, default, check in (("rank", "lora_r", 8, parts.rank), ("alpha", "lora_alpha", 16.0, parts.alpha),
                                      ("dropout", "lora_dropout", 0.05, parts.dropout)):
        if key in data:
            check(data[key], key)
        else:
            parts.default(part, default, "finetune_lora's default")
    key = "lora_r" if "lora_r" in data else "lora_query"
    if quantize is None:
        precision = canonical(data.get("precision")) or "bf16-mixed"
        if precision.endswith("-true") and precision != "32-true":
            parts.add("recipe", LoraRecipe.TORCHTUNE, key, data.get(key), "LitGPT's LoRALinear: adapters in the "
                      "model's dtype, nothing upcast (memfit's torchtune recipe)")
        else:  # the module stays fp32 (Lightning converts nothing): an fp32 base and fp32 adapters under autocast
            parts.add("base", BaseWeights.FP32, "precision", data.get("precision"),
                      "Lightning leaves the module in fp32: the frozen base and the adapters fp32")
        return parts.finish(Method.LORA, key, data.get(key))
    spelled = str(quantize).strip().lower()
    if spelled not in QUANTIZE:
        parts.refuse("quantize", quantize, f"LitGPT's --quantize takes {', '.join(QUANTIZE)}")
    base, double = QUANTIZE[spelled]
    parts.add("base", base, "quantize", quantize, "Lightning's BitsandbytesPrecision")
    parts.add("double_quant", double, "quantize", quantize)
    parts.add("kbit_prep", False, "quantize", quantize, "LitGPT does not call prepare_model_for_kbit_training")
    return parts.finish(Method.QLORA, "quantize", quantize)


def _optimizer(read: Reader, data: Mapping, quantize: Any) -> None:
    raw = data.get("optimizer", "AdamW")
    name = raw.get("class_path") if isinstance(raw, Mapping) else raw
    key = "optimizer.class_path" if isinstance(raw, Mapping) else "optimizer"
    if quantize is not None:
        if "AdamW" not in str(name):
            read.unmappable("optimizer", key, name, "LitGPT's --quantize trains with AdamW only "
                                                    "(instantiate_bnb_optimizer)")
            return
        read.set("optimizer", Optimizer.PAGED_ADAMW, key, name, "--quantize: instantiate_bnb_optimizer builds "
                                                               "bitsandbytes' PagedAdamW")
        return
    text = str(name)
    path = text.lower() if "." in text else f"torch.optim.{text}".lower()
    classes = config_class_names()
    if path in ("torch.optim.adamw", "torch.optim.adam"):
        init = raw.get("init_args", {}) if isinstance(raw, Mapping) else {}
        init = init if isinstance(init, Mapping) else {}
        if _on(init.get("fused")):
            read.set("optimizer", Optimizer.ADAMW_FUSED, key, name, "init_args.fused")
        elif init.get("foreach") is False:
            read.set("optimizer", Optimizer.ADAMW, key, name, "init_args.foreach false")
        else:
            read.set("optimizer", Optimizer.ADAMW_FOREACH, key, name, "foreach by default on CUDA")
    elif path in classes:
        read.set("optimizer", Optimizer(classes[path]), key, name)
    elif "optimizer" in data:
        read.unmappable("optimizer", key, name, "memfit sizes torch.optim.AdamW / Adam / SGD and the bitsandbytes / "
                                                "torchao optimizers it names in --optimizer")


def _train(read: Reader, data: Mapping, world: int | None) -> None:
    train = data.get("train")
    if train is None:
        return
    if not isinstance(train, Mapping):
        read.unmappable("micro_batch_size", "train", train, "not a mapping of TrainArgs")
        return
    with read.scope(read.file, "train."):
        micro = train.get("micro_batch_size")
        if micro is not None:
            if not _positive(micro):
                read.unmappable("micro_batch_size", "micro_batch_size", micro, "not a positive whole number")
            else:
                read.set("micro_batch_size", micro, "micro_batch_size", micro)
        total = train.get("global_batch_size")
        if total is not None and _positive(micro):
            ranks = world or 1
            if not _positive(total) or total % ranks or (total // ranks) % micro:
                read.unmappable("grad_accum_steps", "global_batch_size", total,
                                f"not a multiple of micro_batch_size x devices ({micro} x {ranks})")
            else:
                read.set("grad_accum_steps", total // ranks // micro, "global_batch_size", total,
                         f"global / (devices {ranks} x micro {micro})")
        length = train.get("max_seq_length")
        if length is None:
            if "max_seq_length" in train:
                read.ignore("max_seq_length", None, "no limit: the longest sample of the data, give --seq")
        elif _positive(length):
            read.set("seq_len", length, "max_seq_length", length,
                     "LitGPT pads each batch to its longest sample: the longest a batch can be")
        else:
            read.unmappable("seq_len", "max_seq_length", length, "not a positive whole number")
