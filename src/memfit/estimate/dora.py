"""DoRA (weight-decomposed LoRA, Liu et al. 2024, arXiv:2402.09353; peft `use_dora=True`): what peft 0.21 keeps
beyond LoRA, read off peft/tuners/lora/dora.py (DoraLinearLayer) and variants.py (DoraLinearVariant.forward):

- parameters: one trainable magnitude vector per adapted Linear, `out_features` elements (`lora_magnitude_vector`,
  initialised to the weight's row norms; fp32 like the other adapters: get_peft_model casts every adapter layer);
- saved for backward, per adapted Linear and token: `result_dora = (m / ||W + s BA|| - 1) * base_result +
  (m / ||W + s BA||) * lora_B(lora_A(x)) * s` makes both products keep their B x T x out operand for the
  magnitude's gradient: the base output (its dtype) and lora_B's output (the adapters' dtype, bf16 under autocast).
  The norm is detached (the paper's sec. 4.3, as peft does), so nothing of the weight reaches backward;
- a transient in every forward (DoraLinearLayer.forward): `get_lora_weight` multiplies an in x in identity through
  lora_A and lora_B (x_eye, its in x r image and the in x out product, whose graph lives until the layer returns),
  `get_weight_norm` adds `scaling * lora_weight` to the weight (two out x in tensors) before the row norm. Under
  autocast the identity is cast to bf16 for lora_A, the product comes back bf16 and is cast to x's fp32
  (`lora_weight.to(x.dtype)`), and a 16-bit base weight is cast to fp32 too (`weight.to(x.dtype)`).
"""

from __future__ import annotations

from ..graph import LoraLinear, linears_of
from ..model_spec import ModelSpec, ParamTensor
from ..setup import TrainingSetup
from .terms import TermKey

SOURCE = "peft tuners/lora/dora.py DoraLinearLayer.forward / get_weight_norm / get_lora_weight (peft 0.21)"
MAGNITUDE = "lora_magnitude_vector"


def magnitude_tensors(trainable: list[ParamTensor], rank: int) -> list[ParamTensor]:
    """One fp32 magnitude vector per adapted Linear: out_features (lora_B is out x r) elements."""
    out = []
    for t in trainable:
        if ".lora_B." in t.name:
            numel = t.numel // rank
            out.append(ParamTensor(t.name.replace(".lora_B.", f".{MAGNITUDE}."), numel, t.count, 4 * numel))
    return out


def saved_rows(roles: dict[str, list[LoraLinear]], group_of_role: dict[str, str], low: str,
               quantized: bool = False) -> list:
    """Per adapted Linear: the base output and lora_B's output, each B x T x out, kept by DoRA's two products.
    `low`: the adapters' compute dtype class ('f32', or 'c16' under autocast / FSDP2's bf16 adapters). A
    bitsandbytes base returns its input's dtype (Linear4bit.forward: `.to(inp_dtype)`), so q/k/v's base output is
    in the (fp32, after prepare_model_for_kbit_training) residual dtype."""
    from .activations import Saved

    rows = []
    for role, linears in roles.items():
        base_dtype = "res" if quantized and role == "qkv" else "cmp"
        for node in linears:
            rows.append(Saved(group_of_role[role], node.out_features, base_dtype))  # base_result
            rows.append(Saved(group_of_role[role], node.out_features, low))  # lora_B(lora_A(x))
    return rows


def linear_transient_bytes(n_in: int, n_out: int, rank: int, *, autocast: bool, base_bytes: int) -> int:
    """One DoRA Linear's forward transient, the larger of its two moments:
    get_lora_weight (x_eye, under autocast its bf16 cast kept by lora_A, lora_A's in x r and lora_B's in x out
    outputs) and get_weight_norm (what lora_A / lora_B keep, the product (fp32: cast to x's dtype under autocast),
    the base cast to fp32 (a 16-bit base under autocast), scaling * lora_weight and the sum, out x in fp32 each)."""
    if not autocast:
        return n_in * n_in * 4 + n_in * rank * 4 + n_in * n_out * 4 + 2 * n_out * n_in * 4
    kept = n_in * n_in * 2 + n_in * rank * 2  # lora_A's bf16 cast of x_eye, lora_B's bf16 input
    lora_weight = n_in * n_in * 4 + kept + n_in * n_out * 2  # x_eye fp32 still alive, lora_B's bf16 output
    base_cast = n_out * n_in * 4 if base_bytes != 4 else 0
    weight_norm = kept + n_in * n_out * 4 + base_cast + 2 * n_out * n_in * 4
    return max(lora_weight, weight_norm)


def weight_norm_transient_bytes(spec: ModelSpec, setup: TrainingSetup, autocast: bool, base_bytes: int) -> int:
    """The largest adapted Linear's forward transient (linear_transient_bytes)."""
    return max((linear_transient_bytes(node.in_features, node.out_features, node.rank, autocast=autocast,
                                       base_bytes=base_bytes)
                for _, node in spec.graph.linears() if isinstance(node, LoraLinear)), default=0)


def autocast_copies(spec: ModelSpec, setup: TrainingSetup) -> int:
    """With dropout DoRA computes the base output again, `F.linear(dropout(x), weight.to(x.dtype))`: under autocast
    that matmul casts the (non-leaf or frozen) weight to bf16 afresh and keeps the cast for x's gradient, 2 B per
    adapted base weight (DoraLinearVariant.forward: base_result = None when dropout is not an Identity)."""
    ft = setup.finetune
    if not ft.dora or ft.dropout == 0 or not setup.precision.is_autocast or spec.graph is None:
        return 0
    total = 0
    for stack in spec.graph.stacks:
        total += stack.count * sum(node.base.weight_numel for _, node in linears_of(stack.block, stack.name)
                                   if isinstance(node, LoraLinear))
    return 2 * total


def forward_moment(step, forward: list) -> list:
    """The last adapted Linear's forward: every activation but the head's and the loss's, plus the norm's
    transient."""
    from .result import Category, Term

    setup = step.setup
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    transient = weight_norm_transient_bytes(step.spec, setup, step.dtypes.autocast, 4 if base.value == "fp32" else 2)
    head_and_loss = (TermKey.LOGITS, TermKey.LOSS, TermKey.HEAD, TermKey.LOGIT_SOFTCAP)
    return [t for t in forward if t.name not in head_and_loss] + [Term(
        TermKey.DORA_WEIGHT_NORM, Category.TEMPORARIES, transient,
        "in x in identity through lora_A, lora_B (in x r, in x out) + W + s BA and s BA (2 x out x in, fp32): "
        "the largest adapted Linear's weight norm", SOURCE)]



def recompute_locals_bytes(node: LoraLinear, tokens: int, *, autocast: bool, base_bytes: int,
                           base_out_bytes: int, on_cpu: bool) -> int:
    """What one DoRA Linear's forward holds when it computes `result_dora` (DoraLinearLayer.forward), alive on top
    of a checkpointed block's recompute: get_lora_weight's graph (lora_A keeps x_eye, in x in, in bf16 under
    autocast; lora_B keeps lora_A's in x r output), its in x out product in x's fp32 (`lora_weight.to(x.dtype)`),
    the 16-bit base weight cast to fp32 (`weight.to(x.dtype)`), and the B x T x out
    fp32 product `(m / ||W + s BA|| - 1) * base_result`, on CPU with the fp32 copy of a 16-bit base_result the
    mixed-dtype multiply makes there (TensorIterator promotion; `base_out_bytes`: base_result's element size, the
    compute dtype's, or a bitsandbytes base's input dtype). Measured on CPU: bench/lora_checkpoint.py."""
    n_in, n_out, rank = node.in_features, node.out_features, node.rank
    low = 2 if autocast else 4
    # x_eye (its bf16 cast under autocast) kept by lora_A, lora_A's output kept by lora_B, the product in fp32 (under
    # autocast the bf16 product is gone once cast)
    lora_weight = n_in * n_in * low + n_in * rank * low + n_in * n_out * 4
    base_cast = n_out * n_in * 4 if base_bytes != 4 else 0
    return lora_weight + base_cast + (2 if on_cpu and base_out_bytes != 4 else 1) * tokens * n_out * 4
