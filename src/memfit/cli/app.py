"""The memfit commands: parse -> library call -> render. Each command is one small function; a new one (trace,
measure, launch) is another `@app.command` function on `common.app`, taking `opts: SetupOptions` to get the shared
options. This module registers plan, estimate, models and gpus, and imports steps.py and launch.py so they register
theirs; those two import from common.py, never from here.

Heavy modules (the planner, emitters, rich rendering) are imported inside the commands, so `memfit --help` and
every command start fast; nothing here imports torch, transformers or plotly."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError, MemfitError
from .common import DOES_NOT_FIT, app, check_report_paths, console, examples, print_json, resolve, write_reports
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
    written, unmarked = (_emit(chosen, hardware, emit, force, warning, spec.auto_class) if emit is not None
                         else ([], {}))
    traced = None
    if verify:
        from .steps import run_trace

        from ..verify import cross_check

        traced = cross_check(spec, result.final_setup, hardware,
                             run_trace(model, spec, result.final_setup, hardware, progress=not json_output),
                             margin=opts.margin_fraction)
    reports = write_reports(result, report, png, trace=traced.traced if traced is not None else None)
    if json_output:
        print_json(plan_json(result, optimized=choice if optimize else NOT_SEARCHED, verified=traced,
                             emitted=written if emit is not None else None, reports=reports, emitted_setup=which,
                             emitted_warning=warning))
    else:
        _print_plan(result, chosen, which, optimize=optimize, choice=choice, verbose=verbose, emit_dir=emit,
                    written=written, unmarked=unmarked, warning=warning, reports=reports, traced=traced)
    if not fits:
        raise typer.Exit(DOES_NOT_FIT)


def _print_plan(result, chosen, which: str, *, optimize: bool, choice, verbose: bool, emit_dir: Path | None,
                written: list[str], unmarked: dict[str, str], warning: str | None, reports: list[str],
                traced) -> None:
    from .. import render

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
                       config_snippets=_snippets(chosen, render, emitted=emit_dir,
                                                        auto_class=result.spec.auto_class), config_title=title,
                       show_config=result.fits or which == "optimized", emitted_paths=written + reports,
                       emitted_notes=notes)
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
    from ..diagnose import diagnose
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
          auto_class: str) -> tuple[list[str], dict[str, str]]:
    """Write the engine files; (paths written, {file: why it cannot carry the warning})."""
    try:
        from ..emit import emitted_files, unmarked_files, write_all
    except ImportError:
        raise ConfigError("--emit needs memfit.emit, which this install does not have") from None
    try:
        paths = [str(path) for path in write_all(setup, hardware, directory, force=force, warning=warning,
                                                     auto_class=auto_class)]
    except OSError as error:
        raise ConfigError(f"cannot write the configs into {directory}: {error.strerror or error}") from None
    unmarked = unmarked_files(emitted_files(setup, hardware, directory, warning=warning,
                                               auto_class=auto_class)[0]) if warning else {}
    return paths, unmarked


def _snippets(setup, render, *, emitted: Path | None, auto_class: str = "AutoModelForCausalLM") -> dict[str, str]:
    """HF kwargs always; the DeepSpeed JSON when the setup shards or offloads. Empty without memfit.emit. With
    --emit DIR, the kwargs name DIR's deepspeed.json as training_args.json does. `auto_class`: the transformers
    class that loads the model (ModelSpec.auto_class)."""
    try:
        from ..emit import config_path, deepspeed_config, hf_model_kwargs, hf_trainer_kwargs, uses_deepspeed
    except ImportError:
        return {}
    deepspeed_path = config_path(emitted, "deepspeed.json") if emitted is not None else "deepspeed.json"
    items = {"transformers.TrainingArguments (add output_dir, schedule):":
             render.python_call("TrainingArguments", hf_trainer_kwargs(setup, deepspeed_path=deepspeed_path)),
             "model loading:": render.python_call(f"{auto_class}.from_pretrained", hf_model_kwargs(setup))}
    if setup.finetune.adapters:
        items.update(_adapter_snippets(setup, render, auto_class))
    items.update(_apply_snippet(setup, emitted))
    if uses_deepspeed(setup):
        try:
            items["deepspeed.json:"] = render.compact_json(deepspeed_config(setup, hf_auto=True))
        except MemfitError as error:
            items["deepspeed.json: not expressible"] = str(error)
    if emitted is None:
        items["all engine files (accelerate, FSDP2, README):"] = "memfit plan ... --emit DIR"
    return items


def _apply_snippet(setup, emitted: Path | None) -> dict[str, str]:
    """What TrainingArguments cannot carry but the plan sized (selective checkpointing, activation offloading):
    the line that puts it on the loaded model (memfit.emit.apply_file); without it the step is another one."""
    from ..emit import config_path
    from ..emit.apply_file import APPLY_FILE, apply_call, apply_summary

    from ..emit.hf_trainer import trainer_cannot_express

    items = {}
    line = apply_call(setup, config_path(emitted, APPLY_FILE) if emitted is not None else None)
    if line is not None:
        title = (f"{apply_summary(setup)}: sized, but TrainingArguments cannot express it; on the loaded model, "
                 "before Trainer(...):")
        items[title] = f"import memfit\n{line}"
    notes = trainer_cannot_express(setup)
    if notes:  # the chunked loss, the step in backward: torchtune's, said where they are
        import textwrap

        items["sized, but the HF Trainer cannot run it (the figure assumes it):"] = "\n".join(
            "# " + line for note in notes for line in textwrap.wrap(note, width=72))
    return items


def _adapter_snippets(setup, render, auto_class: str) -> dict[str, str]:
    """LoRA / QLoRA: how to load the base (dtype, or BitsAndBytesConfig) and the LoraConfig, as memfit sized them."""
    from ..emit import hf_model_kwargs
    from ..emit.peft import base_dtype, bnb_config_kwargs, lora_config_kwargs, prepare_line

    bnb = bnb_config_kwargs(setup)
    model = dict(hf_model_kwargs(setup))
    loading = []
    if bnb:
        loading.append(render.python_call("bnb = BitsAndBytesConfig", bnb))
        model["quantization_config"] = _Code("bnb")
    else:
        model["dtype"] = base_dtype(setup)
    loading.append(render.python_call(f"model = {auto_class}.from_pretrained", model))
    if bnb:
        loading.append(prepare_line(setup))
    loading.append("model = get_peft_model(model, " + render.python_call("LoraConfig", lora_config_kwargs(setup))
                   .replace("\n", "\n    ") + ")")
    return {"model loading:": "\n".join(loading)}


class _Code(str):
    """A name printed as code, not as a string literal, inside python_call."""

    def __repr__(self) -> str:
        return str(self)


def main() -> None:
    app()


# Commands in other modules register themselves on `common.app` when imported (they import from common.py only).
from . import steps  # noqa: E402,F401  (trace, measure)
from . import launch  # noqa: E402,F401  (launch)
from . import fit  # noqa: E402,F401  (fit)
from . import serve  # noqa: E402,F401  (serve)
