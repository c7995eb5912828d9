"""Configs of the published Qwen-VL, LLaVA-1.5, LLaVA-NeXT and Gemma 3 checkpoints, so that `memfit vlm` sizes them
offline: the architecture fields of each hub repository's config.json (Qwen/Qwen2-VL-2B-Instruct,
Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct, llava-hf/llava-1.5-7b-hf,
llava-hf/llava-v1.6-mistral-7b-hf, google/gemma-3-4b-it), nested as transformers 5.x's configs take them. A
config.json path or a config dict works for any other."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelSourceError


def _text(hidden, inter, layers, heads, kv, vocab, tied, max_pos=128000):
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos, "tie_word_embeddings": tied,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}


def _qwen2_vision(out_hidden):
    return {"depth": 32, "embed_dim": 1280, "hidden_size": out_hidden, "num_heads": 16, "mlp_ratio": 4,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}


def _qwen25_vision(out_hidden):
    return {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": out_hidden,
            "num_heads": 16, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
            "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}


_CLIP_L_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
               "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
               "projection_dim": 768, "hidden_act": "quick_gelu"}
"""openai/clip-vit-large-patch14-336, the tower of LLaVA-1.5 and LLaVA-NeXT."""

_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653}
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2-VL-2B-Instruct": {"model_type": "qwen2_vl", **_IDS, "tie_word_embeddings": True,
                                  "text_config": _text(1536, 8960, 28, 12, 2, 151936, True, 32768),
                                  "vision_config": _qwen2_vision(1536)},
    "Qwen/Qwen2-VL-7B-Instruct": {"model_type": "qwen2_vl", **_IDS, "tie_word_embeddings": False,
                                  "text_config": _text(3584, 18944, 28, 28, 4, 152064, False, 32768),
                                  "vision_config": _qwen2_vision(3584)},
    "Qwen/Qwen2.5-VL-3B-Instruct": {"model_type": "qwen2_5_vl", **_IDS, "tie_word_embeddings": True,
                                    "text_config": _text(2048, 11008, 36, 16, 2, 151936, True),
                                    "vision_config": _qwen25_vision(2048)},
    "Qwen/Qwen2.5-VL-7B-Instruct": {"model_type": "qwen2_5_vl", **_IDS, "tie_word_embeddings": False,
                                    "text_config": _text(3584, 18944, 28, 28, 4, 152064, False),
                                    "vision_config": _qwen25_vision(3584)},
    "llava-hf/llava-1.5-7b-hf": {
        "model_type": "llava", "image_token_index": 32000, "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "image_seq_length": 576,
        "vision_config": _CLIP_L_336,
        "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}},
    "llava-hf/llava-v1.6-mistral-7b-hf": {
        "model_type": "llava_next", "image_token_index": 32000, "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "image_seq_length": 576,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "vision_config": _CLIP_L_336,
        "text_config": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "vocab_size": 32064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}},
    "google/gemma-3-4b-it": {
        "model_type": "gemma3", "mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
        "image_token_index": 262_144,
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "vocab_size": 262_208, "sliding_window": 1024, "query_pre_attn_scalar": 256,
                        "max_position_embeddings": 131_072},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                          "vision_use_head": False}},
}


def resolve_vlm_config(model: str | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(config dict, display name) for a preset name (case-insensitive, with or without the `Qwen/` owner), a
    config.json path (or its folder) or a config dict."""
    if isinstance(model, Mapping):
        config = dict(model)
        return config, str(config.get("_name_or_path") or config.get("model_type") or "model")
    text = str(model).strip()
    for name, config in PRESETS.items():
        if text.lower() in (name.lower(), name.split("/")[1].lower()):
            return json.loads(json.dumps(config)), name
    path = Path(text).expanduser()
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        try:
            return json.loads(file.read_text(encoding="utf-8")), text
        except (OSError, ValueError) as error:
            raise ModelSourceError(f"cannot read '{file}': {error}") from None
    raise ConfigError(f"unknown VLM '{text}': give a config.json path or one of {', '.join(PRESETS)}")


def tiny_config(model_type: str = "qwen2_vl", *, vocab: int = 1000) -> dict[str, Any]:
    """A two-block tower and two-layer language model of the family, small enough to train for real on a CPU in a
    second: what bench/vlm.py and the tests measure against the trace."""
    text = {**_text(64, 128, 2, 4, 2, vocab, False, 4096),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    if model_type == "qwen2_vl":
        vision = {**_qwen2_vision(64), "depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2}
    elif model_type == "llava":
        return {"model_type": "llava", "image_token_index": vocab - 1, "projector_hidden_act": "gelu",
                "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "image_seq_length": 64,
                "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 112,
                                  "patch_size": 14, "projection_dim": 32},
                "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": vocab, "max_position_embeddings": 4096}}
    elif model_type == "llava_next":  # the 112 px tower's any-res grid: 1 x 2, 2 x 1, 2 x 2, 3 x 1, 1 x 3 tiles
        return {**tiny_config("llava", vocab=vocab), "model_type": "llava_next",
                "image_grid_pinpoints": [[112, 224], [224, 112], [224, 224], [336, 112], [112, 336]]}
    elif model_type == "gemma3":  # SigLIP's 8 x 8 patches pooled 2 x 2 to 16 tokens; one sliding, one full layer
        return {"model_type": "gemma3", "mm_tokens_per_image": 16, "boi_token_index": vocab - 3,
                "eoi_token_index": vocab - 2, "image_token_index": vocab - 1,
                "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": vocab, "sliding_window": 32,
                                "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]},
                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 112,
                                  "patch_size": 14, "vision_use_head": False}}
    elif model_type == "qwen2_5_vl":
        vision = {**_qwen25_vision(64), "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                  "fullatt_block_indexes": [1]}
    else:
        raise ConfigError(f"no tiny config for model_type '{model_type}'")
    ids = {"image_token_id": vocab - 1, "video_token_id": vocab - 2, "vision_start_token_id": vocab - 3,
           "vision_end_token_id": vocab - 4}
    return {"model_type": model_type, **ids, "tie_word_embeddings": False, "text_config": text,
            "vision_config": vision}
