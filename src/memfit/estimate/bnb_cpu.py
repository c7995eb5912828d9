"""bitsandbytes' optimizer step on a CPU device: the fp32 scratch its Python kernels allocate per parameter.

bitsandbytes >= 0.48 steps CPU parameters through `torch.ops.bitsandbytes.optimizer_update_8bit_blockwise` /
`optimizer_update_32bit`, custom ops whose CPU kernels are Python (bitsandbytes/backends/cpu/ops.py,
`_optimizer_update_8bit_blockwise_cpu` and `_optimizer_update_32bit_cpu`). Their tensors are allocated below the
dispatcher entry of the op, so a TorchDispatchMode sees the op and none of them; the profiler sees them all. CUDA
runs one fused kernel per parameter with no scratch tensors (backends/cuda/ops.py), so this is for a CPU device only.

Adam / AdamW, 8-bit blockwise state, one parameter of n elements (locals stay alive until the kernel returns):
  state1_fp32, state2_fp32 = dequantize_blockwise(...)   2 x 4n
  grad = g.float() * gnorm_scale                          4n   (+ 4n for g.float() itself while the product is made,
                                                                 when g is 16-bit: a no-op view for fp32)
  p_fp32 = p.data.float()                                 4n when p is 16-bit (fp32: the parameter itself)
  denom = (state2_fp32.sqrt() / correction2).add_(eps)    sqrt 4n alive while the quotient 4n is made
  -> peak 5 x 4n = 20n (fp32 parameter), 6 x 4n = 24n (16-bit parameter); re-quantising afterwards adds n + absmax
     on top of 4 x 4n (or 5 x 4n), below that peak.
Adam / AdamW, 32-bit state (parameters below min_8bit_size elements):
  g_float 4n, p_float (16-bit only) 4n, then update = state1 / (state2.sqrt() + eps * c2): at most two 4n alive
  -> peak 12n (fp32), 16n (16-bit).
Checked against profiler memory events of one bitsandbytes 0.50 AdamW8bit step on CPU: 20.0 / 24.0 bytes per element
(8-bit, fp32 / bf16) and 12.0 / 16.0 (32-bit), plus a few bytes of scalars.
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from ..setup import Offload, Optimizer, TrainingSetup
from .static import param_elem_bytes

MIN_8BIT_SIZE = 4096
"""bitsandbytes Optimizer2State(min_8bit_size=4096): smaller parameters keep fp32 state (the 32-bit kernel)."""

ADAM_8BIT = (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)


def adam_step_scratch_bytes(numel: int, param_elem_bytes: int, eight_bit: bool) -> int:
    """Peak scratch of one parameter's Adam step in bitsandbytes' CPU kernel (the derivation is in the module doc)."""
    fp32_copies = 5 if eight_bit else 3
    if param_elem_bytes < 4:  # g.float() (8-bit: alive beside the product) / p.data.float() are real copies
        fp32_copies += 1
    return fp32_copies * 4 * numel


def step_scratch_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The largest per-parameter scratch of a bitsandbytes 8-bit AdamW step on a CPU device (0 for every other
    optimizer): parameters step one at a time, so only the largest counts."""
    if setup.optimizer not in ADAM_8BIT or setup.offload is not Offload.NONE:
        return 0
    elem = 4 if setup.precision.master_weights else param_elem_bytes(setup.precision)  # what the step updates
    return max((adam_step_scratch_bytes(p.numel, elem, p.numel >= MIN_8BIT_SIZE) for p in spec.params), default=0)
