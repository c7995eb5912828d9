"""The analytic estimator: formulas, microseconds, no torch.

A training step has a few moments where live memory can peak. Each is built as a list of named terms; the largest
total is the step's peak and its terms are the breakdown:

- loss backward: everything forward saved + the logits the output keeps + log-softmax + its two gradients;
- first layer backward (or, with checkpointing, the recomputed layer): activations + one layer's backward temporaries;
- end of backward: all gradients allocated;
- optimizer step: parameters + gradients + states + the step's temporaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from ..diagnose import PAGED_STATES
from ..errors import ConfigError
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import (LOSS_CHUNKS, Checkpointing, Engine, Loss, Optimizer, Precision, Sharding, TrainingSetup,
                     deepspeed_casts_module, fsdp2_mixed_precision)
from . import activations as act
from . import (bnb_cpu, compiled, compiled_loss, context_parallel, deepspeed_zero3, dora, float8, fsdp2, heads,
               lora, lora_sharded, moe, offload_activations, padding, pipeline, tensor_parallel)
from .device import runtime_overhead_terms
from .notes import rule_of_thumb_notes
from .result import Category, MemoryEstimate, Phase, Term
from .static import ShardedStatic, full_static, paged_state_bytes, shard

ENGINE_SOURCE = "transformers 5.x modelling code, checked with saved_tensors_hooks on real tiny models"
SAC_SOURCE = ("torchtitan op-level SAC policy (torch.utils.checkpoint.create_selective_checkpoint_contexts); "
              "measured on real CPU steps")


def estimate(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, *,
             layout: Engine | None = None) -> MemoryEstimate:
    """Per-device peak memory of one training step of `spec` under `setup` on `hardware`.

    `layout` sizes static memory as another engine lays it out (default: `setup.engine`). memfit.verify uses it
    to compare a trace, which always runs torch's FSDP2, with the formulas on the same layout."""
    if not spec.is_transformer:
        raise ConfigError(f"'{spec.name}' has no transformer shape memfit can size analytically: "
                          "use `memfit trace` (memfit.trace.trace) for arbitrary nn.Modules")
    heads.check(spec, setup)  # a sequence classifier: the plain step only
    if setup.loss is not Loss.STANDARD and (not spec.is_decoder or spec.logit_softcap):
        raise ConfigError(f"a {setup.loss} loss is sized for causal LMs without final logit softcapping; "
                          f"'{spec.name}' needs loss standard")
    spec = lora.adapted_spec(spec, setup)
    moe.check(spec, setup)
    offload_activations.check(spec, setup)
    # MoE: formulas, not the derived model, where they size the precision the engine runs (amp-* under DeepSpeed or
    # FSDP2 runs with 16-bit parameters: _as_run); experts / ep
    spec = moe.ep_local_spec(moe.as_recipe(spec, _as_run(setup, layout or setup.engine)[0]), setup)
    spec = tensor_parallel.rank_spec(spec, setup)  # one tensor-parallel rank's shards (itself when tp is 1)
    # the step that sets the run's peak (padded batches: the longest sample's), then one context-parallel rank's
    asked, setup = setup, context_parallel.rank_setup(padding.peak_setup(setup))
    if setup.num_gpus != hardware.world_size and setup.sharding is not Sharding.NONE:
        setup = setup.replace(num_gpus=hardware.world_size)
    sized, run_notes = _as_run(setup, layout or setup.engine)
    if setup.pp > 1:  # one estimate per pipeline rank's stages; the highest is the job's (memfit.estimate.pipeline)
        pipeline.check(spec, setup)
        return pipeline.estimate(spec, asked, sized, hardware, run_notes + context_parallel.notes(asked))
    full = full_static(spec, sized)
    static = shard(spec, sized, full, layout=layout or setup.engine)
    from ..derive import stacks_estimate  # encoder-decoder / vision models: their own stacks' moments

    step_temp = full.step_temp_bytes + (bnb_cpu.step_scratch_bytes(spec, sized) if hardware.is_cpu else 0)
    moments = (stacks_estimate.moments if stacks_estimate.is_stacked(spec, sized) else _moments)(
        spec, sized, static, step_temp, hardware.is_cpu)
    if asked.cp > 1:  # ring attention's buffers beside every block's backward (memfit.estimate.context_parallel)
        ring = context_parallel.ring_term(spec, asked, act.dtypes(spec, sized, hardware.is_cpu).compute)
        moments = {name: (ph, t + [ring] if any(x.name == "temporaries/layer_backward" for x in t) else t)
                   for name, (ph, t) in moments.items()}
    moments = float8.with_backward_term(moments, spec, sized, hardware.is_cpu)  # memfit.estimate.float8
    compute_bytes = act.dtypes(spec, sized, hardware.is_cpu).compute
    moments = deepspeed_zero3.adjust_moments(moments, spec, sized, compute_bytes)  # memfit.estimate.deepspeed_zero3
    phase_peaks = {phase: max(_total(t) for name, (ph, t) in moments.items() if ph is phase)
                   for phase in Phase if any(ph is phase for ph, _ in moments.values())}
    peak_name = max(moments, key=lambda n: _total(moments[n][1]))
    phase, terms = moments[peak_name]
    terms = [t for t in terms if t.num_bytes > 0]
    in_allocator = [t for t in terms if t.device_figure == "allocated"]
    offloaded = _activation_host(spec, sized, hardware.is_cpu)
    terms += runtime_overhead_terms(_total(in_allocator), setup, hardware, spec=spec, terms=in_allocator,
                                    offload=offloaded)
    return MemoryEstimate(
        terms=tuple(terms), peak_phase=phase, method="analytic", setup=asked, phase_peaks=phase_peaks,
        cpu_bytes=static.cpu_bytes + offloaded.host_bytes,
        notes=tuple(rule_of_thumb_notes(spec, sized)) + static.notes + run_notes
        + offload_activations.host_term_notes(offloaded)
        + _derived_notes(spec) + moe.notes(spec, sized, hardware.is_cpu) + context_parallel.notes(asked)
        + compiled.notes(spec, sized) + padding.notes(asked) + float8.notes(spec, sized),
        model_name=spec.name,
        device_name=hardware.gpu.name, moe=moe.routing_range(spec, sized, hardware.is_cpu))


def _activation_host(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool) -> offload_activations.OffloadSizes:
    """What activation offloading moves to the host (nothing without it, nor on a CPU device, where the saved tensors
    are in host memory already): memfit.estimate.offload_activations."""
    if not offload_activations.applies(setup) or on_cpu:
        return offload_activations.OffloadSizes(0, 0, 0, 0, 0)
    return offload_activations.sizes(spec, setup, forward_activation_terms(spec, setup, on_cpu))


def forward_activation_terms(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> list[Term]:
    """The activation terms alive at the end of forward (before any offloading)."""
    per_layer = act.layer_saved_bytes(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
    return _activation_terms(spec, setup, per_layer, act.dtypes(spec, setup, on_cpu))


def _derived_notes(spec: ModelSpec) -> tuple[str, ...]:
    if spec.derived is None:
        return ()
    from .. import derive
    why = act.saved_problem(spec.graph) if spec.graph is not None else None
    return ((f"no activation formula for its model graph ({why}): derived instead",) if why else ()) + derive.notes(spec)


def _as_run(setup: TrainingSetup, layout: Engine) -> tuple[TrainingSetup, tuple[str, ...]]:
    """The setup whose bytes the engine really has: amp-* under torch's FSDP2 runs as a MixedPrecisionPolicy
    (memfit.setup.fsdp2_mixed_precision), which is bf16-master's layout, not autocast's."""
    if not setup.precision.is_autocast:
        return setup, ()
    deepspeed = layout is Engine.DEEPSPEED and (setup.sharding is not Sharding.NONE or setup.offload.value != "none")
    if deepspeed:  # adapters too: memfit.setup.deepspeed_casts_module
        return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
            f"{setup.precision} under DeepSpeed runs as its {setup.precision.compute_dtype} mode (the config memfit "
            f"emits: {setup.precision.compute_dtype}.enabled): the engine casts the model to "
            f"{setup.precision.compute_dtype} and keeps fp32 master weights in the optimizer, with no autocast "
            "cache; sized like bf16-master",)
    if not fsdp2_mixed_precision(setup, layout):
        return setup, ()
    shards = ("the adapters' fp32 shards (the frozen base keeps its storage dtype)" if setup.finetune.adapters
              else "fp32 shards")
    return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
        f"{setup.precision} under FSDP2 runs as MixedPrecisionPolicy(param_dtype={setup.precision.compute_dtype}, "
        f"reduce_dtype=fp32), as memfit's torch engine shards it: {shards}, low-precision compute, no autocast "
        "cache; sized like bf16-master",)


def _total(terms: list[Term]) -> int:
    return sum(t.num_bytes for t in terms)


def _static_terms(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, grads: int,
                  on_cpu: bool = False) -> list[Term]:
    n = setup.shard_size  # the data-parallel ranks, or the HSDP shard group
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
    shard_note = f" / {n} ranks" if setup.sharding.stage >= 3 else ""
    if spec.frozen:
        a_bytes = lora.adapter_bytes(setup)
        terms = [Term("parameters", Category.PARAMETERS, static.params_bytes,
                      f"trainable P={spec.num_params:,} (LoRA adapters) x {a_bytes} B "
                      f"({'fp32' if a_bytes == 4 else '16-bit'})",
                      "DeepSpeed engine module.bfloat16() / .half()" if deepspeed_casts_module(setup) else
                      "torchtune LoRALinear: adapters in the model's dtype" if setup.finetune.torchtune else
                      "peft get_peft_model(autocast_adapter_dtype=True): adapters upcast to fp32"),
                 Term("parameters/frozen", Category.PARAMETERS, static.frozen_bytes,
                      f"{spec.num_frozen_params:,} frozen base parameters as stored "
                      f"({lora.base_label(spec, setup)})" + (f", FSDP2 shards / {n} ranks" if static.fsdp else ""),
                      lora.BASE_SOURCE + ("; " + lora_sharded.SOURCE if static.fsdp else ""))]
    else:
        terms = [Term("parameters", Category.PARAMETERS, static.params_bytes,
                      f"P={spec.num_params:,} x {p_bytes} B ({setup.precision.param_dtype}){shard_note}",
                      "ZeRO paper sec. 3.1; exact P from the model's parameter tensors")]
    if spec.buffer_bytes:
        terms.append(Term("parameters/buffers", Category.PARAMETERS, spec.buffer_bytes,
                          "the model's buffers as built (sin/cos position tables), never trained",
                          "the built model's named_buffers()"))
    if static.param_working_set_bytes:
        what = ("every block, gathered from its forward to its backward" if setup.sharding is Sharding.ZERO2 else
                "unsharded root (embeddings, head) + the block being computed")
        source = "FSDP2 all-gather"
        if setup.engine is Engine.DEEPSPEED:
            what = ("what is fetched again in backward within stage3_max_reuse_distance (1e9 elements) of its "
                    "forward, at least the block being computed, besides the persistent parameters")
            source = "DeepSpeed partitioned_param_coordinator.py __params_to_release (memfit.estimate.deepspeed_zero3)"
        terms.append(Term("parameters/gathered", Category.PARAMETERS, static.param_working_set_bytes, what, source))
    if grads:
        g_note = f" / {n} ranks" if setup.sharding.stage >= 2 else ""
        g_bytes = lora.adapter_bytes(setup) if spec.frozen else p_bytes
        terms.append(Term("gradients", Category.GRADIENTS, grads, f"P x {g_bytes} B{g_note}", "ZeRO paper sec. 3.1"))
    if static.comm_buffers_bytes:
        terms.append(Term("gradients/comm_buffers", Category.GRADIENTS, static.comm_buffers_bytes,
                          "DDP gradient buckets (1 x gradients)" if setup.engine.value == "torch" else
                          "DeepSpeed reduce bucket: hidden^2 elements (HF 'auto')",
                          "torch DistributedDataParallel / DeepSpeed ZeRO stage 1-2 (ZeRO-3: its ipg bucket, "
                          "stage3.py), measured on 2 gloo ranks"))
    if static.optimizer_bytes:
        o_note = f" / {n} ranks" if setup.sharding.stage >= 1 else ""
        shards = n if setup.sharding.stage >= 1 else 1
        paged = 0 if on_cpu else min(static.optimizer_bytes, paged_state_bytes(spec, setup) // shards)
        terms.append(Term("optimizer/states", Category.OPTIMIZER, static.optimizer_bytes - paged,
                          f"{setup.optimizer}{' + fp32 master weights' if setup.precision.master_weights else ''}"
                          f"{o_note}{' (the part in the caching allocator)' if paged else ''}",
                          "torch.optim / bitsandbytes / torchao / transformers Adafactor state layout"))
        if paged:
            terms.append(Term(PAGED_STATES, Category.OPTIMIZER, paged,
                              f"{setup.optimizer} states of tensors >= 1e5 elements{o_note}: CUDA unified memory "
                              "(cudaMallocManaged), outside torch's allocator; device memory while resident, "
                              "evicted to host RAM under memory pressure (slower steps, no OOM)",
                              "bitsandbytes Optimizer8bit.get_state_buffer / functional.get_paged", figure="outside"))
    return terms


CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state(): the CPU generator's mt19937 state as a uint8 tensor (ATen CPUGeneratorImpl::get_state)."""


def _activation_terms(spec: ModelSpec, setup: TrainingSetup, per_layer: dict[str, int], d: act.Dtypes) -> list[Term]:
    """Terms alive at the end of forward (and so at the start of backward)."""
    tokens, seq, on_cpu = setup.tokens_per_micro_step, setup.seq_len, d.on_cpu
    layers = spec.num_layers
    mode = setup.checkpointing
    ckpt = mode is Checkpointing.FULL
    wrapped = mode.checkpointed_blocks(layers)  # blocks under torch.utils.checkpoint
    terms = []
    if wrapped or act.core_recomputed(setup):
        mask = act.checkpointed_mask_bytes(spec, setup, tokens, seq)
        # sequence parallelism: a block's input is the residual stream, sharded over the sequence between the TP
        # ranks (torchtitan's SequenceParallel norms leave it Shard(1)); checkpoint keeps that local shard
        inputs = wrapped * tokens * spec.hidden_size * d.residual // tensor_parallel.sequence_share(setup)
        if inputs or mask:
            what = (f"{'L' if wrapped == layers else wrapped} x B x T x h (each checkpointed block's input)"
                    if inputs else "")
            what += (" + " if what else "") + "the B x T x T eager mask" if mask else ""
            terms.append(Term("activations/checkpoints", Category.ACTIVATIONS, inputs + mask, what,
                              "torch.utils.checkpoint, non-reentrant"))
        if wrapped and on_cpu:  # on CUDA the stashed generator states live in host memory
            terms.append(Term("activations/rng_states", Category.ACTIVATIONS, wrapped * CPU_RNG_STATE_BYTES,
                              "each checkpointed block's torch.get_rng_state() (5,056 B Mersenne Twister state)",
                              "torch.utils.checkpoint preserve_rng_state=True"))
        int8 = lora.int8_checkpointed_inputs(spec, setup, tokens, seq, d) if spec.frozen and ckpt else 0
        if int8:
            terms.append(Term("activations/int8_inputs", Category.ACTIVATIONS, int8,
                              "every int8 Linear's input, kept as ctx.A by bitsandbytes' CPU int8 matmul",
                              "bitsandbytes MatMul8bitFp (CPU)"))
    if mode is Checkpointing.SELECTIVE_OP:
        kept = act.selective_kept_bytes(spec, setup, tokens, seq, on_cpu)
        terms.append(Term("activations/selective_kept", Category.ACTIVATIONS, layers * kept,
                          "L x (the 1st, 3rd, ... matmul outputs of a block + the SDPA output and log-sum-exp)",
                          SAC_SOURCE))
    elif wrapped < layers:
        first = int(lora.first_layer_unsaved(spec, setup, d) * tokens)
        plain = layers - wrapped
        count = "L" if plain == layers else f"{plain} of L"
        unsaved = lora.first_layer_groups(spec, first, per_layer, plain)
        for group, label in (("attention", "attention"), ("mlp", "mlp"), ("norms", "norms/residual")):
            total = plain * per_layer[group] - unsaved.get(group, 0)
            formula = f"{count} x saved {group} tensors per layer" + (
                " (layer 0's first norm keeps nothing: no gradient flows into it)" if first and group == "norms"
                else "")
            if group == "attention" and act.core_recomputed(setup):
                formula += " (the checkpointed eager core keeps its q, k, v inputs and output, no T x T)"
            terms.append(Term(f"activations/{label}", Category.ACTIVATIONS, total, formula, ENGINE_SOURCE))
    fused = setup.loss is Loss.FUSED
    head = act.head_saved_bytes(spec, setup, tokens, head_input=not fused)["head"]
    # + input_ids and labels (one per token, one per sequence for a classifier)
    emb = act.embedding_saved_bytes(spec, setup, tokens, seq, on_cpu) + 8 * (tokens + heads.label_elems(spec, setup))
    terms.append(Term("activations/embeddings", Category.ACTIVATIONS, emb,
                      "token ids, labels, position tables", ENGINE_SOURCE))
    terms.append(Term("activations/head", Category.ACTIVATIONS, head,
                      "final norm" + ("" if fused else " and LM-head input (BERT: MLM transform)")
                      if heads.classifier(spec) is None else "final norm and the classification head's inputs "
                      "(BERT: pooler, dropout, classifier)", ENGINE_SOURCE))
    if heads.classifier(spec) is not None:
        return terms + _classifier_terms(spec, setup, d)
    vocab = spec.vocab_size * tokens
    if fused:
        terms += _fused_loss_terms(spec, setup, d)
        if setup.precision.is_autocast:
            copies = 2 * (_linear_weight_elems(spec, setup) if not ckpt else spec.vocab_size * spec.hidden_size)
            copies -= 2 * spec.vocab_size * spec.hidden_size  # the head's cast is only cached, never saved
            terms.append(Term("activations/autocast_weight_copies", Category.ACTIVATIONS, copies,
                              "2 B x Linear weights but the LM head's: bf16 casts cached by autocast, saved for "
                              "backward", "torch.autocast weight cast cache"))
        return terms
    logits = vocab * d.compute
    if spec.logit_softcap:
        terms.append(Term("activations/logit_softcap", Category.ACTIVATIONS, logits,
                          f"B x T x V x {d.compute} B: tanh(logits / cap), kept for backward",
                          "transformers Gemma2ForCausalLM final_logit_softcapping"))
    chunked = setup.loss is Loss.CHUNKED
    terms.append(Term("activations/logits", Category.ACTIVATIONS, logits,
                      f"B x T x V x {d.compute} B, until the loss is computed" + (
                          f" (all {LOSS_CHUNKS} chunks: the model returns them as a list)" if chunked else ""),
                      CHUNKED_SOURCE if chunked else
                      "HF CausalLMOutput; freed before backward when only the loss is kept (HF Trainer)"))
    loss_bytes = _loss_elem_bytes(spec, setup)
    loss = Term("activations/loss", Category.ACTIVATIONS, vocab * loss_bytes + 8 * tokens,
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
    terms += moe.terms(spec, setup, d)
    if setup.precision.is_autocast:
        head_weight = spec.vocab_size * spec.hidden_size
        copies = 2 * (head_weight + (_linear_weight_elems(spec, setup) - head_weight) * (layers - wrapped) // layers)
        if setup.compile and not compiled.unsized(spec, setup):  # a compiled block casts its weights in its graph
            copies = 2 * head_weight  # (the casts it saves are in its own bytes): only the eager head's is cached
        if spec.frozen:
            copies = lora.autocast_copies(spec, setup, ckpt)
        terms.append(Term("activations/autocast_weight_copies", Category.ACTIVATIONS, copies,
                          "2 B x Linear weights: bf16 casts cached by autocast, saved for backward",
                          "torch.autocast weight cast cache"))
    return terms


def _classifier_terms(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes) -> list[Term]:
    """A sequence classifier's logits and loss: B x num_labels each (log-softmax in fp32 under autocast), the labels
    counted with the embeddings; its weights' autocast casts, all of them saved for backward."""
    logits = heads.logits_elems(spec, setup)
    loss_bytes = _loss_elem_bytes(spec, setup)
    terms = [Term("activations/logits", Category.ACTIVATIONS, logits * d.compute,
                  f"B x num_labels x {d.compute} B, until the loss is computed", CLASSIFIER_SOURCE),
             Term("activations/loss", Category.ACTIVATIONS, logits * loss_bytes,
                  f"B x num_labels x {loss_bytes} B log-softmax", CLASSIFIER_SOURCE)]
    if setup.precision.is_autocast:
        wrapped = setup.checkpointing.checkpointed_blocks(spec.num_layers)
        head_weight = heads.head_weight_elems(spec)
        blocks = (_linear_weight_elems(spec, setup) - head_weight) * (spec.num_layers - wrapped) // spec.num_layers
        terms.append(Term("activations/autocast_weight_copies", Category.ACTIVATIONS, 2 * (head_weight + blocks),
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
    return [Term("activations/loss", Category.ACTIVATIONS, tokens * h * d.residual,
                 f"B x T x h x {d.residual} B: the hidden states' gradient, made in forward", FUSED_SOURCE),
            Term("gradients/fused_head", Category.GRADIENTS, spec.vocab_size * h * p_bytes,
                 f"V x h x {p_bytes} B: the LM head's gradient, made in forward (it becomes .grad in backward)",
                 FUSED_SOURCE)]


def _fused_chunk_rows(spec: ModelSpec, tokens: int) -> int:
    """Liger's chunk rule: ceil(V / H) chunks' worth of tokens, rounded up to a power of two, at most B x T."""
    inc = -(-spec.vocab_size // spec.hidden_size)
    rows = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(rows, tokens)


def _loss_elem_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Causal LMs go through ForCausalLMLoss, which upcasts logits to fp32; BERT's MLM loss stays in the logits'
    dtype unless autocast (log_softmax runs in fp32 under autocast)."""
    if not act.logits_upcast(spec) and not setup.precision.is_autocast:
        return act.dtypes(spec, setup).compute
    return 4


def _head_grads(spec: ModelSpec, static: ShardedStatic) -> int:
    """Gradient bytes of the LM head, the first weight whose gradient backward makes (none for a frozen head)."""
    if spec.frozen:
        return 0
    return static.grads_bytes * heads.head_weight_elems(spec) // max(spec.num_params, 1)


def _linear_weight_elems(spec: ModelSpec, setup: TrainingSetup | None = None) -> int:
    """Elements of the weights autocast keeps a bf16 copy of (its cache holds one per trainable leaf an autocast op
    casts): every trainable projection of the graph (on one tensor-parallel rank), LoRA's A and B but not their
    frozen base, not the stacked experts (grouped_mm is no autocast op); a tied LM head casts the embedding matrix.
    A model without a graph: the count read off its built copy (memfit.derive.spec), else every parameter. float8
    Linears' weights never are (memfit.estimate.float8)."""
    return sum(linear_weight_parts(spec)) - float8.converted_weight_elems(spec, setup)


def linear_weight_parts(spec: ModelSpec) -> tuple[int, int]:
    """`_linear_weight_elems` as (in the stacks' blocks, all layers; outside them: the LM head, a tied head's
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


@dataclass(frozen=True)
class _Step:
    """What every moment of the step is built from."""

    spec: ModelSpec
    setup: TrainingSetup
    static: ShardedStatic
    acts: list[Term]
    per_layer: dict[str, int]
    dtypes: act.Dtypes

    @property
    def tokens(self) -> int:
        return self.setup.tokens_per_micro_step

    def static_terms(self, grads: int, static: ShardedStatic | None = None) -> list[Term]:
        return _static_terms(self.spec, self.setup, static or self.static, grads, self.dtypes.on_cpu)

    def acts_except(self, *names: str) -> list[Term]:
        return [t for t in self.acts if t.name not in names]

    def recomputed_block(self, what: str, kept_counted: bool = True) -> Term:
        """One block rebuilt in its backward. Under selective-op the block's kept outputs are handed back to the
        recompute, not made again: beside a `selective_kept` term that still counts them, they are subtracted."""
        casts = lora.recomputed_casts(self.spec, self.setup) if self.spec.frozen else 0
        if casts:
            what += "; its adapters' bf16 casts, made again by autocast in the recompute"
        rebuilt = sum(self.per_layer.values()) + casts
        if self.setup.checkpointing is Checkpointing.SELECTIVE_OP and kept_counted:
            rebuilt -= act.selective_kept_bytes(self.spec, self.setup, self.tokens, self.setup.seq_len,
                                                self.dtypes.on_cpu)
            what += ", less its kept matmul / SDPA outputs (counted in activations/selective_kept, reused)"
        return Term("activations/recomputed_block", Category.ACTIVATIONS, rebuilt, what, "torch.utils.checkpoint")

    def attention_backward_dominates(self, rebuilt_core: bool = False) -> bool:
        """Whether a block's backward peaks in its (eager) attention rather than its MLP."""
        if self.spec.derived is not None:  # the derived temporaries are the block's whole backward peak
            return False
        d, spec, setup = self.dtypes, self.spec, self.setup
        attention = act.attention_backward_bytes(spec, setup, self.tokens, setup.seq_len, d.on_cpu)
        if rebuilt_core:
            attention += act.rebuilt_core_bytes(spec, setup, self.tokens, setup.seq_len, d.on_cpu)
        mlp = self.tokens * spec.intermediate_size * d.compute * act.activation_backward_factor(spec)
        return attention - self.per_layer["mlp"] - self.per_layer["norms"] // 2 > mlp

    def layer_temporaries(self, rebuilt_core: bool = False) -> Term:
        """Gradients a block's backward allocates beyond what it frees as it goes: the residual-stream gradients,
        then the larger of the MLP's input gradients and (eager) the T x T gradients once the MLP's saved tensors
        are gone. Checked on measured CPU steps (bench/accuracy.py)."""
        if self.spec.derived is not None:
            from .. import derive
            return Term("temporaries/layer_backward", Category.TEMPORARIES, derive.block_temporaries(
                self.spec, self.setup, self.tokens, self.setup.seq_len, self.dtypes.on_cpu),
                "peak of one block's backward beyond its saved tensors, fitted from traces", "memfit.derive")
        d, spec, setup = self.dtypes, self.spec, self.setup
        if moe.applies(spec, setup):
            a2a = moe.all_to_all_bytes(spec, setup, d)
            return Term("temporaries/layer_backward", Category.TEMPORARIES,
                        moe.block_temporaries(spec, setup, self.tokens, d) + a2a,
                        "3 x B x T x h + T x k x 2h (rows' gradients net of the freed) + E/ep x h x I (down "
                        "weight gradient), balanced routing" + (" + EP all-to-all dispatch/combine buffers "
                                                                 "(2 x T x k x h)" if a2a else ""), moe.SOURCE)
        attention = act.attention_backward_bytes(spec, setup, self.tokens, setup.seq_len, d.on_cpu)
        core = act.rebuilt_core_bytes(spec, setup, self.tokens, setup.seq_len, d.on_cpu) if rebuilt_core else 0
        attention_extra = max(0, attention + core - self.per_layer["mlp"] - self.per_layer["norms"] // 2)
        mlp = self.tokens * spec.intermediate_size * d.compute * act.activation_backward_factor(spec)
        residual = self.tokens * 2 * spec.hidden_size * d.residual // tensor_parallel.sequence_share(setup)
        if setup.sequence_parallel:
            # the gradient of a gathered layer input, whole, until its reduce-scatter back to the sequence shard
            residual += self.tokens * spec.hidden_size * d.compute
        formula = "2 x B x T x h (residual grads) + the larger of B x T x I (MLP input grad) and the eager T x T "
        formula += "gradients beyond the freed MLP tensors"
        if core:
            formula += " (with the checkpointed eager core's T x T tensors rebuilt beside them)"
        dequantized = lora.dequantized_weight_bytes(spec, setup) if spec.frozen else 0
        if dequantized:
            formula += " + the largest quantized weight, dequantized (bitsandbytes MatMul4Bit / int8 backward)"
        return Term("temporaries/layer_backward", Category.TEMPORARIES,
                    residual + max(mlp, attention_extra) + dequantized, formula, "autograd of one block")


# Saved by the head and the loss: gone once the head's backward has run.
_HEAD_AND_LOSS = ("activations/logits", "activations/loss", "activations/head", "activations/logit_softcap",
                  "gradients/fused_head")


def _moments(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, step_temp: int, on_cpu: bool) -> dict:
    saved_by_block = compiled.layer_saved_bytes if setup.compile else act.layer_saved_bytes  # torch.compile
    per_layer = saved_by_block(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
    dtypes = act.dtypes(spec, setup, on_cpu)
    step = _Step(spec, setup, static, _activation_terms(spec, setup, per_layer, dtypes), per_layer, dtypes)
    # gradients live through forward when accumulation keeps them, when the engine pre-allocates the partition, or
    # when zero_grad(set_to_none=False) only zeroes them (setup.keep_zeroed_grads)
    early_grads = static.grads_bytes if (setup.grad_accum_steps > 1 or static.grads_preallocated
                                         or setup.keep_zeroed_grads) else 0
    if setup.optimizer_in_backward:
        early_grads = 0
    forward = step.static_terms(early_grads) + step.acts
    moments = {
        "forward end": (Phase.FORWARD, forward),
        "loss forward": (Phase.FORWARD, _loss_forward(step, forward)),
        "loss backward": (Phase.BACKWARD, _loss_backward(step, forward)),
        "first block backward": (Phase.BACKWARD, _first_block_backward(step, early_grads)),
        "second block backward": (Phase.BACKWARD, _second_block_backward(step, early_grads)),
        "end of backward": (Phase.BACKWARD, _end_of_backward(step)),
        "embedding gradient": (Phase.BACKWARD, _embedding_gradient(step)),
        "root reduce-scatter": (Phase.BACKWARD, _root_reduce(step)),
        "optimizer step": (Phase.OPTIMIZER, _optimizer_step(step, step_temp)),
    }
    if setup.loss is Loss.FUSED or getattr(heads.classifier(spec), "pool", "") == "last":
        # no B x T x V logits gradient before it (fused loss, a classifier's B x num_labels): the final norm's
        # backward chain can be the peak
        moments["final norm backward"] = (Phase.BACKWARD, _final_norm_backward(step, early_grads))
    if setup.optimizer_in_backward:
        moments.update(_in_backward_moments(step))
    if spec.frozen and setup.checkpointing is Checkpointing.FULL and static.fsdp is None:
        moments.update(lora.checkpointed_moments(step, moments))
    if spec.frozen and setup.finetune.dora:
        moments["DoRA weight norm"] = (Phase.FORWARD, dora.forward_moment(step, forward))
    if offload_activations.applies(setup) and not on_cpu:  # on a CPU device there is nowhere to move them
        moments = offload_activations.on_device(moments, spec, setup, step.acts)
    return moments


def _chunk_tokens(setup: TrainingSetup) -> list[int]:
    """Tokens of each of the chunked loss's chunks, in the order backward meets them (the last chunk first):
    torch.tensor_split along the sequence gives the first T mod K chunks one position more."""
    quotient, remainder = divmod(setup.seq_len, LOSS_CHUNKS)
    sizes = [setup.micro_batch_size * (quotient + (i < remainder)) for i in range(LOSS_CHUNKS)]
    return [n for n in reversed(sizes) if n]


def _loss_forward(step: _Step, forward: list[Term]) -> list[Term]:
    """Inside the loss, still under autocast: ForCausalLMLoss upcasts the logits (`logits.float()`, a new fp32 tensor
    beside the log-softmax it feeds), and autocast's cache still holds every Linear weight's cast: under checkpointing
    these are not saved for backward, but live until the autocast region (forward and loss) exits. The chunked loss
    upcasts one chunk at a time (the last, once every other chunk's log-softmax is saved); the fused loss holds one
    chunk of logits (and, under autocast, the reference's fp32 copy of it for the head-weight gradient)."""
    spec, setup = step.spec, step.setup
    if setup.loss is Loss.FUSED:
        return _fused_loss_forward(step, forward)
    if not spec.is_decoder or step.dtypes.compute == 4 or heads.classifier(spec) is not None:
        return []  # only ForCausalLMLoss upcasts the logits
    upcast = spec.vocab_size * (max(_chunk_tokens(setup)) if setup.loss is Loss.CHUNKED else step.tokens) * 4
    if compiled_loss.applies(setup):
        upcast = 0  # read inside inductor's fused reduction kernels, never written (memfit.estimate.compiled_loss)
    what = "one chunk of the logits" if setup.loss is Loss.CHUNKED else "B x T x V x 4 B: the logits"
    terms = list(forward) + [Term("temporaries/logits_fp32", Category.TEMPORARIES, upcast,
                                  f"{what} upcast for the loss, until log-softmax has run",
                                  CHUNKED_SOURCE if setup.loss is Loss.CHUNKED else
                                  "transformers loss_utils.ForCausalLMLoss (logits.float())")]
    if setup.precision.is_autocast and setup.checkpointing.checkpointed_blocks(spec.num_layers):
        cached = 2 * _linear_weight_elems(spec, setup)
        terms = [replace(t, num_bytes=cached, formula="2 B x Linear weights: autocast's cast cache, until it exits")
                 if t.name == "activations/autocast_weight_copies" else t for t in terms]
    return terms


def _fused_loss_forward(step: _Step, forward: list[Term]) -> list[Term]:
    spec, setup, d = step.spec, step.setup, step.dtypes
    rows = _fused_chunk_rows(spec, step.tokens)
    extra = 4 if setup.precision.is_autocast else 0
    terms = list(forward) + [Term(
        "temporaries/loss_chunk", Category.TEMPORARIES, rows * spec.vocab_size * (d.compute + extra),
        f"{rows} tokens x V x {d.compute} B: one chunk's logits, overwritten by their gradient"
        + (" + its fp32 copy for the head-weight gradient (the reference; Liger's CUDA addmm(out_dtype=fp32) "
           "makes none)" if extra else ""), FUSED_SOURCE)]
    if setup.precision.is_autocast:  # autocast's cache holds every Linear weight's cast, the head's too
        cached = 2 * _linear_weight_elems(spec, setup)
        terms = [replace(t, num_bytes=cached, formula="2 B x Linear weights: autocast's cast cache, until it exits")
                 if t.name == "activations/autocast_weight_copies" else t for t in terms]
    return terms


def _loss_backward(step: _Step, forward: list[Term]) -> list[Term]:
    """Log-softmax backward: its output and two B x T x V gradients. The Trainer keeps only the loss, so the logits
    are gone by then (a loop that holds `outputs` through backward adds B x T x V x dtype here). The fused loss
    makes nothing here (its gradients exist already); the chunked one runs chunk by chunk (`_chunked_backward`)."""
    if step.setup.loss is Loss.FUSED:
        return []
    if step.setup.loss is Loss.CHUNKED:
        return _chunked_loss_backward(step, forward)
    if compiled_loss.whole(step.setup):  # the kept logits and their one gradient (memfit.estimate.compiled_loss)
        return list(forward) + [compiled_loss.backward_term(step.spec, step.setup, step.dtypes.compute)]
    loss_bytes = _loss_elem_bytes(step.spec, step.setup)
    if step.setup.tp > 1:
        # torch.distributed.tensor.parallel.loss_parallel fuses nll and log-softmax backward as
        # (zeros_like(x) with -1 at the targets + exp(x)) * grad: three vocab-sharded tensors at once
        loss_tmp = Term("temporaries/loss_backward", Category.TEMPORARIES,
                        3 * step.spec.vocab_size * step.tokens * loss_bytes,
                        f"3 x B x T x V/tp x {loss_bytes} B: loss_parallel's one-hot gradient, exp(log-softmax), "
                        "their sum times the loss gradient", "torch.distributed.tensor.parallel.loss "
                        "_nll_loss_and_log_softmax_backward (torch 2.13), measured on 2 gloo ranks")
        return [t for t in forward if t.name != "activations/logits"] + [loss_tmp]
    loss_tmp = Term("temporaries/loss_backward", Category.TEMPORARIES,
                    2 * heads.logits_elems(step.spec, step.setup) * loss_bytes,
                    f"2 x B x T x V x {loss_bytes} B: gradients of log-softmax and of the logits"
                    if heads.classifier(step.spec) is None else
                    f"2 x B x num_labels x {loss_bytes} B: gradients of log-softmax and of the logits",
                    "aten log_softmax_backward")
    return [t for t in forward if t.name != "activations/logits"] + [loss_tmp]


def _chunked_loss_backward(step: _Step, forward: list[Term]) -> list[Term]:
    """The chunked loss's backward, one chunk at a time from the last: its log-softmax backward (two chunk x V fp32
    gradients beside every log-softmax output not yet consumed), then its LM-head matmul backward (the logits'
    gradient in the compute dtype, a V x h weight gradient added into autograd's buffer for the head weight, and a
    chunk x h input gradient that waits, with the others, for tensor_split's backward). The worst of these."""
    spec, setup, d = step.spec, step.setup, step.dtypes
    vocab, h = spec.vocab_size, spec.hidden_size
    head_grad = vocab * h * (d.compute if setup.precision.param_dtype == "fp32" else 2)
    if not setup.precision.is_autocast and setup.precision.param_dtype == "fp32":
        head_grad = vocab * h * 4
    if spec.frozen and not any(p.name.endswith("lm_head.modules_to_save.weight") for p in spec.params):
        head_grad = 0  # LoRA: the frozen head has no weight gradient to accumulate (measured, tests/test_lora.py)
    base = [t for t in forward if t.name not in ("activations/logits", "activations/loss")]
    saved_total = next(t for t in forward if t.name == "activations/loss")
    if compiled_loss.chunks(setup):
        logits = next(t for t in forward if t.name == "activations/logits")
        return compiled_loss.backward_terms(base, logits, saved_total, _chunk_tokens(setup), vocab, h, d.compute,
                                            d.residual, 0 if spec.frozen else head_grad)  # a frozen head: none
    labels = 8 * step.tokens
    best: tuple[int, list[Term]] | None = None
    done = 0
    for index, n in enumerate(_chunk_tokens(setup)):
        buffered = head_grad if index else 0
        hidden = done * h * d.residual
        saved = saved_total.num_bytes - labels - 4 * vocab * done
        candidates = [
            (saved, 2 * 4 * vocab * n, "2 x chunk x V x 4 B: gradients of log-softmax and of the chunk's logits",
             buffered, hidden),
            (saved - 4 * vocab * n, vocab * n * d.compute + n * h * d.compute,
             f"chunk x V x {d.compute} B logits gradient + chunk x h input gradient", buffered + head_grad, hidden)]
        if d.compute != 4:
            candidates.append((saved - 4 * vocab * n, vocab * n * (4 + d.compute),
                               f"chunk x V x 4 B gradient and its {d.compute} B cast", buffered, hidden))
        for saved_now, temp, what, grads, hidden_now in candidates:
            terms = base + [
                replace(saved_total, num_bytes=saved_now + labels,
                        formula="the log-softmax outputs of the chunks whose backward has not run + labels"),
                Term("temporaries/loss_backward", Category.TEMPORARIES, temp, what, CHUNKED_SOURCE),
                Term("temporaries/head_gradient", Category.TEMPORARIES, grads,
                     "V x h gradient of the head weight, summed over the chunks in autograd's input buffer "
                     "(while one more is added)", "autograd InputBuffer accumulation"),
                Term("temporaries/hidden_gradients", Category.TEMPORARIES, hidden_now,
                     "the finished chunks' B x chunk x h input gradients, until tensor_split's backward",
                     "autograd InputBuffer of SplitBackward")]
            total = _total(terms)
            if best is None or total > best[0]:
                best = (total, terms)
        done += n
    return best[1] if best else []


def _first_block_backward(step: _Step, early_grads: int) -> list[Term]:
    """The last block's backward: every block's activations, the head's gradients, one block's temporaries (and,
    with checkpointing, that block rebuilt). Under FSDP2 the head's and the block's gradients are unsharded."""
    spec, static = step.spec, step.static
    if static.fsdp is not None:
        terms = step.static_terms(early_grads) + fsdp2.block_backward_terms(static.fsdp, first=True)
    else:
        head = _head_grads(spec, static)
        if step.setup.optimizer_in_backward and not spec.tie_word_embeddings:
            head = 0  # stepped and freed right after the head's backward
        grads = head + _down_projection_grads(step)
        if act.core_recomputed(step.setup) and step.attention_backward_dominates(rebuilt_core=True):
            grads += static.grads_bytes * _block_mlp_params(spec) // max(spec.num_params, 1)  # its MLP's are made
        terms = step.static_terms(max(early_grads, grads))
    terms += step.acts_except(*_HEAD_AND_LOSS)
    terms.append(step.layer_temporaries(rebuilt_core=True))
    if step.setup.checkpointing.checkpointed(spec.num_layers - 1):
        terms.append(step.recomputed_block("one block's saved tensors, rebuilt during backward"))
    return terms


def _final_norm_backward(step: _Step, early_grads: int) -> list[Term]:
    """Fused loss: with no logits gradient before it, the peak moves to the final norm's backward, every block's
    activations still alive: the norm's saved tensors, the head's gradient (unless stepped in backward) and the
    B x T x h gradients of RMSNorm's chain (the incoming one, of weight * x, of x * rsqrt, of the fp32 input and
    their sum: 5, measured on the tiny llama / qwen2; LayerNorm's fused backward: 3)."""
    spec, static = step.spec, step.static
    head = 0 if step.setup.optimizer_in_backward and not spec.tie_word_embeddings else _head_grads(spec, static)
    count = 5 if spec.norm != "layernorm" else 3
    # a classifier's `score` has run its backward: its saved input is gone (the fused loss never saved one)
    head_saved = act.head_saved_bytes(spec, step.setup, step.tokens, head_input=False)["head"]
    acts = [replace(t, num_bytes=head_saved - step.tokens * spec.hidden_size * step.dtypes.residual,
                    formula="final norm's saved tensors, once `weight * x` has run its backward")
            if t.name == "activations/head" else t
            for t in step.acts_except("activations/logits", "activations/loss", "gradients/fused_head")]
    return (step.static_terms(max(early_grads, head)) + acts
            + [Term("temporaries/norm_backward", Category.TEMPORARIES, count * step.tokens * spec.hidden_size * 4,
                    f"{count} x B x T x h x 4 B: the final norm's backward chain", "autograd of the final norm")])


def _measured_block_order(spec: ModelSpec) -> bool:
    """Whether the late-backward details (block 0's checkpoint, its down projection's gradient, the recompute's
    casts, a tied head's buffered gradient) were checked on measured steps of this family: the Llama recipe's
    (tests/test_loss_and_inbwd.py). GPT-2 and BERT keep the earlier, coarser end-of-backward moment."""
    return act.separate_projections_layer(spec)


def _down_projection_grads(step: _Step) -> int:
    """The block's MLP output projection's weight gradient (I x h), made by the first matmul backward of the block,
    before its MLP input gradients peak; stepped and freed at once under optimizer in backward. Checked on measured
    CPU steps with checkpointing, where the block moments are the peak."""
    spec = step.spec
    if spec.frozen or spec.derived is not None or step.setup.optimizer_in_backward or not _measured_block_order(spec):
        return 0
    grad_bytes = 2 if step.setup.precision.param_dtype == "bf16" else 4
    return spec.intermediate_size * spec.hidden_size * grad_bytes


def _second_block_backward(step: _Step, early_grads: int) -> list[Term]:
    """FSDP2 only: the next block's backward, with the first one's reduce-scatter input held, its activations (or
    its checkpoint) gone."""
    units = step.static.fsdp
    if units is None or step.spec.num_layers < 2:
        return []
    terms = step.static_terms(early_grads) + fsdp2.block_backward_terms(units, first=False)
    mode, layers = step.setup.checkpointing, step.spec.num_layers
    last_wrapped = mode.checkpointed(layers - 1)  # the block whose backward ran first: its share is gone
    wrapped = mode.checkpointed_blocks(layers)
    for term in step.acts_except(*_HEAD_AND_LOSS):
        if last_wrapped and term.name in ("activations/checkpoints", "activations/selective_kept"):
            mask = act.checkpointed_mask_bytes(step.spec, step.setup, step.tokens, step.setup.seq_len)
            if term.name == "activations/checkpoints":
                term = replace(term, num_bytes=mask + (term.num_bytes - mask) * (wrapped - 1) // wrapped)
            else:
                term = replace(term, num_bytes=term.num_bytes * (layers - 1) // layers)
        elif not last_wrapped and term.name in ("activations/attention", "activations/mlp",
                                                "activations/norms/residual"):
            plain = layers - wrapped
            term = replace(term, num_bytes=term.num_bytes * (plain - 1) // plain)
        terms.append(term)
    terms.append(step.layer_temporaries(rebuilt_core=True))
    if mode.checkpointed(layers - 2):
        terms.append(step.recomputed_block("one block's saved tensors, rebuilt during backward"))
    return terms


def _end_of_backward(step: _Step) -> list[Term]:
    """All gradients exist; with checkpointing, block 0 is rebuilt before its own and the embedding's gradients."""
    spec, static = step.spec, step.static
    embeddings = [t for t in step.acts if t.name == "activations/embeddings"]
    block0_wrapped = step.setup.checkpointing.checkpointed(0)
    if not block0_wrapped and static.fsdp is None:
        return step.static_terms(0 if step.setup.optimizer_in_backward else static.grads_bytes) + embeddings
    per_layer = spec.params_matching(".*.") // max(spec.num_layers, 1)  # the repeated rows ('*' = layer index)
    pending = per_layer + _token_embedding_elems(spec)
    temporaries = step.layer_temporaries()
    if block0_wrapped:
        rebuilt = step.recomputed_block("block 0 rebuilt during backward", kept_counted=False)
    else:
        rebuilt = replace(step.recomputed_block(""), name="activations/block0",
                          formula="block 0's saved tensors, the last still alive")
    if step.attention_backward_dominates():
        # the peak is in block 0's attention backward: its MLP's gradients exist and its MLP tensors are freed
        pending -= min(_block_mlp_params(spec), per_layer)
        freed = step.per_layer["mlp"] + step.per_layer["norms"] // 2
        rebuilt = replace(rebuilt, num_bytes=rebuilt.num_bytes - freed,
                          formula="block 0's attention tensors, rebuilt, once its MLP's backward has run")
        temporaries = replace(temporaries, num_bytes=temporaries.num_bytes + freed)
    if static.fsdp is not None:
        grads = static.fsdp.block_share(static.grads_bytes, static.fsdp.last_prefetching_block)
        return (step.static_terms(grads, _gathered(static, 1)) + fsdp2.block_backward_terms(static.fsdp, first=False)
                + embeddings
                + [temporaries, rebuilt])
    detailed = _measured_block_order(spec) and not spec.frozen
    if detailed and step.setup.checkpointing is Checkpointing.FULL and step.setup.precision.is_autocast:
        # the recompute casts block 0's Linear weights to bf16 again and keeps them for its backward: that rebuilt
        # block, before its first gradient, is the moment (measured on the tiny llama, amp-bf16)
        block_weights = _linear_weight_elems(spec, step.setup) - heads.head_weight_elems(spec)
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
        embeddings += [replace(t, name="activations/checkpoint0", num_bytes=t.num_bytes // max(spec.num_layers, 1),
                               formula="block 0's input, held by its checkpoint until its backward ends")
                       for t in step.acts if t.name == "activations/checkpoints"]
    if held and spec.derived is not None and step.dtypes.on_cpu and step.setup.checkpointing is Checkpointing.FULL:
        embeddings.append(Term("activations/rng_states", Category.ACTIVATIONS, 2 * CPU_RNG_STATE_BYTES,
                               "block 0's stashed torch.get_rng_state() and the one torch.random.fork_rng takes "
                               "around its recompute", "torch.utils.checkpoint preserve_rng_state=True"))
    grads = static.grads_bytes - static.grads_bytes * pending // max(spec.num_params, 1)
    if held and spec.tie_word_embeddings and step.setup.checkpointing is Checkpointing.FULL:
        grads += _head_grads(spec, static)  # the tied head's share waits in autograd's buffer for the embedding's
    if step.setup.optimizer_in_backward:
        grads = _head_grads(spec, static) if spec.tie_word_embeddings else 0  # a tied head's waits in the buffer
    return step.static_terms(grads) + embeddings + [temporaries, rebuilt]


def _block_mlp_params(spec: ModelSpec) -> int:
    """One block's trainable MLP (or experts') parameters, from the graph's first block: their gradients exist once
    the block's backward reaches its attention. 0 without a graph (a derived model has no such moment)."""
    if spec.graph is None:
        return 0
    from ..graph import tensors_of
    from ..graph.kinds.mlp import MLP, Experts

    block = spec.graph.stacks[0].block
    return sum(t.local for n in block.nodes if isinstance(n, (MLP, Experts)) for t in tensors_of(n) if t.trainable)


def _token_embedding_elems(spec: ModelSpec) -> int:
    """The token embedding's trainable elements on this rank: the graph's embedding node (OPT's is narrower than
    hidden; vocabulary-sharded under tensor parallelism), else vocabulary x hidden."""
    from ..graph import tensors_of
    from ..graph.kinds.embedding import Embedding

    embed = getattr(spec.graph, "embed", None)
    if isinstance(embed, Embedding):
        return sum(t.local for t in tensors_of(embed) if t.trainable)
    return spec.vocab_size * spec.hidden_size if not spec.frozen else 0


def _embedding_gradient(step: _Step) -> list[Term]:
    """After the last block: the embedding's gradient. A tied matrix's LM-head contribution waits in autograd's
    input buffer for the embedding's, and the two are summed: three V x h gradients at once."""
    spec, static = step.spec, step.static
    embeddings = [t for t in step.acts if t.name == "activations/embeddings"]
    if static.fsdp is not None:
        grads = static.fsdp.block_share(static.grads_bytes, spec.num_layers)
        return step.static_terms(grads, _gathered(static, 0)) + fsdp2.root_gradient_terms(static.fsdp) + embeddings
    if not spec.tie_word_embeddings or spec.frozen:
        return []
    head = _head_grads(spec, static)
    return step.static_terms(static.grads_bytes - head) + embeddings + [Term(
        "gradients/tied_embedding", Category.GRADIENTS, 3 * head,
        "3 x V x h x grad dtype: the LM head's and the embedding's contributions and their sum",
        "autograd InputBuffer accumulation for a parameter used twice")]


def _root_reduce(step: _Step) -> list[Term]:
    """FSDP2's root post-backward: every block's gradient shard, the root's unsharded gradients and their copy."""
    units = step.static.fsdp
    if units is None:
        return []
    grads = units.block_share(step.static.grads_bytes, step.spec.num_layers)
    return step.static_terms(grads, _gathered(step.static, 0)) + fsdp2.root_reduce_terms(units)


def _gathered(static: ShardedStatic, blocks: int) -> ShardedStatic:
    """Late in backward FSDP2 has resharded every block whose backward ran (ZeRO-2 too): the root and `blocks`
    blocks stay gathered."""
    units = static.fsdp
    if units is None:
        return static
    return replace(static, param_working_set_bytes=units.gathered_bytes(blocks))


def _param_step_temp(spec: ModelSpec, setup: TrainingSetup, numel: int) -> int:
    """Transient bytes of one parameter's own optimizer step (optimizer in backward: one optimizer per parameter)."""
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
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


def _in_backward_moments(step: _Step) -> dict:
    """Optimizer in backward: no gradient outlives its parameter's step, and there is no optimizer step moment.
    Each parameter's gradient and its step's temporaries appear once, inside backward: the LM head's right after
    its matmul backward (every block's activations still alive), the embedding's at the very end. A tied head's
    gradient waits in autograd's buffer for the embedding's and steps with it at the end."""
    spec, setup = step.spec, step.setup
    vh = spec.vocab_size * spec.hidden_size
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
    d = step.dtypes
    one = lambda name, numel, what: [  # noqa: E731
        Term("gradients/in_backward", Category.GRADIENTS, numel * p_bytes, f"{what}: its gradient", IN_BACKWARD_SOURCE),
        Term("temporaries/optimizer_step", Category.TEMPORARIES, _param_step_temp(spec, setup, numel),
             f"{setup.optimizer} step of {what} alone", IN_BACKWARD_SOURCE)]
    embeddings = [t for t in step.acts if t.name == "activations/embeddings"]
    moments: dict = {"optimizer step": (Phase.OPTIMIZER, [])}
    hidden_grad = Term("temporaries/hidden_gradient", Category.TEMPORARIES, step.tokens * spec.hidden_size * d.residual,
                       "B x T x h: the gradient flowing into the final norm", "autograd")
    if spec.tie_word_embeddings:
        moments["embedding gradient"] = (Phase.BACKWARD, step.static_terms(0) + embeddings + [Term(
            "gradients/tied_embedding", Category.GRADIENTS, 3 * vh * p_bytes,
            "3 x V x h: the LM head's and the embedding's contributions and their sum", "autograd InputBuffer")])
        moments["embedding step"] = (Phase.BACKWARD, step.static_terms(0) + embeddings
                                     + one("embedding", vh, "the tied embedding / LM head"))
    else:
        # the fused loss hands out the head's gradient before the final norm's backward: its saved tensors remain
        kept = (step.acts_except("activations/logits", "activations/loss", "gradients/fused_head")
                if setup.loss is Loss.FUSED else step.acts_except(*_HEAD_AND_LOSS))
        moments["head step"] = (Phase.BACKWARD, step.static_terms(0) + kept + [hidden_grad]
                                + one("head", vh, "the LM head"))
        moments["embedding step"] = (Phase.BACKWARD, step.static_terms(0) + embeddings
                                     + one("embedding", vh, "the embedding"))
    return moments


def _optimizer_step(step: _Step, step_temp: int) -> list[Term]:
    """Parameters (shards only: nothing is gathered), gradients, states and the step's temporaries."""
    terms = step.static_terms(step.static.grads_bytes, _without_gathered(step.static))
    if step.static.master_grad_upcast:
        terms.append(Term("temporaries/master_gradients", Category.TEMPORARIES, step.static.grads_bytes,
                          "P x 2 B more: each bf16 gradient upcast to fp32 for the master copy's step (the bf16 one "
                          "released as it goes)", "memfit._torch.master.MasterWeightsOptimizer"))
    if step_temp:
        shards = step.setup.shard_size if step.setup.sharding.stage >= 1 else 1
        terms.append(Term("temporaries/optimizer_step", Category.TEMPORARIES, step_temp // shards,
                          f"{step.setup.optimizer} step temporaries",
                          "torch.optim.adamw / transformers Adafactor / bitsandbytes backends/cpu/ops.py"))
    return terms


def _without_gathered(static: ShardedStatic) -> ShardedStatic:
    """No gathered parameters during the optimizer step: it updates the shards."""
    return replace(static, param_working_set_bytes=0)
