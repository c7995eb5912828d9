"""The setup a user means when they give only some fields: TrainingSetup's defaults (a typical fine-tune) for the
rest, the sequence clamped to the model's context, the world size from the hardware, and notes saying what was
assumed. One definition for the CLI, the config readers and the Python API (memfit.api re-exports it)."""

from __future__ import annotations

from typing import Any

from .derive.stacks_estimate import check_given
from .hardware import Hardware, check_precision
from .model_spec import ModelSpec
from .setup import Attention, Engine, Precision, TrainingSetup, needs_bf16

_ASSUMED_LABELS = (("micro_batch_size", "micro-batch"), ("seq_len", "seq"), ("grad_accum_steps", "accum"),
                   ("precision", "precision"), ("optimizer", "optimizer"), ("checkpointing", "checkpointing"),
                   ("attention", "attention"))


def typical_setup(spec: ModelSpec, hardware: Hardware, **given: Any) -> TrainingSetup:
    """The TrainingSetup with the fields the user `given` (None counts as not given), TrainingSetup()'s defaults (a
    typical fine-tune) for the rest, the default sequence clamped to the model's context and the world size taken
    from the hardware. On a GPU without bf16 (T4, V100) the default precision is amp-fp16, and a given bf16
    precision is a ConfigError. `notes` say what was assumed, so the output can state it."""
    given = {name: value for name, value in given.items() if value is not None}
    given = check_given(spec, given)  # decoder length, image size: refused where not taken
    if spec.finetune is not None and "finetune" not in given:
        given["finetune"] = spec.finetune  # a live LoRA model trains what it has
    defaults, notes = TrainingSetup(), []
    if "precision" in given:
        check_precision(given["precision"], hardware.gpu)
    elif needs_bf16(defaults.precision) and not hardware.gpu.bf16:
        defaults = defaults.replace(precision=Precision.AMP_FP16)
        notes.append(f"precision amp-fp16: {hardware.gpu.name} has no bf16, so fp16 autocast with loss scaling "
                     f"replaces the usual {TrainingSetup.precision}")
    if given.get("tp", 1) > 1 and "engine" not in given:
        given["engine"] = Engine.TORCH
        notes.append(f"engine torch: tensor parallelism (tp={given['tp']}) runs on torch DTensor, not DeepSpeed")
    for name, what in (("pp", "pipeline parallelism (torch.distributed.pipelining)"),
                       ("cp", "context parallelism (torch context_parallel ring attention)")):
        if given.get(name, 1) > 1 and "engine" not in given:
            given["engine"] = Engine.TORCH
            notes.append(f"engine torch: {what} with {name}={given[name]} runs on torch, not DeepSpeed")
    if "attention" not in given and spec.extra.get("supports_sdpa") is False:
        defaults = defaults.replace(attention=Attention.EAGER)
        notes.append(f"attention eager: transformers has no sdpa attention for {spec.model_type}")
    max_positions = spec.max_position_embeddings
    if "seq_len" not in given and 0 < max_positions < defaults.seq_len:
        notes.append(f"seq {max_positions}: the default {defaults.seq_len} clamped to the model's "
                     "max_position_embeddings")
    elif 0 < max_positions < given.get("seq_len", 0):
        notes.append(f"seq {given['seq_len']} is longer than the model's max_position_embeddings ({max_positions})")
    seq = given.get("seq_len", min(defaults.seq_len, max_positions or defaults.seq_len))
    assumed = [f"{label} {seq if name == 'seq_len' else getattr(defaults, name)}"
               for name, label in _ASSUMED_LABELS if name not in given]
    if assumed:
        notes.insert(0, "assumed: " + ", ".join(assumed) + " (a typical fine-tune; set them with options)")
    return TrainingSetup(**{"num_gpus": hardware.world_size, "precision": defaults.precision,
                            "attention": defaults.attention, **given,
                            "seq_len": seq}, notes=tuple(notes))
