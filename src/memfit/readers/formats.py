"""One mapper per config format: the file's memory-relevant fields -> TrainingSetup fields, through the shared
HF / DeepSpeed / FSDP mapping (memfit.readers.hf) wherever the project hands its settings to those engines. Every
field a mapper does not read is listed as ignored with the reason from the format's table (memfit.readers._mapper).

The mappers live one module per format family: training_args (TrainingArguments, DeepSpeed JSON), accelerate,
axolotl, llamafactory, torchtune, from_pretrained, lora (peft), litgpt, lightning and memfit_apply; MAPPERS below
registers them by the format name memfit.readers.files detects."""

from __future__ import annotations

from collections.abc import Callable

from . import lightning, litgpt, lora
from ._mapper import ConfigFile, Context, finish
from ._reader import Reader
from .accelerate import map_accelerate
from .axolotl import map_axolotl
from .from_pretrained import load_dtype, map_from_pretrained
from .hf import read_deepspeed_optimizer
from .llamafactory import map_llamafactory
from .memfit_apply import map_memfit_apply
from .torchtune import map_torchtune, torchtune_model
from .training_args import map_deepspeed, map_training_args


def map_peft(read: Reader, data: dict, ctx: Context) -> None:
    """peft's adapter_config.json, or the peft.json memfit writes."""
    lora.peft_finetune(read, data)
    finish(read, data, {**lora.PEFT_TABLE, **{"lora_config." + k: v for k, v in lora.PEFT_TABLE.items()}})


def map_litgpt(read: Reader, data: dict, ctx: Context) -> None:
    """LitGPT's finetune_lora / finetune_full YAML (memfit.readers.litgpt)."""
    litgpt.map_litgpt(read, data, ctx)
    finish(read, data, litgpt.TABLE)


def map_lightning_cli(read: Reader, data: dict, ctx: Context) -> None:
    """A LightningCLI config's trainer block (memfit.readers.lightning)."""
    lightning.map_lightning_cli(read, data, ctx)
    finish(read, data, lightning.CLI_TABLE)


MAPPERS: dict[str, Callable[[Reader, dict, Context], None]] = {
    "training_args": map_training_args, "deepspeed": map_deepspeed, "accelerate": map_accelerate,
    "axolotl": map_axolotl, "llamafactory": map_llamafactory, "torchtune": map_torchtune,
    "from_pretrained": map_from_pretrained, "peft": map_peft, "memfit_apply": map_memfit_apply,
    "litgpt": map_litgpt, "lightning_cli": map_lightning_cli,
}

__all__ = ["ConfigFile", "Context", "MAPPERS", "load_dtype", "read_deepspeed_optimizer", "torchtune_model"]
