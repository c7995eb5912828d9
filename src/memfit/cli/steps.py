"""Commands that run the step itself: `memfit trace` (fake tensors, exact) and `memfit measure` (real tensors).
They import torch, inside the command, and only when called."""


from typing import Annotated, Optional

import typer

from ..errors import ConfigError, MissingDependencyError
from .common import app, check_report_paths, console, examples, print_json, resolve, write_reports
from .progress import progress_bar
from .options import (OUTPUT_PANEL, JsonOpt, ModelArg, PngOpt, ReportOpt, SetupOptions, VerboseOpt, whole_number,
                      with_setup_options)

StepsOpt = Annotated[int, typer.Option(
    "--steps", parser=whole_number(100), metavar="N", rich_help_panel=OUTPUT_PANEL,
    help="Training steps to run (the first creates the optimizer state).")]
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", metavar="cpu|cuda", rich_help_panel=OUTPUT_PANEL, show_default=False,
    help="Where `measure` runs the real step (default: cuda when available, else cpu).")]


def _model_config(model: str, spec) -> dict:
    """The config the real model is built from: a sequence classifier's as --task rewrote it (its graph's), else
    the reference's."""
    from ..sources import hf_config_dict

    if spec.num_labels and isinstance(getattr(spec.graph, "config", None), dict):
        return dict(spec.graph.config)
    return hf_config_dict(model)  # a catalog name, a config.json (or its folder) or a hub id, like resolve_model


def _require_torch(feature: str) -> None:
    # transformers' config warnings stay off stderr unless `memfit --verbose` (common.quiet_libraries)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"{feature} runs the real step and needs torch: pip install 'memfit[torch]'")


def run_trace(model: str, spec, setup, hardware, *, steps: int = 2, progress: bool = True):
    """Trace `model` (a CLI model reference) under `setup`, with the device's runtime overhead added like any other
    estimate (memfit.trace.traced_estimator); a progress bar on stderr while it runs (unless `progress` is False,
    or memfit.cli.progress hides it)."""
    _require_torch("memfit trace")
    from ..trace import traced_estimator

    from ..derive.cache import one_line_failure

    config = _model_config(model, spec)
    with progress_bar("tracing on fake tensors") as bar, one_line_failure(config, spec.name, everything=False):
        report = bar if progress else None  # one_line_failure: a config attribute the model reads is one line
        advance = (lambda event: report(event.message, event.fraction)) if report is not None else None
        return traced_estimator(config, steps=steps, progress=advance)(spec, setup, hardware)


@app.command("trace", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog=examples(
    "memfit trace llama-3.2-1b -b 4 -s 2048",
    "memfit trace llama-2-70b --gpu H100 --gpus 8 --zero zero3 --precision bf16 --checkpointing full",
    "memfit trace gpt2 --report gpt2.html --png gpt2.png",
    "memfit trace --gpu A100-80GB -- python train.py --lr 1e-4"))
@with_setup_options
def trace_command(ctx: typer.Context, model: ModelArg, opts: SetupOptions, steps: StepsOpt = 2,
                  json_output: JsonOpt = False, verbose: VerboseOpt = False, report: ReportOpt = None,
                  png: PngOpt = None) -> None:
    """Run the real training step on fake tensors (no GPU, no weights) and report its exact per-GPU peak,
    timeline and the modules whose activations dominate, next to the analytic estimate.

    After `--`, your own training script instead (`python train.py ARGS`, `python -m pkg.train ARGS`, `torchrun
    --nproc_per_node N train.py ARGS`): its first --steps optimizer steps run on fake tensors, on the --gpu."""
    from ..diagnose import diagnose
    from ..verify import cross_check

    check_report_paths(report, png)
    script = _script_argv(ctx, model)
    if script is not None:
        from .script import trace_script_command

        return trace_script_command(script, opts, steps=steps, json_output=json_output, verbose=verbose,
                                    report=report, png=png)
    spec, setup, hardware = resolve(model, opts)
    traced = run_trace(model, spec, setup, hardware, steps=steps, progress=not json_output)
    check = cross_check(spec, setup, hardware, traced, margin=opts.margin_fraction) if spec.is_transformer else None
    diagnosis = diagnose(traced, hardware, margin=opts.margin_fraction)
    written = write_reports(traced, report, png, hardware=hardware, margin=opts.margin_fraction)
    if json_output:
        print_json({"model": spec.name, "gpu": hardware.gpu.name, "setup": setup.to_dict(),
                    "traced": traced.to_dict(), "analytic": check.asked.to_dict() if check else None,
                    "cross_check": check.to_dict() if check else None,
                    "diagnosis": diagnosis.to_dict(), "written": written})
        return
    from .. import render

    out = console()
    render.trace_report(out, spec, setup, hardware, traced, diagnosis, check, verbose=verbose)
    if written:
        render.emitted(out, written)


def _script_argv(ctx: typer.Context, model: str) -> list[str] | None:
    """The user's command after `--` (then MODEL is its first word), or None; stray extra words are a mistake."""
    argv = list(getattr(ctx.find_root().command, "argv", []))
    if "--" in argv:
        script = argv[argv.index("--") + 1:]
        if script and script[0] == model and list(ctx.args) == script[1:]:
            return script
        raise ConfigError("give either a MODEL or a script after `--`, not both "
                          "(memfit trace -- python train.py ARGS)")
    options = [arg for arg in ctx.args if arg.startswith("-")]
    if options:
        raise ConfigError(f"No such option: {options[0]}")
    if ctx.args:
        raise ConfigError(f"unexpected extra arguments: {' '.join(ctx.args)} (a training script goes after `--`: "
                          "memfit trace -- python train.py ARGS)")
    return None


@app.command("measure", epilog=examples(
    "memfit measure gpt2 -b 2 -s 256 --precision fp32 --optimizer adamw",
    "memfit measure ./tiny/config.json --device cpu --json",
    "memfit measure llama-3.2-1b --gpu H100 --device cuda -b 4 -s 2048"))
@with_setup_options
def measure_command(model: ModelArg, opts: SetupOptions, steps: StepsOpt = 2, device: DeviceOpt = None,
                    json_output: JsonOpt = False) -> None:
    """Build the model with random weights, run real training steps on this machine, and print the measured peak
    and breakdown next to memfit's prediction (CPU: profiler memory events; CUDA: the caching allocator)."""
    from ..diagnose import diagnose
    from ..estimate.analytic import estimate
    from ..hardware import cpu_device, make_hardware
    from ..measure import check_host_ram, host_ram

    if device not in (None, "cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got '{device}'")
    spec, setup, hardware = resolve(model, opts)
    if device == "cpu":  # refuse a model this machine cannot hold before importing torch or building anything
        check_host_ram(spec, setup)
    _require_torch("memfit measure")
    import torch

    from ..measure import measure

    where = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if where == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch on this machine")
    if where == "cpu":
        if device is None:
            check_host_ram(spec, setup)
        hardware = make_hardware(cpu_device(host_ram()))
    with progress_bar(f"measuring {spec.name} on {where}") as bar:
        measured = measure(_model_config(model, spec), setup, steps=steps, device=where, progress=bar)
    predicted = estimate(spec, setup, hardware)
    diagnosis = diagnose(measured, hardware, margin=opts.margin_fraction)
    if json_output:
        print_json({"model": spec.name, "device": where, "setup": setup.to_dict(),
                    "measured": measured.to_dict(), "analytic": predicted.to_dict(),
                    "error": (predicted.tensor_bytes - measured.tensor_bytes) / measured.tensor_bytes})
        return
    from .. import render

    render.measure_report(console(), spec, setup, hardware, measured, predicted, diagnosis)
