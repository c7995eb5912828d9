"""transformers.TrainingArguments kwargs and from_pretrained kwargs for a TrainingSetup. Checkpointing is spelled
for the installed transformers: `activation_checkpointing*` on 5.x (or when transformers is not installed),
`gradient_checkpointing*` on 4.x, which has no other name (`legacy_names` forces one or the other)."""

from __future__ import annotations

import sys

from ..setup import Attention, Checkpointing, Optimizer, Precision, TrainingSetup
from ..techniques import compile as compile_technique, loss as loss_technique
from ..techniques.base import FRAGMENTS
from ..libraries import dtype_keyword, legacy_checkpointing_names
from .apply_file import APPLY_FILE, apply_call
from .deepspeed import deepspeed_owns_optimizer
from .emitted import EmittedConfig, engine_work, uses_deepspeed, uses_fsdp

# TrainingArguments.optim names (transformers.training_args.OptimizerNames).
def hf_trainer_kwargs(setup: TrainingSetup, *, deepspeed_path: str = "deepspeed.json",
                      legacy_names: bool | None = None) -> dict:
    """Keyword arguments for `transformers.TrainingArguments` (output_dir and the schedule are yours to add)."""
    return _build(setup, deepspeed_path, legacy_names)[0]


def hf_model_kwargs(setup: TrainingSetup) -> dict:
    """Keyword arguments for the Auto class's `from_pretrained` (AutoModelForCausalLM, ... : ModelSpec.auto_class):
    what the Trainer cannot set on the model."""
    return _model_build(setup)[0]


def hf_trainer_file(setup: TrainingSetup, *, deepspeed_path: str = "deepspeed.json",
                    legacy_names: bool | None = None, filename: str = "training_args.json") -> EmittedConfig:
    content, comments, notes = _build(setup, deepspeed_path, legacy_names)
    summary = ("`TrainingArguments(output_dir=..., **json.load(f))`, or "
               "`HfArgumentParser(TrainingArguments).parse_json_file(...)`.")
    return EmittedConfig(filename, content, comments, tuple(notes), summary=summary,
                         unmarkable="TrainingArguments(**kwargs) refuses unknown keys")


def hf_model_file(setup: TrainingSetup, *, filename: str = "model_kwargs.json",
                  auto_class: str = "AutoModelForCausalLM") -> EmittedConfig:
    """`auto_class`: the transformers class that loads the model (ModelSpec.auto_class)."""
    content, comments = _model_build(setup)
    return EmittedConfig(filename, content, comments,
                         summary=f"`{auto_class}.from_pretrained(name, **json.load(f))`: what the Trainer "
                                 "cannot set on the model.",
                         unmarkable="from_pretrained hands unknown keys to the model's __init__, which refuses them")


def _build(setup: TrainingSetup, deepspeed_path: str,
           legacy_names: bool | None) -> tuple[dict, dict[str, str], list[str]]:
    if legacy_names is None:
        legacy_names = legacy_checkpointing_names()
    content = {"per_device_train_batch_size": setup.micro_batch_size,
               "gradient_accumulation_steps": setup.grad_accum_steps}
    comments = {"per_device_train_batch_size": "sequences per GPU per micro-step: the batch memfit's estimate used",
                "gradient_accumulation_steps": "micro-steps per optimizer step; keeps the effective batch at "
                                               f"{setup.effective_batch_size} sequences"}
    notes: list[str] = []
    for part in (_precision_part, *FRAGMENTS["hf_trainer"], _optimizer_part, _checkpointing_part,
                 loss_technique.hf_trainer_fragment, *FRAGMENTS["hf_trainer.memory"],
                 compile_technique.hf_trainer_fragment, _engine_part):
        part_content, part_comments, part_notes = part(setup, deepspeed_path=deepspeed_path,
                                                       legacy_names=legacy_names,
                                                       apply_line=apply_call(setup, APPLY_FILE))
        content.update(part_content)
        comments.update(part_comments)
        notes += part_notes
    return content, comments, notes


def _precision_part(setup: TrainingSetup, **_):
    precision, deepspeed = setup.precision, uses_deepspeed(setup)
    bf16 = precision in (Precision.AMP_BF16, Precision.BF16_MASTER) or (deepspeed and precision is Precision.BF16)
    content = {"bf16": bf16, "fp16": precision is Precision.AMP_FP16}
    if precision is Precision.BF16 and not deepspeed:
        bf16_reason = ("false: pure bf16 is not a TrainingArguments flag; the model is loaded in bf16 "
                       "(model_kwargs.json dtype) and trained as is, so grads and optimizer states are bf16 too")
    elif precision is Precision.BF16_MASTER and not deepspeed:
        bf16_reason = ("bf16 autocast over fp32 weights: without DeepSpeed the Trainer has no bf16-weights + fp32 "
                       "master mode; autocast holds the same 16 bytes per parameter with AdamW")
    elif deepspeed and precision in (Precision.BF16, Precision.BF16_MASTER):
        bf16_reason = "must equal deepspeed.json bf16.enabled (the Trainer checks); DeepSpeed does the casting"
    elif bf16:
        bf16_reason = "torch.autocast(bf16): fp32 weights, bf16 activations"
    else:
        bf16_reason = "off: the plan does not compute in bf16"
    fp16_reason = ("torch.autocast(fp16) with a GradScaler" if content["fp16"] else "off")
    return content, {"bf16": bf16_reason, "fp16": fp16_reason}, []


def _optimizer_part(setup: TrainingSetup, **_):
    optimizer = setup.optimizer
    notes: list[str] = []
    kind = optimizer.kind
    if kind.hf_optim is None:  # torchao AdamWFp8, torch Muon: no TrainingArguments name
        notes.append(kind.hf_note)
        return {"optim": "adamw_torch"}, {"optim": f"placeholder: {optimizer} is passed to the Trainer itself (see the notes)"}, \
            notes
    content: dict = {"optim": kind.hf_optim}
    if optimizer is Optimizer.ADAMW_4BIT:
        notes.append("The Trainer builds adamw_torch_4bit with block_size=256 (its optim_args default; torchao's "
                     "own is 128): 1/128 B/param less state than planned (one fp32 scale per 256 elements, not 128).")
    if uses_deepspeed(setup) and deepspeed_owns_optimizer(setup):
        reason = f"{optimizer}; deepspeed.json has an optimizer block, which the Trainer uses instead of this name"
    elif optimizer is Optimizer.ADAMW:
        reason = ("adamw_torch is AdamW with torch's default (foreach on CUDA); the planned single-tensor AdamW "
                  "has no optim name and adamw_torch ignores optim_args")
        notes.append("For the planned single-tensor AdamW pass Trainer(..., optimizer_cls_and_kwargs="
                     "(torch.optim.AdamW, {'lr': lr, 'foreach': False})); it overrides `optim`.")
    elif optimizer is Optimizer.SGD:
        content["optim_args"] = "momentum=0.9"
        reason = "torch.optim.SGD"
    else:
        reason = kind.summary
    comments = {"optim": reason}
    if "optim_args" in content:
        comments["optim_args"] = "SGD with momentum as planned (one state per parameter); torch's default is 0"
    return content, comments, notes


def _checkpointing_part(setup: TrainingSetup, *, legacy_names: bool, **_):
    if setup.checkpointing is Checkpointing.NONE:
        return {}, {}, []
    if setup.checkpointing is not Checkpointing.FULL:
        return {}, {}, [selective_checkpointing_note(setup)]
    name = "gradient_checkpointing" if legacy_names else "activation_checkpointing"
    other = ("activation_checkpointing on transformers 5.x" if legacy_names else
             "gradient_checkpointing on transformers 4.x")
    content = {name: True, f"{name}_kwargs": {"use_reentrant": False}}
    comments = {name: "recompute each transformer block in backward: activations kept only at block inputs "
                      f"(named for the installed transformers; {other})",
                f"{name}_kwargs": "non-reentrant torch.utils.checkpoint: works with frozen inputs and kwargs"}
    return content, comments, []


def selective_checkpointing_note(setup: TrainingSetup) -> str:
    """TrainingArguments cannot hold selective checkpointing: what to do instead (and torchtitan's spelling)."""
    mode = setup.checkpointing
    titan = {Checkpointing.SELECTIVE_OP: 'mode = "selective", selective_ac_option = "op"'}.get(
        mode, f'mode = "selective", selective_ac_option = "{mode.every}"' if mode.every else None)
    text = (f"checkpointing {mode}: TrainingArguments cannot express it (transformers' gradient_checkpointing / "
            "activation_checkpointing recompute whole blocks only), so training_args.json leaves checkpointing off "
            f"and memfit_apply.json holds it: call `{apply_call(setup, APPLY_FILE)}` on the loaded model before "
            "Trainer(...) (without it the step keeps every activation), or use the FSDP2 code memfit emits "
            "(fsdp2_shard.py, enable_checkpointing)")
    if titan:
        text += f"; torchtitan TOML: [activation_checkpoint] {titan}"
    elif mode is Checkpointing.ATTENTION:
        text += "; Megatron-LM: --recompute-granularity selective (core attention)"
    return text + "."


def trainer_cannot_express(setup: TrainingSetup) -> list[str]:
    """What the plan sized that neither TrainingArguments nor memfit_apply.json can carry (torchtune's chunked loss,
    the optimizer step in backward): the notes that say where it is expressed instead."""
    return loss_technique.hf_trainer_fragment(setup)[2]


def _engine_part(setup: TrainingSetup, *, deepspeed_path: str, **_):
    if uses_fsdp(setup) and setup.fsdp_version.is_fsdp1:
        zero3 = setup.sharding.stage == 3
        content = {"fsdp": "full_shard auto_wrap" if zero3 else "shard_grad_op auto_wrap",
                   "fsdp_config": {"version": 1, "use_orig_params": True, "limit_all_gathers": True,
                                   "backward_prefetch": "backward_pre",
                                   "cpu_offload": setup.offload.value == "optimizer+params"}}
        comments = {"fsdp": f"{setup.sharding} through torch FSDP1 (FullyShardedDataParallel, one flat parameter "
                            "per transformer block)",
                    "fsdp_config": "FSDP1 as sized (memfit.estimate.fsdp1): use_orig_params, two all-gathers in "
                                   "flight at most, the next block prefetched in backward; cpu_offload = flat "
                                   "shards, gradients and the step on the CPU"}
        return content, comments, []
    if uses_fsdp(setup):
        zero3 = setup.sharding.stage == 3
        content = {"fsdp": True,
                   "fsdp_config": {"version": 2, "reshard_after_forward": zero3,
                                   "cpu_offload": setup.offload.value == "optimizer+params"}}
        comments = {"fsdp": f"{setup.sharding} through torch FSDP2 (engine torch)",
                    "fsdp_config": "FSDP2; reshard_after_forward True = ZeRO-3, False = ZeRO-2; cpu_offload (the key "
                                   "TrainingArguments reads) = parameters, gradients and the step on the CPU"}
        return content, comments, []
    if not uses_deepspeed(setup):
        return {}, {}, []
    reason = (f"{engine_work(setup)} through DeepSpeed (chosen over FSDP2: it also expresses ZeRO-1, "
              "optimizer-only offload, sharded pure-bf16 states and 8-bit AdamW)")
    return {"deepspeed": deepspeed_path}, {"deepspeed": reason}, []


def _model_build(setup: TrainingSetup) -> tuple[dict, dict[str, str]]:
    content: dict = {"attn_implementation": setup.attention.value, "use_cache": False}
    comments = {"attn_implementation": ("SDPA: flash/memory-efficient kernel, no T x T scores kept"
                                        if setup.attention is Attention.SDPA else
                                        "eager: materialises the T x T scores per layer, as planned"),
                "use_cache": "no K/V cache during training: the output would keep every layer's K/V alive"}
    if setup.precision is Precision.BF16:
        key = dtype_keyword()
        content[key] = "bfloat16"
        comments[key] = ("pure bf16: weights (and so grads and optimizer states) in bf16 (the keyword the installed "
                         "transformers reads: dtype since 4.56, torch_dtype before)")
    return content, comments
