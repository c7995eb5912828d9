"""memfit.diffusion's Python entry point: the memory of a diffusion fine-tuning run by phase, and whether it fits.

Phases (as the diffusers DreamBooth scripts run them, examples/dreambooth/train_dreambooth_lora_flux.py, 0.42):
- "caching": with --cache-latents / --cache-text the encoders run once before training (the denoiser already on
  the GPU, no optimizer state yet: Adam makes it at the first step), then leave the GPU (`del vae`,
  `del text_encoder_one, ...; free_memory()`): the denoiser's weights + every encoder's weights + the largest
  encoder forward.
- "encoding in the step": what is not cached runs before each step's forward, the encoders staying on the GPU:
  the denoiser's weights and optimizer states (the gradients are freed by zero_grad) + the resident encoders'
  weights + their largest forward.
- "training step": the denoiser's traced step (memfit.diffusion.model) + the resident encoders' weights.
The peak is the largest phase. The cached latents / embeddings themselves (one per image of the dataset) are not
counted: they scale with the dataset, and scripts keep them on the GPU or the host as they choose."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..api import as_hardware
from ..diagnose import diagnose
from ..errors import ConfigError
from ..estimate.device import runtime_overhead_terms
from ..estimate.result import Category, Term
from ..estimate.terms import TermKey
from ..finetune import BaseWeights, Finetune, Method
from ..setup import TrainingSetup
from .blocks import fit_denoiser, fittable
from .encoders import Frozen, frozen_parts
from .latents import Shapes, shapes
from .model import BASE_DTYPES, DTYPES, lora_targets, trace_denoiser, weight_dtype
from .presets import DiffusionModel, resolve_model
from .swap import BlockSwap, block_swap


@dataclass(frozen=True)
class PhaseBytes:
    name: str
    bytes: int
    parts: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class DiffusionEstimate:
    model: str
    family: str
    shapes: Shapes
    batch: int
    method: str
    rank: int
    targets: tuple[str, ...]
    cache_latents: bool
    cache_text: bool
    denoiser_params: int
    trainable_params: int
    memory: Any  # the denoiser step's MemoryEstimate (traced), the resident encoders' weights added as a term
    frozen: tuple[Frozen, ...]
    phases: tuple[PhaseBytes, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    base_dtype: str = "bf16"
    swap: BlockSwap | None = None
    """kohya / musubi-tuner block swap: the blocks whose weights live in host RAM (memfit.diffusion.swap)."""
    fitted: bool = False
    """The step fitted per block (memfit.diffusion.blocks) rather than traced whole."""

    @property
    def peak(self) -> PhaseBytes:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def resident(self) -> tuple[Frozen, ...]:
        return tuple(f for f in self.frozen if not self._cached(f))

    def _cached(self, part: Frozen) -> bool:
        return self.cache_latents if part.kind == "vae" else self.cache_text


def diffusion_setup(*, method: str = "lora", rank: int = 16, targets: str | None = None, family: str = "flux",
                    precision: str = "amp-bf16", checkpointing: bool = False, optimizer: str | None = None,
                    batch: int = 1, base_dtype: str = "bf16") -> TrainingSetup:
    """The TrainingSetup of a diffusers script's run: `precision` memfit's (amp-bf16: --mixed_precision bf16, the
    frozen weights in bf16, a full fine-tune's in fp32), LoRA with alpha = rank and no dropout (the scripts'
    LoraConfig), checkpointing on or off (diffusers' one switch). `base_dtype` nf4: the LoRA's base quantized by
    bitsandbytes (QLoRA: BitsAndBytesConfig(load_in_4bit, nf4) as the diffusers scripts'
    --bnb_quantization_config_path JSON gives it, no double quantization, bnb_4bit_use_double_quant's default)."""
    if method not in ("full", "lora"):
        raise ConfigError(f"--method is full or lora, got '{method}'")
    if base_dtype not in BASE_DTYPES:
        raise ConfigError(f"--base-dtype is one of {', '.join(BASE_DTYPES)}, got '{base_dtype}'")
    if base_dtype != "bf16" and method != "lora":
        raise ConfigError(f"--base-dtype {base_dtype} stores a frozen base: it needs --method lora")
    quantized = (dict(method=Method.QLORA, base=BaseWeights.NF4, double_quant=False) if base_dtype == "nf4"
                 else dict(method=Method.LORA))
    finetune = Finetune(rank=rank, alpha=float(rank), dropout=0.0, targets=lora_targets(family, targets),
                        **quantized) if method == "lora" else Finetune()
    fields: dict[str, Any] = {"precision": precision, "finetune": finetune, "micro_batch_size": batch,
                              "checkpointing": "full" if checkpointing else "none"}
    if optimizer:
        fields["optimizer"] = optimizer
    return TrainingSetup(**fields)


def estimate_diffusion(model: str | dict | DiffusionModel, *, resolution: int | tuple[int, int] = 1024,
                       batch: int = 1, setup: TrainingSetup | None = None, cache_latents: bool = False,
                       cache_text: bool = False, lora_dtype: str = "fp32", kernels: str = "cuda",
                       hardware=None, base_dtype: str = "bf16", blocks_to_swap: int = 0,
                       exact: bool = False) -> DiffusionEstimate:
    """The phases of fine-tuning `model` (a catalog name, hub id, denoiser config.json / dict, or DiffusionModel) on
    `resolution` pixels (one side, or (height, width)), `batch` images per micro-batch, under `setup`
    (diffusion_setup's by default: LoRA r16). `hardware` adds the runtime's overhead terms to the step.
    `base_dtype`: the frozen base stored as bf16 (as the precision says), fp8 (layerwise casting) or nf4 (the
    setup's QLoRA: diffusion_setup(base_dtype="nf4")). `blocks_to_swap`: kohya's block swap (memfit.diffusion.swap).
    Flux and SD3 steps are fitted per block (memfit.diffusion.blocks) unless `exact`."""
    spec = model if isinstance(model, DiffusionModel) else resolve_model(model)
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"the batch is a positive whole number of images, got {batch!r}")
    if lora_dtype not in DTYPES:
        raise ConfigError(f"--lora-dtype is one of {', '.join(DTYPES)}, got '{lora_dtype}'")
    setup = setup or diffusion_setup(family=spec.family, batch=batch, base_dtype=base_dtype)
    if (setup.finetune.method.value == "qlora") != (base_dtype == "nf4"):
        raise ConfigError("an nf4 base is the setup's QLoRA: diffusion_setup(base_dtype='nf4') with base_dtype='nf4'")
    if base_dtype == "fp8" and spec.family == "sdxl":
        raise ConfigError("--base-dtype fp8 is not sized for SDXL's UNet yet: its trace is 5.5% above a real CPU step "
                          "(bench/results/diffusion.md); use bf16 or nf4")
    shp = shapes(spec, int(height), int(width))
    swap = block_swap(spec, setup, blocks_to_swap, base_dtype) if blocks_to_swap else None
    # an fp8 base under checkpointing is not linear in the blocks (Flux-dev 512 px: the 2-block check passes, the
    # full-depth figure is 1.5 GiB off): traced whole
    whole = base_dtype == "fp8" and setup.checkpointing.is_on
    fitted = not exact and fittable(spec)
    if fitted:
        step = fit_denoiser(spec, shp, setup, batch=batch, kernels=kernels, lora_dtype=lora_dtype,
                            base_dtype=base_dtype, whole=whole)
        memory, params, trainable, fitted = step.memory, step.params, step.trainable, step.fitted
    else:
        keep: dict = {}
        memory = trace_denoiser(spec, shp, setup, batch=batch, kernels=kernels, lora_dtype=lora_dtype,
                                base_dtype=base_dtype, keep=keep)
        net = keep["model"]
        params = sum(p.numel() for p in net.parameters() if "lora_" not in _name(net, p))
        trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if swap is not None:
        memory = swap.apply(memory)
    frozen = frozen_parts(spec, weight_dtype(setup), batch=batch, size=(int(height), int(width)), kernels=kernels)
    estimate = DiffusionEstimate(
        model=spec.name, family=spec.family, shapes=shp, batch=batch, method=setup.finetune.method.value,
        rank=setup.finetune.rank, targets=tuple(setup.finetune.targets), cache_latents=cache_latents,
        cache_text=cache_text, denoiser_params=params, trainable_params=trainable, memory=memory, frozen=frozen,
        phases=(), base_dtype=base_dtype, swap=swap, fitted=fitted)
    resident = sum(f.weight_bytes for f in estimate.resident)
    if resident:
        memory = dataclasses.replace(memory, terms=tuple(memory.terms) + (Term(
            TermKey.FROZEN, Category.PARAMETERS, resident,
            source="the text encoders / VAE kept on the GPU (not cached): parameters on meta x weight dtype"),))
    if hardware is not None:
        memory = dataclasses.replace(memory, terms=tuple(memory.terms) + tuple(
            runtime_overhead_terms(memory.tensor_bytes, setup, as_hardware(hardware))))
    phases = _phases(estimate, memory)
    notes = list(memory.notes)
    if not spec.text_encoders and spec.vae is None:
        notes.append("a bare denoiser config: its text encoders and VAE are not known, their phases are left out")
    return dataclasses.replace(estimate, memory=memory, phases=phases, notes=tuple(notes))


def _name(net, param) -> str:
    names = getattr(net, "_memfit_param_names", None)
    if names is None:
        names = {id(p): n for n, p in net.named_parameters()}
        net._memfit_param_names = names
    return names.get(id(param), "")


def _phases(estimate: DiffusionEstimate, memory) -> tuple[PhaseBytes, ...]:
    by = {t.name: t.num_bytes for t in memory.terms}
    weights = sum(t.num_bytes for t in memory.terms if t.category is Category.PARAMETERS
                  and t.name != TermKey.FROZEN)
    states = sum(t.num_bytes for t in memory.terms if t.category is Category.OPTIMIZER)
    resident = estimate.resident
    resident_bytes = by.get(TermKey.FROZEN, 0)
    phases = []
    cached = [f for f in estimate.frozen if f not in resident]
    if cached:
        every = sum(f.weight_bytes for f in estimate.frozen)
        forward = max(f.forward_bytes for f in cached)
        phases.append(PhaseBytes("caching (once, before training)", weights + every + forward, (
            ("denoiser weights", weights), ("text encoders + VAE weights", every),
            ("largest encoder forward", forward))))
    if resident:
        forward = max(f.forward_bytes for f in resident)
        phases.append(PhaseBytes("encoding in each step", weights + states + resident_bytes + forward, (
            ("denoiser weights", weights), ("optimizer states", states),
            ("resident encoders' weights", resident_bytes), ("largest encoder forward", forward))))
    step = memory.tensor_bytes
    phases.append(PhaseBytes("training step (denoiser)", step, (
        ("denoiser step (traced)", step - resident_bytes), ("resident encoders' weights", resident_bytes))))
    return tuple(phases)


def fits(estimate: DiffusionEstimate, hardware) -> tuple[bool, int, int]:
    """(fits, required bytes, budget bytes): memfit.diagnose of the step (with its runtime overhead) on `hardware`,
    plus how far another phase's tensors go beyond the step's."""
    found = diagnose(estimate.memory, as_hardware(hardware))
    step = estimate.phases[-1].bytes
    required = found.required_bytes + max(0, estimate.peak.bytes - step)
    return required <= found.budget_bytes, required, found.budget_bytes


def size_run(model: str | dict, *, resolution: tuple[int, int], batch: int = 1, method: str = "lora", rank: int = 16,
             targets: str | None = None, lora_dtype: str = "fp32", precision: str = "amp-bf16",
             checkpointing: bool = False, optimizer: str | None = None, cache_latents: bool = False,
             cache_text: bool = False, gpu: str = "RTX-4090", base_dtype: str = "bf16", blocks_to_swap: int = 0,
             exact: bool = False):
    """`memfit diffusion`'s one call: (DiffusionEstimate, Hardware, fits(...)) from the command's values."""
    spec = resolve_model(model)
    hardware = as_hardware(gpu)  # a bad GPU name before minutes of tracing
    setup = diffusion_setup(method=method, rank=rank, targets=targets, family=spec.family, precision=precision,
                            checkpointing=checkpointing, optimizer=optimizer, batch=batch, base_dtype=base_dtype)
    result = estimate_diffusion(spec, resolution=resolution, batch=batch, setup=setup, cache_latents=cache_latents,
                                cache_text=cache_text, lora_dtype=lora_dtype, hardware=hardware,
                                base_dtype=base_dtype, blocks_to_swap=blocks_to_swap, exact=exact)
    return result, hardware, fits(result, hardware)
