"""Replay of a profiled step's allocations, with every byte given a memory term. Plain Python, no torch: the
profiler-reading side (measure_cpu.py) turns events into `Allocation`s and `Mark`s.

How bytes get their term (and why not torch's MemoryProfile): the caller knows which storages are parameters,
gradients and optimizer state, and says so with marks at moments where those storages are alive: gradients just
before `optimizer.step()`, optimizer state just after it. A mark tags the allocation live at each named pointer, for
its whole lifetime, so state created inside step 1 counts as optimizer state from its first byte. Activations are the
allocations made in a forward that are still alive when its backward starts (saved for backward, logits, the loss);
every other allocation made during the step is a temporary (forward scratch, recomputed checkpointed layers and
activation gradients in backward, optimizer scratch).
torch.profiler._memory_profiler.MemoryProfile was tried first: with `with_stack=False` it has no Python tracer and
files optimizer state under PARAMETER (the tiny llama: 3x the parameter bytes "parameters", 0 optimizer); with
`with_stack=True` it is right but slower, private, and sizes tensors from their metadata rather than the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..estimate.terms import TermKey

BEFORE_FIRST_EVENT = -1
NEVER = 1 << 62

SCRATCH_TERM = TermKey.ONEDNN_SCRATCH
"""A CPU bf16 matmul's scratch beyond the step's tensor peak (memfit._torch.measure_cpu)."""
PREEXISTING_TERM = TermKey.PREEXISTING
"""Bytes live before profiling that nobody named (freed during the step, so the replay had to count them)."""


@dataclass(frozen=True)
class Allocation:
    """One allocator event: size_bytes > 0 allocates, < 0 frees. `running_total_bytes` is the profiler's counter."""

    ptr: int
    size_bytes: int
    running_total_bytes: int | None = None


@dataclass(frozen=True)
class Mark:
    """A moment in the step: a phase begins (phase given) and/or storages are named (tags: term -> pointers)."""

    phase: str | None = None
    step: int = 0
    micro: int = 0
    tags: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Record:
    ptr: int
    size_bytes: int
    start: int
    """Index of the allocating event; BEFORE_FIRST_EVENT for storages live before profiling."""
    end: int = NEVER
    segment: int = -1
    term: str | None = None


@dataclass(frozen=True)
class Segment:
    """A stretch of the step in one phase: points first_point .. last_point (a point is the state after an event)."""

    phase: str
    step: int
    micro: int
    first_point: int
    last_point: int


@dataclass
class Replay:
    records: list[Record]
    relative_bytes: list[int]
    """Bytes allocated since profiling began (minus frees), after each event; the baseline is not included."""
    baseline_bytes: int
    segments: list[Segment]
    counter_mismatches: int = 0
    """Events where the running sum disagreed with the profiler's own counter (0 when the replay is exact)."""
    scratch_bytes: int = 0
    """What oneDNN's matmul scratch, left out of the events, added to the peak (measure_cpu)."""

    def bytes_at(self, point: int) -> int:
        return self.baseline_bytes + (0 if point == BEFORE_FIRST_EVENT else self.relative_bytes[point])

    @property
    def peak_point(self) -> int:
        best, best_bytes = BEFORE_FIRST_EVENT, self.bytes_at(BEFORE_FIRST_EVENT)
        for point, relative in enumerate(self.relative_bytes):
            if self.baseline_bytes + relative > best_bytes:
                best, best_bytes = point, self.baseline_bytes + relative
        return best

    def bytes_by_term(self, point: int) -> dict[str, int]:
        """Live bytes per term at a point; untagged allocations are temporaries."""
        totals: dict[str, int] = {}
        for record in self.records:
            if record.start <= point < record.end:
                term = record.term or "temporaries"
                totals[term] = totals.get(term, 0) + record.size_bytes
        return totals

    def segment_of(self, point: int) -> Segment:
        """The segment in which the event behind `point` happened (the first one for the baseline point)."""
        for segment in self.segments:
            if point <= segment.last_point:
                return segment
        return self.segments[-1]

    def segment_peak(self, segment: Segment) -> int:
        """The point with the most live bytes in a segment (its first such point)."""
        points = range(segment.first_point, segment.last_point + 1)
        return max(points, key=lambda point: (self.bytes_at(point), -point))


def replay(baseline: list[tuple[int, int, str]], events: list[Allocation | Mark]) -> Replay:
    """Replay `events` (in time order) on top of `baseline` [(ptr, bytes, term)], the storages live before."""
    live: dict[int, Record] = {}
    records: list[Record] = []
    for ptr, size_bytes, term in baseline:
        live[ptr] = Record(ptr, size_bytes, BEFORE_FIRST_EVENT, term=term)
        records.append(live[ptr])
    baseline_bytes = sum(record.size_bytes for record in records)
    relative_bytes: list[int] = []
    boundaries: list[tuple[int, Mark]] = []  # (first point of the segment, its opening mark)
    running, offset, mismatches = 0, None, 0
    for event in events:
        point = len(relative_bytes)
        if isinstance(event, Mark):
            _apply_tags(live, event, current_segment=len(boundaries) - 1)
            if event.phase is not None:
                boundaries.append((point, event))
            continue
        if event.size_bytes > 0:
            record = Record(event.ptr, event.size_bytes, point, segment=len(boundaries) - 1)
            live[event.ptr] = record
            records.append(record)
        else:
            record = live.pop(event.ptr, None)
            if record is None:  # live before profiling and not named by the caller
                record = Record(event.ptr, -event.size_bytes, BEFORE_FIRST_EVENT, term=PREEXISTING_TERM)
                records.append(record)
                baseline_bytes += record.size_bytes
            record.end = point
        running += event.size_bytes
        relative_bytes.append(running)
        if event.running_total_bytes is not None:
            offset = event.running_total_bytes - running if offset is None else offset
            mismatches += event.running_total_bytes - offset != running
    segments = _segments(boundaries, len(relative_bytes))
    return Replay(records, relative_bytes, baseline_bytes, segments, mismatches)


def _apply_tags(live: dict[int, Record], mark: Mark, *, current_segment: int) -> None:
    for term, pointers in mark.tags.items():
        for ptr in pointers:
            record = live.get(ptr)
            if record is not None and (record.term is None or record.term == "activations"):
                record.term = term
    if mark.phase == "backward":  # the forward that just ended: what it left alive is saved for backward
        for record in live.values():
            if record.term is None and record.segment == current_segment:
                record.term = "activations"


def _segments(boundaries: list[tuple[int, Mark]], num_points: int) -> list[Segment]:
    if not boundaries:
        return [Segment("forward", 1, 1, BEFORE_FIRST_EVENT, num_points - 1)]
    segments = []
    for index, (first, mark) in enumerate(boundaries):
        end = boundaries[index + 1][0] - 1 if index + 1 < len(boundaries) else num_points - 1
        # A segment starts at the state its phase begins with: the point just before its first event.
        segments.append(Segment(mark.phase, mark.step, mark.micro, first - 1, max(end, first - 1)))
    return segments


@dataclass(frozen=True)
class MeasuredSteps:
    """What real steps showed, by term name, before it becomes a MemoryEstimate (memfit.measure does that)."""

    peak_terms: dict[str, int]
    peak_phase: str
    phase_peaks: dict[str, int]
    timeline: tuple[tuple[str, str, dict[str, int]], ...]
    """(phase, label, bytes by term) at each phase start and each phase's peak, in time order."""
    step_peaks: tuple[int, ...]
    notes: tuple[str, ...] = ()


def summarise(result: Replay) -> MeasuredSteps:
    """The peak and its breakdown, each phase's peak, per-step peaks and a timeline (phase starts and peaks)."""
    peak = result.peak_point
    phase_peaks: dict[str, int] = {}
    step_peaks: dict[int, int] = {}
    timeline = []
    for segment in result.segments:
        where = f"step {segment.step}" + (f" micro {segment.micro}" if segment.phase != "optimizer" else "")
        segment_peak = result.segment_peak(segment)
        for point, what in ((segment.first_point, "start"), (segment_peak, "peak")):
            timeline.append((segment.phase, f"{where} {segment.phase} {what}", result.bytes_by_term(point)))
        value = result.bytes_at(segment_peak)
        phase_peaks[segment.phase] = max(phase_peaks.get(segment.phase, 0), value)
        step_peaks[segment.step] = max(step_peaks.get(segment.step, 0), value)
    notes, peak_terms = [], result.bytes_by_term(peak)
    if result.scratch_bytes:
        peak_terms[SCRATCH_TERM] = result.scratch_bytes
        notes.append(f"oneDNN's bf16 matmul scratch raised this CPU's peak by {result.scratch_bytes:,} B (it depends on "
                     "the instruction set and the thread count; the tensor figures leave it out)")
    if result.counter_mismatches:
        notes.append(f"{result.counter_mismatches} allocator events disagreed with the profiler's running total")
    return MeasuredSteps(peak_terms, result.segment_of(peak).phase, phase_peaks, tuple(timeline),
                         tuple(step_peaks[s] for s in sorted(step_peaks)), tuple(notes))
