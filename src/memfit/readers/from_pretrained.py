"""A from_pretrained kwargs file (JSON / YAML): the weights' load dtype (which the other files read through
Context.dtype), the attention implementation and the quantization config's base weights (memfit.readers.lora)."""

from __future__ import annotations

from collections.abc import Mapping

from ..setup import Attention, Precision
from . import lora
from ._mapper import LOADING, Context, finish
from ._reader import NOT_RELEVANT, Reader

FROM_PRETRAINED_TABLE = {"use_cache": f"{NOT_RELEVANT} (training keeps no K/V cache)",
                         "quantization_config.": f"{NOT_RELEVANT} (quantization details that keep the layout)",
                         "device_map": LOADING, "low_cpu_mem_usage": LOADING}
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16", "float32": "fp32", "fp32": "fp32",
           "torch.float32": "fp32", "float16": "fp16", "fp16": "fp16", "torch.float16": "fp16"}


def load_dtype(data: Mapping) -> tuple[str, str] | None:
    """(dtype, key) of a from_pretrained kwargs file: 'bf16', 'fp32', 'fp16' or 'auto'."""
    for key in ("dtype", "torch_dtype"):
        if key in data and data[key] is not None:
            text = str(data[key]).lower()
            return _DTYPES.get(text, text), key
    return None


def map_from_pretrained(read: Reader, data: dict, ctx: Context) -> None:
    found = load_dtype(data)
    if found is not None:
        dtype, key = found
        if dtype == "bf16":
            read.set("precision", Precision.BF16, key, data[key], "bf16 weights (a training file's precision settings "
                                                                  "take precedence)", weak=True)
        elif dtype == "fp32":
            read.set("precision", Precision.FP32, key, data[key], "fp32 weights", weak=True)
        elif dtype == "auto":
            read.ignore(key, data[key], "'auto' loads the checkpoint's own dtype, which this file does not say: give "
                                        "--precision")
        else:
            read.unmappable("precision", key, data[key], "memfit sizes models loaded in bfloat16 or float32")
    attn = data.get("attn_implementation")
    if attn is not None:
        text = str(attn).lower()
        if text == "eager":
            read.set("attention", Attention.EAGER, "attn_implementation", attn)
        elif text in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            read.set("attention", Attention.SDPA, "attn_implementation", attn)
        else:
            read.unmappable("attention", "attn_implementation", attn, "memfit sizes eager, sdpa and flash_attention_2")
    if data.get("quantization_config") is not None:
        read.base_hint = lora.quantized_base(read, data["quantization_config"], "quantization_config")
    finish(read, data, FROM_PRETRAINED_TABLE)
