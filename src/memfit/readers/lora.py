"""LoRA / QLoRA settings of each config format -> the setup's `finetune` (memfit.finetune.Finetune), one part per
config field: which fields gave the method, rank, alpha, dropout, targets, modules_to_save, base weights, double
quantization and DoRA, each recorded as read; a value memfit cannot size is a one-line ConfigError naming it.

Defaults are each project's own, said in the note of the field that chose the method (axolotl's pydantic schema,
LLaMA-Factory's FinetuningArguments / QuantizationArguments, torchtune's LoRA model builders, peft's LoraConfig and
transformers' BitsAndBytesConfig)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, TORCHTUNE_ATTENTION, TORCHTUNE_MLP, BaseWeights, Finetune, LoraRecipe, Method
from ._reader import _MISSING, NOT_RELEVANT, NOT_SIZED, Reader, _positive

FIELD = "finetune"
HEAD = "lm_head"
TORCHTUNE_DORA = ("torchtune's DoRALinear is not sized (its weight norm and saved tensors are its own): memfit "
                  "sizes peft's DoRA (use_dora in a peft LoraConfig)")
RSLORA_NOTE = "rank-stabilized scaling alpha / sqrt(r): the same tensors, the same memory"
HEAD_REFUSED = ("LoRA on the output head (lm_head) is not sized by memfit (its adapters and the head's frozen copy "
                "are not modelled): leave the head out of the targets")
_DTYPES = {"bfloat16": BaseWeights.BF16, "bf16": BaseWeights.BF16, "torch.bfloat16": BaseWeights.BF16,
           "float16": BaseWeights.FP16, "fp16": BaseWeights.FP16, "torch.float16": BaseWeights.FP16,
           "float32": BaseWeights.FP32, "fp32": BaseWeights.FP32, "torch.float32": BaseWeights.FP32}


class _Missing(Exception):
    """A value was refused (read.unmappable recorded or raised it): stop building the Finetune."""


class LoraParts:
    """Collects the parts of one Finetune from a config's fields, then sets `finetune` once (on the field that
    chose the method) and records every field that gave a part."""

    def __init__(self, read: Reader) -> None:
        self.read = read
        self.parts: list[tuple[str, Any, str, Any, str]] = []
        self.defaults: list[str] = []

    def add(self, part: str, value: Any, key: str, raw: Any = _MISSING, note: str = "") -> None:
        self.parts.append((part, value, key, raw, note))

    def default(self, part: str, value: Any, why: str) -> None:
        """A part the file does not give: the project's default, said in the note."""
        self.parts.append((part, value, "", _MISSING, ""))
        self.defaults.append(f"{part} {_text(value)} ({why})")

    def refuse(self, key: str, raw: Any, why: str) -> None:
        self.read.unmappable(FIELD, key, raw, why)
        raise _Missing

    # ------------------------------------------------------------------------------------------- typed parts

    def rank(self, value: Any, key: str, note: str = "") -> int:
        if not _positive(value):
            self.refuse(key, value, "LoRA rank must be a positive whole number")
        self.add("rank", value, key, value, note)
        return value

    def alpha(self, value: Any, key: str, note: str = "") -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            self.refuse(key, value, "LoRA alpha must be a positive number")
        self.add("alpha", float(value), key, value, note)

    def dropout(self, value: Any, key: str, note: str = "") -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            self.refuse(key, value, "LoRA dropout must be in [0, 1)")
        self.add("dropout", float(value), key, value, note)

    def flag(self, part: str, value: Any, key: str, note: str = "") -> bool:
        on = _on(value)
        if on is None:
            self.refuse(key, value, "not true or false")
        self.add(part, on, key, value, note)
        return on

    def names(self, value: Any, key: str, *, comma: bool = False) -> tuple[str, ...]:
        """A list of module names (or, with `comma`, one comma-separated string)."""
        if value is None:
            return ()
        if isinstance(value, str):
            if comma or value == ALL_LINEAR:
                return tuple(v.strip() for v in value.split(",") if v.strip())
            self.refuse(key, value, "a string target is a regular expression peft matches against whole module "
                                    "paths: memfit sizes a list of module names (or 'all-linear')")
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        self.refuse(key, value, "not a list of module names")
        return ()

    def targets(self, names: tuple[str, ...], key: str, raw: Any, note: str = "") -> None:
        if HEAD in names:
            self.refuse(key, raw, HEAD_REFUSED)
        if ALL_LINEAR in names and names != (ALL_LINEAR,):
            self.refuse(key, raw, "'all-linear' already covers every projection: give it alone or list names")
        self.add("targets", names, key, raw, note)

    # ----------------------------------------------------------------------------------------------- result

    def finish(self, method: Method, key: str, raw: Any, note: str = "") -> Finetune | None:
        values = {part: value for part, value, *_ in self.parts}
        values["method"] = method
        if method is Method.QLORA and values.get("base") is BaseWeights.NF4:
            values["base"] = BaseWeights.AUTO  # QLoRA's own storage: the same Finetune memfit's options give
        try:
            ft = Finetune(**values)
        except ConfigError as error:
            self.read.unmappable(FIELD, key, raw, str(error))
            return None
        said = "; ".join(([note] if note else []) + (["defaults: " + ", ".join(self.defaults)]
                                                      if self.defaults else []))
        self.read.set(FIELD, ft, key, raw, said)
        for part, value, part_key, part_raw, part_note in self.parts:
            if part_key:
                self.read.set_part(FIELD, part, value, part_key, part_raw, part_note)
        return ft


def _on(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    text = str(value).strip().lower()
    return True if text == "true" else False if text in ("false", "") else None


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "peft's default targets"
    return str(getattr(value, "value", value))


def _run(build) -> Finetune | None:
    try:
        return build()
    except _Missing:
        return None


# --------------------------------------------------------------------------------------------------- axolotl

AXOLOTL_TABLE = {
    "lora_model_dir": f"{NOT_RELEVANT} (starts from a saved adapter: the same adapters)",
    "lora_fan_in_fan_out": NOT_RELEVANT, "loraplus_": f"{NOT_RELEVANT} (learning rates)",
    "lora_on_cpu": f"{NOT_RELEVANT} (model loading, not the step)",
    "lora_mlp_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "lora_qkv_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "lora_o_kernel": f"{NOT_SIZED} (axolotl's fused LoRA kernels save activations; sized without them)",
    "peft_init_lora_weights": f"{NOT_RELEVANT} (initialisation)",
    "peft_layers_to_transform": f"{NOT_SIZED} (adapters sized on every layer, an upper bound)",
    "peft_layers_pattern": NOT_RELEVANT, "peft_autocast_adapter_dtype": NOT_SIZED,
    "merge_lora": NOT_RELEVANT, "merge_method": NOT_RELEVANT,
    "qlora_sharded_model_loading": f"{NOT_RELEVANT} (model loading, not the step)",
    "bnb_config_kwargs.": f"{NOT_RELEVANT} (quantization details that keep the 4-bit layout)",
    "peft.loftq_config": f"{NOT_RELEVANT} (initialisation)",
    "lora_target_parameters": f"{NOT_SIZED} (adapters on expert parameters)",
}
_AXOLOTL_DROPOUT = "axolotl's default 0.0"


AXOLOTL_NO_UPCAST = "axolotl keeps the embeddings, norms and head of a quantized base in torch_dtype"
"""axolotl src/axolotl/loaders/model.py (ModelLoader): `_prepare_model_for_quantization` calls peft's
prepare_model_for_kbit_training unless FSDP (`fsdp` / `fsdp_config`) or ZeRO-3 is on, and
`_configure_embedding_dtypes` then casts every module named "norm" and the embedding / head modules
(loaders/utils.py get_linear_embedding_layers) back to torch_dtype for any adapter, unless the config is
qlora under FSDP (where nothing was upcast): either way the residual stream stays 16-bit (only MoE routers,
`.gate`, stay fp32, and `fp32_norms` keeps norms fp32): memfit's kbit_prep False."""


def axolotl_finetune(read: Reader, data: Mapping) -> Finetune | None:
    """adapter / lora_* / load_in_* / bnb_config_kwargs / peft_use_dora -> finetune."""
    return _run(lambda: _axolotl(read, data, LoraParts(read)))


def _axolotl(read: Reader, data: Mapping, parts: LoraParts) -> Finetune | None:
    adapter, (four, four_key), (eight, eight_key) = _axolotl_quantized(read, data, parts)
    if not adapter:
        if four or eight:
            key = four_key if four else eight_key
            parts.refuse(key, True, "a quantized base trains only through an adapter: set adapter lora / qlora "
                                    "(axolotl refuses load_in_4bit / load_in_8bit for a full fine-tune)")
        if "adapter" in data:
            read.defer("adapter", adapter, "full fine-tune: every weight trained")
        return None
    kind = str(adapter).lower()
    if kind not in ("lora", "qlora"):
        parts.refuse("adapter", adapter, "memfit sizes adapter lora and qlora (or none: a full fine-tune)")
    if _on(data.get("gptq")):
        parts.refuse("gptq", data["gptq"], "a GPTQ-quantized base is not sized: memfit sizes bitsandbytes bases")
    method = Method.QLORA if kind == "qlora" else Method.LORA
    if method is Method.QLORA:
        if eight:
            parts.refuse(eight_key, True, "adapter qlora loads the base in 4 bits: axolotl refuses load_in_8bit "
                                          "with it")
        if not four:
            parts.refuse("adapter", adapter, "adapter qlora needs load_in_4bit: true (axolotl refuses it otherwise)")
        _axolotl_bnb(data, parts, four_key)
    elif four:
        parts.refuse(four_key, True, "axolotl builds its 4-bit bitsandbytes config only for adapter: qlora")
    elif eight:
        parts.add("base", BaseWeights.INT8, eight_key, True, "bitsandbytes LLM.int8 base")
    if four or eight:
        parts.default("kbit_prep", False, AXOLOTL_NO_UPCAST)
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in data and not _on(data[key]):
            read.defer(key, data[key], "not quantized in this way")
    _axolotl_adapter(read, data, parts, adapter)
    return parts.finish(method, "adapter", adapter)


def _axolotl_quantized(read: Reader, data: Mapping, parts: LoraParts) -> tuple[Any, tuple[Any, str], tuple[Any, str]]:
    """The adapter and how the base is quantized: (adapter, (4-bit, its key), (8-bit, its key)), from load_in_4bit /
    load_in_8bit or axolotl's `peft` block (backend bnb, weight_dtype nf4 / int8; nf4 makes adapter lora qlora)."""
    adapter = data.get("adapter")
    peft = data.get("peft") if isinstance(data.get("peft"), Mapping) else {}
    four, eight = _on(data.get("load_in_4bit")), _on(data.get("load_in_8bit"))
    four_key, eight_key = "load_in_4bit", "load_in_8bit"
    backend = peft.get("backend")
    if backend is not None:
        if str(backend).lower() != "bnb":
            parts.refuse("peft.backend", backend, "memfit sizes a bitsandbytes-quantized base (load_in_4bit / "
                                                  "load_in_8bit, or peft.backend bnb)")
        dtype = str(peft.get("weight_dtype") or "").lower()
        if dtype == "nf4" and "load_in_4bit" not in data:
            four, four_key = True, "peft.weight_dtype"
            adapter = "qlora" if str(adapter).lower() == "lora" else adapter
        elif dtype == "int8" and "load_in_8bit" not in data:
            eight, eight_key = True, "peft.weight_dtype"
        elif dtype not in ("nf4", "int8"):
            parts.refuse("peft.weight_dtype", peft.get("weight_dtype"), "axolotl's bnb backend takes nf4 or int8")
        read.defer("peft.backend", backend, "bitsandbytes")
    for key, value in (("load_in_4bit", four), ("load_in_8bit", eight)):
        if value is None:
            parts.refuse(key, data[key], "not true or false")
    return adapter, (four, four_key), (eight, eight_key)


def _axolotl_adapter(read: Reader, data: Mapping, parts: LoraParts, adapter: Any) -> None:
    """The adapter's rank, alpha, dropout, targets (lora_target_modules / lora_target_linear), the modules saved in
    full, DoRA and rsLoRA."""
    for key in ("lora_r", "lora_alpha"):
        if data.get(key) is None:
            parts.refuse(key, data.get(key), f"adapter {adapter} without {key}: axolotl hands peft none")
    parts.rank(data["lora_r"], "lora_r")
    parts.alpha(data["lora_alpha"], "lora_alpha")
    if data.get("lora_dropout") is not None:
        parts.dropout(data["lora_dropout"], "lora_dropout")
    else:
        parts.default("dropout", 0.0, _AXOLOTL_DROPOUT)
    modules = parts.names(data.get("lora_target_modules"), "lora_target_modules")
    linear = _on(data.get("lora_target_linear"))
    if linear is None:
        parts.refuse("lora_target_linear", data["lora_target_linear"], "not true or false")
    if linear:
        if HEAD in modules:
            parts.refuse("lora_target_modules", data["lora_target_modules"], HEAD_REFUSED)
        parts.targets((ALL_LINEAR,), "lora_target_linear", data["lora_target_linear"],
                      "every Linear but the output head")
        if modules:
            read.defer("lora_target_modules", data["lora_target_modules"], "added to the linear layers axolotl "
                                                                           "finds: inside all-linear")
    elif modules:
        parts.targets(modules, "lora_target_modules", data["lora_target_modules"])
        if "lora_target_linear" in data:
            read.defer("lora_target_linear", data["lora_target_linear"], "the listed modules only")
    else:
        parts.refuse("adapter", adapter, "neither lora_target_modules nor lora_target_linear is set: axolotl "
                                         "gives peft no target modules")
    saved = data.get("lora_modules_to_save")
    if saved is not None:
        parts.add("modules_to_save", parts.names(saved, "lora_modules_to_save"), "lora_modules_to_save", saved,
                  "trained in full beside the adapters")
    if "peft_use_dora" in data:
        parts.flag("dora", data["peft_use_dora"], "peft_use_dora")
    if "peft_use_rslora" in data:
        parts.flag("rslora", data["peft_use_rslora"], "peft_use_rslora", RSLORA_NOTE)


def _axolotl_bnb(data: Mapping, parts: LoraParts, four_key: str) -> None:
    """axolotl's QLoRA bitsandbytes config: nf4 with double quantization, bnb_config_kwargs on top."""
    kwargs = data.get("bnb_config_kwargs") if isinstance(data.get("bnb_config_kwargs"), Mapping) else {}
    kind, kind_key = None, ""
    for key, source in (("bnb_4bit_quant_type", data), ("bnb_config_kwargs.bnb_4bit_quant_type", kwargs)):
        name = key.rsplit(".", 1)[-1]
        if name in source and source[name] is not None:
            kind, kind_key = source[name], key
    if kind is None:
        parts.add("base", BaseWeights.NF4, four_key, True, "axolotl's QLoRA config: nf4")
    elif str(kind).lower() in ("nf4", "fp4"):
        parts.read.defer(four_key, True, "4-bit bitsandbytes")
        parts.add("base", BaseWeights.parse(str(kind).lower()), kind_key, kind)
    else:
        parts.refuse(kind_key, kind, "bitsandbytes 4-bit types are nf4 and fp4")
    if "bnb_4bit_use_double_quant" in kwargs:
        parts.flag("double_quant", kwargs["bnb_4bit_use_double_quant"], "bnb_config_kwargs.bnb_4bit_use_double_quant")
    else:
        parts.default("double_quant", True, "axolotl's QLoRA config")


# --------------------------------------------------------------------------------------------- LLaMA-Factory

LLAMAFACTORY_TABLE = {
    "loraplus_": f"{NOT_RELEVANT} (learning rates)",
    "pissa_": f"{NOT_RELEVANT} (initialisation)", "create_new_adapter": NOT_RELEVANT,
    "adapter_name_or_path": f"{NOT_RELEVANT} (starts from a saved adapter: the same adapters)",
    "quantization_device_map": f"{NOT_RELEVANT} (model loading, not the step)",
}
_LF_BNB = ("bnb", "bitsandbytes")


def llamafactory_finetune(read: Reader, data: Mapping) -> Finetune | None:
    """finetuning_type / lora_* / additional_target / quantization_* / use_dora -> finetune."""
    return _run(lambda: _llamafactory(read, data, LoraParts(read)))


def _llamafactory(read: Reader, data: Mapping, parts: LoraParts) -> Finetune | None:
    kind = data.get("finetuning_type")
    text = "lora" if kind is None else str(kind).lower()
    bits = data.get("quantization_bit")
    if text == "full":
        if bits is not None:
            parts.refuse("quantization_bit", bits, "LLaMA-Factory quantizes the base only for finetuning_type lora")
        read.defer("finetuning_type", kind, "full fine-tune: every weight trained")
        return None
    if text == "freeze":
        parts.refuse("finetuning_type", kind, "freeze (partial-parameter) fine-tuning is not sized: memfit sizes "
                                              "full, lora and qlora (lora with quantization_bit)")
    if text != "lora":
        parts.refuse("finetuning_type", kind, "memfit sizes finetuning_type full and lora (qlora: lora with "
                                              "quantization_bit)")
    method = Method.LORA
    if bits is not None:
        method = _llamafactory_quantized(read, data, parts, bits)
    else:
        for key in ("quantization_method", "quantization_type", "double_quantization"):
            if key in data:
                read.defer(key, data[key], "no quantization_bit: the base is not quantized")
    rank = data.get("lora_rank")
    if rank is None:
        rank = 8
        parts.default("rank", 8, "LLaMA-Factory's default")
    else:
        parts.rank(rank, "lora_rank")
    if data.get("lora_alpha") is None:
        if _positive(rank):
            parts.default("alpha", float(rank * 2), "LLaMA-Factory's default: lora_rank * 2")
    else:
        parts.alpha(data["lora_alpha"], "lora_alpha")
    if "lora_dropout" in data:
        parts.dropout(data["lora_dropout"], "lora_dropout")
    else:
        parts.default("dropout", 0.0, "LLaMA-Factory's default")
    target = data.get("lora_target")
    if target is None:
        parts.default("targets", (ALL_LINEAR,), "LLaMA-Factory's default lora_target all")
    else:
        names = parts.names(target, "lora_target", comma=True)
        if names == ("all",):
            parts.targets((ALL_LINEAR,), "lora_target", target, "every Linear but the output head")
        else:
            parts.targets(names, "lora_target", target)
    extra = data.get("additional_target")
    if extra is not None:
        parts.add("modules_to_save", parts.names(extra, "additional_target", comma=True), "additional_target",
                  extra, "trained in full beside the adapters")
    if "use_dora" in data:
        parts.flag("dora", data["use_dora"], "use_dora")
    if "use_rslora" in data:
        parts.flag("rslora", data["use_rslora"], "use_rslora", RSLORA_NOTE)
    note = "absent: LLaMA-Factory's default is lora" if kind is None else ""
    return parts.finish(method, "finetuning_type", kind, note)


def _llamafactory_quantized(read: Reader, data: Mapping, parts: LoraParts, bits: Any) -> Method:
    how = data.get("quantization_method", "bnb")
    if str(getattr(how, "value", how)).lower() not in _LF_BNB:
        parts.refuse("quantization_method", how, "memfit sizes bitsandbytes (bnb) quantization")
    if "quantization_method" in data:
        read.defer("quantization_method", how, "bitsandbytes")
    if bits == 8 and not isinstance(bits, bool):
        parts.add("base", BaseWeights.INT8, "quantization_bit", bits, "bitsandbytes LLM.int8 base")
        for key in ("quantization_type", "double_quantization"):
            if key in data:
                read.defer(key, data[key], "a 4-bit setting: the base is 8-bit")
        _llamafactory_upcast(data, parts)
        return Method.LORA
    if bits != 4 or isinstance(bits, bool):
        parts.refuse("quantization_bit", bits, "memfit sizes bitsandbytes 4- and 8-bit bases")
    kind = data.get("quantization_type")
    if kind is None:
        parts.add("base", BaseWeights.NF4, "quantization_bit", bits, "4-bit bitsandbytes; quantization_type absent: "
                                                                     "LLaMA-Factory's default nf4")
    elif str(kind).lower() in ("nf4", "fp4"):
        read.defer("quantization_bit", bits, "4-bit bitsandbytes")
        parts.add("base", BaseWeights.parse(str(kind).lower()), "quantization_type", kind)
    else:
        parts.refuse("quantization_type", kind, "bitsandbytes 4-bit types are nf4 and fp4")
    if "double_quantization" in data:
        parts.flag("double_quant", data["double_quantization"], "double_quantization")
    else:
        parts.default("double_quant", True, "LLaMA-Factory's default double_quantization true")
    _llamafactory_upcast(data, parts)
    return Method.QLORA


def _llamafactory_upcast(data: Mapping, parts: LoraParts) -> None:
    """LLaMA-Factory never calls peft's prepare_model_for_kbit_training: its own prepare_model_for_training
    (src/llamafactory/model/model_utils/checkpointing.py) upcasts only the norm weights, and only with
    upcast_layernorm (default False, hparams/model_args.py). fp32 norm weights make every norm's output, and from
    the first block on the residual stream, fp32: closest to peft's upcast, so upcast_layernorm keeps it."""
    if _on(data.get("upcast_layernorm")):
        parts.read.defer("upcast_layernorm", data["upcast_layernorm"], "fp32 norms: an fp32 residual stream, "
                         "sized as peft's upcast (the embedding and head counted in fp32 too)")
    else:
        parts.default("kbit_prep", False, "LLaMA-Factory does not call prepare_model_for_kbit_training: the "
                                          "embeddings, norms and head stay in the compute dtype")


# ------------------------------------------------------------------------------------------------- torchtune

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


# ------------------------------------------------------------------------------------------- peft LoraConfig

PEFT_TABLE = {
    "bias": f"{NOT_SIZED} (trainable biases)", "lora_bias": f"{NOT_SIZED} (a bias on lora_B)",
    "layers_to_transform": f"{NOT_SIZED} (adapters sized on every layer, an upper bound)",
    "exclude_modules": f"{NOT_SIZED} (adapters sized on every target, an upper bound)",
    "trainable_token_indices": f"{NOT_SIZED} (trainable embedding rows)",
    "layer_replication": f"{NOT_SIZED} (replicated layers)",
    "megatron_config": NOT_SIZED,
    "model_kwargs.quantization_config.": f"{NOT_RELEVANT} (quantization details that keep the layout)",
    "model_kwargs.": f"{NOT_RELEVANT} (model loading, not the step)",
}


def peft_finetune(read: Reader, data: Mapping) -> Finetune | None:
    """A peft LoraConfig as peft saves it (adapter_config.json) or as memfit writes it (peft.json: lora_config,
    model_kwargs, prepare_model_for_kbit_training)."""
    return _run(lambda: _peft(read, data, LoraParts(read)))


def _peft(read: Reader, data: Mapping, parts: LoraParts) -> Finetune | None:
    emitted = isinstance(data.get("lora_config"), Mapping)
    config = data["lora_config"] if emitted else data
    prefix = "lora_config." if emitted else ""
    kind = config.get("peft_type", "LORA")
    if str(getattr(kind, "value", kind)).upper() != "LORA":
        parts.refuse(prefix + "peft_type", kind, "memfit sizes peft's LORA adapters")
    if config.get("base_model_name_or_path"):
        read.set_model(str(config["base_model_name_or_path"]), prefix + "base_model_name_or_path")
    for key, why in (("rank_pattern", "per-module ranks are not sized: memfit gives every adapter one rank"),
                     ("target_parameters", "adapters on parameters (MoE experts) are not sized"),
                     ("alora_invocation_tokens", "activated LoRA is not sized")):
        if config.get(key):
            parts.refuse(prefix + key, config[key], why)
        elif key in config:
            read.consume(prefix + key)
    for part, key, default, check in (("rank", "r", 8, parts.rank), ("alpha", "lora_alpha", 8.0, parts.alpha),
                                      ("dropout", "lora_dropout", 0.0, parts.dropout)):
        if config.get(key) is not None:
            check(config[key], prefix + key)
        else:
            parts.default(part, default, "peft LoraConfig's default")
    targets = config.get("target_modules")
    if targets is None:
        parts.default("targets", (), "peft's default for the architecture")
        if "target_modules" in config:
            read.defer(prefix + "target_modules", None, "peft's default targets for the architecture")
    else:
        if isinstance(targets, (list, tuple)) and not emitted:
            targets = sorted(targets, key=str)  # peft saves a set: its order says nothing (names() refuses non-str)
        parts.targets(parts.names(targets, prefix + "target_modules"), prefix + "target_modules",
                      config["target_modules"])
    saved = config.get("modules_to_save")
    if saved is not None:
        parts.add("modules_to_save", parts.names(saved, prefix + "modules_to_save"), prefix + "modules_to_save",
                  saved, "trained in full beside the adapters")
    elif "modules_to_save" in config:
        read.consume(prefix + "modules_to_save")
    if "use_dora" in config:
        parts.flag("dora", config["use_dora"], prefix + "use_dora")
    if "use_rslora" in config:
        parts.flag("rslora", config["use_rslora"], prefix + "use_rslora", RSLORA_NOTE)
    if str(config.get("bias", "none")).lower() == "none" and "bias" in config:
        read.defer(prefix + "bias", config["bias"], "no trainable biases")
    method = _peft_model_kwargs(read, data, parts) if emitted else Method.LORA
    if "peft_type" in config:
        key, raw = prefix + "peft_type", kind
    elif "r" in config:
        key, raw = prefix + "r", config["r"]
    else:
        key, raw = "lora_config", "{...}"
    return parts.finish(method, key, raw, "" if emitted else "the adapters; a quantized base is the script's "
                                                             "BitsAndBytesConfig: give its from_pretrained kwargs "
                                                             "(quantization_config) too")


def _peft_model_kwargs(read: Reader, data: Mapping, parts: LoraParts) -> Method:
    """peft.json's model_kwargs: a BitsAndBytesConfig (4-bit: QLoRA; 8-bit: LoRA on LLM.int8) or the base dtype."""
    kwargs = data.get("model_kwargs") if isinstance(data.get("model_kwargs"), Mapping) else {}
    bnb = kwargs.get("quantization_config")
    if data.get("prepare_model_for_kbit_training") is False and isinstance(bnb, Mapping):
        parts.add("kbit_prep", False, "prepare_model_for_kbit_training", False,
                  "not called: the embeddings, norms and head stay in the compute dtype")
    elif "prepare_model_for_kbit_training" in data:
        read.defer("prepare_model_for_kbit_training", data["prepare_model_for_kbit_training"],
                   "follows the quantized base")
    if isinstance(bnb, Mapping):
        return bnb_base(read, parts, bnb, "model_kwargs.quantization_config.")
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) is not None:
            base = _DTYPES.get(str(kwargs[key]).lower())
            if base is None:
                parts.refuse(f"model_kwargs.{key}", kwargs[key], "memfit sizes a base in bfloat16, float16 or "
                                                                 "float32")
            parts.add("base", base, f"model_kwargs.{key}", kwargs[key], "the frozen base's dtype")
    return Method.LORA


def bnb_base(read: Reader, parts: LoraParts, bnb: Mapping, prefix: str) -> Method:
    """A BitsAndBytesConfig's keywords -> the base storage; defaults are BitsAndBytesConfig's own (fp4, no
    double quantization)."""
    how = bnb.get("quant_method", "bitsandbytes")
    if str(getattr(how, "value", how)).lower() not in ("bitsandbytes", "bnb"):
        parts.refuse(prefix + "quant_method", how, "memfit sizes a bitsandbytes-quantized base")
    if "quant_method" in bnb:
        read.consume(prefix + "quant_method")
    four, eight = _on(bnb.get("load_in_4bit")), _on(bnb.get("load_in_8bit"))
    if four is None or eight is None:
        key = "load_in_4bit" if four is None else "load_in_8bit"
        parts.refuse(prefix + key, bnb[key], "not true or false")
    if four and eight:
        parts.refuse(prefix + "load_in_4bit", True, "load_in_4bit and load_in_8bit together")
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in bnb and not _on(bnb[key]):
            read.consume(prefix + key)
    if eight:
        parts.add("base", BaseWeights.INT8, prefix + "load_in_8bit", True, "bitsandbytes LLM.int8 base")
        return Method.LORA
    if not four:
        parts.refuse(prefix + "load_in_4bit", bnb.get("load_in_4bit"), "a quantization_config that quantizes "
                                                                       "nothing")
    kind = bnb.get("bnb_4bit_quant_type")
    read.defer(prefix + "load_in_4bit", True, "4-bit bitsandbytes")
    if kind is None:
        parts.default("base", BaseWeights.FP4, "BitsAndBytesConfig's default bnb_4bit_quant_type fp4")
    elif str(kind).lower() in ("nf4", "fp4"):
        parts.add("base", BaseWeights.parse(str(kind).lower()), prefix + "bnb_4bit_quant_type", kind)
    else:
        parts.refuse(prefix + "bnb_4bit_quant_type", kind, "bitsandbytes 4-bit types are nf4 and fp4")
    if "bnb_4bit_use_double_quant" in bnb:
        parts.flag("double_quant", bnb["bnb_4bit_use_double_quant"], prefix + "bnb_4bit_use_double_quant")
    else:
        parts.default("double_quant", False, "BitsAndBytesConfig's default")
    if "bnb_4bit_compute_dtype" in bnb:
        read.defer(prefix + "bnb_4bit_compute_dtype", bnb["bnb_4bit_compute_dtype"],
                   "the compute dtype is the training precision's")
    return Method.QLORA


def quantized_base(read: Reader, bnb: Any, key: str) -> tuple[Method, dict[str, Any]] | None:
    """A from_pretrained kwargs file's quantization_config: (method, {part: value}) for the LoRA adapters another
    file gives (recorded as read here; applied by read_config), or None when it was refused."""
    if not isinstance(bnb, Mapping):
        read.unmappable(FIELD, key, bnb, "not a mapping of BitsAndBytesConfig keywords")
        return None
    parts = LoraParts(read)
    try:
        method = bnb_base(read, parts, bnb, key + ".")
    except _Missing:
        return None
    values = {part: value for part, value, *_ in parts.parts}
    for part, value, part_key, raw, note in parts.parts:
        if part_key:
            read.set_part(FIELD, part, value, part_key, raw, note)
    return method, values


def with_base(ft: Finetune, method: Method, values: Mapping[str, Any]) -> Finetune:
    """The adapters `ft` on the quantized base a from_pretrained kwargs file gives."""
    base = values.get("base", BaseWeights.AUTO)
    if method is Method.QLORA and base is BaseWeights.NF4:
        base = BaseWeights.AUTO
    return ft.replace(method=method, base=base, double_quant=values.get("double_quant", ft.double_quant))


def same_as_auto(ft: Finetune, compute_dtype: str) -> Finetune:
    """`ft` with a base stored in the training's compute dtype said as 'auto' (what memfit's options give)."""
    if ft.adapters and ft.method is Method.LORA and ft.base.value == compute_dtype:
        return ft.replace(base=BaseWeights.AUTO)
    return ft


__all__ = ["AXOLOTL_TABLE", "LLAMAFACTORY_TABLE", "PEFT_TABLE", "axolotl_finetune", "bnb_base",
           "llamafactory_finetune", "peft_finetune", "quantized_base", "same_as_auto", "torchtune_finetune",
           "with_base"]
