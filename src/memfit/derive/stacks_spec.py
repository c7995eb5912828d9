"""The ModelSpec of an encoder-decoder (T5, BART) or vision (ViT, DINOv2) config: its exact parameter tensors, read
off the full model built on fake tensors (transformers' own classes, tied weights once), and a StackedModel for
its activations (memfit.derive.stacks)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import ModelSourceError
from ..model_spec import ModelSpec, ParamTensor
from ..setup import Attention, TrainingSetup
from .cache import cache_path, failures_cached, first_line, read_json, shipped_data, write_json
from .fit import quiet_transformers
from .stacks import VISION, depths
from .stacks_estimate import StackedModel

PARAMS_KIND = "params"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
"""A block's (or sub-layer's) index in a tensor name: folded into '*', one row per repeated tensor."""


def _param_rows(config: dict[str, Any], source: str) -> tuple[list[ParamTensor], dict[str, Any]]:
    """Parameter tensors, the blocks' folded into `stack.*.name` rows counted once per block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..trace.session import build_hf_model

    try:
        with quiet_transformers(), FakeTensorMode():
            model = build_hf_model(dict(config), TrainingSetup(attention=Attention.EAGER), [])
    except Exception as error:  # noqa: BLE001 - any failure to build means: cannot size this config
        raise ModelSourceError(f"{source}: transformers cannot build model_type '{config.get('model_type')}' offline "
                               f"from this config ({first_line(error)})") from None
    rows: dict[tuple[str, int], int] = {}
    for name, param in model.named_parameters():
        key = (_INDEX.sub("*", name), int(param.numel()))
        rows[key] = rows.get(key, 0) + 1
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and getattr(outputs, "weight", None) is getattr(inputs, "weight", False)
    return [ParamTensor(n, k, c) for (n, k), c in rows.items()], {"tied": bool(tied), "class": type(model).__name__}


def stacked_spec(config: dict[str, Any], *, name: str, source: str) -> ModelSpec:
    path = cache_path(config, PARAMS_KIND)
    data = shipped_data(config, PARAMS_KIND) or read_json(path, path.stem)
    if data is not None and isinstance(data.get("params"), list):
        rows = [ParamTensor(str(n), int(k), int(c)) for n, k, c in data["params"]]
        facts = data.get("facts", {})
    else:
        with failures_cached(path, path.stem, kind=PARAMS_KIND, model_type=config.get("model_type")):
            rows, facts = _param_rows(config, source)
        write_json(path, {"key": path.stem, "format": 1, "kind": PARAMS_KIND, "model_type": config.get("model_type"),
                          "params": [[p.name, p.numel, p.count] for p in rows], "facts": facts})
    get = config.get
    vision = get("model_type") in VISION
    hidden = int(get("hidden_size") or get("d_model") or 0)
    heads = int(get("num_attention_heads") or get("num_heads") or get("encoder_attention_heads") or 0)
    inter = int(get("intermediate_size") or get("d_ff") or get("encoder_ffn_dim") or 0)
    if not inter and get("mlp_ratio"):
        inter = int(hidden * get("mlp_ratio"))
    head_dim = int(get("d_kv") or (hidden // heads if heads else 0))
    act = next((get(k) for k in ("hidden_act", "activation_function", "feed_forward_proj") if isinstance(get(k), str)),
               "")
    return ModelSpec(
        name=name, model_type=str(get("model_type")), params=tuple(rows), hidden_size=hidden,
        num_layers=sum(depths(config).values()), num_attention_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        intermediate_size=inter or 4 * hidden, vocab_size=0 if vision else int(get("vocab_size") or 0),
        max_position_embeddings=0 if vision else int(get("max_position_embeddings") or 0),
        is_decoder=False, gated_mlp=str(act).startswith("gated-"), hidden_act=str(act), norm="",
        tie_word_embeddings=bool(facts.get("tied", False)), source=source,
        extra={"derived_from": facts.get("class", ""), "layout_known": False, "stacks": depths(config)},
        derived=StackedModel(config, label=name))
