"""torchtune's recipe YAML: the model component (a catalog model), batch, length, packing, dtype, optimizer,
checkpointing, activation offloading, optimizer-in-backward, compile, the chunked loss, FSDP2 sharding, float8 and
the LoRA / QLoRA adapter (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping

from ..finetune import TORCHTUNE_ATTENTION, TORCHTUNE_MLP, BaseWeights, Finetune, LoraRecipe, Method
from ..optimizers import config_class_names
from ..setup import Checkpointing, Loss, Optimizer, Precision
from ..sources.catalog import find_entry
from ..techniques.base import FRAGMENTS
from ._mapper import (ADAPTER, QUANTIZED, WRAPPING, Context, _activation_offloading, _packing, _truthy, _whole,
                      finish)
from ._reader import NOT_RELEVANT, NOT_SIZED, OFF, Reader
from .float8 import torchtune_float8
from .hf import PAGED, read_fsdp_plan
from .lora import HEAD_REFUSED, LoraParts, _on, _run

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
        torchtune_finetune(read, model, component)
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


# --------------------------------------------------------------------------------------------- the adapter

TORCHTUNE_DORA = ("torchtune's DoRALinear is not sized (its weight norm and saved tensors are its own): memfit "
                  "sizes peft's DoRA (use_dora in a peft LoraConfig)")
TORCHTUNE_NF4 = ("torchtune's recipe: every block Linear stored as torchao's NF4Tensor (block 64, scaler block 256), "
                 "adapters, embeddings, norms and head in the recipe's dtype (memfit --lora-recipe torchtune)")
TORCHTUNE_LORA = "torchtune's recipe: adapters in the recipe's dtype (memfit --lora-recipe torchtune)"


def torchtune_finetune(read: Reader, model: Mapping, component: str) -> Finetune | None:
    """model: lora_* / qlora_* builders and their lora_* / apply_lora_* / use_dora / quantize_base arguments."""
    return _run(lambda: _torchtune(read, model, component, LoraParts(read)))


def _torchtune(read: Reader, model: Mapping, component: str, parts: LoraParts) -> Finetune | None:
    name = component.rsplit(".", 1)[-1]
    quantize = _on(model.get("quantize_base"))
    if quantize is None:
        parts.refuse("model.quantize_base", model["quantize_base"], "not true or false")
    if not name.startswith(("lora_", "qlora_", "dora_")):
        if quantize:
            parts.refuse("model.quantize_base", model["quantize_base"], "a quantized base trains only through "
                                                                        "LoRA: use a lora_ / qlora_ model builder")
        return None
    method = Method.QLORA if name.startswith("qlora_") or quantize else Method.LORA
    parts.add("recipe", LoraRecipe.TORCHTUNE, "model._component_", component)
    if method is Method.QLORA:
        parts.add("base", BaseWeights.NF4, "model.quantize_base" if quantize else "model._component_",
                  model.get("quantize_base", component))
        parts.default("double_quant", True, "torchao NF4 always quantizes its block scalers")
    if "lora_attn_modules" not in model:
        parts.refuse("model._component_", component, "a LoRA builder without model.lora_attn_modules (torchtune "
                                                     "requires it)")
    attn = model["lora_attn_modules"]
    if not isinstance(attn, (list, tuple)) or not all(isinstance(n, str) for n in attn):
        parts.refuse("model.lora_attn_modules", attn, "not a list of module names")
    unknown = [n for n in attn if n not in TORCHTUNE_ATTENTION]
    if unknown:
        parts.refuse("model.lora_attn_modules", attn, f"{', '.join(unknown)}: torchtune's attention modules are "
                                                      "q_proj, k_proj, v_proj and output_proj")
    names = [TORCHTUNE_ATTENTION[n] for n in attn]
    mlp = _on(model.get("apply_lora_to_mlp"))
    if mlp is None:
        parts.refuse("model.apply_lora_to_mlp", model["apply_lora_to_mlp"], "not true or false")
    if mlp:
        names += TORCHTUNE_MLP
        read.defer("model.apply_lora_to_mlp", model["apply_lora_to_mlp"], "adds gate_proj, up_proj, down_proj "
                                                                          "(torchtune's w1, w3, w2)")
    elif "apply_lora_to_mlp" in model:
        read.defer("model.apply_lora_to_mlp", model["apply_lora_to_mlp"], "no LoRA on the MLP")
    output = _on(model.get("apply_lora_to_output"))
    if output is None or output:
        parts.refuse("model.apply_lora_to_output", model["apply_lora_to_output"],
                     HEAD_REFUSED if output else "not true or false")
    if "apply_lora_to_output" in model:
        read.defer("model.apply_lora_to_output", False, "no LoRA on the output head")
    parts.targets(tuple(dict.fromkeys(names)), "model.lora_attn_modules", attn,
                  "output_proj is o_proj" if "output_proj" in attn else "")
    for part, key, default, check in (("rank", "lora_rank", 8, parts.rank), ("alpha", "lora_alpha", 16.0, parts.alpha),
                                      ("dropout", "lora_dropout", 0.0, parts.dropout)):
        if key in model:
            check(model[key], f"model.{key}")
        else:
            parts.default(part, default, "torchtune's LoRA builders' default")
    if name.startswith("dora_") or _on(model.get("use_dora")):
        parts.refuse("model.use_dora" if "use_dora" in model else "model._component_",
                     model.get("use_dora", component), TORCHTUNE_DORA)
    if "use_dora" in model:
        parts.flag("dora", model["use_dora"], "model.use_dora")
    return parts.finish(method, "model._component_", component,
                        TORCHTUNE_NF4 if method is Method.QLORA else TORCHTUNE_LORA)
