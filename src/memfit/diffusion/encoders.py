"""The frozen models around the denoiser: the text encoders (CLIP-L, OpenCLIP-bigG, T5-XXL) and the VAE. They never
train; what they cost is their weights while they are on the GPU and the transient of their no-grad forward
(the prompt's tokens through each text encoder, the image through the VAE's encoder).

Their weights: the parameter count of transformers' CLIPTextModel / CLIPTextModelWithProjection / T5EncoderModel
and diffusers' AutoencoderKL built on the meta device from the catalog's configs, times the dtype the scripts cast
them to (weight_dtype: bf16 under bf16 mixed precision; train_dreambooth_lora_sdxl.py keeps SDXL's VAE in fp32, its
fp16 / bf16 overflow being the reason the script offers --pretrained_vae_model_name_or_path). Their forward: traced
on fake tensors under torch.no_grad (memfit.trace's tracker and kernel model), every allocation counted: the peak
of live tensors above the weights while the forward runs. The VAE runs `encode(pixels).latent_dist.sample()`; the
text encoders run over their max_sequence_length tokens, the CLIPs keeping every hidden state
(output_hidden_states=True: SD3's and SDXL's pipelines read the penultimate one)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .._torch.step import cast_floating
from ..trace.kernels import device_kernels, hidden_scratch
from ..trace.tracker import StepTracker
from .presets import Component, DiffusionModel

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Frozen:
    """One frozen model on the GPU: its weights and its no-grad forward's transient at the step's shape."""

    name: str
    kind: str  # "text" or "vae"
    params: int
    weight_bytes: int
    forward_bytes: int
    """The peak of the forward's live tensors above the weights (activations, outputs, kernel scratch)."""
    dtype: str


def build(component: Component):
    """The component's module (on whatever device / fake mode is active)."""
    import diffusers  # optional dependencies: imported when a component is built
    import transformers

    if hasattr(diffusers, component.cls):
        return getattr(diffusers, component.cls).from_config(component.config)
    config = dict(component.config)
    model_type = config.pop("model_type")
    hf = transformers.T5Config(**config) if model_type == "t5" else transformers.CLIPTextConfig(**config)
    return getattr(transformers, component.cls)(hf)


@lru_cache(maxsize=32)
def _param_count(name: str, cls: str, config_json: str) -> int:
    import json

    with torch.device("meta"):
        module = build(Component(name, cls, json.loads(config_json)))
    return sum(p.numel() for p in module.parameters())


def param_count(component: Component) -> int:
    """Exact parameter count, built on the meta device (cached per config)."""
    import json

    return _param_count(component.name, component.cls, json.dumps(component.config, sort_keys=True))


def forward_bytes(component: Component, dtype: torch.dtype, *, batch: int, tokens: int = 77,
                  size: tuple[int, int] = (1024, 1024), kernels: str = "cuda") -> int:
    """The traced transient of one no-grad forward (see the module docstring)."""
    fake = FakeTensorMode()
    with fake:
        module = build(component)
        cast_floating(module, dtype)
        module.eval()
    tracker = StepTracker(num_steps=1, hidden_scratch=hidden_scratch(kernels))
    tracker.watch_module(module)
    resident = tracker.device_bytes  # the weights and buffers, there before and after
    with device_kernels(kernels), fake, tracker, torch.no_grad():
        tracker.mark("forward")
        if component.cls == "AutoencoderKL":
            pixels = torch.randn(batch, 3, *size, dtype=dtype)
            latent = module.encode(pixels).latent_dist.sample()
            del latent
        else:
            ids = torch.zeros(batch, tokens, dtype=torch.long)
            clip = component.cls.startswith("CLIP")
            out = module(input_ids=ids, output_hidden_states=clip)
            del out
    return tracker.peak_bytes - resident


def frozen_parts(model: DiffusionModel, dtype: torch.dtype, *, batch: int, size: tuple[int, int],
                 kernels: str = "cuda") -> tuple[Frozen, ...]:
    """Each text encoder and the VAE of `model` (none for a bare denoiser config)."""
    parts = []
    for component in model.text_encoders:
        count = param_count(component)
        tokens = model.text_tokens.get(component.name, 77)
        parts.append(Frozen(component.name, "text", count, count * DTYPE_BYTES[dtype],
                            forward_bytes(component, dtype, batch=batch, tokens=tokens, kernels=kernels),
                            str(dtype).removeprefix("torch.")))
    if model.vae is not None:
        vae_dtype = torch.float32 if model.family == "sdxl" else dtype
        count = param_count(model.vae)
        parts.append(Frozen(model.vae.name, "vae", count, count * DTYPE_BYTES[vae_dtype],
                            forward_bytes(model.vae, vae_dtype, batch=batch, size=size, kernels=kernels),
                            str(vae_dtype).removeprefix("torch.")))
    return tuple(parts)
