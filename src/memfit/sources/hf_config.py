"""Hugging Face config.json -> ModelSpec, by arithmetic alone for SUPPORTED_MODEL_TYPES (the family's graph builder
reads the config and gives every tensor and number; no torch, no transformers at import or call time); any other
architecture is derived by memfit.derive, which needs torch. Plus the two readers around it: a config.json on disk
and a hub id (the one place transformers is imported)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError, ModelSourceError
from ..model_spec import ModelSpec

if TYPE_CHECKING:
    from ..graph import ModelGraph

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2",
                                          "gpt_neox", "bert")
"""The model_types a spec is built for from a config alone (no torch): the graph builder reads the config (with
its transformers defaults) and gives every tensor and number; the others are derived (memfit.derive)."""


def _numbers(graph: ModelGraph, config: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's architecture numbers, read off the graph (first attention, MLP and norm of the first stack), and
    the context length through the same config reader (the family's transformers default where omitted)."""
    from ..graph.builders import config_reader
    from ..graph.kinds.attention import Attention
    from ..graph.kinds.heads import LMHead
    from ..graph.kinds.mlp import MLP
    from ..graph.kinds.norm import Norm

    attention = graph.nodes(Attention)[0][1]
    mlp = graph.nodes(MLP)[0][1]
    norm = next(n for n in graph.stacks[0].block.nodes if isinstance(n, Norm))
    reader = config_reader(config)
    return dict(hidden_size=attention.hidden, num_layers=sum(s.count for s in graph.stacks),
                num_attention_heads=attention.q_heads, num_kv_heads=attention.kv_heads, head_dim=attention.head_dim,
                intermediate_size=mlp.intermediate, vocab_size=graph.embed.num_embeddings,
                max_position_embeddings=reader.first_int("max_position_embeddings", "n_positions"),
                is_decoder=isinstance(graph.head, LMHead) or getattr(graph.head, "pool", "") == "last",
                gated_mlp=mlp.gated, hidden_act=mlp.act,
                norm="rmsnorm" if norm.kind == "rms" else "layernorm",
                tie_word_embeddings=bool(getattr(graph.head, "tied", False)))


_BOUNDS: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
      "decoder_layers"), 2_048, "layers (the deepest real models have ~100)"),
    (("hidden_size", "n_embd", "d_model", "dim"), 262_144, "a hidden size (the widest real models: ~25,000)"),
    (("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
      "moe_intermediate_size", "shared_expert_intermediate_size"), 1_048_576,
     "an MLP width (real models: under 100,000)"),
    (("vocab_size", "type_vocab_size"), 16_777_216, "a vocabulary (real models: under 300,000 tokens)"),
    (("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
      "decoder_attention_heads"), 8_192, "attention heads (real models: under 200)"),
    (("head_dim", "d_kv"), 16_384, "a head dimension (real models: under 1,000)"),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 16_384,
     "experts (real models: under 1,000)"),
    (("max_position_embeddings", "n_positions", "n_ctx"), 1 << 27, "positions (real models: under 20 million)"),
)
"""Sanity bounds on a config's sizes, far above any real model: a hostile or mistyped config (10^9 layers: a graph
block each; hidden 2^40) is refused in one line naming the bound instead of taking minutes to size nonsense."""
MAX_PARAMS = 10 ** 14
"""Parameters of the whole model: 50x the largest real model."""


def check_sizes(config: Mapping[str, Any], source: str, *, _depth: int = 0) -> None:
    """ModelSourceError naming the first size in `config` (or a sub-config: text_config, encoder...) above its
    bound in _BOUNDS."""
    for keys, bound, what in _BOUNDS:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > bound:
                raise ModelSourceError(f"{source}: {key}={value:,} is above memfit's bound of {bound:,} for {what}: "
                                       "not a real model's config")
    if _depth < 3:
        for value in config.values():
            if isinstance(value, Mapping):
                check_sizes(value, source, _depth=_depth + 1)


def _check_params(spec: ModelSpec, source: str) -> ModelSpec:
    if spec.num_params > MAX_PARAMS:
        raise ModelSourceError(f"{source}: {spec.num_params:,} parameters is above memfit's bound of "
                               f"{MAX_PARAMS:,} (50x the largest real model): not a real model's config")
    return spec


def from_hf_config(config: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict: its typed graph (exact per-tensor parameters, the family details
    the activation estimator reads) and the architecture numbers read off it. Raises ModelSourceError (one line)
    for a malformed config, naming every bad key.

    A model_type outside SUPPORTED_MODEL_TYPES is derived (memfit.derive: its tensors read off a shortened copy
    built on fake tensors, needs torch); one whose graph has a node no `saved` handler sizes (qwen3, gemma) gets its
    activations derived the same way, on first use."""
    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    if isinstance(config, Mapping):
        check_sizes(config, source)
    if isinstance(model_type, str) and model_type and model_type not in SUPPORTED_MODEL_TYPES:
        from ..derive.spec import derived_spec

        try:
            derived = derived_spec(dict(config), name=name, source=source)
        except ModelSourceError as error:
            raise ModelSourceError(f"{error}; memfit reads configs of {', '.join(SUPPORTED_MODEL_TYPES)}, or "
                                   "pass the built nn.Module (memfit reads its tensors)") from None
        return _check_params(derived, source)
    if not isinstance(config, Mapping):
        raise ModelSourceError(f"{source}: a model config must be a JSON object, got {type(config).__name__}")
    from ..graph import graph_from_config

    graph = graph_from_config(config, name=name, source=source)  # every tensor and number, one builder per family
    spec = _check_params(ModelSpec(name=name, model_type=graph.model_type, params=graph.param_tensors(),
                                   source=source, graph=graph, **_numbers(graph, config)), source)
    from ..estimate.activations import saved_problem

    if saved_problem(spec.graph) is not None:  # nodes no `saved` formula sizes: derive them, never borrow Llama's
        from ..derive.model import DerivedModel

        spec = replace(spec, derived=DerivedModel(dict(config), label=name))
    return spec


_MAX_CONFIG_VALUES = 1_000_000
"""A config.json holds hundreds of values (tens of thousands with a large id2label); more is some other file."""


def from_config_file(path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a config.json file, or from a folder that holds one (a downloaded checkpoint)."""
    from ..readers.files import check_shape, read_bounded

    try:
        path = Path(path).expanduser()
        file = path / "config.json" if path.is_dir() else path
        text = read_bounded(file, str(file), ModelSourceError).decode("utf-8")
    except UnicodeDecodeError:
        raise ModelSourceError(f"cannot read {file}: not a UTF-8 text file") from None
    except (ValueError, RuntimeError) as exc:  # an embedded NUL, an unknown ~user
        raise ModelSourceError(f"cannot read {str(path)[:80]}: {exc}") from None
    except OSError as exc:
        raise ModelSourceError(f"cannot read {str(file)[:200]}: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ModelSourceError(f"{file} is not valid JSON: {exc.msg} at {where}") from None
    except RecursionError:
        raise ModelSourceError(f"{file} nests too deeply: not a config.json") from None
    check_shape(config, str(file), ModelSourceError, max_values=_MAX_CONFIG_VALUES)
    default_name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return from_hf_config(config, name=name or default_name, source=str(file))


def _env_offline() -> bool:
    return any(os.environ.get(v, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def from_hub(repo_id: str, *, name: str | None = None, alternatives: list[str] | None = None) -> ModelSpec:
    """A ModelSpec from a Hub repository's config.json (hub_config). Never runs remote code."""
    return from_hf_config(hub_config(repo_id, alternatives), name=name or repo_id, source=f"hub:{repo_id}")


def hub_config(repo_id: str, alternatives: list[str] | None = None) -> dict[str, Any]:
    """A Hub repository's config values through transformers.AutoConfig: cached files only when HF_HUB_OFFLINE /
    TRANSFORMERS_OFFLINE is set or the Hub does not answer. Offline and not cached fails at once, before
    transformers is imported (seconds on a loaded machine), with one line saying what to pass instead."""
    hint = (f"pass a catalog name ({', '.join(repr(a) for a in alternatives)}) or a local config.json path"
            if alternatives else "pass a catalog name (`memfit models` lists them) or a local config.json path")
    offline = "HF_HUB_OFFLINE is set" if _env_offline() else None if _hub_reachable() else "the Hub is unreachable"
    if offline and not _in_hub_cache(repo_id):
        raise ModelSourceError(f"cannot get the config of '{repo_id}': offline ({offline}) and not in the local "
                               f"Hugging Face cache; {hint}")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise MissingDependencyError(
            f"resolving hub id '{repo_id}' needs transformers (pip install 'memfit[hf]'); {hint}"
        ) from None
    try:
        config = AutoConfig.from_pretrained(repo_id, local_files_only=bool(offline), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - hub, network and parsing failures all mean "not resolvable here"
        reason = f"offline ({offline})" if offline else _first_line(exc)
        raise ModelSourceError(f"cannot get the config of '{repo_id}' from the Hugging Face Hub ({reason}); "
                               f"{hint}") from None
    return config.to_dict()


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds the repository's config.json (the file transformers would read
    offline). huggingface_hub answers from the cache folder alone (file_download.try_to_load_from_cache)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # no hub client: let transformers report it
        return True
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the cache cannot hold is not cached
        return False


def _hub_reachable(timeout_s: float = 1.5) -> bool:
    """One quick TCP connect to the Hub endpoint (or to the HTTPS proxy when one is set), DNS lookup included,
    within `timeout_s` in all. Without it, huggingface_hub retries an unreachable host with back-off (~35-55 s)
    before failing; with it an offline machine falls back to the cache at once. socket.create_connection's
    timeout does not bound the name lookup, so the probe runs in a daemon thread that is abandoned at the deadline."""
    import socket
    import threading
    import urllib.request
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - no hub client: let transformers report it
        return True
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and urllib.request.proxy_bypass(endpoint.hostname or ""):  # NO_PROXY names the Hub: direct
        proxy = None
    target = urlparse(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else endpoint
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    answer: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                answer.append(True)
        except (OSError, ValueError):
            answer.append(False)

    thread = threading.Thread(target=probe, name="memfit-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer and answer[0])


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
