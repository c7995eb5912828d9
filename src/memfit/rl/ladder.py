"""The RL ladder (issue 23), in the seed's spirit: from a recipe that does not fit, take the cheapest rung that
applies, re-estimate every phase, and stop at the first fit. The rungs, cheapest first:

1. gradient checkpointing (if off);
2. the LM head's fused log-probs (TRL 1.x) instead of materialised logits;
3. the reference off the GPU: precomputed reference log-probs (DPO / KTO), the reference weights offloaded outside
   their phase (verl ref param_offload, OpenRLHF --ref_reward_offload);
4. a LoRA policy whose reference is the base with the adapters off (no second model, no full optimizer state);
5. the colocated vLLM asleep between rollouts, then the utilization memfit recommends;
6. the trainer's parameters and optimizer state off the GPU during the rollout (verl param / optimizer offload,
   OpenRLHF --deepspeed_enable_sleep);
7. a smaller generation batch (fewer micro-batches generated at once), then a smaller micro-batch with more
   gradient accumulation (the same effective batch);
8. more GPUs: sharded trainer state, and for TRL the rollout on GPUs of its own (`trl vllm-serve`).

The solver answers "the largest num_generations / max_completion_length / per-device batch that fits" (a search
over the integer: every phase re-estimated at each probe) and "the fewest GPUs". `emit` spells the changed fields
as the framework's settings, vllm_gpu_memory_utilization first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..hardware import Hardware, make_hardware
from ..model_spec import ModelSpec
from .phases import estimate_rl
from .workload import REFERENCE_FREE, RLEstimate, RLSetup

MAX_GPUS = 512


@dataclass(frozen=True)
class Rung:
    name: str
    title: str
    setup: RLSetup
    gpus: int
    estimate: RLEstimate
    why: str

    def to_dict(self) -> dict:
        return {"name": self.name, "title": self.title, "why": self.why, "gpus": self.gpus,
                "peak_phase": self.estimate.peak.name, "peak_bytes": self.estimate.peak.total_bytes,
                "fits": self.estimate.fits}


@dataclass(frozen=True)
class RLPlan:
    start: RLEstimate
    rungs: tuple[Rung, ...]
    gpus: int
    settings: dict[str, object] = field(default_factory=dict)
    """The framework's settings that make it fit (changed ones only), vllm_gpu_memory_utilization first."""

    @property
    def final(self) -> RLEstimate:
        return self.rungs[-1].estimate if self.rungs else self.start

    @property
    def fits(self) -> bool:
        return self.final.fits

    def to_dict(self) -> dict:
        return {"fits_before": self.start.fits, "fits": self.fits, "gpus": self.gpus,
                "rungs": [r.to_dict() for r in self.rungs], "settings": dict(self.settings),
                "final": self.final.to_dict()}


def hardware_for(hardware: Hardware, gpus: int) -> Hardware:
    """`gpus` of the same kind, 8 per node beyond 8."""
    per_node = gpus if gpus <= 8 else 8
    return make_hardware(hardware.gpu, gpus_per_node=per_node, num_nodes=max(1, gpus // per_node),
                         cuda_runtime=hardware.cuda_runtime, allocator=hardware.allocator)


def _halve(value: int) -> int:
    return max(1, value // 2)


Step = Callable[[RLSetup, RLEstimate, int], "tuple[RLSetup, int, str] | None"]


def _checkpointing(rl: RLSetup, est: RLEstimate, gpus: int):
    if not rl.gradient_checkpointing:
        return rl.replace(gradient_checkpointing=True), gpus, "each layer keeps only its input for backward"
    return None


def _fused_head(rl: RLSetup, est: RLEstimate, gpus: int):
    # ORPO / CPO / SimPO materialise the logits whatever the setting (their concatenated_forward): no rung
    if rl.logprob_head != "fused" and rl.trainer not in REFERENCE_FREE:
        return rl.replace(logprob_head="fused"), gpus, "log-probs in tiles of the LM head, never B x T x V logits"
    return None


def _reference(rl: RLSetup, est: RLEstimate, gpus: int):
    if not rl.has_reference_model:
        return None
    if not rl.online and not rl.precompute_ref_log_probs:
        return (rl.replace(precompute_ref_log_probs=True), gpus,
                "the reference runs once before training and is freed (the precompute pass is its own phase)")
    if rl.online and not rl.ref_offload:
        return rl.replace(ref_offload=True), gpus, "the reference weights are on the GPU only for its log-probs"
    return None


def _lora(rl: RLSetup, est: RLEstimate, gpus: int):
    if not rl.lora:
        return (rl.replace(lora=True), gpus, "adapters train, the base is frozen" + (
            "" if rl.trainer in REFERENCE_FREE else " and doubles as the reference (adapters disabled)"))
    return None


def _vllm(rl: RLSetup, est: RLEstimate, gpus: int):
    if not (rl.online and rl.use_vllm and rl.vllm_mode == "colocate"):
        return None
    if not rl.vllm_enable_sleep_mode:
        return (rl.replace(vllm_enable_sleep_mode=True), gpus,
                "the engine frees its weights and KV cache between rollouts")
    advice = est.vllm
    if advice is not None and advice.recommended is not None and advice.recommended != rl.vllm_gpu_memory_utilization:
        return (rl.replace(vllm_gpu_memory_utilization=advice.recommended), gpus,
                f"the largest utilization that leaves every phase its room ({advice.recommended:.2f})")
    return None


def _offload_trainer(rl: RLSetup, est: RLEstimate, gpus: int):
    if rl.online and not (rl.param_offload and rl.optimizer_offload):
        return (rl.replace(param_offload=True, optimizer_offload=True), gpus,
                "parameters and optimizer state leave the GPU outside the phases that use them")
    return None


def _generation_batch(rl: RLSetup, est: RLEstimate, gpus: int):
    steps = rl.steps_per_generation or rl.gradient_accumulation_steps
    if rl.online and steps > 1:
        return (rl.replace(steps_per_generation=_halve(steps)), gpus,
                f"{_halve(steps) * rl.per_device_train_batch_size} completions generated at once instead of "
                f"{steps * rl.per_device_train_batch_size}")
    return None


def _micro_batch(rl: RLSetup, est: RLEstimate, gpus: int):
    batch = rl.per_device_train_batch_size
    if batch > 1:  # the generation batch (micro-batch x steps) stays: TRL's divisibility by num_generations holds
        factor = batch // _halve(batch)
        steps = rl.steps_per_generation or rl.gradient_accumulation_steps
        return (rl.replace(per_device_train_batch_size=_halve(batch),
                           gradient_accumulation_steps=rl.gradient_accumulation_steps * factor,
                           steps_per_generation=steps * factor if rl.online else rl.steps_per_generation), gpus,
                f"micro-batch {_halve(batch)} with {factor}x the accumulation: the same effective batch")
    return None


def _separate_rollout(rl: RLSetup, est: RLEstimate, gpus: int):
    if rl.online and rl.use_vllm and rl.vllm_mode == "colocate":
        return rl.replace(vllm_mode="server"), gpus, "the vLLM engine on GPUs of its own (trl vllm-serve)"
    return None


def _more_gpus(rl: RLSetup, est: RLEstimate, gpus: int):
    if gpus * 2 > MAX_GPUS:
        return None
    sharded = rl if rl.sharding == "zero3" else rl.replace(sharding="zero3")
    return sharded, gpus * 2, f"{gpus * 2} GPUs, the trainer's state sharded (ZeRO-3 / FSDP)"


RUNGS: tuple[tuple[str, str, Step], ...] = (
    ("checkpointing", "Gradient checkpointing", _checkpointing),
    ("fused-logprobs", "Fused log-probs from the LM head", _fused_head),
    ("reference", "Reference off the GPU", _reference),
    ("lora", "LoRA policy", _lora),
    ("vllm", "vLLM asleep between rollouts, the recommended utilization", _vllm),
    ("offload", "Trainer state offloaded during the rollout", _offload_trainer),
    ("generation-batch", "A smaller generation batch", _generation_batch),
    ("micro-batch", "A smaller micro-batch, more accumulation", _micro_batch),
    ("rollout-gpus", "Rollout on GPUs of its own", _separate_rollout),
    ("gpus", "More GPUs", _more_gpus),
)


def _estimate(spec: ModelSpec, rl: RLSetup, hardware: Hardware, gpus: int, margin: float) -> RLEstimate:
    return estimate_rl(spec, rl, hardware_for(hardware, gpus), margin=margin)


def plan_rl(spec: ModelSpec, rl: RLSetup, hardware: Hardware, *, margin: float, framework: str = "trl",
            keep: frozenset[str] = frozenset(), max_steps: int = 24) -> RLPlan:
    """Walk the rungs, cheapest first, from `rl` on `hardware` (its GPU count): each rung applies once per walk
    (more GPUs and the batch rungs repeat while they still apply); rungs named in `keep` are passed over."""
    gpus = hardware.world_size
    start = _estimate(spec, rl, hardware, gpus, margin)
    current, rungs = start, []
    setup = rl
    while not current.fits and len(rungs) < max_steps:
        for name, title, step in RUNGS:
            if name in keep:
                continue
            proposal = step(setup, current, gpus)
            if proposal is None or not _spellable(setup, proposal[0], framework):
                continue
            setup, gpus, why = proposal
            current = _estimate(spec, setup, hardware, gpus, margin)
            rungs.append(Rung(name, title, setup, gpus, current, why))
            break
        else:
            break
    final = rungs[-1].setup if rungs else rl
    if current.fits and len(rungs) > 1:
        final, current, rungs = _undo_unneeded(spec, rl, hardware, gpus, margin, rungs, current)
    if current.fits and final.use_vllm and final.vllm_mode == "colocate" and current.vllm is not None and \
            current.vllm.recommended is not None and current.vllm.recommended != final.vllm_gpu_memory_utilization:
        # the last rung fit with the user's utilization: still say which one leaves the most KV cache
        final = final.replace(vllm_gpu_memory_utilization=current.vllm.recommended)
        current = _estimate(spec, final, hardware, gpus, margin)
        rungs.append(Rung("vllm", "The recommended vLLM utilization", final, gpus, current,
                          f"the largest utilization that leaves every phase its room "
                          f"({final.vllm_gpu_memory_utilization:.2f})"))
    return RLPlan(start, tuple(rungs), gpus, emit(rl, final, hardware.world_size, gpus, framework))


INTERNAL = ("notes", "sharding", "engine", "lora", "steps_per_generation", "gradient_accumulation_steps")
"""Fields every framework spells another way: the GPU count / sharding, LoRA by its rank, the generation batch by
the global batch (verl, OpenRLHF) or steps_per_generation (TRL)."""


def _spellable(before: RLSetup, after: RLSetup, framework: str) -> bool:
    """Whether the framework has a setting for every field a rung changes (TRL has no reference or trainer-state
    offload of its own: those rungs are passed over for a TRL recipe)."""
    keys = KEYS[framework]
    return all(name in keys or name in INTERNAL for name in RLSetup.__dataclass_fields__
               if getattr(before, name) != getattr(after, name))


def _undo_unneeded(spec: ModelSpec, rl: RLSetup, hardware: Hardware, gpus: int, margin: float, rungs: list[Rung],
                   current: RLEstimate) -> tuple[RLSetup, RLEstimate, list[Rung]]:
    """A rung a later one made unnecessary is undone (a LoRA policy needs no precomputed reference: its reference
    is the base), latest first, keeping the fit; each undo is a rung of its own so the walk stays readable."""
    final = rungs[-1].setup
    for rung, before in zip(reversed(rungs[:-1]), reversed([rl] + [r.setup for r in rungs[:-2]])):
        if rung.name in ("gpus", "vllm"):
            continue
        changed = {n: getattr(before, n) for n in RLSetup.__dataclass_fields__
                   if getattr(before, n) != getattr(rung.setup, n) and getattr(final, n) == getattr(rung.setup, n)}
        if not changed:
            continue
        trial = final.replace(**changed)
        result = _estimate(spec, trial, hardware, gpus, margin)
        if result.fits:
            final, current = trial, result
            rungs = rungs + [Rung("undo", f"Undo: {rung.title}", final, gpus, result,
                                  "no longer needed after the later steps")]
    return final, current, rungs


# --- the solver -----------------------------------------------------------------------------------------------

SOLVABLE = ("num_generations", "max_completion_length", "per_device_train_batch_size", "max_prompt_length")


def largest(spec: ModelSpec, rl: RLSetup, hardware: Hardware, name: str, *, margin: float,
            limit: int = 1 << 20) -> tuple[int | None, RLEstimate | None]:
    """The largest value of `name` (a positive integer field) with which every phase fits, by bisection (memory
    grows with each of them); (None, None) when even 1 does not fit. GRPO's generation batch must stay a multiple
    of num_generations (TRL checks it), so num_generations grows with the generation batch it needs."""
    if name not in SOLVABLE:
        raise ValueError(f"--max takes one of {', '.join(SOLVABLE)}")

    def at(value: int) -> RLEstimate:
        changes = {name: value}
        if name == "num_generations" and rl.trainer == "grpo":
            # every prompt's completions in one generation batch (grpo_config.py: generation_batch_size must be
            # divisible by num_generations): the batch grows in micro-batches to hold them
            steps = -(-value // rl.per_device_train_batch_size)
            changes["steps_per_generation"] = max(steps, rl.steps_per_generation or rl.gradient_accumulation_steps)
        return estimate_rl(spec, rl.replace(**changes), hardware, margin=margin)

    start = 0 if name == "max_prompt_length" else 1
    best = at(start)
    if not _holds(best):
        return None, None
    low = start
    while True:
        probe = max(1, low * 2)
        if probe > limit:
            return low, best
        result = at(probe)
        if not _holds(result):
            high = probe
            break
        low, best = probe, result
    while high - low > 1:
        mid = (low + high) // 2
        result = at(mid)
        if _holds(result):
            low, best = mid, result
        else:
            high = mid
    return low, best


def _holds(result: RLEstimate) -> bool:
    """Fits, and a vLLM engine's KV cache holds the whole generation batch at full length: with less, vLLM
    preempts and recomputes sequences (slower, never out of memory), so memory alone would bound nothing."""
    return result.fits and (result.vllm is None or result.vllm.kv_tokens >= result.vllm.needed_kv_tokens)


def fewest_gpus(spec: ModelSpec, rl: RLSetup, hardware: Hardware, *,
                margin: float) -> tuple[int | None, RLEstimate | None]:
    """The fewest GPUs (1, 2, 4, ... MAX_GPUS) on which the recipe fits, its trainer state sharded (ZeRO-3 / FSDP)
    beyond one GPU, nothing else changed."""
    gpus = 1
    while gpus <= MAX_GPUS:
        setup = rl if gpus == 1 or rl.sharding == "zero3" else rl.replace(sharding="zero3")
        result = _estimate(spec, setup, hardware, gpus, margin)
        if result.fits:
            return gpus, result
        gpus *= 2
    return None, None


# --- emitting the settings --------------------------------------------------------------------------------------

TRL_KEYS = {"vllm_gpu_memory_utilization": "vllm_gpu_memory_utilization",
            "vllm_enable_sleep_mode": "vllm_enable_sleep_mode", "vllm_mode": "vllm_mode",
            "gradient_checkpointing": "gradient_checkpointing", "lora": "use_peft", "lora_rank": "lora_r",
            "precompute_ref_log_probs": "precompute_ref_log_probs",
            "per_device_train_batch_size": "per_device_train_batch_size",
            "gradient_accumulation_steps": "gradient_accumulation_steps",
            "steps_per_generation": "steps_per_generation", "num_generations": "num_generations",
            "max_completion_length": "max_completion_length", "max_prompt_length": "max_prompt_length"}
"""RLSetup field -> TRL config key (GRPOConfig / DPOConfig / KTOConfig / RLOOConfig, ModelConfig for use_peft /
lora_r). A field missing here (the reference / trainer offloads) has no TRL key: its rung is taken only where the
framework has one, and the note says so."""
VERL_KEYS = {"vllm_gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
             "vllm_enable_sleep_mode": "actor_rollout_ref.rollout.free_cache_engine",
             "gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
             "lora_rank": "actor_rollout_ref.model.lora_rank",
             "ref_offload": "actor_rollout_ref.ref.fsdp_config.param_offload",
             "param_offload": "actor_rollout_ref.actor.fsdp_config.param_offload",
             "optimizer_offload": "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
             "per_device_train_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
             "num_generations": "actor_rollout_ref.rollout.n", "max_completion_length": "data.max_response_length",
             "max_prompt_length": "data.max_prompt_length"}
OPENRLHF_KEYS = {"vllm_gpu_memory_utilization": "--vllm_gpu_memory_utilization",
                 "vllm_enable_sleep_mode": "--vllm_enable_sleep", "gradient_checkpointing": "--gradient_checkpointing",
                 "lora_rank": "--lora_rank", "ref_offload": "--ref_reward_offload",
                 "param_offload": "--deepspeed_enable_sleep", "optimizer_offload": "--adam_offload",
                 "per_device_train_batch_size": "--micro_train_batch_size", "num_generations": "--n_samples_per_prompt",
                 "max_completion_length": "--generate_max_len", "max_prompt_length": "--prompt_max_len"}
KEYS = {"trl": TRL_KEYS, "verl": VERL_KEYS, "openrlhf": OPENRLHF_KEYS}


def emit(before: RLSetup, after: RLSetup, gpus_before: int, gpus: int, framework: str) -> dict[str, object]:
    """The changed fields as `framework`'s settings, vllm_gpu_memory_utilization first; a change the framework has
    no key for is listed under '#' with its field name."""
    keys = KEYS[framework]
    out: dict[str, object] = {}
    unspelled = []
    order = ["vllm_gpu_memory_utilization"] + [k for k in RLSetup.__dataclass_fields__ if
                                                k != "vllm_gpu_memory_utilization"]
    for name in order:
        old, new = getattr(before, name), getattr(after, name)
        if old == new or name in ("notes", "sharding"):
            continue
        if name == "lora" and framework != "trl":
            continue  # the rank says it (lora_rank > 0)
        if name == "lora_rank" and framework != "trl" and not after.lora:
            continue
        key = keys.get(name)
        if key is None:
            if name == "steps_per_generation" and framework != "trl":
                continue  # below: the global batch that sets it
            unspelled.append(f"{name}={new}")
            continue
        out[key] = new
    if after.lora and not before.lora and framework != "trl":
        out[keys["lora_rank"]] = after.lora_rank
    if framework == "trl" and after.lora and not before.lora:
        out["lora_r"] = after.lora_rank
    steps_before = before.steps_per_generation or before.gradient_accumulation_steps
    steps_after = after.steps_per_generation or after.gradient_accumulation_steps
    if framework != "trl" and (steps_before != steps_after or gpus != gpus_before
                               or before.per_device_train_batch_size != after.per_device_train_batch_size):
        prompts = max(1, after.per_device_train_batch_size * steps_after * gpus // max(1, after.num_generations))
        out["data.train_batch_size" if framework == "verl" else "--rollout_batch_size"] = prompts
    if gpus != gpus_before:
        if framework == "verl":
            out["trainer.n_gpus_per_node"] = min(gpus, 8)
            out["trainer.nnodes"] = max(1, gpus // 8)
        elif framework == "openrlhf":
            out["--actor_num_gpus_per_node"] = min(gpus, 8)
            out["--actor_num_nodes"] = max(1, gpus // 8)
        else:
            out["# GPUs"] = gpus
    if unspelled:
        out["#"] = f"no {framework} key for: {', '.join(unspelled)}"
    return out
