"""`memfit trace -- python train.py ARGS`: the user's own script traced on fake tensors (memfit.trace.script),
reported like `memfit trace MODEL`. Imports torch only when called."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..errors import ConfigError
from .common import console, print_json, write_reports
from .progress import progress_bar


def trace_script_command(script: list[str], opts, *, steps: int, json_output: bool, verbose: bool,
                         report: Path | None, png: Path | None) -> None:
    """Trace `script` on the --gpu device; print the per-device peak, breakdown, phases, top modules and notes."""
    given = sorted(opts.explicit - {"num_gpus"})
    if given:
        raise ConfigError(f"setup options ({', '.join(given)}) do not apply to a script: it sets its own batch, "
                          "precision and techniques; give them to the script after `--`")
    if (opts.gpus or 1) * (opts.nodes or 1) > 1:
        raise ConfigError("the ranks of a script come from its launcher: drop --gpus / --nodes and trace "
                          "`-- torchrun --nproc_per_node N train.py ARGS` (rank 0 of a fake process group)")
    try:
        from ..trace.script import script_estimate
    except ImportError as error:
        raise ConfigError(f"memfit trace runs the script and needs torch ({error.name}): "
                          "pip install 'memfit[torch]'") from None
    from ..diagnose import diagnose

    hardware = opts.hardware()
    # --json: stdout carries the JSON only; what the script prints goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if json_output else contextlib.nullcontext()
    with progress_bar("tracing the script on fake tensors") as bar, quiet:
        report_progress = bar if not json_output else None
        advance = ((lambda event: report_progress(event.message, event.fraction)) if report_progress is not None
                   else None)
        traced = script_estimate(script, hardware, steps=steps, progress=advance)
    diagnosis = diagnose(traced, hardware, margin=opts.margin_fraction)
    written = write_reports(traced, report, png, hardware=hardware, margin=opts.margin_fraction)
    if json_output:
        print_json({"script": script, "gpu": hardware.gpu.name, "traced": traced.to_dict(),
                    "diagnosis": diagnosis.to_dict(), "written": written})
        return
    from .. import render

    out = console()
    out.print(f"[bold]memfit trace[/bold]: {' '.join(script)} on {hardware.gpu.name} "
              f"({render.gib(hardware.gpu.memory_bytes)}), {steps} optimizer steps on fake tensors")
    render.breakdown(out, traced, verbose=verbose)
    render.peak_and_diagnosis(out, traced, diagnosis)
    render.phase_peaks(out, traced)
    render.top_modules(out, traced)
    render.notes(out, traced)
    if written:
        render.emitted(out, written)
