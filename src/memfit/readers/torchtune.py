"""torchtune's recipe YAML: the model component (a catalog model), batch, length, packing, dtype, optimizer,
checkpointing, activation offloading, optimizer-in-backward, compile, the chunked loss, FSDP2 sharding, float8 and
the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping

from ..optimizers import config_class_names
from ..setup import Checkpointing, Loss, Optimizer, Precision
from ..sources.catalog import find_entry
from ..techniques.base import FRAGMENTS
from . import lora
from ._mapper import (ADAPTER, QUANTIZED, WRAPPING, Context, _activation_offloading, _packing, _truthy, _whole,
                      finish)
from ._reader import NOT_RELEVANT, NOT_SIZED, OFF, Reader
from .float8 import torchtune_float8
from .hf import PAGED, read_fsdp_plan

TORCHTUNE_TABLE = {
    "model.lora_": ADAPTER, "model.apply_lora_": ADAPTER, "model.use_dora": ADAPTER, "model.quantize_base": QUANTIZED,
    "custom_sharded_layers": WRAPPING, "tensor_parallel_": NOT_SIZED, "data_parallel_": NOT_SIZED,
    "optimizer.": f"{NOT_RELEVANT} (optimizer hyperparameters)",
    "checkpointer.": f"{NOT_RELEVANT} (where the weights are read and saved)",
    "fsdp_cpu_offload": OFF,
}
_TORCH_ADAM = ("torch.optim.adamw", "torch.optim.adam")
_TORCHTUNE_OPTIMIZERS = {path: (Optimizer(name), PAGED if Optimizer(name).is_paged else "")
                         for path, name in config_class_names().items()}
"""torchtune `_component_` class paths (lower case) memfit sizes, from memfit.optimizers (torch AdamW apart)."""


def torchtune_model(component: str) -> str | None:
    """torchtune.models.llama3_1.lora_llama3_1_8b -> 'llama3.1-8b' (a catalog alias), or None."""
    name = component.rsplit(".", 1)[-1]
    for head in ("qlora_", "lora_", "dora_"):
        if name.startswith(head):
            name = name[len(head):]
    parts = name.split("_")
    if len(parts) < 2:
        return None
    version = [p for p in parts[1:-1] if p.isdigit()]
    candidate = ".".join([parts[0], *version]) + "-" + "-".join(p for p in parts[1:] if p not in version)
    entry = find_entry(candidate)
    return entry["name"] if entry else None


def map_torchtune(read: Reader, data: dict, ctx: Context) -> None:
    model = data.get("model") if isinstance(data.get("model"), Mapping) else {}
    component = str(model.get("_component_", ""))
    if component:
        name = torchtune_model(component)
        if name:
            read.set_model(name, "model._component_", component, "the catalog model of that architecture")
        else:
            read.ignore("model._component_", component, "not a model in memfit's catalog: give MODEL")
        lora.torchtune_finetune(read, model, component)
    _whole(read, "micro_batch_size", data, "batch_size")
    _whole(read, "grad_accum_steps", data, "gradient_accumulation_steps")
    tokenizer = data.get("tokenizer") if isinstance(data.get("tokenizer"), Mapping) else {}
    if "max_seq_len" in tokenizer:
        if tokenizer["max_seq_len"] is None:
            read.ignore("tokenizer.max_seq_len", None, "no truncation: the length is the data's, give --seq")
        else:
            _whole(read, "seq_len", {"tokenizer.max_seq_len": tokenizer["max_seq_len"]}, "tokenizer.max_seq_len")
    dataset = data.get("dataset") if isinstance(data.get("dataset"), Mapping) else {}
    if "packed" in dataset:
        _packing(read, {"dataset.packed": dataset["packed"]}, "dataset.packed", "tokenizer.max_seq_len")
    _torchtune_dtype(read, data)
    _torchtune_optimizer(read, data)
    for key in ("enable_activation_checkpointing",):
        if key in data:
            on = _truthy(data[key])
            read.set("checkpointing", Checkpointing.FULL if on else Checkpointing.NONE, key, data[key])
    _activation_offloading(read, data, "enable_activation_offloading", "torchtune OffloadActivations")
    if "optimizer_in_bwd" in data:
        read.set("optimizer_in_backward", _truthy(data["optimizer_in_bwd"]), "optimizer_in_bwd",
                 data["optimizer_in_bwd"], "each parameter steps as its gradient arrives (per-parameter hooks)")
    if "compile" in data:  # torchtune training.compile_model: each layer, and the loss
        read.set("compile", _truthy(data["compile"]), "compile", data["compile"],
                 "each layer compiled, and the loss (memfit.estimate.compiled_loss: the chunked one)"
                 if _truthy(data["compile"]) else "")
    loss = data.get("loss") if isinstance(data.get("loss"), Mapping) else {}
    if "chunked" in str(loss.get("_component_", "")).lower():
        read.set("loss", Loss.CHUNKED, "loss._component_", loss["_component_"],
                 "the head's output per sequence chunk (CEWithChunkedOutputLoss)")
    _torchtune_sharding(read, data, ctx.world)
    torchtune_float8(read, data, ctx.world)
    finish(read, data, TORCHTUNE_TABLE)


def _torchtune_dtype(read: Reader, data: Mapping) -> None:
    if "dtype" not in data:
        return
    dtype = str(data["dtype"]).lower()
    if dtype in ("bf16", "bfloat16"):
        read.set("precision", Precision.BF16, "dtype", data["dtype"], "torchtune trains the weights in bf16: "
                                                                        "gradients and optimizer states bf16 too")
    elif dtype in ("fp32", "float32"):
        read.set("precision", Precision.FP32, "dtype", data["dtype"])
    elif dtype in ("fp16", "float16"):
        read.unmappable("precision", "dtype", data["dtype"], "torchtune's recipes refuse fp16 (no gradient "
                                                             "scaling): use bf16 or fp32")
    else:
        read.unmappable("precision", "dtype", data["dtype"], "memfit sizes torchtune's bf16 and fp32")


def _torchtune_optimizer(read: Reader, data: Mapping) -> None:
    optimizer = data.get("optimizer") if isinstance(data.get("optimizer"), Mapping) else {}
    component = optimizer.get("_component_")
    if component is None:
        return
    name = str(component).lower()
    if any(read_fragment(read, optimizer) for read_fragment in FRAGMENTS["torchtune.optimizer"]):
        return  # a technique module's own component (memfit.techniques.base.FRAGMENTS)
    if name in _TORCH_ADAM:
        if _truthy(optimizer.get("fused")):
            read.set("optimizer", Optimizer.ADAMW_FUSED, "optimizer.fused", optimizer["fused"])
            read.consume("optimizer._component_")
        elif optimizer.get("foreach") is False:
            read.set("optimizer", Optimizer.ADAMW, "optimizer.foreach", False)
            read.consume("optimizer._component_")
        else:
            read.set("optimizer", Optimizer.ADAMW_FOREACH, "optimizer._component_", component,
                     "foreach by default on CUDA")
    elif name in _TORCHTUNE_OPTIMIZERS:
        value, note = _TORCHTUNE_OPTIMIZERS[name]
        read.set("optimizer", value, "optimizer._component_", component, note)
        if value is Optimizer.SGD and not optimizer.get("momentum"):
            read.ignore("optimizer.momentum", optimizer.get("momentum", 0),
                        "without momentum SGD keeps no state: sized with one momentum buffer (an upper bound)")
    else:
        read.unmappable("optimizer", "optimizer._component_", component,
                        "memfit sizes torch.optim.AdamW / Adam / SGD / Adafactor, bitsandbytes' (Paged)AdamW8bit, "
                        "PagedAdamW and Lion, torchao's AdamW8bit / AdamW4bit / AdamWFp8")


def _torchtune_sharding(read: Reader, data: Mapping, world: int | None) -> None:
    """torchtune's distributed recipes shard with FSDP2 (fully_shard, reshard_after_forward True by default)."""
    keys = [k for k in ("fsdp_reshard_after_forward", "fsdp_cpu_offload") if k in data]
    if not keys and (world is None or world < 2):
        return
    key = keys[0] if keys else "fsdp_reshard_after_forward"
    reshard = data.get("fsdp_reshard_after_forward", True)
    offload = ("fsdp_cpu_offload", data["fsdp_cpu_offload"]) if _truthy(data.get("fsdp_cpu_offload")) else None
    read_fsdp_plan(read, 3 if _truthy(reshard) else 2, key, data.get(key, True), world, offload=offload)
    for name in keys:
        read.consume(name)
