"""`memfit trace -- python train.py ARGS`: the user's own training script, run for a few optimizer steps on fake
tensors, sized by memfit's StepTracker (as torchtitan's memory estimation runs its own train loop under
FakeTensorMode, torchtitan/tools/estimate.py). A framework memfit never studied is sized by running its code.

The script runs in this process (runpy, with sys.argv set) under a FakeTensorMode; the tracker counts every
storage from the first statement on. Phases come from the script's own calls: the first module call outside the
step begins a forward, `torch.autograd.backward` (what `loss.backward()`, accelerate's and Lightning's backward
call) a backward, and every torch optimizer's step (torch.optim's global step hooks, so subclasses and wrappers
are seen once) the optimizer phase. After `steps` optimizer steps a sentinel (a BaseException, so that a
script's `except Exception` does not swallow it) ends the script.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import runpy
import sys
from types import SimpleNamespace
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .._torch.measure_cpu import profiled_peak
from ..errors import ConfigError
from ..estimate.device import runtime_overhead_terms
from ..estimate.result import MemoryEstimate, Phase
from ..setup import TrainingSetup
from . import script_env
from .kernels import cpu_rng_states, device_kernels, hidden_scratch, kernel_note
from .run import to_estimate
from .script_dist import fake_launch, torchrun_options
from .script_launch import launcher_name, read_launcher
from .session import _FakeDeepcopy, routed_experts
from .tracker import StepTracker, _Kind

_DEVICES = ("cuda", "cpu")


class _Stop(BaseException):
    """Raised after the last counted optimizer step; caught by memfit."""


@dataclass(frozen=True)
class ScriptCommand:
    """What to run: a file (`path`) or a module (`module`, as `python -m`), and its arguments."""

    path: str | None
    module: str | None
    args: tuple[str, ...]
    world_size: int = 1
    """torchrun's --nproc_per_node: the script runs as rank 0 of a fake process group of this size."""
    launched: bool = False
    """Started by torchrun (its environment variables are set)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables its launcher sets (accelerate's ACCELERATE_* settings), set while it runs."""

    @property
    def name(self) -> str:
        return self.module or Path(self.path or "").name


def parse_command(argv: Sequence[str]) -> ScriptCommand:
    """`python train.py A`, `python -m pkg.train A`, `train.py A` (python3 / a python path also),
    `torchrun --nproc_per_node N train.py A` (also `python -m torch.distributed.run ...`), `accelerate launch ...`
    and `deepspeed ...` (memfit.trace.script_launch), one node."""
    argv = [str(a) for a in argv]
    if launcher_name(argv):
        launch = read_launcher(argv)
        return dataclasses.replace(parse_command(list(launch.argv)), world_size=launch.world_size, launched=True,
                                   env=launch.env)
    if argv and Path(argv[0]).name.startswith("python") and not argv[0].endswith(".py"):
        argv = argv[1:]
    if argv[:2] == ["-m", "torch.distributed.run"]:
        argv = ["torchrun", *argv[2:]]
    if argv and Path(argv[0]).name == "torchrun":
        argv, world_size = torchrun_options(argv[1:])
        return dataclasses.replace(parse_command(argv), world_size=world_size, launched=True)
    if not argv:
        raise ConfigError("no script to trace: give it after `--`, e.g. memfit trace -- python train.py --lr 1e-4")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ConfigError("`python -m` needs a module name")
        return ScriptCommand(path=None, module=argv[1], args=tuple(argv[2:]))
    if argv[0].startswith("-"):
        raise ConfigError(f"python option {argv[0]} is not supported: give the script (or -m module) first")
    path = Path(argv[0]).expanduser()
    if not path.is_file():
        raise ConfigError(f"script not found: {argv[0]}")
    return ScriptCommand(path=str(path), module=None, args=tuple(argv[1:]))


@contextlib.contextmanager
def script_argv(command: ScriptCommand) -> Iterator[None]:
    """sys.argv and sys.path[0] as `python script ARGS` sets them, and its launcher's environment; restored
    afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_env = {name: os.environ.get(name) for name, _ in command.env}
    sys.argv = [command.path or command.module or "", *command.args]
    sys.path.insert(0, str(Path(command.path).resolve().parent) if command.path else os.getcwd())
    os.environ.update(dict(command.env))
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute(command: ScriptCommand) -> None:
    """Run the script as __main__; SystemExit(0 / None) is a normal end."""
    try:
        if command.module is not None:
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(command.path, run_name="__main__")
    except SystemExit as exit_:
        if isinstance(exit_.__context__, KeyboardInterrupt):  # Lightning turns Ctrl-C into sys.exit(1)
            raise KeyboardInterrupt from None
        if exit_.code not in (None, 0):
            raise ConfigError(f"the script exited with {exit_.code!r} before its first optimizer step") from None


# ---- the script's steps --------------------------------------------------------------------------------------------

@dataclass
class StepWatch:
    """Sees the script's forward / backward / optimizer steps through global hooks; calls `on_phase(phase)` as each
    phase begins and `on_step(optimizer)` after each optimizer step; raises _Stop after `steps` steps."""

    steps: int
    on_phase: Callable[[str], None] = lambda phase: None
    on_step: Callable[[Any], None] = lambda optimizer: None
    on_root: Callable[[torch.nn.Module, tuple], None] = lambda module, args: None
    taken: int = 0
    forwards: int = 0
    depth: int = 0
    backward_depth: int = 0
    optimizer_depth: int = 0
    _handles: list = field(default_factory=list)

    def in_step(self) -> bool:
        return bool(self.depth or self.backward_depth or self.optimizer_depth)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post, always_call=True),
                         optim.register_optimizer_step_pre_hook(self._step_pre),
                         optim.register_optimizer_step_post_hook(self._step_post)]
        original = torch.autograd.backward
        torch.autograd.backward = self._backward(original)
        try:
            yield
        finally:
            torch.autograd.backward = original
            for handle in self._handles:
                handle.remove()

    def _pre(self, module, args):
        self.depth += 1
        if self.depth == 1 and not self.backward_depth:  # a recompute inside backward is not a new forward
            self.forwards += 1
            self.on_root(module, args)
            self.on_phase("forward")

    def _post(self, module, args, output):
        self.depth = max(0, self.depth - 1)

    def _backward(self, original):
        def backward(*args, **kwargs):
            if not self.backward_depth:
                self.on_phase("backward")
            self.backward_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.backward_depth -= 1
        return backward

    def _step_pre(self, optimizer, args, kwargs):
        self.optimizer_depth += 1
        if self.optimizer_depth > 1:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self.on_phase("optimizer")
            return None

        def wrapped():  # Lightning's closure runs forward and backward inside step(): the step begins after it
            self.optimizer_depth -= 1
            try:
                return closure()
            finally:
                self.optimizer_depth += 1
                self.on_phase("optimizer")

        return ((args[0], wrapped, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": wrapped})

    def _step_post(self, optimizer, args, kwargs):
        self.optimizer_depth -= 1
        if self.optimizer_depth:
            return
        self.taken += 1
        self.on_step(optimizer)
        if self.taken >= self.steps:
            raise _Stop


def run_steps(command: ScriptCommand, watch: StepWatch, *, install: bool = True) -> None:
    """Run the script until `watch.steps` optimizer steps are done (or it ends); `install=False`: the watch's
    hooks are in place already."""
    with script_argv(command), watch.installed() if install else contextlib.nullcontext():
        try:
            execute(command)
        except _Stop:
            pass
    if not watch.taken:
        raise ConfigError(f"{command.name} ended without an optimizer step (torch.optim): nothing to size")


def check_device(device: str) -> None:
    if device not in _DEVICES:
        raise ConfigError(f"unknown device '{device}': choose one of {', '.join(_DEVICES)}")


# ---- the trace -----------------------------------------------------------------------------------------------------

def trace_script(argv: Sequence[str], *, steps: int = 2, device: str = "cuda", gpu_name: str = "H100",
                 gpu_memory_bytes: int = 80 * 2**30, progress: Callable | None = None,
                 _fake: bool = True) -> MemoryEstimate:
    """The exact per-device tensor peak of the first `steps` optimizer steps of the script `argv` (`["python",
    "train.py", "--lr", "1e-4"]`, `["python", "-m", "pkg.train"]` or `["train.py"]`), run on fake tensors.

    `device="cuda"`: the script sees one CUDA device `gpu_name` of `gpu_memory_bytes` and takes its CUDA path;
    CUDA's kernel choices; host tensors (the data pipeline's) are outside the peak. `device="cpu"`: the script's
    CPU path with CPU kernels and every tensor counted, as a real CPU run's profiler counts them. Result: method
    "traced", tensors only (no CUDA context or allocator reserve: the CLI adds them)."""
    check_device(device)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"steps must be a positive whole number, got {steps!r}")
    command = parse_command(argv)
    notes: list[str] = []
    tracker = StepTracker(host_kinds=_host_kinds(device), num_steps=steps, progress=progress,
                          hidden_scratch=_scratch(device))
    tracker.assume_values = True
    watch = _watch(tracker, steps)
    with contextlib.ExitStack() as stack:
        # _fake=False runs the script for real under the same tracker (a check of the fake run, device="cpu")
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True) if _fake else contextlib.nullcontext())
        stack.enter_context(watch.installed())  # before the tracker's module hooks: the root is named when it runs
        stack.enter_context(tracker)
        stack.enter_context(_environment(device, tracker, watch, gpu_name, gpu_memory_bytes, notes,
                                         command.world_size))
        stack.enter_context(fake_launch(command.world_size, command.world_size > 1 or command.launched, notes,
                                        lambda bucket: tracker.register(bucket, _Kind.GRADIENTS)))
        _run_refusing(command, watch)
    tracker.finish_progress()
    notes.append(f"the script's own setup ({command.name}): the setup fields of this estimate are memfit's defaults "
                 f"and do not describe it; {watch.taken} optimizer step(s) traced, {watch.forwards} forward call(s)")
    notes.append(kernel_note(device))
    if device == "cuda":
        notes.append("tensors the script makes on the CPU (its data pipeline's, before .to(device)) are host memory, "
                     "outside the device peak")
    result = to_estimate(tracker, SimpleNamespace(notes=notes, name=command.name), TrainingSetup(), command.name)
    kept = tuple(note for note in result.notes if not note.startswith(_OFFLOAD_NOTE))  # not an offload here
    return dataclasses.replace(result, notes=kept, cpu_bytes=0)


_OFFLOAD_NOTE = "CPU offload:"


def measured_script_peak(argv: Sequence[str], *, steps: int = 2) -> int:
    """The real CPU peak of the script's first `steps` optimizer steps: live tensor bytes from the profiler's
    allocation events over the whole run, without oneDNN's bf16 matmul scratch (memfit._torch.measure_cpu), as
    memfit's trace tests measure a real step. The ground truth `trace_script(..., device="cpu")` is checked on."""
    from torch.profiler import ProfilerActivity, profile

    command = parse_command(argv)
    watch = StepWatch(steps=steps)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_steps(command, watch)
    return profiled_peak(prof)


def _host_kinds(device: str) -> tuple:
    return (_Kind.HOST_TEMPORARIES,) if device == "cuda" else ()


def _scratch(device: str):
    return hidden_scratch(device)


def _watch(tracker, steps: int) -> StepWatch:
    roots: dict[int, torch.nn.Module] = {}
    optimizers: dict[int, Any] = {}

    def on_root(module, inputs) -> None:
        if id(module) not in roots:
            refuse_unproven(module)
            roots[id(module)] = module
            tracker.watch_module(module)
        for tensor in _leaves(inputs):
            if tracker.on_device(tensor):
                tracker.register(tensor, _Kind.INPUTS)

    def on_phase(phase: str) -> None:
        phase = Phase(phase)
        if phase is Phase.FORWARD and tracker.phase is Phase.FORWARD:
            return
        if phase is Phase.OPTIMIZER:
            for module in roots.values():
                tracker.classify_gradients(module.parameters())
        tracker.mark(phase)

    def on_step(optimizer) -> None:
        optimizers[id(optimizer)] = optimizer
        tracker.classify_optimizer_state(optimizer)

    return StepWatch(steps=steps, on_phase=on_phase, on_step=on_step, on_root=on_root)


def refuse_unproven(module: torch.nn.Module) -> None:
    """A DeepSpeed engine runs on fake tensors but is not proven there: HF Trainer with ZeRO-2 on 2 gloo ranks
    peaks at 2,986,596 B on rank 0 and the trace says 3,577,700 (cause not found), so it is refused, not guessed."""
    if type(module).__name__ == "DeepSpeedEngine" and type(module).__module__.startswith("deepspeed."):
        raise ConfigError("deepspeed.initialize (DeepSpeedEngine): a DeepSpeed script is not traced yet (its "
                          "ZeRO buffers on fake tensors do not match a real run); size it with `memfit plan MODEL "
                          "--zero N --engine deepspeed` or trace the script without DeepSpeed")


def _leaves(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


@contextlib.contextmanager
def _environment(device: str, tracker, watch: StepWatch, gpu_name: str, memory: int,
                 notes: list[str], ranks: int) -> Iterator[None]:

    with contextlib.ExitStack() as stack:
        stack.enter_context(script_env.weightless_loading(notes))
        stack.enter_context(script_env.nothing_saved(notes))
        stack.enter_context(script_env.replacing_module_apply())
        stack.enter_context(script_env.real_run_branches())
        stack.enter_context(script_env.loaders_in_process())
        stack.enter_context(script_env.eager_compile(notes))
        stack.enter_context(_FakeDeepcopy())  # copy.deepcopy of a fake tensor (Lightning's logged results)
        stack.enter_context(device_kernels(device))
        stack.enter_context(routed_experts())
        if device == "cpu":
            stack.enter_context(cpu_rng_states(tracker.see))
        else:
            stack.enter_context(script_env.fake_cuda(gpu_name, memory, lambda: tracker.device_bytes,
                                                     lambda: tracker.peak_bytes, count=ranks))

            def set_host(host: bool) -> bool:
                previous, tracker.host_birth = tracker.host_birth, host
                return previous

            stack.enter_context(script_env.DeviceMap(set_host, tracker.on_device, watch.in_step))
        yield


def _run_refusing(command: ScriptCommand, watch: StepWatch) -> None:
    """run_steps; anything the script raises becomes one line naming the call that failed on fake tensors."""
    try:
        run_steps(command, watch, install=False)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's script can raise anything: it becomes one clear line
        where = _where(error.__traceback__, command)
        message = " ".join(str(error).split())[:300] or type(error).__name__
        raise ConfigError(f"{command.name} cannot run on fake tensors{where}: {type(error).__name__}: "
                          f"{message}") from None


def _where(traceback, command: ScriptCommand) -> str:
    """' at FILE:LINE (CODE)': the script's own last frame, else the last frame outside torch."""
    import traceback as tb

    frames = tb.extract_tb(traceback)
    script = str(Path(command.path).resolve()) if command.path else None
    own = [f for f in frames if script and str(Path(f.filename).resolve()) == script]
    outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename and "memfit" not in f.filename]
    frame = (own or outside or frames or [None])[-1]
    if frame is None:
        return ""
    return f" at {Path(frame.filename).name}:{frame.lineno} ({(frame.line or '').strip()[:80]})"


def script_estimate(argv: Sequence[str], hardware, *, steps: int = 2, progress: Callable | None = None
                    ) -> MemoryEstimate:
    """trace_script on `hardware`'s device (its GPU's name and memory; a CPU device traces the CPU path), with the
    device's runtime overhead (CUDA context, allocator reserve) added as memfit.trace.estimator adds it."""

    device = "cpu" if hardware.is_cpu else "cuda"
    result = trace_script(argv, steps=steps, device=device, gpu_name=hardware.gpu.name,
                          gpu_memory_bytes=hardware.gpu.memory_bytes, progress=progress)
    overhead = runtime_overhead_terms(result.tensor_bytes, TrainingSetup(), hardware)
    return dataclasses.replace(result, terms=result.terms + tuple(overhead), device_name=hardware.gpu.name)
