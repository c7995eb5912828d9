"""The engine runtimes and the collectives' names (memfit.estimate.comm)."""

from __future__ import annotations

import enum

from ...setup import Engine, Offload, Sharding, TrainingSetup

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST = "all-reduce", "reduce-scatter", "all-gather", "broadcast"
SEND = "send"
DEEPSPEED_MAX_REUSE_DISTANCE = 10**9
"""DeepSpeed's stage3_max_reuse_distance default, in parameter elements (runtime/zero/config.py)."""
PAPER_PSI_MULTIPLE = {0: 2, 1: 2, 2: 2, 3: 3}
"""ZeRO paper sec. 7: what each rank moves per step, in units of Psi, for data parallelism and ZeRO-1/2/3."""


class Runtime(enum.Enum):
    """What runs data parallelism for a setup: derived from (Engine, Sharding) by `runtime_of`, never typed in."""

    SINGLE = "one process (no communication)"
    DDP = "torch data parallel (gradients all-reduced)"
    ZERO_REDUNDANCY = "torch ZeroRedundancyOptimizer (ZeRO-1)"
    FSDP2_NO_RESHARD = "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)"
    FSDP2_RESHARD = "FSDP2 fully_shard, reshard_after_forward=True (ZeRO-3)"
    DEEPSPEED = "DeepSpeed ZeRO"

    @property
    def is_fsdp2(self) -> bool:
        return self in (Runtime.FSDP2_NO_RESHARD, Runtime.FSDP2_RESHARD)


def runtime_of(engine: Engine, sharding: Sharding, world_size: int = 2) -> Runtime:
    """The one mapping from the setup's engine and ZeRO stage to what runs it (memfit._torch.engine.prepare)."""
    if engine is Engine.DEEPSPEED:
        return Runtime.DEEPSPEED
    if sharding is Sharding.NONE:
        return Runtime.SINGLE if world_size < 2 else Runtime.DDP
    return {Sharding.ZERO1: Runtime.ZERO_REDUNDANCY, Sharding.ZERO2: Runtime.FSDP2_NO_RESHARD,
            Sharding.ZERO3: Runtime.FSDP2_RESHARD}[sharding]


def deepspeed_stage(setup: TrainingSetup) -> int:
    """The setup's ZeRO stage, or 1 when only offload asks for ZeRO: DeepSpeed offloads the optimizer only under
    ZeRO, and stage 1 is the smallest stage that does, keeping gradients whole on the GPU as planned (memfit's
    DeepSpeed JSON says this stage: memfit.emit.deepspeed.zero_stage is this function)."""
    if setup.sharding is Sharding.NONE and setup.offload is not Offload.NONE:
        return 1
    return setup.sharding.stage


def describe_runtime(setup: TrainingSetup) -> str:
    runtime = runtime_of(setup.engine, setup.sharding, setup.dp_size)
    if setup.tp > 1:
        sp = " + sequence parallel" if setup.sequence_parallel else ""
        return (f"torch DTensor tensor parallel (tp={setup.tp}{sp}) x {runtime.value} on {setup.dp_size} "
                "data-parallel groups")
    if runtime is Runtime.DEEPSPEED:
        return f"DeepSpeed ZeRO stage {deepspeed_stage(setup)}"
    if runtime.is_fsdp2 and setup.fsdp_version.is_fsdp1:
        strategy = "FULL_SHARD" if runtime is Runtime.FSDP2_RESHARD else "SHARD_GRAD_OP"
        unit = "block" if setup.fsdp_version.value == "1-blocks" else "wrapped unit"
        return f"FSDP1 FullyShardedDataParallel, {strategy} (one flat parameter per {unit})"
    return runtime.value
