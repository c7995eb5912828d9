"""OOM-safe training: `FitLoop` runs optimizer steps under a plan's setups and, on an out-of-memory error, frees memory,
moves to the next setup that a live model can take, replays the same global batch and goes on, logging each change.

    loop = FitLoop(model, None, plan, loss_fn=loss_fn)      # optimizer None: built from the plan's first setup
    for global_batch in batches:                            # one global batch per optimizer step
        loop.step(global_batch)
    print(loop.report().summary())

What it guarantees (tests/plan/test_fit.py checks each on a simulated device, against runs that never ran out of memory):

- **The effective batch never changes.** The caller passes one global batch per optimizer step; the loop cuts it into
  micro-batches of the current setup's `micro_batch_size` and weights each micro-loss by its share of the samples
  (micro size / global size), so the accumulated gradient is that of the global mean loss whatever the split (equal
  up to floating-point summation order). `loss_fn` must return the mean over its micro-batch's samples (HF's loss
  does when the sequences carry no padding).
- **No sample is lost or counted twice.** An OOM in forward or backward drops the partial gradients
  (`set_to_none`) and replays the whole global batch from its first micro-batch, with the RNG state the step began
  with (dropout masks repeat).
- **Optimizer state stays intact.** Only changes a live model takes without touching the optimizer are made: the
  micro-batch size (re-chunking), gradient checkpointing and the attention implementation (through `apply_`). Plan
  steps that change precision, the optimizer, sharding or offload are skipped and the reason logged: mid-run they
  would cast parameters under existing state or throw the state away (restart with them instead).
- **An OOM inside optimizer.step() leaves no half-updated model** while freeing memory lets the step finish: see
  `TransactionalStep`. Such an OOM changes no setup (activations are gone by then; micro-batch and checkpointing
  do not change the step's memory), so the step resumes where it stopped.
- **It stops.** Every OOM moves one rung down a finite ladder (the plan's steps, then, with `extend_plan`,
  checkpointing and halving the micro-batch down to 1); when none is left it raises `FitOutOfMemoryError`, one line
  saying what it tried, with the model as the last completed step left it.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .apply import AppliedChanges, apply_
from .errors import ConfigError, MemfitError
from ._torch.transactional import TransactionalStep, is_out_of_memory
from .setup import Attention, Checkpointing, TrainingSetup

LIVE_FIELDS = ("micro_batch_size", "grad_accum_steps", "checkpointing", "attention")
"""What a running job may change: none of these touches the optimizer or its state."""
FROZEN_FIELDS = {
    "precision": "casting parameters under existing optimizer state breaks it",
    "optimizer": "a new optimizer would start with empty state",
    "sharding": "sharding needs an engine started with it",
    "offload": "offload needs an engine started with it",
    "num_gpus": "the number of ranks is fixed at launch",
    "seq_len": "the data decides the sequence length",
}
logger = logging.getLogger("memfit.fit")


class FitOutOfMemoryError(MemfitError):
    """Out of memory with no setup left to try (or an optimizer step that cannot fit at all). Not a RuntimeError, so
    outer OOM handlers (batch-size finders) do not mistake it for one more allocation failure."""


@dataclass(frozen=True)
class FitEvent:
    """One out-of-memory error handled: where it hit, the setup before and after, and why."""

    step: int
    """Optimizer step index (0-based) the error hit."""
    phase: str
    """'forward', 'backward' or 'optimizer'."""
    micro_step: int | None
    """Micro-step index (0-based) within the step; None in the optimizer phase."""
    error: str
    old_setup: TrainingSetup
    new_setup: TrainingSetup
    action: str
    """What the loop did: the setup change (e.g. 'micro-batch 8 -> 2 (accumulation 1 -> 4)') or the resumption."""
    reason: str
    """Which rung it took and why (the plan step's title, or a fallback beyond the plan)."""
    skipped: tuple[str, ...] = ()
    """Plan steps passed over on the way, each with why."""

    def __str__(self) -> str:
        where = f"micro-step {self.micro_step}" if self.micro_step is not None else "optimizer.step()"
        text = f"step {self.step}, {self.phase} ({where}): out of memory -> {self.action} [{self.reason}]"
        return text + (f"; skipped {'; '.join(self.skipped)}" if self.skipped else "")


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_samples: int
    micro_batch_sizes: tuple[int, ...]
    """The split of the attempt that completed."""
    loss: float
    """Sample-weighted mean loss over the global batch."""
    attempts: int
    """Forward/backward passes over the global batch (1 + replays) plus optimizer-step resumptions."""
    setup: TrainingSetup


@dataclass(frozen=True)
class FitReport:
    initial_setup: TrainingSetup
    setup: TrainingSetup
    """The setup the loop runs now (after every change)."""
    steps: tuple[StepRecord, ...]
    events: tuple[FitEvent, ...]

    @property
    def losses(self) -> list[float]:
        return [record.loss for record in self.steps]

    def summary(self) -> str:
        lines = [f"{len(self.steps)} optimizer steps, {len(self.events)} out-of-memory errors handled; "
                 f"setup {_describe(self.initial_setup)} -> {_describe(self.setup)}"]
        return "\n".join(lines + [f"  {event}" for event in self.events])


def log_event(event: FitEvent) -> None:
    """The default `on_change`: a warning on the 'memfit.fit' logger."""
    logger.warning("memfit fit: %s", event)


def fit_steps(model, optimizer, batches: Iterable, plan_or_setups, *, loss_fn=None,
              on_change: Callable[[FitEvent], None] | None = log_event, **options) -> FitReport:
    """Run one optimizer step per global batch in `batches` with `FitLoop` (see it for the arguments)."""
    loop = FitLoop(model, optimizer, plan_or_setups, loss_fn=loss_fn, on_change=on_change, **options)
    for batch in batches:
        loop.step(batch)
    return loop.report()


@dataclass
class _Failure:
    phase: str
    micro_step: int | None
    error: str


class FitLoop:
    """Optimizer steps that survive out-of-memory errors by moving down a plan.

    `model`: an nn.Module, made to train as the first setup says (`apply_`) before anything runs.
    `optimizer`: a torch optimizer built over `model`, a callable `model -> optimizer` (called after `apply_`), or
    None to build the first setup's (`AppliedChanges.make_optimizer`, with `lr`).
    `plan_or_setups`: a `Plan` (its initial setup, then its steps in order), a sequence of TrainingSetups (the first
    is the start) or one TrainingSetup. With `extend_plan`, once those are spent the loop also tries checkpointing and
    then halving the micro-batch down to 1.
    `loss_fn(model, micro_batch) -> scalar mean loss`; by default the model output's `.loss`.
    `on_change(event)` is called for each handled OOM (default: a logged warning). `phase_callback(phase, step,
    micro_step)` is told as each phase begins (e.g. `OOMInjector.on_phase`).
    `step_undo`: 'device' (default) or 'host' keeps the per-parameter undo record of the transactional optimizer step
    there; 'none' calls optimizer.step() as is (an OOM inside it then raises FitOutOfMemoryError).
    Each attempt runs memfit's one training loop (`_torch.step.forward_backward` / `optimizer_step`, the loop that
    measure and the tracer run), so amp-fp16 trains with a GradScaler (kept on the optimizer across steps): the
    loss is scaled, the gradients unscaled before the transactional step, and a step the scaler skips for inf
    gradients is a completed step.
    """

    def __init__(self, model, optimizer, plan_or_setups, *, loss_fn=None,
                 on_change: Callable[[FitEvent], None] | None = log_event,
                 phase_callback: Callable[[str, int, int | None], None] | None = None, extend_plan: bool = True,
                 step_undo: str = "device", lr: float | None = None) -> None:
        import torch

        from ._torch.step import default_loss

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"FitLoop trains an nn.Module, got {type(model).__name__}")
        if step_undo not in ("device", "host", "none"):
            raise ConfigError(f"step_undo must be 'device', 'host' or 'none', got {step_undo!r}")
        first, self._rungs = _ladder(plan_or_setups)
        if isinstance(optimizer, torch.optim.Optimizer) and not _dtypes_match(model, first):
            raise ConfigError(f"the model's parameters are not {first.precision.param_dtype} as the first setup "
                              f"({first.precision}) says: cast them before building the optimizer, or pass a factory")
        self.model = model
        self.applied: AppliedChanges = apply_(model, first)
        self.optimizer = self._build_optimizer(optimizer, lr)
        self.loss_fn = loss_fn or default_loss
        self.on_change = on_change
        self.phase_callback = phase_callback
        self.extend_plan = extend_plan
        self._stepper = TransactionalStep(model, self.optimizer, step_undo)
        self._step_total = 0
        self._previous_target = first
        self._fallbacks: set[str] = set()
        self._initial = first
        self._tried = [f"as given ({_describe(first)})"]
        self._skipped: list[str] = []
        self._records: list[StepRecord] = []
        self._events: list[FitEvent] = []
        self._broken: str | None = None

    @property
    def setup(self) -> TrainingSetup:
        return self.applied.setup

    def report(self) -> FitReport:
        return FitReport(self._initial, self.setup, tuple(self._records), tuple(self._events))

    # ---- one optimizer step -----------------------------------------------------------------------------------

    def step(self, global_batch) -> StepRecord:
        """One optimizer step over `global_batch` (a tensor, a dict of tensors or a tuple/list of tensors; dim 0 is
        the sample dimension), whatever it takes: replays after OOM in forward/backward, resumption after OOM in the
        optimizer step. Returns what completed."""
        if self._broken:
            raise FitOutOfMemoryError(self._broken)
        num_samples = _num_samples(global_batch)
        index, attempts = len(self._records), 0
        rng = _rng_state()
        while True:
            attempts += 1
            failure, sizes, loss = self._forward_backward(global_batch, num_samples, index)
            if failure is None:
                self._step_total = self._stepper.remaining
                failure = self._optimizer_step(index)
                while failure is not None:
                    attempts += 1
                    failure = self._resume_optimizer(failure, index)
                break
            self._release(zero_grads=True)
            _set_rng_state(rng)
            self._move_down(failure, index)
        record = StepRecord(index, num_samples, sizes, loss, attempts, self.setup)
        self._records.append(record)
        return record

    def _forward_backward(self, global_batch, num_samples: int, index: int):
        """All micro-steps of one attempt, through memfit's one loop (`_torch.step.forward_backward`), each
        micro-loss weighted by its share of the samples. Returns (failure or None, micro sizes, loss); on failure the
        traceback's frames are cleared so the activations they hold die with this frame."""
        from ._torch import step as torch_step

        micro_batches = _split(global_batch, self.setup.micro_batch_size)
        sizes = tuple(_num_samples(mb) for mb in micro_batches)
        where = {"phase": "forward", "micro": -1}

        def on_phase(phase: str) -> None:
            where["micro"] += phase == "forward"
            where["phase"] = phase
            self._notify(phase, index, where["micro"])

        try:
            loss = torch_step.forward_backward(self.model, self.optimizer, micro_batches, self.setup,
                                               loss_fn=self.loss_fn, phase_callback=on_phase,
                                               weights=[size / num_samples for size in sizes])
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            traceback.clear_frames(error.__traceback__)
            return _Failure(where["phase"], max(where["micro"], 0), _one_line(error)), sizes, float("nan")
        return None, sizes, loss

    def _optimizer_step(self, index: int, *, resume: bool = False) -> _Failure | None:
        """The loop's optimizer phase with the transactional step (a GradScaler, for amp-fp16, still decides)."""
        from ._torch import step as torch_step

        hooks = torch_step.EngineHooks(step=self._stepper.step)
        try:
            torch_step.optimizer_step(self.model, self.optimizer, self.setup, hooks=hooks, resume=resume,
                                      phase_callback=lambda phase: self._notify(phase, index, None))
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            traceback.clear_frames(error.__traceback__)
            return _Failure("optimizer", None, _one_line(error))
        self.model.zero_grad(set_to_none=True)
        return None

    def _resume_optimizer(self, failure: _Failure, index: int) -> _Failure | None:
        """After an OOM inside the step: free memory and go on with the parameters that still hold a gradient."""
        remaining_before = self._stepper.remaining
        if self._stepper.undo is None:
            self._broken = (f"out of memory inside optimizer.step() of step {index} with step_undo='none': the model "
                            f"may be half-updated; restore a checkpoint ({failure.error})")
            raise FitOutOfMemoryError(self._broken)
        self._release(zero_grads=False)
        done = self._step_total - remaining_before
        self._record(FitEvent(index, "optimizer", None, failure.error, self.setup, self.setup,
                              f"resumed optimizer.step() at parameter {done + 1} of {self._step_total}",
                              "the failed parameter was restored from its undo record; micro-batch and checkpointing "
                              "do not change the step's memory"))
        retry = self._optimizer_step(index, resume=True)
        if retry is not None and self._stepper.remaining == remaining_before:
            self._broken = (f"out of memory in optimizer.step() of step {index} at parameter "
                            f"'{self._stepper.next_name()}' even after freeing memory: parameters, gradients and "
                            f"optimizer state leave no room for its update ({done} of {self._step_total} "
                            "parameters took the step, the rest keep their gradients); restart with 8-bit AdamW, "
                            f"sharding or offload ({retry.error})")
            raise FitOutOfMemoryError(self._broken)
        return retry

    # ---- moving down the ladder -------------------------------------------------------------------------------

    def _move_down(self, failure: _Failure, index: int) -> None:
        old = self.setup
        skipped: list[str] = []
        while True:
            rung = self._next_rung(old, skipped)
            if rung is None:
                self._skipped += skipped
                where = f"{failure.phase} of step {index}" + (
                    f" (micro-step {failure.micro_step})" if failure.micro_step is not None else "")
                skips = f"; skipped {'; '.join(self._skipped)}" if self._skipped else ""
                raise FitOutOfMemoryError(f"out of memory in {where} with every setup tried: "
                                          f"{' -> '.join(self._tried)}{skips} ({failure.error})")
            title, proposal = rung
            applied = apply_(self.model, proposal)
            refused = {name: applied[name].detail for name in ("checkpointing", "attention")
                       if getattr(old, name) != getattr(proposal, name) and not applied[name].changed
                       and not applied[name].detail.startswith("already")}
            if refused:  # keep the setup truthful: the model could not take these
                proposal = proposal.replace(**{name: getattr(old, name) for name in refused})
                applied = apply_(self.model, proposal)
                skipped.append(f"{title} ({'; '.join(f'{name}: {why}' for name, why in refused.items())})")
                if _same_live(old, proposal):
                    continue
            break
        self.applied = applied
        self._skipped += skipped
        self._tried.append(title)
        self._record(FitEvent(index, failure.phase, failure.micro_step, failure.error, old, proposal,
                              _diff(old, proposal),
                              f"{title}; replayed the global batch", tuple(skipped)))

    def _next_rung(self, current: TrainingSetup, skipped: list[str]) -> tuple[str, TrainingSetup] | None:
        while self._rungs:
            title, target = self._rungs.pop(0)
            before, self._previous_target = self._previous_target, target  # plan steps are cumulative: name only
            frozen = [f"{name} {getattr(before, name)} -> {getattr(target, name)} ({why})"  # what this one adds
                      for name, why in FROZEN_FIELDS.items() if getattr(target, name) != getattr(before, name)]
            proposal = current.replace(**{name: getattr(target, name) for name in LIVE_FIELDS})
            worse = _uses_more_memory(current, proposal)
            if frozen:
                skipped.append(f"{title} (not made: {', '.join(frozen)})")
            elif worse or _same_live(current, proposal):
                skipped.append(f"{title} ({worse or 'nothing left to change'})")
            if not worse and not _same_live(current, proposal):
                return title, proposal
        if not self.extend_plan:
            return None
        title = "checkpointing (beyond the plan)"
        if current.checkpointing is Checkpointing.NONE and title not in self._fallbacks:
            self._fallbacks.add(title)  # proposed once: a model that cannot take it is not asked again
            return title, current.replace(checkpointing=Checkpointing.FULL)
        if current.micro_batch_size > 1:
            size = current.micro_batch_size // 2
            accum = -(-current.micro_batch_size * current.grad_accum_steps // size)
            return "halved micro-batch (beyond the plan)", current.replace(micro_batch_size=size,
                                                                          grad_accum_steps=accum)
        return None

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _build_optimizer(self, optimizer, lr):
        import torch

        if optimizer is None:
            return self.applied.make_optimizer(self.model, lr=lr)
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            return optimizer(self.model)
        raise ConfigError(f"optimizer must be a torch optimizer, a callable model -> optimizer or None, "
                          f"got {type(optimizer).__name__}")

    def _release(self, *, zero_grads: bool) -> None:
        import torch

        if zero_grads:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _notify(self, phase: str, step: int, micro_step: int | None) -> None:
        if self.phase_callback is not None:
            self.phase_callback(phase, step, micro_step)

    def _record(self, event: FitEvent) -> None:
        self._events.append(event)
        if self.on_change is not None:
            self.on_change(event)


def _ladder(plan_or_setups) -> tuple[TrainingSetup, list[tuple[str, TrainingSetup]]]:
    if isinstance(plan_or_setups, TrainingSetup):
        return plan_or_setups, []
    steps = getattr(plan_or_setups, "steps", None)
    initial = getattr(plan_or_setups, "initial_setup", None)
    if isinstance(initial, TrainingSetup) and steps is not None:
        return initial, [(step.title, step.setup) for step in steps]
    if isinstance(plan_or_setups, Sequence) and plan_or_setups and all(
            isinstance(s, TrainingSetup) for s in plan_or_setups):
        return plan_or_setups[0], [(f"setup {i}", s) for i, s in enumerate(plan_or_setups[1:], 1)]
    raise ConfigError(f"FitLoop needs a Plan, a TrainingSetup or a non-empty list of them, "
                      f"got {type(plan_or_setups).__name__}")


def _same_live(a: TrainingSetup, b: TrainingSetup) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in LIVE_FIELDS if name != "grad_accum_steps")


def _uses_more_memory(current: TrainingSetup, proposal: TrainingSetup) -> str | None:
    if proposal.micro_batch_size > current.micro_batch_size:
        return f"a larger micro-batch ({current.micro_batch_size} -> {proposal.micro_batch_size})"
    if current.checkpointing.is_on and proposal.checkpointing is Checkpointing.NONE:
        return "it turns checkpointing off"
    if current.attention is Attention.SDPA and proposal.attention is Attention.EAGER:
        return "eager attention materialises the T x T scores"
    return None


def _describe(setup: TrainingSetup) -> str:
    attention = ", eager attention" if setup.attention is Attention.EAGER else ""
    return (f"micro-batch {setup.micro_batch_size} x {setup.grad_accum_steps}, checkpointing {setup.checkpointing}"
            f"{attention}")


def _diff(old: TrainingSetup, new: TrainingSetup) -> str:
    parts = []
    if old.micro_batch_size != new.micro_batch_size:
        parts.append(f"micro-batch {old.micro_batch_size} -> {new.micro_batch_size} "
                     f"(accumulation {old.grad_accum_steps} -> {new.grad_accum_steps})")
    for name in ("checkpointing", "attention"):
        if getattr(old, name) != getattr(new, name):
            parts.append(f"{name} {getattr(old, name)} -> {getattr(new, name)}")
    return "; ".join(parts) or "no change"


def _dtypes_match(model, setup: TrainingSetup) -> bool:
    import torch

    target = torch.bfloat16 if setup.precision.param_dtype == "bf16" else torch.float32
    return {p.dtype for p in model.parameters() if p.is_floating_point()} <= {target}


def _num_samples(batch) -> int:
    import torch

    tensors = [batch] if isinstance(batch, torch.Tensor) else [
        v for v in (batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple))
                    else ()) if isinstance(v, torch.Tensor)]
    sizes = {t.shape[0] for t in tensors if t.ndim > 0}
    if len(sizes) != 1:
        raise ConfigError("a global batch is a tensor, or a dict / tuple / list of tensors that share dim 0 (the "
                          f"samples); got sizes {sorted(sizes) or 'none'}")
    return sizes.pop()


def _split(batch, micro_batch_size: int) -> list:
    """Views of consecutive micro-batches; values that are not batched tensors are passed to each unchanged."""
    import torch

    count = _num_samples(batch)
    bounds = [(start, min(start + micro_batch_size, count)) for start in range(0, count, micro_batch_size)]

    def cut(value, start: int, end: int):
        return value[start:end] if isinstance(value, torch.Tensor) and value.ndim > 0 else value

    if isinstance(batch, torch.Tensor):
        return [batch[s:e] for s, e in bounds]
    if isinstance(batch, Mapping):
        return [{k: cut(v, s, e) for k, v in batch.items()} for s, e in bounds]
    return [type(batch)(cut(v, s, e) for v in batch) for s, e in bounds]


def _rng_state() -> tuple:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
