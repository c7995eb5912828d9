"""torchao float8 training (Float8Linear, torchao 0.18 `torchao/float8/`), per rank: what it changes in memory.

torchtitan converts every nn.Linear but the LM head (`filter_fqns=["output"]`) whose dimensions are multiples of 16
(memfit._torch.float8.convertible). What each converted Linear of in_features a, out_features b does, with N tokens
(read off the source; the CPU figures checked on measured steps, bench/float8.py):

- saved for backward (float8_linear.py `matmul_with_hp_or_float8_args.forward`: `ctx.save_for_backward(input_hp,
  weight_hp_t)`): the HIGH-precision input and weight, exactly what F.linear keeps, so eager float8 saves no
  activation memory. The weight is a view of the parameter (or, under FSDP2, of its unsharded copy): no bytes.
- under autocast, `Float8Linear.forward` casts the input itself (`input.to(autocast_dtype)`) and passes the fp32
  parameter: autocast's cached bf16 weight cast is never made, so `activations/autocast_weight_copies` loses
  2 B x the converted weights. On CPU `torch.is_autocast_enabled()` (CUDA's flag) is False under CPU autocast, so
  the input is not cast at all: every Linear reading one fp32 tensor saves that shared tensor (4 B) instead of its
  own bf16 copy (2 B each) - a CPU-only difference (`Dtypes.float8_hp_input`).
- the casts (float8_scaling_utils.py `hp_tensor_to_float8_dynamic` -> float8_utils.py `tensor_to_amax`
  `max(abs(x))`, float8_training_tensor.py `_ToFloat8ConstrFunc.forward` `x.to(float32) * scale`, then
  `to_fp8_saturated` `clamp` and `.to(fp8)`): an eager cast of n elements peaks at 9n bytes (two fp32 tensors and
  the result) and leaves n bytes of float8. Backward casts grad_output twice (one per gemm, dim0 and dim1), the
  weight and the input once each. torch.compile fuses each cast into one kernel: only the 1-byte results remain.
- rowwise: the backward gemms run without fast accumulation and so rescale their output in place by an fp32
  outer product of the scales (`ROWWISE_SCALE_BYTES`).
- the gemms: CUDA `torch._scaled_mm` (cuBLASLt) allocates only its output; CPU's fallback makes fp32 copies of
  both operands and of the product, then casts the product (`cpu_gemm_bytes`).
- FSDP2 with `enable_fsdp_float8_all_gather` (fsdp_utils.py `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`
  casts the shard; `fsdp_post_all_gather` wraps the gathered bytes as a Float8TrainingTensor): the converted
  weights are all-gathered and held unsharded in 1 B per element instead of 2 (plus one fp32 scale each), and the
  matmul uses them as they are (`tensor_already_casted_to_fp8`): no weight casts in forward or backward.
- `force_recompute_fp8_weight_in_bwd` is deprecated and does nothing in torchao 0.18 (config.py): memfit ignores it.

The transient beyond a bf16 Linear's own backward peak (its grad_input 2Na and grad_weight 2ab) is the largest,
over the converted Linears of a block, of the backward's steps (`backward_extra_bytes`); it is added to every
block-backward moment. memfit's trace (fake tensors: `_scaled_mm`'s meta function allocates only the output, as
cuBLASLt does) is the CUDA side's check (bench/float8.py): the additive term is 1.6-3.8% above it on the tiny
models whose block backward sets the peak, as the float8 moment holds fewer of the bf16 block's temporaries.
Not sized: the forward's casts (a forward-end moment is rarely the peak), compile's partitioner saving a float8
cast instead of the high-precision tensor, torchtitan's float8 tensor parallelism (its float8 all-gather of the
sequence-parallel input).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_spec import ModelSpec
from ..choices import Float8
from ..setup import TrainingSetup
from .result import Category, Term
from .moments import AddBeside
from .terms import TermKey

SOURCE = ("torchao 0.18 float8/float8_linear.py matmul_with_hp_or_float8_args, float8_scaling_utils.py "
          "hp_tensor_to_float8_dynamic")
CPU_GEMM_SOURCE = "ATen CPU torch._scaled_mm fallback (fp32 copies of both operands and the product), measured"
FSDP_SOURCE = "torchao 0.18 float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre/post_all_gather"
HEAD_NAMES = ("lm_head", "output", "embed_out")
CAST_PEAK = 9
"""Bytes per element at an eager cast's peak: `x.to(float32) * scale` is still referenced while its clamp (fp32)
is cast to float8 (two fp32 tensors and the 1-byte result; measured with the profiler, tests/estimate/test_float8.py)."""


@dataclass(frozen=True)
class Shape:
    """One converted Linear on this rank: `a` in, `b` out features (tensor-parallel shards applied)."""

    a: int
    b: int


def applies(setup: TrainingSetup) -> bool:
    return setup.float8.is_on


def block_linears(spec: ModelSpec) -> tuple[Shape, ...]:
    """The converted Linears of one block (every nn.Linear of the layer stack; GPT-2's Conv1D is none)."""
    if spec.graph is None:
        return ()
    shapes = []
    for path, node in spec.graph.linears():
        if ".*." not in path or path.split(".")[-1] in HEAD_NAMES or getattr(node, "conv1d", True):
            continue
        a, b = node.in_features, node.out_features
        if a % 16 or b % 16:  # torch._scaled_mm needs both multiples of 16: torchtitan leaves them in bf16
            continue
        shard = node.shard
        if shard is not None:
            a, b = (a // shard.degree, b) if shard.style == "row" else (a, b // shard.degree)
        shapes.append(Shape(a, b))
    return tuple(shapes)


def converted_weight_elems(spec: ModelSpec, setup: TrainingSetup | None) -> int:
    """Weight elements of every converted Linear on this rank (0 without float8)."""
    if setup is None or not applies(setup):
        return 0
    return spec.num_layers * sum(s.a * s.b for s in block_linears(spec))


def _cuda_steps(n: int, s: Shape, weight_cast: bool, compiled: bool) -> list[int]:
    """Bytes beyond a bf16 Linear's backward peak (2Na + 2ab) at each step of the backward: cast grad_output
    (dim0), cast the weight, the grad_input gemm, cast grad_output again (dim1), cast the input, the grad_weight
    gemm. float8_ops.py `float8_mm` makes its first operand row-major and its second column-major (1-byte copies):
    the weight's for grad_input, grad_output's and the input's for grad_weight."""
    a, b = s.a, s.b
    cast = 1 if compiled else CAST_PEAK  # a fused cast leaves only its float8 result
    w8 = a * b if weight_cast else 0
    base = 2 * n * a + 2 * a * b
    return [cast * n * b - base,
            n * b + (cast * a * b if weight_cast else 0) - base,
            n * b + 2 * a * b + 2 * n * a - base,
            2 * n * a + n * b + w8 + cast * n * b - base,
            2 * n * a + 2 * n * b + w8 + cast * n * a - base,
            2 * n * a + 3 * n * b + w8 + 2 * n * a + 2 * a * b - base]


def cpu_gemm_bytes(m: int, k: int, n: int) -> int:
    """CPU torch._scaled_mm of an m x k by a k x n float8 matrix, beyond its m x n bf16 output: a 1-byte copy of
    the second operand, then fp32 copies of each operand (`.to(float32)` and its product with the scale, alive
    together), of the product and its cast (ATen's CPU fallback; measured with the profiler on CPU, each of the
    three moments on shapes where it dominates: tests/estimate/test_float8.py). CUDA's cuBLASLt kernel allocates only its
    output."""
    return max(8 * m * k + k * n, 4 * m * k + 9 * k * n, 4 * m * k + 5 * k * n + 6 * m * n)


def _cpu_gemm_steps(n: int, s: Shape) -> list[int]:
    """The two backward gemms on CPU (the float8 tensors and layout copies of `_cuda_steps` plus the emulated
    kernel's own bytes), beyond the bf16 Linear's peak (2Na + 2ab)."""
    a, b = s.a, s.b
    grad_input = n * b + 2 * a * b + 2 * n * a + cpu_gemm_bytes(n, b, a) - (2 * n * a + 2 * a * b)
    grad_weight = 3 * n * b + a * b + 2 * n * a + cpu_gemm_bytes(b, n, a)
    return [grad_input, grad_weight]


ROWWISE_SCALE_BYTES = 4
"""Rowwise: float8_ops.py `addmm_float8_unwrapped` runs a gemm without fast accumulation (grad_input's and
grad_weight's, Float8GemmConfig() default) as a tensorwise one and multiplies the output in place by
`a_inverse_scale * b_inverse_scale`, an fp32 tensor of the output's shape (4 B per output element)."""


def _rowwise_steps(n: int, s: Shape, steps: list[int]) -> list[int]:
    """The rowwise recipe's outer-product scale beside each backward gemm's output (steps 3 and 6 and, on CPU,
    the two emulated gemms after them)."""
    extra = [0, 0, ROWWISE_SCALE_BYTES * n * s.a, 0, 0, ROWWISE_SCALE_BYTES * s.a * s.b]
    extra += [ROWWISE_SCALE_BYTES * n * s.a, ROWWISE_SCALE_BYTES * s.a * s.b][:len(steps) - len(extra)]
    return [step + more for step, more in zip(steps, extra)]


def backward_extra_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, on_cpu: bool) -> int:
    """The largest transient of one converted Linear's float8 backward beyond its bf16 backward's, over a block."""
    if not applies(setup):
        return 0
    compiled = setup.compile and not on_cpu
    weight_cast = not setup.float8_all_gather
    best = 0
    for shape in block_linears(spec):
        steps = _cuda_steps(tokens, shape, weight_cast, compiled)
        if on_cpu:
            steps += _cpu_gemm_steps(tokens, shape)
        if setup.float8 is Float8.ROWWISE:
            steps = _rowwise_steps(tokens, shape, steps)
        best = max(best, *steps)
    return best


def backward_term(spec: ModelSpec, setup: TrainingSetup, tokens: int, on_cpu: bool) -> Term:
    how = ("CPU: eager casts (9 B per element at their peak) and the emulated _scaled_mm's fp32 copies"
           if on_cpu else "fused casts (1 B results)" if setup.compile else "eager casts (8 B per element at "
           "their peak) and their float8 results")
    return Term(TermKey.FLOAT8_BACKWARD, Category.TEMPORARIES,
                backward_extra_bytes(spec, setup, tokens, on_cpu),
                f"the largest converted Linear's float8 backward beyond a bf16 one's: {how}",
                SOURCE + ("; " + CPU_GEMM_SOURCE if on_cpu else ""))


def step_changes(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool) -> list[AddBeside]:
    """Every block-backward moment gains the float8 backward's transient."""
    if not applies(setup):
        return []
    return [AddBeside(backward_term(spec, setup, setup.tokens_per_micro_step, on_cpu), TermKey.LAYER_BACKWARD)]


def gathered_saving_per_block(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> int:
    """Bytes one gathered block saves when FSDP2 all-gathers its converted weights in float8 (1 B, not
    `compute_bytes`); the fp32 scales (4 B per Linear) are left out."""
    if not (applies(setup) and setup.float8_all_gather):
        return 0
    return (compute_bytes - 1) * sum(s.a * s.b for s in block_linears(spec))


def all_gather_collectives(spec: ModelSpec, setup: TrainingSetup, collectives: list) -> list:
    """FSDP2's parameter all-gathers with the converted weights in float8: each splits into its float8 part (1 B
    per element; the scales, one fp32 per Linear, are left out) and the rest."""
    from .comm import ALL_GATHER, Collective

    fp8 = converted_weight_elems(spec, setup) if setup.float8_all_gather else 0
    if not fp8:
        return collectives
    out = []
    for c in collectives:
        if c.name != ALL_GATHER or not c.what.startswith("parameters"):
            out.append(c)
            continue
        out.append(Collective(c.name, c.what + " (all but the float8 Linears' weights)", c.num_elements - fp8,
                              c.dtype_bytes, c.calls_per_step, c.group))
        out.append(Collective(c.name, c.what.replace("parameters", "float8 Linear weights, in float8", 1), fp8, 1,
                              c.calls_per_step, c.group))
    return out


def notes(spec: ModelSpec, setup: TrainingSetup) -> tuple[str, ...]:
    if not applies(setup):
        return ()
    count = len(block_linears(spec))
    text = (f"float8 {setup.float8}: {count} Linears per block in torchao Float8Linear (the LM head stays bf16); "
            "they keep their high-precision input and weight for backward, as a bf16 Linear does")
    if setup.precision.is_autocast:
        text += "; autocast caches no bf16 copy of their weights"
    if setup.float8_all_gather:
        text += "; FSDP2 all-gathers their weights in float8 (1 B per element)"
    return (text,)
