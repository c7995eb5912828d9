"""The one JSON document of a plan: `Plan.to_dict()` plus what the command around it produced (the --optimize
search, a --verify trace, the files written). `memfit plan --json` prints exactly `plan_json(...)`, so scripts
reading the CLI and code calling the library see the same keys."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigError
from .estimate.result import FIGURE_METRICS
from .launch import SETUP_FILE, launch_plan, launch_section
from .plan import OptimizedChoice


class _NotSearched:
    def __repr__(self) -> str:
        return "NOT_SEARCHED"


NOT_SEARCHED = _NotSearched()
"""`optimized` was not asked for (distinct from None: searched, and no combination fits)."""


def plan_json(plan, *, optimized=NOT_SEARCHED, verified=None, emitted: Sequence[str] | None = None,
              reports: Sequence[str] | None = None, emitted_setup: str = "final",
              emitted_warning: str | None = None, setup_file: str | None = None) -> dict:
    """`plan.to_dict()` with:

    - "launch": per-rank memory, per-node commands and communication per step (more than one GPU), else None;
      for the setup the configs hold: the --optimize choice when there is one, else the ladder's final setup; the
      commands read it from `setup_file` (default memfit_setup.json; launch.files holds its text);
    - "optimized": the --optimize choice (an OptimizedChoice, or None when nothing fits), only when searched;
    - "verified": `verified`, a memfit.verify.CrossCheck of the final setup (trace, formulas like for like and
      on the setup's own engine, which figure memfit trusts and why);
    - "emitted": the paths written by --emit, "emitted_setup" ('final' or 'optimized': which setup they hold) and,
      when the plan does not fit, "emitted_warning";
    - "reports": the --report / --png paths, when any were written.

    Every estimate in it (`initial_estimate`, each step's, `final_estimate`) carries "device_memory": the three
    device figures (allocated, reserved, device_used, each labelled with what measures it); the diagnoses say
    which one the verdict uses (`device_memory_dict` gathers them).
    """
    data = plan.to_dict()
    if optimized is not NOT_SEARCHED:
        data["optimized"] = optimized_dict(optimized)
    if emitted is not None:
        data["emitted"] = [str(path) for path in emitted]
        data["emitted_setup"] = emitted_setup
        if emitted_warning:
            data["emitted_warning"] = emitted_warning
    data["launch"] = launch_dict(plan, optimized.setup if isinstance(optimized, OptimizedChoice) else None,
                                 setup_file=setup_file)
    if verified is not None:
        data["verified"] = verified.to_dict()
    if reports:
        data["reports"] = [str(path) for path in reports]
    return data


def launch_section_for(plan, setup=None, setup_file: str | None = None):
    """memfit.launch's launch section for `setup` (default: the plan's final setup) on the plan's hardware: None
    for one GPU, or when no engine runs the setup. Its commands read the setup from `setup_file` (default
    memfit_setup.json, the file --emit writes)."""
    setup_file = setup_file or SETUP_FILE
    if setup is None or setup == plan.final_setup:
        return launch_section(plan, setup_file=setup_file)
    if plan.hardware.world_size < 2:
        return None
    try:
        return launch_plan(setup, plan.hardware, spec=plan.spec, setup_file=setup_file)
    except ConfigError:
        return None


def launch_dict(plan, setup=None, setup_file: str | None = None) -> dict | None:
    """Per-rank memory, per-node commands and communication per step for more than one GPU (memfit.launch)."""
    section = launch_section_for(plan, setup, setup_file)
    return section.to_dict() if section is not None else None


def optimized_dict(choice) -> dict | None:
    if choice is None:
        return None
    return {"setup": choice.setup.to_dict(), "total_bytes": choice.estimate.total_bytes,
            "relative_step_time": choice.relative_step_time, "differences": list(choice.differences),
            "estimate": choice.estimate.to_dict()}




def device_memory_dict(plan) -> dict:
    """allocated <= reserved <= device_used for the setup as given and the final one; the verdict compares
    reserved + outside the allocator (= device_used) with the budget."""
    return {"initial": plan.initial_estimate.device_figures(), "final": plan.final_estimate.device_figures(),
            "metrics": dict(FIGURE_METRICS), "verdict_uses": "device_used (reserved + outside the allocator)"}
