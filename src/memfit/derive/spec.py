"""A ModelSpec for an architecture memfit has no recipe for: parameter tensors read off the 1- and 2-block copies
(built on fake tensors), scaled to the real depth; architecture numbers from the transformers config."""

from __future__ import annotations

from typing import Any

from ..errors import ModelSourceError
from ..model_spec import ModelSpec, ParamTensor
from ..setup import Attention, TrainingSetup
from .cache import cache_path, failures_cached, read_json, shipped_data, write_json
from .cache import first_line as _first_line
from .fit import _blocks, build_short, dense_prefix
from .model import DerivedModel
from .progress import reporting

PARAMS_KIND = "params"
PARAMS_FORMAT = 2
"""The parameter payload's layout: 2 added facts["buffer_bytes"] (the model's buffers, e.g. sin/cos tables) and
facts["routed_experts"] (whether the built copy routes tokens to experts) and facts["linear_weight_elems"] (the
weights autocast caches a copy of, for a model without a graph)."""


def _hf_config(config: dict[str, Any], source: str):
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ModelSourceError(f"{source}: model_type '{config.get('model_type')}' has no recipe in memfit; deriving "
                               "one traces the model and needs torch and transformers (pip install "
                               "'memfit[torch]')") from None
    from .._torch.step import hf_config_from_dict
    from ..errors import ConfigError

    try:
        return hf_config_from_dict(config)
    except (ConfigError, TypeError, KeyError) as error:
        raise ModelSourceError(f"{source}: transformers cannot build model_type '{config.get('model_type')}' "
                               f"offline ({_first_line(error)})") from None


BUILD_SETUP = TrainingSetup(attention=Attention.EAGER)
"""The copies' setup: the attention implementation changes no parameter, and some models (gpt_oss) refuse sdpa."""


def _param_rows(config: dict[str, Any], num_layers: int, source: str) -> tuple[list[ParamTensor], dict[str, Any]]:
    """Root and per-block parameter tensors, from the shortened copies (tied weights once), and facts about them."""
    dense = dense_prefix(config, num_layers)
    found = {layers: _short_copy(config, layers, source) for layers in (1, 2)}
    castable = found[1]["castable"] | found[2]["castable"]
    buffers = [_buffer_bytes(found[layers]["model"]) for layers in (1, 2)]
    blocks, params, model = found[2]["blocks"], found[2]["params"], found[2]["model"]
    class_name = type(model).__name__
    prefix = blocks[0].rpartition(".")[0]
    repeated = num_layers - dense
    rows: dict[tuple[str, int], int] = {}
    cast_rows: set[tuple[str, int]] = set()
    for name, numel in params:
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        key = (name, numel) if block is None else (f"{prefix}.*.{name[len(block) + 1:]}", numel)
        rows[key] = 1 if block is None else repeated
        if name in castable:
            cast_rows.add(key)
    one = sum(n for _, n in found[1]["params"])
    two = sum(n for _, n in params)
    total = sum(n * c for (_, n), c in rows.items())
    expected = one + (two - one) * (repeated - 1)
    if total != expected:
        raise ModelSourceError(f"{source}: the blocks of model_type '{config.get('model_type')}' are not all alike "
                               "(parameters do not scale with depth); use `memfit trace`")
    if dense:  # the leading dense blocks (first_k_dense_replace), from a 1-block copy of the dense block
        _add_dense_rows(config, dense, prefix, rows, cast_rows, source)
    facts = {"tied": found[2]["tied"], "class": class_name, "block_prefix": prefix,
             "buffer_bytes": buffers[0] + (buffers[1] - buffers[0]) * (num_layers - 1),
             "routed_experts": _has_experts(model),
             "linear_weight_elems": sum(key[1] * rows[key] for key in cast_rows),
             "is_decoder": class_name.endswith("ForCausalLM"),
             "supports_sdpa": bool(getattr(type(model), "_supports_sdpa", True))}
    return [ParamTensor(name, numel, count) for (name, numel), count in rows.items()], facts


def _short_copy(config: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """The `layers`-block copy on fake tensors: its model, block names, (name, numel) parameters, the weights autocast
    casts, and whether its output embedding is its input embedding (tied)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        model, _ = build_short(config, layers, BUILD_SETUP, FakeTensorMode())
    except ModelSourceError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure to build means: cannot derive this architecture
        raise ModelSourceError(f"{source}: transformers cannot build model_type '{config.get('model_type')}' "
                               f"offline from this config ({_first_line(error)})") from None
    blocks = [name for name, _ in _blocks(model)]
    if not blocks:
        raise ModelSourceError(f"{source}: model_type '{config.get('model_type')}' has no repeated blocks to "
                               "derive a memory model from; use `memfit trace`")
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = (inputs is not None and outputs is not None and getattr(outputs, "weight", None) is not None
            and outputs.weight is getattr(inputs, "weight", None))
    return {"model": model, "blocks": blocks, "params": [(n, int(p.numel())) for n, p in model.named_parameters()],
            "castable": _autocast_weights(model), "tied": tied}


def _add_dense_rows(config: dict[str, Any], dense: int, prefix: str, rows: dict[tuple[str, int], int],
                    cast_rows: set[tuple[str, int]], source: str) -> None:
    """Count the `dense` leading dense blocks' parameters (first_k_dense_replace) into `rows` (and the weights
    autocast casts into `cast_rows`), from a 1-block copy of the dense block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        dense_model, _ = build_short(config, 1, BUILD_SETUP, FakeTensorMode(), dense=True)
    except Exception as error:  # noqa: BLE001 - as in _short_copy
        raise ModelSourceError(f"{source}: transformers cannot build the dense block of model_type "
                               f"'{config.get('model_type')}' offline ({_first_line(error)})") from None
    (dense_block, _), = _blocks(dense_model)
    dense_castable = _autocast_weights(dense_model)
    for name, p in dense_model.named_parameters():
        if name.startswith(dense_block + "."):
            key = (f"{prefix}.*.{name[len(dense_block) + 1:]}", int(p.numel()))
            rows[key] = rows.get(key, 0) + dense
            if name in dense_castable:
                cast_rows.add(key)


def _autocast_weights(model) -> set[str]:
    """Names of the parameters autocast would cache a bf16 copy of: the 2-D weights matmuls read (projections,
    routers), not embedding tables (embedding is no autocast op), norms and biases (1-D), nor anything of a module
    holding stacked experts (3-D weights for grouped_mm, no autocast op; their per-expert biases are indexed)."""
    from torch import nn

    skipped = {name for name, module in model.named_modules() if isinstance(module, nn.Embedding)
               or any(p.dim() == 3 for p in module.parameters(recurse=False))}
    return {name for name, p in model.named_parameters()
            if p.dim() == 2 and p.requires_grad and name.rpartition(".")[0] not in skipped}


def _has_experts(model) -> bool:
    from ..trace.session import _has_experts as experts_in

    return experts_in(model)


def _buffer_bytes(model) -> int:
    """Bytes of a built copy's buffers (each storage once), as built: tables made with an explicit dtype (GPT-J's
    `create_sinusoidal_positions(...)` in fp32) keep it whatever the parameters' dtype."""
    return sum(b.numel() * b.element_size() for _, b in model.named_buffers())


def arch_numbers(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The architecture numbers of a config as transformers' config class reads them (attribute maps, text
    sub-configs, defaults): stored beside the derived parameters, so a cached or shipped model needs no transformers."""
    hf = _hf_config(config, source)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    if num_layers <= 0:
        raise ModelSourceError(f"{source}: model_type '{config.get('model_type')}' config has no number of layers")
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv = int(getattr(text, "num_key_value_heads", 0) or getattr(text, "num_kv_heads", 0) or heads)
    if getattr(text, "multi_query", False) is True and not getattr(text, "new_decoder_architecture", False):
        kv = 1  # Falcon-7B style multi-query attention: one K/V head whatever num_kv_heads says
    inter = next((value for key in ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size")
                  if isinstance(value := getattr(text, key, None), int) and value > 0), 0)
    act = next((getattr(text, k) for k in ("hidden_act", "hidden_activation", "activation_function")
                if isinstance(getattr(text, k, None), str)), "")
    return {"num_layers": num_layers, "hidden_size": hidden, "num_attention_heads": heads, "num_kv_heads": kv,
            "head_dim": int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0)),
            "intermediate_size": inter, "hidden_act": act, "vocab_size": int(getattr(text, "vocab_size", 0) or 0),
            "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 0)}


def derived_spec(config: dict[str, Any], *, name: str, source: str, params: tuple | None = None,
                 base: ModelSpec | None = None) -> ModelSpec:
    """The spec of any transformers architecture: exact parameter tensors, derived activations (lazily, per kind)."""
    if base is not None:  # a family with a parameter layout: only its activations are derived (lazily)
        from dataclasses import replace

        return replace(base, derived=DerivedModel(config, label=name))
    from .stacks import applies

    if applies(config):  # several stacks, or tokens fixed by the image: memfit.derive.stacks
        from .stacks_spec import stacked_spec

        return stacked_spec(config, name=name, source=source)
    derived = DerivedModel(config, label=name)
    path = cache_path(config, PARAMS_KIND, PARAMS_FORMAT)
    data = shipped_data(config, PARAMS_KIND)  # shipped for catalog models
    if data is None or data.get("format") != PARAMS_FORMAT:
        data = read_json(path, path.stem, PARAMS_FORMAT)
    if data is not None and isinstance(data.get("params"), list):
        rows = [ParamTensor(str(n), int(k), int(c)) for n, k, c in data["params"]]
        facts = data.get("facts", {})
        # stored with the parameters, so a cached or shipped model plans without importing transformers (or torch)
        arch = data["arch"] if isinstance(data.get("arch"), dict) else arch_numbers(config, source)
    else:
        from .fit import quiet_transformers

        with (failures_cached(path, path.stem, PARAMS_FORMAT, kind=PARAMS_KIND, model_type=config.get("model_type")),
              reporting(f"reading {name}'s parameters") as progress, quiet_transformers()):
            if progress is not None:
                progress("loading its configuration class from transformers", 0.0)
            arch = arch_numbers(config, source)
            if progress is not None:
                progress("building 1- and 2-block copies on fake tensors", 0.5)
            rows, facts = _param_rows(config, arch["num_layers"], source)
        write_json(path, {"key": path.stem, "format": PARAMS_FORMAT, "kind": PARAMS_KIND,
                          "model_type": config.get("model_type"),
                          "params": [[p.name, p.numel, p.count] for p in rows], "facts": facts, "arch": arch})
    hidden, heads, kv, head_dim, inter, act = (arch[k] for k in ("hidden_size", "num_attention_heads", "num_kv_heads",
                                                                  "head_dim", "intermediate_size", "hidden_act"))
    num_layers = arch["num_layers"]
    return ModelSpec(
        name=name, model_type=str(config.get("model_type")), params=tuple(rows), hidden_size=hidden,
        num_layers=num_layers, num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=inter or 4 * hidden, vocab_size=arch["vocab_size"],
        max_position_embeddings=arch["max_position_embeddings"],
        is_decoder=bool(facts.get("is_decoder", True)), gated_mlp=False, hidden_act=act, norm="",
        tie_word_embeddings=bool(facts.get("tied", False)), source=source,
        buffer_bytes=int(facts.get("buffer_bytes", 0)),
        extra={"derived_from": facts.get("class", ""), "layout_known": False,
               **({"supports_sdpa": False} if facts.get("supports_sdpa") is False else {}),
               **({"routed_experts": True} if facts.get("routed_experts") else {}),
               **({"linear_weight_elems": int(facts["linear_weight_elems"])}
                  if "linear_weight_elems" in facts else {})}, derived=derived)
