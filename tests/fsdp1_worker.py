"""One rank of an FSDP1 job on gloo (run under torchrun by bench/fsdp1.py and tests/engines/test_fsdp1.py): for each
setup given, the tiny Llama (full fine-tune, or peft LoRA adapters), wrapped in torch's FullyShardedDataParallel the
way the frameworks do it (memfit._torch.fsdp1.wrap: the transformer block as the auto-wrap unit, peft's policy or the
blocks alone for LoRA), AdamW, a few real steps under memfit's PeakMeter. Writes OUT/<name>/rank<R>.json: each flat
parameter's local elements and bytes, the sharded gradients, the optimizer's state bytes, the peak, the losses."""

from __future__ import annotations

import contextlib
import sys

import torch
from torchrun_job import serve_setups, token_batches


def run(config: dict, setup, steps: int) -> dict:
    from memfit._torch import step as torch_step
    from memfit._torch.fsdp1 import wrap
    from memfit._torch.rank_memory import PeakMeter
    from memfit._torch.step import build_hf_model

    torch.manual_seed(0)
    batches = token_batches(config, setup, steps)
    with PeakMeter() as meter:
        model = build_hf_model(config, setup)
        wrapped = wrap(model, setup)
        optimizer = torch_step.make_optimizer(wrapped, _optimizer_setup(setup))
        hooks = torch_step.EngineHooks(autocast=True)  # accelerate and Lightning autocast over MixedPrecision
        offloaded = setup.offload.value != "none"
        losses = []
        with contextlib.nullcontext() if offloaded else meter.window():
            for index, batch in enumerate(batches):
                last = offloaded and index == len(batches) - 1
                with meter.window() if last else contextlib.nullcontext():
                    losses.append(torch_step.training_step(wrapped, optimizer, batch, setup, hooks=hooks))
        flat = [{"numel": p.numel(), "bytes": p.numel() * p.element_size(), "trainable": p.requires_grad,
                 "device": str(p.device)} for p in _flat_params(wrapped)]
        states = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    alive = [*wrapped.parameters(), *wrapped.buffers(),
             *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    meter.account_unseen_frees(alive)
    return {"flat": flat, "optimizer_bytes": states, "peak_bytes": meter.peak_bytes,
            "unseen_at_peak_bytes": meter.unseen_at_peak_bytes, "end_bytes": meter.end_bytes, "losses": losses}


def _optimizer_setup(setup):
    """FSDP1's sharded flat parameters are fp32 under MixedPrecision: the optimizer steps them directly."""
    return setup.replace(precision="fp32") if setup.precision.master_weights else setup


def _flat_params(model) -> list:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]


def run_or_say(config: dict, setup, steps: int) -> dict:
    """`run`, or the error it raised (each rank raises alike: a setup FSDP1 refuses fails on both at wrap time)."""
    try:
        return run(config, setup, steps)
    except Exception as error:  # noqa: BLE001 - reported per setup by the caller
        return {"error": f"{type(error).__name__}: {error}"}


if __name__ == "__main__":
    sys.exit(serve_setups(run_or_say, *sys.argv[1:]))
