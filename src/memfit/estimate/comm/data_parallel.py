"""Data parallelism's collectives per engine: DDP, torch ZeRO-1, FSDP2, DeepSpeed ZeRO (memfit.estimate.comm)."""

from __future__ import annotations


from ...model_spec import ModelSpec
from ...setup import Engine, Offload, Precision, Sharding, TrainingSetup
from .result import Collective
from .runtime import ALL_GATHER, ALL_REDUCE, BROADCAST, DEEPSPEED_MAX_REUSE_DISTANCE, REDUCE_SCATTER, Runtime, deepspeed_stage


def data_parallel_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """What plain data parallelism on the setup's engine sends per rank per step (DDP's all-reduce, or DeepSpeed
    ZeRO-0's), the baseline a ZeRO stage is compared with."""
    if setup.dp_size < 2:
        return 0
    from ..tensor_parallel import rank_spec

    params, trained = _gathered_and_trained(rank_spec(spec, setup), setup)
    if setup.engine is Engine.DEEPSPEED:
        return _deepspeed(params, setup, trained, stage=0)[0].num_bytes
    return _ddp(params, setup, trained)[0].num_bytes


def _gathered_and_trained(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """(every parameter, the trained ones): under LoRA / QLoRA the frozen base is gathered (FSDP2, ZeRO-3) but
    has no gradient to reduce, nor a partition to step (DDP buckets, FSDP2's reduce-scatter and ZeRO-1/2 take
    only parameters that require grad: torch reducer.cpp, fsdp _fsdp_param_group, DeepSpeed stage_1_and_2)."""
    if not setup.finetune.adapters:
        return spec.num_params, spec.num_params
    from ..lora import adapted_spec

    adapted = adapted_spec(spec, setup)
    return adapted.num_params + sum(p.total for p in adapted.frozen), adapted.num_params


def _ddp(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    return [Collective(ALL_REDUCE, "gradients, after the last micro-step", _trained(params, trained),
                       _torch_param_bytes(setup))]


def _trained(params: int, trained: int | None) -> int:
    return params if trained is None else trained


def _zero_redundancy(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    return [*_ddp(params, setup, trained),
            Collective(BROADCAST, "updated parameters, each from the rank that stepped it", _trained(params, trained),
                       _torch_param_bytes(setup))]


def _fsdp2(params: int, setup: TrainingSetup, trained: int | None = None) -> list[Collective]:
    micro = setup.grad_accum_steps
    gather, reduce = _fsdp2_dtype_bytes(setup)
    collectives = [Collective(ALL_GATHER, "parameters, before each forward", params, gather, micro)]
    if setup.sharding is Sharding.ZERO3:
        collectives.append(Collective(ALL_GATHER, "parameters again, before each backward", params, gather, micro))
    grads = _trained(params, trained)
    collectives.append(Collective(REDUCE_SCATTER, "gradients, after each backward", grads, reduce, micro))
    if setup.replicas > 1:  # HSDP: each gradient shard all-reduced across the replicas
        collectives.append(Collective(ALL_REDUCE, f"gradient shards across the {setup.replicas} HSDP replicas, "
                                      "after each backward", grads // setup.shard_size, reduce, micro,
                                      group="replicate"))
    return collectives


def _deepspeed(params: int, setup: TrainingSetup, trained: int | None = None,
               stage: int | None = None) -> list[Collective]:
    stage = deepspeed_stage(setup) if stage is None else stage
    micro, dtype = setup.grad_accum_steps, _deepspeed_dtype_bytes(setup)
    grads = _trained(params, trained)
    if stage == 0:
        return [Collective(ALL_REDUCE, "gradients, at the accumulation boundary", grads, dtype)]
    if stage == 3:
        regathered = params - min(params, DEEPSPEED_MAX_REUSE_DISTANCE // 2)
        collectives = [Collective(ALL_GATHER, "parameters, in each forward", params, dtype, micro)]
        if regathered:
            collectives.append(Collective(ALL_GATHER, "parameters released after forward, again in backward",
                                          regathered, dtype, micro))
        return collectives + [Collective(REDUCE_SCATTER, "gradients, in each backward", grads, dtype, micro)]
    reduce = (Collective(ALL_REDUCE, "gradient buckets, at the accumulation boundary", grads, dtype) if stage == 1
              else Collective(ALL_REDUCE, "gradient buckets, in each backward", grads, dtype, micro))
    return [reduce, Collective(ALL_GATHER, "updated parameter partitions, after the step", grads, dtype)]


_COLLECTIVES = {Runtime.SINGLE: lambda params, setup, trained=None: [], Runtime.DDP: _ddp,
                Runtime.ZERO_REDUNDANCY: _zero_redundancy, Runtime.FSDP2_NO_RESHARD: _fsdp2,
                Runtime.FSDP2_RESHARD: _fsdp2, Runtime.DEEPSPEED: _deepspeed}


def _torch_param_bytes(setup: TrainingSetup) -> int:
    """Parameters and gradients of an unsharded torch model: fp32 unless the weights are bf16 (bf16, bf16-master:
    memfit keeps the fp32 master copy in the optimizer, so gradients are bf16)."""
    return setup.precision.param_bytes


def _fsdp2_dtype_bytes(setup: TrainingSetup) -> tuple[int, int]:
    """(all-gather, reduce-scatter) bytes per element under memfit's FSDP2 options (memfit._torch.engine.shard):
    MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=fp32) for amp-* and bf16-master."""
    if setup.precision is Precision.FP32:
        return 4, 4
    if setup.precision is Precision.BF16:
        return 2, 2
    return 2, 4


def _deepspeed_dtype_bytes(setup: TrainingSetup) -> int:
    """DeepSpeed's communication_data_type default (runtime/engine.py): fp16 or bf16 when enabled, else fp32."""
    return setup.precision.compute_bytes


def _notes(runtime: Runtime, setup: TrainingSetup) -> tuple[str, ...]:
    notes = []
    if runtime is Runtime.ZERO_REDUNDANCY:
        notes.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) all-reduces whole gradients and broadcasts the "
                     "updated parameters: 3 Psi, where the ZeRO paper's ZeRO-1 moves 2 Psi")
    if runtime is Runtime.DEEPSPEED and deepspeed_stage(setup) in (1, 2):
        notes.append("DeepSpeed ZeRO-1/2 all-reduce gradient buckets (use_multi_rank_bucket_allreduce, on by "
                     "default) before all-gathering the updated partitions: 3 Psi, where the ZeRO paper moves 2 Psi")
    if setup.grad_accum_steps > 1 and (runtime.is_fsdp2 or (
            runtime is Runtime.DEEPSPEED and deepspeed_stage(setup) >= 2)):
        notes.append(f"gradients are reduced in each of the {setup.grad_accum_steps} micro-steps, not once per step")
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        notes.append("parameter offload adds host<->device copies (techniques.costs.offload_traffic_bytes), not "
                     "network traffic")
    return tuple(notes)
