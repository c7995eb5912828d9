"""Terminal rendering: the only module that imports rich. Every function takes a Console and library values and
prints; nothing here computes a number. Sizes are shown in GiB (1024**3), labelled GiB, and every line fits the
console width (80 columns is the target)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .diagnose import Diagnosis
from .estimate.result import Category, MemoryEstimate
from .hardware import GPU, Hardware
from .launch import SETUP_FILE, engine_description
from .model_spec import ModelSpec
from .plan_output import launch_section_for
from .emit.litgpt import script as litgpt_script
from .setup import Engine, ModelCode, Sharding, TrainingSetup
from .units import GiB, format_bytes


def make_console(*, stderr: bool = False) -> Console:
    """Width from the terminal (or $COLUMNS); 80 when the output is not a terminal. No colour when piped."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f}"


def _params(num_params: int) -> str:
    if num_params >= 10**9:
        return f"{num_params / 1e9:.2f} B params"
    return f"{num_params / 1e6:.1f} M params"


def describe_setup(setup: TrainingSetup) -> str:
    shape = (f"image {setup.image_size} px ({setup.seq_len} tokens)" if setup.image_size else f"seq {setup.seq_len}")
    shape += f", target {setup.target_len}" if setup.target_len else ""
    # a section checked late was the setup's own field once, said after torch.compile: it still is
    return (f"micro-batch {setup.micro_batch_size} x {shape}, accum {setup.grad_accum_steps}, "
            f"{setup.precision}, {setup.optimizer}, checkpointing {setup.checkpointing}, {setup.attention}, "
            f"sharding {setup.sharding}, offload {setup.offload}"
            + (f", tp {setup.tp}{' + sequence parallel' if setup.sequence_parallel else ''}" if setup.tp > 1 else "")
            + (f", pp {setup.pp} {setup.pp_schedule}" + (f" x {setup.pp_virtual_stages} stages per rank"
                                                         if setup.pp_virtual_stages > 1 else "") if setup.pp > 1 else "")
            + (f", cp {setup.cp} ({setup.cp_rotate})" if setup.cp > 1 else "")
            + (f", HSDP shard group {setup.dp_shard}" if setup.dp_shard else "")
            + (f", {setup.finetune}" if setup.finetune.adapters else "")
            + (f", loss {setup.loss}" if setup.loss.value != "standard" else "")
            + (", optimizer in backward" if setup.optimizer_in_backward else "")
            + "".join(section.describe() for section in setup.techniques if not section.checked_late)
            + (", torch.compile" if setup.compile else "")
            + "".join(section.describe() for section in setup.techniques if section.checked_late))


def _heading(console: Console, title: str) -> None:
    console.print()
    console.print(Text(title, style="bold"))


def _bullets(console: Console, lines: Iterable[str], *, style: str = "") -> None:
    for line in lines:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_row("-", Text(line, style=style))
        console.print(Padding(grid, (0, 0, 0, 1)))


def _fields(console: Console, rows: Sequence[tuple[str, str | Text]]) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, value if isinstance(value, Text) else Text(value))
    console.print(grid)


def header(console: Console, command: str, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware,
           margin: float) -> None:
    gpu = hardware.gpu
    count = f"{hardware.world_size} x " if hardware.world_size > 1 else ""
    nodes = f" ({hardware.num_nodes} nodes x {hardware.gpus_per_node})" if hardware.num_nodes > 1 else ""
    nominal = f", sold as {gpu.nominal}" if gpu.nominal else ""
    budget = int(gpu.memory_bytes * (1 - margin))
    console.print(Text.assemble(("memfit ", "bold"), (command, "bold cyan"), "  ", (spec.name, "bold"),
                                f"  {_params(spec.num_params)}"))
    _fields(console, [
        ("model", f"{spec.model_type}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
                  + (f"vocab {spec.vocab_size:,}" if spec.vocab_size else "no vocabulary: image input")
                  + f" (from {spec.source})"),
        ("GPU", f"{count}{gpu.name}{nodes}: {gib(gpu.memory_bytes)} GiB usable{nominal}; "
                f"{margin:.0%} kept free -> {gib(budget)} GiB budget"),
        ("setup", describe_setup(setup)),
        *[("", Text(note, style="dim")) for note in setup.notes],
    ])


def breakdown(console: Console, estimate: MemoryEstimate, *, verbose: bool = False) -> None:
    total = estimate.total_bytes
    title = f"Peak memory per GPU: {gib(total)} GiB ({estimate.method} estimate)"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left", title_style="bold")
    table.add_column("term", overflow="fold", ratio=1)
    table.add_column("category", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    for term in estimate.terms:
        name = Text(term.name)
        if verbose and term.formula:
            name.append(f"\n{term.formula}", style="dim")
            if term.source:
                name.append(f"\n[{term.source}]", style="dim italic")
        share = term.num_bytes / total if total else 0.0
        table.add_row(name, str(term.category), gib(term.num_bytes), f"{share:.1%}")
    table.add_section()
    table.add_row(Text("total", style="bold"), "", Text(gib(total), style="bold"), "100.0%")
    if any(t.category.value == "overhead" for t in estimate.terms):
        table.add_section()
        for label, metric, value in device_figure_rows(estimate):
            table.add_row(Text(label), Text(metric, style="dim"), gib(value),
                          f"{value / total:.1%}" if total else "-")
    console.print()
    console.print(table)
    if estimate.cpu_bytes:
        console.print(Text(f"CPU RAM for offloaded tensors: {gib(estimate.cpu_bytes)} GiB per GPU (each rank's own)"))


def device_figure_rows(estimate: MemoryEstimate) -> list[tuple[str, str, int]]:
    """(label, what measures it, bytes) for the three device figures, smallest first."""
    return [("allocated", "max_memory_allocated", estimate.allocated_bytes),
            ("reserved", "max_memory_reserved", estimate.reserved_bytes),
            ("device used", "nvidia-smi", estimate.device_used_bytes)]


def peak_and_diagnosis(console: Console, estimate: MemoryEstimate, diagnosis: Diagnosis) -> None:
    phases = ", ".join(f"{phase} {gib(num_bytes)}" for phase, num_bytes in estimate.phase_peaks.items())
    rows: list[tuple[str, str | Text]] = [
        ("peak", f"during {estimate.peak_phase}" + (f" (tensor GiB by phase: {phases})" if phases else ""))]
    style = "green" if diagnosis.fits else "red"
    rows.append(("diagnosis", Text(diagnosis.summary(), style=style)))
    if diagnosis.reserved_bytes:
        paged = (f" - evictable paged optimizer states {gib(diagnosis.evictable_bytes)} GiB"
                 if diagnosis.evictable_bytes else "")
        outside = f"outside the allocator {gib(diagnosis.outside_allocator_bytes)} GiB (CUDA context, NCCL){paged}"
        if diagnosis.fits_by_retry:
            least = diagnosis.required_bytes - diagnosis.outside_allocator_bytes + diagnosis.evictable_bytes
            rows.append(("", f"needs = the least the allocator runs with at the limit {gib(least)} GiB + {outside}: "
                             f"what a CUDA OOM is decided on (reserved {gib(diagnosis.reserved_bytes)} GiB with room; "
                             "a failed cudaMalloc frees the cached segments and retries)"))
        else:
            rows.append(("", f"needs = reserved {gib(diagnosis.reserved_bytes)} GiB + {outside}: what a CUDA OOM "
                             "is decided on"))
    cache = f", allocator cache {gib(diagnosis.cache_bytes)} GiB" if diagnosis.cache_bytes else ""
    rows.append(("", f"static {gib(diagnosis.static_bytes)} GiB (params + grads + optimizer + fixed runtime), "
                     f"activations {gib(diagnosis.activation_bytes)} GiB{cache}, headroom "
                     f"{gib(diagnosis.headroom_bytes)} GiB"))
    console.print()
    _fields(console, rows)


def notes(console: Console, estimate: MemoryEstimate) -> None:
    if not estimate.notes:
        return
    _heading(console, "Where the rule of thumb differs" if estimate.method == "analytic" else "Notes")
    _bullets(console, estimate.notes)


def estimate_report(console: Console, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware,
                    estimate: MemoryEstimate, diagnosis: Diagnosis, *, verbose: bool = False) -> None:
    header(console, "estimate", spec, setup, hardware, diagnosis.margin)
    breakdown(console, estimate, verbose=verbose)
    peak_and_diagnosis(console, estimate, diagnosis)
    notes(console, estimate)


def _fits_cell(diagnosis: Diagnosis) -> Text:
    if diagnosis.fits:
        return Text("yes", style="green")
    return Text(f"no: {diagnosis.bottleneck}", style="red")


def ladder(console: Console, plan) -> None:
    """One row per PlanStep, then each step's change and why, then the rungs passed over."""
    _heading(console, "Ladder (cheapest change first, re-estimated after each step)")
    if not plan.steps:
        if plan.fits:
            console.print(Text(" nothing to change: the step fits as given", style="green"))
            return
        console.print(Text(" no rung could be taken: each one below is passed over or saves nothing here",
                           style="red"))
        _skipped(console, plan)
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("technique", max_width=24, overflow="fold")
    table.add_column("GiB after", justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    table.add_column("cost", ratio=1, overflow="fold")
    table.add_row("", Text("as given", style="dim"), gib(plan.initial_estimate.total_bytes),
                  _fits_cell(plan.initial_diagnosis), "")
    for number, step in enumerate(plan.steps, 1):
        table.add_row(str(number), step.title, gib(step.estimate.total_bytes), _fits_cell(step.diagnosis), step.cost)
    console.print(table)
    for number, step in enumerate(plan.steps, 1):
        console.print(Text(f" {number}. {step.title}", style="bold"))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_row("change", Text(step.change, style="cyan"))
        grid.add_row("why", Text(step.why))
        console.print(Padding(grid, (0, 0, 0, 4)))
    _skipped(console, plan)


def _skipped(console: Console, plan) -> None:
    if plan.skipped:
        _heading(console, "Rungs passed over")
        _bullets(console, [f"{title}: {reason}" for title, reason in plan.skipped])


def verdict_text(plan) -> str:
    """The verdict's words after its label ('fits' or 'no fit'): 'after 2 changes: needs X of Y usable (...)', or
    'nothing on the ladder makes it fit: needs ...'. The terminal and the page both show it."""
    final = plan.final_diagnosis
    if plan.fits:
        changes = len(plan.steps)
        lead = "as given" if not changes else f"after {changes} change{'s' if changes > 1 else ''}"
        return f"{lead}: {final.summary().removeprefix('fits: ')}"
    return "nothing on the ladder makes it fit: " + final.summary().removeprefix("does not fit: ")


def verdict(console: Console, plan) -> None:
    _heading(console, "Verdict")
    rows: list[tuple[str, str | Text]] = []
    if plan.fits:
        rows.append(("fits", Text(verdict_text(plan), style="bold green")))
        if plan.steps:
            rows.append(("final setup", describe_setup(plan.final_setup)))
    else:
        rows.append(("no fit", Text(verdict_text(plan), style="bold red")))
    cpu = plan.final_estimate.cpu_bytes
    if cpu:
        per_node = cpu * plan.hardware.gpus_per_node  # cpu_bytes is one rank's; the node's RAM serves all its ranks
        rows.append(("CPU RAM", f"{gib(per_node)} GiB of {gib(plan.hardware.cpu_ram_bytes)} GiB per node"
                     + (f" ({gib(cpu)} GiB per GPU)" if plan.hardware.gpus_per_node > 1 else "")))
    _fields(console, rows)
    if not plan.fits and plan.suggestions:
        _heading(console, "What would fit")
        _bullets(console, plan.suggestions)


def optimized(console: Console, choice, reference: TrainingSetup) -> None:
    """The throughput-optimal fitting setup (plan --optimize) and where it differs from the ladder's."""
    _heading(console, "Throughput-optimal setup (--optimize)")
    if choice is None:
        console.print(Text(" no combination of the techniques fits either", style="red"))
        return
    if not choice.differences:
        console.print(Text(" the ladder's final setup is already the fastest fitting one"))
        return
    speed = choice.relative_step_time
    console.print(Text(f" {gib(choice.estimate.total_bytes)} GiB; modelled time per sample {speed:.2f}x the "
                       f"ladder's final setup. Differs in:"))
    _bullets(console, choice.differences)


def snippets(console: Console, items: Mapping[str, str], *, title: str = "Configuration for the final setup") -> None:
    """Paste-ready configuration of the final setup: {label: text}. Under a label ending in ':' the text is code,
    printed unwrapped (a line longer than the console runs past it rather than breaking mid-token) so it pastes as
    printed; under any other label it is prose, wrapped to the width."""
    if not items:
        return
    _heading(console, title)
    for label, text in items.items():
        console.print(Text(f" {label}", style="dim"))
        if not label.endswith(":"):
            console.print(Padding(Text(text, overflow="fold"), (0, 0, 0, 2)))
            continue
        for line in text.splitlines():
            command(console, line, indent=2)


def command(console: Console, line: str, *, indent: int = 1, style: str = "cyan") -> None:
    """One line to copy (a shell command, a line of code), never wrapped or cropped whatever the width."""
    console.print(Text(" " * indent + line, style=style, no_wrap=True, overflow="ignore"), soft_wrap=True)


def python_call(function: str, kwargs: Mapping[str, object]) -> str:
    lines = [f"{function}("] + [f"    {key}={value!r}," for key, value in kwargs.items()] + [")"]
    return "\n".join(lines)


def compact_json(data: Mapping, *, width: int = 72, indent: int = 2) -> str:
    """A JSON object one key per line, with nested objects inline where they fit in `width`: short, still valid."""
    items = []
    for key, value in data.items():
        inline = f"{' ' * indent}{json.dumps(key)}: {json.dumps(value)}"
        if isinstance(value, Mapping) and value and len(inline) > width:
            inline = f"{' ' * indent}{json.dumps(key)}: " + compact_json(value, width=width, indent=indent + 2)
        items.append(inline)
    return "{\n" + ",\n".join(items) + "\n" + " " * (indent - 2) + "}"


def emitted(console: Console, paths: Sequence[str], notes: Sequence[str] = ()) -> None:
    _heading(console, "Written")
    _bullets(console, paths)
    for note in notes:
        style = "bold red" if note.startswith("DOES NOT FIT") else "dim"
        console.print(Padding(Text(note, style=style, overflow="fold"), (0, 0, 0, 1)))


def plan_report(console: Console, plan, *, verbose: bool = False, optimize_requested: bool = False,
                optimized_choice=None, config_snippets: Mapping[str, str] | None = None,
                config_title: str = "Configuration for the final setup", show_config: bool | None = None,
                emitted_paths: Sequence[str] = (), emitted_notes: Sequence[str] = (),
                setup_file: str | None = None) -> None:
    """The whole plan. `show_config` (default: the plan fits) prints `config_snippets` under `config_title`. The
    launch commands read the setup from `setup_file` (the memfit_setup.json --emit wrote; None: not written)."""
    header(console, "plan", plan.spec, plan.initial_setup, plan.hardware, plan.margin)
    breakdown(console, plan.initial_estimate, verbose=verbose)
    peak_and_diagnosis(console, plan.initial_estimate, plan.initial_diagnosis)
    notes(console, plan.initial_estimate)
    ladder(console, plan)
    verdict(console, plan)
    if optimize_requested:
        optimized(console, optimized_choice, plan.final_setup)
    if (plan.fits if show_config is None else show_config) and config_snippets:
        snippets(console, config_snippets, title=config_title)
    if emitted_paths:
        emitted(console, emitted_paths, emitted_notes)
    if plan.hardware.world_size > 1:
        launch_and_communication(console, plan, optimized_choice.setup if optimized_choice is not None else None,
                                 setup_file=setup_file)


MAX_NODE_COMMANDS = 4
"""More nodes than this: the first two commands and the last are printed (the others differ in --node-rank)."""


def launch_and_communication(console: Console, plan, setup: TrainingSetup | None = None, *,
                             setup_file: str | None = None) -> None:
    """'Launch (per node)' and 'Communication per step' for a plan over more than one GPU (memfit.launch), for
    `setup` (the --optimize choice) when given, else the plan's final setup. The commands name the setup's file
    (`setup_file`, written by --emit; None: memfit_setup.json, not written yet) instead of carrying its JSON."""
    section = launch_section_for(plan, setup, setup_file)
    if section is None:
        return
    hardware, comm = section.hardware, section.comm
    optimized = setup is not None and setup != plan.final_setup
    _heading(console, "Launch (per node, the --optimize setup)" if optimized else "Launch (per node)")
    console.print(Text(f" {engine_description(section.setup, section.engine)} over {hardware.world_size} ranks "
                       f"({hardware.num_nodes} node(s) x {hardware.gpus_per_node}): "
                       f"{gib(section.per_rank_bytes)} GiB per rank", overflow="fold"))
    elsewhere = _launched_elsewhere(section.setup, hardware)
    if elsewhere:
        _bullets(console, [elsewhere])
        nodes = []
    else:
        nodes = list(section.commands)
    shown = nodes if len(nodes) <= MAX_NODE_COMMANDS else nodes[:2] + nodes[-1:]
    for node in shown:  # whole commands, environment included, each on one unwrapped line
        console.print(Text(f" node {node.node_rank} (one line, paste it whole):", style="dim"))
        command(console, node.shell(), indent=2)
        if len(shown) < len(nodes) and node is shown[1]:
            console.print(Text(f" nodes 2 to {len(nodes) - 2}: the same command with --node-rank 2 to "
                               f"{len(nodes) - 2} (all of them: --json)", style="dim"))
    unwritten = [f"{SETUP_FILE} is not written yet: `memfit plan ... --emit DIR` writes it (--json: launch.files)"
                 ] if setup_file is None and nodes else []
    notes = list(section.notes) if nodes else []  # the notes are about memfit's command
    if notes or unwritten:
        _bullets(console, [*notes, *unwritten])
    _heading(console, "Communication per step")
    lines = [f"per rank: {format_bytes(comm.per_rank_bytes)} ({comm.psi_multiple:g} x Psi, ZeRO paper sec. 7)"]
    if comm.tp > 1:
        lines = [f"per rank: {format_bytes(comm.per_rank_bytes)}: data parallel "
                 f"{format_bytes(comm.data_parallel_bytes)} ({comm.psi_multiple:g} x Psi of one TP rank's "
                 f"parameters, ZeRO paper sec. 7) + tensor parallel {format_bytes(comm.tensor_parallel_bytes)} "
                 f"inside each group of {comm.tp} (activations, per layer)"]
    lines += [f"{c.name}: {format_bytes(c.num_bytes)}, {c.what}" for c in comm.collectives]
    if hardware.num_nodes > 1:
        lines.append(f"over each node's network link: {format_bytes(comm.inter_node_bytes_per_node)} "
                     "(a ring crosses each node boundary once)")
    _bullets(console, lines)


def _launched_elsewhere(setup: TrainingSetup, hardware: Hardware) -> str | None:
    """What starts the ranks of a setup memfit's own launch line does not run (None: memfit's runs it)."""
    if setup.model_code is ModelCode.LITGPT:  # LitGPT's own model: its scripts start their ranks
        return (f"litgpt {litgpt_script(setup)} --config litgpt.yaml on each node: Fabric starts the node's ranks "
                f"itself (devices {hardware.gpus_per_node}); memfit's torchrun command would run the Hugging Face "
                "model")
    if setup.fsdp_version.is_fsdp1 and setup.sharding is not Sharding.NONE and setup.engine is Engine.TORCH:
        who = ("Lightning's FSDPStrategy starts its ranks (`devices`, `num_nodes`)"
               if setup.fsdp_version.value == "1-blocks" else
               "`accelerate launch --config_file <your accelerate FSDP config> train.py` on each node (the HF "
               "Trainer and accelerate run FSDP1)")
        return f"{who}; memfit's own engine shards with FSDP2 only, so it prints no command of its own for FSDP1"
    return None


def models_table(console: Console, entries: Sequence[Mapping]) -> None:
    """One row per model; under 110 columns the hub id goes under the name, so the table fits 80 columns."""
    wide = console.width >= 110
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title_justify="left",
                  title="Built-in models (memfit plan MODEL)", title_style="bold")
    table.add_column("name" if wide else "name / hub id", overflow="fold")
    for header in ("params\nB", "layers", "hidden", "heads\n/kv", "vocab", "max\npos"):
        table.add_column(header.replace("\n", " ") if wide else header, justify="right", no_wrap=True)
    if wide:
        table.add_column("hub id", overflow="fold")
    for i, e in enumerate(entries):
        hub = Text(e["hub_id"], style="dim")
        name = Text(e["name"]) if wide else Text.assemble(e["name"], "\n", hub)
        numbers = [f"{e['num_params'] / 1e9:.2f}", str(e["num_layers"]), str(e["hidden_size"]),
                   f"{e['num_attention_heads']}/{e['num_kv_heads']}", str(e["vocab_size"]),
                   str(e["max_position_embeddings"])]
        last_of_family = i + 1 < len(entries) and entries[i + 1].get("family") != e.get("family")
        table.add_row(name, *numbers, *([hub] if wide else []), end_section=last_of_family)
    console.print(table)


def gpus_table(console: Console, gpus: Sequence[GPU], *, verbose: bool = False) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="GPU catalog (--gpu NAME, or a size such as 24GiB)",
                  title_justify="left", title_style="bold")
    table.add_column("name", no_wrap=True)
    table.add_column("usable GiB", justify="right", no_wrap=True)
    table.add_column("nominal", no_wrap=True)
    table.add_column("bf16", no_wrap=True)
    table.add_column("source", overflow="fold", ratio=1, min_width=12)
    for gpu in gpus:
        source = Text(gpu.source, style="dim", no_wrap=not verbose, overflow="fold" if verbose else "ellipsis")
        table.add_row(gpu.name, gib(gpu.memory_bytes), gpu.nominal, "yes" if gpu.bf16 else "no", source)
    console.print(table)
    if not verbose:
        console.print(Text("Full sources: memfit gpus --verbose (or --json).", style="dim"))


def comparison(console: Console, estimates: Mapping[str, MemoryEstimate], *, reference: str) -> None:
    """Several estimates of one step side by side, by category, with each one's error against `reference`."""
    names = list(estimates)
    _heading(console, "Side by side (GiB)")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("category")
    for name in names:
        table.add_column(name, justify="right")
    cats = {name: est.by_category() for name, est in estimates.items()}
    for cat in Category:
        if any(cats[n][cat] for n in names):
            table.add_row(str(cat), *(gib(cats[n][cat]) for n in names))
    table.add_row("tensor peak", *(gib(estimates[n].tensor_bytes) for n in names), style="bold")
    ref = estimates[reference].tensor_bytes
    table.add_row(f"vs {reference}", *(f"{100 * (estimates[n].tensor_bytes - ref) / ref:+.2f}%" if ref else "-"
                                       for n in names))
    table.add_row("peak phase", *(estimates[n].peak_phase.value for n in names))
    console.print(table)


def top_modules(console: Console, estimate: MemoryEstimate, *, limit: int = 8) -> None:
    if not estimate.top_modules:
        return
    _heading(console, "Modules whose saved activations dominate")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("module", overflow="fold")
    table.add_column("GiB", justify="right")
    for name, num_bytes in estimate.top_modules[:limit]:
        table.add_row(name or "(root)", gib(num_bytes))
    console.print(table)


def phase_peaks(console: Console, estimate: MemoryEstimate) -> None:
    if not estimate.phase_peaks:
        return
    peaks = ", ".join(f"{phase.value} {gib(value)}" for phase, value in estimate.phase_peaks.items())
    extra = f"; host (offloaded) {gib(estimate.cpu_bytes)} GiB" if estimate.cpu_bytes else ""
    _fields(console, [("phases", f"tensor GiB at each phase's peak: {peaks}{extra}")])


def trace_report(console: Console, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware,
                 traced: MemoryEstimate, diagnosis: Diagnosis, check=None, *, verbose: bool = False) -> None:
    header(console, "trace", spec, setup, hardware, diagnosis.margin)
    breakdown(console, traced, verbose=verbose)
    peak_and_diagnosis(console, traced, diagnosis)
    phase_peaks(console, traced)
    top_modules(console, traced)
    if check is not None:
        verification(console, check)
    notes(console, traced)


def measure_report(console: Console, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware,
                   measured: MemoryEstimate, predicted: MemoryEstimate, diagnosis: Diagnosis) -> None:
    header(console, "measure", spec, setup, hardware, diagnosis.margin)
    breakdown(console, measured)
    phase_peaks(console, measured)
    comparison(console, {"measured": measured, "analytic": predicted}, reference="measured")
    notes(console, measured)


def verification(console: Console, check) -> None:
    """A trace next to the formulas (memfit.verify.CrossCheck): like for like, then the setup's own engine, and
    which figure memfit trusts and why."""
    columns = {"traced": check.traced, "formulas": check.like_for_like}
    if check.traced_as.engine_differs:
        columns[f"formulas, {check.asked.setup.engine} layout"] = check.asked
    comparison(console, columns, reference="traced")
    _heading(console, "Which figure to trust")
    for line in check.verdict():
        console.print(Padding(Text(f"- {line}", overflow="fold"), (0, 0, 0, 1)))
