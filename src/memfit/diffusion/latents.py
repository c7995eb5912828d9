"""What a resolution becomes in the denoiser: the VAE's latent and the tokens attention runs over.

diffusers 0.42 pipelines: vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1) = 8 for the Flux, SD3 and
SDXL VAEs. Flux (pipeline_flux.py `_pack_latents`) packs 2 x 2 latent patches into one token of 4 x 16 = 64 channels:
(H/16) x (W/16) image tokens, joined in the transformer to the T5 prompt's max_sequence_length tokens (512 by
default in the pipeline and train_dreambooth_lora_flux.py). SD3 (transformer_sd3.py PatchEmbed, patch_size 2) makes
the same (H/16) x (W/16) image tokens; its prompt is CLIP's 77 tokens (CLIP-L and bigG side by side in channels)
followed by T5's max_sequence_length tokens (256 in pipeline_stable_diffusion_3.py), 333 in all. SDXL's UNet runs
on the 4 x (H/8) x (W/8) latent itself, its cross-attention over the 77 CLIP tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .presets import DiffusionModel


@dataclass(frozen=True)
class Shapes:
    height: int
    width: int
    latent: tuple[int, int, int]
    """(channels, height, width) of the VAE's latent."""
    image_tokens: int
    """Tokens of the image stream (0 for a UNet)."""
    text_tokens: int
    """Tokens of the prompt the denoiser attends to (Flux / SD3: joined to the image tokens)."""
    text_dim: int = 0
    pooled_dim: int = 0

    @property
    def joint_tokens(self) -> int:
        return self.image_tokens + self.text_tokens if self.image_tokens else 0


def shapes(model: DiffusionModel, height: int, width: int) -> Shapes:
    """The latent and token counts for `height` x `width` pixels (the images the trainer crops to)."""
    if min(height, width) < 1:
        raise ConfigError(f"the resolution is positive pixels, got {height}x{width}")
    scale, config = model.vae_scale, model.denoiser.config
    step = scale * (2 if model.family in ("flux", "sd3") else 1)
    if height % step or width % step:
        raise ConfigError(f"{model.family} needs a resolution that is a multiple of {step} pixels (VAE /{scale}"
                          f"{', 2 x 2 patches' if step > scale else ''}), got {height}x{width}")
    channels = model.latent_channels
    lh, lw = height // scale, width // scale
    tokens = model.text_tokens
    if model.family == "flux":
        t5 = next((n for name, n in tokens.items() if name.startswith("t5")), 512)
        return Shapes(height, width, (channels, lh, lw), (lh // 2) * (lw // 2), t5,
                      int(config.get("joint_attention_dim", 4096)), int(config.get("pooled_projection_dim", 768)))
    if model.family == "sd3":
        patch, limit = int(config.get("patch_size", 2)), config.get("pos_embed_max_size")
        if limit and max(lh, lw) // patch > int(limit):
            raise ConfigError(f"{height}x{width} is beyond the transformer's positional table (pos_embed_max_size "
                              f"{limit}: at most {int(limit) * patch * scale} pixels a side)")
        clip = max((n for name, n in tokens.items() if name.startswith(("clip", "openclip"))), default=77)
        t5 = next((n for name, n in tokens.items() if name.startswith("t5")), 256)
        return Shapes(height, width, (channels, lh, lw), (lh // patch) * (lw // patch), clip + t5,
                      int(config.get("joint_attention_dim", 4096)), int(config.get("pooled_projection_dim", 2048)))
    clip = max(tokens.values(), default=77)
    pooled = int(config.get("projection_class_embeddings_input_dim", 2816)) - \
        6 * int(config.get("addition_time_embed_dim", 256))
    return Shapes(height, width, (channels, lh, lw), 0, clip, int(config.get("cross_attention_dim", 2048)), pooled)
