"""The way out of a refusal that names another engine: a command memfit itself accepts, never a circle.

A refusal such as "use --engine torch" used to be a fixed sentence: the engine it named could refuse the same setup
for another reason and point back ("use --engine deepspeed"), and the user went round. Here the suggestion is built
by trying it: the setup on the other engine, then with the fewest changes that engine needs (FSDP2 offloads only
optimizer+params at zero3, over 2+ ranks; DeepSpeed's ZeRO-Offload of LoRA adapters is zero2 + offload optimizer),
and only a candidate that TrainingSetup accepts is named. tests/techniques/test_refusals.py reads every such suggestion back from the
message and checks the command it spells is accepted.
"""

from __future__ import annotations

import dataclasses
import threading

from .errors import ConfigError

_PROBING = threading.local()

_FLAGS = {"engine": "--engine", "sharding": "--zero", "offload": "--offload", "num_gpus": "--gpus"}
"""The CLI flag of each field a way out may change (memfit plan / estimate)."""


def _candidates(setup, engine, more_gpus: bool) -> list[dict]:
    from .setup import Engine, Offload, Sharding

    base = {"engine": engine}
    if engine is Engine.TORCH:
        extra = [{"sharding": Sharding.ZERO3}]
        if setup.offload is not Offload.NONE:
            extra.insert(0, {"offload": Offload.OPTIMIZER_AND_PARAMS, "sharding": Sharding.ZERO3})
        if setup.num_gpus == 1 and more_gpus:  # FSDP2 shards over 2+ ranks
            extra += [{**e, "num_gpus": 2} for e in extra]
    else:
        extra = [{"sharding": Sharding.ZERO2}]
        if setup.offload is not Offload.NONE:
            extra.insert(0, {"offload": Offload.OPTIMIZER, "sharding": Sharding.ZERO2})
    return [base, *({**base, **e} for e in extra)]


def checked(setup, **changes) -> str:
    """'--zero Y --offload Z' when `setup` with `changes` is accepted, else ''."""
    changes = {k: v for k, v in changes.items() if getattr(setup, k) != v or k == "engine"}
    if getattr(_PROBING, "on", False):
        return ""
    _PROBING.on = True
    try:
        dataclasses.replace(setup, **changes)
    except ConfigError:
        return ""
    finally:
        _PROBING.on = False
    return " ".join(f"{_FLAGS[k]} {v}" for k, v in changes.items())


def engine_way_out(setup, engine, *, more_gpus: bool = True) -> str:
    """'--engine X [--zero Y] [--offload Z] [--gpus 2]' for the first candidate on `engine` that is accepted, else
    ''; `more_gpus=False` where another way keeps the user's one GPU. Inside a probe (a candidate being validated)
    nothing is tried again: only whether it raises matters there."""
    return next((way for way in (checked(setup, **c) for c in _candidates(setup, engine, more_gpus)) if way), "")


def refusal(reason: str, *ways: str) -> str:
    """`reason`, then ': use A, or B' for the ways out that exist (a way is flags, or words for the user)."""
    ways = tuple(w for w in ways if w)
    return f"{reason}: use " + ", or ".join(ways) if ways else reason
