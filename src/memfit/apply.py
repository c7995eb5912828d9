"""apply_(): make a live model train the way a setup (or a Plan's final setup) says. The only in-process mutation in
memfit. Every item of the setup is reported as a Change: what was done, or why nothing was (already so, not
applicable, the caller's job) -- never silent.

What it changes on the model: gradient checkpointing (HF's switch, or torch.utils.checkpoint around the repeated
blocks of a plain module: memfit._torch.blocks, the one finder and wrapper, which the engines and the tracer use
too), the attention implementation (HF models), the parameter dtype (pure bf16 / back to fp32), torchao Float8Linear
for float8 training.
What it hands back for the training loop: `autocast()` for amp-*, `make_optimizer(model)`, the micro-batch size and
accumulation steps. Sharding and offload need an engine and are only reported.

torch is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from .change import Change
from .errors import ConfigError
from .setup import Checkpointing, Offload, Precision, Sharding, TrainingSetup

@dataclass(frozen=True)
class AppliedChanges:
    """What apply_ did to the model and what the training loop must do with the rest."""

    setup: TrainingSetup
    changes: tuple[Change, ...]
    autocast: Callable[[], contextlib.AbstractContextManager]
    """`with applied.autocast(): loss = ...` -- torch.autocast for amp-* precisions, a no-op otherwise."""

    @property
    def micro_batch_size(self) -> int:
        return self.setup.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.setup.grad_accum_steps

    @property
    def changed(self) -> tuple[str, ...]:
        """Names of the items that modified the model."""
        return tuple(c.name for c in self.changes if c.changed)

    def __getitem__(self, name: str) -> Change:
        for change in self.changes:
            if change.name == name:
                return change
        raise KeyError(name)

    def make_optimizer(self, model, *, lr: float | None = None):
        """The setup's optimizer over `model`'s trainable parameters (bf16-master: behind an fp32 master copy)."""
        from ._torch.step import make_optimizer

        return make_optimizer(model, self.setup, lr=lr)

    def summary(self) -> str:
        return "\n".join(str(change) for change in self.changes)


def apply_(model, plan_or_setup) -> AppliedChanges:
    """Change `model` (an HF PreTrainedModel or any nn.Module) in place to train as the setup says.

    `plan_or_setup`: a Plan (its final setup), a TrainingSetup (every item), or only some items: a mapping of
    setup fields ({'checkpointing': 'selective-op', 'activation_offload': True}) or the path of the
    memfit_apply.json `memfit plan --emit` writes for what TrainingArguments cannot express; then only those items
    are applied and the rest of the model is left as it is."""
    import torch

    from ._torch import step as torch_step

    setup, handlers = _what_to_apply(plan_or_setup)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"apply_ changes an nn.Module, got {type(model).__name__}")
    is_hf = torch_step.is_hf_model(model)
    changes = [handler(model, setup, is_hf) for handler in handlers]
    autocast = torch_step.autocast_factory(setup, torch_step.model_device(model).type)
    return AppliedChanges(setup, tuple(c for c in changes if c is not None), autocast)


# -------------------------------------------------------------------------------------------- one per setup item


def _precision(model, setup: TrainingSetup, is_hf: bool) -> Change:
    import torch

    if setup.finetune.adapters:
        from ._torch import lora as torch_lora

        return torch_lora.base_precision_change(model, setup)
    target = torch.bfloat16 if setup.precision.param_dtype == "bf16" else torch.float32
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    how = {
        Precision.AMP_BF16: "; wrap forward and loss in `applied.autocast()` (torch.autocast bf16)",
        Precision.AMP_FP16: "; wrap forward and loss in `applied.autocast()` (torch.autocast fp16) and scale the "
                            "loss with torch.amp.GradScaler",
        Precision.BF16_MASTER: "; `applied.make_optimizer` keeps the fp32 master copy",
    }.get(setup.precision, "")
    name = "bf16" if target is torch.bfloat16 else "fp32"
    if dtypes <= {target}:
        return Change("precision", False, f"parameters already {name} ({setup.precision}){how}")
    model.to(dtype=target)
    was = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return Change("precision", True, f"cast parameters {was} -> {name} ({setup.precision}){how}")


def _attention(model, setup: TrainingSetup, is_hf: bool) -> Change:
    want = str(setup.attention)
    if not is_hf:
        return Change("attention", False, "not applicable: a plain nn.Module attends however its code does "
                                          "(torch.nn.functional.scaled_dot_product_attention is the O(T) kernel)")
    current = getattr(model.config, "_attn_implementation", None)
    if current == want:
        return Change("attention", False, f"already {want}")
    try:
        model.set_attn_implementation(want)
    except (ValueError, ImportError) as error:
        return Change("attention", False, f"could not switch {current} -> {want}: {error}")
    now = getattr(model.config, "_attn_implementation", None)
    if now != want:
        return Change("attention", False, f"{type(model).__name__} kept {now}: it cannot switch to {want}")
    return Change("attention", True, f"switched {current} -> {want}")


def _checkpointing(model, setup: TrainingSetup, is_hf: bool) -> Change:
    from ._torch import blocks, step as torch_step

    mode = setup.checkpointing
    if mode not in (Checkpointing.NONE, Checkpointing.FULL):
        return _selective_checkpointing(model, setup, is_hf)
    want_on = setup.checkpointing is Checkpointing.FULL
    if is_hf:
        if not getattr(model, "supports_gradient_checkpointing", False):
            return Change("checkpointing", False, f"not applicable: {type(model).__name__} does not support it")
        is_on = torch_step.hf_checkpointing_is_on(model)
        if is_on == want_on:
            return Change("checkpointing", False, f"already {'on' if is_on else 'off'}")
        (torch_step.enable_hf_checkpointing if want_on else torch_step.disable_hf_checkpointing)(model)
        how = "on (HF activation checkpointing, use_reentrant=False)" if want_on else "off, as the setup asks"
        return Change("checkpointing", True, f"turned {how}")
    found = blocks.named_blocks(model)
    if not found:
        if not want_on:
            return Change("checkpointing", False, "already off")
        return Change("checkpointing", False, "not applicable: no repeated blocks found (an nn.ModuleList or "
                                              "nn.Sequential of 2+ modules of one class); wrap your blocks' forward "
                                              "in torch.utils.checkpoint.checkpoint yourself")
    where = ", ".join(f"'{name}'" for name in blocks.block_containers([name for name, _ in found]))
    block_list = [block for _, block in found]
    wrapped = sum(blocks.is_checkpointed(b) for b in block_list)
    if want_on and wrapped == len(block_list):
        return Change("checkpointing", False, f"already on ({wrapped} blocks of {where})")
    if not want_on and wrapped == 0:
        return Change("checkpointing", False, "already off")
    for block in block_list:
        (blocks.checkpoint_block if want_on else blocks.uncheckpoint_block)(block)
    verb = "wrapped" if want_on else "unwrapped"
    return Change("checkpointing", True, f"{verb} the {len(block_list)} blocks of {where} "
                                         "(torch.utils.checkpoint, non-reentrant)")


def _optimizer(model, setup: TrainingSetup, is_hf: bool) -> Change:
    detail = f"build it with applied.make_optimizer(model): {setup.optimizer.kind.describe()}"
    if setup.precision.master_weights:
        detail += " on an fp32 master copy of the bf16 parameters"
    if setup.optimizer.library in ("bitsandbytes", "torchao"):
        import importlib.util

        library = setup.optimizer.library
        if importlib.util.find_spec(library) is None:
            detail += f" -- {library} is not installed: pip install {library}"
    return Change("optimizer", False, detail)


def _batching(model, setup: TrainingSetup, is_hf: bool) -> Change:
    return Change("batching", False,
                  f"the data loader is yours: micro-batch {setup.micro_batch_size} x {setup.grad_accum_steps} "
                  f"accumulation steps = {setup.micro_batch_size * setup.grad_accum_steps} sequences per optimizer "
                  f"step (HF: per_device_train_batch_size={setup.micro_batch_size}, "
                  f"gradient_accumulation_steps={setup.grad_accum_steps}), sequences of {setup.seq_len} tokens")


def _engine(model, setup: TrainingSetup, is_hf: bool) -> Change | None:
    if setup.sharding is Sharding.NONE and setup.offload is Offload.NONE:
        return None
    parts = [f"{setup.sharding} over {setup.num_gpus} GPUs"] if setup.sharding is not Sharding.NONE else []
    parts += [f"offload {setup.offload}"] if setup.offload is not Offload.NONE else []
    return Change("engine", False, f"{' + '.join(parts)} needs an engine (DeepSpeed / FSDP): launch with the config "
                                   "memfit emits; apply_ changes this one process only")


def _finetune(model, setup: TrainingSetup, is_hf: bool) -> Change | None:
    """LoRA / QLoRA: the adapters injected in place (peft.inject_adapter_in_model, which freezes everything else),
    kept in fp32 as get_peft_model does by default; for QLoRA the base's Linears quantized in place to
    bitsandbytes 4-bit (or 8-bit) first, the rest upcast to fp32 (prepare_model_for_kbit_training) unless
    kbit_prep is False (the rest in the compute dtype)."""
    ft = setup.finetune
    if not ft.adapters:
        return None
    from ._torch import lora as torch_lora

    return Change("finetune", *torch_lora.apply_adapters(model, setup))


def _activation_offload(model, setup: TrainingSetup, is_hf: bool) -> Change | None:
    """torchtune's OffloadActivations hooks around every forward of the model (memfit._torch.offload_activations):
    for loops that call model(**batch), as the HF Trainer does. memfit's own loop wraps its forward itself."""
    if not setup.activation_offload:
        return None
    from ._torch import offload_activations

    if getattr(model, "_memfit_activation_offload", None) is not None:
        return Change("activation offload", False, "already installed")
    offload_activations.install(model)
    return Change("activation offload", True, "saved tensors of >= 1 KiB (parameters aside) go to pinned host RAM in "
                                              "forward and come back in backward; the LM head's and the loss's stay")


def _float8(model, setup: TrainingSetup, is_hf: bool) -> Change | None:
    """torchao float8 training: the convertible Linears swapped for Float8Linear (memfit._torch.float8), as
    torchtitan converts them, before checkpointing wraps the blocks."""
    if not setup.float8.is_on:
        return None
    from ._torch.float8 import apply_float8

    swapped = apply_float8(model, setup)
    if not swapped:
        return Change("float8", False, "no plain nn.Linear left to convert (already Float8Linear, or none)")
    return Change("float8", True, f"{swapped} Linears now torchao Float8Linear ({setup.float8}; the LM head and "
                                  "Linears with a dimension not a multiple of 16 stay as they were)")


_HANDLERS = (_precision, _finetune, _float8, _attention, _checkpointing, _optimizer, _batching, _engine,
             _activation_offload)
_ITEM_HANDLERS = {"checkpointing": _checkpointing, "activation_offload": _activation_offload}
"""The setup items apply_ takes alone (a mapping or memfit_apply.json): what only code can put on a model."""


def _what_to_apply(given) -> tuple[TrainingSetup, tuple]:
    """(setup, handlers): every handler for a Plan / TrainingSetup; the named items' for a mapping or a file."""
    import os
    from collections.abc import Mapping

    setup = getattr(given, "final_setup", given)
    if isinstance(setup, TrainingSetup):
        return setup, _HANDLERS
    if isinstance(given, (str, os.PathLike)):
        from .readers import read_config

        given = {name: value for name, value in read_config(given).overrides.items() if name != "num_gpus"}
    if not isinstance(given, Mapping):
        raise ConfigError(f"apply_ needs a TrainingSetup, a Plan, a mapping of setup items or the path of "
                          f"memfit_apply.json, got {type(given).__name__}")
    unknown = sorted(set(given) - set(_ITEM_HANDLERS))
    if unknown:
        raise ConfigError(f"apply_ takes {', '.join(_ITEM_HANDLERS)} alone, not {', '.join(unknown)}: pass the whole "
                          "TrainingSetup for the rest")
    return TrainingSetup(**given), tuple(h for name, h in _ITEM_HANDLERS.items() if name in given)


def _selective_checkpointing(model, setup: TrainingSetup, is_hf: bool) -> Change:
    """selective-op / every-N / attention through memfit's block wrapper (HF's switch is full only)."""
    from ._torch import blocks, step as torch_step

    found = blocks.named_blocks(model)
    if not found:
        return Change("checkpointing", False, "not applicable: no repeated blocks found (an nn.ModuleList or "
                                              "nn.Sequential of 2+ modules of one class)")
    block_list = [block for _, block in found]
    mode = str(setup.checkpointing)
    before = [(blocks.checkpoint_mode(b), blocks.is_core_checkpointed(b)) for b in block_list]
    hf_was_on = is_hf and torch_step.hf_checkpointing_is_on(model)
    done = torch_step.apply_selective_checkpointing(model, setup)
    after = [(blocks.checkpoint_mode(b), blocks.is_core_checkpointed(b)) for b in block_list]
    if not done:
        return Change("checkpointing", False, f"not applicable: checkpointing {mode} found no eager attention core "
                                              "to wrap (transformers' eager_attention_forward)")
    if before == after and not hf_was_on:
        return Change("checkpointing", False, f"already {mode} ({done})")
    where = ", ".join(f"'{name}'" for name in blocks.block_containers([name for name, _ in found]))
    return Change("checkpointing", True, f"checkpointing {mode}: {done} of {where}")
