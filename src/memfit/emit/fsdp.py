"""FSDP2 (torch.distributed.fsdp.fully_shard) code for a TrainingSetup, as a runnable Python module.
Each setting carries its reason as a Python comment; API per torch/distributed/fsdp/_fully_shard (torch 2.6+)."""

from __future__ import annotations

import textwrap

from ..errors import ConfigError
from ..setup import Checkpointing, Offload, Precision, Sharding, TrainingSetup
from ..techniques.checkpointing import fsdp2_fragment
from .emitted import EmittedConfig, describe


def fsdp2_unsupported(setup: TrainingSetup) -> str | None:
    """Why fully_shard alone cannot express the setup, or None when it can."""
    if setup.sharding is Sharding.NONE:
        return "the plan does not shard, so there is nothing for FSDP2 to do (plain DDP or one GPU)"
    if setup.fsdp_version.is_fsdp1:
        return ("the plan runs FSDP1 (--fsdp-version 1): accelerate.yaml (fsdp_version 1) and the Trainer's "
                "fsdp_config carry it; fully_shard is FSDP2")
    if setup.sharding is Sharding.ZERO1:
        return ("FSDP2 has no ZeRO-1: fully_shard always shards gradients with the parameters; "
                "use deepspeed.json (DeepSpeed ZeRO-1)")
    if setup.offload is Offload.OPTIMIZER:
        return ("FSDP2 offloads parameters, gradients and the optimizer step together (CPUOffloadPolicy), never the "
                "optimizer alone; use deepspeed.json (ZeRO-Offload)")
    return setup.optimizer.kind.fsdp2 or None  # the optimizers that cannot step DTensor parameters say why


def fsdp2_code(setup: TrainingSetup) -> str:
    """A Python module defining `shard_model(model)` and `build_optimizer(model, lr)` for the setup."""
    reason = fsdp2_unsupported(setup)
    if reason:
        raise ConfigError(f"no FSDP2 code for this plan: {reason}")
    sections = [_header(setup), _reshard_section(setup), _BLOCKS, _precision_section(setup),
                _offload_section(setup), fsdp2_fragment(setup), _shard_section(setup),
                _optimizer_section(setup)]
    return "\n\n\n".join(section.strip("\n") for section in sections if section) + "\n"


def fsdp2_file(setup: TrainingSetup, *, filename: str = "fsdp2_shard.py") -> EmittedConfig:
    notes = ["Not wired into training_args.json: the HF Trainer route uses DeepSpeed. To use FSDP2 with accelerate, "
             "launch with accelerate_fsdp2.yaml; in your own loop, call shard_model(model) then "
             "build_optimizer(model, lr)."]
    if setup.precision is Precision.AMP_FP16:
        notes.append("fp16: scale the loss with make_grad_scaler() from this file.")
    return EmittedConfig(filename, fsdp2_code(setup), notes=tuple(notes),
                         summary="FSDP2 `fully_shard` code for your own training loop; the reasons are comments in it.")


def _header(setup: TrainingSetup) -> str:
    names = ["fully_shard"]
    if _precision_section(setup):
        names.insert(0, "MixedPrecisionPolicy")
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        names.insert(0, "CPUOffloadPolicy")
    plan = textwrap.fill(f"FSDP2 sharding written by memfit for: {describe(setup)}.", width=115)
    return f'''"""{plan}

Under torchrun, after torch.distributed.init_process_group(): put the model on its training device (or build it on
the meta device and call model.to_empty(...) after sharding), call shard_model(model), then build_optimizer(model, lr).
"""

import torch
{"import torchao.optim" + chr(10) if setup.optimizer.library == "torchao" else ""}from torch import nn
from torch.distributed.fsdp import {", ".join(names)}'''


def _reshard_section(setup: TrainingSetup) -> str:
    if setup.sharding is Sharding.ZERO3:
        why = ("# zero3 (FSDP full shard): each block's parameters are gathered for its forward, freed right after\n"
               "# it and gathered again in backward, so whole parameters exist for one block at a time.")
    else:
        why = ("# zero2 (FSDP shard-grad-op): gathered parameters stay whole from forward to backward (no second\n"
               "# all-gather); gradients and optimizer states stay sharded.")
    return f"{why}\nRESHARD_AFTER_FORWARD = {setup.sharding is Sharding.ZERO3}"


_BLOCKS = '''
def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The nn.ModuleList holding the most parameters: the stack of transformer blocks."""
    candidates = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    if not candidates:
        raise ValueError("no nn.ModuleList of blocks in the model: pass them as shard_model(model, blocks=...)")
    return max(candidates, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))'''


def _precision_section(setup: TrainingSetup) -> str:
    precision = setup.precision
    if precision in (Precision.FP32, Precision.BF16):
        return ""
    dtype = "torch.float16" if precision is Precision.AMP_FP16 else "torch.bfloat16"
    why = {
        Precision.AMP_BF16: "# amp-bf16: sharded parameters stay fp32; FSDP casts the gathered copy to bf16 for\n"
                            "# compute (in place of torch.autocast) and reduces gradients in fp32.",
        Precision.BF16_MASTER: "# bf16-master: the fp32 sharded parameters are the master copy the optimizer steps;\n"
                               "# compute uses a bf16 gathered copy and gradients are reduced in fp32.",
        Precision.AMP_FP16: "# amp-fp16: fp32 sharded parameters, fp16 compute, fp32 gradient reduction; scale the\n"
                            "# loss with make_grad_scaler() (fp16 gradients underflow without it).",
    }[precision]
    text = f'''def mixed_precision_policy() -> MixedPrecisionPolicy:
    {why.replace(chr(10), chr(10) + "    ")}
    return MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32)'''
    if precision is Precision.AMP_FP16:
        text += '''


def make_grad_scaler():
    """Dynamic loss scaling for fp16; FSDP2's gradients are DTensors, which torch.amp.GradScaler unscales."""
    return torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu")'''
    return text


def _offload_section(setup: TrainingSetup) -> str:
    if setup.offload is not Offload.OPTIMIZER_AND_PARAMS:
        return ""
    return '''def offload_policy() -> CPUOffloadPolicy:
    # optimizer+params: parameter and gradient shards live in CPU RAM and the optimizer steps there; each block
    # is copied to the GPU for its forward/backward. Pinned memory makes the copies asynchronous, but pinning
    # needs an accelerator (it fails on a CPU-only build), so pin only where CUDA is present.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())'''


def _shard_section(setup: TrainingSetup) -> str:
    steps = ["    blocks = transformer_blocks(model) if blocks is None else blocks"]
    if setup.precision is Precision.BF16:
        steps.append("    # pure bf16: parameters, gradients and optimizer states all bf16, so cast before sharding.\n"
                     "    model.to(torch.bfloat16)")
    if setup.checkpointing is not Checkpointing.NONE:
        steps.append("    enable_checkpointing(model, blocks)")
    options = ['"reshard_after_forward": RESHARD_AFTER_FORWARD']
    if setup.dp_shard and setup.replicas > 1:
        steps.append(f"    # HSDP: shard within groups of {setup.shard_size} ranks, replicate across the {setup.replicas} "
                     "groups\n    # (a 2D mesh: fully_shard reduce-scatters in 'shard', all-reduces in 'replicate').\n"
                     "    from torch.distributed.device_mesh import init_device_mesh\n"
                     f"    mesh = init_device_mesh(\"cuda\", ({setup.replicas}, {setup.shard_size}), "
                     "mesh_dim_names=(\"replicate\", \"shard\"))")
        options.append('"mesh": mesh')
    if _precision_section(setup):
        options.append('"mp_policy": mixed_precision_policy()')
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        options.append('"offload_policy": offload_policy()')
    steps.append("    options = {\n" + "".join(f"        {option},\n" for option in options) + "    }")
    steps.append("    # One FSDP unit per block, so one block's parameters are gathered at a time; then the root,\n"
                 "    # which holds the rest (embeddings, final norm, head).\n"
                 "    for block in blocks:\n"
                 "        fully_shard(block, **options)\n"
                 "    fully_shard(model, **options)\n"
                 "    return model")
    body = "\n".join(steps)
    return f'''def shard_model(model: nn.Module, blocks: nn.ModuleList | None = None) -> nn.Module:
    """Apply FSDP2 per transformer block, then to the root. Build the optimizer afterwards (on the shards)."""
{body}'''


def _optimizer_section(setup: TrainingSetup) -> str:
    call, why = setup.optimizer.kind.call(), setup.optimizer.kind.summary
    return f'''def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The planned optimizer over the sharded parameters, so its states are sharded too."""
    # {setup.optimizer}: {why}.
    return {call}'''
