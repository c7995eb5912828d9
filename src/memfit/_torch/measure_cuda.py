"""Real steps on a CUDA device, read from the caching allocator's own statistics.

The peak of each phase is exact: `max_memory_allocated` read and reset at every phase boundary. Its breakdown is
not: CUDA has no per-allocation record here, so parameters, buffers, gradients, optimizer state and inputs are summed
from the live tensors at the phase's start and end (the larger of the two, per term: gradients are all alive when
the optimizer phase starts, its state once it ends), tensors already on the device that the step does not own are
'temporaries/preexisting', and activations are what remains of the peak. `max_memory_reserved - max_memory_allocated`
is reported as the allocator's reserve (an OVERHEAD term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..estimate.terms import TermKey
from .measure_cpu import _optimizer_tensors, _tensors_in
from .replay import PREEXISTING_TERM, MeasuredSteps
from .step import training_step

RESERVE_TERM = TermKey.ALLOCATOR_RESERVE


@dataclass(frozen=True)
class CudaSegment:
    phase: str
    label: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    static_bytes_by_term: dict[str, int]
    """Bytes of step-owned tensors per term: the larger of the phase's start and end."""


def measure_cuda_steps(model, optimizer, batches, setup, *, steps: int, loss_fn=None, device,
                       on_phase=None) -> tuple[MeasuredSteps, list[float]]:
    """`on_phase(step, phase)` is called as each phase begins (progress)."""
    segments: list[CudaSegment] = []
    open_segment: dict = {}
    losses: list[float] = []
    torch.cuda.synchronize(device)
    owned = _static_bytes_by_term(model, optimizer, batches)
    preexisting_bytes = torch.cuda.memory_allocated(device) - sum(owned.values())

    def close() -> None:
        if not open_segment:
            return
        torch.cuda.synchronize(device)
        end = _static_bytes_by_term(model, optimizer, batches)
        static = {term: max(value, end.get(term, 0)) for term, value in open_segment["start"].items()}
        segments.append(CudaSegment(open_segment["phase"], open_segment["label"],
                                    torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                                    static))
        open_segment.clear()

    def phase_begins(phase: str) -> None:
        if on_phase is not None:
            on_phase(len(losses) + 1, phase)
        close()
        torch.cuda.reset_peak_memory_stats(device)
        open_segment.update(phase=phase, label=f"step {len(losses) + 1} {phase}",
                            start=_static_bytes_by_term(model, optimizer, batches))

    for _ in range(steps):
        loss = training_step(model, optimizer, batches, setup, loss_fn=loss_fn, phase_callback=phase_begins)
        close()
        losses.append(loss)
    return cuda_breakdown(segments, max(preexisting_bytes, 0), steps), losses


def cuda_breakdown(segments: list[CudaSegment], preexisting_bytes: int, steps: int) -> MeasuredSteps:
    """The peak segment's breakdown (activations = the remainder), phase peaks, per-step peaks. Pure arithmetic."""
    peak = max(segments, key=lambda s: s.peak_allocated_bytes)
    phase_peaks: dict[str, int] = {}
    for segment in segments:
        phase_peaks[segment.phase] = max(phase_peaks.get(segment.phase, 0), segment.peak_allocated_bytes)
    terms = _with_remainder(peak, preexisting_bytes)
    terms[RESERVE_TERM] = max(s.peak_reserved_bytes for s in segments) - peak.peak_allocated_bytes
    per_step = [0] * steps
    for segment in segments:
        step = int(segment.label.split()[1]) - 1
        per_step[step] = max(per_step[step], segment.peak_allocated_bytes)
    timeline = tuple((s.phase, f"{s.label} peak", _with_remainder(s, preexisting_bytes)) for s in segments)
    notes = ("CUDA: phase peaks are exact (max_memory_allocated per phase); the split into terms sums live tensors at "
             "phase boundaries and calls the rest of the peak activations",)
    return MeasuredSteps(terms, peak.phase, phase_peaks, timeline, tuple(per_step), notes)


def _with_remainder(segment: CudaSegment, preexisting_bytes: int) -> dict[str, int]:
    terms = dict(segment.static_bytes_by_term)
    if preexisting_bytes:
        terms[PREEXISTING_TERM] = preexisting_bytes
    terms["activations"] = max(segment.peak_allocated_bytes - sum(terms.values()), 0)
    return terms


def _static_bytes_by_term(model, optimizer, batches) -> dict[str, int]:
    groups = {
        "parameters": list(model.parameters()),
        "buffers": list(model.buffers()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        **_optimizer_tensors(optimizer),
        "inputs": list(_tensors_in(batches)),
    }
    seen: set[int] = set()
    terms = {}
    for term, tensors in groups.items():
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device.type == "cuda" and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        terms[term] = total
    return terms
