"""A LitGPT finetune config (`litgpt finetune_lora --config litgpt.yaml`; `finetune_full` for a full fine-tune) for
a setup sized with LitGPT's own model (model code litgpt).

The keys are the ones memfit.readers.litgpt reads (litgpt 0.5.13 finetune/lora.py and full.py `setup`, args.py
TrainArgs), and this module is that reader inverted: reading the written file back gives the setup that was
written (tests/emit/test_litgpt_emit.py), so what a key means is defined once, by the reader. A setting LitGPT's
scripts have no key for is a ConfigError naming it:

- gradient checkpointing is not a switch: on one device the scripts run Fabric's default strategy and checkpoint
  nothing; on more than one they wrap every block (finetune_lora's parallelize_fn, finetune_full's
  FSDPStrategy(activation_checkpointing_policy={Block})) and shard the model;
- no activation offloading, no CPU offload, no DoRA / rsLoRA / modules_to_save, no optimizer other than what
  `optimizer.class_path` can name (under --quantize only bitsandbytes' PagedAdamW, instantiate_bnb_optimizer).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, Method
from ..optimizers import config_class_names, kind_of
from ..readers.lightning import SIZED
from ..readers.litgpt import FLAG_DEFAULTS, LORA_FLAGS, NAMES, QUANTIZE
from ..setup import Attention, Checkpointing, Loss, Offload, Optimizer, TrainingSetup
from .emitted import EmittedConfig

FILENAME = "litgpt.yaml"
GPUS_PER_NODE = 8
LIGHTNING_PRECISION = {precision: name for name, precision in SIZED.items()}
"""memfit's precision -> the Lightning precision the reader maps to it (readers.lightning.SIZED inverted)."""
_QUANTIZE = {spec: name for name, spec in QUANTIZE.items()}
_ADAMW = {Optimizer.ADAMW_FOREACH: "AdamW", Optimizer.ADAMW: {"class_path": "torch.optim.AdamW",
                                                             "init_args": {"foreach": False}},
          Optimizer.ADAMW_FUSED: {"class_path": "torch.optim.AdamW", "init_args": {"fused": True}}}
"""AdamW as the reader tells its three kernels apart (LitGPT's default string 'AdamW' is foreach on CUDA)."""


def script(setup: TrainingSetup) -> str:
    """The LitGPT command that runs the setup."""
    return "finetune_full" if setup.finetune.method is Method.FULL else "finetune_lora"


def litgpt_config(setup: TrainingSetup, *, hub_id: str | None = None, model_type: str = "llama") -> dict[str, Any]:
    """The finetune config's keys for `setup` (`hub_id`: the checkpoint LitGPT downloads to checkpoints/<hub_id>;
    `model_type`: the Hugging Face model_type, for the LoRA flags' module names). ConfigError: a setting LitGPT's
    finetune scripts cannot run."""
    world = setup.num_gpus
    _refuse_what_litgpt_lacks(setup, world)
    config: dict[str, Any] = {}
    if hub_id:
        config["checkpoint_dir"] = f"checkpoints/{hub_id}"
    config["precision"] = _precision(setup)
    if setup.finetune.method is Method.QLORA:
        config["quantize"] = _quantize(setup, world)
    devices, nodes = (world, 1) if world <= GPUS_PER_NODE or world % GPUS_PER_NODE else (GPUS_PER_NODE,
                                                                                          world // GPUS_PER_NODE)
    config["devices"] = devices
    if nodes > 1:
        config["num_nodes"] = nodes
    if setup.finetune.adapters:
        config.update(_lora(setup, model_type))
    config["train"] = {"micro_batch_size": setup.micro_batch_size,
                       "global_batch_size": setup.micro_batch_size * setup.grad_accum_steps * world,
                       "max_seq_length": setup.seq_len}
    config["optimizer"] = _optimizer(setup)
    return config


def litgpt_file(setup: TrainingSetup, *, hub_id: str | None = None, model_type: str = "llama",
                filename: str = FILENAME) -> EmittedConfig:
    """litgpt.yaml: the config `litgpt <script> --config litgpt.yaml` runs, as sized."""
    content = litgpt_config(setup, hub_id=hub_id, model_type=model_type)
    comments = {"precision": "Lightning's precision plugin, as sized",
                "devices": ("more than one: the script shards the model (FSDP) and checkpoints every block"
                            if setup.num_gpus > 1 else "one device: no sharding, no checkpointing"),
                "train.global_batch_size": "micro-batch x accumulation x devices",
                "train.max_seq_length": "batches are padded to their longest sample, up to this"}
    if "quantize" in content:
        comments["quantize"] = "Lightning's BitsandbytesPrecision: the base Linears 4-bit, nothing upcast"
    notes = (f"run: litgpt {script(setup)} --config {filename} (add --data for your dataset)",)
    return EmittedConfig(filename, content, comments, notes,
                         summary=f"the config of `litgpt {script(setup)}`, as sized (LitGPT's own model)")


def _refuse_what_litgpt_lacks(setup: TrainingSetup, world: int) -> None:
    finetune = setup.finetune
    sections = [section.describe().lstrip(", ") or type(section).__name__ for section in setup.techniques]
    lacking = [(sections, ", ".join(sections)), (setup.offload is not Offload.NONE, "CPU offload"),
               (finetune.dora, "DoRA"), (finetune.rslora, "rsLoRA"), (finetune.modules_to_save, "modules_to_save"),
               (setup.optimizer_in_backward, "the optimizer step in backward"), (setup.compile, "torch.compile"),
               (setup.tp > 1 or setup.pp > 1 or setup.cp > 1, "tensor / pipeline / context "
                                                                             "parallelism"),
               (setup.loss is not Loss.STANDARD, "loss option (its loss is always computed in 128-token chunks)"),
               (setup.attention is not Attention.SDPA, f"{setup.attention} attention (its model calls SDPA)")]
    for on, what in lacking:
        if on:
            raise ConfigError(f"LitGPT's finetune scripts have no {what}")
    wanted = Checkpointing.FULL if world > 1 else Checkpointing.NONE
    if setup.checkpointing is not wanted:
        raise ConfigError(f"LitGPT's finetune scripts have no checkpointing switch: they checkpoint every block on "
                          f"more than one device and nothing on one, so checkpointing {setup.checkpointing} on "
                          f"{world} GPU{'s' if world > 1 else ''} cannot be written")


def _precision(setup: TrainingSetup) -> str:
    name = LIGHTNING_PRECISION.get(setup.precision)
    if name is None:
        raise ConfigError(f"LitGPT has no precision that trains as memfit's {setup.precision}")
    return name


def _quantize(setup: TrainingSetup, world: int) -> str:
    name = _QUANTIZE.get((setup.finetune.base_storage(setup.precision.compute_dtype), setup.finetune.double_quant))
    if name is None:
        raise ConfigError(f"LitGPT's --quantize has no {setup.finetune.base_storage(setup.precision.compute_dtype)} base")
    if not LIGHTNING_PRECISION[setup.precision].endswith("-true"):
        raise ConfigError("LitGPT refuses --quantize with a mixed precision: the base runs in the -true dtype")
    if world > 1:
        raise ConfigError("LitGPT refuses --quantize on more than one device")
    return name


def _lora(setup: TrainingSetup, model_type: str) -> dict[str, Any]:
    finetune = setup.finetune
    names, fused = NAMES.get(model_type, NAMES["llama"])
    if fused:
        names = {**names, **{flag: (fused,) for flag in ("lora_query", "lora_key", "lora_value")}}
    targets = set(finetune.targets)
    if not targets:  # peft's default for the architecture: query and value, LitGPT's defaults too
        flags = dict(FLAG_DEFAULTS)
    elif targets == {ALL_LINEAR}:
        flags = {flag: flag != "lora_head" for flag in LORA_FLAGS}
    else:
        flags = {flag: flag in names and set(names[flag]) <= targets for flag in LORA_FLAGS}
        covered = {name for flag, on in flags.items() if on for name in names.get(flag, ())}
        if covered != targets:
            raise ConfigError(f"LitGPT's LoRA flags adapt whole groups ({', '.join(LORA_FLAGS[:5])}): the targets "
                              f"{', '.join(sorted(targets - covered)) or 'asked'} are no such group")
    return {"lora_r": finetune.rank, "lora_alpha": finetune.alpha, "lora_dropout": finetune.dropout, **flags}


def _optimizer(setup: TrainingSetup) -> Any:
    if setup.finetune.method is Method.QLORA:
        if setup.optimizer is not Optimizer.PAGED_ADAMW:
            raise ConfigError(f"LitGPT's --quantize trains with bitsandbytes' PagedAdamW only, not {setup.optimizer}")
        return "AdamW"
    if setup.optimizer in _ADAMW:
        return _ADAMW[setup.optimizer]
    kind = kind_of(setup.optimizer)
    if kind.cls.lower() not in config_class_names():
        raise ConfigError(f"LitGPT's optimizer.class_path cannot name memfit's {setup.optimizer}")
    return {"class_path": kind.cls}
