"""Hugging Face config.json -> ModelSpec, by arithmetic alone for the families memfit reads the numbers of here and
builds a graph for (memfit.graph.builders: every parameter tensor; no torch, no transformers at import or call
time); any other architecture is derived by memfit.derive, which needs torch,
plus the two readers around it: a config.json on disk and a hub id (the one place transformers is imported)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError, ModelSourceError
from ..model_spec import ModelSpec


@dataclass(frozen=True)
class _Family:
    """How one model_type spells and defaults its numbers. Defaults are those of the transformers config class,
    so a config.json that omits a key means what it means to transformers."""

    norm: str
    gated_mlp: bool
    tie_default: bool
    max_positions_default: int
    act_default: str
    is_decoder: bool = True
    keys: dict[str, str] = field(default_factory=dict)
    """Canonical name -> this family's key, where they differ (GPT-2's n_embd, n_layer...)."""
    act_keys: tuple[str, ...] = ("hidden_act",)
    head_dim_default: int = 0
    """Used when the config has no head_dim (gemma: 256); 0 means hidden_size / num_attention_heads."""
    uses_head_dim: bool = True
    """False where the modeling code ignores head_dim and kv heads (GPT-2, GPT-NeoX, BERT: plain multi-head)."""


_GPT2_KEYS = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "max_position_embeddings": "n_positions", "intermediate_size": "n_inner"}

@dataclass(frozen=True)
class Arch:
    """The architecture numbers of a config, validated and defaulted (parse_arch); the parameter tensors come from
    the family's graph builder (memfit.graph.builders)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    tie_word_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


FAMILIES: dict[str, _Family] = {
    "llama": _Family("rmsnorm", True, False, 2048, "silu"),
    "mistral": _Family("rmsnorm", True, False, 131072, "silu"),
    "qwen2": _Family("rmsnorm", True, False, 32768, "silu"),
    "qwen3": _Family("rmsnorm", True, False, 32768, "silu"),
    "gemma": _Family("rmsnorm", True, True, 8192, "gelu_pytorch_tanh", head_dim_default=256,
                     act_keys=("hidden_activation", "hidden_act")),
    "gemma2": _Family("rmsnorm", True, True, 8192, "gelu_pytorch_tanh", head_dim_default=256,
                      act_keys=("hidden_activation", "hidden_act")),
    "phi3": _Family("rmsnorm", True, False, 4096, "silu"),
    "gpt2": _Family("layernorm", False, True, 1024, "gelu_new", keys=_GPT2_KEYS,
                    act_keys=("activation_function",), uses_head_dim=False),
    "gpt_neox": _Family("layernorm", False, False, 2048, "gelu", uses_head_dim=False),
    "bert": _Family("layernorm", False, True, 512, "gelu", is_decoder=False, uses_head_dim=False),
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
"""The model_types a spec is built for from a config alone (no torch): numbers here, tensors from the graph."""


class _Reader:
    """Reads and checks config values, collecting every problem so one error names them all."""

    def __init__(self, config: Mapping[str, Any], family: _Family, source: str) -> None:
        self.config, self.family, self.source = config, family, source
        self.problems: list[str] = []

    def key(self, canonical: str) -> str:
        return self.family.keys.get(canonical, canonical)

    def positive_int(self, canonical: str, default: int | None = None) -> int:
        key = self.key(canonical)
        value = self.config.get(key)
        if value is None:
            if default is None:
                self.problems.append(f"'{key}' is missing")
                return 0
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.problems.append(f"'{key}' must be a positive whole number, got {value!r}")
            return 0
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"'{key}' must be true or false, got {value!r}")
            return default
        return value

    def fail_if_any(self) -> None:
        if self.problems:
            raise ModelSourceError(f"{self.source}: " + "; ".join(self.problems) + ".")


def _model_type(config: Mapping[str, Any], source: str) -> str:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelSourceError(f"{source}: config has no 'model_type' string; is this a Hugging Face config.json?")
    if model_type not in FAMILIES:
        raise ModelSourceError(
            f"{source}: model_type '{model_type}' has no parameter layout in memfit (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); pass the built nn.Module instead (memfit reads its tensors)."
        )
    return model_type


def _heads(r: _Reader, hidden: int) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim), checking that they fit together."""
    heads = r.positive_int("num_attention_heads")
    if not r.family.uses_head_dim:
        if heads and hidden and hidden % heads:
            r.problems.append(f"'{r.key('num_attention_heads')}' ({heads}) must divide "
                              f"'{r.key('hidden_size')}' ({hidden})")
        return heads, heads, hidden // heads if heads else 0
    kv_heads = r.positive_int("num_key_value_heads", default=heads or 1)
    if heads and kv_heads and heads % kv_heads:
        r.problems.append(f"'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' ({heads})")
    if r.config.get("head_dim") is not None:
        return heads, kv_heads, r.positive_int("head_dim")
    if r.family.head_dim_default:
        return heads, kv_heads, r.family.head_dim_default
    if heads and hidden and hidden % heads:
        r.problems.append(f"'num_attention_heads' ({heads}) must divide 'hidden_size' ({hidden}) "
                          "when 'head_dim' is not given")
    return heads, kv_heads, hidden // heads if heads else 0


def parse_arch(config: Mapping[str, Any], source: str) -> Arch:
    """Validated, defaulted architecture numbers of an HF config dict; ModelSourceError names every bad key."""
    if not isinstance(config, Mapping):
        raise ModelSourceError(f"{source}: a model config must be a JSON object, got {type(config).__name__}")
    model_type = _model_type(config, source)
    family = FAMILIES[model_type]
    r = _Reader(config, family, source)
    hidden = r.positive_int("hidden_size")
    heads, kv_heads, head_dim = _heads(r, hidden)
    if model_type == "gpt2":  # GPT2MLP: n_inner or 4 * n_embd
        intermediate = r.positive_int("intermediate_size", default=4 * hidden)
    else:
        intermediate = r.positive_int("intermediate_size")
    arch = Arch(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=r.positive_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=r.positive_int("vocab_size"),
        max_positions=r.positive_int("max_position_embeddings", default=family.max_positions_default),
        tie_word_embeddings=r.flag("tie_word_embeddings", family.tie_default),
    )
    r.fail_if_any()
    return arch


def _hidden_act(config: Mapping[str, Any], family: _Family) -> str:
    for key in family.act_keys:
        if isinstance(config.get(key), str):
            return config[key]
    return family.act_default


def from_hf_config(config: Mapping[str, Any], *, name: str, source: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict: exact per-tensor parameter layout, architecture numbers and the
    family details the activation estimator needs. Raises ModelSourceError (one line) for a malformed config.

    A model_type without a parameter layout here is derived (memfit.derive: its tensors read off a shortened copy
    built on fake tensors, needs torch); one with a layout but no activation recipe (qwen3, gemma) gets its
    activations derived the same way, on first use."""
    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    if isinstance(model_type, str) and model_type and model_type not in FAMILIES:
        from ..derive import derived_spec

        try:
            return derived_spec(dict(config), name=name, source=source)
        except ModelSourceError as error:
            raise ModelSourceError(f"{error}; memfit reads configs of {', '.join(SUPPORTED_MODEL_TYPES)}, or "
                                   "pass the built nn.Module (memfit reads its tensors)") from None
    arch = parse_arch(config, source)
    family = FAMILIES[arch.model_type]
    from ..graph import graph_from_config

    graph = graph_from_config(config, name=name, source=source)  # every parameter tensor, one builder per family
    spec = ModelSpec(
        name=name,
        model_type=arch.model_type,
        params=graph.param_tensors(),
        hidden_size=arch.hidden_size,
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_positions,
        is_decoder=family.is_decoder,
        gated_mlp=family.gated_mlp,
        hidden_act=_hidden_act(config, family),
        norm=family.norm,
        tie_word_embeddings=arch.tie_word_embeddings,
        source=source,
        graph=graph,
    )
    from ..estimate.activations import saved_problem
    if saved_problem(spec.graph) is not None:  # nodes no `saved` formula sizes: derive them, never borrow Llama's
        from ..derive import DerivedModel

        spec = replace(spec, derived=DerivedModel(dict(config), label=name))
    return spec


_MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A config.json is a few kB; anything this large is some other file."""


def from_config_file(path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a config.json file, or from a folder that holds one (a downloaded checkpoint)."""
    try:
        path = Path(path).expanduser()
        file = path / "config.json" if path.is_dir() else path
        if file.exists() and not file.is_file():  # a device or a FIFO would be read forever
            raise ModelSourceError(f"cannot read {file}: not a regular file")
        if file.exists() and file.stat().st_size > _MAX_CONFIG_BYTES:
            raise ModelSourceError(f"{file} is {file.stat().st_size:,} bytes: not a config.json")
        text = file.read_text(encoding="utf-8")
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
    default_name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return from_hf_config(config, name=name or default_name, source=str(file))


def _env_offline() -> bool:
    return any(os.environ.get(v, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def from_hub(repo_id: str, *, name: str | None = None, alternatives: list[str] | None = None) -> ModelSpec:
    """A ModelSpec from a Hub repository's config.json, through transformers.AutoConfig (cached files only when
    HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set). Never runs remote code."""
    hint = f"try {', '.join(repr(a) for a in alternatives)} or " if alternatives else "use a catalog name or "
    try:
        from transformers import AutoConfig
    except ImportError:
        raise MissingDependencyError(
            f"resolving hub id '{repo_id}' needs transformers (pip install 'memfit[hf]'); "
            f"{hint}pass a local config.json"
        ) from None
    offline = _env_offline() or not _hub_reachable()
    try:
        config = AutoConfig.from_pretrained(repo_id, local_files_only=offline, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - hub, network and parsing failures all mean "not resolvable here"
        reason = "offline and not in the local cache" if offline else _first_line(exc)
        raise ModelSourceError(f"cannot get the config of '{repo_id}' from the Hugging Face Hub ({reason}); "
                               f"{hint}pass a local config.json") from None
    return from_hf_config(config.to_dict(), name=name or repo_id, source=f"hub:{repo_id}")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One quick TCP connect to the Hub endpoint. Without it, huggingface_hub retries an unreachable host five
    times with back-off (~35 s) before failing; with it an offline machine falls back to the cache at once."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - no hub client: let transformers report it
        return True
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
