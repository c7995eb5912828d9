"""The memfit commands: parse -> library call -> render. Each command is one small function; a new one (trace,
measure, launch) is another `@app.command` function, taking `opts: SetupOptions` to get the shared options.

Heavy modules (the planner, emitters, rich rendering) are imported inside the commands, so `memfit --help` and
every command start fast; nothing here imports torch, transformers or plotly."""

import json
import logging
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from ..errors import ConfigError, MemfitError
from .options import OUTPUT_PANEL, JsonOpt, ModelArg, PngOpt, ReportOpt, SetupOptions, VerboseOpt, with_setup_options

try:  # typer >= 0.2x vendors click; its parser errors derive from TyperException
    from typer import TyperException as CommandLineError
except ImportError:  # pragma: no cover - older typer raises click's own exceptions
    from click import ClickException as CommandLineError

USER_ERROR = 2


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


class OneLineErrors(TyperGroup):
    """Every user mistake, from click's parser or from memfit, is one `error: ...` line on stderr and exit code 2.
    Unexpected exceptions (bugs) still raise, so they are reported with their traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra) -> Any:
        try:
            result = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                  standalone_mode=False, **extra)
        except CommandLineError as error:
            if type(error).__name__ == "NoArgsIsHelpError":
                return _finish(0, standalone_mode)  # typer printed the help while the error was built
            result = _report(error.format_message(), _help_hint(error))
        except MemfitError as error:
            result = _report(str(error))
        except typer.Abort:
            typer.echo("aborted", err=True)
            result = 1
        return _finish(result, standalone_mode)


def _finish(result: Any, standalone_mode: bool) -> Any:
    if not standalone_mode:
        return result
    sys.exit(result if isinstance(result, int) else 0)


def _help_hint(error: Exception) -> str:
    """Where to look, for mistakes in the command's shape (a bad value's message already says what to give)."""
    ctx = getattr(error, "ctx", None)
    if ctx is None or getattr(error, "exit_code", 0) != USER_ERROR or type(error).__name__ == "BadParameter":
        return ""
    return f" (see `{ctx.command_path} --help`)"


def _report(message: str, hint: str = "") -> int:
    typer.echo(f"error: {_one_line(message)}{hint}", err=True)
    return USER_ERROR


app = typer.Typer(
    name="memfit", cls=OneLineErrors, pretty_exceptions_enable=False, no_args_is_help=True,
    rich_markup_mode="rich", context_settings={"help_option_names": ["-h", "--help"]},
    help="Know before you run: where GPU memory goes in a training step, what the bottleneck is, and the "
         "cheapest ordered fix (mixed precision -> 8-bit Adam -> ZeRO; checkpointing -> micro-batch + "
         "accumulation -> FlashAttention; CPU offload).",
    epilog="Start with: [bold]memfit plan llama-3.1-8b --gpu A100-80GB[/bold]",
)


def _examples(*lines: str) -> str:
    """An epilog typer prints one example per line (its rich mode joins single newlines)."""
    return "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  [cyan]{line}[/cyan]" for line in lines)


def _resolve(model: str, opts: SetupOptions):
    from ..sources import resolve_model

    # huggingface_hub logs each retry of an unreachable Hub; the failure itself becomes one error line.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)

    spec = resolve_model(model)
    hardware = opts.hardware()
    return spec, opts.setup(spec, hardware), hardware


def _print_json(data: dict) -> None:
    typer.echo(json.dumps(data, indent=2))


def _console(*, stderr: bool = False):
    from .. import render

    return render.make_console(stderr=stderr)


OptimizeOpt = Annotated[bool, typer.Option(
    "--optimize", rich_help_panel=OUTPUT_PANEL,
    help="Also search every combination of the techniques for the fitting setup with the best modelled throughput, "
         "and show where it differs from the ladder's.")]
EmitOpt = Annotated[Optional[Path], typer.Option(
    "--emit", metavar="DIR", rich_help_panel=OUTPUT_PANEL, file_okay=False, dir_okay=True, show_default=False,
    help="Write the final setup's engine configs (TrainingArguments, DeepSpeed, accelerate...) into DIR.")]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", rich_help_panel=OUTPUT_PANEL,
    help="Re-check the final setup with `memfit trace` (the real step on fake tensors; needs torch) and show both.")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", rich_help_panel=OUTPUT_PANEL,
    help="With --emit: overwrite files in DIR that memfit did not write.")]


@app.command("plan", epilog=_examples(
    "memfit plan llama-3.1-8b",
    "memfit plan llama-2-70b --gpu H100 --gpus 8",
    "memfit plan mistral-7b --gpu 24GiB -b 4 -s 4096 --optimize",
    "memfit plan ./my-model/config.json --gpu L4 --precision bf16 --json",
    "memfit plan Qwen/Qwen2.5-7B --gpus 4 --emit configs/"))
@with_setup_options
def plan_command(model: ModelArg, opts: SetupOptions, optimize: OptimizeOpt = False, json_output: JsonOpt = False,
                 verbose: VerboseOpt = False, emit: EmitOpt = None, force: ForceOpt = False,
                 verify: VerifyOpt = False, report: ReportOpt = None, png: PngOpt = None) -> None:
    """Diagnose a training step and walk the decision ladder until it fits.

    Options not given take a typical fine-tune's values, and the output says which were assumed.
    """
    from ..plan import optimize as search_optimal
    from ..plan import plan as make_plan

    spec, setup, hardware = _resolve(model, opts)
    result = make_plan(spec, setup, hardware, margin=opts.margin_fraction)
    choice = (search_optimal(spec, setup, hardware, margin=opts.margin_fraction, reference=result.final_setup)
              if optimize else None)
    written = _emit(result.final_setup, hardware, emit, force) if emit is not None else []
    traced = None
    if verify:
        from .steps import run_trace

        traced = run_trace(model, spec, result.final_setup, hardware, progress=not json_output)
    reports = write_reports(result, report, png, trace=traced)
    if json_output:
        data = result.to_dict()
        if optimize:
            data["optimized"] = _optimized_dict(choice)
        if emit is not None:
            data["emitted"] = written
        data["launch"] = _launch_dict(result)
        if verify:
            data["verified"] = _verified_dict(result.final_estimate, traced)
        if reports:
            data["reports"] = reports
        _print_json(data)
        return
    from .. import render

    console = _console()
    render.plan_report(console, result, verbose=verbose, optimize_requested=optimize, optimized_choice=choice,
                       config_snippets=_snippets(result.final_setup, render, emitted=emit is not None),
                       emitted_paths=written + reports)
    if traced is not None:
        render.verification(console, result.final_estimate, traced)


@app.command("estimate", epilog=_examples(
    "memfit estimate llama-3.1-8b",
    "memfit estimate gpt2 --gpu T4 -b 16 -s 1024 --precision amp-fp16",
    "memfit estimate llama-3.1-8b --gpus 8 --zero zero3 --checkpointing full --json"))
@with_setup_options
def estimate_command(model: ModelArg, opts: SetupOptions, json_output: JsonOpt = False,
                     verbose: VerboseOpt = False) -> None:
    """The per-GPU memory breakdown of one training step, and its diagnosis (no plan)."""
    from ..diagnose import diagnose
    from ..estimate.analytic import estimate

    spec, setup, hardware = _resolve(model, opts)
    result = estimate(spec, setup, hardware)
    diagnosis = diagnose(result, hardware, margin=opts.margin_fraction)
    if json_output:
        _print_json({"model": spec.name, "num_params": spec.num_params, "gpu": hardware.gpu.name,
                     "gpu_memory_bytes": hardware.gpu.memory_bytes, "world_size": hardware.world_size,
                     "setup": setup.to_dict(), "estimate": result.to_dict(), "diagnosis": diagnosis.to_dict()})
        return
    from .. import render

    render.estimate_report(_console(), spec, setup, hardware, result, diagnosis, verbose=verbose)


@app.command("models", epilog=_examples("memfit models", "memfit models --json"))
def models_command(json_output: JsonOpt = False) -> None:
    """The built-in model catalog (offline): name, size and shape."""
    from ..sources import catalog_entry, catalog_names

    entries = [catalog_entry(name) for name in catalog_names()]
    if json_output:
        _print_json({"models": entries})
        return
    from .. import render

    render.models_table(_console(), entries)


@app.command("gpus", epilog=_examples("memfit gpus", "memfit gpus --verbose", "memfit gpus --json"))
def gpus_command(json_output: JsonOpt = False, verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", rich_help_panel=OUTPUT_PANEL, help="Show each entry's full source.")] = False) -> None:
    """The GPU catalog: usable memory as the driver reports it, and where each figure comes from."""
    import dataclasses

    from ..hardware import gpu_catalog

    gpus = sorted(gpu_catalog().values(), key=lambda g: (g.memory_bytes, g.name))
    if json_output:
        _print_json({"gpus": [{**dataclasses.asdict(g), "aliases": list(g.aliases)} for g in gpus]})
        return
    from .. import render

    render.gpus_table(_console(), gpus, verbose=verbose)


def _emit(setup, hardware, directory: Path, force: bool) -> list[str]:
    try:
        from ..emit import write_all
    except ImportError:
        raise ConfigError("--emit needs memfit.emit, which this install does not have") from None
    try:
        return [str(path) for path in write_all(setup, hardware, directory, force=force)]
    except OSError as error:
        raise ConfigError(f"cannot write the configs into {directory}: {error.strerror or error}") from None


def _snippets(setup, render, *, emitted: bool) -> dict[str, str]:
    """HF kwargs always; the DeepSpeed JSON when the setup shards or offloads. Empty without memfit.emit."""
    try:
        from ..emit import deepspeed_config, hf_model_kwargs, hf_trainer_kwargs, uses_deepspeed
    except ImportError:
        return {}
    items = {"transformers.TrainingArguments (add output_dir, schedule):":
             render.python_call("TrainingArguments", hf_trainer_kwargs(setup)),
             "model loading:": render.python_call("AutoModelForCausalLM.from_pretrained", hf_model_kwargs(setup))}
    if uses_deepspeed(setup):
        try:
            items["deepspeed.json:"] = render.compact_json(deepspeed_config(setup, hf_auto=True))
        except MemfitError as error:
            items["deepspeed.json: not expressible"] = str(error)
    if not emitted:
        items["all engine files (accelerate, FSDP2, README):"] = "memfit plan ... --emit DIR"
    return items


def _launch_dict(result) -> dict | None:
    """Per-rank memory, per-node commands and communication per step for more than one GPU (memfit.launch)."""
    from ..launch import launch_section

    section = launch_section(result)
    return section.to_dict() if section is not None else None


def _optimized_dict(choice) -> dict | None:
    if choice is None:
        return None
    return {"setup": choice.setup.to_dict(), "total_bytes": choice.estimate.total_bytes,
            "relative_step_time": choice.relative_step_time, "differences": list(choice.differences),
            "estimate": choice.estimate.to_dict()}


def _verified_dict(analytic, traced) -> dict:
    return {"traced": traced.to_dict(), "analytic_tensor_bytes": analytic.tensor_bytes,
            "traced_tensor_bytes": traced.tensor_bytes,
            "error": (analytic.tensor_bytes - traced.tensor_bytes) / traced.tensor_bytes}


def write_reports(obj, report: Path | None, png: Path | None, **kwargs) -> list[str]:
    """--report / --png for a Plan or a traced estimate; returns the paths written."""
    if report is None and png is None:
        return []
    try:
        from .. import report as reporting
    except ImportError:
        raise ConfigError("--report/--png need memfit.report (pip install 'memfit[report]')") from None
    written = []
    try:
        if report is not None:
            written.append(str(reporting.write_html(obj, report, **kwargs)))
        if png is not None:
            written.append(str(reporting.write_png(obj, png, **kwargs)))
    except ImportError as error:
        raise ConfigError(f"the report needs {error.name}: pip install 'memfit[report]'") from None
    except OSError as error:
        raise ConfigError(f"cannot write the report: {error.strerror or error}") from None
    return written


def main() -> None:
    app()


# Commands in other modules register themselves on `app` when imported (they import from this module).
from . import steps  # noqa: E402,F401  (trace, measure)
from . import launch  # noqa: E402,F401  (launch)
