"""The traces memfit.derive.stacks fits: at one shape, a copy with one block per stack and copies with one more
block in one stack, each run forward and backward (memfit's own step, no optimizer) on fake tensors under
memfit's StepTracker."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ModelSourceError
from ..setup import Checkpointing
from .fit import quiet_transformers
from .model import kind_setup
from .stacks import STACK_KEYS, VISION, copy_config, patch_size

_STATIC = ("PARAMETERS", "BUFFERS", "OPTIMIZER", "GATHERED")


def shape_setup(config: dict[str, Any], kind: str, shape: tuple[int, ...]):
    """The setup a kind is traced under, at `shape`."""
    base_kind, ckpt = kind.rsplit("/", 1)
    setup, kernels = kind_setup(base_kind)
    setup = setup.replace(checkpointing=Checkpointing.FULL if ckpt == "ckpt" else Checkpointing.NONE)
    if config["model_type"] in VISION:
        return setup.replace(micro_batch_size=shape[0], image_size=shape[1] * patch_size(config)), kernels
    return setup.replace(micro_batch_size=shape[0], seq_len=shape[1], target_len=shape[2]), kernels


def trace_copies(config: dict[str, Any], kind: str, shape: tuple[int, ...], models: dict | None = None) -> dict:
    """{"saved": {stack: bytes one more block keeps}, "grads": {stack: its gradient bytes}, "segments": the base
    copy's moments from its last block's forward end to the end of backward}. `models` keeps the copies built
    (on fake tensors) for the next shape: only a vision model's copies change with the shape (its image size)."""
    setup, kernels = shape_setup(config, kind, shape)
    stacks = [s for s, _ in STACK_KEYS[config["model_type"]]]
    base = {s: 1 for s in stacks}
    models = {} if models is None else models

    def built(layers: dict[str, int]):
        copied = copy_config(config, layers, shape)
        key = json.dumps(copied, sort_keys=True, default=str)
        if key not in models:
            models[key] = _build(copied, setup)
        return copied, models[key]

    run = _trace(*built(base), setup, kernels, stacks, timeline=True)
    saved, grads, second = {}, {}, {}
    checkpointed = kind.endswith("/ckpt")
    for stack in stacks:
        more = _trace(*built({**base, stack: 2}), setup, kernels, stacks, timeline=checkpointed)
        saved[stack] = more["forward_end"] - run["forward_end"]
        grads[stack] = more["block_params_bytes"][stack]
        if checkpointed:  # the backward of the stack's second block (the first one in forward)
            window = [seg for seg in more["segments"] if seg["stack"] == stack][-1]
            second[stack] = {"acts": window["acts"], "grads": window["grads"]}
    return {"saved": saved, "grads": grads, "segments": run["segments"], "second": second}


def _block_lists(model, stacks: list[str]) -> list[tuple[str, list]]:
    """The ModuleLists holding each stack's blocks, in forward (module) order."""
    from torch import nn

    found = [(name, list(module)) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) and any(True for _ in module[0].parameters())]
    found = [(name, mods) for name, mods in found  # outermost only (a T5 block holds a ModuleList of sub-layers)
             if not any(name.startswith(other + ".") for other, _ in found)]
    if len(found) != len(stacks):
        raise ModelSourceError(f"model_type '{model.config.model_type}': expected {len(stacks)} stacks of blocks, "
                               f"found {[n for n, _ in found]}; use `memfit trace` for this model")
    return found


def _build(config: dict[str, Any], setup):
    """A copy on fake tensors, and its fake mode (its batches are made in the same one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..trace.session import build_hf_model

    fake_mode = FakeTensorMode()
    with quiet_transformers(), fake_mode:
        return build_hf_model(config, setup, []), fake_mode


def _trace(config: dict[str, Any], built, setup, kernels: str, stacks: list[str], *, timeline: bool) -> dict:
    from .._torch import step as runner
    from ..trace.kernels import device_kernels, hidden_scratch
    from ..trace.session import make_hf_batch
    from ..trace.tracker import StepTracker, _Kind

    model, fake_mode = built
    for param in model.parameters():
        param.grad = None
    with fake_mode:
        batch = make_hf_batch(config, model, setup)
    tracker = StepTracker(num_steps=1, hidden_scratch=hidden_scratch(kernels))  # the trace's kernel model
    blocks = {id(block): stack for stack, (_, modules) in zip(stacks, _block_lists(model, stacks))
              for block in modules}
    events: dict[tuple[str, int], int] = {}
    handles = _block_hooks(model, blocks, tracker, events)
    try:
        tracker.watch_module(model)
        tracker.register_tree(batch, _Kind.INPUTS)
        with device_kernels(kernels), fake_mode, tracker:
            if timeline:
                runner.forward_backward(model, None, batch, setup.replace(grad_accum_steps=1),
                                        phase_callback=tracker.mark)
            else:  # a longer copy: only what forward leaves (its gradients are its block's parameter sizes)
                tracker.mark("forward")
                with runner.autocast_factory(setup, "cpu")():
                    loss = runner.setup_loss(setup)(model, batch)
                tracker.mark("backward")  # with the loss alive: its graph holds what backward would use
                del loss
    finally:
        for handle in handles:
            handle.remove()
    columns = (len(_Kind), tuple(k for k in range(len(_Kind)) if _Kind(k).name in _STATIC), int(_Kind.GRADIENTS))
    return _trace_result(model, stacks, tracker, blocks, events, columns, timeline=timeline)


def _block_hooks(model, blocks: dict[int, str], tracker, events: dict[tuple[str, int], int]) -> list:
    """Hooks on every block of `blocks` (module id -> stack) noting in `events` the tracker's event count where its
    forward ends ("forward") and its backward starts ("start": its output's gradient) and ends ("end": its input's);
    the handles to remove."""
    import torch

    def hidden(args, kwargs):
        found = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        return found if isinstance(found, torch.Tensor) else None

    def note(key):
        return lambda _grad: events.setdefault(key, tracker.events) and None

    def block_in(module, args, kwargs):
        x = hidden(args, kwargs)
        if x is not None and x.requires_grad:
            x.register_hook(note(("end", id(module))))

    def block_out(module, _args, _kwargs, output):
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
        events.setdefault(("forward", id(module)), tracker.events)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(note(("start", id(module))))

    handles = []
    for module in model.modules():
        if id(module) in blocks:
            handles += [module.register_forward_pre_hook(block_in, with_kwargs=True),
                        module.register_forward_hook(block_out, with_kwargs=True)]
    return handles


def _trace_result(model, stacks: list[str], tracker, blocks: dict[int, str], events: dict,
                  columns: tuple[int, tuple[int, ...], int], *, timeline: bool) -> dict:
    """_trace's answer from the tracker's history: the activations at forward end, the gradients at the end, each
    stack's last block's parameter bytes and, with `timeline`, each block's backward segments. `columns`: how many
    kinds the tracker's history rows hold, those that are static, and the gradients' one."""
    history = tracker._history
    kinds, static, grads_kind = columns

    def at(index: int) -> tuple[int, int]:
        row = history[index - 1] if index > 0 else (0,) * kinds
        acts = sum(v for k, v in enumerate(row) if k not in static and k != grads_kind)
        return acts, row[grads_kind]

    backward_at = next(e for e, _s, phase in tracker.marks if str(getattr(phase, "value", phase)) == "backward")
    out = {"forward_end": at(backward_at)[0], "grads_end": at(tracker.events)[1],
           # a gradient per parameter of the stack's last block, in the parameter's dtype (torch autograd)
           "block_params_bytes": {stack: sum(p.numel() * p.element_size() for p in modules[-1].parameters())
                                  for stack, (_, modules) in zip(stacks, _block_lists(model, stacks))}}
    if timeline:
        out["segments"] = _segments(blocks, events, backward_at, tracker.events, at)
    return out


def _segments(blocks: dict[int, str], events: dict, backward_at: int, end: int, at) -> list[dict[str, Any]]:
    """Moments from the last block's forward end to the end of backward, cut at each block's backward start and
    end (in the order backward runs them); each segment names the blocks done before it and the one running."""
    ids = list(blocks)
    if any(("start", i) not in events or ("end", i) not in events for i in ids):
        raise ModelSourceError("the backward of a block could not be located; use `memfit trace` for this model")
    order = sorted(ids, key=lambda i: events[("start", i)])
    cuts = [(max(events[("forward", i)] for i in ids), backward_at, None, "forward")]
    position = backward_at
    done: list[str] = []
    for i in order:
        cuts.append((position, events[("start", i)], None, "backward"))
        cuts.append((events[("start", i)], events[("end", i)] + 1, i, "backward"))
        position = events[("end", i)] + 1
    cuts.append((position, end + 1, None, "backward"))
    segments = []
    for lo, hi, current, phase in cuts:
        points = [at(k) for k in range(max(lo, 1), max(hi, lo + 1))] or [at(lo)]
        segments.append({"stack": blocks[current] if current is not None else None, "phase": phase,
                         "done": list(done), "acts": [a for a, _ in points], "grads": [g for _, g in points]})
        if current is not None:
            done.append(blocks[current])
    return segments
