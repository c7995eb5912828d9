"""The step as a typed, public model: what every moment of a training step is built from.

`StepModel` holds the model, the setup as the engine runs it, its (sharded) static memory, the activation terms alive
at the end of forward and one block's saved bytes; its methods give the terms the moments share: the static terms
with a given gradient count, one block's backward temporaries, a block rebuilt by checkpointing, the optimizer step.
The analytic estimate (memfit.estimate.analytic) builds its moments on it, as do a pipeline rank's
(memfit.estimate.pipeline) and a stacked model's (memfit.derive.stacks_estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..model_spec import ModelSpec
from ..setup import Checkpointing, Engine, Sharding, TrainingSetup, deepspeed_casts_module
from . import activations as act
from . import compiled, heads, litgpt, lora, lora_sharded, moe, tensor_parallel
from .forward_terms import activation_terms
from .result import Category, Term
from .static import ShardedStatic, paged_state_bytes
from .terms import TermKey


def _parameter_terms(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic) -> list[Term]:
    """The parameters (a LoRA step: the adapters and the frozen base), buffers and what is gathered."""
    n = setup.shard_size  # the data-parallel ranks, or the HSDP shard group
    p_bytes = setup.precision.param_bytes
    shard_note = f" / {n} ranks" if setup.sharding.stage >= 3 else ""
    if spec.frozen:
        a_bytes = lora.adapter_bytes(setup)
        terms = [Term(TermKey.PARAMETERS, Category.PARAMETERS, static.params_bytes,
                      f"trainable P={spec.num_params:,} (LoRA adapters) x {a_bytes} B "
                      f"({'fp32' if a_bytes == 4 else '16-bit'})",
                      "DeepSpeed engine module.bfloat16() / .half()" if deepspeed_casts_module(setup) else
                      "torchtune LoRALinear: adapters in the model's dtype" if setup.finetune.torchtune else
                      "peft get_peft_model(autocast_adapter_dtype=True): adapters upcast to fp32"),
                 Term(TermKey.FROZEN, Category.PARAMETERS, static.frozen_bytes,
                      f"{spec.num_frozen_params:,} frozen base parameters as stored "
                      f"({lora.base_label(spec, setup)})" + (f", {_fsdp_name(static)} shards / {n} ranks"
                                                             if static.fsdp else ""),
                      lora.BASE_SOURCE + ("; " + lora_sharded.SOURCE if static.fsdp else ""))]
    else:
        terms = [Term(TermKey.PARAMETERS, Category.PARAMETERS, static.params_bytes,
                      f"P={spec.num_params:,} x {p_bytes} B ({setup.precision.param_dtype}){shard_note}",
                      "ZeRO paper sec. 3.1; exact P from the model's parameter tensors")]
    if spec.buffer_bytes:
        terms.append(Term(TermKey.BUFFERS, Category.PARAMETERS, spec.buffer_bytes,
                          "the model's buffers as built (sin/cos position tables), never trained",
                          "the built model's named_buffers()"))
    if static.param_working_set_bytes:
        what = ("every block, gathered from its forward to its backward" if setup.sharding is Sharding.ZERO2 else
                "unsharded root (embeddings, head) + the block being computed")
        source = f"{_fsdp_name(static)} all-gather"
        if setup.engine is Engine.DEEPSPEED:
            what = ("what is fetched again in backward within stage3_max_reuse_distance (1e9 elements) of its "
                    "forward, at least the block being computed, besides the persistent parameters")
            source = "DeepSpeed partitioned_param_coordinator.py __params_to_release (memfit.estimate.deepspeed_zero3)"
        terms.append(Term(TermKey.GATHERED, Category.PARAMETERS, static.param_working_set_bytes, what, source))
    return terms


def _fsdp_name(static: ShardedStatic) -> str:
    """FSDP1's flat parameters (memfit.estimate.fsdp1.Fsdp1Units) or FSDP2's per-parameter shards."""
    return "FSDP1" if hasattr(static.fsdp, "flat_gradient_terms") else "FSDP2"


def static_terms(spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, grads: int,
                 on_cpu: bool = False) -> list[Term]:
    """Static memory as terms with `grads` gradient bytes alive: parameters, gradients (and their buckets),
    optimizer states (a paged optimizer's part outside the allocator on its own)."""
    n = setup.shard_size
    p_bytes = setup.precision.param_bytes
    terms = _parameter_terms(spec, setup, static)
    if grads:
        g_note = f" / {n} ranks" if setup.sharding.stage >= 2 else ""
        g_bytes = lora.adapter_bytes(setup) if spec.frozen else p_bytes
        terms.append(Term(TermKey.GRADIENTS, Category.GRADIENTS, grads, f"P x {g_bytes} B{g_note}",
                          "ZeRO paper sec. 3.1"))
    if static.comm_buffers_bytes and (grads or not static.comm_buffers_with_grads):
        terms.append(Term(TermKey.COMM_BUFFERS, Category.GRADIENTS, static.comm_buffers_bytes,
                          "DDP gradient buckets (1 x gradients)" if setup.engine.value == "torch" else
                          "DeepSpeed reduce bucket(s): reduce_bucket_size elements (HF 'auto': hidden^2), two "
                          "under ZeRO-1/2 overlap_comm, none without contiguous_gradients (memfit.zero_knobs)",
                          "torch DistributedDataParallel / DeepSpeed ZeRO stage 1-2 (ZeRO-3: its ipg bucket, "
                          "stage3.py), measured on 2 gloo ranks"))
    if static.optimizer_bytes:
        o_note = f" / {n} ranks" if setup.sharding.stage >= 1 else ""
        shards = n if setup.sharding.stage >= 1 else 1
        paged = 0 if on_cpu else min(static.optimizer_bytes, paged_state_bytes(spec, setup) // shards)
        terms.append(Term(TermKey.STATES, Category.OPTIMIZER, static.optimizer_bytes - paged,
                          f"{setup.optimizer}{' + fp32 master weights' if setup.precision.master_weights else ''}"
                          f"{o_note}{' (the part in the caching allocator)' if paged else ''}",
                          "torch.optim / bitsandbytes / torchao / transformers Adafactor state layout"))
        if paged:
            terms.append(Term(TermKey.PAGED_STATES, Category.OPTIMIZER, paged,
                              f"{setup.optimizer} states of tensors >= 1e5 elements{o_note}: CUDA unified memory "
                              "(cudaMallocManaged), outside torch's allocator; device memory while resident, "
                              "evicted to host RAM under memory pressure (slower steps, no OOM)",
                              "bitsandbytes Optimizer8bit.get_state_buffer / functional.get_paged", figure="outside"))
    return terms


def head_grads(spec: ModelSpec, static: ShardedStatic) -> int:
    """Gradient bytes of the LM head, the first weight whose gradient backward makes (none for a frozen head)."""
    if spec.frozen:
        return 0
    return static.grads_bytes * heads.head_weight_elems(spec) // max(spec.num_params, 1)


@dataclass(frozen=True)
class StepModel:
    """What every moment of the step is built from: the model (after LoRA / MoE / tensor-parallel rewrites), the
    setup as the engine runs it, its static memory on this rank, the activation terms alive at the end of forward
    and one block's saved bytes by group ('attention', 'mlp', 'norms')."""

    spec: ModelSpec
    setup: TrainingSetup
    static: ShardedStatic | None
    acts: list[Term]
    per_layer: dict[str, int]
    dtypes: act.Dtypes

    @classmethod
    def build(cls, spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, on_cpu: bool) -> StepModel:
        """The whole step's model: every block's saved bytes (a compiled block's under torch.compile) and the
        activation terms of the end of forward (memfit.estimate.forward_terms)."""
        saved_by_block = compiled.layer_saved_bytes if setup.compile else act.layer_saved_bytes
        per_layer = saved_by_block(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
        dtypes = act.dtypes(spec, setup, on_cpu)
        acts = activation_terms(spec, setup, per_layer, dtypes)
        if litgpt.applies(setup):  # LitGPT's GPT keeps more per block and in its final norm (memfit.estimate.litgpt)
            extra = litgpt.block_extra(spec, setup, setup.tokens_per_micro_step, dtypes.compute, dtypes.residual)
            per_layer = {group: n + extra.get(group, 0) for group, n in per_layer.items()}
            acts = activation_terms(spec, setup, per_layer, dtypes)
            final = litgpt.norm_extra(spec, setup.tokens_per_micro_step, dtypes.residual)
            acts = [replace(t, num_bytes=t.num_bytes + final) if t.name == TermKey.HEAD else t for t in acts]
        return cls(spec, setup, static, acts, per_layer, dtypes)

    @classmethod
    def for_block(cls, spec: ModelSpec, setup: TrainingSetup, on_cpu: bool) -> StepModel:
        """A block's view alone (no static memory, no activation terms): its backward temporaries and recompute,
        as a pipeline stage takes them (memfit.estimate.pipeline)."""
        per_layer = act.layer_saved_bytes(spec, setup, setup.tokens_per_micro_step, setup.seq_len, on_cpu)
        return cls(spec, setup, None, [], per_layer, act.dtypes(spec, setup, on_cpu))

    @classmethod
    def for_static(cls, spec: ModelSpec, setup: TrainingSetup, static: ShardedStatic, on_cpu: bool) -> StepModel:
        """Static memory alone (a stacked model's moments come from its own fit: memfit.derive.stacks_estimate)."""
        return cls(spec, setup, static, [], {}, act.dtypes(spec, setup, on_cpu))

    @property
    def tokens(self) -> int:
        return self.setup.tokens_per_micro_step

    def static_terms(self, grads: int, static: ShardedStatic | None = None) -> list[Term]:
        return static_terms(self.spec, self.setup, static or self.static, grads, self.dtypes.on_cpu)

    def optimizer_step(self, step_temp: int) -> list[Term]:
        """Parameters (shards only: nothing is gathered), gradients, states and the step's temporaries."""
        static = self.static
        if static.comm_buffers_with_grads:  # DeepSpeed ZeRO-1/2 released its buckets at the backward epilogue
            static = replace(static, comm_buffers_bytes=0)
        terms = self.static_terms(static.grads_bytes, _without_gathered(static))
        if static.master_grad_upcast:
            terms.append(Term(TermKey.MASTER_GRADIENTS, Category.TEMPORARIES, static.grads_bytes,
                              "P x 2 B more: each bf16 gradient upcast to fp32 for the master copy's step (the bf16 "
                              "one released as it goes)", "memfit._torch.master.MasterWeightsOptimizer"))
        if litgpt.applies(self.setup) and self.spec.is_decoder:
            terms.append(litgpt.held_logits(self.spec, self.tokens))  # and through the optimizer step
        if step_temp:
            shards = self.setup.shard_size if self.setup.sharding.stage >= 1 else 1
            terms.append(Term(TermKey.OPTIMIZER_STEP, Category.TEMPORARIES, step_temp // shards,
                              f"{self.setup.optimizer} step temporaries",
                              "torch.optim.adamw / transformers Adafactor / bitsandbytes backends/cpu/ops.py"))
        return terms

    def acts_except(self, *names: TermKey) -> list[Term]:
        kept = [t for t in self.acts if t.name not in names]
        if TermKey.LOGITS in names and litgpt.applies(self.setup) and self.spec.is_decoder:
            kept.append(litgpt.held_logits(self.spec, self.tokens))  # LitGPT's loop holds them through backward
        return kept

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
        return Term(TermKey.RECOMPUTED_BLOCK, Category.ACTIVATIONS, rebuilt, what, "torch.utils.checkpoint")

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
            from . import derived as derive
            return Term(TermKey.LAYER_BACKWARD, Category.TEMPORARIES, derive.block_temporaries(
                self.spec, self.setup, self.tokens, self.setup.seq_len, self.dtypes.on_cpu),
                "peak of one block's backward beyond its saved tensors, fitted from traces", "memfit.derive")
        d, spec, setup = self.dtypes, self.spec, self.setup
        if moe.applies(spec, setup):
            a2a = moe.all_to_all_bytes(spec, setup, d)
            return Term(TermKey.LAYER_BACKWARD, Category.TEMPORARIES,
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
        return Term(TermKey.LAYER_BACKWARD, Category.TEMPORARIES,
                    residual + max(mlp, attention_extra) + dequantized, formula, "autograd of one block")


# Saved by the head and the loss: gone once the head's backward has run.
HEAD_AND_LOSS = (TermKey.LOGITS, TermKey.LOSS, TermKey.HEAD, TermKey.LOGIT_SOFTCAP, TermKey.FUSED_HEAD)


def _without_gathered(static: ShardedStatic) -> ShardedStatic:
    """No gathered parameters during the optimizer step: it updates the shards."""
    return replace(static, param_working_set_bytes=0)


__all__ = ["HEAD_AND_LOSS", "StepModel", "head_grads", "static_terms"]
