"""The terms alive at the end of forward: every block's saved tensors (or their checkpoints), the embeddings',
the head's and the loss's, autocast's weight casts; and the counts of Linear weights those casts are made of."""

from __future__ import annotations

from ..model_spec import ModelSpec
from ..setup import LOSS_CHUNKS, Checkpointing, Loss, TrainingSetup
from . import activations as act
from . import compiled, compiled_loss, float8, heads, lora, moe, tensor_parallel
from .result import Category, Term
from .terms import TermKey

ENGINE_SOURCE = "transformers 5.x modelling code, checked with saved_tensors_hooks on real tiny models"
SAC_SOURCE = ("torchtitan op-level SAC policy (torch.utils.checkpoint.create_selective_checkpoint_contexts); "
              "measured on real CPU steps")


CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state(): the CPU generator's mt19937 state as a uint8 tensor (ATen CPUGeneratorImpl::get_state)."""


def activation_terms(spec: ModelSpec, setup: TrainingSetup, per_layer: dict[str, int], d: act.Dtypes) -> list[Term]:
    """Terms alive at the end of forward (and so at the start of backward)."""
    wrapped = setup.checkpointing.checkpointed_blocks(spec.num_layers)  # blocks under torch.utils.checkpoint
    terms = _checkpoint_terms(spec, setup, d, wrapped) + _block_terms(spec, setup, per_layer, d, wrapped)
    fused = setup.loss is Loss.FUSED
    tokens = setup.tokens_per_micro_step
    head = act.head_saved_bytes(spec, setup, tokens, head_input=not fused)["head"]
    # + input_ids and labels (one per token, one per sequence for a classifier)
    emb = (act.embedding_saved_bytes(spec, setup, tokens, setup.seq_len, d.on_cpu)
           + 8 * (tokens + heads.label_elems(spec, setup)))
    terms.append(Term(TermKey.EMBEDDINGS, Category.ACTIVATIONS, emb,
                      "token ids, labels, position tables", ENGINE_SOURCE))
    terms.append(Term(TermKey.HEAD, Category.ACTIVATIONS, head,
                      "final norm" + ("" if fused else " and LM-head input (BERT: MLM transform)")
                      if heads.classifier(spec) is None else "final norm and the classification head's inputs "
                      "(BERT: pooler, dropout, classifier)", ENGINE_SOURCE))
    if heads.classifier(spec) is not None:
        return terms + _classifier_terms(spec, setup, d)
    if fused:
        return terms + _fused_loss_terms(spec, setup, d) + _fused_autocast_copies(spec, setup)
    return _lm_loss_terms(spec, setup, d, terms) + moe.terms(spec, setup, d) + _autocast_copies(spec, setup, wrapped)


def _checkpoint_terms(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, wrapped: int) -> list[Term]:
    """What checkpointing keeps of its blocks: their inputs (and an eager mask), the CPU generator states, a frozen
    int8 base's inputs."""
    if not (wrapped or act.core_recomputed(setup)):
        return []
    tokens, seq, layers = setup.tokens_per_micro_step, setup.seq_len, spec.num_layers
    terms = []
    mask = act.checkpointed_mask_bytes(spec, setup, tokens, seq)
    # sequence parallelism: a block's input is the residual stream, sharded over the sequence between the TP
    # ranks (torchtitan's SequenceParallel norms leave it Shard(1)); checkpoint keeps that local shard
    inputs = wrapped * tokens * spec.hidden_size * d.residual // tensor_parallel.sequence_share(setup)
    if inputs or mask:
        what = (f"{'L' if wrapped == layers else wrapped} x B x T x h (each checkpointed block's input)"
                if inputs else "")
        what += (" + " if what else "") + "the B x T x T eager mask" if mask else ""
        terms.append(Term(TermKey.CHECKPOINTS, Category.ACTIVATIONS, inputs + mask, what,
                          "torch.utils.checkpoint, non-reentrant"))
    if wrapped and d.on_cpu:  # on CUDA the stashed generator states live in host memory
        terms.append(Term(TermKey.RNG_STATES, Category.ACTIVATIONS, wrapped * CPU_RNG_STATE_BYTES,
                          "each checkpointed block's torch.get_rng_state() (5,056 B Mersenne Twister state)",
                          "torch.utils.checkpoint preserve_rng_state=True"))
    ckpt = setup.checkpointing is Checkpointing.FULL
    int8 = lora.int8_checkpointed_inputs(spec, setup, tokens, seq, d) if spec.frozen and ckpt else 0
    if int8:
        terms.append(Term(TermKey.INT8_INPUTS, Category.ACTIVATIONS, int8,
                          "every int8 Linear's input, kept as ctx.A by bitsandbytes' CPU int8 matmul",
                          "bitsandbytes MatMul8bitFp (CPU)"))
    return terms


BLOCK_GROUPS = (("attention", TermKey.ATTENTION), ("mlp", TermKey.MLP), ("norms", TermKey.NORMS))
"""A block's saved bytes by group (memfit.estimate.activations.layer_saved_bytes) and the term of each."""


def _block_terms(spec: ModelSpec, setup: TrainingSetup, per_layer: dict[str, int], d: act.Dtypes,
                 wrapped: int) -> list[Term]:
    """The saved tensors of the blocks no checkpoint wraps (selective-op: every block's kept outputs)."""
    tokens, layers = setup.tokens_per_micro_step, spec.num_layers
    if setup.checkpointing is Checkpointing.SELECTIVE_OP:
        kept = act.selective_kept_bytes(spec, setup, tokens, setup.seq_len, d.on_cpu)
        return [Term(TermKey.SELECTIVE_KEPT, Category.ACTIVATIONS, layers * kept,
                     "L x (the 1st, 3rd, ... matmul outputs of a block + the SDPA output and log-sum-exp)", SAC_SOURCE)]
    if wrapped >= layers:
        return []
    first = int(lora.first_layer_unsaved(spec, setup, d) * tokens)
    plain = layers - wrapped
    count = "L" if plain == layers else f"{plain} of L"
    terms = []
    for group, key in BLOCK_GROUPS:
        total = plain * per_layer[group] - (first if group == "norms" else 0)
        formula = f"{count} x saved {group} tensors per layer" + (
            " (layer 0's first norm keeps nothing: no gradient flows into it)" if first and group == "norms"
            else "")
        if group == "attention" and act.core_recomputed(setup):
            formula += " (the checkpointed eager core keeps its q, k, v inputs and output, no T x T)"
        terms.append(Term(key, Category.ACTIVATIONS, total, formula, ENGINE_SOURCE))
    return terms


def _fused_autocast_copies(spec: ModelSpec, setup: TrainingSetup) -> list[Term]:
    if not setup.precision.is_autocast:
        return []
    ckpt = setup.checkpointing is Checkpointing.FULL
    copies = 2 * (linear_weight_elems(spec, setup) if not ckpt else spec.vocab_size * spec.hidden_size)
    copies -= 2 * spec.vocab_size * spec.hidden_size  # the head's cast is only cached, never saved
    return [Term(TermKey.AUTOCAST_WEIGHT_COPIES, Category.ACTIVATIONS, copies,
                 "2 B x Linear weights but the LM head's: bf16 casts cached by autocast, saved for "
                 "backward", "torch.autocast weight cast cache")]


def _lm_loss_terms(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, terms: list[Term]) -> list[Term]:
    """`terms` with a causal / masked LM's logits (a softcap's tanh) and its loss's saved tensors."""
    tokens = setup.tokens_per_micro_step
    vocab = spec.vocab_size * tokens
    logits = vocab * d.compute
    terms = list(terms)
    if spec.logit_softcap:
        terms.append(Term(TermKey.LOGIT_SOFTCAP, Category.ACTIVATIONS, logits,
                          f"B x T x V x {d.compute} B: tanh(logits / cap), kept for backward",
                          "transformers Gemma2ForCausalLM final_logit_softcapping"))
    chunked = setup.loss is Loss.CHUNKED
    terms.append(Term(TermKey.LOGITS, Category.ACTIVATIONS, logits,
                      f"B x T x V x {d.compute} B, until the loss is computed" + (
                          f" (all {LOSS_CHUNKS} chunks: the model returns them as a list)" if chunked else ""),
                      CHUNKED_SOURCE if chunked else
                      "HF CausalLMOutput; freed before backward when only the loss is kept (HF Trainer)"))
    loss_bytes = loss_elem_bytes(spec, setup)
    loss = Term(TermKey.LOSS, Category.ACTIVATIONS, vocab * loss_bytes + 8 * tokens,
                f"B x T x V x {loss_bytes} B log-softmax" + (" (every chunk's, saved by its own "
                                                             "cross-entropy)" if chunked else "")
                + " + shifted labels",
                CHUNKED_SOURCE if chunked else
                "transformers loss_utils.ForCausalLMLoss (upcasts to fp32); BertForMaskedLM does not")
    if compiled_loss.chunks(setup):  # torchtune compiles the chunked loss: its chunks keep no fp32 log-softmax
        loss = compiled_loss.saved_term(tokens)
    terms.append(loss)
    if compiled_loss.whole(setup):  # memfit.estimate.compiled_loss: the logits kept, no log-softmax
        terms = terms[:-2] + compiled_loss.forward_terms(spec, setup, d.compute)
    return terms


def _autocast_copies(spec: ModelSpec, setup: TrainingSetup, wrapped: int) -> list[Term]:
    """Autocast's cached casts of the Linear weights that backward keeps: the head's and those of the blocks no
    checkpoint wraps."""
    if not setup.precision.is_autocast:
        return []
    layers = spec.num_layers
    head_weight = spec.vocab_size * spec.hidden_size
    copies = 2 * (head_weight + (linear_weight_elems(spec, setup) - head_weight) * (layers - wrapped) // layers)
    if setup.compile and not compiled.unsized(spec, setup):  # a compiled block casts its weights in its graph
        copies = 2 * head_weight  # (the casts it saves are in its own bytes): only the eager head's is cached
    if spec.frozen:
        copies = lora.autocast_copies(spec, setup, setup.checkpointing is Checkpointing.FULL)
    return [Term(TermKey.AUTOCAST_WEIGHT_COPIES, Category.ACTIVATIONS, copies,
                 "2 B x Linear weights: bf16 casts cached by autocast, saved for backward",
                 "torch.autocast weight cast cache")]


def _classifier_terms(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes) -> list[Term]:
    """A sequence classifier's logits and loss: B x num_labels each (log-softmax in fp32 under autocast), the labels
    counted with the embeddings; its weights' autocast casts, all of them saved for backward."""
    logits = heads.logits_elems(spec, setup)
    loss_bytes = loss_elem_bytes(spec, setup)
    terms = [Term(TermKey.LOGITS, Category.ACTIVATIONS, logits * d.compute,
                  f"B x num_labels x {d.compute} B, until the loss is computed", CLASSIFIER_SOURCE),
             Term(TermKey.LOSS, Category.ACTIVATIONS, logits * loss_bytes,
                  f"B x num_labels x {loss_bytes} B log-softmax", CLASSIFIER_SOURCE)]
    if setup.precision.is_autocast:
        wrapped = setup.checkpointing.checkpointed_blocks(spec.num_layers)
        head_weight = heads.head_weight_elems(spec)
        blocks = (linear_weight_elems(spec, setup) - head_weight) * (spec.num_layers - wrapped) // spec.num_layers
        terms.append(Term(TermKey.AUTOCAST_WEIGHT_COPIES, Category.ACTIVATIONS, 2 * (head_weight + blocks),
                          "2 B x Linear weights: bf16 casts cached by autocast, saved for backward",
                          "torch.autocast weight cast cache"))
    return terms


CLASSIFIER_SOURCE = ("transformers BertForSequenceClassification (CrossEntropyLoss) / GenericForSequenceClassification"
                     " (loss_utils.ForSequenceClassificationLoss -> fixed_cross_entropy)")
CHUNKED_SOURCE = ("torchtune CEWithChunkedOutputLoss (num_output_chunks=8: head per sequence chunk, "
                  "F.cross_entropy(chunk.float(), reduction='sum') per chunk); memfit._torch.step.chunked_loss")
FUSED_SOURCE = ("Liger LigerFusedLinearCrossEntropyFunction (ops/fused_linear_cross_entropy.py: gradients made in "
                "forward, chunk_size = next_power_of_2(ceil(BT / ceil(V / H)))); measured on memfit's pure-torch "
                "reference, memfit._torch.step.FusedLinearCrossEntropy")


def _fused_loss_terms(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes) -> list[Term]:
    """What the fused loss keeps from forward to backward: the gradient of the hidden states (their dtype) and of
    the head weight (its dtype), made in forward chunk by chunk; no logits, no log-softmax, no labels."""
    tokens, h = setup.tokens_per_micro_step, spec.hidden_size
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
    return [Term(TermKey.LOSS, Category.ACTIVATIONS, tokens * h * d.residual,
                 f"B x T x h x {d.residual} B: the hidden states' gradient, made in forward", FUSED_SOURCE),
            Term(TermKey.FUSED_HEAD, Category.GRADIENTS, spec.vocab_size * h * p_bytes,
                 f"V x h x {p_bytes} B: the LM head's gradient, made in forward (it becomes .grad in backward)",
                 FUSED_SOURCE)]


def fused_chunk_rows(spec: ModelSpec, tokens: int) -> int:
    """Liger's chunk rule: ceil(V / H) chunks' worth of tokens, rounded up to a power of two, at most B x T."""
    inc = -(-spec.vocab_size // spec.hidden_size)
    rows = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(rows, tokens)


def loss_elem_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Causal LMs go through ForCausalLMLoss, which upcasts logits to fp32; BERT's MLM loss stays in the logits'
    dtype unless autocast (log_softmax runs in fp32 under autocast)."""
    if not act.logits_upcast(spec) and not setup.precision.is_autocast:
        return act.dtypes(spec, setup).compute
    return 4


def linear_weight_elems(spec: ModelSpec, setup: TrainingSetup | None = None) -> int:
    """Elements of the weights autocast keeps a bf16 copy of (its cache holds one per trainable leaf an autocast op
    casts): every trainable projection of the graph (on one tensor-parallel rank), LoRA's A and B but not their
    frozen base, not the stacked experts (grouped_mm is no autocast op); a tied LM head casts the embedding matrix.
    A model without a graph: the count read off its built copy (memfit.derive.spec), else every parameter. float8
    Linears' weights never are (memfit.estimate.float8)."""
    return sum(linear_weight_parts(spec)) - float8.converted_weight_elems(spec, setup)


def linear_weight_parts(spec: ModelSpec) -> tuple[int, int]:
    """`linear_weight_elems` as (in the stacks' blocks, all layers; outside them: the LM head, a tied head's
    embedding matrix, input / output projections), so a pipeline stage takes its layers' share and the last stage
    the rest. Without a graph everything counts as the blocks'."""
    tied = spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings and not spec.frozen else 0
    # a tied LM head casts the embedding matrix; a frozen one is no autocast-cached leaf (cached_cast needs
    # requires_grad), so under LoRA only the adapters' casts are cached
    if spec.graph is None:
        if "linear_weight_elems" not in spec.extra:
            return spec.num_params, 0  # nothing known about the layers: every parameter, an upper bound
        return int(spec.extra["linear_weight_elems"]), tied
    from ..graph import Stack
    from ..graph.kinds.linear import linear_rows
    from ..graph.model import linear_copies, tied_head_weight

    parts = [0, tied]
    for node, copies, parents in linear_copies(spec.graph):
        if node.trainable and not moe.in_stacked_experts(parents) and not tied_head_weight(parents):
            in_block = any(isinstance(p, Stack) and field == "block" for p, field in parents)
            parts[0 if in_block else 1] += linear_rows(node)[0][2] * copies
    return parts[0], parts[1]
