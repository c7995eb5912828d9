"""Presentation of a trace: the allocation history down-sampled to a timeline, module attribution grouped."""

from __future__ import annotations

from dataclasses import dataclass

from ..estimate.result import Phase


@dataclass(frozen=True)
class TraceProgress:
    """Handed to the progress callback while a trace runs."""

    step: int
    """1-based training step (iteration)."""
    num_steps: int
    phase: Phase
    fraction: float
    """Of the whole trace, 0..1 (an estimate inside a phase; exact at phase boundaries)."""

    @property
    def message(self) -> str:
        return f"step {self.step}/{self.num_steps} {self.phase.value}"


@dataclass(frozen=True)
class Sample:
    """Live bytes per kind right after one allocation or free (event numbers start at 1)."""

    event: int
    step: int
    phase: Phase | None
    live: tuple[int, ...]
    label: str = ""


def downsample(history: list[tuple[int, ...]], marks: list[tuple[int, int, Phase]], peak_event: int,
               device: list[bool], max_points: int = 2000) -> list[Sample]:
    """At most about `max_points` samples of `history` (live bytes per kind after each event): each bucket keeps
    its highest moment on the device; the first event of every phase (labelled 'step N phase') and the peak
    (labelled 'peak') are always kept. `marks` are (events before the phase began, step, phase)."""
    if not history:
        return []
    totals = [sum(v for v, on_device in zip(row, device) if on_device) for row in history]
    peak_index = max(peak_event - 1, 0)
    labels = {event: f"step {step} {phase.value}" for event, step, phase in marks if event < len(history)}
    labels[peak_index] = "peak"
    keep = {len(history) - 1, *labels}
    bucket = max(1, -(-len(history) // max(1, max_points - len(keep))))
    for start in range(0, len(history), bucket):
        keep.add(max(range(start, min(start + bucket, len(history))), key=totals.__getitem__))
    samples, marks, mark_index, step, phase = [], sorted(marks), 0, 0, None
    for index in sorted(keep):
        while mark_index < len(marks) and marks[mark_index][0] <= index:
            _, step, phase = marks[mark_index]
            mark_index += 1
        samples.append(Sample(event=index + 1, step=step, phase=phase, live=history[index],
                              label=labels.get(index, "")))
    return samples


def group_modules(saved_by_module: dict[str, int], limit: int = 10) -> list[tuple[str, int]]:
    """Saved activation bytes per module, repeated layers summed under one name ('model.layers.*.mlp'),
    largest first."""
    totals: dict[str, int] = {}
    for name, num_bytes in saved_by_module.items():
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        totals[pattern] = totals.get(pattern, 0) + num_bytes
    ranked = sorted(((n, b) for n, b in totals.items() if b > 0), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]
