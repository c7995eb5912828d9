"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) around a built model, as the frameworks wrap it, so that
its per-rank memory can be measured against memfit.estimate.fsdp1.

- units: the transformer block as the auto-wrap unit (accelerate's TRANSFORMER_BASED_WRAP with the model's
  `_no_split_modules`, Lightning's `auto_wrap_policy={Block}`), the root FSDP holding the rest (embeddings, final
  norm, LM head); for a peft model under fsdp_version "1", peft's own `fsdp_auto_wrap_policy` (peft 0.21
  utils/other.py, which the HF Trainer installs for a PeftModel): every leaf module with a trainable weight (each
  lora_A / lora_B Linear) is a unit of its own, so no flat parameter mixes frozen and trainable tensors; under
  "1-blocks" (Lightning Fabric's FSDPStrategy, which sets use_orig_params=True) the adapters join their block's;
- precision: amp-bf16 / bf16-master as MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=bf16), what accelerate
  1.15 (FullyShardedDataParallelPlugin.set_mixed_precision) and Lightning 2.6 (FSDPPrecision "bf16-mixed") pass,
  and accelerate's upcast of every trainable flat parameter to fp32 (Accelerator.prepare_model); Lightning builds
  the model in fp32 under bf16-mixed, so "1-blocks" upcasts the whole model first (one dtype per flat parameter);
- offload: CPUOffload(offload_params=True) for optimizer+params;
- limit_all_gathers=True (both frameworks' default), backward_prefetch BACKWARD_PRE (FSDP1's default),
  sync_module_states off, use_orig_params=True: the HF Trainer's default (transformers 5.x TrainingArguments
  `fsdp_config.get("use_orig_params", "true")`), `accelerate config`'s suggested answer and Lightning's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ..setup import FsdpVersion, Offload, Precision, Sharding, TrainingSetup
from . import blocks as block_tools


def wrap(model: nn.Module, setup: TrainingSetup) -> nn.Module:
    """`model` (built by memfit._torch.step.build_hf_model: adapters and checkpointing applied) in FSDP1."""
    blocks = block_tools.find_blocks(model)
    mixed = setup.precision in (Precision.AMP_BF16, Precision.AMP_FP16, Precision.BF16_MASTER)
    low = torch.float16 if setup.precision is Precision.AMP_FP16 else torch.bfloat16
    lightning = setup.fsdp_version is FsdpVersion.V1_BLOCKS
    if lightning:  # one dtype per flat parameter: Lightning builds the model in fp32 (bf16 for bf16-true)
        model.to(torch.bfloat16 if setup.precision is Precision.BF16 else torch.float32)
    elif mixed and not setup.finetune.adapters:
        model.to(torch.float32)
    if setup.finetune.adapters and not lightning:
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
    else:
        policy = ModuleWrapPolicy({type(blocks[0])})
    wrapped = FSDP(model, auto_wrap_policy=policy,
                   sharding_strategy=(ShardingStrategy.FULL_SHARD if setup.sharding is Sharding.ZERO3
                                      else ShardingStrategy.SHARD_GRAD_OP),
                   mixed_precision=(MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low)
                                    if mixed else None),
                   cpu_offload=CPUOffload(offload_params=setup.offload is Offload.OPTIMIZER_AND_PARAMS),
                   use_orig_params=True, limit_all_gathers=True, sync_module_states=False,
                   device_id=torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu"))
    if mixed:
        for module in FSDP.fsdp_modules(wrapped):  # accelerate: trainable flat parameters held in fp32
            flat = getattr(module, "_flat_param", None)
            if flat is not None and flat.requires_grad and flat.dtype != torch.float32:
                flat.data = flat.data.to(torch.float32)
                module._handle._orig_param_dtype = torch.float32
    return wrapped


__all__ = ["wrap"]
