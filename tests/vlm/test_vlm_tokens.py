"""memfit.vlm.tokens against transformers' own image processors (the PIL backends, no torchvision) and their
processors' placeholder expansion (`replace_image_token`, the method that writes the prompt), run offline on
synthetic images: the counts must be equal."""

import re
import types

import numpy as np
import pytest

from memfit.vlm import tokens as vt

PIL = pytest.importorskip("PIL.Image")
SIZES = [(224, 224), (300, 500), (500, 300), (768, 768), (1080, 1920), (37, 2000), (2048, 1536), (100, 100)]


def image(height, width):
    return PIL.fromarray(np.zeros((height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("max_pixels", [vt.QWEN_MAX_PIXELS, 1_003_520, 200_704])
@pytest.mark.parametrize("size", SIZES)
def test_qwen_matches_image_processor(size, max_pixels):
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=vt.QWEN_MIN_PIXELS, max_pixels=max_pixels)
    out = processor(images=[image(*size)], return_tensors="np")
    grid = out["image_grid_thw"][0]
    ours = vt.qwen_image(*size, max_pixels=max_pixels)
    # processing_qwen2_vl.py: image_grid_thw.prod() // merge_size**2 placeholders; the tower gets every patch row
    assert ours.lm_tokens == int(np.prod(grid)) // 4
    assert ours.tower_tokens == int(np.prod(grid)) == out["pixel_values"].shape[0]


@pytest.mark.parametrize("size", SIZES)
def test_llava_next_matches_processor(size):
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                 image_grid_pinpoints=[list(p) for p in vt.LLAVA_NEXT_PINPOINTS])
    out = image_processor(images=[image(*size)], return_tensors="np")
    processor = object.__new__(LlavaNextProcessor)  # its token arithmetic without a tokenizer
    processor.image_processor, processor.patch_size, processor.image_token = image_processor, 14, "<image>"
    processor.num_additional_image_tokens, processor.vision_feature_select_strategy = 1, "default"
    expected = processor.replace_image_token(out, 0).count("<image>")
    ours = vt.llava_next_image(*size)
    assert ours.lm_tokens == expected
    assert ours.crops == out["pixel_values"].shape[1]


def test_llava_is_576():
    from transformers import LlavaImageProcessorPil

    out = LlavaImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})(
        images=[image(480, 640)], return_tensors="np")
    side = out["pixel_values"].shape[-1] // 14
    ours = vt.llava_image()
    assert ours.lm_tokens == side * side == 576 and ours.tower_tokens == 577


@pytest.mark.parametrize("pan_and_scan", [False, True])
@pytest.mark.parametrize("size", SIZES + [(400, 1600), (1600, 300)])
def test_gemma3_matches_processor(size, pan_and_scan):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    image_processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=pan_and_scan,
                                              pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                                              pan_and_scan_min_ratio_to_activate=1.2)
    out = image_processor(images=[image(*size)], return_tensors="np")
    processor = object.__new__(Gemma3Processor)
    processor.full_image_sequence = "\n\n<boi>" + "<img>" * 256 + "<eoi>\n\n"
    prompt = processor.replace_image_token(out, 0)
    ours = vt.gemma3_image(*size, pan_and_scan=pan_and_scan)
    assert ours.lm_tokens == len(re.findall("<boi>|<img>|<eoi>", prompt))
    assert ours.crops == out["pixel_values"].shape[0]


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("size", SIZES)
def test_idefics3_smolvlm_match_processor(size, family):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, SmolVLMImageProcessorPil

    # Idefics3-8B: 364 px tiles, longest edge 4 x 364, scale factor 2; SmolVLM2: 512 px tiles of 16 px patches,
    # longest edge 4 x 512, scale factor 4 (their preprocessor / model configs on the hub)
    tile, patch, scale = (364, 14, 2) if family == "idefics3" else (512, 16, 4)
    cls = Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil
    image_processor = cls(size={"longest_edge": 4 * tile}, max_image_size={"longest_edge": tile})
    out = image_processor(images=[[image(*size)]], return_tensors="np", return_row_col_info=True)
    ours = vt.idefics3_image(*size, longest_edge=4 * tile, tile=tile, patch=patch, scale_factor=scale)
    fake = types.SimpleNamespace(fake_image_token="<fake>", global_image_tag="<global-img>", image_token="<image>",
                                 image_seq_len=(tile // patch) ** 2 // scale ** 2)
    prompt = Idefics3Processor.replace_image_token(fake, out, 0)
    # one token each: <fake>, <global-img>, <image>, <row_i_col_j>, and "\n\n" / "\n" (merged by the real tokenizer)
    assert ours.lm_tokens == len(re.findall(r"<fake>|<global-img>|<image>|<row_\d+_col_\d+>|\n\n|\n", prompt))
    assert ours.crops == out["pixel_values"].shape[1]


def test_bad_size_is_a_config_error():
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError):
        vt.qwen_image(0, 10)
    with pytest.raises(ConfigError):
        vt.qwen_image(10, 3000)
