"""A vision-language model's training step, built from its HF config with inputs shaped as its processor makes them:
the vision tower over every image's patches, the merger / projector, the language model over text + vision tokens.

The same step is traced on fake tensors (memfit.trace, the peak of every allocation) and run for real on CPU
(memfit.measure, the profiler's allocation events, bench/vlm.py). Qwen2-VL's forward reads values of its inputs (the
patch grid for the vision tower's rotary table and attention splits, the placeholder positions in the token ids);
on fake tensors those inputs are made as constants (FakeTensorMode keeps the real values of a tensor made from a
Python list and of ops on constants only: torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT, raised here while the
step runs) and the M-RoPE position ids are given (their values do not change memory; their shape is the model's).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..techniques.convert import MEMFIT_LOOP, Target, convert_model
from .tokens import ImageTokens

QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""The families whose processor resizes within [min_pixels, max_pixels] (the others resize to the tower's square)."""
FAMILIES = (*QWEN_TYPES, "llava", "llava_next", "gemma3")
_TOWER_AND_PROJECTOR = ("model.vision_tower.", "model.multi_modal_projector.")
VISION_PREFIXES = {"qwen2_vl": ("model.visual.",), "qwen2_5_vl": ("model.visual.",), "llava": _TOWER_AND_PROJECTOR,
                   "llava_next": (*_TOWER_AND_PROJECTOR, "model.image_newline"), "gemma3": _TOWER_AND_PROJECTOR}
"""The vision side's modules (tower and merger / projector): modeling_qwen2_vl.py, modeling_llava.py,
modeling_llava_next.py (its learned image_newline row), modeling_gemma3.py (SigLIP tower, pooling projector)."""
TOWER_BLOCKS = {"qwen2_vl": "model.visual.blocks.", "qwen2_5_vl": "model.visual.blocks.",
                "llava": "model.vision_tower.encoder.", "llava_next": "model.vision_tower.encoder.",
                "gemma3": "model.vision_tower.encoder."}
TOWERS = ("frozen", "trained", "lora")
"""How the vision side trains: "frozen" (tower and merger: the defaults of ms-swift, freeze_vit / freeze_aligner, and
LLaMA-Factory, freeze_vision_tower / freeze_multi_modal_projector), "trained" with the rest (a full fine-tune of
both), or "lora": adapters on the tower blocks' Linears too (a LoRA setup only)."""


@dataclass(frozen=True)
class VlmInputs:
    """One micro-batch's shape: the images of one sample, the text tokens around them, the samples per batch."""

    images: tuple[ImageTokens, ...]
    text_len: int
    micro_batch: int
    wrapper: int = 2
    """Text tokens around each image's placeholders: Qwen's <|vision_start|> / <|vision_end|> (processing_qwen2_vl.py
    expands one <|image_pad|> between them); none for LLaVA (processing_llava.py repeats <image> alone) and for
    Gemma 3 (its begin / end of image tokens are counted in the image's lm_tokens): `wrapper_tokens`."""

    @property
    def lm_seq(self) -> int:
        """Text + every image's placeholders and wrapper tokens."""
        return self.text_len + sum(image.lm_tokens + self.wrapper for image in self.images)

    @property
    def patches(self) -> int:
        return sum(image.tower_tokens for image in self.images)


def wrapper_tokens(config: Mapping[str, Any]) -> int:
    """VlmInputs.wrapper of the config's family."""
    return 2 if config.get("model_type") in QWEN_TYPES else 0


def check_family(config: Mapping[str, Any]) -> str:
    model_type = str(config.get("model_type", ""))
    if model_type not in FAMILIES:
        raise ConfigError(f"memfit vlm sizes the memory of {', '.join(FAMILIES)} so far, not model_type "
                          f"'{model_type}' (vision tokens alone: memfit.vlm.tokens)")
    return model_type


def _hf_config(config: Mapping[str, Any]):
    from transformers import AutoConfig

    config = dict(config)
    # no KV cache in training: transformers 5 reads use_cache from the text config too, and a cache kept across a
    # checkpointed block's recompute would double its keys
    config["text_config"] = {**(config.get("text_config") or {}), "use_cache": False}
    model_type = config.pop("model_type")
    hf = AutoConfig.for_model(model_type, **config)
    hf.use_cache = False
    return hf


def build_vlm(config: Mapping[str, Any], setup, tower: str = "frozen"):
    """The VLM as `setup` trains it: weights in the setup's dtype (LoRA / QLoRA bases as memfit._torch.lora builds
    them, adapters added by its apply_adapters), the attention implementation asked, the tower frozen or not."""
    import transformers

    from .._torch.lora import apply_adapters, base_dtype
    from .._torch.step import param_dtype

    family = check_family(config)
    if tower not in TOWERS:
        raise ConfigError(f"the vision tower is one of {', '.join(TOWERS)}, got '{tower}'")
    dtype = base_dtype(setup) if setup.finetune.adapters else param_dtype(setup)
    model = transformers.AutoModelForImageTextToText.from_config(
        _hf_config(config), attn_implementation=str(setup.attention), dtype=dtype)
    # checkpointing as every other model gets it (HF's switch for full, the blocks wrapped otherwise): the technique's
    # one conversion (memfit.techniques.convert), as memfit._torch.step.build_hf_model runs it for text models
    convert_model(model, setup, Target(is_hf=True, loop=MEMFIT_LOOP), ("checkpointing",))
    if tower == "lora" and not setup.finetune.adapters:
        raise ConfigError("a LoRA vision tower needs a LoRA / QLoRA setup (--finetune lora)")
    if setup.finetune.adapters:
        targets = lora_targets(model, family, with_tower=tower == "lora") if not setup.finetune.targets else None
        apply_adapters(model, setup.replace(finetune=dataclasses.replace(setup.finetune, targets=targets))
                       if targets else setup)
    if tower == "frozen":
        for name, param in model.named_parameters():
            if name.startswith(VISION_PREFIXES[family]):
                param.requires_grad_(False)
    model.train()
    return model


def lora_targets(model, family: str, *, with_tower: bool) -> tuple[str, ...]:
    """Every Linear of the language model (ms-swift / LLaMA-Factory `all-linear` with the tower frozen), by full name
    so that peft matches no vision block or merger layer of the same short name; the tower's too when asked."""
    import torch

    stacks = ("model.language_model.",) + ((TOWER_BLOCKS[family],) if with_tower else ())
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and name.startswith(stacks))


def qwen_batch(config: Mapping[str, Any], inputs: VlmInputs) -> dict:
    """The batch processing_qwen2_vl.py makes: every sample the same (text, then each image's placeholders), no
    attention mask (no padding: transformers' masking_utils takes a fake mask for a traced one and would build the
    T x T mask a real all-ones mask skips, for SDPA's causal kernel instead), labels =
    input ids (the loss runs over every position's logits either way), pixel rows of 3 x temporal x patch^2 values
    per patch, one (1, h, w) grid row per image, mm_token_type_ids 1 on image tokens. Made with torch.tensor from
    Python lists, so that on fake tensors the ids and grids are constants (see the module docstring)."""
    import torch

    text, vision = config.get("text_config", {}) or {}, config.get("vision_config", {}) or {}
    patch, temporal = int(vision.get("patch_size", 14)), int(vision.get("temporal_patch_size", 2))
    image_id = int(config.get("image_token_id") or text.get("image_token_id") or 151655)
    start_id = int(config.get("vision_start_token_id") or 151652)
    end_id = int(config.get("vision_end_token_id") or 151653)
    row: list[int] = []
    for image in inputs.images:
        row += [start_id] + [image_id] * image.lm_tokens + [end_id]
    row += [0] * inputs.text_len
    b = inputs.micro_batch
    grids = [[1, image.size[0] // patch, image.size[1] // patch] for image in inputs.images] * b
    text_only = {"input_ids": torch.tensor([row] * b), "labels": torch.tensor([row] * b),
                 "mm_token_type_ids": torch.tensor([[int(t == image_id) for t in row]] * b),
                 "position_ids": torch.tensor([[list(range(len(row)))] * b] * 3)}
    if not grids:  # a sample without images: the tower does not run
        return text_only
    return {**text_only, "pixel_values": torch.randn(b * inputs.patches, 3 * temporal * patch * patch),
            "image_grid_thw": torch.tensor(grids), **_window_index(config, grids)}


def llava_batch(config: Mapping[str, Any], inputs: VlmInputs) -> dict:
    """The batch processing_llava.py / processing_llava_next.py makes: each image's <image> token repeated as many
    times as the image has features (LLaVA-NeXT: tiles unpadded + a newline per row + the base image), then the
    text; pixel_values one image_size square per image (LLaVA-1.5: the CLIP processor resizes and crops to it) or,
    for LLaVA-NeXT, (base image + tiles) squares per image with each image's original (height, width) in
    image_sizes (made from Python lists: constants on fake tensors, which the unpadding reads)."""
    import torch

    image_id = int(config.get("image_token_index") or config.get("image_token_id") or 32000)
    size = int((config.get("vision_config") or {}).get("image_size", 336))
    row: list[int] = []
    for image in inputs.images:
        row += [image_id] * image.lm_tokens
    row += [0] * inputs.text_len
    b = inputs.micro_batch
    batch = {"input_ids": torch.tensor([row] * b), "labels": torch.tensor([row] * b)}
    if not inputs.images:
        return batch
    if config.get("model_type") == "llava_next":
        crops = max(image.crops for image in inputs.images)  # the processor pads every image to the most tiles
        batch["pixel_values"] = torch.randn(b * len(inputs.images), crops, 3, size, size)
        batch["image_sizes"] = torch.tensor([list(image.original or image.size) for image in inputs.images] * b)
    else:
        batch["pixel_values"] = torch.randn(b * len(inputs.images), 3, size, size)
    return batch


def gemma3_batch(config: Mapping[str, Any], inputs: VlmInputs) -> dict:
    """The batch processing_gemma3.py makes: every image (and pan-and-scan crop) becomes <start_of_image>, then
    mm_tokens_per_image <image_soft_token>, then <end_of_image>; token_type_ids 1 on the soft tokens (the processor
    returns them, and with them the language model attends bidirectionally within each image); pixel_values one
    image_size square per image and crop."""
    import torch

    image_id = int(config.get("image_token_index") or config.get("image_token_id") or 262_144)
    boi, eoi = int(config.get("boi_token_index") or 255_999), int(config.get("eoi_token_index") or 256_000)
    size = int((config.get("vision_config") or {}).get("image_size", 896))
    row: list[int] = []
    for image in inputs.images:
        row += ([boi] + [image_id] * (image.lm_tokens // image.crops - 2) + [eoi]) * image.crops
    row += [0] * inputs.text_len
    b = inputs.micro_batch
    batch = {"input_ids": torch.tensor([row] * b), "labels": torch.tensor([row] * b),
             "token_type_ids": torch.tensor([[int(t == image_id) for t in row]] * b)}
    if inputs.images:
        batch["pixel_values"] = torch.randn(b * sum(image.crops for image in inputs.images), 3, size, size)
    return batch


def make_batch(config: Mapping[str, Any], inputs: VlmInputs) -> dict:
    family = config.get("model_type")
    if family in QWEN_TYPES:
        return qwen_batch(config, inputs)
    return gemma3_batch(config, inputs) if family == "gemma3" else llava_batch(config, inputs)


def _window_index(config: Mapping[str, Any], grids: list[list[int]]) -> dict:
    """Qwen2.5-VL's window attention order, computed by transformers' own vision_utils.get_vision_window_index on
    real tensors and passed as the precomputed `image_window_index` / `image_cu_window_seqlens` the model accepts
    (its boolean indexing has no fake-tensor form); made again from Python lists, so constants on fake tensors."""
    if config.get("model_type") != "qwen2_5_vl":
        return {}
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers.vision_utils import get_vision_window_index

    vision = config.get("vision_config", {}) or {}
    with unset_fake_temporarily():
        index, cu = get_vision_window_index(torch.tensor(grids), int(vision.get("spatial_merge_size", 2)),
                                            int(vision.get("window_size", 112)), int(vision.get("patch_size", 14)))
        index, cu = index.tolist(), cu.tolist()
    return {"image_window_index": torch.tensor(index), "image_cu_window_seqlens": torch.tensor(cu, dtype=torch.int32)}


@contextlib.contextmanager
def fake_safe_init():
    """SigLIP's weight init (Gemma 3's tower: lecun_normal_) runs torch.nn.init.trunc_normal_ through transformers'
    TORCH_INIT_FUNCTIONS, and torch's rejection loop there reads values (`mask.any()`), which fake tensors have
    none of: while the model is built for a trace the truncated normal is a plain normal fill of the same tensor
    (in place: no byte moves; values change no memory)."""
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    old = TORCH_INIT_FUNCTIONS["trunc_normal_"]

    def normal_fill(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        tensor.detach().normal_(mean, std, generator=generator)  # detached: the same storage, no autograd record
        return tensor

    TORCH_INIT_FUNCTIONS["trunc_normal_"] = normal_fill
    try:
        yield
    finally:
        TORCH_INIT_FUNCTIONS["trunc_normal_"] = old


@contextlib.contextmanager
def constant_inputs(limit: int):
    """Fake tensors made from Python lists of up to `limit` values keep their values (see the module docstring)."""
    import torch._subclasses.fake_tensor as fake

    old = fake.CONSTANT_NUMEL_LIMIT
    fake.CONSTANT_NUMEL_LIMIT = max(old, limit)
    try:
        yield
    finally:
        fake.CONSTANT_NUMEL_LIMIT = old


def trace_vlm(config: Mapping[str, Any], inputs: VlmInputs, setup, *, tower: str = "frozen",
              kernels: str = "cuda", keep: dict | None = None):
    """memfit.trace of one VLM step (a MemoryEstimate, method "traced"). `keep["model"]` gets the (fake) model."""
    from ..trace.run import BuiltDtypes, trace

    check_family(config)
    setup = setup.replace(micro_batch_size=inputs.micro_batch, seq_len=inputs.lm_seq)
    with constant_inputs(max(1 << 22, 4 * inputs.micro_batch * inputs.lm_seq)):
        # checkpointing is applied by build_vlm (HF's switch, as for text models), not again by the module session
        plain = setup.replace(checkpointing="none")
        kept = BuiltDtypes()

        def batch(_setup):
            kept.restore()
            return make_batch(config, inputs)

        def build():
            with fake_safe_init():
                return build_vlm(config, setup, tower)

        result = trace(kept.factory(build), plain, input_builder=batch, kernels=kernels)
    if keep is not None:
        keep["model"] = kept.model
    return dataclasses.replace(result, setup=setup)


def measure_vlm(config: Mapping[str, Any], inputs: VlmInputs, setup, *, tower: str = "frozen", steps: int = 2):
    """memfit.measure of real CPU steps of the same model and batch (tiny configs: bench/vlm.py, the tests)."""
    import torch

    from ..measure import measure

    torch.manual_seed(0)
    setup = setup.replace(micro_batch_size=inputs.micro_batch, seq_len=inputs.lm_seq)
    model = build_vlm(config, setup, tower)
    batch = make_batch(config, inputs)
    dtype = next(p.dtype for p in model.parameters())
    if "pixel_values" in batch:
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
    return measure(model, setup, steps=steps, device="cpu", batches=[batch] * setup.grad_accum_steps)
