"""TrainingSetup's combination checks: what memfit sizes of each engine, parallelism, adapter and optimizer pairing,
said in one line each rather than guessed (TrainingSetup.__post_init__ joins them into one ConfigError). The setup's
own field checks and the technique sections' `problems` stay with their fields. memfit.setup re-exports what
others use (fsdp2_mixed_precision, deepspeed_casts_module, positive_int)."""

from __future__ import annotations

from typing import Any

from .choices import Attention, Checkpointing, Engine, Loss, Offload, Optimizer, Precision, Sharding
from .way_out import checked, engine_way_out, refusal

TrainingSetup = Any  # a memfit.setup.TrainingSetup (typed loosely: this module sits below it)


def positive_int(value: object) -> bool:
    """A whole number above 0 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0



def fsdp2_mixed_precision(setup: TrainingSetup, engine: Engine | None = None) -> bool:
    """Whether FSDP2 runs the setup's precision as MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32):
    fp32 shards (the master copy), low-precision compute with no autocast, fp32 gradient reduction. That is what
    memfit's torch engine (`memfit._torch.engine.shard`) and its emitted FSDP2 code do for amp-* and bf16-master at
    ZeRO-2/3, so an amp setup there is sized like bf16-master (same bytes: fp16 and bf16 are both 2 B). `engine`
    overrides the setup's (a trace always runs FSDP2)."""
    return ((engine or setup.engine) is Engine.TORCH and setup.sharding.stage >= 2
            and (setup.precision.is_autocast or setup.precision.master_weights))


def deepspeed_casts_module(setup: TrainingSetup) -> bool:
    """Whether DeepSpeed runs the setup in its bf16 / fp16 mode (the config memfit emits under ZeRO or offload:
    bf16.enabled / fp16.enabled): the engine casts the whole module, LoRA adapters included, to the 16-bit dtype
    (runtime/engine.py _configure_distributed_model: module.bfloat16() / .half()) and keeps fp32 master partitions
    of the trainable tensors in its ZeRO optimizer, with no autocast."""
    return (setup.engine is Engine.DEEPSPEED and setup.precision is not Precision.FP32
            and (setup.sharding is not Sharding.NONE or setup.offload is not Offload.NONE))


def fsdp1_problems(setup: TrainingSetup) -> list[str]:
    """What memfit sizes of FSDP1 (memfit.estimate.fsdp1, measured by bench/fsdp1.py)."""
    if not setup.fsdp_version.is_fsdp1:
        return []
    ft, way = setup.finetune, "use --fsdp-version 2"
    checks = [(setup.engine is not Engine.TORCH, "FSDP1 is torch's: needs --engine torch"),
              (setup.sharding is Sharding.ZERO1, "FSDP1 has no ZeRO-1 (NO_SHARD is DDP): use zero2 or zero3"),
              (setup.tp > 1 or setup.pp > 1 or setup.cp > 1 or setup.dp_shard > 0,
               f"FSDP1 with tensor / pipeline / context parallelism or HSDP is not sized: {way}"),
              (setup.compile or any(not section.fsdp1_sized() for section in setup.techniques),
               f"FSDP1 with float8 or torch.compile is not sized: {way}"),
              (ft.adapters and (ft.method.value != "lora" or ft.dora or ft.torchtune or bool(ft.modules_to_save)),
               f"FSDP1 is sized for plain peft LoRA on a 16-bit or fp32 base (not QLoRA, DoRA, torchtune or "
               f"modules_to_save): {way}"),
              (setup.optimizer_in_backward, f"FSDP1 with optimizer in backward is not sized: {way}"),
              (setup.offload is Offload.OPTIMIZER, "FSDP1 offloads parameters, gradients and the step together "
               "(CPUOffload(offload_params=True)): use --offload optimizer+params")]
    return [why for bad, why in checks if bad]

def moe_problems(setup: TrainingSetup) -> list[str]:
    """Expert parallelism and the capacity factor (whether ep divides the model's experts is checked where the
    model is known: memfit.estimate.moe)."""
    problems = []
    if not positive_int(setup.expert_parallel):
        problems.append(f"expert_parallel must be a positive whole number, got {setup.expert_parallel!r}")
    elif setup.num_gpus % setup.expert_parallel:
        problems.append(f"expert_parallel {setup.expert_parallel} does not divide num_gpus {setup.num_gpus}: the "
                        "EP group is a slice of the data-parallel ranks")
    elif setup.expert_parallel > 1 and setup.sharding is not Sharding.NONE:
        # the engines shard each expert over its expert-data-parallel group (num_gpus / ep ranks: DeepSpeed-MoE's
        # expert_data_parallel_group), the rest over all ranks; memfit's layouts shard everything over all ranks
        problems.append(f"expert parallelism with {setup.sharding} is not sized yet (the experts shard over the "
                        f"{setup.num_gpus // setup.expert_parallel} ranks of their expert-data-parallel group, not "
                        "over all of them): use --zero none with --ep, or --ep 1")
    c = setup.capacity_factor
    if isinstance(c, bool) or not isinstance(c, (int, float)) or c != c or c < 0 or c == float("inf"):
        problems.append(f"capacity_factor must be 0 (dropless) or a number >= 1, got {c!r}")
    elif 0 < c < 1:
        problems.append(f"capacity_factor {c} is below 1: it drops tokens even under balanced routing; give 0 "
                        "for dropless routing (transformers' experts) or a factor >= 1")
    return problems

def combination_problems(setup: TrainingSetup) -> list[str]:
    problems = []
    if setup.tp > 1 or setup.sequence_parallel:
        problems += _tensor_parallel_problems(setup)
        if problems:
            return problems
    if setup.pp > 1 or setup.pp_virtual_stages > 1:
        problems += _pipeline_problems(setup)
        if problems:
            return problems
    if setup.cp > 1:
        problems += _context_parallel_problems(setup)
        if problems:
            return problems
    if setup.dp_shard:
        problems += _hsdp_problems(setup)
        if problems:
            return problems
    if setup.sharding is not Sharding.NONE and setup.shard_size < 2:
        problems += _one_gpu_sharding_problems(setup)
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS and setup.sharding is not Sharding.ZERO3:
        problems.append("offloading parameters needs zero3 sharding (DeepSpeed offload_param / FSDP CPUOffload)")
    if setup.offload is not Offload.NONE and setup.optimizer.library in ("bitsandbytes", "torchao"):
        problems.append(f"CPU offload runs DeepSpeed's CPU Adam; it does not combine with {setup.optimizer} "
                        f"({setup.optimizer.library})")
    if setup.engine is Engine.TORCH:
        problems += _torch_engine_problems(setup)
    if setup.finetune.adapters:
        problems += _adapter_problems(setup)
    if setup.optimizer_in_backward:
        problems += _in_backward_problems(setup)
    if setup.optimizer is Optimizer.MUON:
        problems += _muon_problems(setup)
    return problems

def _muon_problems(setup: TrainingSetup) -> list[str]:
    """torch.optim.Muon orthogonalises whole matrices (Newton-Schulz on each 2-D gradient): sized on one
    unsharded GPU, full training, without a master copy or per-parameter stepping."""
    if (setup.sharding is not Sharding.NONE or setup.offload is not Offload.NONE or setup.tp > 1 or setup.pp > 1
            or setup.cp > 1):
        return ["muon is sized without sharding, offload or model parallelism (its Newton-Schulz step needs each "
                "whole matrix on one rank): use --sharding none, or an AdamW variant"]
    if setup.finetune.adapters:
        return [f"muon with {setup.finetune.method} is not sized yet: use method full, or an AdamW variant"]
    if setup.precision.master_weights or setup.optimizer_in_backward:
        return ["muon is sized without an fp32 master copy (bf16-master) and without the optimizer in backward: "
                "use amp-bf16 or bf16"]
    return []

def _in_backward_problems(setup: TrainingSetup) -> list[str]:
    """Where stepping each parameter inside backward (torchtune optimizer_in_bwd) cannot run, or is not sized."""
    problems = []
    if setup.grad_accum_steps > 1:
        problems.append("optimizer in backward steps each parameter as its gradient arrives, so nothing can "
                        "accumulate over micro-steps (torchtune refuses it too): use accum 1")
    if setup.num_gpus > 1 or setup.sharding is not Sharding.NONE or setup.offload is not Offload.NONE:
        problems.append("optimizer in backward is sized on one GPU without sharding or offload (torchtune's "
                        "single-device recipe); DeepSpeed owns its own step")
    if setup.precision is Precision.AMP_FP16:
        problems.append("optimizer in backward cannot run amp-fp16: the GradScaler must see every gradient "
                        "before any step; use amp-bf16")
    if setup.precision.master_weights:
        problems.append("optimizer in backward with an fp32 master copy (bf16-master) is not sized yet: use "
                        "amp-bf16 or bf16")
    if setup.finetune.adapters:
        problems.append(f"optimizer in backward with {setup.finetune.method} is not sized yet (the adapters' "
                        "gradients are small anyway)")
    return problems

def _adapter_problems(setup: TrainingSetup) -> list[str]:
    """What memfit does not size for LoRA / QLoRA (yet), said rather than guessed."""
    problems = []
    # engine torch: FSDP2's CPUOffloadPolicy (optimizer+params at zero3, the frozen base's shards on the host
    # too: memfit.estimate.lora_sharded); its other offloads are refused with the engine's own limits
    if setup.checkpointing not in (Checkpointing.NONE, Checkpointing.FULL):
        problems.append(f"checkpointing {setup.checkpointing} with {setup.finetune.method} is not sized yet: use "
                        "full or none")
    if setup.loss is Loss.FUSED:
        problems.append(f"a fused loss with {setup.finetune.method} is not sized yet (the frozen head's casts "
                        "under the fused kernel are not measured): use loss chunked or standard")
    if setup.finetune.dora and setup.sharding.stage >= 2 and setup.engine is Engine.DEEPSPEED:
        problems.append(refusal("DoRA under DeepSpeed ZeRO-2/3 is not sized yet (measured unsharded and under "
                                "FSDP2)", engine_way_out(setup, Engine.TORCH),
                                checked(setup, sharding=Sharding.ZERO1) or checked(setup, sharding=Sharding.NONE)))
    quantized = setup.finetune.base_storage(setup.precision.compute_dtype).quantized
    if quantized and deepspeed_casts_module(setup) and setup.sharding is not Sharding.ZERO3:
        # DeepSpeed's bf16 / fp16 engine casts the module (the fp32 norms and embeddings that peft's k-bit
        # preparation made, the adapters) and keeps fp32 master partitions: not measured with a packed base
        torch_way = engine_way_out(setup, Engine.TORCH)
        problems.append(refusal(
            f"{setup.finetune.method} under DeepSpeed's {setup.precision.compute_dtype} engine (ZeRO or offload) is "
            "not sized yet", torch_way and torch_way + " (FSDP2 shards a packed base, memfit.estimate.lora_sharded)",
            checked(setup, sharding=Sharding.NONE, offload=Offload.NONE)))
    elif quantized and setup.precision.master_weights and not fsdp2_mixed_precision(setup):
        problems.append("a quantized base has no master weights: use amp-bf16 (HF Trainer bf16=True) for QLoRA")
    if setup.sharding is Sharding.ZERO3 and setup.engine is Engine.DEEPSPEED and (quantized or setup.offload.value
                                                                                != "none"):
        zero2 = checked(setup, sharding=Sharding.ZERO2, offload=Offload.OPTIMIZER if setup.offload.value != "none"
                        else Offload.NONE)
        # one GPU: ZeRO-2 offload keeps it where DeepSpeed sizes it (not a packed base: then 2 GPUs of FSDP2)
        torch_way = engine_way_out(setup, Engine.TORCH, more_gpus=not zero2)
        problems.append(refusal(
            f"{setup.finetune.method} under DeepSpeed zero3 is sized for a 16/32-bit base without offload",
            torch_way and torch_way + " (FSDP2 shards a packed base, memfit.estimate.lora_sharded)",
            zero2 and zero2 + " (ZeRO-Offload of the adapters)" * (setup.offload.value != "none")))
    return problems

def _tensor_parallel_problems(setup: TrainingSetup) -> list[str]:
    """What memfit's tensor parallelism covers: torch DTensor TP on the torch engine, with FSDP2 (zero2/zero3)
    or DDP over the data-parallel groups."""
    if setup.tp == 1:
        return ["sequence parallelism splits the sequence between tensor-parallel ranks: it needs tp > 1"]
    if setup.num_gpus % setup.tp:
        return [f"tensor parallel degree {setup.tp} must divide the GPU count ({setup.num_gpus})"]
    problems = []
    if setup.engine is not Engine.TORCH:
        problems.append(refusal("tensor parallelism runs on engine torch (DTensor, as torchtitan does): "
                                "DeepSpeed trains with TP only through Megatron-DeepSpeed or its AutoTP, which "
                                "memfit does not size", engine_way_out(setup, Engine.TORCH)))
    if setup.sharding is Sharding.ZERO1:
        problems.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) cannot step tensor-parallel (DTensor) "
                        "parameters: use zero2 or zero3 (FSDP2 over the data-parallel groups) or none")
    if setup.offload is not Offload.NONE:
        problems.append("CPU offload with tensor parallelism is not sized yet")
    if setup.finetune.adapters:
        problems.append(f"{setup.finetune.method} with tensor parallelism is not sized yet")
    return problems

def _pipeline_problems(setup: TrainingSetup) -> list[str]:
    """What memfit's pipeline parallelism covers: torch.distributed.pipelining on engine torch, as torchtitan
    runs it (whether the stages divide the model's layers is checked where the model is known)."""
    if setup.pp == 1:
        return ["pipeline virtual stages need pipeline parallelism: give pp > 1"]
    if setup.num_gpus % (setup.pp * setup.tp):
        return [f"pipeline degree {setup.pp} x tensor degree {setup.tp} must divide the GPU count ({setup.num_gpus})"]
    problems = []
    if setup.engine is not Engine.TORCH:
        problems.append(refusal("pipeline parallelism runs on engine torch (torch.distributed.pipelining, as "
                                "torchtitan does); DeepSpeed's PipelineModule is not sized",
                                engine_way_out(setup, Engine.TORCH)))
    if setup.pp_schedule.interleaved != (setup.pp_virtual_stages > 1):
        problems.append("interleaved-1f1b holds 2 or more stages per rank (--pp-virtual-stages 2); gpipe and "
                        "1f1b hold one" if setup.pp_schedule.interleaved or setup.pp_virtual_stages == 1 else
                        f"{setup.pp_virtual_stages} stages per rank need --pp-schedule interleaved-1f1b")
    rounds = max(1, setup.grad_accum_steps // setup.pp)  # torch ScheduleInterleaved1F1B.number_of_rounds
    if setup.pp_schedule.interleaved and setup.grad_accum_steps % rounds:
        problems.append(f"interleaved-1f1b needs the micro-batches (accum {setup.grad_accum_steps}) to be a "
                        f"multiple of its {rounds} rounds of pp {setup.pp} (torch ScheduleInterleaved1F1B): "
                        f"use accum {rounds * setup.pp}")
    if setup.sharding is Sharding.ZERO1:
        problems.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) is not what torchtitan pairs with pipelining: "
                        "use zero2 or zero3 (FSDP2 over the data-parallel ranks) or none")
    if setup.offload is not Offload.NONE or setup.finetune.adapters or setup.optimizer_in_backward:
        problems.append("pipeline parallelism is sized with full training, no CPU offload and no optimizer in "
                        "backward")
    if setup.loss is not Loss.STANDARD:
        problems.append(f"a {setup.loss} loss on the last pipeline stage is not sized yet: use loss standard")
    return problems

def _context_parallel_problems(setup: TrainingSetup) -> list[str]:
    """Ring attention as torch's context_parallel runs it (torch 2.13 _context_parallel/_attention.py)."""
    if setup.num_gpus % (setup.cp * setup.tp * setup.pp):
        return [f"context degree {setup.cp} x tensor {setup.tp} x pipeline {setup.pp} must divide the GPU count "
                f"({setup.num_gpus})"]
    problems = []
    if setup.engine is not Engine.TORCH:
        problems.append(refusal("context parallelism runs on engine torch (torch context_parallel, as "
                                "torchtitan does)", engine_way_out(setup, Engine.TORCH)))
    if setup.attention is not Attention.SDPA:
        problems.append("context parallelism replaces the flash / memory-efficient SDPA kernels with ring "
                        "attention; eager attention cannot run it: use --attention sdpa")
    if setup.seq_len % (2 * setup.cp):
        problems.append(f"context parallelism with load balancing cuts each sequence into 2 x cp = "
                        f"{2 * setup.cp} chunks: seq {setup.seq_len} must be a multiple of {2 * setup.cp}")
    if setup.sharding is Sharding.ZERO1 or setup.offload is not Offload.NONE or setup.finetune.adapters:
        problems.append("context parallelism is sized with full training on FSDP2 (zero2 / zero3) or none, "
                        "without offload")
    if setup.loss is not Loss.STANDARD:
        problems.append(f"a {setup.loss} loss with context parallelism is not sized yet: use loss standard")
    return problems

def _hsdp_problems(setup: TrainingSetup) -> list[str]:
    """Hybrid sharding: FSDP2 on a 2D (replicate, shard) mesh of the data-parallel ranks."""
    if not positive_int(setup.dp_shard):
        return [f"dp_shard (the HSDP shard group) must be a positive whole number, got {setup.dp_shard!r}"]
    if setup.dp_size % setup.dp_shard:
        return [f"HSDP shard group {setup.dp_shard} must divide the {setup.dp_size} data-parallel ranks "
                "(num_gpus / (tp x pp))"]
    problems = []
    if setup.engine is not Engine.TORCH or setup.sharding.stage < 2:
        problems.append(refusal("HSDP (a shard group) is FSDP2 on a 2D mesh with zero2 or zero3 (DeepSpeed's "
                                "MiCS / ZeRO++ hpZ are not sized)", engine_way_out(setup, Engine.TORCH)))
    if setup.offload is not Offload.NONE:
        problems.append("CPU offload with HSDP is not sized yet")
    return problems

def _one_gpu_sharding_problems(setup: TrainingSetup) -> list[str]:
    """ZeRO on one GPU: with nothing to shard over, a stage saves memory only by moving its partitions to the
    host, which DeepSpeed's ZeRO-Offload / ZeRO-Infinity do on one rank (offload_optimizer, offload_param).
    DeepSpeed also runs ZeRO-1/2/3 on one rank without offload (world size 1: every partition is whole, plus
    its fp32 partition copy and buckets; memfit.estimate.static), as users launch it; torch's engines do not."""
    if setup.tp > 1:
        return [f"{setup.sharding} shards over the data-parallel ranks, num_gpus / tp = {setup.dp_size}: it needs "
                f"at least 2 (give --gpus {2 * setup.tp} or more)"]
    if setup.offload is Offload.NONE and setup.engine is Engine.DEEPSPEED:
        return []
    if setup.offload is Offload.NONE:
        return [f"{setup.sharding} shards over GPUs and needs at least 2 (got num_gpus={setup.num_gpus}): on one "
                "GPU it saves nothing unless it offloads to the CPU (--offload optimizer, or optimizer+params "
                "with zero3); DeepSpeed runs it on one rank anyway (--engine deepspeed)"]
    if setup.engine is not Engine.DEEPSPEED:
        return [refusal(f"{setup.sharding} with CPU offload on one GPU runs on DeepSpeed (ZeRO-Offload)",
                        engine_way_out(setup, Engine.DEEPSPEED), "2+ GPUs for torch's FSDP2")]
    return []

def _torch_engine_problems(setup: TrainingSetup) -> list[str]:
    """What torch's own engines cannot express (checked against torch 2.13 FSDP2 / ZeroRedundancyOptimizer)."""
    problems = []
    if setup.offload is Offload.OPTIMIZER:
        params = checked(setup, offload=Offload.OPTIMIZER_AND_PARAMS, sharding=Sharding.ZERO3)
        deepspeed = engine_way_out(setup, Engine.DEEPSPEED)
        problems.append(refusal("FSDP2 offloads parameters with the optimizer step, never the optimizer alone",
                                params, deepspeed and deepspeed + " (ZeRO-Offload)"))
    if setup.sharding.stage >= 2 and setup.optimizer.kind.fsdp2:
        problems.append(refusal(f"{setup.optimizer} cannot step FSDP2's sharded (DTensor) parameters",
                                engine_way_out(setup, Engine.DEEPSPEED)))
    if setup.sharding is Sharding.ZERO1 and (not setup.optimizer.kind.zero1
                                             or setup.precision.master_weights):
        problems.append(refusal("torch's ZeRO-1 (ZeroRedundancyOptimizer) covers AdamW and SGD without an fp32 "
                                "master copy", engine_way_out(setup, Engine.DEEPSPEED)))
    return problems
