"""How many tokens an image becomes, by each processor's own rules: the language model's placeholder tokens and the
patches the vision tower runs over. What a VLM's memory hangs on is this count, not the pixels themselves.

Each rule restates the arithmetic of the transformers 5.x image processor / processor named in its docstring (no
pixels are touched); tests/vlm/test_vlm.py runs those classes on synthetic images and asserts equal counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 12_845_056
"""Qwen2-VL / Qwen2.5-VL preprocessor_config.json on the hub: min_pixels 3136, max_pixels 12845056 (16384 x 28 x 28).
transformers' class default is smaller (28 x 28 x 1280); what a user loading the hub processor gets is this one."""


@dataclass(frozen=True)
class ImageTokens:
    """One image after the processor. `lm_tokens`: the positions it takes in the language model's sequence (image
    placeholders, plus the wrapper tokens the processor adds around them where it adds them); `tower_tokens`: the
    patches the vision tower attends over, summed over crops / tiles; `crops`: the images the tower sees (tiles,
    crops and the global view); `tower_seq`: the patches of one crop (the tower's attention length) — for Qwen the
    whole image is one sequence; `size`: the (height, width) the processor resizes to (the first crop's);
    `original`: the image's own (height, width) where the model reads it (LLaVA-NeXT's image_sizes), else None."""

    lm_tokens: int
    tower_tokens: int
    crops: int
    tower_seq: int
    size: tuple[int, int]
    original: tuple[int, int] | None = None


def _check_size(height: int, width: int) -> None:
    if not (isinstance(height, int) and isinstance(width, int)) or height < 1 or width < 1:
        raise ConfigError(f"an image size is two positive whole numbers of pixels, got {height} x {width}")


# ---- Qwen2-VL / Qwen2.5-VL / Qwen3-VL ------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers models/qwen2_vl/image_processing_qwen2_vl.py smart_resize: both sides rounded to a multiple of
    `factor` (patch x merge), then scaled (floor / ceil to the factor) into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ConfigError(f"Qwen-VL processors refuse an aspect ratio above 200, got {height} x {width}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_image(height: int, width: int, *, patch: int = 14, merge: int = 2, min_pixels: int = QWEN_MIN_PIXELS,
               max_pixels: int = QWEN_MAX_PIXELS) -> ImageTokens:
    """One image: grid (1, h / patch, w / patch) patches (the image is repeated to the temporal patch of 2, so t = 1),
    image_grid_thw.prod() // merge^2 placeholder tokens (processing_qwen2_vl.py); the tower's merger folds merge x
    merge patches into one token. The vision start / end tokens around them are text tokens of the prompt."""
    _check_size(height, width)
    h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    patches = (h // patch) * (w // patch)
    return ImageTokens(patches // merge ** 2, patches, 1, patches, (h, w))


# ---- LLaVA-1.5 / LLaVA-NeXT ----------------------------------------------------------------------------------------

def llava_image(*, image_size: int = 336, patch: int = 14, strategy: str = "default",
                additional: int = 1) -> ImageTokens:
    """processing_llava.py: (image_size / patch)^2 patches + `additional` (CLS) tokens, minus the CLS under the
    "default" feature strategy: 576 for LLaVA-1.5 at 336 px. Every image is resized / cropped to image_size."""
    side = image_size // patch
    seq = side * side + additional
    return ImageTokens(seq - (1 if strategy == "default" else 0), seq, 1, seq, (image_size, image_size))


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """image_processing_utils.select_best_resolution: the pinpoint keeping the most of the image, then the least
    waste."""
    best, most, least = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pw * ph - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (ph, pw), effective, wasted
    return best


LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
"""llava-hf/llava-v1.6-* image_grid_pinpoints (image_processing_llava_next.py's default too)."""


def llava_next_image(height: int, width: int, *, pinpoints=LLAVA_NEXT_PINPOINTS, crop: int = 336, patch: int = 14,
                     strategy: str = "default", additional: int = 1) -> ImageTokens:
    """processing_llava_next.py _get_number_of_features: the best pinpoint's grid of crop-sized tiles, its patches
    with the letterbox padding removed (unpadding) plus one newline token per remaining row, plus the base image's
    patches (+ CLS, minus it under "default"). The tower runs the base image and every tile at crop x crop."""
    _check_size(height, width)
    best_h, best_w = select_best_resolution(height, width, pinpoints)
    scale_h, scale_w = best_h // crop, best_w // crop
    side = crop // patch
    cur_h, cur_w = side * scale_h, side * scale_w
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    base = side * side + additional
    lm = cur_h * cur_w + cur_h + base - (1 if strategy == "default" else 0)
    crops = 1 + scale_h * scale_w
    return ImageTokens(lm, crops * base, crops, base, (crop, crop), (height, width))


# ---- Gemma 3 -------------------------------------------------------------------------------------------------------

def pan_and_scan_crops(height: int, width: int, *, min_crop: int = 256, max_crops: int = 4,
                       min_ratio: float = 1.2) -> int:
    """image_processing_gemma3.py pan_and_scan_batched: how many crops an elongated image is cut into (0 when pan and
    scan does not apply)."""
    long, short = (width, height) if width >= height else (height, width)
    if long / short < min_ratio:
        return 0
    n = min(int(math.floor(long / min_crop)), int(math.floor(long / short + 0.5)))
    n = min(max_crops, max(2, n))
    crop_long, crop_short = int(math.ceil(long / n)), short
    return 0 if min(crop_long, crop_short) < min_crop else n


def gemma3_image(height: int, width: int, *, image_size: int = 896, patch: int = 14, mm_tokens: int = 256,
                 pan_and_scan: bool = False, min_crop: int = 256, max_crops: int = 4,
                 min_ratio: float = 1.2) -> ImageTokens:
    """processing_gemma3.py: every image (and each pan-and-scan crop) is resized to image_size and becomes
    mm_tokens_per_image placeholders between a begin- and end-of-image token (+ 2). The SigLIP tower runs
    (image_size / patch)^2 patches per crop; the projector pools them to mm_tokens."""
    _check_size(height, width)
    crops = 1 + (pan_and_scan_crops(height, width, min_crop=min_crop, max_crops=max_crops, min_ratio=min_ratio)
                 if pan_and_scan else 0)
    seq = (image_size // patch) ** 2
    return ImageTokens(crops * (mm_tokens + 2), crops * seq, crops, seq, (image_size, image_size))


# ---- Idefics3 / SmolVLM --------------------------------------------------------------------------------------------

MAX_IMAGE_SIDE = 4096
"""image_processing_idefics3.py MAX_IMAGE_SIZE: no side above 4k."""


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height:
        width, height = max_len, int(max_len / ratio)
        height += height % 2
    else:
        height, width = max_len, int(max_len * ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / ratio)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * ratio)
    return max(height, 1), max(width, 1)


def idefics3_image(height: int, width: int, *, longest_edge: int = 4 * 364, tile: int = 364, patch: int = 14,
                   scale_factor: int = 2, splitting: bool = True, newline_tokens: int = 1) -> ImageTokens:
    """image_processing_idefics3.py get_number_of_image_patches (rows x cols tiles of `tile` px after resizing the
    longest edge, + the global image) and processing_idefics3.py _get_num_multimodal_tokens: image_seq_len tokens
    per tile (tile / patch)^2 / scale_factor^2, each wrapped by a fake token and a row/col tag (+2), a newline per
    row; the global image's wrapper (+3). `newline_tokens`: what "\\n\\n" tokenizes to (1 for SmolVLM's and
    Idefics3's tokenizers, which merge it)."""
    _check_size(height, width)
    seq_len = (tile // patch) ** 2 // scale_factor ** 2
    rows = cols = 0
    if splitting:
        h, w = _rescale_to_max_len(height, width, longest_edge)
        h, w = _below_upper_bound(h, w, MAX_IMAGE_SIDE)
        rh, rw = math.ceil(h / tile) * tile, math.ceil(w / tile) * tile
        if rh > tile or rw > tile:
            rows, cols = math.ceil(rh / tile), math.ceil(rw / tile)
    lm = seq_len + 3 + (rows * ((seq_len + 2) * cols + 1) + (newline_tokens - 1) if rows else 0)
    crops = rows * cols + 1
    seq = (tile // patch) ** 2
    return ImageTokens(lm, crops * seq, crops, seq, (tile, tile))
