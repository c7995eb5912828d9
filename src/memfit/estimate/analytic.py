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
from ..setup import Checkpointing, Engine, Precision, Sharding, TrainingSetup, fsdp2_mixed_precision
from . import activations as act
from . import fsdp2, lora, moe, tensor_parallel
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
    spec = lora.adapted_spec(spec, setup)
    moe.check(spec, setup)
    spec = moe.ep_local_spec(moe.as_recipe(spec, setup), setup)  # MoE: formulas, not the derived model; experts / ep
    spec = tensor_parallel.rank_spec(spec, setup)  # one tensor-parallel rank's shards (itself when tp is 1)
    if setup.num_gpus != hardware.world_size and setup.sharding is not Sharding.NONE:
        setup = setup.replace(num_gpus=hardware.world_size)
    sized, run_notes = _as_run(setup, layout or setup.engine)
    full = full_static(spec, sized)
    static = shard(spec, sized, full, layout=layout or setup.engine)
    moments = _moments(spec, sized, static, full.step_temp_bytes, hardware.is_cpu)
    phase_peaks = {phase: max(_total(t) for name, (ph, t) in moments.items() if ph is phase)
                   for phase in Phase if any(ph is phase for ph, _ in moments.values())}
    peak_name = max(moments, key=lambda n: _total(moments[n][1]))
    phase, terms = moments[peak_name]
    terms = [t for t in terms if t.num_bytes > 0]
    in_allocator = [t for t in terms if t.device_figure == "allocated"]
    terms += runtime_overhead_terms(_total(in_allocator), setup, hardware, spec=spec, terms=in_allocator)
    return MemoryEstimate(
        terms=tuple(terms), peak_phase=phase, method="analytic", setup=setup, phase_peaks=phase_peaks,
        cpu_bytes=static.cpu_bytes, notes=tuple(rule_of_thumb_notes(spec, sized)) + static.notes + run_notes
        + _derived_notes(spec) + moe.notes(spec, sized, hardware.is_cpu),
        model_name=spec.name,
        device_name=hardware.gpu.name, moe=moe.routing_range(spec, sized, hardware.is_cpu))


def _derived_notes(spec: ModelSpec) -> tuple[str, ...]:
    if spec.derived is None:
        return ()
    from .. import derive
    return derive.notes(spec)


def _as_run(setup: TrainingSetup, layout: Engine) -> tuple[TrainingSetup, tuple[str, ...]]:
    """The setup whose bytes the engine really has: amp-* under torch's FSDP2 runs as a MixedPrecisionPolicy
    (memfit.setup.fsdp2_mixed_precision), which is bf16-master's layout, not autocast's."""
    if not setup.precision.is_autocast:
        return setup, ()
    deepspeed = layout is Engine.DEEPSPEED and (setup.sharding is not Sharding.NONE or setup.offload.value != "none")
    if deepspeed and not setup.finetune.adapters:
        return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
            f"{setup.precision} under DeepSpeed runs as its {setup.precision.compute_dtype} mode (the config memfit "
            f"emits: {setup.precision.compute_dtype}.enabled): the engine casts the model to "
            f"{setup.precision.compute_dtype} and keeps fp32 master weights in the optimizer, with no autocast "
            "cache; sized like bf16-master",)
    if not fsdp2_mixed_precision(setup, layout):
        return setup, ()
    return dataclasses.replace(setup, precision=Precision.BF16_MASTER), (
        f"{setup.precision} under FSDP2 runs as MixedPrecisionPolicy(param_dtype={setup.precision.compute_dtype}, "
        "reduce_dtype=fp32), as memfit's torch engine shards it: fp32 shards, low-precision compute, no autocast "
        "cache; sized like bf16-master",)


def _total(terms: list[Term]) -> int:
    return sum(t.num_bytes for t in terms)


def _static_terms(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, grads: int,
                  on_cpu: bool = False) -> list[Term]:
    n = setup.dp_size
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
    shard_note = f" / {n} ranks" if setup.sharding.stage >= 3 else ""
    if spec.frozen:
        terms = [Term("parameters", Category.PARAMETERS, static.params_bytes,
                      f"trainable P={spec.num_params:,} (LoRA adapters) x 4 B (fp32)",
                      "peft get_peft_model(autocast_adapter_dtype=True): adapters upcast to fp32"),
                 Term("parameters/frozen", Category.PARAMETERS, static.frozen_bytes,
                      f"{spec.num_frozen_params:,} frozen base parameters as stored "
                      f"({lora.base_label(spec, setup)})", lora.BASE_SOURCE)]
    else:
        terms = [Term("parameters", Category.PARAMETERS, static.params_bytes,
                      f"P={spec.num_params:,} x {p_bytes} B ({setup.precision.param_dtype}){shard_note}",
                      "ZeRO paper sec. 3.1; exact P from the model's parameter tensors")]
    if static.param_working_set_bytes:
        what = ("every block, gathered from its forward to its backward" if setup.sharding is Sharding.ZERO2 else
                "unsharded root (embeddings, head) + the block being computed")
        terms.append(Term("parameters/gathered", Category.PARAMETERS, static.param_working_set_bytes, what,
                          "FSDP2 all-gather / DeepSpeed ZeRO-3 prefetch"))
    if grads:
        g_note = f" / {n} ranks" if setup.sharding.stage >= 2 else ""
        g_bytes = 4 if spec.frozen else p_bytes
        terms.append(Term("gradients", Category.GRADIENTS, grads, f"P x {g_bytes} B{g_note}", "ZeRO paper sec. 3.1"))
    if static.comm_buffers_bytes:
        terms.append(Term("gradients/comm_buffers", Category.GRADIENTS, static.comm_buffers_bytes,
                          "DDP gradient buckets (1 x gradients)" if setup.engine.value == "torch" else
                          "DeepSpeed reduce bucket: hidden^2 elements (HF 'auto')",
                          "torch DistributedDataParallel / DeepSpeed ZeRO stage 1-2, measured on 2 gloo ranks"))
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
        inputs = wrapped * tokens * spec.hidden_size * d.residual
        if inputs or mask:
            what = (f"{'L' if wrapped == layers else wrapped} x B x T x h (each checkpointed block's input)"
                    if inputs else "")
            what += (" + " if what else "") + "the B x T x T eager mask" if mask else ""
            terms.append(Term("activations/checkpoints", Category.ACTIVATIONS, inputs + mask, what,
                              "torch.utils.checkpoint, non-reentrant"))
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
        for group, label in (("attention", "attention"), ("mlp", "mlp"), ("norms", "norms/residual")):
            total = plain * per_layer[group] - (first if group == "norms" else 0)
            formula = f"{count} x saved {group} tensors per layer" + (
                " (layer 0's first norm keeps nothing: no gradient flows into it)" if first and group == "norms"
                else "")
            if group == "attention" and act.core_recomputed(setup):
                formula += " (the checkpointed eager core keeps its q, k, v inputs and output, no T x T)"
            terms.append(Term(f"activations/{label}", Category.ACTIVATIONS, total, formula, ENGINE_SOURCE))
    head = act.head_saved_bytes(spec, setup, tokens)["head"]
    emb = act.embedding_saved_bytes(spec, setup, tokens, seq, on_cpu) + 2 * 8 * tokens  # + input_ids and labels
    terms.append(Term("activations/embeddings", Category.ACTIVATIONS, emb,
                      "token ids, labels, position tables", ENGINE_SOURCE))
    terms.append(Term("activations/head", Category.ACTIVATIONS, head,
                      "final norm and LM-head input (BERT: MLM transform)", ENGINE_SOURCE))
    vocab = spec.vocab_size * tokens
    logits = vocab * d.compute
    if spec.extra.get("final_logit_softcapping"):
        terms.append(Term("activations/logit_softcap", Category.ACTIVATIONS, logits,
                          f"B x T x V x {d.compute} B: tanh(logits / cap), kept for backward",
                          "transformers Gemma2ForCausalLM final_logit_softcapping"))
    terms.append(Term("activations/logits", Category.ACTIVATIONS, logits,
                      f"B x T x V x {d.compute} B, until the loss is computed",
                      "HF CausalLMOutput; freed before backward when only the loss is kept (HF Trainer)"))
    loss_bytes = _loss_elem_bytes(spec, setup)
    terms.append(Term("activations/loss", Category.ACTIVATIONS, vocab * loss_bytes + 8 * tokens,
                      f"B x T x V x {loss_bytes} B log-softmax + shifted labels",
                      "transformers loss_utils.ForCausalLMLoss (upcasts to fp32); BertForMaskedLM does not"))
    terms += moe.terms(spec, setup, d)
    if setup.precision.is_autocast:
        head_weight = spec.vocab_size * spec.hidden_size
        copies = 2 * (head_weight + (_linear_weight_elems(spec) - head_weight) * (layers - wrapped) // layers)
        if spec.frozen:
            copies = lora.autocast_copies(spec, setup, ckpt)
        terms.append(Term("activations/autocast_weight_copies", Category.ACTIVATIONS, copies,
                          "2 B x Linear weights: bf16 casts cached by autocast, saved for backward",
                          "torch.autocast weight cast cache"))
    return terms


def _loss_elem_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Causal LMs go through ForCausalLMLoss, which upcasts logits to fp32; BERT's MLM loss stays in the logits'
    dtype unless autocast (log_softmax runs in fp32 under autocast)."""
    if spec.model_type == "bert" and not setup.precision.is_autocast:
        return act.dtypes(spec, setup).compute
    return 4


def _head_grads(spec: ModelSpec, static: ShardedStatic) -> int:
    """Gradient bytes of the LM head, the first weight whose gradient backward makes (none for a frozen head)."""
    if spec.frozen:
        return 0
    return static.grads_bytes * spec.vocab_size * spec.hidden_size // max(spec.num_params, 1)


def _linear_weight_elems(spec: ModelSpec) -> int:
    skip = ("embed", "wte", "wpe", "norm", "ln_", "ln_f", "bias", "LayerNorm", "position", "token_type")
    total = sum(p.total for p in spec.params if not any(s in p.name for s in skip))
    total -= moe.expert_weight_elems(spec)  # grouped_mm is no autocast op: no cached casts of stacked experts
    if spec.tie_word_embeddings:
        total += spec.vocab_size * spec.hidden_size  # the tied LM head casts the embedding matrix
    return total


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
_HEAD_AND_LOSS = ("activations/logits", "activations/loss", "activations/head", "activations/logit_softcap")


def _moments(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, step_temp: int, on_cpu: bool) -> dict:
    per_layer = act.layer_saved_bytes(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
    dtypes = act.dtypes(spec, setup, on_cpu)
    step = _Step(spec, setup, static, _activation_terms(spec, setup, per_layer, dtypes), per_layer, dtypes)
    # gradients live through forward when accumulation keeps them, or when the engine pre-allocates the partition
    early_grads = static.grads_bytes if setup.grad_accum_steps > 1 or static.grads_preallocated else 0
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
    if spec.frozen and setup.checkpointing is Checkpointing.FULL and static.fsdp is None:
        moments.update(lora.checkpointed_moments(step, moments))
    return moments


def _loss_forward(step: _Step, forward: list[Term]) -> list[Term]:
    """Inside the loss, still under autocast: ForCausalLMLoss upcasts the logits (`logits.float()`, a new fp32 tensor
    beside the log-softmax it feeds), and autocast's cache still holds every Linear weight's cast: under checkpointing
    these are not saved for backward, but live until the autocast region (forward and loss) exits."""
    spec, setup = step.spec, step.setup
    if not spec.is_decoder or step.dtypes.compute == 4:
        return []
    terms = list(forward) + [Term("temporaries/logits_fp32", Category.TEMPORARIES, spec.vocab_size * step.tokens * 4,
                                  "B x T x V x 4 B: the logits upcast for the loss, until log-softmax has run",
                                  "transformers loss_utils.ForCausalLMLoss (logits.float())")]
    if setup.precision.is_autocast and setup.checkpointing.checkpointed_blocks(spec.num_layers):
        cached = 2 * _linear_weight_elems(spec)
        terms = [replace(t, num_bytes=cached, formula="2 B x Linear weights: autocast's cast cache, until it exits")
                 if t.name == "activations/autocast_weight_copies" else t for t in terms]
    return terms


def _loss_backward(step: _Step, forward: list[Term]) -> list[Term]:
    """Log-softmax backward: its output and two B x T x V gradients. The Trainer keeps only the loss, so the logits
    are gone by then (a loop that holds `outputs` through backward adds B x T x V x dtype here)."""
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
                    2 * step.spec.vocab_size * step.tokens * loss_bytes,
                    f"2 x B x T x V x {loss_bytes} B: gradients of log-softmax and of the logits",
                    "aten log_softmax_backward")
    return [t for t in forward if t.name != "activations/logits"] + [loss_tmp]


def _first_block_backward(step: _Step, early_grads: int) -> list[Term]:
    """The last block's backward: every block's activations, the head's gradients, one block's temporaries (and,
    with checkpointing, that block rebuilt). Under FSDP2 the head's and the block's gradients are unsharded."""
    spec, static = step.spec, step.static
    if static.fsdp is not None:
        terms = step.static_terms(early_grads) + fsdp2.block_backward_terms(static.fsdp, first=True)
    else:
        grads = _head_grads(spec, static)
        if act.core_recomputed(step.setup) and step.attention_backward_dominates(rebuilt_core=True):
            grads += static.grads_bytes * _block_mlp_params(spec) // max(spec.num_params, 1)  # its MLP's are made
        terms = step.static_terms(max(early_grads, grads))
    terms += step.acts_except(*_HEAD_AND_LOSS)
    terms.append(step.layer_temporaries(rebuilt_core=True))
    if step.setup.checkpointing.checkpointed(spec.num_layers - 1):
        terms.append(step.recomputed_block("one block's saved tensors, rebuilt during backward"))
    return terms


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
        return step.static_terms(static.grads_bytes) + embeddings
    per_layer = spec.params_matching(".*.") // max(spec.num_layers, 1)
    pending = per_layer + spec.params_matching("embed_tokens", "wte", "word_embeddings", "embed_in")
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
    grads = static.grads_bytes - static.grads_bytes * pending // max(spec.num_params, 1)
    return step.static_terms(grads) + embeddings + [temporaries, rebuilt]


def _block_mlp_params(spec: ModelSpec) -> int:
    """One block's MLP parameters (their gradients exist once the block's backward reaches its attention)."""
    return spec.params_matching(".mlp.", ".intermediate.", ".output.dense", "dense_h_to_4h",
                                "dense_4h_to_h") // max(spec.num_layers, 1)


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
    return replace(static, param_working_set_bytes=(units.root_params + blocks * units.block_params) * units.compute_bytes)


def _optimizer_step(step: _Step, step_temp: int) -> list[Term]:
    """Parameters (shards only: nothing is gathered), gradients, states and the step's temporaries."""
    terms = step.static_terms(step.static.grads_bytes, _without_gathered(step.static))
    if step.static.master_grad_upcast:
        terms.append(Term("temporaries/master_gradients", Category.TEMPORARIES, step.static.grads_bytes,
                          "P x 2 B more: each bf16 gradient upcast to fp32 for the master copy's step (the bf16 one "
                          "released as it goes)", "memfit._torch.master.MasterWeightsOptimizer"))
    if step_temp:
        shards = step.setup.dp_size if step.setup.sharding.stage >= 1 else 1
        terms.append(Term("temporaries/optimizer_step", Category.TEMPORARIES, step_temp // shards,
                          f"{step.setup.optimizer} step temporaries", "torch.optim.adamw / transformers Adafactor"))
    return terms


def _without_gathered(static: ShardedStatic) -> ShardedStatic:
    """No gathered parameters during the optimizer step: it updates the shards."""
    return replace(static, param_working_set_bytes=0)
