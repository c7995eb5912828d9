"""GRPO and DPO as phases (TRL's GRPOTrainer and DPOTrainer, trl 1.x), each phase's terms on one GPU, and the
vLLM utilization that leaves the trainer room. `estimate_rl` is the entry point."""

from __future__ import annotations

from ..diagnose import DEFAULT_MARGIN
from ..estimate.analytic import estimate
from ..estimate.result import Category, MemoryEstimate, Term
from ..estimate.terms import TermKey
from ..finetune import Finetune, Method
from ..hardware import Hardware, cpu_device, make_hardware
from ..model_spec import ModelSpec
from ..setup import Checkpointing, Engine, Loss, Optimizer, Precision, Sharding, TrainingSetup
from . import logprobs
from .generation import default_max_num_seqs, hf_generate_terms, hf_kv_cache_bytes, vllm_budget, vllm_terms
from .workload import REFERENCE_FREE, Phase, RLEstimate, RLSetup, VllmAdvice, term

GRPO = "trl/trainer/grpo_trainer.py"
DPO = "trl/trainer/dpo_trainer.py"
_HOST = make_hardware(cpu_device(1 << 50))
"""A device with room for anything: the core's saved-activation terms without checkpointing, read at any size."""
SHARED_OVERHEAD = (TermKey.CUDA_CONTEXT, TermKey.CUBLAS_WORKSPACE)
"""Overhead terms of the core estimate every phase of the one process carries."""


def training_setup(rl: RLSetup, hardware: Hardware, batch: int) -> TrainingSetup:
    """The policy's step as memfit's core sizes it. TRL loads the policy in the checkpoint's dtype ('auto') and
    trains it with bf16 autocast: pure bf16 weights and AdamW states (torch keeps states in the params' dtype);
    bf16=False: fp32. The log-prob head is TRL's own (logprobs.py), so the core runs without a CE loss's logits
    (Loss.FUSED leaves only the final norm's tensors at the head). The optimizer is TrainingArguments' default
    with torch >= 2.8, `adamw_torch_fused` (transformers training_args.py `default_optim`)."""
    finetune = Finetune(method=Method.LORA, rank=rl.lora_rank, alpha=2.0 * rl.lora_rank) if rl.lora else Finetune()
    return TrainingSetup(micro_batch_size=batch, seq_len=rl.seq_len, grad_accum_steps=rl.gradient_accumulation_steps,
                         precision=Precision.BF16 if rl.bf16 else Precision.FP32, optimizer=Optimizer.ADAMW_FUSED,
                         checkpointing=Checkpointing.FULL if rl.gradient_checkpointing else Checkpointing.NONE,
                         loss=Loss.STANDARD if rl.lora else Loss.FUSED, finetune=finetune,
                         num_gpus=hardware.world_size, sharding=Sharding(rl.sharding), engine=Engine(rl.engine))


CE_LOSS_TERMS = (TermKey.LOSS, TermKey.LOGITS, TermKey.LOSS_BACKWARD)
"""The core's cross-entropy tensors (a LoRA policy is sized with Loss.STANDARD): TRL's head replaces them."""


def _pick(result: MemoryEstimate, *categories: Category) -> list[Term]:
    return [t for t in result.terms if t.category in categories and t.name not in CE_LOSS_TERMS]


def _overhead(result: MemoryEstimate) -> list[Term]:
    return [t for t in result.terms if t.name in SHARED_OVERHEAD]


def _reference_weights(core: MemoryEstimate, rl: RLSetup) -> list[Term]:
    """A second copy of the policy's weights, frozen, in the model's dtype (the policy's parameter terms)."""
    if not rl.has_reference_model:
        return []
    weights = sum(t.num_bytes for t in core.terms if t.category is Category.PARAMETERS)
    source = GRPO + " (ref_model: create_model_from_path)" if rl.online else DPO + " (ref_model)"
    return [term(TermKey.REFERENCE, Category.PARAMETERS, weights, "the reference model: the policy's weights",
                 source)]


def _rollout_buffers(rl: RLSetup, rows: int) -> list[Term]:
    """The batch's token tensors (ids, attention mask, completion mask: int64) that stay alive across phases."""
    return [term(TermKey.ROLLOUT_INPUTS, Category.ACTIVATIONS, 3 * rows * rl.seq_len * 8,
                 f"{rows} sequences x {rl.seq_len} tokens x 3 int64 (ids, masks)", GRPO + " _generate_and_score")]


def _dtype_bytes(rl: RLSetup) -> int:
    return 2 if rl.bf16 else 4


def _no_grad_forward(spec: ModelSpec, rl: RLSetup, batch: int) -> list[Term]:
    """A no-grad log-prob forward of `batch` sequences: the larger of the head's peak and the last decoder layer's
    (below)."""
    d = _dtype_bytes(rl)
    if rl.logprob_head == "fused":
        rows = logprobs.head_rows(batch, rl.seq_len, rl.max_completion_length, rl.triton)
        head = logprobs.fused_forward_terms(spec, rows, batch, rl.seq_len, compute_bytes=d, hidden_bytes=d,
                                            triton=rl.triton)
    else:
        head = logprobs.logits_forward_terms(spec, batch, rl.max_completion_length, kind=rl.logprob_head,
                                             logits_bytes=d)
    # the last layer's MLP (generation._prefill_terms reads the same forward): four hidden-sized tensors and three
    # MLP intermediates; TRL 0.x's forward leaves use_cache on, so the whole KV cache of the pass is alive too
    layer = batch * rl.seq_len * (4 * spec.hidden_size + 3 * spec.intermediate_size) * d
    if rl.logprob_head != "fused":
        layer += hf_kv_cache_bytes(spec, batch, rl.seq_len, d)
    if layer > sum(t.num_bytes for t in head):
        return [term(TermKey.FORWARD_LAYER, Category.TEMPORARIES, layer,
                     "B x T x (4h + 3I) (+ the KV cache with use_cache): the last layer's MLP, no grad", GRPO)]
    return head


def _head_backward(spec: ModelSpec, rl: RLSetup, batch: int) -> list[Term]:
    d = _dtype_bytes(rl)
    if rl.logprob_head == "fused":
        rows = logprobs.head_rows(batch, rl.seq_len, rl.max_completion_length, rl.triton)
        return logprobs.fused_backward_terms(spec, rows, compute_bytes=d, hidden_bytes=d, triton=rl.triton,
                                             head_trainable=not rl.lora)
    return logprobs.logits_backward_terms(spec, batch, rl.max_completion_length, kind=rl.logprob_head,
                                          logits_bytes=d)


def _saved_activations(spec: ModelSpec, rl: RLSetup, core: MemoryEstimate, batch: int) -> list[Term]:
    """What the policy's forward leaves for backward when the head's backward begins. Without checkpointing: the
    core's activation terms (its peak is that moment). With full checkpointing each decoder layer keeps only its
    input hidden states [B, T, h] (transformers GradientCheckpointingLayer), plus the embeddings' and the final
    norm's tensors."""
    if not rl.gradient_checkpointing:
        return _pick(core, Category.ACTIVATIONS)
    unchanged = training_setup(rl.replace(gradient_checkpointing=False, sharding="none"), _HOST, batch)
    plain = estimate(spec, unchanged, _HOST)
    kept = [t for t in _pick(plain, Category.ACTIVATIONS) if t.name in (TermKey.EMBEDDINGS, TermKey.HEAD)]
    inputs = spec.num_layers * batch * rl.seq_len * spec.hidden_size * _dtype_bytes(rl)
    return kept + [term(TermKey.CHECKPOINTS, Category.ACTIVATIONS, inputs,
                        "L x B x T x h: each layer's checkpointed input", "transformers GradientCheckpointingLayer")]


def _training(core: MemoryEstimate, head_point: list[Term], extra: list[Term]) -> list[Term]:
    """The training phase's peak: the head's backward (`head_point`) or the core's own peak (a layer's backward
    under checkpointing, or the optimizer step with gradients and its temporaries), whichever is larger, each with
    the reference weights and the batch's tensors (`extra`)."""
    own = [t for t in core.terms if t.category is not Category.OVERHEAD and t.name not in CE_LOSS_TERMS]
    head_total = sum(t.num_bytes for t in head_point)
    return (head_point if head_total >= sum(t.num_bytes for t in own) else own) + extra


def _static(core: MemoryEstimate, rl: RLSetup) -> list[Term]:
    return _pick(core, Category.PARAMETERS, Category.OPTIMIZER) + _reference_weights(core, rl)


def critic_fraction(spec: ModelSpec) -> float:
    """A value model's parameters over the policy's: the same backbone with a [h] -> 1 score head instead of the LM
    head (verl's critic is AutoModelForTokenClassification with num_labels=1, OpenRLHF's a value head on the base
    model; transformers `score = nn.Linear(hidden_size, num_labels)`). A tied LM head shares the embedding, which
    the critic keeps."""
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    return (spec.num_params - head + spec.hidden_size + 1) / spec.num_params


def _scaled(terms: list[Term], fraction: float, rename: dict) -> list[Term]:
    return [Term(rename.get(t.category, t.name), t.category, int(t.num_bytes * fraction), t.formula + " (critic)",
                 t.source, t.figure) for t in terms]


class Resident:
    """The models' states on one GPU and which phase each is loaded in: the policy's parameters and optimizer
    state, the critic's, the reference and reward weights, each leaving the GPU outside its phases when offloaded
    (verl fsdp_config.param_offload / optimizer_offload, ref param_offload; OpenRLHF --adam_offload,
    --ref_reward_offload)."""

    def __init__(self, spec: ModelSpec, rl: RLSetup, core: MemoryEstimate, critic_core: MemoryEstimate) -> None:
        self.rl = rl
        self.params = _pick(core, Category.PARAMETERS)
        self.optimizer = _pick(core, Category.OPTIMIZER)
        self.reference = _reference_weights(core, rl)
        fraction = critic_fraction(spec)
        self.critic_params = _scaled(_pick(critic_core, Category.PARAMETERS), fraction,
                                     {Category.PARAMETERS: TermKey.CRITIC}) if rl.has_critic else []
        self.critic_optimizer = _scaled(_pick(critic_core, Category.OPTIMIZER), fraction,
                                        {Category.OPTIMIZER: TermKey.CRITIC_OPTIMIZER}) if rl.has_critic else []
        weights = sum(t.num_bytes for t in core.terms if t.category is Category.PARAMETERS)
        full = weights if rl.lora else None  # a LoRA policy's parameter terms hold the frozen base too
        self.reward = [term(TermKey.REWARD_MODEL, Category.PARAMETERS, (full or weights) * fraction,
                            "a reward model: the backbone with a score head, frozen", "verl reward_model / OpenRLHF "
                            "--reward_pretrain")] if rl.reward_model else []

    def models(self, phase: str) -> tuple[str, ...]:
        names = ["policy"]
        names += ["critic"] if self.critic_params else []
        names += ["reference"] if self.reference else []
        names += ["reward"] if self.reward else []
        return tuple(names)

    def terms(self, phase: str, *, vllm: bool = False) -> list[Term]:
        """phase: 'generation', 'log-probs', 'training' (the policy's update) or 'critic'."""
        rl = self.rl
        policy_params = not (rl.param_offload and (phase == "critic" or (phase == "generation" and vllm)))
        critic_params = not (rl.param_offload and phase in ("training", "generation"))
        out = list(self.params) if policy_params else []
        out += self.optimizer if not rl.optimizer_offload or phase == "training" else []
        out += self.critic_params if critic_params else []
        out += self.critic_optimizer if not rl.optimizer_offload or phase == "critic" else []
        if not rl.ref_offload or phase == "log-probs":
            out += self.reference + self.reward
        return out


def grpo_phases(spec: ModelSpec, rl: RLSetup, hardware: Hardware) -> tuple[list[Phase], MemoryEstimate]:
    """The online trainers (GRPO, RLOO, PPO): rollout (HF generate of the whole generation batch), log-probs
    (old policy, reference when beta > 0, the critic's values), the policy's training step, and for PPO the
    critic's."""
    batch = rl.per_device_train_batch_size
    core = estimate(spec, training_setup(rl, hardware, batch), hardware)
    # the critic is a full model (verl / OpenRLHF train it whole even beside a LoRA actor), on its own micro-batch
    critic_core = estimate(spec, training_setup(rl.replace(lora=False), hardware, rl.critic_batch), hardware) \
        if rl.has_critic and (rl.lora or rl.critic_batch != batch) else core
    resident = Resident(spec, rl, core, critic_core)
    overhead, rollout = _overhead(core), _rollout_buffers(rl, rl.generation_batch)
    models = resident.models("all")
    phases = []
    if not rl.use_vllm:
        gen = hf_generate_terms(spec, rl.generation_batch, rl.max_prompt_length, rl.max_completion_length,
                                _dtype_bytes(rl))
        phases.append(Phase("generation", tuple(resident.terms("generation") + gen + overhead), models,
                            f"HF generate: {rl.generation_batch} completions x {rl.seq_len} tokens"))
    # grpo_trainer.py `_generate_and_score_completions`: old-policy log-probs when gradient_accumulation_steps is
    # not a multiple of steps_per_generation x num_iterations, or always with vLLM (importance-sampling correction);
    # RLOO always (rloo_trainer.py: old_per_token_logps under no_grad); PPO always (old log-probs and values)
    generate_every = (rl.steps_per_generation or rl.gradient_accumulation_steps) * rl.num_iterations
    old_policy = rl.gradient_accumulation_steps % generate_every != 0 or rl.use_vllm or rl.trainer != "grpo"
    if rl.needs_reference_logprobs or old_policy or rl.has_critic:
        forward = _no_grad_forward(spec, rl, batch)
        what = "reference" if rl.needs_reference_logprobs else "old policy"
        phases.append(Phase("log-probs", tuple(resident.terms("log-probs") + rollout + forward + overhead), models,
                            f"{what} log-probs{', values' if rl.has_critic else ''}, no grad, {batch} sequences "
                            "at a time"))
    own = resident.terms("training")
    others = [t for t in own if t not in resident.params and t not in resident.optimizer]
    head_point = (resident.params + resident.optimizer + _saved_activations(spec, rl, core, batch)
                  + _head_backward(spec, rl, batch)
                  + logprobs.rl_loss_terms(batch, rl.max_completion_length, trainer=rl.trainer,
                                           with_reference=rl.needs_reference_logprobs))
    train = _training(core, head_point, others + rollout) + overhead
    phases.append(Phase("training", tuple(train), models, f"policy forward + backward, {batch} completions"))
    if rl.has_critic:
        critic = _critic_training(spec, rl, critic_core, resident)
        phases.append(Phase("critic", tuple(critic + rollout + overhead),
                            models, f"critic (value model) forward + backward, {rl.critic_batch} sequences"))
    return phases, core


def _critic_training(spec: ModelSpec, rl: RLSetup, core: MemoryEstimate, resident: Resident) -> list[Term]:
    """The critic's update: the core's step on the same backbone (its peak terms, parameters / gradients /
    optimizer scaled to the value model's size; its activations the policy's, the score head's [B, T, 1] output
    instead of logits, which Loss.FUSED already leaves out), beside the other models' resident state."""
    fraction = critic_fraction(spec)
    own = [t for t in core.terms if t.category is not Category.OVERHEAD and t.name not in CE_LOSS_TERMS]
    rename = {Category.PARAMETERS: TermKey.CRITIC, Category.OPTIMIZER: TermKey.CRITIC_OPTIMIZER}
    scaled = [t for t in own if t.category not in (Category.PARAMETERS, Category.OPTIMIZER, Category.GRADIENTS)]
    scaled += _scaled([t for t in own if t.category in (Category.PARAMETERS, Category.OPTIMIZER)], fraction, rename)
    scaled += _critic_gradients(spec, rl, [t for t in own if t.category is Category.GRADIENTS], fraction)
    others = [t for t in resident.terms("critic") if t not in resident.critic_params
              and t not in resident.critic_optimizer]
    values = logprobs.rl_loss_terms(rl.critic_batch, rl.max_completion_length, trainer="critic",
                                    with_reference=False)
    return scaled + others + values


def _critic_gradients(spec: ModelSpec, rl: RLSetup, grads: list[Term], fraction: float) -> list[Term]:
    """The critic's gradients at its update's peak. When the core's peak holds every gradient (the optimizer step,
    or the end of backward) they scale with the value model's size. When it holds only some, the peak is in
    backward and the LM head's [V, h] gradient, the first one computed, is among them: a value model has no LM
    head, its first gradient is the score head's [1, h] + bias (measured: the critic's peak is its head's backward
    with no other gradient yet; scaling the LM head's gradient was the ~2% excess). A tied head's gradient lands in
    the embedding, which the critic computes last. Sharded gradients keep the scaling."""
    b = _dtype_bytes(rl)
    total = sum(t.num_bytes for t in grads)
    if rl.sharding != "none" or not grads or total >= spec.num_params * b:
        return _scaled(grads, fraction, {})
    head = spec.vocab_size * spec.hidden_size * b
    return [term(TermKey.GRADIENTS, Category.GRADIENTS, max(0, total - head) + (spec.hidden_size + 1) * b,
                 "the core's gradients at its backward peak less the LM head's [V, h], plus the score head's "
                 "[1, h] + bias", "transformers AutoModelForTokenClassification (num_labels=1): score = "
                 "nn.Linear(hidden_size, 1)")]


def dpo_phases(spec: ModelSpec, rl: RLSetup, hardware: Hardware) -> tuple[list[Phase], MemoryEstimate]:
    """DPO: chosen and rejected concatenated (2 x batch rows). Online reference log-probs run inside
    compute_loss after the policy's forward (dpo_trainer.py `_compute_loss`), so the policy's saved activations are
    alive under them; precomputed ones run once before training (`_precompute_ref_logps`), with no optimizer state
    yet, and then the full reference model is freed (non-LoRA, non-FSDP)."""
    kto = rl.trainer == "kto"
    rows = rl.per_device_train_batch_size if kto else 2 * rl.per_device_train_batch_size
    core = estimate(spec, training_setup(rl, hardware, rows), hardware)
    params = _pick(core, Category.PARAMETERS)
    static, overhead = _static(core, rl), _overhead(core)
    models = ("policy", "reference") if rl.has_reference_model else ("policy",)
    activations = _saved_activations(spec, rl, core, rows) + logprobs.rl_loss_terms(
        rows, rl.max_completion_length, trainer="dpo", with_reference=True)
    phases = []
    if kto:
        # kto_trainer.py `_compute_kl_logps`: the policy's log-probs of the mismatched KL rows, no grad, before its
        # own forward with grad: nothing of the step is alive yet
        phases.append(Phase("kl", tuple(static + _no_grad_forward(spec, rl, rows) + overhead),
                            ("policy", "reference") if rl.has_reference_model else ("policy",),
                            f"KTO's KL rows through the policy, no grad, {rows} rows"))
    if rl.precompute_ref_log_probs:
        pre_rows = (1 if kto else 2) * (rl.precompute_ref_batch_size or rl.per_device_train_batch_size)
        ref = [] if rl.lora else [term(TermKey.REFERENCE, Category.PARAMETERS, sum(
            t.num_bytes for t in params), "the reference model, loaded for the precompute", DPO)]
        phases.append(Phase("precompute", tuple(params + ref + _no_grad_forward(spec, rl, pre_rows) + overhead),
                            ("policy",) if rl.lora else ("policy", "reference"),
                            f"reference log-probs over the dataset, {pre_rows} rows at a time, before training"))
    else:
        saved = [t for t in _head_backward(spec, rl, rows) if t.category is Category.ACTIVATIONS]
        phases.append(Phase("log-probs", tuple(static + activations + saved + _no_grad_forward(spec, rl, rows)
                                               + overhead),
                            models, "online reference forward inside compute_loss, policy activations alive"))
    head_point = _pick(core, Category.PARAMETERS, Category.OPTIMIZER) + activations + _head_backward(spec, rl, rows)
    train = _training(core, head_point, _reference_weights(core, rl)) + overhead
    phases.append(Phase("training", tuple(train), models, f"policy forward + backward, {rows} rows"))
    return phases, core


def preference_phases(spec: ModelSpec, rl: RLSetup, hardware: Hardware) -> tuple[list[Phase], MemoryEstimate]:
    """ORPO, CPO and SimPO (trl.experimental, trl 1.16): chosen and rejected concatenated (2 x batch rows of
    prompt + completion) through the policy alone, no reference model, the logits materialised: one phase, the
    policy's step, whose peak is the head's backward (logprobs.preference_head_terms) or the core's own peak."""
    rows = 2 * rl.per_device_train_batch_size
    core = estimate(spec, training_setup(rl, hardware, rows), hardware)
    head = logprobs.preference_head_terms(spec, rows, rl.seq_len, nll=rl.trainer != "simpo",
                                          logits_bytes=_dtype_bytes(rl), triton=rl.triton, head_trainable=not rl.lora)
    head_point = (_pick(core, Category.PARAMETERS, Category.OPTIMIZER) + _saved_activations(spec, rl, core, rows)
                  + head + logprobs.rl_loss_terms(rows, rl.seq_len - 1, trainer=rl.trainer, with_reference=False))
    train = _training(core, head_point, []) + _overhead(core)
    return [Phase("training", tuple(train), ("policy",), f"policy forward + backward, {rows} rows (chosen + "
                  "rejected)")], core


def estimate_rl(spec: ModelSpec, rl: RLSetup, hardware: Hardware, *, margin: float = DEFAULT_MARGIN) -> RLEstimate:
    if rl.online:
        phases, core = grpo_phases(spec, rl, hardware)
    elif rl.trainer in REFERENCE_FREE:
        phases, core = preference_phases(spec, rl, hardware)
    else:
        phases, core = dpo_phases(spec, rl, hardware)
    advice = None
    notes = []
    if rl.online and rl.use_vllm:
        trainer_phases = phases
        phases, advice = _with_vllm(spec, rl, hardware, trainer_phases, core, margin)
        if advice.recommended is None and rl.vllm_mode == "colocate" and not rl.vllm_enable_sleep_mode:
            slept = _with_vllm(spec, rl.replace(vllm_enable_sleep_mode=True), hardware, trainer_phases, core,
                               margin)[1]
            if slept.recommended is not None:
                notes.append(f"with vllm_enable_sleep_mode: true (vLLM frees its weights and KV cache between "
                             f"rollouts) vllm_gpu_memory_utilization {slept.recommended:.2f} fits")
    return RLEstimate(spec.name, hardware.gpu.name, hardware.gpu.memory_bytes, rl, tuple(phases), advice,
                      tuple(notes))


def _with_vllm(spec: ModelSpec, rl: RLSetup, hardware: Hardware, phases: list[Phase], core: MemoryEstimate,
               margin: float) -> tuple[list[Phase], VllmAdvice]:
    """Colocate: the engine lives in the trainer's process (TRL `vllm_mode="colocate"`), its budget taken from the
    same GPU, sleeping (level 2, as TRL calls it) between rollouts when vllm_enable_sleep_mode. Server: the engine
    has GPUs of its own; the trainer's GPUs carry no rollout."""
    total = hardware.gpu.memory_bytes
    tp = rl.vllm_tensor_parallel_size
    # the engine's own whole copy of the weights in the checkpoint's dtype (bf16 here), split only by its TP: the
    # trainer's ZeRO-3 / FSDP shards do not shard it; a LoRA policy's adapters are merged into it before loading
    weights = spec.num_params * 2 // tp
    seqs = rl.vllm_max_num_seqs or default_max_num_seqs(total, hardware.gpu.name)
    budget = vllm_budget(spec, total=total, utilization=rl.vllm_gpu_memory_utilization, weights=weights,
                         max_num_seqs=seqs, tp=tp, kv_cache_dtype=rl.vllm_kv_cache_dtype,
                         enforce_eager=rl.vllm_enforce_eager)
    needed = rl.generation_batch * rl.seq_len
    usable = int(total * (1 - margin))
    if rl.vllm_mode == "server":  # `trl vllm-serve` on GPUs of its own: the engine alone under the margin
        return phases, _advice(budget, (usable - budget.cuda_graphs) / total, needed, total, rl.seq_len)
    sleep = 2 if rl.vllm_enable_sleep_mode else 0
    resident = vllm_terms(budget, generating=False, sleep_level=sleep)
    critic_core = estimate(spec, training_setup(rl.replace(lora=False), hardware, rl.per_device_train_batch_size),
                           hardware) if rl.lora and rl.has_critic else core
    static = Resident(spec, rl, core, critic_core).terms("generation", vllm=True)  # the trainer's, in the rollout
    overhead = [t for t in phases[-1].terms if t.category is Category.OVERHEAD]
    gen = Phase("generation", tuple(static + vllm_terms(budget, generating=True, sleep_level=sleep) + overhead),
                phases[-1].models + ("vllm",), f"vLLM colocated: {rl.generation_batch} completions")
    rest = [Phase(p.name, p.terms + tuple(resident), p.models + (("vllm",) if not sleep else ()), p.description)
            for p in phases]
    trainer_static = sum(t.num_bytes for t in static + overhead)
    # generation: trainer_static + requested + graphs <= usable; other phases: phase + resident(util) <= usable
    limits = [usable - trainer_static - budget.cuda_graphs]
    if not sleep:
        # resident(util) = requested(util) - activation peak + graphs (the KV cache takes what the rest leaves)
        limits += [usable - p.total_bytes + budget.activation_peak - budget.cuda_graphs for p in phases]
    best = min(limits) / total
    return [gen] + rest, _advice(budget, best, needed, total, rl.seq_len)


def _advice(budget, best: float | None, needed: int, total: int, max_model_len: int) -> VllmAdvice:
    floor_need = budget.weights + budget.activation_peak + budget.non_torch + needed * budget.bytes_per_token
    minimum = floor_need / total
    recommended = None
    if best is not None and best >= minimum:
        recommended = int(best * 100) / 100
    notes = []
    if budget.kv_tokens < max_model_len:
        # vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory: the engine refuses to start
        notes.append(f"at utilization {budget.utilization:g} vLLM cannot start: its KV cache holds "
                     f"{budget.kv_tokens:,} tokens, fewer than one sequence of {max_model_len:,} (ValueError at "
                     "engine start)")
    elif budget.kv_tokens < needed:
        notes.append(f"at utilization {budget.utilization:g} the KV cache holds {budget.kv_tokens:,} tokens, fewer "
                     f"than the {needed:,} of the generation batch: vLLM will preempt and recompute sequences")
    return VllmAdvice(budget.utilization, recommended, round(minimum, 4), budget.kv_cache, budget.kv_tokens,
                      budget.bytes_per_token, needed, notes=tuple(notes))
