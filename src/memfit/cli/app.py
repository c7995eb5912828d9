"""The memfit commands: parse -> library call -> render. Each command is one small function; a new one (trace,
measure, launch) is another `@app.command` function on `common.app`, taking `opts: SetupOptions` to get the shared
options. This module registers plan, estimate, models and gpus, and imports steps.py and launch.py so they register
theirs; those two import from common.py, never from here.

Heavy modules (the planner, emitters, rich rendering) are imported inside the commands, so `memfit --help` and
every command start fast; nothing here imports torch, transformers or plotly."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..diagnose import diagnose
from ..errors import ConfigError
from . import progress
from .common import (DOES_NOT_FIT, app, check_report_paths, console, examples, print_json, quiet_libraries, resolve,
                     write_reports)
from .options import OUTPUT_PANEL, JsonOpt, ModelArg, PngOpt, ReportOpt, SetupOptions, VerboseOpt, with_setup_options

OptimizeOpt = Annotated[bool, typer.Option(
    "--optimize", rich_help_panel=OUTPUT_PANEL,
    help="Also search every combination of the techniques for the fitting setup with the best modelled throughput, "
         "and show where it differs from the ladder's.")]
EmitOpt = Annotated[Optional[Path], typer.Option(
    "--emit", metavar="DIR", rich_help_panel=OUTPUT_PANEL, file_okay=False, dir_okay=True, show_default=False,
    help="Write the final setup's engine configs (TrainingArguments, DeepSpeed, accelerate...) into DIR; with "
         "--optimize, the throughput-optimal setup's. A plan that does not fit still writes them, marked so, and "
         "exits 1.")]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", rich_help_panel=OUTPUT_PANEL,
    help="Re-check the final setup with `memfit trace` (the real step on fake tensors; needs torch) and show both.")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", rich_help_panel=OUTPUT_PANEL,
    help="With --emit: overwrite files in DIR that memfit did not write.")]


@app.callback()
def global_options(
        ctx: typer.Context,
        verbose: Annotated[bool, typer.Option(
            "--verbose", help="Also show the libraries' own warnings and logs (torch, transformers, torchao) on "
                              "stderr: memfit keeps them out by default. A command's own --verbose / -v does "
                              "too.")] = False,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="No progress bars on stderr (they are drawn only on a terminal, and never with "
                                  "--json).")] = False) -> None:
    # No docstring: typer would print it instead of the app's help. Runs before every command, before the command's
    # own options are parsed: its --verbose is looked for in the command line (OneLineErrors.main keeps it).
    progress.hide(quiet)
    progress.install()
    argv = getattr(ctx.command, "argv", [])
    options = argv[:argv.index("--")] if "--" in argv else argv
    if not (verbose or "--verbose" in options or "-v" in options):
        quiet_libraries()


@app.command("plan", epilog=examples(
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

    Options not given take a typical fine-tune's values, and the output says which were assumed. Exit code 0: the
    plan fits; 1: it does not (the answer is still printed, and --emit still writes the configs, marked so);
    2: a mistake in the command.
    """
    from ..plan import optimize as search_optimal
    from ..plan import plan as make_plan
    from ..plan_output import NOT_SEARCHED, plan_json

    check_report_paths(report, png)
    spec, setup, hardware = resolve(model, opts)
    result = make_plan(spec, setup, hardware, margin=opts.margin_fraction, explicit=opts.explicit, keep=opts.keep)
    choice = (search_optimal(spec, setup, hardware, margin=opts.margin_fraction, reference=result.final_setup,
                             explicit=opts.explicit, keep=opts.keep)
              if optimize else None)
    chosen, which = (choice.setup, "optimized") if choice is not None else (result.final_setup, "final")
    fits = result.fits or choice is not None
    warning = None if fits else (f"memfit plan: {result.final_diagnosis.summary()}. Nothing on the ladder makes "
                                 "it fit: this setup will run out of memory as it is.")
    written, unmarked = (_emit(chosen, hardware, emit, force, warning, spec) if emit is not None
                         else ([], {}))
    traced = None
    if verify:
        from .steps import run_trace

        from ..verify import cross_check

        traced = cross_check(spec, result.final_setup, hardware,
                             run_trace(model, spec, result.final_setup, hardware, progress=not json_output),
                             margin=opts.margin_fraction)
    reports = write_reports(result, report, png, trace=traced.traced if traced is not None else None)
    setup_file = _setup_file(emit, written)
    if json_output:
        print_json(plan_json(result, optimized=choice if optimize else NOT_SEARCHED, verified=traced,
                             emitted=written if emit is not None else None, reports=reports, emitted_setup=which,
                             emitted_warning=warning, setup_file=setup_file))
    else:
        _print_plan(result, chosen, which, optimize=optimize, choice=choice, verbose=verbose, emit_dir=emit,
                    written=written, unmarked=unmarked, warning=warning, reports=reports, traced=traced,
                    setup_file=setup_file)
    if not fits:
        raise typer.Exit(DOES_NOT_FIT)


def _setup_file(emit: Path | None, written: list[str]) -> str | None:
    """How the launch commands name the memfit_setup.json --emit wrote (relative to where memfit runs), or None."""
    from ..launch import SETUP_FILE

    if emit is None or not any(Path(path).name == SETUP_FILE for path in written):
        return None
    from ..emit import config_path

    return config_path(emit, SETUP_FILE)


def _print_plan(result, chosen, which: str, *, optimize: bool, choice, verbose: bool, emit_dir: Path | None,
                written: list[str], unmarked: dict[str, str], warning: str | None, reports: list[str],
                traced, setup_file: str | None) -> None:
    from .. import render
    from ..config_snippets import config_snippets

    out = console()
    title = ("Configuration for the --optimize setup" if which == "optimized" else
             "Configuration for the final setup")
    notes = []
    if written:
        notes.append("these files hold the --optimize setup (throughput-optimal), not the ladder's final one"
                     if which == "optimized" else "these files hold the ladder's final setup")
    if written and warning:
        note = "DOES NOT FIT: every file says so at its top"
        if unmarked:
            note += (", except " + "; ".join(f"{name} ({why})" for name, why in unmarked.items())
                     + ": README.md says it for them")
        notes.append(note)
    render.plan_report(out, result, verbose=verbose, optimize_requested=optimize, optimized_choice=choice,
                       config_snippets=config_snippets(chosen, emitted=emit_dir, auto_class=result.spec.auto_class,
                                                       hub_id=result.spec.extra.get("hub_id"),
                                                       model_type=result.spec.model_type),
                       config_title=title,
                       show_config=result.fits or which == "optimized", emitted_paths=written + reports,
                       emitted_notes=notes, setup_file=setup_file)
    if traced is not None:
        render.verification(out, traced)


@app.command("estimate", epilog=examples(
    "memfit estimate llama-3.1-8b",
    "memfit estimate gpt2 --gpu T4 -b 16 -s 1024 --precision amp-fp16",
    "memfit estimate llama-3.1-8b --gpus 8 --zero zero3 --checkpointing full --json"))
@with_setup_options
def estimate_command(model: ModelArg, opts: SetupOptions, json_output: JsonOpt = False,
                     verbose: VerboseOpt = False) -> None:
    """The per-GPU memory breakdown of one training step, and its diagnosis (no plan)."""
    from ..estimate.analytic import estimate

    spec, setup, hardware = resolve(model, opts)
    result = estimate(spec, setup, hardware)
    diagnosis = diagnose(result, hardware, margin=opts.margin_fraction)
    if json_output:
        print_json({"model": spec.name, "num_params": spec.num_params, "gpu": hardware.gpu.name,
                    "gpu_memory_bytes": hardware.gpu.memory_bytes, "world_size": hardware.world_size,
                    "setup": setup.to_dict(), "estimate": result.to_dict(), "diagnosis": diagnosis.to_dict()})
        return
    from .. import render

    render.estimate_report(console(), spec, setup, hardware, result, diagnosis, verbose=verbose)


@app.command("models", epilog=examples("memfit models", "memfit models --json"))
def models_command(json_output: JsonOpt = False) -> None:
    """The built-in model catalog (offline): name, size and shape."""
    from ..sources import catalog_entry, catalog_names

    entries = [catalog_entry(name) for name in catalog_names()]
    if json_output:
        print_json({"models": entries})
        return
    from .. import render

    render.models_table(console(), entries)


@app.command("gpus", epilog=examples("memfit gpus", "memfit gpus --verbose", "memfit gpus --json"))
def gpus_command(json_output: JsonOpt = False, verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", rich_help_panel=OUTPUT_PANEL, help="Show each entry's full source.")] = False) -> None:
    """The GPU catalog: usable memory as the driver reports it, and where each figure comes from."""
    import dataclasses

    from ..hardware import gpu_catalog

    gpus = sorted(gpu_catalog().values(), key=lambda g: (g.memory_bytes, g.name))
    if json_output:
        print_json({"gpus": [{**dataclasses.asdict(g), "aliases": list(g.aliases)} for g in gpus]})
        return
    from .. import render

    render.gpus_table(console(), gpus, verbose=verbose)


def _emit(setup, hardware, directory: Path, force: bool, warning: str | None,
          spec) -> tuple[list[str], dict[str, str]]:
    """Write the engine files; (paths written, {file: why it cannot carry the warning})."""
    try:
        from ..emit import emitted_files, unmarked_files, write_all
    except ImportError:
        raise ConfigError("--emit needs memfit.emit, which this install does not have") from None
    model = {"auto_class": spec.auto_class, "hub_id": spec.extra.get("hub_id"), "model_type": spec.model_type}
    try:
        paths = [str(path) for path in write_all(setup, hardware, directory, force=force, warning=warning,
                                                     **model)]
    except OSError as error:
        raise ConfigError(f"cannot write the configs into {directory}: {error.strerror or error}") from None
    unmarked = unmarked_files(emitted_files(setup, hardware, directory, warning=warning,
                                               **model)[0]) if warning else {}
    return paths, unmarked


def main() -> None:
    app()


# Commands in other modules register themselves on `common.app` when imported (they import from common.py only).
from . import steps  # noqa: E402,F401  (trace, measure)
from . import launch  # noqa: E402,F401  (launch)
from . import fit  # noqa: E402,F401  (fit)
from . import serve  # noqa: E402,F401  (serve)
from . import rl  # noqa: E402,F401  (rl)
from . import vlm  # noqa: E402,F401  (vlm)
from . import diffusion  # noqa: E402,F401  (diffusion)
