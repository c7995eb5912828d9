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

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from .._torch.lora import apply_adapters
from .._torch.step import cast_floating, param_dtype
from ..errors import ConfigError
from ..estimate.terms import TermKey
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
BASE_DTYPES = ("bf16", "fp8", "nf4")
"""How a LoRA run stores the frozen base: bf16 (as the precision says: the mixed-precision dtype), fp8 (diffusers'
layerwise casting: `enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=weight_dtype)`,
diffusers/hooks/layerwise_casting.py) or nf4 (bitsandbytes 4-bit Linears: the setup's finetune is QLoRA, built by
memfit._torch.lora.apply_adapters as for text models)."""


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


def build_denoiser(model: DiffusionModel, setup: TrainingSetup, *, lora_dtype: str = "fp32", base_dtype: str = "bf16"):
    """The denoiser as the scripts train it under `setup` (precision, finetune full / lora / qlora with its rank and
    targets, checkpointing on or off) with its frozen base stored as `base_dtype` (BASE_DTYPES): see the module
    docstring."""
    import diffusers  # an optional dependency: imported when a denoiser is built

    net = getattr(diffusers, model.denoiser.cls).from_config(model.denoiser.config)
    lora = setup.finetune.adapters
    if setup.finetune.method.value not in ("full", "lora", "qlora"):
        raise ConfigError(f"memfit diffusion sizes full and LoRA fine-tunes so far, not {setup.finetune.method.value}")
    if base_dtype not in BASE_DTYPES:
        raise ConfigError(f"--base-dtype is one of {', '.join(BASE_DTYPES)}, got '{base_dtype}'")
    if base_dtype != "bf16" and not lora:
        raise ConfigError(f"--base-dtype {base_dtype} stores a frozen base: it needs --method lora")
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
    if base_dtype == "fp8":  # after peft: diffusers' default patterns skip the adapters (and norms, embeddings)
        net.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=weight_dtype(setup))
    net.train()
    return net


@contextlib.contextmanager
def fake_layerwise_casting() -> Iterator[None]:
    """diffusers' LayerwiseCastingHook as fake tensors can run it. The hook calls `module.to(dtype)` around each
    layer's forward; on real tensors Module._apply replaces each parameter's data in place (`param.data = ...`, its
    set_data path), so the compute-dtype copy a matmul saved for backward (F.linear's `weight.t()` view) stays alive
    until that backward while the parameter holds the storage-dtype copy again. Fake tensors refuse Module.to (it
    swaps them), and a storage moved into a parameter by `param.data = ...` escapes memfit's tracker (it follows each
op's output storage): each parameter is replaced by the cast's output here instead (frozen weights: the hooked
layers are never trained). The memory is the same: the old
parameter's storage lives exactly as long as the saved view that holds it."""
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    def cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad():
            for owner in module.modules():
                for name, param in list(owner._parameters.items()):
                    if param is not None and param.is_floating_point() and param.dtype != dtype:
                        # the op's output itself: nn.Parameter(fake) gets a storage the tracker never saw
                        owner._parameters[name] = param.detach().to(dtype)
                for name, buffer in list(owner._buffers.items()):
                    if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                        owner._buffers[name] = buffer.to(dtype)

    def initialize(self, module):
        cast(module, self.storage_dtype)
        return module

    def pre(self, module, *args, **kwargs):
        cast(module, self.compute_dtype)
        return args, kwargs

    def post(self, module, output):
        cast(module, self.storage_dtype)
        return output

    saved = {name: getattr(LayerwiseCastingHook, name) for name in ("initialize_hook", "pre_forward", "post_forward")}
    LayerwiseCastingHook.initialize_hook, LayerwiseCastingHook.pre_forward = initialize, pre
    LayerwiseCastingHook.post_forward = post
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(LayerwiseCastingHook, name, method)


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
                   kernels: str = "cuda", lora_dtype: str = "fp32", base_dtype: str = "bf16",
                   keep: dict | None = None):
    """memfit.trace of the denoiser's step (a MemoryEstimate, method "traced"); `keep["model"]`: the fake model."""
    dtype, kept = weight_dtype(setup), BuiltDtypes()

    def inputs(_setup):
        kept.restore()  # the trace casts a factory's floats to its setup's dtype
        return make_batch(model, shp, batch, dtype)

    casting = fake_layerwise_casting() if base_dtype == "fp8" else contextlib.nullcontext()
    with casting:
        result = trace(kept.factory(lambda: build_denoiser(model, setup, lora_dtype=lora_dtype,
                                                           base_dtype=base_dtype)),
                       loop_setup(setup, batch), input_builder=inputs, loss_fn=loss_fn(model.family),
                       kernels=kernels)
    if keep is not None:
        keep["model"] = kept.model
    if base_dtype == "fp8":
        result = _with_stored_fp8(result, kept.model)
    return dataclasses.replace(result, setup=setup.replace(micro_batch_size=batch))


def _with_stored_fp8(result, net):
    """The fp8 copies the hook stores back after each layer's forward are live from then on (real CPU steps: the
    parameters at the peak are the unhooked ones plus the hooked ones in fp8), but the trace does not see them
    (the compute-dtype copies it does; cause in memfit.trace not found yet): added to the parameters, 1 byte per
    hooked element (bench/diffusion.py: fp8 rows against real CPU steps)."""
    stored = sum(p.numel() for p in net.parameters() if p.dtype == torch.float8_e4m3fn)
    terms = tuple(dataclasses.replace(t, num_bytes=t.num_bytes + stored, source=(
        f"{t.source}; + {stored:,} B of fp8-stored weights (diffusers layerwise casting)").lstrip("; "))
        if t.name is TermKey.PARAMETERS else t for t in result.terms)
    return dataclasses.replace(result, terms=terms)


def measure_denoiser(model: DiffusionModel, shp: Shapes, setup: TrainingSetup, *, batch: int = 1, steps: int = 2,
                     lora_dtype: str = "fp32", base_dtype: str = "bf16"):
    """memfit.measure of real CPU steps of the same denoiser and batch (tiny configs: bench/diffusion.py, tests)."""
    torch.manual_seed(0)
    net = build_denoiser(model, setup, lora_dtype=lora_dtype, base_dtype=base_dtype)
    data = make_batch(model, shp, batch, weight_dtype(setup))
    return measure(net, loop_setup(setup, batch), steps=steps, device="cpu", batches=[data],
                   loss_fn=loss_fn(model.family))
