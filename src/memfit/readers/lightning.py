"""Lightning's `precision=` (Trainer, Fabric, and the recipes built on Fabric such as LitGPT's) -> memfit's Precision.

What each plugin does to the step (lightning 2.6.6, lightning/fabric/connector.py `_check_and_init_precision` and
lightning/fabric/plugins/precision/*.py; the Trainer's plugins in lightning/pytorch/plugins/precision/ are the same
classes):

- "32-true" (and the legacy 32 / "32"): `Precision`, which changes nothing: the module keeps the dtype it was built
  in (fp32 unless the user built it otherwise), AdamW's states follow the parameters.
- "bf16-true" / "16-true": `HalfPrecision.convert_module` is `module.to(dtype)`, and `init_module()` builds the
  module in that dtype (`_DtypeContextManager`). The optimizer is made on the converted parameters, so torch's
  AdamW `zeros_like(param)` states are 16-bit too: every weight, gradient and state in bf16 is memfit's pure bf16
  (Precision.BF16), not bf16 with fp32 master weights. 16-true is the same step in fp16 with no loss scaling;
  memfit has no pure-fp16 precision and refuses it.
- "bf16-mixed" / "16-mixed" (legacy "bf16" / 16 / "16"): `MixedPrecision`: `torch.autocast` around the forward,
  fp32 parameters, gradients and states; 16-mixed adds a `torch.amp.GradScaler` (its scale and growth tracker are
  two scalars). On the CPU accelerator Lightning turns 16-mixed into bf16-mixed.
- "transformer-engine" / "transformer-engine-float16": `TransformerEnginePrecision` swaps every nn.Linear and
  LayerNorm for NVIDIA Transformer Engine's modules and runs them in FP8 with delayed scaling (its amax history
  and scales per module, its own workspaces). It needs CUDA and Transformer Engine, and memfit does not size it.
- "64-true": `DoublePrecision`, fp64 everything: not sized.

Checked on real CPU Fabric steps of a tiny Llama (tests/engines/test_lightning_precision.py): the profiler's peak of
each plugin's step is memfit's formula for the precision named here within 0.5%.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..setup import Precision
from ._reader import NOT_RELEVANT, NOT_SIZED, Reader, _positive
from .hf import read_fsdp_plan, read_zero

LEGACY = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's _PRECISION_INPUT_STR_ALIAS_CONVERSION: the old spellings (and the ints 64 / 32 / 16)."""

SIZED = {"32-true": Precision.FP32, "bf16-true": Precision.BF16, "bf16-mixed": Precision.AMP_BF16,
         "16-mixed": Precision.AMP_FP16}
"""Lightning precision -> memfit precision, for a module built in fp32 (Lightning's '32-true' keeps the module's own
dtype: a bf16-built module under '32-true' trains in pure bf16)."""

NOTES = {"32-true": "Lightning leaves the module's dtype as built",
         "bf16-true": "HalfPrecision: module.to(bfloat16); AdamW states bf16 too",
         "bf16-mixed": "MixedPrecision: autocast(bfloat16) over fp32 weights",
         "16-mixed": "MixedPrecision: autocast(float16) + GradScaler over fp32 weights"}

REFUSED = {
    "16-true": "16-true trains fp16 weights, gradients and AdamW states with no loss scaling, which memfit does not "
               "size: use bf16-true (the same bytes) or 16-mixed",
    "64-true": "64-true (fp64 everything) is not sized by memfit: use 32-true, bf16-true, bf16-mixed or 16-mixed",
    "transformer-engine": "transformer-engine swaps the Linears and LayerNorms for NVIDIA Transformer Engine's FP8 "
                          "modules (CUDA only, their own scaling state): memfit does not size it; use bf16-true or "
                          "bf16-mixed",
    "transformer-engine-float16": "transformer-engine-float16 swaps the Linears and LayerNorms for NVIDIA Transformer "
                                  "Engine's FP8 modules (CUDA only): memfit does not size it; use 16-mixed",
}


def canonical(raw: Any) -> str:
    """Lightning's own spelling of a precision value (its legacy aliases and ints resolved); '' when none."""
    if raw is None:
        return ""
    text = str(raw).strip().lower()
    return LEGACY.get(text, text)


def lightning_precision(raw: Any, module_dtype: str = "") -> Precision | str:
    """The memfit Precision Lightning's `precision=raw` trains in, or the one-line reason it is not sized.
    `module_dtype`: the dtype the module was built in ('' unknown: fp32, Lightning's default), which only
    '32-true' keeps."""
    text = canonical(raw)
    if text == "32-true" and module_dtype == "bf16":
        return Precision.BF16
    if text in SIZED:
        return SIZED[text]
    return REFUSED.get(text, f"not a Lightning precision: it takes {', '.join([*SIZED, *REFUSED])}")


def read_lightning_precision(read: Reader, raw: Any, key: str, module_dtype: str = "", note: str = "") -> None:
    """Set the precision Lightning's `key` (= raw) trains in; a value memfit does not size is unmappable (a one-line
    ConfigError when the reader is strict)."""
    found = lightning_precision(raw, module_dtype)
    if not isinstance(found, Precision):  # (a Precision is a str too)
        read.unmappable("precision", key, raw, found, fallback="precision not read")
        return
    text = canonical(raw)
    why = NOTES[text] if not (text == "32-true" and found is Precision.BF16) else "the module was built in bf16"
    read.set("precision", found, key, raw, "; ".join(filter(None, [why, note])))


# ------------------------------------------------------------------------------------ LightningCLI config (YAML)

CLI_TABLE = {"seed_everything": NOT_RELEVANT, "ckpt_path": f"{NOT_RELEVANT} (where training resumes from)",
             "model": "the LightningModule's own arguments: give MODEL", "data": f"{NOT_RELEVANT} (the DataModule)",
             "optimizer": f"{NOT_SIZED} (LightningCLI's optimizer block: give --optimizer)",
             "lr_scheduler": NOT_RELEVANT, "trainer.logger": NOT_RELEVANT, "trainer.callbacks": NOT_RELEVANT,
             "trainer.max_epochs": NOT_RELEVANT, "trainer.max_steps": NOT_RELEVANT,
             "trainer.gradient_clip_val": f"{NOT_RELEVANT} (clipping works in place)",
             "trainer.gradient_clip_algorithm": NOT_RELEVANT, "trainer.log_every_n_steps": NOT_RELEVANT,
             "trainer.val_check_interval": NOT_RELEVANT, "trainer.check_val_every_n_epoch": NOT_RELEVANT,
             "trainer.limit_": NOT_RELEVANT, "trainer.enable_": NOT_RELEVANT, "trainer.default_root_dir": NOT_RELEVANT,
             "trainer.accelerator": f"{NOT_RELEVANT} (memfit sizes the GPU given)", "trainer.benchmark": NOT_RELEVANT,
             "trainer.deterministic": NOT_RELEVANT, "trainer.num_sanity_val_steps": NOT_RELEVANT,
             "trainer.fast_dev_run": NOT_RELEVANT, "trainer.profiler": NOT_RELEVANT,
             "trainer.min_epochs": NOT_RELEVANT, "trainer.min_steps": NOT_RELEVANT, "trainer.max_time": NOT_RELEVANT}

_DEEPSPEED = {"deepspeed": (2, False), "deepspeed_stage_1": (1, False), "deepspeed_stage_2": (2, False),
              "deepspeed_stage_2_offload": (2, True), "deepspeed_stage_3": (3, False),
              "deepspeed_stage_3_offload": (3, True)}
"""lightning/pytorch/strategies/deepspeed.py register_strategies: name -> (ZeRO stage, offload_optimizer to cpu)
('deepspeed' alone: DeepSpeedStrategy()'s default stage 2)."""


def map_lightning_cli(read: Reader, data: dict, ctx: Any) -> None:
    """A LightningCLI config (`python main.py fit --config config.yaml`): its `trainer:` block, read as
    setup_from_lightning reads a live Trainer. The strategy decides how the precision plugin acts:
    DeepSpeedStrategy's DeepSpeedPrecision writes bf16-mixed / bf16-true as DeepSpeed's `bf16: {enabled: true}`
    (bf16 weights, an fp32 master copy in the optimizer: memfit's bf16-master)."""
    trainer = data.get("trainer")
    if not isinstance(trainer, Mapping):
        read.unmappable("precision", "trainer", trainer, "not a mapping of Trainer arguments")
        return
    with read.scope(read.file, "trainer."):
        devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
        world = None
        if devices in ("auto", -1, "-1") or isinstance(devices, (list, str)):
            read.ignore("devices", devices, "every GPU or a device list: give --gpus")
        elif _positive(devices) and _positive(nodes):
            world = devices * nodes
            if "devices" in trainer or "num_nodes" in trainer:
                read.set("num_gpus", world, "devices", devices, f"devices x num_nodes = {world}")
                read.consume("num_nodes")
                if nodes > 1 and "num_gpus" not in read.overridden:
                    read.num_nodes = nodes
        else:
            read.unmappable("num_gpus", "devices", devices, "not a positive whole number")
        strategy = str(trainer.get("strategy", "auto")).lower()
        precision = canonical(trainer.get("precision", "32-true"))
        if strategy in _DEEPSPEED:
            stage, offload = _DEEPSPEED[strategy]
            read_zero(read, stage, "cpu" if offload else "none", "cpu" if offload and stage == 3 else "none", world,
                      keys=("strategy", "strategy", "strategy"))
            if precision.startswith("bf16"):
                read.set("precision", Precision.BF16_MASTER, "precision", trainer.get("precision"),
                         "DeepSpeedPrecision: DeepSpeed bf16 (bf16 weights, fp32 master copy)")
            elif precision.startswith("16"):
                read.unmappable("precision", "precision", trainer.get("precision"), "DeepSpeed fp16 (loss-scaled, "
                                "fp32 master) is not sized by memfit: use bf16-mixed")
            else:
                read_lightning_precision(read, trainer.get("precision", "32-true"), "precision")
        else:
            if strategy in ("fsdp", "fsdp_cpu_offload"):  # FSDPStrategy: FULL_SHARD by default
                offload = ("strategy", trainer["strategy"]) if strategy == "fsdp_cpu_offload" else None
                read_fsdp_plan(read, 3, "strategy", trainer.get("strategy"), world, offload=offload)
            elif strategy not in ("auto", "ddp", "ddp_spawn", "ddp_find_unused_parameters_true", "single_device",
                                  "none"):
                read.unmappable("sharding", "strategy", trainer.get("strategy"), "memfit reads Lightning's auto, "
                                "ddp, fsdp and deepspeed_stage_* strategies")
            elif "strategy" in trainer:
                read.consume("strategy")
            if "precision" in trainer:
                read_lightning_precision(read, trainer["precision"], "precision")
        accum = trainer.get("accumulate_grad_batches")
        if accum is not None:
            if _positive(accum):
                read.set("grad_accum_steps", accum, "accumulate_grad_batches", accum)
            else:
                read.unmappable("grad_accum_steps", "accumulate_grad_batches", accum, "not a positive whole number")
