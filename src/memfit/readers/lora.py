"""LoRA / QLoRA settings of a config file -> the setup's `finetune` (memfit.finetune.Finetune), one part per config
field (LoraParts): which fields gave the method, rank, alpha, dropout, targets, modules_to_save, base weights, double
quantization and DoRA, each recorded as read; a value memfit cannot size is a one-line ConfigError naming it. Here:
peft's LoraConfig and transformers' BitsAndBytesConfig; the axolotl, LLaMA-Factory, torchtune and LitGPT adapters are
read in their formats' modules (memfit.readers.axolotl, .llamafactory, .torchtune, .litgpt) with these parts.

Defaults are each project's own, said in the note of the field that chose the method (axolotl's pydantic schema,
LLaMA-Factory's FinetuningArguments / QuantizationArguments, torchtune's LoRA model builders, peft's LoraConfig and
transformers' BitsAndBytesConfig)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, BaseWeights, Finetune, Method
from ._reader import _MISSING, NOT_RELEVANT, NOT_SIZED, Reader, _positive

FIELD = "finetune"
HEAD = "lm_head"
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


__all__ = ["HEAD_REFUSED", "LoraParts", "PEFT_TABLE", "bnb_base", "peft_finetune", "quantized_base", "same_as_auto",
           "with_base"]
