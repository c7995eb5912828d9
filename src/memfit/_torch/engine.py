"""The in-process side of `memfit launch`: what a training script calls, on every rank, to train the way a
TrainingSetup says. `prepare(model, setup)` returns a `Prepared` whose `train_step` runs one optimizer step on the
setup's engine (memfit's one loop, `step.training_step`, with the engine's hooks), and whose `local_bytes()` says
what this rank holds. This module never imports memfit.launch (launch imports it lazily).

Engines are `setup.Engine`; what runs each ZeRO stage is `estimate.comm.runtime_of(engine, sharding)` (checked on
CPU with gloo, torch 2.13, DeepSpeed 0.19; what each sends per step is memfit.estimate.comm):
- torch (torch.distributed): ZeRO-3 = FSDP2 `fully_shard` per block + root, reshard_after_forward=True; ZeRO-2 =
  the same with reshard_after_forward=False (gathered parameters stay whole from forward to backward; at rest FSDP2
  still keeps only the shard, unlike DeepSpeed's ZeRO-2). FSDP2 cannot express ZeRO-1 (it always shards gradients
  with the parameters), so ZeRO-1 here is `torch.distributed.optim.ZeroRedundancyOptimizer`, torch's own ZeRO-1:
  whole parameters and whole gradients, optimizer state partitioned by whole parameter (each rank steps the ones it
  owns, then broadcasts them). No sharding with more than one rank is data parallelism. In both, gradients are
  averaged in place (one async all-reduce per tensor) after the last micro-step, not by DDP: DDP keeps its
  gradient-sized all-reduce buckets alive for the whole step (measured: +4 B/param in fp32 at the peak; memfit's
  estimate counts them for engine torch without sharding, as the HF Trainer and accelerate run DDP); the cost here is
  no overlap of backward and communication.
- deepspeed: `deepspeed.initialize` with `memfit.emit.deepspeed_config(setup)`. On CPU, DeepSpeed's communication
  backend JIT-compiles a shared-memory op (deepspeed_shm_comm, ~35 s on first use) that only its *inference*
  all-reduce uses; training never calls it, so it is switched off here (see `_skip_inference_shm_op`).

torch is imported at module level: this module lives in the torch side of memfit (memfit._torch).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..emit.deepspeed import deepspeed_config
from ..errors import ConfigError
from ..estimate.comm import Runtime, runtime_of
from ..setup import Engine, Offload, Precision, Sharding, TrainingSetup
from ..techniques.convert import MEMFIT_LOOP, Target, convert_model
from . import blocks as block_tools
from . import rank_memory
from . import step as torch_step
from .storage import storage_tensors

DEFAULT_MAX_GRAD_NORM = 1.0
"""Gradient clipping, as the HF Trainer and memfit's DeepSpeed config (gradient_clipping) do by default."""


# ------------------------------------------------------------------------------------------- the process group


def init_process_group() -> tuple[int, int]:
    """Join the job the launcher started (torchrun and the deepspeed launcher set RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK): gloo on CPU, nccl on CUDA. Returns (rank, world_size). Without a launcher (plain
    `python script.py`) it returns (0, 1) and creates no group. Calling it again returns the existing group's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def training_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------ the result


@dataclass
class Prepared:
    """A model ready to train on its engine. Call `model` for the forward (the FSDP2-sharded model itself, or the
    DeepSpeed engine wrapping it); `module` is the user's model."""

    model: Any
    optimizer: Any
    module: nn.Module
    setup: TrainingSetup
    """The setup this rank trains; `setup.engine` is its engine."""
    world_size: int = 1
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM
    notes: list[str] = field(default_factory=list)

    @property
    def engine(self) -> Engine:
        return self.setup.engine

    @property
    def runtime(self) -> Runtime:
        """DDP, ZeroRedundancyOptimizer, FSDP2 or DeepSpeed (estimate.comm.runtime_of)."""
        return runtime_of(self.setup.engine, self.setup.sharding, self.world_size)

    def train_step(self, batches, *, loss_fn: Callable | None = None) -> float:
        """One optimizer step of `setup.grad_accum_steps` micro-steps; returns this rank's mean micro-step loss.
        `batches`: one batch (reused) or a list of grad_accum_steps; `loss_fn(model, batch)` defaults to `.loss`."""
        return torch_step.training_step(self.model, self.optimizer, batches, self.setup, loss_fn=loss_fn,
                                        hooks=self.hooks())

    def hooks(self) -> torch_step.EngineHooks:
        """How this engine runs memfit's one loop: FSDP2 and DeepSpeed cast to the compute dtype themselves
        (MixedPrecisionPolicy / bf16 config); DeepSpeed scales, accumulates and steps in `engine.backward` +
        `engine.step`; DDP and ZeroRedundancyOptimizer average the gradients after the last micro-step."""
        runtime = self.runtime
        if runtime is Runtime.DEEPSPEED:
            return torch_step.EngineHooks(autocast=False, engine_backward=self._deepspeed_backward)
        averaged = runtime in (Runtime.DDP, Runtime.ZERO_REDUNDANCY)
        return torch_step.EngineHooks(autocast=not runtime.is_fsdp2,
                                      reduce_gradients=self._average_gradients if averaged else None,
                                      max_grad_norm=self.max_grad_norm)

    def _average_gradients(self) -> None:
        average_gradients(self.module)

    def _deepspeed_backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        self.model.step()  # applies the update only at the accumulation boundary

    def local_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, each storage counted once, padding included:
        - parameters: the local shards (FSDP2 DTensor `to_local()`; DeepSpeed ZeRO-3 `ds_tensor`, plus parameters
          under stage3_param_persistence_threshold, which stay whole), or whole parameters;
        - optimizer: the inner optimizer's state tensors; optimizer_scalars: its 0-dim ones (AdamW's `step`
          counters, one per tensor it steps, never sharded);
        - master_weights: DeepSpeed's fp32 partitions (kept even when the model is fp32) or memfit's bf16 master copy;
        - gradient_buffers: DeepSpeed ZeRO-3's flat gradient partition buffer, allocated at initialisation."""
        return rank_memory.local_bytes(self)


# ----------------------------------------------------------------------------------------------- prepare


def prepare(model: nn.Module, setup: TrainingSetup, *, engine: Engine | str | None = None, lr: float | None = None,
            max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM, blocks: Sequence[nn.Module] | None = None
            ) -> Prepared:
    """Shard `model` as `setup` says on its engine (or on `engine`, which replaces it) and build its optimizer, on
    this rank.

    Call after `init_process_group()` (the launcher's environment), with the same model built on every rank from
    the same seed. `setup.num_gpus` must equal the job's world size. `blocks`: the modules FSDP2 shards one by one
    (default: memfit._torch.blocks.find_blocks, the transformer blocks).
    """
    setup = _on_engine(setup, engine)
    if setup.engine is Engine.TORCH and setup.fsdp_version.is_fsdp1:
        raise ConfigError("memfit's torch engine shards with FSDP2 (fully_shard); a plan sized for FSDP1 "
                          "(--fsdp-version 1) runs under accelerate / the HF Trainer / Lightning from the configs "
                          "`memfit plan --emit` writes, or use --fsdp-version 2")
    ranks = world_size()
    if setup.sharding is not Sharding.NONE and setup.num_gpus != ranks:
        raise ConfigError(f"the setup shards over num_gpus={setup.num_gpus} but this job has {ranks} rank(s): launch "
                          f"{setup.num_gpus} processes or pass setup.replace(num_gpus={ranks})")
    if setup.engine is Engine.DEEPSPEED:
        return _prepare_deepspeed(model, setup, lr=lr, max_grad_norm=max_grad_norm, ranks=ranks)
    offloaded = setup.offload is Offload.OPTIMIZER_AND_PARAMS  # FSDP2 keeps the shards on the host
    if not offloaded:
        _to_training_device(model)
    if ranks > 1 and not (offloaded and torch.cuda.is_available()):  # NCCL broadcasts device tensors only
        _broadcast_from_rank0(model)
    runtime = runtime_of(setup.engine, setup.sharding, ranks)
    if runtime.is_fsdp2:
        sharded = shard(model, setup, blocks=blocks)
        optimizer = torch_step.make_optimizer(sharded, _fsdp_optimizer_setup(setup), lr=lr)
        return _finish(Prepared(sharded, optimizer, model, setup, ranks, max_grad_norm))
    _prepare_precision_and_checkpointing(model, setup, blocks)
    optimizer = (_zero_redundancy_optimizer(model, setup, lr) if runtime is Runtime.ZERO_REDUNDANCY
                 else torch_step.make_optimizer(model, setup, lr=lr))
    return _finish(Prepared(model, optimizer, model, setup, ranks, max_grad_norm))


def _on_engine(setup: TrainingSetup, engine: Engine | str | None) -> TrainingSetup:
    """The setup on `engine`; torch's limits are TrainingSetup's own validation (DeepSpeed's: its config)."""
    if engine is None or Engine.parse(engine) is setup.engine:
        return setup
    chosen = Engine.parse(engine)
    try:
        return setup.replace(engine=chosen)
    except ConfigError as error:
        raise ConfigError(f"engine '{chosen}' cannot run this setup: {error}") from None


def shard(model: nn.Module, setup: TrainingSetup, *, blocks: Sequence[nn.Module] | None = None,
          mesh=None) -> nn.Module:
    """Apply FSDP2 to `model` in place for a ZeRO-2 or ZeRO-3 setup and return it: `fully_shard` on each block,
    then on the root (embeddings, final norm, head), with the setup's precision, offload and checkpointing."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if setup.sharding not in (Sharding.ZERO2, Sharding.ZERO3):
        raise ConfigError(f"FSDP2 shards zero2 and zero3, not {setup.sharding}: use prepare(model, setup), which "
                          "runs zero1 with ZeroRedundancyOptimizer")
    setup = _on_engine(setup, Engine.TORCH)
    blocks = list(transformer_blocks(model) if blocks is None else blocks)
    _prepare_precision_and_checkpointing(model, setup, blocks)
    options: dict[str, Any] = {"reshard_after_forward": setup.sharding is Sharding.ZERO3}
    if mesh is not None:
        options["mesh"] = mesh
    if setup.precision in (Precision.AMP_BF16, Precision.AMP_FP16, Precision.BF16_MASTER):
        # fp32 sharded parameters (the master copy), compute in the low dtype, gradients reduced in fp32. A model
        # built in bf16 for bf16-master (memfit's single-process layout) is widened first.
        if all(p.requires_grad for p in model.parameters()):
            if any(p.dtype != torch.float32 for p in model.parameters()):
                model.to(torch.float32)
        else:  # a frozen base keeps its storage dtype: only trainable tensors upcast (accelerate fsdp2_prepare_model)
            for param in model.parameters():
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)
        low = torch.float16 if setup.precision is Precision.AMP_FP16 else torch.bfloat16
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        # Pinning needs an accelerator: CPUOffloadPolicy() fails on a CPU-only build (FACTS.md).
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    else:
        _to_training_device(model)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: memfit._torch.blocks.find_blocks, the one finder."""
    found = block_tools.find_blocks(model)
    if not found:
        raise ConfigError("no repeated blocks in the model (an nn.ModuleList or nn.Sequential of 2+ modules of one "
                          "class): pass blocks=[...] to prepare/shard")
    return found


def _finish(prepared: Prepared) -> Prepared:
    prepared.notes.extend(getattr(prepared.optimizer, "memfit_notes", ()))
    return prepared


def _to_training_device(model: nn.Module) -> None:
    if torch.cuda.is_available() and torch_step.model_device(model).type == "cpu":
        model.to(training_device())


def _prepare_precision_and_checkpointing(model: nn.Module, setup: TrainingSetup,
                                         blocks: Sequence[nn.Module] | None = None) -> None:
    """Pure bf16 parameters, and the setup's checkpointing around `blocks` (default: the repeated blocks), before
    sharding: the techniques' conversions (memfit.techniques.convert), apply_'s path. Only pure bf16 casts here:
    FSDP2 widens a master-weights or autocast model to fp32 shards itself (`shard`), and the optimizer of
    bf16-master keeps its own copy."""
    items = ("precision", "checkpointing") if setup.precision is Precision.BF16 else ("checkpointing",)
    _convert(model, setup, items, blocks)


def _convert(model: nn.Module, setup: TrainingSetup, items: tuple[str, ...],
             blocks: Sequence[nn.Module] | None = None) -> None:

    convert_model(model, setup, Target(is_hf=torch_step.is_hf_model(model), loop=MEMFIT_LOOP,
                                       blocks=None if blocks is None else tuple(blocks)), items)


def _fsdp_optimizer_setup(setup: TrainingSetup) -> TrainingSetup:
    """Under FSDP2 the fp32 sharded parameters are the master copy, so the optimizer steps them directly."""
    return setup.replace(precision=Precision.FP32) if setup.precision.master_weights else setup


def average_gradients(model: nn.Module) -> None:
    """Average every gradient over the ranks in place: one async all-reduce per tensor, then wait for all (no
    gradient-sized bucket beyond the gradients themselves)."""
    import torch.distributed as dist

    ranks = dist.get_world_size()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    works = [dist.all_reduce(grad, async_op=True) for grad in grads]
    for work in works:
        work.wait()
    for grad in grads:
        grad.div_(ranks)


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Start every rank from rank 0's weights (as DDP does), whatever each rank's seed was."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            for plain in storage_tensors(tensor):  # an NF4Tensor has no collective of its own
                dist.broadcast(plain, src=0)


def _zero_redundancy_optimizer(model: nn.Module, setup: TrainingSetup, lr: float | None):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kind = setup.optimizer.kind  # one that torch's ZeRO-1 wraps (TrainingSetup checks kind.zero1)
    kwargs = dict(kind.kwargs)
    if kwargs.get("fused") and not torch.cuda.is_available():
        kwargs = {"foreach": False}  # no fused AdamW kernel on this device
    lr = torch_step.DEFAULT_LR.get(setup.optimizer, 1e-3) if lr is None else lr
    params = [p for p in model.parameters() if p.requires_grad]
    # Each rank owns whole parameters (greedy by size) and steps only those, then broadcasts them.
    return ZeroRedundancyOptimizer(params, optimizer_class=kind.load(), lr=lr, **kwargs)


# ------------------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_runtime_config(setup: TrainingSetup, *, lr: float | None, max_grad_norm: float | None, ranks: int,
                             hidden_size: int | None = None) -> dict:
    """memfit's DeepSpeed config for the setup, with the numbers only the running job knows filled in.

    Bucket sizes: left unset, DeepSpeed allocates its gradient reduce bucket at `reduce_bucket_size` = 5e8 elements
    whatever the model's size (runtime/zero/stage_1_and_2.py setup_buckets, stage3.py: `torch.empty(
    reduce_bucket_size)`), i.e. 2 GB per rank in fp32 and 1 GB in bf16 (twice with overlap_comm), and ZeRO-3 keeps
    every parameter under `stage3_param_persistence_threshold` = 1e5 elements whole on every rank. With the model's
    hidden size they are set as the HF Trainer sets their "auto" values (transformers integrations/deepspeed.py):
    hidden^2, 0.9 hidden^2 and 10 hidden.
    """
    config = deepspeed_config(setup)
    config["train_batch_size"] = setup.micro_batch_size * setup.grad_accum_steps * ranks
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    if "optimizer" in config:
        config["optimizer"]["params"]["lr"] = torch_step.DEFAULT_LR.get(setup.optimizer, 1e-3) if lr is None else lr
    zero = config.setdefault("zero_optimization", {})
    if hidden_size:
        zero.setdefault("reduce_bucket_size", hidden_size * hidden_size)
        if zero.get("stage") == 3:
            zero.setdefault("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size))
            zero.setdefault("stage3_param_persistence_threshold", 10 * hidden_size)
    return config


def _prepare_deepspeed(model: nn.Module, setup: TrainingSetup, *, lr: float | None,
                       max_grad_norm: float | None, ranks: int) -> Prepared:
    deepspeed = torch_step._import("deepspeed", extra="engines")
    _skip_inference_shm_op(deepspeed)
    _convert(model, setup, ("checkpointing",))  # DeepSpeed casts to its bf16 / fp16 config itself
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    config = deepspeed_runtime_config(setup, lr=lr, max_grad_norm=max_grad_norm, ranks=ranks,
                                      hidden_size=hidden if isinstance(hidden, int) else None)
    client = None
    if "optimizer" not in config:  # an optimizer DeepSpeed does not build (8-bit AdamW, Adafactor, SGD)
        client = torch_step.make_optimizer(model, setup.replace(precision=Precision.FP32), lr=lr)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config,
                                                   model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad])
    return Prepared(engine, optimizer, model, setup, ranks, max_grad_norm)


def _skip_inference_shm_op(deepspeed) -> None:
    """DeepSpeed's CPU communication backend builds its shared-memory op (deepspeed_shm_comm: a ~35 s JIT compile on
    first use) whenever it starts, but only `inference_all_reduce` uses it (deepspeed/comm/torch.py, 0.19); training
    collectives go through torch.distributed. Marking the op incompatible before the backend starts skips the build."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    compatible = deepspeed.ops.__compatible_ops__  # computed on first access, then a plain dict
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
