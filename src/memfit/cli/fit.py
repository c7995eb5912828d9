"""`memfit fit`: the most that fits (--max batch|seq|gpus|gpu) and the sequence x micro-batch x method table
(--sweep). Parse -> memfit.solve -> render; the rendering lives here (rich), the numbers in memfit.solve."""


from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from .. import atomic
from ..errors import ConfigError
from .common import DOES_NOT_FIT, app, console, examples, print_json, resolve
from .options import (MAX_MICRO_BATCH, MAX_SEQ_LEN, OUTPUT_PANEL, JsonOpt, ModelArg, SetupOptions,
                      with_setup_options)

FIT_PANEL = "What to solve for"


class Quantity(str, Enum):
    BATCH = "batch"
    SEQ = "seq"
    GPUS = "gpus"
    GPU = "gpu"


class Format(str, Enum):
    TABLE = "table"
    CSV = "csv"
    MARKDOWN = "markdown"


def _parse_choice(kind: type[Enum]) -> Callable[[str], Enum]:
    def parse(value: str | Enum) -> Enum:
        if isinstance(value, kind):
            return value
        key = str(value).strip().lower()
        aliases = {"micro-batch": "batch", "micro_batch": "batch", "seq-len": "seq", "sequence": "seq",
                   "md": "markdown"}
        key = aliases.get(key, key)
        for member in kind:
            if member.value == key:
                return member
        raise typer.BadParameter(f"'{value}': choose one of {', '.join(m.value for m in kind)}")

    return parse


def whole_numbers(maximum: int) -> Callable[[str], tuple[int, ...]]:
    """'1024,2048,4096' -> (1024, 2048, 4096); each a whole number from 1 to maximum."""

    def parse(value: str | tuple) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",") if p.strip()]
        if not parts:
            raise typer.BadParameter("give a comma list of whole numbers, e.g. 1,2,4,8")
        out = []
        for part in parts:
            try:
                number = int(part)
            except ValueError:
                raise typer.BadParameter(f"'{part}' is not a whole number") from None
            if not 1 <= number <= maximum:
                raise typer.BadParameter(f"{number} must be a whole number from 1 to {maximum:,}")
            out.append(number)
        return tuple(dict.fromkeys(out))

    return parse


def _step(value: str | int) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a whole number") from None
    if number < 1:
        raise typer.BadParameter(f"{number} must be a whole number of at least 1")
    return number


MaxOpt = Annotated[Optional[Quantity], typer.Option(
    "--max", parser=_parse_choice(Quantity), metavar="batch|seq|gpus|gpu", rich_help_panel=FIT_PANEL,
    show_default=False,
    help="Solve for the largest micro-batch, the longest sequence, the fewest GPUs (powers of two, sharded), or "
         "the smallest-memory catalog GPU on which the step fits; everything else held fixed.")]
SweepOpt = Annotated[bool, typer.Option(
    "--sweep", rich_help_panel=FIT_PANEL,
    help="Size every sequence length x micro-batch x method (--seqs, --batches, --methods) and print the table.")]
LadderOpt = Annotated[bool, typer.Option(
    "--ladder", rich_help_panel=FIT_PANEL,
    help="With --max: a candidate fits when `memfit plan`'s ladder makes it fit (the searched field pinned); the "
         "answer shows the changes it took.")]
StepOpt = Annotated[Optional[int], typer.Option(
    "--step", parser=_step, metavar="N", rich_help_panel=FIT_PANEL, show_default=False,
    help="With --max batch|seq: search multiples of N. Default: 1 for batch, 64 for seq (1 is exact).")]
SeqsOpt = Annotated[Optional[tuple], typer.Option(
    "--seqs", parser=whole_numbers(MAX_SEQ_LEN), metavar="N,N,...", rich_help_panel=FIT_PANEL, show_default=False,
    help="With --sweep: sequence lengths. Default: 1024,2048,4096 (those within the model's context).")]
BatchesOpt = Annotated[Optional[tuple], typer.Option(
    "--batches", parser=whole_numbers(MAX_MICRO_BATCH), metavar="N,N,...", rich_help_panel=FIT_PANEL,
    show_default=False, help="With --sweep: micro-batches. Default: 1,2,4,8.")]
MethodsOpt = Annotated[Optional[str], typer.Option(
    "--methods", metavar="KEY,KEY,...", rich_help_panel=FIT_PANEL, show_default=False,
    help="With --sweep: the method columns (full-amp-adamw, full-bf16-adamw, full-bf16-adamw8bit, "
         "full-bf16-adamw-ckpt, full-bf16-adamw8bit-ckpt, lora, lora-ckpt, qlora-ckpt, setup = the options as "
         "given). Default: full-bf16-adamw,full-bf16-adamw8bit-ckpt,lora-ckpt,qlora-ckpt.")]
CsvOpt = Annotated[Optional[Path], typer.Option(
    "--csv", metavar="FILE", rich_help_panel=OUTPUT_PANEL, show_default=False, dir_okay=False,
    help="With --sweep: also write the table as CSV (one row per cell).")]
MarkdownOpt = Annotated[Optional[Path], typer.Option(
    "--markdown", metavar="FILE", rich_help_panel=OUTPUT_PANEL, show_default=False, dir_okay=False,
    help="With --sweep: also write the table as Markdown.")]
HtmlOpt = Annotated[Optional[Path], typer.Option(
    "--html", metavar="FILE", rich_help_panel=OUTPUT_PANEL, show_default=False, dir_okay=False,
    help="With --sweep: also write the table as an offline HTML page with a heat map per method.")]
FormatOpt = Annotated[Optional[Format], typer.Option(
    "--format", parser=_parse_choice(Format), metavar="table|csv|markdown", rich_help_panel=OUTPUT_PANEL,
    show_default=False, help="With --sweep: what stdout gets. Default: table.")]

DEFAULT_SEQS = (1024, 2048, 4096)
_LABELS = {"micro_batch_size": "micro-batch", "seq_len": "seq", "grad_accum_steps": "accum"}
DEFAULT_BATCHES = (1, 2, 4, 8)
_IGNORED = {Quantity.BATCH: (("batch", "--batch"),), Quantity.SEQ: (("seq", "--seq"),),
            Quantity.GPUS: (("gpus", "--gpus"), ("nodes", "--nodes"), ("zero", "--zero")),
            Quantity.GPU: (("gpu", "--gpu"),)}


@app.command("fit", epilog=examples(
    "memfit fit llama-3.1-8b --gpu A100-80GB --max batch",
    "memfit fit llama-3.1-8b --gpu 24GiB --max seq --precision bf16 --optimizer adamw-8bit --checkpointing full",
    "memfit fit llama-2-70b --gpu H100 --max gpus --precision bf16 --checkpointing full -b 1",
    "memfit fit mistral-7b --max gpu -b 4 --ladder",
    "memfit fit llama-3.1-8b --gpu H100 --sweep --seqs 1024,2048,4096 --batches 1,2,4,8 --csv sweep.csv"))
@with_setup_options
def fit_command(model: ModelArg, opts: SetupOptions, max_: MaxOpt = None, sweep: SweepOpt = False,
                ladder: LadderOpt = False, step: StepOpt = None, seqs: SeqsOpt = None, batches: BatchesOpt = None,
                methods: MethodsOpt = None, csv: CsvOpt = None, markdown: MarkdownOpt = None, html: HtmlOpt = None,
                format_: FormatOpt = None, json_output: JsonOpt = False) -> None:
    """Solve for the most that fits, or size a sequence x micro-batch x method table.

    --max batch|seq|gpus|gpu searches with the analytic estimate, exact to the step: the answer fits and the next
    candidate does not (both shown). Exit code 0: an answer fits; 1: nothing fits (the answer says what was
    closest); 2: a mistake in the command, or a --sweep in which no cell fits.
    """
    _check_options(max_, sweep, ladder, step, seqs, batches, methods, csv, markdown, format_, json_output, html)
    if sweep:
        _sweep(model, opts, seqs, batches, methods, csv, markdown, format_ or Format.TABLE, json_output, html)
        return
    _solve(model, opts, max_, ladder, step, json_output)


def _check_options(max_, sweep, ladder, step, seqs, batches, methods, csv, markdown, format_, json_output,
                   html=None) -> None:
    if sweep and max_ is not None:
        raise ConfigError("give either --max or --sweep, not both")
    if not sweep and max_ is None:
        raise ConfigError("say what to solve for: --max batch|seq|gpus|gpu, or --sweep for the table")
    sweep_only = [name for name, value in (("--seqs", seqs), ("--batches", batches), ("--methods", methods),
                                           ("--csv", csv), ("--markdown", markdown), ("--format", format_),
                                           ("--html", html))
                  if value is not None]
    if not sweep and sweep_only:
        raise ConfigError(f"{', '.join(sweep_only)} go with --sweep")
    if sweep and ladder:
        raise ConfigError("--ladder goes with --max; the sweep sizes each cell as it is")
    if sweep and step is not None:
        raise ConfigError("--step goes with --max batch or --max seq")
    if max_ in (Quantity.GPUS, Quantity.GPU) and step is not None:
        raise ConfigError(f"--step goes with --max batch or --max seq, not --max {max_.value}")
    if json_output and format_ not in (None, Format.TABLE):
        raise ConfigError("--json and --format csv/markdown both set what stdout gets: give one")
    if csv is not None and markdown is not None and csv.resolve() == markdown.resolve():
        raise ConfigError("--csv and --markdown name the same file")


# ------------------------------------------------------------------------------------------------------------ --max


def _solve(model: str, opts: SetupOptions, quantity: Quantity, ladder: bool, step: int | None,
           json_output: bool) -> None:
    from .. import solve

    notes = [f"{flag} {_given(opts, name)} is ignored: it is what --max {quantity.value} searches"
             for name, flag in _IGNORED[quantity] if getattr(opts, name) is not None]
    spec, setup, hardware = resolve(model, opts)
    keep = frozenset(opts.keep or ())

    def run(with_ladder: bool, keep: frozenset[str]):
        common = dict(margin=opts.margin_fraction, with_ladder=with_ladder, explicit=opts.explicit, keep=keep)
        if quantity is Quantity.BATCH:
            return solve.max_micro_batch(spec, setup, hardware, step=step or 1, **common)
        if quantity is Quantity.SEQ:
            return solve.max_seq_len(spec, setup, hardware, step=step or solve.DEFAULT_SEQ_STEP, **common)
        if quantity is Quantity.GPUS:
            return solve.fewest_gpus(spec, setup, hardware, **common)
        return solve.cheapest_gpu(spec, setup, hardware, **common)

    result = run(ladder, keep)
    if not result.fits and not ladder:
        notes.append(_with_the_ladder(run(True, keep | {"finetune"}), quantity))
    notes += _assumed_without(setup.notes, _SEARCHED_LABELS[quantity])
    if json_output:
        print_json({"model": spec.name, "num_params": spec.num_params, "max": quantity.value,
                    "with_ladder": ladder, "fits": result.fits, "notes": notes, "result": result.to_dict()})
    else:
        _print_solved(spec, quantity, result, notes)
    if not result.fits:
        raise typer.Exit(DOES_NOT_FIT)


def _with_the_ladder(result, quantity: Quantity) -> str:
    """One line on what would change a held-fixed answer that does not fit: the same question with the plan's rungs
    walked at each candidate (--ladder), the fine-tuning method kept (LoRA / QLoRA change what is trained)."""
    if not result.fits:
        return (f"with the ladder's rungs (--ladder; the fine-tuning method kept) it does not fit either: "
                f"{result.text()}")
    from ..render import describe_setup

    return (f"what changes the answer: the setup above is held fixed; with the ladder's rungs (--ladder, the "
            f"fine-tuning method kept): {result.text()}, as {describe_setup(result.best.setup)}")


_SEARCHED_LABELS = {Quantity.BATCH: ("micro-batch",), Quantity.SEQ: ("seq",), Quantity.GPUS: (), Quantity.GPU: ()}
_ASSUMED = "assumed: "
_ASSUMED_END = " (a typical fine-tune; set them with options)"


def _assumed_without(notes, labels) -> list[str]:
    """The setup's notes, with the searched or swept fields taken out of the "assumed: ..." one (they were not
    assumed: the command chose them)."""
    out = []
    for note in notes:
        if note.startswith(_ASSUMED) and note.endswith(_ASSUMED_END):
            items = [item for item in note[len(_ASSUMED):-len(_ASSUMED_END)].split(", ")
                     if item.split(" ")[0] not in labels]
            if items:
                out.append(_ASSUMED + ", ".join(items) + _ASSUMED_END)
            continue
        out.append(note)
    return out


def _given(opts: SetupOptions, name: str) -> str:
    value = getattr(opts, name)
    return getattr(value, "name", None) or str(value)


def _print_solved(spec, quantity: Quantity, result, notes: list[str]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from ..solve import describe_held
    from ..units import GiB

    out = console()
    out.print(Text.assemble(("memfit ", "bold"), ("fit", "bold cyan"), "  ", (spec.name, "bold"),
                            f"  --max {quantity.value}" + ("  --ladder" if result.with_ladder else "")))
    out.print(Text(result.text(), style="bold green" if result.fits else "bold red"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in ((quantity.value, "right"), ("GiB", "right"), ("budget GiB", "right"), ("fits", "left"),
                          ("ladder changes" if result.with_ladder else "bottleneck", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for point in _points(quantity, result):
        last = ", ".join(point.changes) or "none" if result.with_ladder else point.diagnosis.bottleneck.value
        table.add_row(str(point.value), f"{point.total_bytes / GiB:.2f}",
                      f"{point.diagnosis.budget_bytes / GiB:.2f}", "yes" if point.fits else "no", last)
    out.print(table)
    if quantity is Quantity.GPU:
        out.print(Text(f"order: {result.order}", style="dim"))
        skipped = [r for r in result.rejected if r.point is None]
        if skipped:
            out.print(Text("passed over: " + "; ".join(f"{r.gpu} ({r.reason})" for r in skipped), style="dim"))
    if result.fits and result.with_ladder:
        from ..render import describe_setup

        out.print(Text(f"setup at the answer: {describe_setup(result.best.setup)}"))
    out.print(Text(f"held fixed: {describe_held(result.held_fixed)}", style="dim"))
    if result.with_ladder:
        out.print(Text(f"the ladder started from: {describe_held(result.start)}", style="dim"))
    for note in list(getattr(result, "notes", ())) + notes:
        out.print(Text(f"note: {note}", style="dim"))


def _points(quantity: Quantity, result) -> list:
    if quantity is Quantity.GPU:
        return [r.point for r in result.rejected if r.point is not None] + ([result.best] if result.best else [])
    if quantity is Quantity.GPUS:
        return [p for p in (result.below, result.best) if p is not None]
    return [p for p in (result.best, result.beyond) if p is not None]


# ---------------------------------------------------------------------------------------------------------- --sweep


def _sweep(model: str, opts: SetupOptions, seqs, batches, methods, csv_path: Path | None,
           markdown_path: Path | None, fmt: Format, json_output: bool, html_path: Path | None = None) -> None:
    from .. import solve

    chosen = solve.get_methods(methods)
    spec, setup, hardware = resolve(model, opts)
    notes = []
    if seqs is None:
        context = spec.max_position_embeddings
        seqs = tuple(s for s in DEFAULT_SEQS if not context or s <= context) or (context,)
        notes.append(f"sequence lengths {', '.join(map(str, seqs))} (the default; set them with --seqs)")
    result = solve.sweep(spec, setup, hardware, seqs=seqs, batches=batches or DEFAULT_BATCHES, methods=chosen,
                         margin=opts.margin_fraction)
    if not result.any_fits:
        smallest = min((c for c in result.cells if c.total_bytes is not None), key=lambda c: c.total_bytes,
                       default=None)
        closest = (f"; the smallest cell (seq {smallest.seq_len}, micro-batch {smallest.micro_batch_size}, "
                   f"{smallest.method}) needs {smallest.total_bytes / 2**30:.2f} GiB of "
                   f"{smallest.budget_bytes / 2**30:.2f} GiB usable" if smallest else "")
        raise ConfigError(f"no point of the sweep fits on {hardware.gpu.name}{closest}; nothing written")
    _write(csv_path, result.to_csv(), "--csv")
    _write(markdown_path, result.to_markdown(), "--markdown")
    if html_path is not None:
        from ..report.html import render_sweep_html

        _write(html_path, render_sweep_html(result, model=spec.name), "--html")
    swept = {"micro-batch", "seq"} | {_LABELS.get(name, name) for m in chosen for name in m.fields}
    notes += _assumed_without(setup.notes, swept)
    if json_output:
        print_json({"model": spec.name, "num_params": spec.num_params, "notes": notes, "sweep": result.to_dict()})
    elif fmt is Format.CSV:
        typer.echo(result.to_csv(), nl=False)
    elif fmt is Format.MARKDOWN:
        typer.echo(result.to_markdown(), nl=False)
    else:
        _print_sweep(spec, result, notes, [str(p) for p in (csv_path, markdown_path, html_path) if p is not None])


def _write(path: Path | None, text: str, option: str) -> None:
    if path is None:
        return
    try:
        atomic.write_text(path, text)  # all or nothing: a full disk or a Ctrl-C leaves no partial file
    except OSError as error:
        raise ConfigError(f"{option} {path}: cannot write it: {error.strerror or error}") from None


def _print_sweep(spec, result, notes: list[str], written: list[str]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from ..solve import describe_held

    out = console()
    out.print(Text.assemble(("memfit ", "bold"), ("fit --sweep", "bold cyan"), "  ", (spec.name, "bold")))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=result.title(), title_justify="left")
    table.add_column("seq", justify="right")
    table.add_column("batch", justify="right")
    for method in result.methods:
        table.add_column(method.title, justify="right", overflow="fold")
    for seq, batch, cells in result.rows():
        table.add_row(str(seq), str(batch), *(_cell(c) for c in cells))
    out.print(table)
    out.print(Text(f"held fixed: {describe_held(result.held_fixed)}", style="dim"))
    for note in list(result.notes) + notes:
        out.print(Text(f"note: {note}", style="dim"))
    for path in written:
        out.print(f"wrote {path}")


def _cell(cell):
    from rich.text import Text

    if cell.total_bytes is None:
        return Text("n/a", style="dim")
    return Text(f"{cell.gib:.2f} {'fits' if cell.fits else 'no'}", style="green" if cell.fits else "red")
