"""An RL post-training step as phases (rollout generation, reference log-probs, the policy's training step), each
with the models and tensors alive in it. The job's peak per GPU is the largest phase: phases that do not coexist are
never summed (issue 23).

`RLSetup` holds what TRL's GRPOConfig / DPOConfig decide for memory, with TRL's defaults (trl 1.x,
trl/trainer/grpo_config.py and dpo_config.py); `Phase` is one bar; `RLEstimate` the answer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..estimate.result import Category, Term

TRAINERS = ("grpo", "rloo", "ppo", "dpo", "kto", "orpo", "cpo", "simpo")
ONLINE = ("grpo", "rloo", "ppo")
"""Trainers that generate their rollouts; the others (DPO, KTO, ORPO, CPO, SimPO) train on a fixed preference
dataset."""
REFERENCE_FREE = ("orpo", "cpo", "simpo")
"""Preference trainers with no reference model (trl.experimental.orpo / .cpo, trl 1.16): chosen and rejected
concatenated through the policy alone, over materialised logits. 'simpo' is CPOTrainer with loss_type 'simpo' and
cpo_alpha 0 (no NLL term on the chosen half); 'cpo' keeps cpo_alpha's default 1.0; ORPO always adds the NLL."""
DEFAULT_BETA = {"grpo": 0.0, "rloo": 0.05, "ppo": 0.05, "dpo": 0.1, "kto": 0.1, "orpo": 0.1, "cpo": 0.1,
                "simpo": 0.1}
"""The KL / preference weight each trainer's config defaults to (trl 1.16 grpo_config.py, rloo_config.py,
dpo_config.py, kto_config.py, experimental orpo_config.py / cpo_config.py; PPO: TRL 0.x PPOConfig kl_coef 0.05).
ORPO's beta is the odds-ratio weight; none of the three loads a reference for it."""
VLLM_MODES = ("colocate", "server")
KV_CACHE_DTYPES = (None, "auto", "bfloat16", "float16", "half", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM CacheConfig.cache_dtype values memfit sizes (vllm/config/cache.py CacheDType)."""
SHARDINGS = ("none", "zero1", "zero2", "zero3")
LOGPROB_HEADS = ("fused", "selective", "full")
"""How the per-token log-probs are taken from the LM head: 'fused' is TRL 1.x's `add_fused_lm_head` (tiles of the
head's output, never the B x T x V logits: trl/trainer/utils.py, trl/kernels/chunked_logprob.py); 'selective' is
TRL 0.x's `selective_log_softmax` over materialised logits (row-wise logsumexp, no full log-softmax); 'full' the
naive `log_softmax(logits).gather(...)`."""


@dataclass(frozen=True)
class RLSetup:
    """One RL recipe as TRL configures it. Lengths in tokens; batch sizes per device."""

    trainer: str = "grpo"
    per_device_train_batch_size: int = 8
    """GRPO: completions per micro-batch (TRL counts completions, not prompts); DPO: preference pairs."""
    num_generations: int = 8
    max_prompt_length: int = 512
    max_completion_length: int = 512
    """GRPO: tokens generated per completion; DPO: the completion (chosen / rejected) length."""
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    """GRPO: micro-batches generated at once (TRL default: gradient_accumulation_steps)."""
    num_iterations: int = 1
    beta: float = 0.0
    """KL weight; GRPO's default 0.0 loads no reference model (grpo_trainer.py: `if self.beta == 0.0`)."""
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False
    vllm_tensor_parallel_size: int = 1
    vllm_kv_cache_dtype: str | None = None
    vllm_max_num_seqs: int | None = None
    """None: vLLM's default (1024 on a >= 70 GiB GPU that is not an A100, else 256: vllm/engine/arg_utils.py)."""
    vllm_enforce_eager: bool = False
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    gradient_checkpointing: bool = True
    bf16: bool = True
    lora: bool = False
    lora_rank: int = 16
    logprob_head: str = "fused"
    triton: bool = True
    """Whether TRL's fused head runs its Triton kernels (a CUDA/XPU device) or the torch fallback (CPU)."""
    critic: bool | None = None
    """A value model trained beside the policy (PPO's critic, verl `critic.*`, adv_estimator 'gae'); None: PPO
    only."""
    critic_micro_batch_size: int | None = None
    """The critic update's micro-batch (verl critic.ppo_micro_batch_size_per_gpu); None: the actor's (OpenRLHF's
    --micro_train_batch_size is shared)."""
    reward_model: bool = False
    """A reward model's weights on the trainer's GPUs (verl reward_model.enable, OpenRLHF --reward_pretrain); TRL's
    GRPO / RLOO here score with functions."""
    sharding: str = "none"
    """How the trainer's state is split over the GPUs: 'none' (DDP), 'zero2', 'zero3' (= FSDP full shard: verl's
    FSDP workers, OpenRLHF --zero_stage 3)."""
    engine: str = "deepspeed"
    """Who shards the trainer's state: 'deepspeed' (OpenRLHF, TRL with accelerate's DeepSpeed) or 'torch' (FSDP:
    verl's FSDP workers)."""
    param_offload: bool = False
    """verl fsdp_config.param_offload: the trainer's parameters leave the GPU outside the phases that compute with
    them (the rollout with vLLM, the other model's update)."""
    optimizer_offload: bool = False
    """verl fsdp_config.optimizer_offload / OpenRLHF --adam_offload: the optimizer state is on the GPU only for its
    model's update (verl loads it before `update_actor` and offloads it after)."""
    ref_offload: bool = False
    """verl ref.fsdp_config.param_offload / OpenRLHF --ref_reward_offload: the reference (and reward) weights
    leave the GPU outside the log-probs phase."""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = ((self.trainer in TRAINERS, f"trainer must be one of {', '.join(TRAINERS)}"),
                  (self.vllm_mode in VLLM_MODES, f"vllm_mode must be one of {', '.join(VLLM_MODES)}"),
                  (self.logprob_head in LOGPROB_HEADS, f"logprob head must be one of {', '.join(LOGPROB_HEADS)}"),
                  (0.0 < self.vllm_gpu_memory_utilization <= 1.0, "vllm_gpu_memory_utilization must be in (0, 1]"),
                  (self.beta >= 0.0, f"beta must be >= 0, got {self.beta:g}"),
                  (self.sharding in SHARDINGS, f"sharding must be one of {', '.join(SHARDINGS)}"),
                  (self.engine in ("deepspeed", "torch"), "engine must be deepspeed or torch"),
                  (self.vllm_kv_cache_dtype in KV_CACHE_DTYPES,
                   f"vllm_kv_cache_dtype must be one of {', '.join(str(d) for d in KV_CACHE_DTYPES[1:])}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for name in ("per_device_train_batch_size", "num_generations", "max_completion_length",
                     "gradient_accumulation_steps", "num_iterations", "vllm_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.critic_micro_batch_size is not None and self.critic_micro_batch_size < 1:
            raise ValueError(f"critic_micro_batch_size must be at least 1, got {self.critic_micro_batch_size}")
        if self.max_prompt_length < 0:
            raise ValueError(f"max_prompt_length must be >= 0, got {self.max_prompt_length}")

    def replace(self, **changes) -> RLSetup:
        return replace(self, **changes)

    @property
    def seq_len(self) -> int:
        """Prompt + completion: the length every log-prob forward runs over."""
        return self.max_prompt_length + self.max_completion_length

    @property
    def generation_batch(self) -> int:
        """Completions generated per device in one call (grpo_config.py: per_device_train_batch_size x
        steps_per_generation, steps_per_generation defaulting to gradient_accumulation_steps)."""
        return self.per_device_train_batch_size * (self.steps_per_generation or self.gradient_accumulation_steps)

    @property
    def has_reference_model(self) -> bool:
        """A second copy of the weights: GRPO with beta > 0, DPO without precomputed log-probs; never for a LoRA
        policy, whose reference is the base with the adapters disabled (trl `use_adapter(model, None)`)."""
        if self.lora or self.trainer in REFERENCE_FREE:
            return False
        if self.trainer in ONLINE:
            return self.beta > 0.0
        return not self.precompute_ref_log_probs

    @property
    def needs_reference_logprobs(self) -> bool:
        if self.trainer in REFERENCE_FREE:
            return False
        return self.beta > 0.0 if self.trainer in ONLINE else True

    @property
    def online(self) -> bool:
        return self.trainer in ONLINE

    @property
    def critic_batch(self) -> int:
        return self.critic_micro_batch_size or self.per_device_train_batch_size

    @property
    def has_critic(self) -> bool:
        return self.trainer == "ppo" if self.critic is None else self.critic


@dataclass(frozen=True)
class Phase:
    """One bar: what is alive on one GPU at this phase's peak."""

    name: str
    terms: tuple[Term, ...]
    models: tuple[str, ...]
    """The models with weights on the GPU in this phase ('policy', 'reference', 'vllm')."""
    description: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(term.num_bytes for term in self.terms)

    @property
    def tensor_bytes(self) -> int:
        """Without the overhead category (CUDA context, allocator): what a CPU measurement sees."""
        return sum(term.num_bytes for term in self.terms if term.category is not Category.OVERHEAD)

    def by_category(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for term in self.terms:
            totals[term.category.value] = totals.get(term.category.value, 0) + term.num_bytes
        return totals

    def to_dict(self) -> dict:
        return {"name": self.name, "models": list(self.models), "description": self.description,
                "total_bytes": self.total_bytes, "tensor_bytes": self.tensor_bytes,
                "by_category": self.by_category(), "terms": [term.to_dict() for term in self.terms]}


@dataclass(frozen=True)
class VllmAdvice:
    """The colocated vLLM engine's budget and the gpu_memory_utilization that leaves the trainer its peak."""

    utilization: float
    """The utilization the estimate used (the user's)."""
    recommended: float | None
    """The largest utilization (2 decimals, rounded down) with which every phase fits; None: none does."""
    minimum: float
    """The smallest utilization whose KV cache holds the generation batch (every sequence at full length)."""
    kv_cache_bytes: int
    kv_tokens: int
    kv_bytes_per_token: int
    needed_kv_tokens: int
    terms: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"utilization": self.utilization, "recommended": self.recommended, "minimum": self.minimum,
                "kv_cache_bytes": self.kv_cache_bytes, "kv_tokens": self.kv_tokens,
                "kv_bytes_per_token": self.kv_bytes_per_token, "needed_kv_tokens": self.needed_kv_tokens,
                "terms": [term.to_dict() for term in self.terms], "notes": list(self.notes)}


@dataclass(frozen=True)
class RLEstimate:
    model: str
    gpu: str
    gpu_memory_bytes: int
    setup: RLSetup
    phases: tuple[Phase, ...]
    vllm: VllmAdvice | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total_bytes)

    @property
    def fits(self) -> bool:
        """The peak phase fits the GPU, and a vLLM engine has room for at least one full sequence."""
        engine_ok = self.vllm is None or self.vllm.kv_tokens >= self.setup.seq_len
        return self.peak.total_bytes <= self.gpu_memory_bytes and engine_ok

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"model": self.model, "gpu": self.gpu, "gpu_memory_bytes": self.gpu_memory_bytes,
                "setup": {k: v for k, v in asdict(self.setup).items() if k != "notes"},
                "phases": [phase.to_dict() for phase in self.phases], "peak_phase": self.peak.name,
                "peak_bytes": self.peak.total_bytes, "fits": self.fits,
                "vllm": self.vllm.to_dict() if self.vllm is not None else None,
                "notes": list(self.notes) + list(self.setup.notes)}


def term(name: str, category: Category, num_bytes: float, formula: str, source: str, figure: str = "") -> Term:
    return Term(name, category, int(num_bytes), formula, source, figure)
