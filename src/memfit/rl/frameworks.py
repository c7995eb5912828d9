"""verl's trainer config and OpenRLHF's command line as RLSetup fields (issue 23).

- verl: the Hydra YAML of `python -m verl.trainer.main_ppo` (verl/trainer/config/ppo_trainer.yaml: `data.*`,
  `actor_rollout_ref.{model,actor,ref,rollout}.*`, `critic.*`, `reward_model.*`, `algorithm.*`, `trainer.*`), or a
  launch script's `key=value` overrides of it. Simple `${a.b}` interpolations are resolved.
- OpenRLHF: the arguments of `openrlhf.cli.train_ppo_ray` (openrlhf/cli/train_ppo_ray.py), from a launch script
  or a file holding the command line.

Every key is recorded with what it set (`mapped`) or why it sizes nothing (`ignored`, memfit.readers' Reader): a
key memfit does not model is never an error, a value of the wrong type is one ConfigError line naming the key."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..readers._reader import NOT_RELEVANT, NOT_SIZED, Reader, show
from ..readers.files import load_mapping, read_bounded

VERL = "verl"
OPENRLHF = "openrlhf"
_INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


@dataclass
class Reading:
    """What one framework config gave: RLSetup keyword arguments, the model, the GPUs, and the reading's record."""

    framework: str
    settings: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    gpus: int | None = None
    mapped: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    """Keys read that set nothing at their value (the model, a switch left at its default, the optimizer's batch)."""


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """`${a.b}` values replaced by a.b's value (a chain of them followed a few steps; an unknown name stays as
    written)."""
    out = dict(flat)
    for _ in range(4):
        changed = False
        for key, value in out.items():
            match = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if match and match.group(1) in out and out[match.group(1)] is not value:
                out[key] = out[match.group(1)]
                changed = True
        if not changed:
            break
    return out


def _scalar(text: str) -> Any:
    """A Hydra override's value: null / true / false / a number / a string."""
    lowered = text.lower()
    if lowered in ("null", "none", "~"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")


def _tokens(path: Path, shown: str) -> list[str]:
    """A launch script's words, line continuations joined, comments and shell variables' assignments kept as
    words (they are not arguments: the readers skip what they do not know)."""
    text = read_bounded(path, shown).decode("utf-8", errors="replace").replace("\\\n", " ")
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words += shlex.split(line, comments=True)
        except ValueError as error:
            raise ConfigError(f"{shown}: cannot split the command line ({error})") from None
    return words


def detect(path: Path) -> str | None:
    """'verl', 'openrlhf' or None (TRL's config) from the file's content."""
    try:
        head = read_bounded(path, str(path)).decode("utf-8", errors="replace")
    except (OSError, ConfigError):
        return None
    if "actor_rollout_ref" in head:
        return VERL
    if "openrlhf" in head.lower() or re.search(r"(^|\s)--(pretrain|colocate_all_models|micro_train_batch_size)\b",
                                                head):
        return OPENRLHF
    return None


# --- verl --------------------------------------------------------------------------------------------------------

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


def _done(read: Reader, flat: Mapping[str, Any], handled: set[str], shown: str) -> tuple[str, ...]:
    """Every handled key the reading has no record of yet is recorded as read (it changes nothing at its value)."""
    for key in sorted(handled):
        if key in flat and key not in read.consumed.get(shown, set()):
            read.defer(key, flat[key], "read: changes nothing at this value")
    return tuple(e.text for e in read.entries() if not e.sets or e.sets[0][0] == "model")


def _int(read: Reader, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{read.file}: {key} must be an integer, got {show(value)}")
    return value


def _bool(read: Reader, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{read.file}: {key} must be true or false, got {show(value)}")
    return value


def _float(read: Reader, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{read.file}: {key} must be a number, got {show(value)}")
    return float(value)


ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo"}
"""verl algorithm.adv_estimator -> the trainer whose phases memfit sizes: GAE needs the critic; every other
estimator (grpo, rloo, reinforce_plus_plus, remax, opo, ...) is critic-free and sized as GRPO's phases."""


@dataclass
class _Keys:
    """A reading under way: the file's keys, the RLSetup settings they gave so far, the keys handled; `flag` is how
    the file writes a key ('' verl, '--' OpenRLHF); a null value is the key's absence when `null_is_absent`."""

    read: Reader
    keys: Mapping[str, Any]
    out: dict[str, Any]
    flag: str = ""
    null_is_absent: bool = True
    handled: set[str] = field(default_factory=set)

    def get(self, key: str, default: Any = None) -> Any:
        return self.keys.get(key, default)

    def take(self, key: str, target: str, convert, note: str = "", transform=lambda v: v) -> Any:
        """keys[key], converted (ConfigError on the wrong type), as the setting `target`; None when absent."""
        self.handled.add(key)
        if key not in self.keys or (self.null_is_absent and self.keys[key] is None):
            return None
        value = transform(convert(self.read, self.flag + key, self.keys[key]))
        self.out[target] = value
        self.read.set(target, value, self.flag + key, self.keys[key], note)
        return value


def verl_settings(flat: Mapping[str, Any], shown: str) -> Reading:
    read = Reader(file=shown, strict=True)
    get = flat.get
    keys = _Keys(read, flat, {"engine": "torch"})
    gpus = _int(read, "trainer.n_gpus_per_node", get("trainer.n_gpus_per_node", 8)) * _int(
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
    keys.take("data.max_prompt_length", "max_prompt_length", _int)
    keys.take("data.max_response_length", "max_completion_length", _int)
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
    keys.handled |= {A + "ppo_micro_batch_size_per_gpu", A + "ppo_micro_batch_size", A + "use_dynamic_bsz",
                     A + "ppo_max_token_len_per_gpu", A + "ppo_mini_batch_size", "data.train_batch_size"}
    seq = out.get("max_prompt_length", 512) + out.get("max_completion_length", 512)
    micro = None
    if _bool(read, A + "use_dynamic_bsz", get(A + "use_dynamic_bsz", False)):
        tokens = _int(read, A + "ppo_max_token_len_per_gpu", get(A + "ppo_max_token_len_per_gpu", 16384))
        micro = max(1, tokens // seq)
        read.set("per_device_train_batch_size", micro, A + "ppo_max_token_len_per_gpu", tokens,
                 f"use_dynamic_bsz: {tokens} tokens // {seq} per full-length sequence")
    elif get(A + "ppo_micro_batch_size_per_gpu") is not None:
        micro = _int(read, A + "ppo_micro_batch_size_per_gpu", get(A + "ppo_micro_batch_size_per_gpu"))
        read.set("per_device_train_batch_size", micro, A + "ppo_micro_batch_size_per_gpu", micro)
    elif get(A + "ppo_micro_batch_size") is not None:
        micro = max(1, _int(read, A + "ppo_micro_batch_size", get(A + "ppo_micro_batch_size")) // gpus)
        read.set("per_device_train_batch_size", micro, A + "ppo_micro_batch_size", get(A + "ppo_micro_batch_size"),
                 f"global, / {gpus} GPUs")
    if micro is not None:
        out["per_device_train_batch_size"] = micro
    batch = _int(read, "data.train_batch_size", get("data.train_batch_size", 1024))
    per_gpu = max(1, -(-batch * n // gpus))
    micro = out.get("per_device_train_batch_size", 8)
    out["steps_per_generation"] = max(1, -(-per_gpu // micro))
    read.set("steps_per_generation", out["steps_per_generation"], "data.train_batch_size", batch,
             f"x n {n} / {gpus} GPUs = {per_gpu} responses generated per GPU at once")
    if get(A + "ppo_mini_batch_size") is not None:
        read.defer(A + "ppo_mini_batch_size", get(A + "ppo_mini_batch_size"),
                   "the optimizer step's batch: gradients accumulate in place, no memory of its own")


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


# --- OpenRLHF ----------------------------------------------------------------------------------------------------

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
    gpus = _int(read, "--actor_num_gpus_per_node", get("actor_num_gpus_per_node", 8)) * _int(
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
    take("micro_train_batch_size", "per_device_train_batch_size", _int)
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
