"""The device side of a step: what a CUDA GPU needs beyond the tensor terms, as three labelled figures.

- allocated (`torch.cuda.max_memory_allocated`): the tensor terms + the caching allocator's rounding (each request
  rounded to 512 B; a large-pool block is handed out whole when the rest would be 1 MiB or less) + the cuBLAS
  workspaces PyTorch allocates through the allocator;
- reserved (`torch.cuda.max_memory_reserved`): + the segments the allocator holds but no tensor uses at its peak
  (fragmentation and cache), from a replay of the step's allocations through the allocator's rules
  (memfit.estimate.allocator);
- device used (nvidia-smi / NVML): + what lives outside the allocator: the CUDA context, NCCL's buffers.

A trace gives the replay the step's real event stream (StepTracker.allocation_events). The formulas have none, so
`formula_stream` builds a representative one from the estimate's terms and the model's tensor shapes: parameters
tensor by tensor, each block's saved tensors allocated in forward and freed in reverse in backward while its
gradients appear, the optimizer's states and temporaries; two steps, so the second runs on the first one's cache.
Only the overheads (rounding, cache) are taken from the replay, and added to the formulas' exact tensor peak. Blocks
repeat, so the replay runs on a few blocks and the overheads are extended linearly to the model's depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Protocol

from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Checkpointing, Optimizer, TrainingSetup
from . import allocator as alloc
from .result import Category, Term
from .terms import TermKey



class HostMoves(Protocol):
    """What a technique moves off the device per micro-step (memfit.fields.TechniqueSection.host_activations): the
    device storages that leave for the host in forward, and one block's brought back for its backward."""

    offloaded_bytes: int
    in_flight_bytes: int

ROUNDING = TermKey.ALLOCATOR_ROUNDING
WORKSPACE = TermKey.CUBLAS_WORKSPACE
RESERVE = TermKey.ALLOCATOR_RESERVE
CONTEXT = TermKey.CUDA_CONTEXT
NCCL = TermKey.NCCL
SAMPLE_BLOCKS = 4
"""Blocks the formula stream replays; the overheads are scaled to the whole model by its tensor peak."""


@dataclass(frozen=True)
class DeviceReplay:
    """What the allocator replay found, for notes and tests."""

    rounding_bytes: int
    reserve_bytes: int
    limit_reserve: Callable[[], int]
    """The least reserve the step runs with when the device is full (allocator.least_capacity - peak allocated),
    computed on first call and cached: the search replays the stream a dozen times, and only a verdict near the
    limit asks for it (memfit.diagnose)."""
    stream: str
    """'trace' (the step's real events) or 'formulas' (the representative stream)."""
    config: str


def runtime_overhead_terms(tensor_peak: int, setup: TrainingSetup, hardware: Hardware, *,
                           spec: ModelSpec | None = None, terms: Sequence[Term] = (),
                           events: Sequence[tuple[object, int]] | None = None,
                           offload: "HostMoves | None" = None) -> list[Term]:
    """The terms that turn a tensor peak into the three device figures (empty on a CPU device).

    `events`: a traced step's allocation stream (StepTracker.allocation_events). Else `spec` and the peak's `terms`
    build the formulas' representative stream. With neither, only the peak itself is replayed (one block: the
    rounding of one request, no fragmentation) and the reserve term says so. `offload`: what a technique moves
    to the host (HostMoves: activation offloading's), for the device buffers it allocates on the way."""
    if hardware.is_cpu:
        return []
    constants = hardware.device
    workspaces = constants.cublas_workspaces * constants.cublas_workspace_bytes
    replay = device_replay(tensor_peak, setup, hardware, spec=spec, terms=terms, events=events, offload=offload)
    out = []
    if workspaces:
        out.append(Term(WORKSPACE, Category.OVERHEAD, workspaces,
                        f"{constants.cublas_workspaces} x {constants.cublas_workspace_bytes / 2**20:.3g} MiB cuBLAS "
                        "workspaces, allocated through the caching allocator (counted in max_memory_allocated)",
                        constants.cublas_source, figure="allocated"))
    if replay.rounding_bytes:
        out.append(Term(ROUNDING, Category.OVERHEAD, replay.rounding_bytes,
                        "block sizes beyond the requests at the allocated peak: 512 B rounding, large blocks handed "
                        f"out whole when the rest is <= 1 MiB ({replay.stream} stream replayed)",
                        alloc.SOURCE, figure="allocated"))
    reserve_formula = (f"max_memory_reserved - max_memory_allocated of the {replay.stream} stream replayed through "
                       f"the caching allocator ({replay.config}): segments cached but unused at the peak")
    if replay.stream == "peak only":
        reserve_formula += "; no event stream was given, so fragmentation is not modelled"
    out.append(Term(RESERVE, Category.OVERHEAD, replay.reserve_bytes, reserve_formula, alloc.SOURCE,
                    figure="reserved", at_limit=_capped(replay.limit_reserve, replay.reserve_bytes)))
    if constants.cuda_context_bytes:
        out.append(Term(CONTEXT, Category.OVERHEAD, constants.cuda_context_bytes,
                        f"CUDA context, {hardware.cuda_runtime} module loading (outside PyTorch's allocator)",
                        constants.cuda_context_source, figure="outside"))
    if setup.num_gpus > 1 and constants.nccl_bytes_per_communicator:
        count = hardware.nccl_communicators
        out.append(Term(NCCL, Category.OVERHEAD, count * constants.nccl_bytes_per_communicator,
                        f"{count} communicator(s) x {constants.nccl_formula}", constants.nccl_source,
                        figure="outside"))
    return out


def device_replay(tensor_peak: int, setup: TrainingSetup, hardware: Hardware, *, spec: ModelSpec | None = None,
                  terms: Sequence[Term] = (), events: Sequence[tuple[object, int]] | None = None,
                  offload: "HostMoves | None" = None) -> DeviceReplay:
    constants = hardware.device
    workspace = constants.cublas_workspace_bytes
    workspaces = (workspace,) * constants.cublas_workspaces
    config = hardware.allocator
    if events is not None:
        stream = [(("ws", i), size) for i, size in enumerate(workspaces)] + list(events)
        result = alloc.replay(stream, config)
        return DeviceReplay(max(0, result.peak_allocated - result.peak_requested),
                            max(0, result.peak_reserved - result.peak_allocated),
                            _least_reserve(stream, config, result.peak_allocated), "trace", config.describe())
    if spec is None or not terms or not spec.params:
        stream = [(i, s) for i, s in enumerate((*workspaces, tensor_peak)) if s]
        result = alloc.replay(stream, config)
        return DeviceReplay(result.peak_allocated - result.peak_requested,
                            result.peak_reserved - result.peak_allocated,
                            _least_reserve(stream, config, result.peak_allocated), "peak only",
                            config.describe())
    shape = _shape(spec, setup, terms, workspaces, offload)
    rounding, reserve, limit = _extended(shape, config, spec.num_layers, tensor_peak)
    return DeviceReplay(rounding, reserve, limit, "formulas", config.describe())


def _least_reserve(stream: list, config: alloc.AllocatorConfig, peak_allocated: int) -> Callable[[], int]:
    """The least reserve at the limit of `stream`, searched on first call."""
    return cache(lambda: max(0, alloc.least_capacity(stream, config) - peak_allocated))


def _capped(limit: Callable[[], int], reserve: int) -> Callable[[], int]:
    return cache(lambda: min(limit(), reserve))


# ------------------------------------------------------------------------------------------ the formula stream


@dataclass(frozen=True)
class _Shape:
    """Everything the representative stream is built from, hashable (replays are cached on it)."""

    root_params: tuple[int, ...]
    block_params: tuple[int, ...]
    param_scale: float
    grad_scale: float
    state_tensors: int
    state_scale: float
    saved_per_block: tuple[int, ...]
    block_temps: tuple[int, ...]
    recompute: tuple[int, ...]
    head_saved: tuple[int, ...]
    """Freed by the loss's backward."""
    root_saved: tuple[int, ...]
    """Freed at the end of backward (embeddings)."""
    loss_temps: tuple[int, ...]
    gathered_root: int
    gathered_block: int
    step_temps: tuple[int, ...]
    step_temp_per_param: bool
    early_grads: bool
    workspaces: tuple[int, ...]
    frozen_root: tuple[int, ...] = ()
    """Frozen parameters (a LoRA base) outside the blocks, in bytes: allocated once, no gradients or states."""
    frozen_block: tuple[int, ...] = ()
    """One block's frozen parameters, in bytes."""
    offloaded_per_block: tuple[int, ...] = ()
    """Activation offload: one block's saved tensors, created on the device in forward and freed once copied to
    pinned host RAM (the host copies are not device memory: they take no segment)."""
    in_flight: tuple[int, ...] = ()
    """Activation offload: one block's saved tensors, copied back into new device buffers for its backward."""


def _units(total: int, unit: int, cap: int = 16) -> list[int]:
    """`total` bytes as tensors of `unit` bytes (at most `cap` of them) and one remainder."""
    if total <= 0:
        return []
    if unit <= 0:
        return [total]
    count = min(total // unit, cap)
    rest = total - count * unit
    return [unit] * count + ([rest] if rest else [])


def _split_by_block(sizes: list[tuple[int, int]], layers: int) -> tuple[list[int], list[int]]:
    """(size, count) of each tensor as (one block's sizes, the root's sizes): a tensor repeated a multiple of
    `layers` times is a block's."""
    block, root = [], []
    for size, count in sizes:
        if count >= layers and count % layers == 0:
            block += [size] * (count // layers)
        else:
            root += [size] * count
    return block, root


def _shape(spec: ModelSpec, setup: TrainingSetup, terms: Sequence[Term], workspaces: tuple[int, ...],
           offload: "HostMoves | None" = None) -> _Shape:
    by = {t.name: t.num_bytes for t in terms}
    layers = max(spec.num_layers, 1)
    tokens = setup.tokens_per_micro_step
    compute = setup.precision.compute_bytes
    unit_h = tokens * spec.hidden_size * compute
    unit_i = tokens * max(spec.intermediate_size, spec.hidden_size) * compute
    block, root = _split_by_block([(p.numel, p.count) for p in spec.params], layers)
    frozen_block, frozen_root = _split_by_block(
        [(p.total_bytes(compute) // max(p.count, 1), p.count) for p in spec.frozen], layers)
    numel = max(spec.num_params, 1)
    params = by.get(TermKey.PARAMETERS, 0)
    grads = by.get(TermKey.GRADIENTS, 0)
    states = by.get(TermKey.STATES, 0)
    # FSDP2 / ZeRO-3 shard every tensor: the per-tensor sizes scale with the per-rank bytes
    per_elem_state = states / numel
    state_tensors = 0 if not states else max(1, round(per_elem_state / 4))
    saved = 0
    for name in (TermKey.ATTENTION, TermKey.MLP, TermKey.NORMS, TermKey.CHECKPOINTS):
        saved += by.get(name, 0)
    per_block = saved // layers
    mlp = by.get(TermKey.MLP, 0) // layers
    saved_tensors = _units(mlp, unit_i) + _units(per_block - mlp, unit_h)
    copies = by.get(TermKey.AUTOCAST_WEIGHT_COPIES, 0)
    if copies and block:  # autocast caches one low-precision copy per Linear weight, block by block
        per_elem = copies / max(sum(root) + sum(block), 1)
        saved_tensors += [int(n * per_elem) for n in block]
        copies -= int(sum(block) * per_elem) * layers
    temps = by.get(TermKey.LAYER_BACKWARD, 0)
    block_temps = _units(min(temps, 2 * unit_h), unit_h) + _units(max(0, temps - 2 * unit_h), unit_i, cap=4)
    recompute = _units(by.get(TermKey.RECOMPUTED_BLOCK, 0), unit_h) if (
        setup.checkpointing.is_on) else []
    head = [by.get(n, 0) for n in (TermKey.LOGITS, TermKey.LOSS, TermKey.HEAD,
                                   TermKey.LOGIT_SOFTCAP) if by.get(n)] + ([copies] if copies > 0 else [])
    root_saved = [by.get(TermKey.EMBEDDINGS, 0)] if by.get(TermKey.EMBEDDINGS) else []
    loss_backward = by.get(TermKey.LOSS_BACKWARD, 0)  # the gradients of log-softmax and of the logits
    loss_temps = [loss_backward // 2, loss_backward - loss_backward // 2] if loss_backward else []
    loss_temps += [by[TermKey.LOGITS_FP32]] if by.get(TermKey.LOGITS_FP32) else []
    gathered = by.get(TermKey.GATHERED, 0)
    block_numel = sum(block)
    gathered_block = 0
    gathered_root = 0
    if gathered and block_numel:
        per_elem = gathered / max(sum(root) + block_numel, 1)
        gathered_block = int(block_numel * per_elem)
        gathered_root = max(0, gathered - gathered_block)
    step = by.get(TermKey.OPTIMIZER_STEP, 0) + by.get(TermKey.MASTER_GRADIENTS, 0)
    per_param = setup.optimizer in (Optimizer.ADAMW_FOREACH, Optimizer.ADAMW_FUSED) or bool(
        by.get(TermKey.MASTER_GRADIENTS))
    return _Shape(
        root_params=tuple(root), block_params=tuple(block), param_scale=params / numel, grad_scale=grads / numel,
        state_tensors=state_tensors, state_scale=per_elem_state / max(state_tensors, 1),
        saved_per_block=tuple(saved_tensors), block_temps=tuple(block_temps), recompute=tuple(recompute),
        head_saved=tuple(head), root_saved=tuple(root_saved), loss_temps=tuple(loss_temps),
        gathered_root=gathered_root, gathered_block=gathered_block, step_temps=(step,) if step else (),
        step_temp_per_param=per_param, early_grads=setup.grad_accum_steps > 1 or setup.keep_zeroed_grads,
        workspaces=workspaces,
        frozen_root=tuple(frozen_root), frozen_block=tuple(frozen_block),
        offloaded_per_block=tuple(_units(offload.offloaded_bytes // layers, unit_h)) if offload else (),
        in_flight=tuple(_units(offload.in_flight_bytes, unit_h)) if offload else ())


def formula_stream(shape: _Shape, blocks: int, steps: int = 2) -> list[tuple[object, int]]:
    """The representative event stream of `steps` training steps over `blocks` blocks: the static tensors, then per
    step forward, the loss, backward and the optimizer step."""
    events: list[tuple[object, int]] = []
    add = events.append
    tensors = [("root", i, n) for i, n in enumerate(shape.root_params)]
    tensors += [(b, i, n) for b in range(blocks) for i, n in enumerate(shape.block_params)]
    _static_events(shape, blocks, tensors, add)
    for step in range(steps):
        if step == 0:
            for i, size in enumerate(shape.workspaces):
                add((("ws", i), size))
        if shape.early_grads and step == 0:
            for key in tensors:
                add((("d",) + key[:2], int(key[2] * shape.grad_scale)))
        for i, size in enumerate(shape.root_saved):
            add((("re", i), size))
        _forward_events(shape, blocks, add)
        _loss_events(shape, add)
        for b in reversed(range(blocks)):
            _block_backward_events(shape, b, add)
        if not shape.early_grads:
            for i, n in enumerate(shape.root_params):
                add((("d", "root", i), int(n * shape.grad_scale)))
        for i in range(len(shape.root_saved)):
            add((("re", i), alloc.FREE))
        _optimizer_events(shape, tensors, step, add)
    return events


_Add = Callable[[tuple[object, int]], None]


def _static_events(shape: _Shape, blocks: int, tensors: list[tuple[object, int, int]], add: _Add) -> None:
    """The parameters, the frozen tensors and the gathered root, allocated once before the first step."""
    for key in tensors:
        add((("p",) + key[:2], int(key[2] * shape.param_scale)))
    for i, size in enumerate(shape.frozen_root):
        add((("f", "root", i), size))
    for b in range(blocks):
        for i, size in enumerate(shape.frozen_block):
            add((("f", b, i), size))
    if shape.gathered_root:
        add((("g", "root"), shape.gathered_root))


def _forward_events(shape: _Shape, blocks: int, add: _Add) -> None:
    for b in range(blocks):
        if shape.gathered_block:
            add((("g", b), shape.gathered_block))
        for i, size in enumerate(shape.saved_per_block):
            add((("s", b, i), size))
        for i, size in enumerate(shape.offloaded_per_block):  # created, copied to the host, freed (one by one)
            add((("x", i), size))
            add((("x", i), alloc.FREE))
        if shape.gathered_block:
            add((("g", b), alloc.FREE))


def _loss_events(shape: _Shape, add: _Add) -> None:
    """The head's saved tensors and the loss's backward temporaries, then both freed."""
    for i, size in enumerate(shape.head_saved):
        add((("h", i), size))
    for i, size in enumerate(shape.loss_temps):
        add((("lt", i), size))
    for i in range(len(shape.head_saved)):
        add((("h", i), alloc.FREE))
    for i in range(len(shape.loss_temps)):
        add((("lt", i), alloc.FREE))


def _block_backward_events(shape: _Shape, b: int, add: _Add) -> None:
    if shape.gathered_block:
        add((("g", b), shape.gathered_block))
    for i, size in enumerate(shape.in_flight):  # brought back from the host for this block's backward
        add((("x", i), size))
    for i, size in enumerate(shape.recompute):
        add((("rc", i), size))
    for i, size in enumerate(shape.block_temps):
        add((("t", i), size))
    if not shape.early_grads:
        for i, n in enumerate(shape.block_params):
            add((("d", b, i), int(n * shape.grad_scale)))
    for name, kept in (("s", shape.saved_per_block), ("rc", shape.recompute), ("x", shape.in_flight),
                       ("t", shape.block_temps)):
        for i in range(len(kept)):
            add(((name, b, i) if name == "s" else (name, i), alloc.FREE))
    if shape.gathered_block:
        add((("g", b), alloc.FREE))


def _optimizer_events(shape: _Shape, tensors: list[tuple[object, int, int]], step: int, add: _Add) -> None:
    """The optimizer state (created by the first step), the step's temporaries and zero_grad."""
    if step == 0:
        for key in tensors:
            for j in range(shape.state_tensors):
                add((("o",) + key[:2] + (j,), int(key[2] * shape.state_scale)))
    if shape.step_temps:
        if shape.step_temp_per_param:  # foreach / master upcast: one temporary per parameter, freed together
            total = sum(k[2] for k in tensors) or 1
            for key in tensors:
                add((("st",) + key[:2], int(shape.step_temps[0] * key[2] / total)))
            for key in tensors:
                add((("st",) + key[:2], alloc.FREE))
        else:
            add((("st",), shape.step_temps[0]))
            add((("st",), alloc.FREE))
    if not shape.early_grads:  # zero_grad(set_to_none=True)
        for key in tensors:
            add((("d",) + key[:2], alloc.FREE))


@lru_cache(maxsize=512)
def _replayed(shape: _Shape, blocks: int, config: alloc.AllocatorConfig) -> tuple[int, int, int]:
    """(peak requested, rounding, reserve with room) of the sample's stream."""
    result = alloc.replay(formula_stream(shape, blocks), config)
    return (result.peak_requested, max(0, result.peak_allocated - result.peak_requested),
            max(0, result.peak_reserved - result.peak_allocated))


@lru_cache(maxsize=512)
def _least_replayed(shape: _Shape, blocks: int, config: alloc.AllocatorConfig) -> int:
    """The sample stream's reserve at the limit (allocator.least_capacity less its peak allocated)."""
    stream = formula_stream(shape, blocks)
    return max(0, alloc.least_capacity(stream, config) - alloc.replay(stream, config).peak_allocated)


def _extended(shape: _Shape, config: alloc.AllocatorConfig, layers: int,
              tensor_peak: int) -> tuple[int, int, Callable[[], int]]:
    """Replay SAMPLE_BLOCKS blocks (all of them when the model has fewer) and scale the overheads by the tensor
    peak: the sample's rounding and cache as fractions of its own peak, applied to the formulas' peak. (Blocks
    repeat the same allocations, but how their blocks pack into segments does not grow linearly with depth, so a
    fraction is steadier than an extrapolation.)"""
    blocks = min(SAMPLE_BLOCKS, layers)
    requested, rounding, reserve = _replayed(shape, blocks, config)
    if blocks == layers or not requested:
        return rounding, reserve, cache(lambda: _least_replayed(shape, blocks, config))
    scale = tensor_peak / requested
    return (int(rounding * scale), int(reserve * scale),
            cache(lambda: int(_least_replayed(shape, blocks, config) * scale)))
