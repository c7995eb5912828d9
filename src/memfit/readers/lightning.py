"""Lightning's `precision=` (Trainer, Fabric, and the recipes built on Fabric such as LitGPT's) -> memfit's Precision.

What each plugin does to the step (lightning 2.6.6, lightning/fabric/connector.py `_check_and_init_precision` and
lightning/fabric/plugins/precision/*.py; the Trainer's plugins in lightning/pytorch/plugins/precision/ are the same
classes):

- "32-true" (and the legacy 32 / "32"): `Precision`, which changes nothing: the module keeps the dtype it was built
  in (fp32 unless the user built it otherwise), AdamW's states follow the parameters.
- "bf16-true" / "16-true": `HalfPrecision.convert_module` is `module.to(dtype)`, and `init_module()` builds the
  module in that dtype (`_DtypeContextManager`). The optimizer is made on the converted parameters, so torch's
  AdamW `zeros_like(param)` states are 16-bit too: every weight, gradient and state in bf16 is memfit's pure bf16
  (Precision.BF16), not bf16 with fp32 master weights. 16-true is the same step in fp16 with no loss scaling;
  memfit has no pure-fp16 precision and refuses it.
- "bf16-mixed" / "16-mixed" (legacy "bf16" / 16 / "16"): `MixedPrecision`: `torch.autocast` around the forward,
  fp32 parameters, gradients and states; 16-mixed adds a `torch.amp.GradScaler` (its scale and growth tracker are
  two scalars). On the CPU accelerator Lightning turns 16-mixed into bf16-mixed.
- "transformer-engine" / "transformer-engine-float16": `TransformerEnginePrecision` swaps every nn.Linear and
  LayerNorm for NVIDIA Transformer Engine's modules and runs them in FP8 with delayed scaling (its amax history
  and scales per module, its own workspaces). It needs CUDA and Transformer Engine, and memfit does not size it.
- "64-true": `DoublePrecision`, fp64 everything: not sized.

Checked on real CPU Fabric steps of a tiny Llama (tests/engines/test_lightning_precision.py): the profiler's peak of
each plugin's step is memfit's formula for the precision named here within 0.5%.
"""

from __future__ import annotations

from typing import Any

from ..setup import Precision
from ._reader import Reader

LEGACY = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's _PRECISION_INPUT_STR_ALIAS_CONVERSION: the old spellings (and the ints 64 / 32 / 16)."""

SIZED = {"32-true": Precision.FP32, "bf16-true": Precision.BF16, "bf16-mixed": Precision.AMP_BF16,
         "16-mixed": Precision.AMP_FP16}
"""Lightning precision -> memfit precision, for a module built in fp32 (Lightning's '32-true' keeps the module's own
dtype: a bf16-built module under '32-true' trains in pure bf16)."""

NOTES = {"32-true": "Lightning leaves the module's dtype as built",
         "bf16-true": "HalfPrecision: module.to(bfloat16); AdamW states bf16 too",
         "bf16-mixed": "MixedPrecision: autocast(bfloat16) over fp32 weights",
         "16-mixed": "MixedPrecision: autocast(float16) + GradScaler over fp32 weights"}

REFUSED = {
    "16-true": "16-true trains fp16 weights, gradients and AdamW states with no loss scaling, which memfit does not "
               "size: use bf16-true (the same bytes) or 16-mixed",
    "64-true": "64-true (fp64 everything) is not sized by memfit: use 32-true, bf16-true, bf16-mixed or 16-mixed",
    "transformer-engine": "transformer-engine swaps the Linears and LayerNorms for NVIDIA Transformer Engine's FP8 "
                          "modules (CUDA only, their own scaling state): memfit does not size it; use bf16-true or "
                          "bf16-mixed",
    "transformer-engine-float16": "transformer-engine-float16 swaps the Linears and LayerNorms for NVIDIA Transformer "
                                  "Engine's FP8 modules (CUDA only): memfit does not size it; use 16-mixed",
}


def canonical(raw: Any) -> str:
    """Lightning's own spelling of a precision value (its legacy aliases and ints resolved); '' when none."""
    if raw is None:
        return ""
    text = str(raw).strip().lower()
    return LEGACY.get(text, text)


def lightning_precision(raw: Any, module_dtype: str = "") -> Precision | str:
    """The memfit Precision Lightning's `precision=raw` trains in, or the one-line reason it is not sized.
    `module_dtype`: the dtype the module was built in ('' unknown: fp32, Lightning's default), which only
    '32-true' keeps."""
    text = canonical(raw)
    if text == "32-true" and module_dtype == "bf16":
        return Precision.BF16
    if text in SIZED:
        return SIZED[text]
    return REFUSED.get(text, f"not a Lightning precision: it takes {', '.join([*SIZED, *REFUSED])}")


def read_lightning_precision(read: Reader, raw: Any, key: str, module_dtype: str = "", note: str = "") -> None:
    """Set the precision Lightning's `key` (= raw) trains in; a value memfit does not size is unmappable (a one-line
    ConfigError when the reader is strict)."""
    found = lightning_precision(raw, module_dtype)
    if not isinstance(found, Precision):  # (a Precision is a str too)
        read.unmappable("precision", key, raw, found, fallback="precision not read")
        return
    text = canonical(raw)
    why = NOTES[text] if not (text == "32-true" and found is Precision.BF16) else "the module was built in bf16"
    read.set("precision", found, key, raw, "; ".join(filter(None, [why, note])))
