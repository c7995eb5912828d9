"""A bitsandbytes 4-bit Linear as fake tensors can run it (memfit.trace): the same storage (the packed weight and
its QuantState tensors, sized as bitsandbytes allocates them: memfit.estimate.lora.quantized_weight_bytes) and the
same memory behaviour as Linear4bit / MatMul4Bit (the input cast to the compute dtype, the whole weight dequantized
into the compute dtype for the matmul and again in backward, nothing saved per token, the output cast back to the
input's dtype). The values are not computed: fake tensors have none."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..estimate.lora import BNB_4BIT_BLOCK, BNB_4BIT_CODE, BNB_NESTED_BLOCK, BNB_NESTED_CODE


class _Matmul4bit(torch.autograd.Function):
    """y = x W^T with W dequantized on the fly, as bitsandbytes MatMul4Bit: forward and backward each make one
    compute-dtype copy of the weight, freed after its matmul; only the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, packed, out_features: int, in_features: int):
        weight = torch.empty(out_features, in_features, dtype=x.dtype, device=x.device)  # dequantize_4bit
        ctx.save_for_backward(packed)
        ctx.shape = (out_features, in_features)
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        weight = torch.empty(*ctx.shape, dtype=grad.dtype, device=grad.device)  # dequantized again
        return grad @ weight, None, None, None


class FakeLinear4bit(nn.Module):
    """Stands in for bitsandbytes.nn.Linear4bit on fake tensors (the quantization kernels need real values)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, compute_dtype: torch.dtype,
                 double_quant: bool, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        numel = in_features * out_features
        blocks = math.ceil(numel / BNB_4BIT_BLOCK)
        self.weight = nn.Parameter(torch.empty(math.ceil(numel / 2), 1, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        quant_state = {"code": torch.empty(BNB_4BIT_CODE, dtype=torch.float32, device=device)}
        if double_quant:
            quant_state.update(absmax=torch.empty(blocks, dtype=torch.uint8, device=device),
                               nested_absmax=torch.empty(math.ceil(blocks / BNB_NESTED_BLOCK), device=device),
                               nested_code=torch.empty(BNB_NESTED_CODE, device=device),
                               offset=torch.empty(1, device=device))
        else:
            quant_state["absmax"] = torch.empty(blocks, dtype=torch.float32, device=device)
        for name, tensor in quant_state.items():
            self.register_buffer(f"quant_{name}", tensor, persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device),
                                 requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        out = _Matmul4bit.apply(x.to(self.compute_dtype), self.weight, self.out_features, self.in_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(input_dtype)
