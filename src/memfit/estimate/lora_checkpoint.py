"""Checkpointed LoRA steps: what a block's recompute and its MLP's backward hold beyond the block's saved tensors,
for the Llama family's gated RMSNorm block (checkpointed_moments) and for a block with a plain (ungated) MLP and
LayerNorms (GPT-2's pre-norm block, BERT's post-norm one: ungated_moments).

The LayerNorm block, read on allocation timelines of real checkpointed peft steps (torch.profiler memory events, each allocation named
by its module and autograd node; tiny GPT-2 and BERT of tests/tiny_configs.py, bench/lora_checkpoint.py prints
them):

- the recompute (torch.utils.checkpoint, non-reentrant) starts at the block's first backward node that needs a
  saved tensor (the residual dropout's mask, or a post-norm block's last LayerNorm) with only the incoming
  residual gradient allocated, and keeps one more CPU RNG state while it runs;
- inside the adapted down projection's forward (peft lora.Linear.forward) the forward's locals are alive: the
  attention branch's output (a pre-norm block keeps `attn_output` beside the residual sum), the MLP input, the
  activation's output (the down projection's input), base_layer(x), peft's fp32 cast of x and, under autocast,
  the dropout output whose bf16 cast lora_A saves;
- LayerNorm saves its input as it is, so a pre-norm block's first norm keeps the checkpoint itself, not a copy;
- the MLP's backward peaks at the down projection's input gradient: the residual gradient, three B x T x I
  tensors in the MLP's dtype (the activation-output gradient and the activation's two products, or with an
  adapted down projection the base and adapter input gradients and their sum), with the residual dropout's mask and
  the down projection's own saved tensors gone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..graph import MLP, Dropout, Norm
from ..setup import Attention
# estimate.lora, activations and forward_terms import this module (directly or through lora): as modules, read at
# call time, they need no import inside a function
from . import activations as act
from . import derived as derive
from . import dora, forward_terms
from . import lora as _lora
from .result import Category, Phase, Term

SOURCE = "torch.utils.checkpoint recompute, peft lora.Linear.forward, autograd of a plain MLP"


# --- checkpointed LoRA steps: what a block's recompute and its frozen MLP's backward hold ---------------------------
# Measured on allocation timelines of real checkpointed peft steps (profiler memory events, module-labelled):
# - torch.utils.checkpoint (non-reentrant, preserve_rng_state=True) keeps the CPU generator state per layer until
#   that layer's backward (torch.get_rng_state(): the mt19937 state, 5,056 bytes) and takes one more in each
#   recompute; it lives on the device only when the device is the CPU.
# - the recompute stops early (_StopRecomputationError once the last saved tensor is packed), so the Python locals
#   of the decoder layer, its MLP and peft's lora.Linear.forward are still alive at that moment: the residual sum,
#   the MLP input, down_proj's input, base_layer(x), peft's fp32 cast of x, the dropout output;
# - a frozen gated MLP's backward holds the product's gradient and both factors' (3 x B x T x I) with the
#   residual gradient, all of the block's saved tensors still alive;
# - with an fp32 residual stream the first RMSNorm's x.to(float32) is x itself: the checkpoint, not a new tensor;
# - peft's enable_input_require_grads makes the embedding output a leaf that autograd keeps to the end of backward.

def checkpointed_moments(step, moments: dict) -> dict:
    """The backward moments of a checkpointed LoRA step of a gated-MLP decoder (the Llama family's recipe):
    the last block's recompute (R) and frozen-MLP backward (B), and the same for block 0 once every other
    block's adapters have their gradients; the loss backward with the RNG states. A LayerNorm block with a plain
    MLP: ungated_moments; other blocks keep the generic moments with the embedding leaf."""

    if not act.rms_gated_layer(step.spec):
        return _other_block_moments(step, moments)
    sizes = _GatedSizes.of(step)
    return _gated_moments(step, moments, sizes)


def _other_block_moments(step, moments: dict) -> dict:
    """GPT-2 / BERT and the derived families: the generic moments with the embedding leaf (and GPT-2 / BERT's
    recompute and plain-MLP backward, a derived family's block-0 checkpoint)."""

    spec, d = step.spec, step.dtypes
    if not step.setup.finetune.asks_input_gradient():  # torchtune asks no input gradient: no embedding leaf
        return {}
    # GPT-2 / BERT: the token embedding is followed by adds, so the leaf peft's enable_input_require_grads
    # makes is a tensor of its own, kept to the end of backward
    leaf = Term("activations/embedding_leaf", Category.ACTIVATIONS, embedding_leaf_bytes(step),
                "the embedding output, a leaf autograd keeps to the end (peft enable_input_require_grads)",
                "torch autograd AccumulateGrad")
    with_leaf = {name: (phase, list(terms) + ([leaf] if leaf.num_bytes else [])) for name, (phase, terms)
                 in moments.items() if phase is Phase.BACKWARD and terms}
    if layer_norm_block(spec):  # GPT-2 / BERT: their recompute and plain-MLP backward
        rng = forward_terms.CPU_RNG_STATE_BYTES if d.on_cpu else 0
        with_leaf.update(ungated_moments(step, with_leaf, _lora.adapted_roles, rng))
    if _lora.adapted_derived(spec) and "end of backward" in with_leaf:
        phase, terms = with_leaf["end of backward"]
        with_leaf["end of backward"] = (phase, terms + block0_checkpoint(step, forward_terms.CPU_RNG_STATE_BYTES))
    return with_leaf


@dataclass(frozen=True)
class _GatedSizes:
    """What the gated block's recompute and frozen-MLP backward hold, in bytes (see checkpointed_moments)."""

    locals_: int
    incoming: int
    not_yet: int
    freed: int
    first_norm: int
    dequantized: int
    rng: int

    @classmethod
    def of(cls, step) -> "_GatedSizes":

        spec, setup, d = step.spec, step.setup, step.dtypes
        ft = setup.finetune
        n, h, inter = step.tokens, spec.hidden_size, spec.intermediate_size
        res, cmp = d.residual, d.compute
        mlp = res if d.mlp_in_residual else cmp
        shares_x, low = _lora.adapter_reads(setup, d)
        low_bytes = 2 if low == "c16" else 4
        fp32_adapters = _lora.adapter_bytes(setup) == 4
        mask_bytes = 2 if _lora._mask(setup, d) == "c16" else 4
        down = _lora.adapted_roles(spec).get("down", [None])[0]
        # R: the recompute's own peak, inside down_proj's adapter (or at the frozen down_proj)
        locals_ = n * h * res if res == 2 else 0  # the post-attention residual sum (an fp32 one the norm saves)
        not_yet = freed = 0
        if down is not None:
            if not shares_x:
                locals_ += n * h * res + n * inter * mlp  # the MLP input, down_proj's input
            locals_ += n * h * mlp  # base_layer(x)
            locals_ += n * inter * 4 if mlp != 4 and fp32_adapters else 0  # peft's fp32 cast of x
            # the fp32 dropout output (its autocast cast is what is saved); lora_B's cast, not made yet
            locals_ += n * inter * 4 if ft.dropout > 0 and d.autocast and fp32_adapters else 0
            locals_ -= 2 * down.rank * h if d.autocast and fp32_adapters else 0
            incoming = n * h * res + n * h * cmp  # the residual gradient and lora_B's output gradient
            if ft.dora:  # DoRA's product m / ||W + s BA|| * lora_result starts the recompute: result_dora's fp32
                # gradient and its product's, and a 16-bit stream's own residual gradient (the add's promotion)
                incoming = 2 * n * h * 4 + (n * h * res if res != 4 else 0)
            dropout_mask = n * inter * mask_bytes if ft.dropout > 0 and d.on_cpu else 0
            not_yet = n * h * mlp + n * down.rank * low_bytes + (0 if shares_x else n * inter * low_bytes)
            not_yet += dropout_mask
            freed = n * down.rank * low_bytes + dropout_mask + (0 if shares_x else n * inter * low_bytes)
        else:
            base = ft.base_storage(setup.precision.compute_dtype)
            locals_ += n * h * res  # the MLP input (frozen gate/up keep nothing)
            locals_ += 0 if base.four_bit else n * inter * mlp  # the product (a 4-bit down_proj packs nothing)
            incoming = n * h * res
        # torchao's linear_nf4 dequantizes each weight again in the recompute: down_proj's before its output and its
        # adapter's saved tensors exist
        dequantized = _lora.dequantized_weight_bytes(spec, setup) if ft.torchtune else 0
        return cls(locals_=locals_, incoming=incoming, not_yet=not_yet, freed=freed,
                   first_norm=n * h * res if res == 4 else 0, dequantized=dequantized,
                   rng=forward_terms.CPU_RNG_STATE_BYTES if d.on_cpu else 0)


def _term(name: str, num_bytes: int, formula: str, category=Category.TEMPORARIES) -> Term:
    return Term(name, category, int(num_bytes), formula, "torch.utils.checkpoint recompute, peft lora.Linear")


def _gated_terms(step, sizes: _GatedSizes) -> dict[str, list[Term]]:
    """The recompute's and the frozen MLP backward's temporaries, with and without torchao's dequantized weight."""

    spec, d = step.spec, step.dtypes
    n, h, inter = step.tokens, spec.hidden_size, spec.intermediate_size
    res = d.residual
    mlp = res if d.mlp_in_residual else d.compute
    down = _lora.adapted_roles(spec).get("down", [None])[0]
    recompute = [_term("temporaries/recompute_locals", sizes.locals_, "the layer's forward locals still alive when "
                       "the recompute stops at its last saved tensor"),
                 _term("temporaries/incoming_gradient", sizes.incoming, "the gradient flowing into the block")]
    recompute += dora_recompute(step, down)
    dequantizing = [_term("temporaries/recompute_locals", sizes.locals_, "the layer's forward locals"), recompute[1],
                    _term("temporaries/dequantized_weight", sizes.dequantized, "the largest NF4 weight being "
                          "dequantized in the recompute's forward (torchao NF4Tensor.get_original_weight)")]
    # B: the frozen gated MLP's backward (the product's and both factors' gradients + the residual gradient)
    mlp_backward = [_term("temporaries/frozen_mlp_backward", n * h * res + 3 * n * inter * mlp - sizes.freed,
                          "B x T x h residual gradient + 3 x B x T x I: the gradients of act * up and of both "
                          "factors, in the MLP's dtype")]
    # torchao's NF4 backward dequantizes gate / up's weight for their input gradient, once the product's gradient
    # is gone (measured: the two factors' gradients and the residual gradient alive at that moment)
    dequantized_backward = [_term("temporaries/frozen_mlp_backward", n * h * res + 2 * n * inter * mlp - sizes.freed,
                                  "B x T x h residual gradient + 2 x B x T x I: both factors' gradients"),
                            _term("temporaries/dequantized_weight", sizes.dequantized, "the largest NF4 weight "
                                  "dequantized for a frozen MLP projection's input gradient "
                                  "(NF4Tensor.get_original_weight)")]
    return {"recompute": recompute, "recompute dequantizing": dequantizing, "mlp backward": mlp_backward,
            "mlp backward dequantizing": dequantized_backward}


def _gated_moments(step, moments: dict, sizes: _GatedSizes) -> dict:
    spec, res = step.spec, step.dtypes.residual
    layers, n, h = spec.num_layers, step.tokens, spec.hidden_size
    parts = _gated_terms(step, sizes)

    def with_rng(terms: list[Term], states: int) -> list[Term]:
        terms = [t for t in terms if t.name != "activations/rng_states"]  # the generic moments' count, replaced
        if not states:
            return terms
        return terms + [_term("activations/rng_states", states * sizes.rng, f"{states} x {sizes.rng} B: "
                              "torch.get_rng_state() kept per checkpointed layer (CPU device)", Category.ACTIVATIONS)]

    def less(terms: list[Term], num_bytes: int) -> list[Term]:  # off the recomputed block
        if not num_bytes:
            return terms
        return [replace(t, num_bytes=t.num_bytes - num_bytes) if t.name == "activations/recomputed_block" else t
                for t in terms]

    def without_layer_temps(name: str) -> list[Term]:
        # under checkpointing the autocast copies are the head's cast alone (autocast_copies), freed by the head's
        # backward before any block's
        gone = ("temporaries/layer_backward", "activations/autocast_weight_copies")
        return [t for t in moments[name][1] if t.name not in gone]

    last = less(without_layer_temps("first block backward"), sizes.first_norm)
    first = less(without_layer_temps("end of backward"), sizes.first_norm)
    leaf = [_term("activations/embedding_leaf", n * h * res, "the embedding output, a leaf autograd keeps to the "
                  "end (peft enable_input_require_grads)", Category.ACTIVATIONS)] \
        if step.setup.finetune.asks_input_gradient() else []
    dequantizing = {} if not sizes.dequantized else {
        "first block recompute, dequantizing": (Phase.BACKWARD, with_rng(
            less(last, sizes.not_yet) + parts["recompute dequantizing"], layers + 1)),
        "first block MLP input gradient": (Phase.BACKWARD, with_rng(last + parts["mlp backward dequantizing"],
                                                                    layers)),
        "block 0 MLP input gradient": (Phase.BACKWARD, with_rng(first + leaf + parts["mlp backward dequantizing"],
                                                                1))}
    return dequantizing | {
        "loss backward": (Phase.BACKWARD, with_rng(list(moments["loss backward"][1]), layers)),
        "first block backward": (Phase.BACKWARD, with_rng(last + parts["recompute"], layers + 1)),
        "first block MLP backward": (Phase.BACKWARD, with_rng(last + parts["mlp backward"], layers)),
        "end of backward": (Phase.BACKWARD, with_rng(first + leaf + parts["recompute"], 2)),
        "block 0 MLP backward": (Phase.BACKWARD, with_rng(first + leaf + parts["mlp backward"], 1)),
    }


def block0_checkpoint(step, rng_state: int) -> list:
    """Held while block 0 is rebuilt and runs its backward, beside every gradient: its checkpointed input (the
    embedding leaf itself where that is block 0's input) and, on a CPU device, two generator states (its own and
    the one its recompute stashes)."""

    n, h, d = step.tokens, step.spec.hidden_size, step.dtypes
    terms = [Term("activations/checkpoint0", Category.ACTIVATIONS, n * h * d.residual,
                  "block 0's input, held by its checkpoint until its backward ends", "torch.utils.checkpoint")]
    if d.on_cpu:
        terms.append(Term("activations/rng_states", Category.ACTIVATIONS, 2 * rng_state,
                          "2 x torch.get_rng_state(): block 0's and its recompute's (CPU device)",
                          "torch.utils.checkpoint preserve_rng_state=True"))
    return terms


def embedding_leaf_bytes(step) -> int:
    """The embedding output peft's enable_input_require_grads makes a leaf: a B x T x h tensor of its own; for a
    derived family as traced (memfit.derive KindFit.lora 'leaf': 0 where block 0's checkpointed input is that very
    tensor, counted with the checkpoints already)."""

    if _lora.adapted_derived(step.spec):

        return derive.lora_bytes(step.spec, step.setup, "leaf", step.tokens, step.setup.seq_len, step.dtypes.on_cpu)
    return step.tokens * step.spec.hidden_size * step.dtypes.residual


def layer_norm_block(spec) -> bool:
    """A block the formulas size whose norms are LayerNorms and whose MLP is plain (not gated)."""

    if spec.derived is not None or act.saved_problem(spec.graph) is not None:
        return False
    norms, mlps = act._nodes_of(spec, Norm), act._nodes_of(spec, MLP)
    return (bool(norms) and all(n.kind == "layer" for n in norms) and len(mlps) == 1 and not mlps[0].gated
            and not act._block(spec).parallel_residual)


def _pre_norm(spec) -> bool:

    return type(act._block(spec).nodes[0]) is Norm


def _residual_dropout(spec) -> bool:

    return any(n.where == "residual" and n.p > 0 for n in act._nodes_of(spec, Dropout))


def ungated_moments(step, moments: dict, adapted_roles, rng_bytes: int) -> dict:
    """The backward moments of a checkpointed LoRA step of a LayerNorm block with a plain MLP: the last block's
    recompute (R) and MLP backward (B), block 0's the same once the other blocks are done, the loss backward with
    the RNG states (`moments`: the generic ones; `adapted_roles(spec)`: the adapted projections by role)."""

    spec, setup, d = step.spec, step.setup, step.dtypes
    ft = setup.finetune
    n, h, inter, layers = step.tokens, spec.hidden_size, spec.intermediate_size, spec.num_layers
    res, cmp = d.residual, d.compute
    mlp = res if d.mlp_in_residual else cmp
    roles = adapted_roles(spec)
    down, up = roles.get("down", [None])[0], roles.get("up", [None])[0]
    shares_x = not d.autocast and cmp == 4 and res == 4 and ft.dropout == 0

    def term(name: str, num_bytes: int, formula: str, category=Category.TEMPORARIES) -> Term:
        return Term(name, category, int(num_bytes), formula, SOURCE)

    def with_rng(terms: list, states: int) -> list:
        if not rng_bytes:
            return terms
        return terms + [term("activations/rng_states", states * rng_bytes, f"{states} x {rng_bytes} B: "
                             "torch.get_rng_state() kept per checkpointed layer (CPU device)", Category.ACTIVATIONS)]

    # a pre-norm block's first LayerNorm saves the layer input, which is the checkpoint already counted
    first_norm = n * h * res if _pre_norm(spec) else 0

    def block_part(name: str, checkpoint_counted: bool) -> list:
        # the autocast copies are the head's cast alone under checkpointing, freed by the head's backward
        gone = ("temporaries/layer_backward", "activations/rng_states", "activations/autocast_weight_copies")
        terms = [t for t in moments[name][1] if t.name not in gone]
        if not first_norm or not checkpoint_counted:
            return terms
        return [replace(t, num_bytes=t.num_bytes - first_norm) if t.name == "activations/recomputed_block" else t
                for t in terms]

    # R: inside the adapted down projection's forward (or at the recompute's end)
    locals_ = n * h * res if _pre_norm(spec) else 0  # the attention branch's output, kept beside the sum
    locals_ += 0 if up is not None and shares_x else n * h * res  # the MLP input (lora_A saves it when shared)
    locals_ += 0 if down is not None and shares_x else n * inter * mlp  # the activation's output
    if down is not None:
        locals_ += n * h * cmp  # base_layer(x)
        locals_ += n * inter * 4 if mlp != 4 else 0  # peft's fp32 cast of x
        locals_ += n * inter * 4 if ft.dropout > 0 and d.autocast else 0  # the dropout output (its cast is saved)
    else:
        locals_ += n * h * cmp  # the down projection's output
    incoming = n * h * res
    recompute = [term("temporaries/recompute_locals", locals_, "the block's forward locals alive in its recompute "
                      "(branch output, MLP input, activation output, base_layer(x), peft's casts)"),
                 term("temporaries/incoming_gradient", incoming, "the residual gradient flowing into the block")]
    recompute += dora_recompute(step, down)
    # B: the down projection's input gradient, the block's saved tensors less what its backward has freed
    freed = n * h * cmp if _residual_dropout(spec) else 0  # the residual dropout's mask
    if down is not None:
        freed += n * down.rank * (2 if d.autocast else 4)  # lora_A's output, kept by lora_B
        freed += n * inter * (mlp if shares_x else (2 if d.autocast else 4))  # lora_A's input
        freed += n * inter * 4 if ft.dropout > 0 else 0  # the adapter dropout's mask
    mlp_backward = [term("temporaries/mlp_backward", n * h * res + 3 * n * inter * mlp - freed,
                         "B x T x h residual gradient + 3 x B x T x I (the down projection's input gradients or "
                         "the activation's), less the residual dropout mask and the down projection's saved "
                         "tensors, freed by then")]
    if down is not None:  # the down projection's adapter gradients, made just before its input gradients
        mlp_backward.append(term("gradients/down_adapters", 4 * (down.a.weight_numel + down.b.weight_numel),
                                 "lora_A and lora_B gradients of the down projection (fp32 adapters)",
                                 Category.GRADIENTS))
    # block 0's input is no checkpoint term of the end-of-backward moment: its first norm's copy is counted
    last, first = block_part("first block backward", True), block_part("end of backward", False)
    out = {
        "loss backward": (Phase.BACKWARD, with_rng(list(moments["loss backward"][1]), layers)),
        "first block backward": (Phase.BACKWARD, with_rng(last + recompute, layers + 1)),
        "first block MLP backward": (Phase.BACKWARD, with_rng(last + mlp_backward, layers)),
        "end of backward": (Phase.BACKWARD, with_rng(first + recompute, 2)),
        "block 0 MLP backward": (Phase.BACKWARD, with_rng(first + mlp_backward, 1)),
    }
    if sdpa_math_path(spec, setup, d):
        out["first block attention recompute"] = (Phase.BACKWARD, with_rng(
            attention_recompute(step, last, incoming, term), layers + 1))
        out["block 0 attention recompute"] = (Phase.BACKWARD, with_rng(
            attention_recompute(step, first, incoming, term), 2))
    return out


def sdpa_math_path(spec, setup, d) -> bool:
    """CPU SDPA with attention dropout runs torch's composite math kernel (_scaled_dot_product_attention_math),
    which materialises the B x H x T x T scores."""

    return (d.on_cpu and setup.attention is Attention.SDPA
            and any(n.where == "attention" and n.p > 0 for n in act._nodes_of(spec, Dropout)))


def attention_recompute(step, terms: list, incoming: int, term) -> list:
    """A block's recompute at its SDPA (the math path): the block's saved tensors but its MLP's and norms', the
    q / k / v projections' outputs (the attention's locals), the SDPA output and the math kernel's own C++ locals
    beyond what it saves: under autocast its fp32 q / k / v copies and the contiguous copies of the transposed
    views (5 x B x T x h_q fp32) and the bf16 probabilities for the last matmul (B x H x T x T x 2 B), in fp32 one
    B x T x h_q copy. Measured: SDPA alone on HF's transposed views, and a BERT step (bench/lora_checkpoint.py)."""
    spec, setup, d = step.spec, step.setup, step.dtypes
    n, seq = step.tokens, setup.seq_len
    heads = spec.num_attention_heads
    q_width = heads * (spec.head_dim or spec.hidden_size // heads)
    kv_width = spec.kv_dim
    # not made yet: the MLP's and the norms' saved tensors (the output projection's adapter rows and every
    # adapter's bf16 weight casts stay counted: a little high)
    later = step.per_layer["mlp"] + step.per_layer["norms"]
    kept = [replace(t, num_bytes=t.num_bytes - later) if t.name == "activations/recomputed_block" else t
            for t in terms]
    scores = (n // seq) * heads * seq * seq
    transient = 5 * n * q_width * 4 + scores * 2 if d.autocast else n * q_width * 4
    local = n * (q_width + 2 * kv_width) * d.compute + n * q_width * d.compute
    return kept + [term("temporaries/attention_recompute", local + transient,
                        "q / k / v outputs and the SDPA output (B x T x (h_q + 2 h_kv + h_q)) + the math kernel's "
                        "copies (autocast: 5 x B x T x h_q x 4 B + B x H x T x T x 2 B; fp32: B x T x h_q x 4 B)"),
                   term("temporaries/incoming_gradient", incoming, "the residual gradient flowing into the block")]


def dora_recompute(step, down) -> list:
    """Under DoRA the recompute peaks in the adapted down projection's DoRA forward (memfit.estimate.dora
    recompute_locals_bytes): nothing when DoRA is off or the down projection is not adapted."""

    setup = step.setup
    if not setup.finetune.dora or down is None:
        return []
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    d = step.dtypes
    num_bytes = dora.recompute_locals_bytes(down, step.tokens, autocast=d.autocast,
                                            base_bytes=4 if base.value == "fp32" else 2,
                                            base_out_bytes=d.residual if d.mlp_in_residual else d.compute,
                                            on_cpu=d.on_cpu)
    return [Term("temporaries/dora_recompute", Category.TEMPORARIES, num_bytes, "the down projection's DoRA forward "
                 "in the recompute: get_lora_weight's graph and product, the fp32 weight, the two B x T x out "
                 "products of result_dora", dora.SOURCE)]
