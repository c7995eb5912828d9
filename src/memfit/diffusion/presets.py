"""The diffusion catalog (src/memfit/data/diffusion.json): each model's denoiser, text encoders and VAE as the hub
repository's config.json files give them, resolvable offline by catalog name or hub id; a config dict of the
denoiser (with its diffusers class) works for any other. Tiny configs of each family for the CPU proofs."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelSourceError

CATALOG = Path(__file__).resolve().parent.parent / "data" / "diffusion.json"
FAMILIES = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3", "UNet2DConditionModel": "sdxl"}
"""The denoiser classes sized so far (diffusers 0.42: transformer_flux.py, transformer_sd3.py, unet_2d_condition.py)."""


@dataclass(frozen=True)
class Component:
    """A model part as diffusers' / transformers' class and config."""

    name: str
    cls: str
    config: dict[str, Any]
    source: str = ""


@dataclass(frozen=True)
class DiffusionModel:
    name: str
    family: str
    denoiser: Component
    text_encoders: tuple[Component, ...] = ()
    vae: Component | None = None
    text_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens each text encoder reads per prompt (the pipelines' max_sequence_length / CLIP's 77)."""

    @property
    def latent_channels(self) -> int:
        if self.vae is not None:
            return int(self.vae.config.get("latent_channels", 4))
        config = self.denoiser.config
        return int(config.get("in_channels", 64)) // (4 if self.family == "flux" else 1)

    @property
    def vae_scale(self) -> int:
        """The VAE's downscale: 2 ** (len(block_out_channels) - 1), as the pipelines compute vae_scale_factor."""
        blocks = (self.vae.config if self.vae is not None else {}).get("block_out_channels", [0, 0, 0, 0])
        return 2 ** (len(blocks) - 1)


@lru_cache(maxsize=1)
def _catalog() -> dict[str, Any]:
    return json.loads(CATALOG.read_text(encoding="utf-8"))


def catalog_names() -> list[str]:
    return list(_catalog()["models"])


def _component(name: str) -> Component:
    spec = _catalog()["components"][name]
    return Component(name, spec["class"], copy.deepcopy(spec["config"]), spec.get("source", ""))


def resolve_model(model: str | Mapping[str, Any]) -> DiffusionModel:
    """A catalog name or hub id (case-insensitive), a path to a denoiser's config.json, or a config dict with its
    `_class_name` (FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel). A config alone brings no
    text encoders or VAE: the step of the denoiser is sized, the encoders' phases are not."""
    if isinstance(model, Mapping):
        return _from_config(dict(model), str(model.get("_name_or_path") or model.get("_class_name") or "denoiser"))
    text = str(model).strip()
    for name, entry in _catalog()["models"].items():
        if text.lower() in [name.lower(), *(a.lower() for a in entry.get("aliases", ()))]:
            spec = entry["denoiser"]
            return DiffusionModel(
                name=name, family=entry["family"],
                denoiser=Component(name, spec["class"], copy.deepcopy(spec["config"]), spec.get("source", "")),
                text_encoders=tuple(_component(c) for c in entry["text_encoders"]),
                vae=_component(entry["vae"]), text_tokens=dict(entry["text_tokens"]))
    path = Path(text).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ModelSourceError(f"cannot read '{file}': {error}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"'{file}' holds no config object")
        return _from_config(config, text)
    raise ConfigError(f"unknown diffusion model '{text}': give a denoiser config.json or one of "
                      f"{', '.join(catalog_names())}")


def _from_config(config: dict[str, Any], name: str) -> DiffusionModel:
    cls = str(config.pop("_class_name", ""))
    if cls not in FAMILIES:
        raise ConfigError(f"memfit diffusion sizes {', '.join(FAMILIES)} so far, not _class_name '{cls or '?'}' "
                          "(video DiTs are next: docs/diffusion.md)")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return DiffusionModel(name=name, family=FAMILIES[cls], denoiser=Component(name, cls, config))


TINY_VAE = {"latent_channels": 4, "block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4, "layers_per_block": 1,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}


def tiny_model(family: str) -> DiffusionModel:
    """Two blocks of each kind and narrow widths, small enough to train for real on a CPU in seconds: what
    bench/diffusion.py and the tests measure against the trace. Text encoders and VAE are left out (frozen,
    never in the denoiser's step)."""
    if family == "flux":
        config = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2,
                  "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                  "pooled_projection_dim": 24, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
        cls, tokens = "FluxTransformer2DModel", {"clip-l": 77, "t5-xxl": 24}
        vae = TINY_VAE
    elif family == "sd3":
        config = {"sample_size": 16, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 16,
                  "num_attention_heads": 2, "joint_attention_dim": 32, "caption_projection_dim": 32,
                  "pooled_projection_dim": 24, "out_channels": 4, "pos_embed_max_size": 32, "qk_norm": "rms_norm",
                  "dual_attention_layers": [0]}
        cls, tokens = "SD3Transformer2DModel", {"clip-l-proj": 8, "t5-xxl": 16}
        vae = TINY_VAE
    elif family == "sdxl":
        config = {"sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
                  "block_out_channels": [16, 32], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                  "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "attention_head_dim": [2, 4],
                  "transformer_layers_per_block": [1, 2], "cross_attention_dim": 32, "norm_num_groups": 8,
                  "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
                  "projection_class_embeddings_input_dim": 24 + 6 * 8}
        cls, tokens = "UNet2DConditionModel", {"clip-l": 12}
        vae = TINY_VAE
    else:
        raise ConfigError(f"no tiny config for family '{family}' (flux, sd3, sdxl)")
    return DiffusionModel(name=f"tiny-{family}", family=family, denoiser=Component(f"tiny-{family}", cls, config),
                          vae=Component("tiny-vae", "AutoencoderKL", vae), text_tokens=tokens)
