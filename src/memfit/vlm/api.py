"""memfit.vlm's Python entry points: the memory of a VLM training step from the images a sample carries, and the
largest max_pixels or images per sample that fit a GPU."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api import as_hardware
from ..diagnose import diagnose
from ..errors import ConfigError
from ..estimate.device import runtime_overhead_terms
from ..setup import TrainingSetup
from .model import QWEN_TYPES, VlmInputs, check_family, trace_vlm, wrapper_tokens
from .presets import resolve_vlm_config
from .tokens import (LLAVA_NEXT_PINPOINTS, QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, ImageTokens, gemma3_image,
                     llava_image, llava_next_image, qwen_image)

STACKS = (("vision tower", ("model.visual.blocks.", "model.vision_tower.encoder.")),
          ("vision embeddings", ("model.visual.patch_embed.", "model.vision_tower.")),
          ("merger / projector", ("model.visual.merger.", "model.multi_modal_projector.", "model.image_newline")),
          ("language model", ("model.language_model.",)), ("lm head", ("lm_head.",)))
"""Module prefixes of each stack (modeling_qwen2_vl.py, modeling_llava.py, modeling_llava_next.py,
modeling_gemma3.py), first match wins: the CLIP / SigLIP tower's embeddings and norms fall in "vision embeddings",
LLaVA-NeXT's image_newline row in the projector's; Gemma 3's head is tied to its embeddings (no lm head row)."""


@dataclass(frozen=True)
class StackParams:
    name: str
    params: int
    trainable: int
    bytes: int


@dataclass(frozen=True)
class VlmEstimate:
    """One training step of a VLM: the images' tokens, each stack's sequence and parameters, the traced memory."""

    model: str
    image: ImageTokens
    images: int
    text_len: int
    micro_batch: int
    max_pixels: int
    tower: str
    memory: Any  # MemoryEstimate (traced)
    stacks: tuple[StackParams, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    wrapper: int = 2
    family: str = "qwen2_vl"

    @property
    def inputs(self) -> VlmInputs:
        return VlmInputs((self.image,) * self.images, self.text_len, self.micro_batch, self.wrapper)

    @property
    def lm_seq(self) -> int:
        return self.inputs.lm_seq

    @property
    def max_pixels_apply(self) -> bool:
        """Whether the processor resizes within [min_pixels, max_pixels] (Qwen-VL) rather than to a fixed square."""
        return self.family in QWEN_TYPES

    @property
    def vision_tokens(self) -> int:
        """The placeholders of one sample's images."""
        return self.image.lm_tokens * self.images

    @property
    def patches(self) -> int:
        """The patches one sample's images put through the vision tower."""
        return self.image.tower_tokens * self.images


def _setup(setup, micro_batch: int | None):

    setup = setup or TrainingSetup()
    return setup.replace(micro_batch_size=micro_batch or setup.micro_batch_size)


def estimate_vlm(model: str | Mapping[str, Any], *, images: int = 1, image_size: tuple[int, int] = (768, 768),
                 max_pixels: int | None = None, min_pixels: int | None = None, text_len: int = 512, setup=None,
                 micro_batch: int | None = None, tower: str = "frozen", kernels: str = "cuda",
                 hardware=None) -> VlmEstimate:
    """The traced peak of one training step of `model` (a preset name, config.json path or config dict) on samples
    of `images` images of `image_size` (height, width) pixels, each resized by the processor's rules within
    [min_pixels, max_pixels] (the hub processor's 3136 / 12,845,056 by default), plus `text_len` text tokens.
    `setup`: a TrainingSetup (precision, LoRA, checkpointing, optimizer...); its micro-batch unless `micro_batch`.
    `hardware` (a Hardware or GPU name): the runtime's overhead terms are added (cuBLAS workspaces, the caching
    allocator's rounding and reserve, the CUDA context: memfit.estimate.device, the peak replayed alone)."""
    config, name = resolve_vlm_config(model)
    check_family(config)
    if not isinstance(images, int) or images < 0:
        raise ConfigError(f"images per sample is a whole number >= 0, got {images!r}")
    if not isinstance(text_len, int) or text_len < 1:
        raise ConfigError(f"the text length is a positive whole number of tokens, got {text_len!r}")
    setup = _setup(setup, micro_batch)
    max_pixels = max_pixels or QWEN_MAX_PIXELS
    image = image_tokens(config, image_size, min_pixels=min_pixels, max_pixels=max_pixels)
    wrapper = wrapper_tokens(config)
    inputs = VlmInputs((image,) * images, text_len, setup.micro_batch_size, wrapper)
    built: dict[str, Any] = {}
    memory = trace_vlm(config, inputs, setup, tower=tower, kernels=kernels, keep=built)
    if hardware is not None:
        memory = with_overhead(memory, setup, hardware)
    return VlmEstimate(model=name, image=image, images=images, text_len=text_len, wrapper=wrapper,
                       family=str(config["model_type"]),
                       micro_batch=setup.micro_batch_size, max_pixels=max_pixels, tower=tower, memory=memory,
                       stacks=stack_params(built.get("model")), notes=tuple(memory.notes))


def image_tokens(config: Mapping[str, Any], image_size: tuple[int, int], *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> ImageTokens:
    """One image of `image_size` by the family's processor rules (memfit.vlm.tokens), from the model's config."""
    vision = config.get("vision_config", {}) or {}
    family = config.get("model_type")
    side, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
    strategy = str(config.get("vision_feature_select_strategy", "default"))
    if family == "llava":  # every image resized and cropped to the tower's square
        return llava_image(image_size=side, patch=patch, strategy=strategy)
    if family == "llava_next":  # any-res tiles of the tower's square
        pinpoints = tuple(tuple(p) for p in config.get("image_grid_pinpoints") or LLAVA_NEXT_PINPOINTS)
        return llava_next_image(*image_size, pinpoints=pinpoints, crop=side, patch=patch, strategy=strategy)
    if family == "gemma3":  # resized to the tower's square, pooled to mm_tokens_per_image (no pan and scan: the
        # processor's default do_pan_and_scan=False)
        return gemma3_image(*image_size, image_size=int(vision.get("image_size", 896)), patch=patch,
                            mm_tokens=int(config.get("mm_tokens_per_image") or 256))
    return qwen_image(*image_size, patch=int(vision.get("patch_size", 14)),
                      merge=int(vision.get("spatial_merge_size", 2)), min_pixels=min_pixels or QWEN_MIN_PIXELS,
                      max_pixels=max_pixels or QWEN_MAX_PIXELS)


def with_overhead(memory, setup, hardware):
    import dataclasses


    terms = runtime_overhead_terms(memory.tensor_bytes, setup, as_hardware(hardware))
    return dataclasses.replace(memory, terms=tuple(memory.terms) + tuple(terms))


def stack_params(model) -> tuple[StackParams, ...]:
    if model is None:
        return ()
    rows = {name: [0, 0, 0] for name, _ in STACKS}
    for path, param in model.named_parameters():
        stack = next((name for name, prefixes in STACKS if path.startswith(prefixes)), None)
        if stack is None:
            continue
        row = rows[stack]
        row[0] += param.numel()
        row[1] += param.numel() if param.requires_grad else 0
        row[2] += param.numel() * param.element_size()
    return tuple(StackParams(name, *rows[name]) for name, _ in STACKS if rows[name][0])


# ---- what fits ---------------------------------------------------------------------------------------------------

def fits(estimate: VlmEstimate, hardware) -> tuple[bool, int, int]:
    """(fits, required bytes, budget bytes) by memfit.diagnose on `hardware` (a Hardware or a GPU name)."""

    found = diagnose(estimate.memory, as_hardware(hardware))
    return found.required_bytes <= found.budget_bytes, found.required_bytes, found.budget_bytes


def largest(candidates: list, required: Callable[[Any], int], budget: int, *, tries: int = 6):
    """The last of the ascending `candidates` whose `required(c)` bytes stay within `budget` (None when the first
    does not), searched by interpolation: a VLM's step grows about linearly with its vision tokens (the attention
    kernels a GPU runs keep no tokens x tokens matrix), so a few traces land on the answer. After `tries` traces the
    largest candidate known to fit is returned. Returns (candidate or None, {candidate: bytes} traced)."""
    seen: dict[int, int] = {}

    def cost(i: int) -> int:
        if i not in seen:
            seen[i] = required(candidates[i])
        return seen[i]

    lo, hi = 0, len(candidates) - 1
    if cost(lo) > budget:
        return None, _named(candidates, seen)
    if cost(hi) <= budget:
        return candidates[hi], _named(candidates, seen)
    step = 0
    while hi - lo > 1 and len(seen) < tries:  # cost(lo) fits, cost(hi) does not
        slope = (cost(hi) - cost(lo)) / (hi - lo)
        guess = lo + int((budget - cost(lo)) / slope) if slope > 0 else (lo + hi) // 2
        # every other probe one past the interpolated guess: a curve bending one way moves only one end of the
        # bracket (regula falsi's slow side); the extra step lands on the other
        mid = min(hi - 1, max(lo + 1, guess + step % 2))
        step += 1
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return candidates[lo], _named(candidates, seen)


def _named(candidates: list, seen: dict[int, int]) -> dict:
    return {candidates[i]: b for i, b in sorted(seen.items())}


def max_pixels_ladder(image_size: tuple[int, int], *, patch: int = 14, merge: int = 2,
                      min_pixels: int = QWEN_MIN_PIXELS, ceiling: int = QWEN_MAX_PIXELS) -> list[int]:
    """The max_pixels settings (multiples of (patch x merge)^2, as the Qwen cookbooks write them) that give
    distinct token counts for an image of `image_size`, ascending, up to `ceiling`: the candidates of the search."""
    unit = (patch * merge) ** 2
    out, last = [], None
    for k in range(max(1, min_pixels // unit), ceiling // unit + 1):
        tokens = qwen_image(*image_size, patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=k * unit).lm_tokens
        if tokens != last:
            out.append(k * unit)
            last = tokens
    return out


# ---- the data rungs: fewer pixels, fewer images ---------------------------------------------------------------------

def search_max_pixels(model, *, images: int, hardware, budget: int, seen: dict | None = None,
                      **given) -> tuple[int | None, dict]:
    """The largest max_pixels (of max_pixels_ladder's candidates) at which `images` images per sample fit `budget`
    bytes, and {max_pixels: required bytes} of the traces taken (memfit.vlm.api.largest). `given`: estimate_vlm's
    other arguments (image_size, min_pixels, text_len, setup, tower); `seen` keeps each estimate by (images,
    max_pixels) for a caller that needs one again."""
    ladder = max_pixels_ladder(given["image_size"], min_pixels=given.get("min_pixels") or QWEN_MIN_PIXELS)
    return largest(ladder, lambda m: _required(model, images, m, hardware, seen, given), budget)


def search_images(model, *, max_pixels: int | None, hardware, budget: int, seen: dict | None = None,
                  **given) -> tuple[int | None, dict]:
    """The most images per sample (1 to 64) that fit `budget` bytes at `max_pixels`, and the traces taken."""
    return largest(list(range(1, 65)), lambda n: _required(model, n, max_pixels, hardware, seen, given), budget)


def _estimate(model, images: int, max_pixels: int | None, hardware, seen: dict | None, given: dict) -> VlmEstimate:
    key = (images, max_pixels)
    if seen is not None and key in seen:
        return seen[key]
    found = estimate_vlm(model, images=images, max_pixels=max_pixels, hardware=hardware, **given)
    if seen is not None:
        seen[key] = found
    return found


def _required(model, images: int, max_pixels: int | None, hardware, seen: dict | None, given: dict) -> int:
    return fits(_estimate(model, images, max_pixels, hardware, seen, given), hardware)[1]


@dataclass(frozen=True)
class DataRung:
    """One step of `memfit vlm --plan`: what the samples give up (pixels per image, or images per sample), the
    vision tokens per sample before and after (its cost), and the step re-estimated."""

    rung: str
    change: str
    vision_tokens_before: int
    vision_tokens_after: int
    estimate: VlmEstimate
    required_bytes: int
    fits: bool

    def to_dict(self) -> dict:
        return {"rung": self.rung, "change": self.change, "vision_tokens_before": self.vision_tokens_before,
                "vision_tokens_after": self.vision_tokens_after, "max_pixels": self.estimate.max_pixels,
                "images": self.estimate.images, "lm_seq": self.estimate.lm_seq,
                "required_bytes": self.required_bytes, "fits": self.fits}


def plan_data(model, start: VlmEstimate, *, hardware, **given) -> tuple[tuple[DataRung, ...], dict[str, str]]:
    """The data rungs from `start` (estimate_vlm's result for `given`), cheapest first, each re-estimated, stopping at
    the first that fits: fewer pixels (the largest max_pixels that fits; Qwen-VL only: the other processors resize
    to a fixed square), then fewer images per sample (the most that fit at the pixels reached). Where a rung cannot
    fit alone it goes as far as it can (the smallest max_pixels, one image) and the next rung goes on from there.
    Returns the rungs taken and {rung: why it was passed over}."""
    ok, _, budget = fits(start, hardware)
    seen: dict = {(start.images, start.max_pixels): start}  # (images, max_pixels) -> estimate: no trace twice
    rungs: list[DataRung] = []
    skipped: dict[str, str] = {}
    current = start
    if ok:
        return (), skipped
    if not start.max_pixels_apply:
        skipped["fewer pixels"] = f"{start.family} resizes every image (or tile) to its tower's square"
    else:
        best, _ = search_max_pixels(model, images=current.images, hardware=hardware, budget=budget, seen=seen,
                                    **given)
        candidates = max_pixels_ladder(given["image_size"], min_pixels=given.get("min_pixels") or QWEN_MIN_PIXELS)
        chosen = best if best is not None else candidates[0]
        after = _estimate(model, current.images, chosen, hardware, seen, given)
        if after.vision_tokens < current.vision_tokens:
            rungs.append(_rung("fewer pixels", f"max_pixels {current.max_pixels:,} -> {chosen:,}", current, after,
                               hardware))
            current = after
        else:
            skipped["fewer pixels"] = "the images are at their fewest tokens already"
    if not (rungs and rungs[-1].fits):
        best, _ = search_images(model, max_pixels=current.max_pixels, hardware=hardware, budget=budget, seen=seen,
                                **given)
        chosen = best if best is not None else 1
        if chosen < current.images:
            after = _estimate(model, chosen, current.max_pixels, hardware, seen, given)
            rungs.append(_rung("fewer images", f"images per sample {current.images} -> {chosen}", current, after,
                               hardware))
        else:
            skipped["fewer images"] = f"{current.images} image(s) per sample already"
    return tuple(rungs), skipped


def _rung(name: str, change: str, before: VlmEstimate, after: VlmEstimate, hardware) -> DataRung:
    ok, required, _ = fits(after, hardware)
    return DataRung(name, change, before.vision_tokens, after.vision_tokens, after, required, ok)
