"""measure(): run real training steps and report their peak memory as a MemoryEstimate (method='measured'), the same
type the analytic estimate and the fake-tensor trace return, so prediction and truth compare directly.

torch is imported inside the function only: importing memfit never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .errors import ConfigError
from .estimate.result import Category, MemoryEstimate, Phase, Term, TimelinePoint
from .estimate.terms import TermKey
from .setup import TrainingSetup

TERM_CATEGORIES: dict[str, Category] = {
    "parameters": Category.PARAMETERS,
    "buffers": Category.PARAMETERS,
    "gradients": Category.GRADIENTS,
    "optimizer": Category.OPTIMIZER,
    TermKey.MASTER_WEIGHTS: Category.OPTIMIZER,
    "activations": Category.ACTIVATIONS,
    "inputs": Category.ACTIVATIONS,
    "temporaries": Category.TEMPORARIES,
    TermKey.PREEXISTING: Category.TEMPORARIES,
    TermKey.ALLOCATOR_RESERVE: Category.OVERHEAD,
    TermKey.ONEDNN_SCRATCH: Category.OVERHEAD,
}
ALWAYS_SHOWN = ("parameters", "gradients", "optimizer", "activations", "temporaries")

TERM_FORMULAS = {
    "parameters": "distinct parameter storages",
    "buffers": "registered buffers (rotary tables, position ids)",
    "gradients": "p.grad storages alive at the peak",
    "optimizer": "optimizer.state tensors (and bitsandbytes quantisation maps)",
    TermKey.MASTER_WEIGHTS: "fp32 master copy of the bf16 parameters",
    "activations": "allocated in forward and still alive when backward starts",
    "inputs": "the batch tensors",
    "temporaries": "every other allocation alive at the peak",
    TermKey.PREEXISTING: "live before the step, owned by nobody memfit knows, freed during it",
    TermKey.ALLOCATOR_RESERVE: "max_memory_reserved - max_memory_allocated",
    TermKey.ONEDNN_SCRATCH: "what a bf16 matmul's oneDNN scratchpad added to the CPU peak (ISA-dependent: none "
                               "with AVX2 only; not in the tensor figures, as a CUDA step has no such buffer)",
}


Progress = Callable[[str, float], None]
"""progress(what is happening, fraction done in [0, 1]): the CLI draws it on stderr; the library never prints."""

PHASE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}


def measure(model_or_config, setup: TrainingSetup, *, steps: int = 2, device=None, batches=None, optimizer=None,
            loss_fn=None, progress: Progress | None = None) -> MemoryEstimate:
    """Run `steps` real optimizer steps and return their peak memory, broken down at the moment of the peak.

    `model_or_config`: an nn.Module (measured as it is: call `apply_` first to change it) or an HF config dict (built
    with random weights by `build_hf_model`, on CUDA when available unless `device` says otherwise). The model runs in
    train mode and its weights really change. `setup` may be a TrainingSetup or a Plan (its `final_setup`).
    `batches`: one batch dict (reused) or a list of grad_accum_steps; made from the model's vocabulary when omitted
    (a plain nn.Module needs them). `optimizer`: built from `setup` when omitted. `loss_fn(model, batch) -> loss`.

    The first step creates the optimizer state; the result is the peak over all steps (normally step 2's, the
    steady state) and its notes give each step's peak. On CPU the numbers come from torch.profiler's allocation
    events and the total equals the profiler's peak of live bytes exactly; on CUDA from the caching allocator.
    A CPU step runs on one intra-op thread whatever the machine, its load or OMP_NUM_THREADS (memfit._torch.threads:
    the CPU flash attention's scratch is per thread, so the peak would change with the count). `progress(message,
    fraction)` is called as the model is built and each phase of each step begins.
    """
    setup = getattr(setup, "final_setup", setup)
    if not isinstance(setup, TrainingSetup):
        raise ConfigError(f"measure needs a TrainingSetup (or a Plan), got {type(setup).__name__}")
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive whole number, got {steps!r}")
    from ._torch.threads import step_threads

    report = progress or (lambda message, fraction: None)
    with step_threads():
        model, name, notes = _resolve_model(model_or_config, setup, device, report)
        return _measure_model(model, name, notes, setup, steps, batches, optimizer, loss_fn, report)


def _measure_model(model, name: str, notes: list[str], setup: TrainingSetup, steps: int, batches, optimizer,
                   loss_fn, report: Progress) -> MemoryEstimate:
    import torch

    from ._torch import step as torch_step

    where = torch_step.model_device(model)
    if where.type not in ("cpu", "cuda"):
        raise ConfigError(f"measure reads memory on cpu (torch.profiler) and cuda (the caching allocator), not on "
                          f"{where.type}: pass device='cpu' or a model on one of those")
    if batches is None:
        batches = _default_batches(model, setup, where)
    if optimizer is None:
        optimizer = torch_step.make_optimizer(model, setup)
    notes += list(getattr(optimizer, "memfit_notes", ()))

    def on_phase(step: int, phase: str) -> None:
        report(f"measuring step {step} of {steps}: {phase}", (step - 1 + PHASE_ORDER.get(phase, 0) / 3) / steps)

    was_training = model.training
    model.train()
    try:
        if where.type == "cuda":
            from ._torch.measure_cuda import measure_cuda_steps

            measured, losses = measure_cuda_steps(model, optimizer, batches, setup, steps=steps, loss_fn=loss_fn,
                                                  device=where, on_phase=on_phase)
            device_name = torch.cuda.get_device_name(where)
        else:
            from ._torch.measure_cpu import measure_cpu_steps
            from ._torch.replay import summarise

            result, losses = measure_cpu_steps(model, optimizer, batches, setup, steps=steps, loss_fn=loss_fn,
                                               on_phase=on_phase)
            report("replaying the profiler's allocation events", 1.0)
            measured = summarise(result)
            device_name = str(where)
            threads = torch.get_num_threads()
            notes.append(f"measured on {threads} intra-op thread{'s' * (threads != 1)}: CPU kernels' per-thread "
                         "scratch (flash attention, oneDNN) would move the peak with the count (memfit._torch.threads)")
    finally:
        model.train(was_training)
    notes += list(measured.notes)
    notes.append("peak per step: " + ", ".join(f"step {i}: {b:,} B" for i, b in enumerate(measured.step_peaks, 1))
                 + " (step 1 creates the optimizer state)")
    notes.append("losses: " + ", ".join(f"{loss:.4f}" for loss in losses))
    return _estimate(measured, setup, notes, name, device_name)


def _resolve_model(model_or_config, setup: TrainingSetup, device, report: Progress) -> tuple[object, str, list[str]]:
    import torch

    from ._torch import step as torch_step

    if isinstance(model_or_config, Mapping):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        report(f"building the model with random weights on {device}", 0.0)
        model = torch_step.build_hf_model(dict(model_or_config), setup, device=device)
        name = model_or_config.get("_name_or_path") or model_or_config.get("model_type", "model")
        return model, str(name), [f"built from a config with random weights ({model.__class__.__name__})"]
    if not isinstance(model_or_config, torch.nn.Module):
        raise ConfigError(f"measure takes an nn.Module or an HF config dict, got {type(model_or_config).__name__}")
    if device is not None and torch_step.model_device(model_or_config) != torch.device(device):
        model_or_config.to(device)
    config = getattr(model_or_config, "config", None)
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or type(model_or_config).__name__
    return model_or_config, str(name), []


def _default_batches(model, setup: TrainingSetup, device) -> list:
    import torch

    from ._torch.step import is_image_classifier, make_batch

    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None) is None and not is_image_classifier(config):
        raise ConfigError("measure needs batches= for a model without an HF config: one dict of tensors its forward "
                          "takes (or a list of grad_accum_steps of them)")
    from .estimate.padding import peak_setup

    generator = torch.Generator().manual_seed(0)
    longest = peak_setup(setup)  # batches padded to their longest sample: the one that sets the run's peak
    return [make_batch(config, longest, device=device, generator=generator) for _ in range(setup.grad_accum_steps)]


def _estimate(measured, setup: TrainingSetup, notes: list[str], name: str, device_name: str) -> MemoryEstimate:
    names = list(ALWAYS_SHOWN) + sorted(t for t, b in measured.peak_terms.items() if t not in ALWAYS_SHOWN and b)
    terms = tuple(Term(t, _category(t), measured.peak_terms.get(t, 0), TERM_FORMULAS.get(t, ""), "measured")
                  for t in names)
    timeline = tuple(TimelinePoint(index, Phase(phase), _by_category(by_term), label)
                     for index, (phase, label, by_term) in enumerate(measured.timeline))
    return MemoryEstimate(terms=terms, peak_phase=Phase(measured.peak_phase), method="measured", setup=setup,
                          phase_peaks={Phase(p): b for p, b in measured.phase_peaks.items()}, notes=tuple(notes),
                          timeline=timeline, model_name=name, device_name=device_name)


def _category(term: str) -> Category:
    return TERM_CATEGORIES.get(term, Category.TEMPORARIES)


def _by_category(by_term: dict[str, int]) -> dict[Category, int]:
    totals = {c: 0 for c in Category}
    for term, num_bytes in by_term.items():
        totals[_category(term)] += num_bytes
    return totals


# ------------------------------------------------------------------------------- host RAM, before building on CPU


def available_host_ram() -> int | None:
    """Bytes of RAM this machine can give a new allocation now: psutil's `available`, else /proc/meminfo
    MemAvailable, else free pages from os.sysconf; None where none of them answers."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - not installed, or no reading on this platform
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def host_ram() -> int:
    """This machine's total physical RAM in bytes (the CPU 'device' capacity for a diagnosis)."""
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:  # noqa: BLE001
            return available_host_ram() or 1


def check_host_ram(spec, setup: TrainingSetup) -> int:
    """Refuse, with one line, to build and step a model on the CPU when the analytic estimate of its step (on a
    CPU device) exceeds the RAM available now: the process would be killed by the OS with no message. Returns the
    estimated bytes."""
    from .estimate.analytic import estimate
    from .hardware import cpu_device, make_hardware
    from .units import GiB

    available = available_host_ram()
    if available is not None:  # the weights, gradients and optimizer states first: arithmetic, no derive
        from .estimate.static import full_static

        static = full_static(spec, setup)
        floor = (static.params_bytes + static.grads_bytes + static.states_bytes + static.master_bytes
                 + static.frozen_bytes)
        if floor > available:
            raise ConfigError(f"measuring {spec.name} on the CPU needs over {floor / GiB:.1f} GiB of host RAM "
                              f"(weights, gradients and optimizer states alone), {available / GiB:.1f} GiB "
                              "available; use a smaller model or `memfit trace` (fake tensors, no RAM for the model)")
    needed = estimate(spec, setup, make_hardware(cpu_device(max(host_ram(), 1)))).total_bytes
    if available is not None and needed > available:
        raise ConfigError(f"measuring {spec.name} on the CPU needs ~{needed / GiB:.1f} GiB of host RAM, "
                          f"{available / GiB:.1f} GiB available; use a smaller model or `memfit trace` "
                          "(fake tensors, no RAM for the model)")
    return needed
