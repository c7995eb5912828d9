"""A live model -> ModelSpec: exact parameter tensors from the module, architecture numbers from its HF config.

Nothing here imports torch or transformers: a module is read through `named_parameters()` and a config through
`to_dict()`, so this works on meta-device, fake-tensor and real models alike.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..errors import ModelSourceError
from ..model_spec import ModelSpec, ParamTensor
from .hf_config import from_hf_config

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def is_module(obj: Any) -> bool:
    """Duck-typed torch.nn.Module (no torch import): has named_parameters() and parameters()."""
    return callable(getattr(obj, "named_parameters", None)) and callable(getattr(obj, "parameters", None))


def is_hf_config(obj: Any) -> bool:
    """Duck-typed transformers.PretrainedConfig: has to_dict() and a model_type, and is not a module."""
    return callable(getattr(obj, "to_dict", None)) and hasattr(obj, "model_type") and not is_module(obj)


def module_params(model: Any) -> tuple[ParamTensor, ...]:
    """The module's parameter tensors, tied ones once (named_parameters() skips repeats of the same Parameter),
    grouped so a tensor repeated in every layer is one row: 'model.layers.*.mlp.up_proj.weight' x num_layers."""
    counts: dict[tuple[str, int], int] = {}
    for name, param in model.named_parameters():
        key = (_LAYER_INDEX.sub("*", name), int(param.numel()))
        counts[key] = counts.get(key, 0) + 1
    return tuple(ParamTensor(name, numel, count) for (name, numel), count in counts.items())


def _frozen_numel(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters() if not getattr(p, "requires_grad", True))


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _numbers_without_layout(config: Any) -> dict[str, Any]:
    """Best-effort architecture numbers of a config whose model_type memfit has no layout for."""
    get = lambda key: _positive(getattr(config, key, None))  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or (hidden // heads if heads and hidden % heads == 0 else 0)
    return dict(
        hidden_size=hidden,
        num_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=get("intermediate_size"),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def from_pretrained_config(config: Any, *, name: str | None = None, source: str = "config") -> ModelSpec:
    """A ModelSpec from a transformers.PretrainedConfig object (through its to_dict(), no import needed)."""
    label = name or getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or "model"
    return from_hf_config(config.to_dict(), name=label, source=source)


def from_module(model: Any, *, name: str | None = None) -> ModelSpec:
    """A ModelSpec whose params are the module's own tensors (exact, tied once). A transformers PreTrainedModel
    also gives its architecture numbers through model.config; a plain nn.Module gives params only (model_type
    'custom', num_layers 0, so only a trace can size its activations)."""
    if not is_module(model):
        raise ModelSourceError(f"expected an nn.Module, got {type(model).__name__}")
    params = module_params(model)
    extra: dict[str, Any] = {}
    frozen = _frozen_numel(model)
    if frozen:
        extra["num_frozen_params"] = frozen
    config = getattr(model, "config", None)
    label = name or (getattr(config, "_name_or_path", "") if config is not None else "") or type(model).__name__
    if config is None or not is_hf_config(config):
        return ModelSpec(name=label, model_type="custom", params=params, num_layers=0, gated_mlp=False,
                         hidden_act="", norm="", source="module", extra=extra)
    try:
        spec = from_pretrained_config(config, name=label, source="module")
    except ModelSourceError:
        # No memfit layout for this model_type (or an odd config): the module's tensors are still exact.
        spec = ModelSpec(name=label, model_type=str(config.model_type), params=(), source="module",
                         gated_mlp=False, hidden_act=str(getattr(config, "hidden_act", "") or ""), norm="",
                         extra={"layout_known": False}, **_numbers_without_layout(config))
    if _has_lora(model):
        return _peft_spec(model, spec, label)
    return replace(spec, params=params, extra={**spec.extra, **extra})


def _has_lora(model: Any) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


def _peft_spec(model: Any, spec: ModelSpec, label: str) -> ModelSpec:
    """A LoRA model (peft's get_peft_model / inject_adapter_in_model, on a bf16/fp32 or bitsandbytes-quantized
    base), read exactly: trainable and frozen tensors with their real bytes (a Params4bit's packed data and its
    QuantState), and the Finetune it was built with (rank, alpha, dropout, targets, base storage), so the
    activations follow the adapters it has."""
    from ..errors import ConfigError
    from ..estimate.lora import adapted_spec
    from ..finetune import Finetune
    from ..setup import TrainingSetup

    from .graphs import with_graph

    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):
        spec = with_graph(spec, config.to_dict)
    if spec.graph is None:
        raise ModelSourceError(f"'{label}' has LoRA adapters but memfit has no graph of its architecture "
                               f"({spec.model_type}): trace it instead (memfit.trace)")
    finetune = _finetune_of(model)
    try:
        adapted = adapted_spec(spec, TrainingSetup(finetune=finetune))
    except ConfigError as error:
        raise ModelSourceError(f"cannot read the LoRA layout of '{label}': {error}") from None
    trainable, frozen = _tensors_with_bytes(model)
    return replace(adapted, params=trainable, frozen=frozen, finetune=finetune, source="module")


def _finetune_of(model: Any):
    """The Finetune of a live LoRA model, from its peft_config (or its lora modules) and its base layers."""
    from ..finetune import Finetune

    config = None
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        config = next(iter(peft_config.values()))
    ranks, targets, dropout, alpha = set(), set(), 0.0, None
    base = "auto"
    double_quant = True
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if lora_a is None or not hasattr(lora_a, "items"):
            continue
        for adapter, layer in lora_a.items():
            ranks.add(int(layer.out_features))
            targets.add(name.rsplit(".", 1)[-1])
            drops = getattr(module, "lora_dropout", None)
            drop = drops[adapter] if drops is not None and adapter in drops else None
            dropout = max(dropout, float(getattr(drop, "p", 0.0) or 0.0))
            alphas = getattr(module, "lora_alpha", None)
            alpha = alphas.get(adapter, alpha) if isinstance(alphas, dict) else alpha
        layer = getattr(module, "base_layer", None)
        weight = getattr(layer, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            base = str(getattr(state, "quant_type", "nf4"))
            double_quant = bool(getattr(state, "nested", False))
        elif type(weight).__name__ == "Int8Params":
            base = "int8"
        elif weight is not None and base == "auto":
            base = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(
                str(weight.dtype), "auto")
    if len(ranks) != 1:
        raise ModelSourceError(f"memfit sizes one LoRA rank per model; this one has ranks {sorted(ranks)}")
    rank = ranks.pop()
    if config is not None:
        alpha = getattr(config, "lora_alpha", alpha)
    quantized = base in ("nf4", "fp4", "int8")
    return Finetune(method="qlora" if quantized else "lora", rank=rank, alpha=float(alpha or rank),
                    dropout=dropout, targets=tuple(sorted(targets)), base=base, double_quant=double_quant,
                    modules_to_save=tuple(sorted(getattr(config, "modules_to_save", None) or ())),
                    dora=bool(getattr(config, "use_dora", False)),
                    rslora=bool(getattr(config, "use_rslora", False)))


def _tensors_with_bytes(model: Any) -> tuple[tuple[ParamTensor, ...], tuple[ParamTensor, ...]]:
    """(trainable, frozen) tensors grouped by name pattern, each with its real bytes (a quantized weight with
    its QuantState tensors)."""
    groups: dict[tuple[bool, str, int, int], int] = {}
    for name, param in model.named_parameters():
        nbytes = int(param.numel()) * int(param.element_size())
        state = getattr(param, "quant_state", None)
        if state is not None:
            parts = [state.absmax, state.code]
            if getattr(state, "nested", False):
                parts += [state.offset, state.state2.absmax, state.state2.code]
            nbytes += sum(int(t.numel()) * int(t.element_size()) for t in parts if t is not None)
        scb = getattr(param, "SCB", None)
        if scb is not None:
            nbytes += int(scb.numel()) * int(scb.element_size())
        numel = int(param.numel()) * (2 if state is not None else 1)  # Params4bit packs two weights per byte
        key = (bool(param.requires_grad), _LAYER_INDEX.sub("*", name), numel, nbytes)
        groups[key] = groups.get(key, 0) + 1
    trainable = tuple(ParamTensor(n, numel, count, nbytes) for (t, n, numel, nbytes), count in groups.items() if t)
    frozen = tuple(ParamTensor(n, numel, count, nbytes) for (t, n, numel, nbytes), count in groups.items() if not t)
    return trainable, frozen
