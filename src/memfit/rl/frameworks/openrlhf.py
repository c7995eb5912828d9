"""OpenRLHF's command line: the arguments of `openrlhf.cli.train_ppo_ray` (openrlhf/cli/train_ppo_ray.py), from a
launch script or a file holding it, as RLSetup fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...readers._reader import NOT_RELEVANT, NOT_SIZED, Reader
from .common import OPENRLHF, Reading, _bool, _count, _done, _float, _int, _Keys, _scalar, _tokens

OPENRLHF_FLAGS = frozenset((
    "colocate_all_models", "colocate_actor_ref", "colocate_critic_reward", "vllm_enable_sleep", "enforce_eager",
    "gradient_checkpointing", "bf16", "adam_offload", "ref_reward_offload", "deepspeed_enable_sleep",
    "packing_samples", "use_dynamic_batch", "flash_attn", "normalize_reward", "apply_chat_template", "use_kl_loss",
    "load_in_4bit", "save_value_network", "enable_prefix_caching", "async_train", "vllm_sync_with_ray",
    "enable_vllm_is_correction", "save_hf_ckpt", "disable_ds_ckpt", "load_checkpoint", "use_ds_universal_ckpt",
    "overlap_comm", "gradient_checkpointing_use_reentrant", "disable_fast_tokenizer", "enable_ema",
    "full_determinism", "no_advantage_std_norm", "dynamic_filtering", "perf", "use_ms", "deepcompile",
    "actor_init_on_gpu", "use_liger_kernel",
))
"""openrlhf/cli/train_ppo_ray.py's `action="store_true"` arguments."""
OPENRLHF_SOURCE = "openrlhf/cli/train_ppo_ray.py"


def read_openrlhf(path: str | Path) -> Reading:
    path = Path(path)
    return openrlhf_settings(_tokens(path, str(path)), str(path))


def _arguments(words: list[str]) -> dict[str, Any]:
    """--name value / --name=value / --flag, from the first `--` word on (the launcher's own words before it are
    not arguments); nargs=2 options keep their two values."""
    args: dict[str, Any] = {}
    starts = [n + 1 for n, word in enumerate(words) if "train_ppo_ray" in word]
    i = starts[0] if starts else 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--") or len(word) < 3:
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("-", "_")
        if eq:
            args[name] = _scalar(value)
        elif name in OPENRLHF_FLAGS:
            args[name] = True
        else:
            values = []
            while i < len(words) and not words[i].startswith("--"):
                values.append(_scalar(words[i]))
                i += 1
            args[name] = values[0] if len(values) == 1 else values or True
    return args


def openrlhf_settings(words: list[str], shown: str) -> Reading:
    args = _arguments(words)
    read = Reader(file=shown, strict=True)
    keys = _Keys(read, args, {"engine": "deepspeed"}, flag="--", null_is_absent=False)
    get = args.get
    gpus = _count(read, "--actor_num_gpus_per_node", get("actor_num_gpus_per_node", 8)) * _count(
        read, "--actor_num_nodes", get("actor_num_nodes", 1))
    keys.handled |= {"actor_num_gpus_per_node", "actor_num_nodes"}
    estimator = get("advantage_estimator", "gae")
    keys.handled.add("advantage_estimator")
    trainer = {"gae": "ppo", "rloo": "rloo"}.get(str(estimator), "grpo")
    keys.out["trainer"] = trainer
    read.set("trainer", trainer, "--advantage_estimator", estimator,
             "GAE: a critic" if trainer == "ppo" else "critic-free")
    _openrlhf_switches(keys)
    colocate = _openrlhf_vllm(keys)
    _openrlhf_models(keys, trainer, colocate)
    _openrlhf_batches(keys, gpus)
    for key in ("ring_attn_size", "ds_tensor_parallel_size"):
        keys.handled.add(key)
        if get(key) not in (None, 1):
            read.ignore(key, get(key), NOT_SIZED + " (sized as 1)")
    for key, value in args.items():
        if key not in keys.handled:
            read.ignore("--" + key, value, NOT_RELEVANT)
    model = read.model[0] if read.model else None
    deferred = _done(read, {"--" + k: v for k, v in args.items()}, {"--" + k for k in keys.handled}, shown)
    return Reading(OPENRLHF, keys.out, model, gpus, tuple(read.mapped), tuple(read.ignored), deferred)


def _openrlhf_switches(keys: _Keys) -> None:
    """The settings one flag gives, train_ppo_ray.py's defaults where the command line is silent."""
    read, out, get, take = keys.read, keys.out, keys.get, keys.take
    take("prompt_max_len", "max_prompt_length", _int)
    take("generate_max_len", "max_completion_length", _int)
    take("n_samples_per_prompt", "num_generations", _int)
    take("micro_train_batch_size", "per_device_train_batch_size", _count)
    take("vllm_gpu_memory_utilization", "vllm_gpu_memory_utilization", _float)
    take("vllm_tensor_parallel_size", "vllm_tensor_parallel_size", _int)
    take("enforce_eager", "vllm_enforce_eager", _bool)
    take("gradient_checkpointing", "gradient_checkpointing", _bool)
    take("adam_offload", "optimizer_offload", _bool)
    take("ref_reward_offload", "ref_offload", _bool)
    keys.handled.add("deepspeed_enable_sleep")
    if get("deepspeed_enable_sleep"):
        # the DeepSpeed models' states leave the GPU between their own phases (openrlhf utils/deepspeed
        # offload_deepspeed_states / reload_deepspeed_states around each model's work)
        out.update(param_offload=True, optimizer_offload=True)
        read.set("param_offload", True, "--deepspeed_enable_sleep", True, "and the optimizer state")
    if take("zero_stage", "sharding", _int, "DeepSpeed ZeRO", lambda v: "none" if v == 0 else f"zero{v}") is None:
        out["sharding"] = "zero2"  # train_ppo_ray.py: --zero_stage defaults to 2
    if "vllm_gpu_memory_utilization" not in keys.keys:
        out["vllm_gpu_memory_utilization"] = 0.95  # train_ppo_ray.py's default
    take("lora_rank", "lora_rank", _int)
    if out.get("lora_rank"):
        out["lora"] = True
    out.setdefault("gradient_checkpointing", False)  # store_true: off unless given
    out["bf16"] = bool(get("bf16", False))
    keys.handled.add("bf16")
    read.set("bf16", out["bf16"], "--bf16", get("bf16", False), "" if out["bf16"] else "absent: fp32")


def _openrlhf_vllm(keys: _Keys) -> bool:
    """vLLM on the training GPUs (--colocate_all_models, returned), on GPUs of its own, or none (HF generate)."""
    read, out, get = keys.read, keys.out, keys.get
    colocate = bool(get("colocate_all_models", False))
    keys.handled |= {"colocate_all_models", "vllm_num_engines", "vllm_enable_sleep"}
    engines = get("vllm_num_engines")
    if engines:
        out["use_vllm"] = True
        out["vllm_mode"] = "colocate" if colocate else "server"
        read.set("vllm_mode", out["vllm_mode"], "--colocate_all_models" if colocate else "--vllm_num_engines",
                 True if colocate else engines,
                 "vLLM on the training GPUs" if colocate else "vLLM engines on GPUs of their own")
        if colocate and get("vllm_enable_sleep"):
            out["vllm_enable_sleep_mode"] = True
            read.set("vllm_enable_sleep_mode", True, "--vllm_enable_sleep", True)
    else:
        out["use_vllm"] = False
        read.ignore("vllm_num_engines", engines, "no vLLM engine: the actor generates with HF generate")
    return colocate


def _openrlhf_models(keys: _Keys, trainer: str, colocate: bool) -> None:
    """Which of the reference, critic and reward model share the actor's GPUs, and the model."""
    read, out, get = keys.read, keys.out, keys.get
    keys.handled |= {"init_kl_coef", "use_kl_loss", "colocate_actor_ref", "colocate_critic_reward"}
    kl = _float(read, "--init_kl_coef", get("init_kl_coef", 0.01))
    # train_ppo_ray.py: without --colocate_all_models the critic and reward model have GPUs of their own, and the
    # reference too unless --colocate_actor_ref; memfit sizes the actor's GPUs
    ref_here = colocate or bool(get("colocate_actor_ref", False))
    out["beta"] = kl if ref_here else 0.0
    read.set("beta", out["beta"], "--init_kl_coef", kl, ("a reference model" if ref_here else
                                                          "the reference on GPUs of its own") if kl > 0 else
             "no reference model")
    if trainer == "ppo" and not colocate:
        out["critic"] = False
        read.set("critic", False, "--colocate_all_models", False, "the critic on GPUs of its own")
    keys.handled |= {"reward_pretrain", "remote_rm_url", "critic_pretrain", "pretrain"}
    out["reward_model"] = bool(get("reward_pretrain")) and not get("remote_rm_url") and colocate
    if get("reward_pretrain"):
        read.set("reward_model", out["reward_model"], "--reward_pretrain", get("reward_pretrain"),
                 "a reward model on the GPUs" if out["reward_model"] else "--remote_rm_url scores instead"
                 if get("remote_rm_url") else "the reward model on GPUs of its own")
    if isinstance(get("pretrain"), str):
        read.set_model(get("pretrain"), "--pretrain", get("pretrain"))


def _openrlhf_batches(keys: _Keys, gpus: int) -> None:
    """How many micro-batches one rollout's samples make on each GPU."""
    read, out = keys.read, keys.out
    keys.handled |= {"rollout_batch_size", "micro_rollout_batch_size"}
    rollout = _int(read, "--rollout_batch_size", keys.get("rollout_batch_size", 1024))
    per_gpu = max(1, -(-rollout * out.get("num_generations", 1) // gpus))
    micro = out.get("per_device_train_batch_size", 4)
    out.setdefault("per_device_train_batch_size", micro)
    out["steps_per_generation"] = max(1, -(-per_gpu // micro))
    read.set("steps_per_generation", out["steps_per_generation"], "--rollout_batch_size", rollout,
             f"x n_samples_per_prompt / {gpus} GPUs = {per_gpu} samples generated per GPU at once")
