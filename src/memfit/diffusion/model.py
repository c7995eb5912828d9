"""The denoiser's training step, built from its diffusers config and fed the tensors the diffusers training scripts
give it; traced on fake tensors (memfit.trace: every allocation of the real module's forward, backward and optimizer
step, exact at any resolution in seconds) and run for real on CPU for the proof (memfit.measure, bench/diffusion.py).

What the step is (diffusers 0.42 examples/dreambooth/train_dreambooth_lora_flux.py, train_dreambooth_lora_sd3.py,
train_dreambooth_lora_sdxl.py): the denoiser built by `from_config`; its frozen weights in the mixed-precision dtype
(`transformer.to(dtype=weight_dtype)`), a full fine-tune's weights in the setup's dtype; LoRA by peft on the
attention projections (`LoraConfig(r, lora_alpha=r, target_modules=[to_k, to_q, to_v, to_out.0])`, Flux's and SD3's
scripts also name their context stream and feed-forwards with --lora_layers); gradient checkpointing by diffusers'
own `enable_gradient_checkpointing()` (torch.utils.checkpoint, use_reentrant=False, around each block). The inputs
are the noised latent in the weight dtype (Flux: packed 2 x 2 into tokens by pipeline_flux.py `_pack_latents`), the
prompt embeddings and pooled embeddings, the timestep (Flux: also the guidance and the position ids); the loss is
the mean of (prediction.float() - target.float())^2, Flux's prediction unpacked to the latent first. Only the
denoiser trains: text encoders and VAE are frozen and sized as their own phases (memfit.diffusion.encoders)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .._torch.lora import apply_adapters
from .._torch.step import cast_floating, param_dtype
from ..errors import ConfigError
from ..finetune import Finetune
from ..measure import measure
from ..setup import TrainingSetup
from ..trace.run import BuiltDtypes, trace
from .latents import Shapes
from .presets import DiffusionModel

ATTENTION_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
"""The diffusers DreamBooth LoRA scripts' default target_modules (train_dreambooth_lora_{flux,sd3,sdxl}.py)."""
ALL_TARGETS = {
    "flux": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
             "ff_context.net.2", "proj_mlp", "proj_out"),
    "sd3": ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
            "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
            "ff_context.net.2"),
    "sdxl": ("to_k", "to_q", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"),
}
"""`--lora-targets all`: every Linear of the attention blocks (Flux's single-stream blocks' proj_mlp / proj_out too),
as --lora_layers lists them in the scripts' README examples."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lora_targets(family: str, targets: str | Sequence[str] | None) -> tuple[str, ...]:
    if targets in (None, "", "attention"):
        return ATTENTION_TARGETS
    if targets == "all":
        return ALL_TARGETS[family]
    names = tuple(t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip())
    if not names:
        raise ConfigError("--lora-targets takes 'attention', 'all' or module names separated by commas")
    return names


def weight_dtype(setup: TrainingSetup) -> torch.dtype:
    """The scripts' weight_dtype: the mixed-precision dtype the frozen weights and the inputs are cast to."""
    return DTYPES[setup.precision.compute_dtype]


def build_denoiser(model: DiffusionModel, setup: TrainingSetup, *, lora_dtype: str = "fp32"):
    """The denoiser as the scripts train it under `setup` (precision, finetune full / lora with its rank and
    targets, checkpointing on or off): see the module docstring."""
    import diffusers  # an optional dependency: imported when a denoiser is built

    net = getattr(diffusers, model.denoiser.cls).from_config(model.denoiser.config)
    lora = setup.finetune.adapters
    if setup.finetune.method.value not in ("full", "lora"):
        raise ConfigError(f"memfit diffusion sizes full and LoRA fine-tunes so far, not {setup.finetune.method.value}")
    cast_floating(net, weight_dtype(setup) if lora else param_dtype(setup))
    if setup.checkpointing.is_on:
        net.enable_gradient_checkpointing()
    if lora:
        if lora_dtype not in DTYPES:
            raise ConfigError(f"--lora-dtype is one of {', '.join(DTYPES)}, got '{lora_dtype}'")
        net.requires_grad_(False)
        changed, detail = apply_adapters(net, setup.replace(checkpointing="none"))
        if not changed:
            raise ConfigError(f"LoRA: {detail}")
        with torch.no_grad():
            for name, param in net.named_parameters():
                if "lora_" in name and param.dtype != DTYPES[lora_dtype]:
                    param.data = param.data.to(DTYPES[lora_dtype])
    net.train()
    return net


def make_batch(model: DiffusionModel, shp: Shapes, batch: int, dtype: torch.dtype) -> dict:
    """One micro-batch as the scripts hand it to the denoiser (see the module docstring), plus the loss's target."""
    c, h, w = shp.latent
    latent = torch.randn(batch, c, h, w, dtype=dtype)
    text = torch.randn(batch, shp.text_tokens, shp.text_dim, dtype=dtype)
    pooled = torch.randn(batch, shp.pooled_dim, dtype=dtype)
    target = torch.randn(batch, c, h, w, dtype=dtype)  # noise - latents, in the latent's dtype
    if model.family == "flux":
        packed = latent.view(batch, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
            batch, (h // 2) * (w // 2), c * 4)
        inputs = {"hidden_states": packed, "encoder_hidden_states": text, "pooled_projections": pooled,
                  "timestep": torch.rand(batch), "img_ids": torch.zeros(shp.image_tokens, 3),
                  "txt_ids": torch.zeros(shp.text_tokens, 3)}
        if model.denoiser.config.get("guidance_embeds"):
            inputs["guidance"] = torch.full((batch,), 3.5)
        return {**inputs, "target": target}
    if model.family == "sd3":
        return {"hidden_states": latent, "encoder_hidden_states": text, "pooled_projections": pooled,
                "timestep": torch.rand(batch) * 1000, "target": target}
    return {"sample": latent, "timestep": torch.randint(0, 1000, (batch,)), "encoder_hidden_states": text,
            "added_cond_kwargs": {"text_embeds": pooled, "time_ids": torch.randn(batch, 6, dtype=dtype)},
            "target": target}


def loss_fn(family: str) -> Callable:
    def loss(net, batch):
        inputs = {k: v for k, v in batch.items() if k != "target"}
        target = batch["target"]
        pred = net(**inputs, return_dict=False)[0]
        if family == "flux":  # pipeline_flux.py _unpack_latents: tokens back to the latent's 2 x 2 patches
            b, c, h, w = target.shape
            pred = pred.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
    return loss


def loop_setup(setup: TrainingSetup, batch: int) -> TrainingSetup:
    """The setup memfit's loop runs: checkpointing and adapters are the denoiser builder's (diffusers' own switch,
    peft), so the loop gets neither; micro-batch as asked."""
    return setup.replace(checkpointing="none", finetune=Finetune(), micro_batch_size=batch)


def trace_denoiser(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, *, batch: int = 1,
                   kernels: str = "cuda", lora_dtype: str = "fp32", keep: dict | None = None):
    """memfit.trace of the denoiser's step (a MemoryEstimate, method "traced"); `keep["model"]`: the fake model."""
    dtype, kept = weight_dtype(setup), BuiltDtypes()

    def inputs(_setup):
        kept.restore()  # the trace casts a factory's floats to its setup's dtype
        return make_batch(model, shp, batch, dtype)

    result = trace(kept.factory(lambda: build_denoiser(model, setup, lora_dtype=lora_dtype)),
                   loop_setup(setup, batch), input_builder=inputs, loss_fn=loss_fn(model.family), kernels=kernels)
    if keep is not None:
        keep["model"] = kept.model
    return dataclasses.replace(result, setup=setup.replace(micro_batch_size=batch))


def measure_denoiser(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, *, batch: int = 1, steps: int = 2,
                     lora_dtype: str = "fp32"):
    """memfit.measure of real CPU steps of the same denoiser and batch (tiny configs: bench/diffusion.py, tests)."""
    torch.manual_seed(0)
    net = build_denoiser(model, setup, lora_dtype=lora_dtype)
    data = make_batch(model, shp, batch, weight_dtype(setup))
    return measure(net, loop_setup(setup, batch), steps=steps, device="cpu", batches=[data],
                   loss_fn=loss_fn(model.family))
