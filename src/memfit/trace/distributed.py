"""ZeRO as FSDP2 (`fully_shard`) over a fake process group: one process plays rank 0 of N, no communication.

FACTS.md: FSDPMemTracker with a fake process group gave the same per-rank peak as a real 2-process gloo run; the
device mesh must be made outside FakeTensorMode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import ConfigError
from ..setup import Offload, Optimizer, Precision, Sharding, TrainingSetup
from .tracker import StepTracker, _Kind


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[object]:
    """A fake process group of `world_size` ranks (this process is rank 0) and its 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("a torch.distributed process group already exists in this process: "
                          "trace a sharded setup in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def sharder(setup: TrainingSetup, mesh, block_finder: Callable[[nn.Module], list[nn.Module]]):
    """A function that applies the setup's ZeRO stage to a model with FSDP2 and returns notes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(model: nn.Module) -> list[str]:
        notes = [f"{setup.sharding} traced as FSDP2 fully_shard over a fake process group of {setup.num_gpus} ranks; "
                 "numbers are per rank"]
        options: dict = {"mesh": mesh, "reshard_after_forward": setup.sharding is Sharding.ZERO3}
        if setup.precision.master_weights or setup.precision.is_autocast:
            low = torch.float16 if setup.precision is Precision.AMP_FP16 else torch.bfloat16
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            notes.append(f"{setup.precision} under FSDP2: fp32 sharded parameters (the master copy), {low} "
                         "all-gathers and compute (no autocast), fp32 gradient reduction")
        if setup.engine.value == "deepspeed":
            notes.append("the setup's engine is DeepSpeed, whose layout differs (fp32 partition copy, pre-allocated "
                         "ZeRO-3 gradient partition); the trace runs torch's FSDP2: compare with --engine torch")
        if setup.sharding is Sharding.ZERO1:
            notes.append("FSDP2 has no ZeRO-1 mode: traced as ZeRO-2 (gradients sharded too), so gradients are "
                         "1/N of what ZeRO-1 keeps")
        blocks = block_finder(model)
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        notes.append(f"{len(blocks)} blocks sharded as their own FSDP units, the rest with the root")
        return notes

    return shard


class ShardLocalOptimizer:
    """Steps FSDP2's sharded parameters through their local shards, for optimizers that have no DTensor rules
    (bitsandbytes 8-bit AdamW, Adafactor). The shards are plain tensors sharing the DTensors' storage, so no byte
    moves; this is also how DeepSpeed steps a rank's partition (plain tensors, never DTensors)."""

    def __init__(self, params: list[torch.Tensor], build: Callable[[list[torch.Tensor]], object]) -> None:
        self._pairs = [(param, _local(param)) for param in params]
        self.inner = build([local for _, local in self._pairs])
        self.memfit_notes = ("the optimizer steps each rank's local shard (plain tensors, as DeepSpeed steps its "
                             "partition): FSDP2's DTensors have no rules for this optimizer",)

    @property
    def param_groups(self):
        self._sync_grads()  # GradScaler unscales through param_groups before step()
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _sync_grads(self) -> None:
        for param, local in self._pairs:
            local.grad = _local(param.grad) if param.grad is not None else None

    def step(self, closure=None):
        self._sync_grads()
        return self.inner.step(closure) if closure is not None else self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, local in self._pairs:
            local.grad = None
            param.grad = None


def needs_local_step(setup: TrainingSetup) -> bool:
    """Whether the setup's optimizer must step local shards under FSDP2 (see ShardLocalOptimizer)."""
    return setup.sharding.stage > 0 and setup.optimizer.library in ("bitsandbytes", "transformers")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def host_kinds(setup: TrainingSetup) -> tuple[set[_Kind], bool]:
    """Kinds that CPU offload keeps in host memory, and whether the optimizer step runs on the host."""
    if setup.offload is Offload.NONE:
        return set(), False
    kinds = {_Kind.OPTIMIZER, _Kind.HOST_TEMPORARIES}
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        kinds |= {_Kind.PARAMETERS, _Kind.GRADIENTS}
    return kinds, True


def instrument(model: nn.Module, tracker: StepTracker) -> Callable[[], None]:
    """Name FSDP2's unsharded parameters and sharded gradients as they appear; returns an undo function."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return lambda: None
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # private: FSDP2 has no public hook for these
            if group is not None:
                groups.append(group)
    for group in groups:
        _wrap_group(group, tracker)

    def undo() -> None:
        for group in groups:
            for name in ("wait_for_unshard", "post_backward"):
                group.__dict__.pop(name, None)

    return undo


def _wrap_group(group, tracker: StepTracker) -> None:
    wait_for_unshard, post_backward = group.wait_for_unshard, group.post_backward

    def unsharded(*args, **kwargs):
        result = wait_for_unshard(*args, **kwargs)
        for fsdp_param in group.fsdp_params:
            for tensor in fsdp_param.all_gather_outputs:
                tracker.register(tensor, _Kind.GATHERED)
        return result

    def reduced(*args, **kwargs):
        result = post_backward(*args, **kwargs)
        tracker.classify_gradients(fsdp_param.sharded_param for fsdp_param in group.fsdp_params)
        return result

    group.wait_for_unshard = unsharded
    group.post_backward = reduced
