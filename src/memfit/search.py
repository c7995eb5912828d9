"""Every combination of the techniques that TrainingSetup accepts, for `plan --optimize`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .errors import ConfigError
from .hardware import Hardware
from .techniques.micro_batch import divisors
from .setup import Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup


def candidate_setups(setup: TrainingSetup, hardware: Hardware) -> Iterator[TrainingSetup]:
    precisions = {setup.precision}
    if hardware.gpu.bf16:
        precisions |= {Precision.AMP_BF16, Precision.BF16}
    elif setup.precision is Precision.FP32:
        precisions.add(Precision.AMP_FP16)
    optimizers = {setup.optimizer}
    if setup.optimizer.is_adam:
        optimizers |= {Optimizer.ADAMW_8BIT, Optimizer.ADAMW_FUSED}
    batch = setup.micro_batch_size * setup.grad_accum_steps
    micro = divisors(setup.micro_batch_size)
    n = hardware.world_size
    shardings = [Sharding.NONE] + ([Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3] if n > 1 else [])
    engines = list(Engine) if n > 1 else [setup.engine]
    for prec, opt, ckpt, b, shard, off, engine in itertools.product(
            sorted(precisions), sorted(optimizers), list(Checkpointing), micro, shardings, list(Offload), engines):
        try:
            yield setup.replace(precision=prec, optimizer=opt, checkpointing=ckpt, attention=Attention.SDPA,
                                micro_batch_size=b, grad_accum_steps=batch // b, sharding=shard, offload=off,
                                num_gpus=n, engine=engine)
        except ConfigError:
            continue
