"""verl's trainer config: the Hydra YAML of `python -m verl.trainer.main_ppo` (verl/trainer/config/ppo_trainer.yaml),
or a launch script's `key=value` overrides of it, as RLSetup fields."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...readers._reader import NOT_RELEVANT, NOT_SIZED, Reader, show
from ...readers.files import load_mapping
from .common import VERL, Reading, _bool, _count, _done, _float, _int, _Keys, _resolve, _scalar, _tokens, flatten

A, R, REF, M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.", \
    "actor_rollout_ref.model."
VERL_SOURCE = "verl/trainer/config/ppo_trainer.yaml"


def read_verl(path: str | Path) -> Reading:
    path = Path(path)
    shown = str(path)
    if path.suffix in (".sh", ".bash", ".txt", ""):
        flat = {}
        for word in _tokens(path, shown):
            if "=" in word and not word.startswith("-"):
                key, value = word.split("=", 1)
                key = key.lstrip("+")
                if "." in key:
                    flat[key] = _scalar(value)
    else:
        flat = flatten(load_mapping(path, shown))
    return verl_settings(_resolve(flat), shown)


ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo"}
"""verl algorithm.adv_estimator -> the trainer whose phases memfit sizes: GAE needs the critic; every other
estimator (grpo, rloo, reinforce_plus_plus, remax, opo, ...) is critic-free and sized as GRPO's phases."""


def verl_settings(flat: Mapping[str, Any], shown: str) -> Reading:
    read = Reader(file=shown, strict=True)
    get = flat.get
    keys = _Keys(read, flat, {"engine": "torch"})
    gpus = _count(read, "trainer.n_gpus_per_node", get("trainer.n_gpus_per_node", 8)) * _count(
        read, "trainer.nnodes", get("trainer.nnodes", 1))
    n = _int(read, R + "n", get(R + "n", 1))
    estimator = get("algorithm.adv_estimator", "gae")
    trainer = ESTIMATORS.get(str(estimator), "grpo")
    keys.out["trainer"] = trainer
    read.set("trainer", trainer, "algorithm.adv_estimator", estimator,
             "GAE: a critic" if trainer == "ppo" else "critic-free")
    keys.handled |= {"algorithm.adv_estimator", "trainer.n_gpus_per_node", "trainer.nnodes"}
    _verl_switches(keys)
    _verl_rollout(keys, shown)
    _verl_reference(keys)
    _verl_batches(keys, gpus, n)
    _verl_sharding(keys, gpus, shown)
    _verl_rest(keys, trainer, estimator, shown)
    model_name = read.model[0] if read.model else None
    deferred = _done(read, flat, keys.handled, shown)
    return Reading(VERL, keys.out, model_name, gpus, tuple(read.mapped), tuple(read.ignored), deferred)


def _verl_switches(keys: _Keys) -> None:
    """Lengths, vLLM settings, gradient checkpointing, the FSDP workers' offload, the reward model."""
    keys.take("data.max_prompt_length", "max_prompt_length", lambda read, key, value: _count(read, key, value, 0))
    keys.take("data.max_response_length", "max_completion_length", _count)
    keys.take(R + "n", "num_generations", _int, "responses per prompt")
    if keys.take(R + "gpu_memory_utilization", "vllm_gpu_memory_utilization", _float) is None:
        keys.out["vllm_gpu_memory_utilization"] = 0.5  # ppo_trainer.yaml's default
    keys.take(R + "tensor_model_parallel_size", "vllm_tensor_parallel_size", _int)
    # ppo_trainer.yaml's rollout defaults where the file is silent: enforce_eager True, max_num_seqs 1024,
    # free_cache_engine True (the engine sleeps between rollouts)
    keys.out.update(vllm_enforce_eager=True, vllm_max_num_seqs=1024, vllm_enable_sleep_mode=True)
    keys.take(R + "enforce_eager", "vllm_enforce_eager", _bool)
    keys.take(R + "max_num_seqs", "vllm_max_num_seqs", _int)
    keys.take(R + "free_cache_engine", "vllm_enable_sleep_mode", _bool,
              "the engine sleeps between rollouts (weights offloaded, KV cache freed)")
    keys.take(M + "enable_gradient_checkpointing", "gradient_checkpointing", _bool)
    keys.take(A + "fsdp_config.param_offload", "param_offload", _bool)
    keys.take(A + "fsdp_config.optimizer_offload", "optimizer_offload", _bool)
    keys.take(REF + "fsdp_config.param_offload", "ref_offload", _bool)
    keys.take("reward_model.enable", "reward_model", _bool)


def _verl_rollout(keys: _Keys, shown: str) -> None:
    """The rollout engine (vLLM colocated with the FSDP workers, or HF generate) and a LoRA actor."""
    read, out, get = keys.read, keys.out, keys.get
    keys.handled.add(R + "name")
    name = get(R + "name", "vllm")
    if name == "vllm":
        out.update(use_vllm=True, vllm_mode="colocate")
        read.set("use_vllm", True, R + "name", name, "colocated with the FSDP workers (hybrid engine)")
    elif name == "hf":
        out["use_vllm"] = False
        read.set("use_vllm", False, R + "name", name, "HF generate")
    else:
        raise ConfigError(f"{shown}: {R}name={show(name)}: memfit sizes vLLM and HF rollouts, not {name}")
    keys.handled.add(M + "lora_rank")
    rank = get(M + "lora_rank", 0) or 0
    if _int(read, M + "lora_rank", rank) > 0:
        out.update(lora=True, lora_rank=rank)
        read.set("lora", True, M + "lora_rank", rank, "LoRA actor; the reference is the base, adapters off")


def _verl_reference(keys: _Keys) -> None:
    """A reference policy when the KL is a loss or a reward penalty (verl ray_trainer need_reference_policy)."""
    read, get = keys.read, keys.get
    keys.handled |= {A + "use_kl_loss", A + "kl_loss_coef", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef"}
    kl_loss = _bool(read, A + "use_kl_loss", get(A + "use_kl_loss", False))
    kl_reward = _bool(read, "algorithm.use_kl_in_reward", get("algorithm.use_kl_in_reward", False))
    beta = 0.0
    if kl_loss:
        beta = _float(read, A + "kl_loss_coef", get(A + "kl_loss_coef", 0.001))
        read.set("beta", beta, A + "kl_loss_coef", beta, "use_kl_loss: a reference model")
    elif kl_reward:
        beta = _float(read, "algorithm.kl_ctrl.kl_coef", get("algorithm.kl_ctrl.kl_coef", 0.001))
        read.set("beta", beta, "algorithm.kl_ctrl.kl_coef", beta, "use_kl_in_reward: a reference model")
    keys.out["beta"] = beta


def _verl_batches(keys: _Keys, gpus: int, n: int) -> None:
    """The update's per-GPU micro-batch (sequences, or tokens with use_dynamic_bsz); how many a generation makes."""
    read, out, get = keys.read, keys.out, keys.get
    keys.handled |= {A + "ppo_mini_batch_size", "data.train_batch_size"}
    seq = out.get("max_prompt_length", 512) + out.get("max_completion_length", 512)
    micro = _micro_batch(keys, A, "per_device_train_batch_size", gpus, seq, get(A + "use_dynamic_bsz", False), 16384)
    if micro is not None:
        out["per_device_train_batch_size"] = micro
    batch = _int(read, "data.train_batch_size", get("data.train_batch_size", 1024))
    per_gpu = max(1, -(-batch * n // gpus))
    micro = out.get("per_device_train_batch_size", 8)
    out["steps_per_generation"] = max(1, -(-per_gpu // micro))
    read.set("steps_per_generation", out["steps_per_generation"], "data.train_batch_size", batch,
             f"x n {n} / {gpus} GPUs = {per_gpu} responses generated per GPU at once")
    if out.get("trainer") == "ppo":
        # the critic update's own micro-batch; verl's dp_critic splits the batch as dp_actor does.
        # ppo_trainer.yaml: critic.use_dynamic_bsz defaults to the actor's, ppo_max_token_len_per_gpu to 32768
        critic = _micro_batch(keys, "critic.", "critic_micro_batch_size", gpus, seq,
                              get("critic.use_dynamic_bsz", get(A + "use_dynamic_bsz", False)), 32768)
        if critic is not None:
            out["critic_micro_batch_size"] = critic
    if get(A + "ppo_mini_batch_size") is not None:
        read.defer(A + "ppo_mini_batch_size", get(A + "ppo_mini_batch_size"),
                   "the optimizer step's batch: gradients accumulate in place, no memory of its own")


def _micro_batch(keys: _Keys, prefix: str, field: str, gpus: int, seq: int, dynamic: Any,
                 tokens_default: int) -> int | None:
    """verl's micro-batch of one update (`prefix`: the actor's or the critic's keys): use_dynamic_bsz's
    ppo_max_token_len_per_gpu // the sequence, else ppo_micro_batch_size_per_gpu, else the global
    ppo_micro_batch_size / GPUs; None when the config says none of them."""
    read, get = keys.read, keys.get
    keys.handled |= {prefix + "ppo_micro_batch_size_per_gpu", prefix + "ppo_micro_batch_size",
                     prefix + "use_dynamic_bsz", prefix + "ppo_max_token_len_per_gpu"}
    if _bool(read, prefix + "use_dynamic_bsz", dynamic):
        tokens = _int(read, prefix + "ppo_max_token_len_per_gpu",
                      get(prefix + "ppo_max_token_len_per_gpu", tokens_default))
        micro = max(1, tokens // seq)
        read.set(field, micro, prefix + "ppo_max_token_len_per_gpu", tokens,
                 f"use_dynamic_bsz: {tokens} tokens // {seq} per full-length sequence")
    elif get(prefix + "ppo_micro_batch_size_per_gpu") is not None:
        micro = _count(read, prefix + "ppo_micro_batch_size_per_gpu", get(prefix + "ppo_micro_batch_size_per_gpu"))
        read.set(field, micro, prefix + "ppo_micro_batch_size_per_gpu", micro)
    elif get(prefix + "ppo_micro_batch_size") is not None:
        micro = max(1, _int(read, prefix + "ppo_micro_batch_size", get(prefix + "ppo_micro_batch_size")) // gpus)
        read.set(field, micro, prefix + "ppo_micro_batch_size", get(prefix + "ppo_micro_batch_size"),
                 f"global, / {gpus} GPUs")
    else:
        return None
    return micro


def _verl_sharding(keys: _Keys, gpus: int, shown: str) -> None:
    """The workers' FSDP full shard, and the model."""
    read, get = keys.read, keys.get
    strategy = get(A + "strategy", "fsdp")
    keys.handled.add(A + "strategy")
    if strategy in ("fsdp", "fsdp2"):
        keys.out["sharding"] = "zero3" if gpus > 1 else "none"
        read.set("sharding", keys.out["sharding"], A + "strategy", strategy, f"FSDP full shard over {gpus} GPUs")
    else:
        raise ConfigError(f"{shown}: {A}strategy={show(strategy)}: memfit sizes verl's FSDP workers, not {strategy}")
    model = get(M + "path")
    keys.handled.add(M + "path")
    if isinstance(model, str) and model:
        read.set_model(model, M + "path", model)


def _verl_rest(keys: _Keys, trainer: str, estimator: Any, shown: str) -> None:
    """Ulysses and a critic offloading otherwise than the actor (not sized), and every other key (not relevant)."""
    read, get, flat = keys.read, keys.get, keys.keys
    for key in (A + "ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"):
        keys.handled.add(key)
        if get(key) not in (None, 1):
            read.ignore(key, get(key), NOT_SIZED + ": Ulysses sequence parallelism (sized as 1)")
    for key in ("critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload"):
        keys.handled.add(key)
        mine = "param_offload" if key.endswith("param_offload") else "optimizer_offload"
        if key in flat and flat[key] is not None and bool(flat[key]) != keys.out.get(mine, False):
            read.ignore(key, flat[key], f"{NOT_SIZED}: the critic offloads as the actor does ({mine} "
                                        f"{keys.out.get(mine, False)})")
    for key, value in flat.items():
        if key in keys.handled or key in read.consumed.get(shown, set()):
            continue
        if trainer != "ppo" and key.startswith("critic."):
            read.ignore(key, value, f"no critic with adv_estimator {estimator}")
        else:
            read.ignore(key, value, NOT_RELEVANT)
