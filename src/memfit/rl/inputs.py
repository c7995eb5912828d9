"""What `memfit rl`'s options and its --config describe, as the library takes it (RLInputs): the one place the
command (memfit.cli.rl) and the page's phase bars (memfit.serve.rl) build an RL recipe, its model and its GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import sources
from ..diagnose import DEFAULT_MARGIN
from ..errors import ConfigError
from ..hardware import DEFAULT_GPU, make_hardware
from . import frameworks, reader, workload


@dataclass(frozen=True)
class RLInputs:
    """What `memfit rl`'s options (and its --config) describe: the model, the recipe, the GPUs, the margin, and
    the framework the recipe was read from with what its reading recorded."""

    spec: object
    rl: object
    hardware: object
    margin: float
    framework: str = "trl"
    read: tuple[str, ...] = ()


def rl_inputs(*, model=None, trainer=None, config=None, gpu=None, gpus=None, nodes=None, margin=None, batch=None,
              num_generations=None, prompt_len=None, completion_len=None, accum=None, beta=None, vllm=None,
              vllm_mode=None, vllm_util=None, sleep=None, vllm_tp=None, kv_cache_dtype=None, lora=None, method=None,
              lora_rank=None, precompute_ref=None, checkpointing=None, logprob_head=None, zero=None,
              offload_trainer=None, ref_offload=None, reward_model=None, critic_batch=None,
              resolve=None) -> RLInputs:
    """`memfit rl`'s parameters (as its options parse them) as RLInputs: what the command and the page's RL
    phase bars (memfit.serve.rl) compute from. `resolve`: how the model is read (default: memfit.sources)."""
    framework, read_lines, read_gpus = "trl", (), None
    if config is not None and frameworks.detect(Path(config)) is not None:
        reading = (frameworks.read_verl if frameworks.detect(Path(config)) == frameworks.VERL
                   else frameworks.read_openrlhf)(config)
        framework, settings, named, read_gpus = reading.framework, dict(reading.settings), reading.model, reading.gpus
        read_lines = reading.mapped + tuple(f"ignored {line}" for line in reading.ignored)
        trainer = trainer or settings.get("trainer")
    else:
        settings, named = reader.read_trl_config(config) if config is not None else ({}, None)
    settings.pop("trainer", None)
    trainer = (trainer or "grpo").lower()
    if trainer not in workload.TRAINERS:
        raise ConfigError(f"--trainer must be one of {', '.join(workload.TRAINERS)}, got {trainer!r}")
    model = model or named
    if model is None:
        raise ConfigError("give MODEL, or a --config that names the model")
    if beta is None and "beta" not in settings:
        beta = workload.DEFAULT_BETA[trainer]
    if method is not None:
        if method.value not in ("full", "lora"):
            raise ConfigError(f"--method {method.value}: memfit rl sizes a full or a LoRA policy")
        lora = method.value == "lora" if lora is None else lora
    if lora_rank is not None and lora is None:
        lora = True
    rl = reader.build_setup(trainer, settings, per_device_train_batch_size=batch, num_generations=num_generations,
                     max_prompt_length=prompt_len, max_completion_length=completion_len,
                     gradient_accumulation_steps=accum, beta=beta, use_vllm=vllm, vllm_mode=vllm_mode,
                     vllm_gpu_memory_utilization=vllm_util, vllm_enable_sleep_mode=sleep,
                     vllm_tensor_parallel_size=vllm_tp, vllm_kv_cache_dtype=kv_cache_dtype, lora=lora,
                     lora_rank=lora_rank, precompute_ref_log_probs=precompute_ref,
                     gradient_checkpointing=checkpointing, logprob_head=logprob_head,
                     sharding=zero.value if zero is not None else None, param_offload=offload_trainer,
                     optimizer_offload=offload_trainer, ref_offload=ref_offload, reward_model=reward_model,
                     critic_micro_batch_size=critic_batch)
    if rl.use_vllm and not rl.online:
        raise ConfigError(f"--vllm is a rollout option: {trainer.upper()} generates nothing")
    spec = (resolve or sources.resolve_model)(model)
    if gpus is None and nodes is None and read_gpus:
        gpus, nodes = min(read_gpus, 8), max(1, read_gpus // 8)
    world = (gpus or 1) * (nodes or 1)
    if world > 1 and zero is None and "sharding" not in settings:
        rl = rl.replace(sharding="zero3")  # several GPUs: the trainer's state sharded, as the frameworks do
    if world == 1 and rl.sharding != "none":
        rl = rl.replace(sharding="none")  # nothing to shard over on one GPU
    hardware = make_hardware(gpu or DEFAULT_GPU, gpus_per_node=gpus or 1, num_nodes=nodes or 1)
    return RLInputs(spec, rl, hardware, DEFAULT_MARGIN if margin is None else margin, framework, read_lines)
