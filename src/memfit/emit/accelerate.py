"""`accelerate launch --config_file` YAML for a TrainingSetup. Keys as accelerate 1.x writes and reads them
(accelerate/commands/config/config_args.py ClusterConfig, commands/launch.py, utils/launch.py)."""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..hardware import Hardware
from ..setup import Checkpointing, Offload, Precision, Sharding, TrainingSetup
from .deepspeed import deepspeed_owns_optimizer
from .emitted import EmittedConfig, engine_work, uses_deepspeed, uses_fsdp
from .fsdp import fsdp2_unsupported

BACKENDS = ("deepspeed", "fsdp")


def accelerate_config(setup: TrainingSetup, hardware: Hardware, *, backend: str = "deepspeed",
                      deepspeed_path: str = "deepspeed.json") -> str:
    """YAML text with a comment above each setting. `backend` picks the engine for sharded/offloaded plans."""
    return accelerate_file(setup, hardware, backend=backend, deepspeed_path=deepspeed_path).render()


def accelerate_file(setup: TrainingSetup, hardware: Hardware, *, backend: str = "deepspeed",
                    deepspeed_path: str = "deepspeed.json", filename: str = "accelerate.yaml") -> EmittedConfig:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown accelerate backend '{backend}': choose one of {', '.join(BACKENDS)}")
    if backend == "fsdp" and uses_deepspeed(setup) and fsdp2_unsupported(setup):
        raise ConfigError(f"accelerate cannot run this plan on FSDP2: {fsdp2_unsupported(setup)}")
    content, comments = _machines(setup, hardware)
    notes: list[str] = []
    if uses_fsdp(setup):
        part = _fsdp_part(setup)  # engine torch: FSDP2 runs it whichever file is asked for
    elif not uses_deepspeed(setup):
        part = _plain_part(setup)
    elif backend == "deepspeed":
        part = _deepspeed_part(setup, deepspeed_path, content["num_machines"])
        if deepspeed_owns_optimizer(setup):
            notes.append("deepspeed.json builds the optimizer: pass accelerate.utils.DummyOptim to "
                         "accelerator.prepare instead of a torch optimizer.")
    else:
        part = _fsdp_part(setup)
    merged = {**content, **part[0]}
    content = {key: merged[key] for key in sorted(merged, key=_key_order)}
    comments.update(part[1])
    if setup.precision is Precision.BF16 and not (uses_deepspeed(setup) and backend == "deepspeed"):
        notes.append("Pure bf16: load the model in bf16 (model_kwargs.json) - accelerate has no flag for it.")
    return EmittedConfig(filename, content, comments, tuple(notes),
                         summary=f"`accelerate launch --config_file {filename} train.py`.")


_ORDER = ("compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes", "machine_rank")


def _key_order(key: str) -> int:
    """accelerate's usual reading order: what runs first, then where, then the engine block."""
    return _ORDER.index(key) if key in _ORDER else len(_ORDER) + (key.endswith("_config"))


def _machines(setup: TrainingSetup, hardware: Hardware) -> tuple[dict, dict[str, str]]:
    if setup.num_gpus > hardware.world_size:
        raise ConfigError(f"the plan uses {setup.num_gpus} GPUs but the hardware has {hardware.world_size} "
                          f"({hardware.num_nodes} node(s) x {hardware.gpus_per_node}): lower num_gpus or add nodes")
    num_machines = math.ceil(setup.num_gpus / hardware.gpus_per_node)
    content = {"compute_environment": "LOCAL_MACHINE", "num_machines": num_machines, "machine_rank": 0,
               "num_processes": setup.num_gpus, "main_training_function": "main", "use_cpu": False}
    comments = {"num_processes": "total ranks over all machines: the data-parallel size memfit's estimate assumed",
                "num_machines": f"{setup.num_gpus} GPU(s) at {hardware.gpus_per_node} per node"}
    if num_machines > 1:
        content.update(main_process_port=29500, rdzv_backend="static", same_network=True)
        comments["machine_rank"] = "0 on the main node; set 1, 2, ... on the others"
        comments["main_process_port"] = "add main_process_ip: the main node's address, the same on every node"
        comments["rdzv_backend"] = "fixed ranks: each node is started with its own machine_rank"
        comments["same_network"] = "the nodes reach each other directly (one cluster network)"
    return content, comments


def _mixed_precision(setup: TrainingSetup) -> tuple[str, str]:
    precision = setup.precision
    if precision is Precision.BF16:
        return "no", "pure bf16 is not a mixed-precision mode: the model itself is loaded in bf16"
    if precision is Precision.FP32:
        return "no", "the plan trains in fp32"
    if precision is Precision.AMP_FP16:
        return "fp16", "fp16 compute with fp32 weights and loss scaling"
    if precision is Precision.BF16_MASTER:
        return "bf16", "bf16 compute over fp32 weights: the fp32 copy is the master; same bytes per parameter"
    return "bf16", "bf16 compute over fp32 weights (autocast)"


def _plain_part(setup: TrainingSetup) -> tuple[dict, dict[str, str]]:
    distributed = "MULTI_GPU" if setup.num_gpus > 1 else "NO"
    mixed, why = _mixed_precision(setup)
    reason = ("DDP: each rank holds the whole model, gradients are all-reduced" if setup.num_gpus > 1 else
              "one process on one GPU")
    return ({"distributed_type": distributed, "mixed_precision": mixed},
            {"distributed_type": reason, "mixed_precision": why})


def _deepspeed_part(setup: TrainingSetup, deepspeed_path: str, num_machines: int) -> tuple[dict, dict[str, str]]:
    deepspeed = {"deepspeed_config_file": deepspeed_path, "zero3_init_flag": setup.sharding is Sharding.ZERO3}
    comments = {
        "distributed_type": f"{engine_work(setup)} through DeepSpeed",
        "deepspeed_config.deepspeed_config_file": (
            "stage, offload, precision, batch and optimizer all come from this file; accelerate refuses "
            "mixed_precision, zero_stage or offload keys here alongside it, so none are set"),
        "deepspeed_config.zero3_init_flag": ("build the model already partitioned (deepspeed.zero.Init), so no rank "
                                             "ever holds the whole model" if setup.sharding is Sharding.ZERO3 else
                                             "only meaningful for ZeRO-3"),
    }
    if num_machines > 1:
        deepspeed["deepspeed_multinode_launcher"] = "standard"
        comments["deepspeed_config.deepspeed_multinode_launcher"] = (
            "run `accelerate launch` on every node (torchrun-style); no pdsh hostfile needed")
    return {"distributed_type": "DEEPSPEED", "deepspeed_config": deepspeed}, comments


def _fsdp_part(setup: TrainingSetup) -> tuple[dict, dict[str, str]]:
    mixed, why = _mixed_precision(setup)
    zero3 = setup.sharding is Sharding.ZERO3
    fsdp = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": zero3,
        "fsdp_offload_params": setup.offload is Offload.OPTIMIZER_AND_PARAMS,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": setup.checkpointing is Checkpointing.FULL,  # accelerate's is full only
    }
    comments = {
        "distributed_type": f"{setup.sharding} as FSDP2 (fully_shard)",
        "mixed_precision": why + ("; FSDP2 keeps the fp32 shards and computes on a cast copy"
                                  if mixed != "no" else ""),
        "fsdp_config.fsdp_version": "FSDP2: per-parameter DTensor sharding (torch.distributed.fsdp.fully_shard)",
        "fsdp_config.fsdp_reshard_after_forward": (
            "zero3: free gathered parameters after each block's forward" if zero3 else
            "zero2: keep gathered parameters from forward to backward; gradients and states stay sharded"),
        "fsdp_config.fsdp_offload_params": ("optimizer+params: shards, gradients and the optimizer step on CPU"
                                            if fsdp["fsdp_offload_params"] else "no CPU offload in the plan"),
        "fsdp_config.fsdp_auto_wrap_policy": ("one FSDP unit per transformer block; the block class comes from "
                                              "the model's _no_split_modules"),
        "fsdp_config.fsdp_state_dict_type": "each rank saves its own shard: no full gather at checkpoint time",
        "fsdp_config.fsdp_activation_checkpointing": (
            "recompute each block in backward; set here rather than in TrainingArguments, which would add a "
            "redundant all-gather" if fsdp["fsdp_activation_checkpointing"] else "no checkpointing in the plan"),
    }
    if setup.fsdp_version.is_fsdp1:
        return _fsdp1_part(setup, mixed, fsdp, comments)
    if setup.finetune.adapters:
        # no fsdp_use_orig_params: FSDP2 always keeps the original parameters (accelerate warns it is obsolete),
        # which a frozen base beside trainable adapters needs
        comments["fsdp_config.fsdp_version"] += ("; it shards the frozen base with its block and reduce-scatters "
                                                 "only the adapters' gradients, as sized")
    return {"distributed_type": "FSDP", "mixed_precision": mixed, "fsdp_config": fsdp}, comments


def _fsdp1_part(setup: TrainingSetup, mixed: str, fsdp: dict, comments: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """The FSDP1 config accelerate 1.15 reads (FullyShardedDataParallelPlugin, fsdp_version 1): what
    memfit.estimate.fsdp1 sized (memfit._torch.fsdp1.wrap measures the same wrapping)."""
    zero3 = setup.sharding is Sharding.ZERO3
    fsdp = {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD" if zero3 else "SHARD_GRAD_OP",
            **{k: v for k, v in fsdp.items() if k not in ("fsdp_version", "fsdp_reshard_after_forward")},
            "fsdp_use_orig_params": True, "fsdp_limit_all_gathers": True, "fsdp_sync_module_states": True,
            "fsdp_backward_prefetch": "BACKWARD_PRE"}
    comments = {k: v for k, v in comments.items() if k not in ("fsdp_config.fsdp_version",
                                                                  "fsdp_config.fsdp_reshard_after_forward")}
    comments.update({
        "distributed_type": f"{setup.sharding} as FSDP1 (FullyShardedDataParallel, flat parameters)",
        "fsdp_config.fsdp_version": "FSDP1: one flat parameter per transformer block, padded to the GPU count",
        "fsdp_config.fsdp_sharding_strategy": ("zero3: reshard each block after its forward" if zero3 else
                                               "zero2: keep every block gathered from forward to backward"),
        "fsdp_config.fsdp_use_orig_params": "the optimizer steps the original parameters' shard views, as sized",
        "fsdp_config.fsdp_limit_all_gathers": "at most two all-gathers in flight (the CUDA caching allocator's share)",
        "fsdp_config.fsdp_sync_module_states": ("rank 0's weights broadcast at wrap time, which accelerate's "
                                                  "cpu_ram_efficient_loading needs: no memory after it"),
        "fsdp_config.fsdp_backward_prefetch": "the next block's all-gather before this one's gradients, as sized"})
    if setup.finetune.adapters:
        comments["fsdp_config.fsdp_version"] += (
            "; with a PeftModel the Trainer wraps each LoRA Linear in a unit of its own (peft fsdp_auto_wrap_policy),"
            " so the frozen base's flat parameters get no gradient")
    return {"distributed_type": "FSDP", "mixed_precision": mixed, "fsdp_config": fsdp}, comments
