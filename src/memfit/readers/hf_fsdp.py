"""FSDP's side of the shared mapping (memfit.readers.hf): the Trainer's / accelerate's / axolotl's FSDP options
and an FSDP plan (stage, resharding, offload) -> TrainingSetup fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..setup import Checkpointing, Engine, FsdpVersion, Offload, Sharding
from ._reader import NOT_SIZED, Reader, _value

def read_fsdp(read: Reader, fsdp: Any, config: Any, world: int | None, *, key: str = "fsdp", shown: Any = None,
              offload_keys: tuple[str, ...] = ("cpu_offload",), trainer: bool = True,
              version: tuple[str, Any] | None = None) -> None:
    """FSDP from TrainingArguments' fsdp (True, or the legacy 'full_shard auto_wrap' string / list) and fsdp_config
    (keys with or without the fsdp_ prefix). `offload_keys`: the fsdp_config keys that turn CPU offload on for this
    reader (the HF Trainer reads cpu_offload; accelerate and axolotl offload_params)."""
    items = [] if fsdp is True else (fsdp.split() if isinstance(fsdp, str) else [str(_value(i)) for i in fsdp])
    items = [item.lower() for item in items]
    if shown is None:
        shown = fsdp if fsdp is True or isinstance(fsdp, str) else " ".join(items)
    cfg: dict[str, tuple[str, Any]] = {}
    if isinstance(config, Mapping):
        cfg = {(k[5:] if k.startswith("fsdp_") else k): (f"fsdp_config.{k}", v) for k, v in config.items()}
    elif config and read.strict:
        read.ignore("fsdp_config", config, f"an fsdp_config file is not read: {NOT_SIZED}")
    read.consume(key)
    base_key = key
    stage, raw = None, shown
    if "full_shard" in items or "hybrid_shard" in items:
        stage = 3
    elif "shard_grad_op" in items or "hybrid_shard_zero2" in items:
        stage = 2
    elif "no_shard" in items:
        stage = 0
    for name in ("reshard_after_forward", "sharding_strategy"):
        if name in cfg:
            key, raw = cfg[name]
            stage = _fsdp_stage(read, key, raw)
            break
    else:
        if stage is None and items:
            read.unmappable("sharding", key, shown, "no sharding strategy memfit sizes (full_shard, "
                                                    "shard_grad_op)")
            return
    if stage is None:
        if key != base_key:
            return
        stage = 3  # FSDP2 reshards after forward unless told otherwise
    offload = (base_key, shown) if "offload" in items else None
    for name in offload_keys:
        if name in cfg and _value(cfg[name][1]) in (True, "true", "True"):
            offload = cfg[name]
        elif name in cfg:
            read.consume(cfg[name][0])
    if trainer and "offload_params" in cfg:
        read.ignore(*cfg["offload_params"], "TrainingArguments reads fsdp_config cpu_offload, not offload_params: "
                                            "the Trainer does not offload with it")
    read_fsdp_plan(read, stage, key, raw, world, offload=offload, checkpointing=cfg.get("activation_checkpointing"),
                   version=version or cfg.get("version"), default_version=2 if trainer else 1)


def _fsdp_stage(read: Reader, key: str, raw: Any) -> int | None:
    value = _value(raw)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if isinstance(value, bool):
        return 3 if value else 2
    text = str(value).lower().replace("shardingstrategy.", "")
    stage = {"full_shard": 3, "hybrid_shard": 3, "1": 3, "4": 3, "shard_grad_op": 2, "hybrid_shard_zero2": 2,
             "2": 2, "5": 2, "no_shard": 0, "3": 0}.get(text)
    if stage is None:
        read.unmappable("sharding", key, raw, "memfit sizes FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (or true / "
                                              "false for FSDP2)")
    return stage


def read_fsdp_plan(read: Reader, stage: int, key: str, raw: Any, world: int | None, *,
                   offload: tuple[str, Any] | None = None, checkpointing: tuple[str, Any] | None = None,
                   version: tuple[str, Any] | None = None, default_version: int = 2) -> None:
    """FSDP as memfit's torch engine: full shard -> zero3, shard_grad_op / no reshard -> zero2, as FSDP1 (flat
    parameters, memfit.estimate.fsdp1) or FSDP2. `default_version`: the FSDP the framework runs when the config
    names none (transformers 5's Trainer: 2; accelerate's FSDP plugin and axolotl: 1)."""
    fsdp1 = str(_value(version[1]) if version is not None else default_version) == "1"
    sharded = world is None or world >= 2
    if fsdp1 and stage >= 2 and sharded:
        where = version or (key, raw)
        read.set("fsdp_version", FsdpVersion.V1, where[0], where[1],
                 "FSDP1 (FullyShardedDataParallel): one flat parameter per transformer block, padded to the ranks"
                 + ("" if version is not None else "; no fsdp_version given: the framework's default"))
    elif version is not None:
        read.consume(version[0])
    if stage == 0:
        if sharded:
            read.set("engine", Engine.TORCH, key, raw, "NO_SHARD: whole parameters on every GPU, as DDP")
        else:
            read.consume(key)
    elif not sharded:
        read.ignore(key, raw, f"FSDP over {world} GPU shards nothing: sized unsharded (give the GPU count, "
                              "--gpus N / num_gpus=)", text=f"fsdp={raw!r}: over {world} GPU it shards nothing")
    else:
        read.set("sharding", Sharding(f"zero{stage}"), key, raw)
        read.set("engine", Engine.TORCH, key, raw, "FSDP1" if fsdp1 else "FSDP2")
    if offload is not None:
        if stage == 3 and sharded:
            read.set("offload", Offload.OPTIMIZER_AND_PARAMS, offload[0], offload[1], (
                "FSDP1 CPUOffload(offload_params=True): flat shards, their gradients and the step on the host"
                if fsdp1 else "FSDP2 CPUOffloadPolicy: shards, gradients and the step on the host"))
        else:
            read.ignore(offload[0], offload[1], f"FSDP CPU offload without full sharding over 2+ GPUs: {NOT_SIZED}")
    if checkpointing is not None:
        if _value(checkpointing[1]) in (True, "true", "True"):
            read.set("checkpointing", Checkpointing.FULL, checkpointing[0], checkpointing[1], "FSDP's checkpointing")
        elif read.strict:
            read.consume(checkpointing[0])
