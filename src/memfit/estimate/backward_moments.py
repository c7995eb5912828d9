"""The moments of backward after the loss: the last block's backward, the next one's (FSDP2), the end of backward,
the embedding's gradient, FSDP2's root reduce-scatter; and optimizer in backward's own moments."""

from __future__ import annotations

from dataclasses import replace

from ..model_spec import ModelSpec
from ..setup import Checkpointing, Loss, Optimizer, TrainingSetup
from . import activations as act
from . import heads
from .forward_terms import CPU_RNG_STATE_BYTES, linear_weight_elems
from .moments import MomentKey
from .result import Category, Term
from .static import ShardedStatic
from .step_model import HEAD_AND_LOSS, StepModel, head_grads
from .terms import TermKey


def first_block_backward(step: StepModel, early_grads: int) -> list[Term]:
    """The last block's backward: every block's activations, the head's gradients, one block's temporaries (and,
    with checkpointing, that block rebuilt). Under FSDP2 the head's and the block's gradients are unsharded."""
    spec, static = step.spec, step.static
    if static.fsdp is not None:
        terms = step.static_terms(early_grads) + static.fsdp.block_terms(first=True)
    else:
        head = head_grads(spec, static)
        if step.setup.optimizer_in_backward and not spec.tie_word_embeddings:
            head = 0  # stepped and freed right after the head's backward
        grads = head + _down_projection_grads(step)
        if act.core_recomputed(step.setup) and step.attention_backward_dominates(rebuilt_core=True):
            grads += static.grads_bytes * block_mlp_params(spec) // max(spec.num_params, 1)  # its MLP's are made
        terms = step.static_terms(max(early_grads, grads))
    terms += step.acts_except(*HEAD_AND_LOSS)
    terms.append(step.layer_temporaries(rebuilt_core=True))
    if step.setup.checkpointing.checkpointed(spec.num_layers - 1):
        terms.append(step.recomputed_block("one block's saved tensors, rebuilt during backward"))
    return terms


def _measured_block_order(spec: ModelSpec) -> bool:
    """Whether the late-backward details (block 0's checkpoint, its down projection's gradient, the recompute's
    casts, a tied head's buffered gradient) were checked on measured steps of this family: the Llama recipe's
    (tests/estimate/test_loss_and_inbwd.py). GPT-2 and BERT keep the earlier, coarser end-of-backward moment."""
    return act.separate_projections_layer(spec)


def _down_projection_grads(step: StepModel) -> int:
    """The block's MLP output projection's weight gradient (I x h), made by the first matmul backward of the block,
    before its MLP input gradients peak; stepped and freed at once under optimizer in backward. Checked on measured
    CPU steps with checkpointing, where the block moments are the peak."""
    spec = step.spec
    if spec.frozen or spec.derived is not None or step.setup.optimizer_in_backward or not _measured_block_order(spec):
        return 0
    grad_bytes = step.setup.precision.param_bytes
    return spec.intermediate_size * spec.hidden_size * grad_bytes


def second_block_backward(step: StepModel, early_grads: int) -> list[Term]:
    """FSDP2 only: the next block's backward, with the first one's reduce-scatter input held, its activations (or
    its checkpoint) gone."""
    units = step.static.fsdp
    if units is None or step.spec.num_layers < 2:
        return []
    terms = step.static_terms(early_grads) + units.block_terms(first=False) + _acts_after_first_block(step)
    terms.append(step.layer_temporaries(rebuilt_core=True))
    if step.setup.checkpointing.checkpointed(step.spec.num_layers - 2):
        terms.append(step.recomputed_block("one block's saved tensors, rebuilt during backward"))
    return terms


def flat_gradient(step: StepModel, early_grads: int) -> list[Term]:
    """FSDP1 only: the end of the first block's backward, its weight gradients and the flat gradient they are
    concatenated into (memfit.estimate.fsdp1.Fsdp1Units.flat_gradient_terms), its activations gone and the
    gradient it passes on to the next block alive."""
    units = step.static.fsdp
    if not hasattr(units, "flat_gradient_terms"):
        return []
    passed = Term(TermKey.INCOMING_GRADIENT, Category.TEMPORARIES,
                  step.tokens * step.spec.hidden_size * step.dtypes.residual,
                  "B x T x h: the gradient of the block's input, passed on to the next block", "autograd")
    return step.static_terms(early_grads) + units.flat_gradient_terms() + _acts_after_first_block(step) + [passed]


def _acts_after_first_block(step: StepModel) -> list[Term]:
    """The activations once the first block's backward has run: its saved tensors (or its checkpoint) gone."""
    out = []
    mode, layers = step.setup.checkpointing, step.spec.num_layers
    last_wrapped = mode.checkpointed(layers - 1)  # the block whose backward ran first: its share is gone
    wrapped = mode.checkpointed_blocks(layers)
    for term in step.acts_except(*HEAD_AND_LOSS):
        if last_wrapped and term.name in (TermKey.CHECKPOINTS, TermKey.SELECTIVE_KEPT):
            mask = act.checkpointed_mask_bytes(step.spec, step.setup, step.tokens, step.setup.seq_len)
            if term.name == TermKey.CHECKPOINTS:
                term = replace(term, num_bytes=mask + (term.num_bytes - mask) * (wrapped - 1) // wrapped)
            else:
                term = replace(term, num_bytes=term.num_bytes * (layers - 1) // layers)
        elif not last_wrapped and term.name in (TermKey.ATTENTION, TermKey.MLP,
                                                TermKey.NORMS):
            plain = layers - wrapped
            term = replace(term, num_bytes=term.num_bytes * (plain - 1) // plain)
        out.append(term)
    return out


def end_of_backward(step: StepModel) -> list[Term]:
    """All gradients exist; with checkpointing, block 0 is rebuilt before its own and the embedding's gradients."""
    spec, static = step.spec, step.static
    embeddings = [t for t in step.acts if t.name == TermKey.EMBEDDINGS]
    block0_wrapped = step.setup.checkpointing.checkpointed(0)
    if not block0_wrapped and static.fsdp is None:
        return step.static_terms(0 if step.setup.optimizer_in_backward else static.grads_bytes) + embeddings
    per_layer = spec.params_matching(".*.") // max(spec.num_layers, 1)  # the repeated rows ('*' = layer index)
    pending = per_layer + token_embedding_elems(spec)
    temporaries = step.layer_temporaries()
    if block0_wrapped:
        rebuilt = step.recomputed_block("block 0 rebuilt during backward", kept_counted=False)
    else:
        rebuilt = replace(step.recomputed_block(""), name=TermKey.BLOCK0,
                          formula="block 0's saved tensors, the last still alive")
    if step.attention_backward_dominates():
        # the peak is in block 0's attention backward: its MLP's gradients exist and its MLP tensors are freed
        pending -= min(block_mlp_params(spec), per_layer)
        freed = step.per_layer["mlp"] + step.per_layer["norms"] // 2
        rebuilt = replace(rebuilt, num_bytes=rebuilt.num_bytes - freed,
                          formula="block 0's attention tensors, rebuilt, once its MLP's backward has run")
        temporaries = replace(temporaries, num_bytes=temporaries.num_bytes + freed)
    if static.fsdp is not None:
        grads = static.fsdp.block_share(static.grads_bytes, static.fsdp.last_prefetching_block)
        return (step.static_terms(grads, _gathered(static, 1)) + static.fsdp.block_terms(first=False)
                + embeddings
                + [temporaries, rebuilt])
    detailed = _measured_block_order(spec) and not spec.frozen
    if detailed and step.setup.checkpointing is Checkpointing.FULL and step.setup.precision.is_autocast:
        # the recompute casts block 0's Linear weights to bf16 again and keeps them for its backward: that rebuilt
        # block, before its first gradient, is the moment (measured on the tiny llama, amp-bf16)
        block_weights = linear_weight_elems(spec, step.setup) - heads.head_weight_elems(spec)
        casts = 2 * max(block_weights, 0) // max(spec.num_layers, 1)
        rebuilt = replace(rebuilt, num_bytes=rebuilt.num_bytes + casts,
                          formula=rebuilt.formula + "; its Linear weights' bf16 casts, made again in the recompute")
    elif not step.attention_backward_dominates() and _down_projection_grads(step):
        pending -= spec.intermediate_size * spec.hidden_size  # block 0's down projection has its gradient
    # block 0's checkpoint at its recompute, measured on the Llama recipe and on derived families (Falcon's fp32
    # step peaks there: bench/arch_matrix.py)
    held = (detailed or spec.derived is not None) and not spec.frozen
    if detailed and step.setup.checkpointing is Checkpointing.FULL:  # block 0's input, kept until its backward
        # (a derived block's saved bytes hold its input already: its first norm saves it, memfit.derive.fit)
        embeddings += [replace(t, name=TermKey.CHECKPOINT0, num_bytes=t.num_bytes // max(spec.num_layers, 1),
                               formula="block 0's input, held by its checkpoint until its backward ends")
                       for t in step.acts if t.name == TermKey.CHECKPOINTS]
    if held and spec.derived is not None and step.dtypes.on_cpu and step.setup.checkpointing is Checkpointing.FULL:
        embeddings.append(Term(TermKey.RNG_STATES, Category.ACTIVATIONS, 2 * CPU_RNG_STATE_BYTES,
                               "block 0's stashed torch.get_rng_state() and the one torch.random.fork_rng takes "
                               "around its recompute", "torch.utils.checkpoint preserve_rng_state=True"))
    grads = static.grads_bytes - static.grads_bytes * pending // max(spec.num_params, 1)
    if held and spec.tie_word_embeddings and step.setup.checkpointing is Checkpointing.FULL:
        grads += head_grads(spec, static)  # the tied head's share waits in autograd's buffer for the embedding's
    if step.setup.optimizer_in_backward:
        grads = head_grads(spec, static) if spec.tie_word_embeddings else 0  # a tied head's waits in the buffer
    return step.static_terms(grads) + embeddings + [temporaries, rebuilt]


def block_mlp_params(spec: ModelSpec) -> int:
    """One block's trainable MLP (or experts') parameters, from the graph's first block: their gradients exist once
    the block's backward reaches its attention. 0 without a graph (a derived model has no such moment)."""
    if spec.graph is None:
        return 0
    from ..graph import tensors_of
    from ..graph.kinds.mlp import MLP, Experts

    block = spec.graph.stacks[0].block
    return sum(t.local for n in block.nodes if isinstance(n, (MLP, Experts)) for t in tensors_of(n) if t.trainable)


def token_embedding_elems(spec: ModelSpec) -> int:
    """The token embedding's trainable elements on this rank: the graph's embedding node (OPT's is narrower than
    hidden; vocabulary-sharded under tensor parallelism), else vocabulary x hidden."""
    from ..graph import tensors_of
    from ..graph.kinds.embedding import Embedding

    embed = getattr(spec.graph, "embed", None)
    if isinstance(embed, Embedding):
        return sum(t.local for t in tensors_of(embed) if t.trainable)
    return spec.vocab_size * spec.hidden_size if not spec.frozen else 0


def embedding_gradient(step: StepModel) -> list[Term]:
    """After the last block: the embedding's gradient. A tied matrix's LM-head contribution waits in autograd's
    input buffer for the embedding's, and the two are summed: three V x h gradients at once."""
    spec, static = step.spec, step.static
    embeddings = [t for t in step.acts if t.name == TermKey.EMBEDDINGS]
    if static.fsdp is not None:
        grads = static.fsdp.block_share(static.grads_bytes, spec.num_layers)
        return step.static_terms(grads, _gathered(static, 0)) + static.fsdp.root_gradient_terms() + embeddings
    if not spec.tie_word_embeddings or spec.frozen:
        return []
    head = head_grads(spec, static)
    return step.static_terms(static.grads_bytes - head) + embeddings + [Term(
        TermKey.TIED_EMBEDDING, Category.GRADIENTS, 3 * head,
        "3 x V x h x grad dtype: the LM head's and the embedding's contributions and their sum",
        "autograd InputBuffer accumulation for a parameter used twice")]


def root_reduce(step: StepModel) -> list[Term]:
    """FSDP2's root post-backward: every block's gradient shard, the root's unsharded gradients and their copy."""
    units = step.static.fsdp
    if units is None:
        return []
    grads = units.block_share(step.static.grads_bytes, step.spec.num_layers)
    return step.static_terms(grads, _gathered(step.static, 0)) + units.root_reduce_terms()


def _gathered(static: ShardedStatic, blocks: int) -> ShardedStatic:
    """Late in backward FSDP2 has resharded every block whose backward ran (ZeRO-2 too): the root and `blocks`
    blocks stay gathered."""
    units = static.fsdp
    if units is None:
        return static
    return replace(static, param_working_set_bytes=units.gathered_bytes(blocks))


def _param_step_temp(spec: ModelSpec, setup: TrainingSetup, numel: int) -> int:
    """Transient bytes of one parameter's own optimizer step (optimizer in backward: one optimizer per parameter)."""
    p_bytes = setup.precision.param_bytes
    if setup.optimizer is Optimizer.ADAMW:
        return 2 * numel * p_bytes  # exp_avg_sq.sqrt() and its division by the bias correction
    if setup.optimizer is Optimizer.ADAMW_FOREACH:
        return numel * p_bytes  # _foreach_sqrt over a one-tensor list
    if setup.optimizer is Optimizer.ADAFACTOR:
        return (3 + (2 if p_bytes == 2 else 0)) * numel * 4
    return 0


IN_BACKWARD_SOURCE = ("torchtune optimizer_in_bwd: one optimizer per parameter, stepped by "
                      "register_post_accumulate_grad_hook, then zero_grad(set_to_none=True); "
                      "memfit._torch.step.InBackwardOptimizer")


def in_backward_moments(step: StepModel) -> dict[MomentKey, list[Term]]:
    """Optimizer in backward: no gradient outlives its parameter's step, and there is no optimizer step moment.
    Each parameter's gradient and its step's temporaries appear once, inside backward: the LM head's right after
    its matmul backward (every block's activations still alive), the embedding's at the very end. A tied head's
    gradient waits in autograd's buffer for the embedding's and steps with it at the end."""
    spec, setup = step.spec, step.setup
    vh = spec.vocab_size * spec.hidden_size
    p_bytes = setup.precision.param_bytes
    d = step.dtypes
    one = lambda name, numel, what: [  # noqa: E731
        Term(TermKey.IN_BACKWARD, Category.GRADIENTS, numel * p_bytes, f"{what}: its gradient", IN_BACKWARD_SOURCE),
        Term(TermKey.OPTIMIZER_STEP, Category.TEMPORARIES, _param_step_temp(spec, setup, numel),
             f"{setup.optimizer} step of {what} alone", IN_BACKWARD_SOURCE)]
    embeddings = [t for t in step.acts if t.name == TermKey.EMBEDDINGS]
    moments: dict[MomentKey, list[Term]] = {MomentKey.OPTIMIZER_STEP: []}
    hidden_grad = Term(TermKey.HIDDEN_GRADIENT, Category.TEMPORARIES, step.tokens * spec.hidden_size * d.residual,
                       "B x T x h: the gradient flowing into the final norm", "autograd")
    if spec.tie_word_embeddings:
        moments[MomentKey.EMBEDDING_GRADIENT] = step.static_terms(0) + embeddings + [Term(
            TermKey.TIED_EMBEDDING, Category.GRADIENTS, 3 * vh * p_bytes,
            "3 x V x h: the LM head's and the embedding's contributions and their sum", "autograd InputBuffer")]
        moments[MomentKey.EMBEDDING_STEP] = (step.static_terms(0) + embeddings
                                             + one("embedding", vh, "the tied embedding / LM head"))
    else:
        # the fused loss hands out the head's gradient before the final norm's backward: its saved tensors remain
        kept = (step.acts_except(TermKey.LOGITS, TermKey.LOSS, TermKey.FUSED_HEAD)
                if setup.loss is Loss.FUSED else step.acts_except(*HEAD_AND_LOSS))
        moments[MomentKey.HEAD_STEP] = step.static_terms(0) + kept + [hidden_grad] + one("head", vh, "the LM head")
        moments[MomentKey.EMBEDDING_STEP] = (step.static_terms(0) + embeddings
                                             + one("embedding", vh, "the embedding"))
    return moments
