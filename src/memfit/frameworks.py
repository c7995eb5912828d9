"""The framework a setup runs in, as the ladder speaks to its user: a rung is taken only where that framework can
make the change, the setup it sizes is the one the framework then runs, and its `change` line is the framework's own
config keys rather than TrainingArguments.

Today that is LitGPT (a setup with model code litgpt, which `--config` gives for a LitGPT finetune YAML): its
finetune scripts have no checkpointing switch on one device, no activation or CPU offload, and run QLoRA only in a
`-true` precision on one device. The test of a rung is the round trip of memfit.emit.litgpt: the rung's setup is
written as LitGPT's config and read back by memfit.readers.litgpt; a field the rung changes that the config does not
carry is a change LitGPT cannot make, and the fields read back (its k-bit preparation, adapter dtype, sharding) are
what LitGPT runs. A setup LitGPT cannot run to begin with (the user asked for something it has no key for) is left
to the general ladder."""

from __future__ import annotations

from typing import Any

from .emit.litgpt import litgpt_config, script
from .errors import ConfigError
from .readers import InMemory, read_config
from .finetune import Method
from .model_spec import ModelSpec
from .optimizers import kind_of
from .setup import Checkpointing, ModelCode, Optimizer, Precision, TrainingSetup, setup_changes
from .techniques.base import Context, Proposal, Skip
from .techniques.lora import UPCAST_NOTE


def speak(ctx: Context, result: Proposal | Skip) -> Proposal | Skip:
    """The rung's proposal in the setup's framework: passed over when the framework cannot make it, else its
    setup as the framework runs it and its change in the framework's keys."""
    if isinstance(result, Skip) or not _litgpt_run(ctx.setup):
        return result
    before = _litgpt(ctx.spec, ctx.setup)
    if before is None:
        return result
    proposed = _forced(result.setup)
    try:
        after = _litgpt(ctx.spec, proposed, strict=True)
    except ConfigError as error:
        return Skip(str(error))
    overrides = read_config(InMemory("litgpt.yaml", after), num_gpus=proposed.num_gpus).overrides
    carried = set(overrides) | {"num_gpus"}
    missing = [c for c in setup_changes(ctx.setup, result.setup) if c.field not in carried]
    if missing:
        return Skip(f"LitGPT's finetune config has no key for {', '.join(c.label for c in missing)}")
    runs = proposed.replace(**overrides)
    why = result.why
    if not runs.finetune.upcasts_unquantized():  # LitGPT calls no prepare_model_for_kbit_training
        why = why.replace(UPCAST_NOTE, " (in the compute dtype: LitGPT upcasts nothing)")
    return Proposal(runs, _change(runs, before, after), result.cost, why)


def runs_as(spec: ModelSpec, setup: TrainingSetup) -> TrainingSetup:
    """The setup as the framework runs it (LitGPT on more GPUs: every block checkpointed, the model sharded, as its
    multi-device strategies do); `setup` itself where the framework cannot run it or it has none."""
    if not _litgpt_run(setup):
        return setup
    forced = _forced(setup)
    config = _litgpt(spec, forced)
    if config is None:
        return setup
    return forced.replace(**read_config(InMemory("litgpt.yaml", config), num_gpus=forced.num_gpus).overrides)


def cannot(spec: ModelSpec, setup: TrainingSetup, **changes: Any) -> str | None:
    """Why the setup's framework cannot run `setup` with `changes` (None: it can, or memfit speaks no framework
    for the setup)."""
    if not _litgpt_run(setup):
        return None
    try:
        _litgpt(spec, _forced(setup.replace(**changes)), strict=True)
    except ConfigError as error:
        return str(error)
    return None


def _litgpt_run(setup: TrainingSetup) -> bool:
    return setup.model_code is ModelCode.LITGPT


def _forced(setup: TrainingSetup) -> TrainingSetup:
    """What LitGPT's scripts impose whatever the config says: every block checkpointed on more than one device;
    under --quantize the `-true` dtype and bitsandbytes' PagedAdamW for an AdamW (finetune/lora.py setup,
    utils.instantiate_bnb_optimizer)."""
    changes: dict[str, Any] = {}
    if setup.num_gpus > 1:
        changes["checkpointing"] = Checkpointing.FULL
    if setup.finetune.method is Method.QLORA:
        if setup.precision in (Precision.AMP_BF16, Precision.AMP_FP16):
            changes["precision"] = Precision.BF16
        if kind_of(setup.optimizer).torch_adam:
            changes["optimizer"] = Optimizer.PAGED_ADAMW
    return setup.replace(**changes) if changes else setup


def _litgpt(spec: ModelSpec, setup: TrainingSetup, *, strict: bool = False) -> dict[str, Any] | None:
    try:
        return litgpt_config(setup, hub_id=spec.extra.get("hub_id"), model_type=spec.model_type)
    except ConfigError:
        if strict:
            raise
        return None


def _change(setup: TrainingSetup, before: dict[str, Any], after: dict[str, Any]) -> str:
    old, new = _flat(before), _flat(after)
    keys = [f"{key}: {value}" for key, value in new.items() if old.get(key) != value]
    keys += [f"{key}: (remove)" for key in old if key not in new]
    return f"litgpt {script(setup)} config: " + ", ".join(keys)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and key != "optimizer":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
