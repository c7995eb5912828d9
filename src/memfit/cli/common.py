"""What every memfit command shares: the `app` the commands register on, the one-line error handling and exit
codes, model resolution, JSON and console output, and the --report/--png writers.

app.py, steps.py and launch.py import from here and never from each other, so there is no import cycle; app.py
imports the other two only to register their commands. Nothing here imports torch, transformers, plotly or rich
at import time, so `memfit --help` stays fast."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from ..errors import ConfigError, MemfitError
from . import interrupt

try:  # typer >= 0.2x vendors click; its parser errors derive from TyperException
    from typer import TyperException as CommandLineError
except ImportError:  # pragma: no cover - older typer raises click's own exceptions
    from click import ClickException as CommandLineError

OK = 0
DOES_NOT_FIT = 1
"""The command worked, and its answer is "no": a plan (or its emitted configs) that does not fit."""
USER_ERROR = 2
"""A mistake in the command line or its inputs: one `error: ...` line on stderr."""


MAX_ERROR_CHARS = 2000
"""An error line is cut here: a message that quotes user input (a path, a value) never floods the terminal."""


def _one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = re.sub(r"\s+", " ", str(text)[: 4 * limit]).strip()  # cut first: the regex never sees megabytes
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OneLineErrors(TyperGroup):
    """Every user mistake, from click's parser or from memfit, is one `error: ...` line on stderr and exit code 2.
    Unexpected exceptions (bugs) still raise, so they are reported with their traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra) -> Any:
        self.argv = list(sys.argv[1:] if args is None else args)  # the global options' callback reads it
        with interrupt.handling():
            try:
                result = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                      standalone_mode=False, **extra)
            except CommandLineError as error:
                if type(error).__name__ == "NoArgsIsHelpError":
                    return _finish(OK, standalone_mode)  # typer printed the help while the error was built
                result = report_error(error.format_message(), _help_hint(error))
            except MemfitError as error:
                result = report_error(str(error))
            except typer.Abort:
                typer.echo("aborted", err=True)
                result = 1
            except BaseException:  # an import cut by Ctrl-C can fail in any way: the interrupt is the cause
                if not interrupt.interrupted():
                    raise
                result = interrupt.INTERRUPTED
            if interrupt.interrupted() and result == interrupt.INTERRUPTED:
                typer.echo("interrupted", err=True)
        return _finish(result, standalone_mode)


def _finish(result: Any, standalone_mode: bool) -> Any:
    if not standalone_mode:
        return result
    sys.exit(result if isinstance(result, int) else OK)


def _help_hint(error: Exception) -> str:
    """Where to look, for mistakes in the command's shape (a bad value's message already says what to give)."""
    ctx = getattr(error, "ctx", None)
    if ctx is None or getattr(error, "exit_code", 0) != USER_ERROR or type(error).__name__ == "BadParameter":
        return ""
    return f" (see `{ctx.command_path} --help`)"


def report_error(message: str, hint: str = "") -> int:
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


LIBRARY_LOGGERS = ("torchao", "torch", "torch.utils._pytree", "torch._dynamo", "torch.distributed", "peft",
                   "accelerate", "bitsandbytes", "DeepSpeed", "deepspeed", "huggingface_hub")
"""Loggers of the libraries a step imports that write to stderr on their own: torchao's "Failed to load ...so" for
kernels built for other CUDA / Python versions (torchao/__init__.py), torch's pytree deprecations
(torch/utils/_pytree.py), DeepSpeed's op-builder notes. transformers is quieted through its own variable."""


def quiet_libraries() -> None:
    """Keep the libraries' own warnings and logs off stderr (memfit's output, progress and `error:` lines stay):
    set up once, before any of them is imported; `memfit --verbose` skips it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read by transformers/utils/logging.py on import
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's C++ "STAGE:" / "USDT: profiler_start" lines
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")  # memfit's command line says what it has to say itself, never through warnings


def examples(*lines: str) -> str:
    """An epilog typer prints one example per line (its rich mode joins single newlines)."""
    return "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  [cyan]{line}[/cyan]" for line in lines)


def resolve(model: str, opts):
    """(ModelSpec, TrainingSetup, Hardware) for a command's MODEL argument and shared options."""
    # huggingface_hub logs each retry of an unreachable Hub; the failure itself becomes one error line.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    return opts.resolve(model)


def parse_pixels(value: str, option: str, shape: str) -> tuple[int, int]:
    """An image's pixels as `option` takes them: one side ('1024': square) or HEIGHTxWIDTH ('768x1344'), as
    (height, width); else a one-line ConfigError that says so (`shape` names the accepted forms)."""
    parts = str(value).lower().replace("*", "x").split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers) < 1:
        raise ConfigError(f"{option} takes {shape}, got '{value}'")
    return (numbers[0], numbers[-1])


def print_json(data: dict) -> None:
    typer.echo(json.dumps(data, indent=2))


def console(*, stderr: bool = False):
    from .. import render

    return render.make_console(stderr=stderr)


_REPORT_SUFFIXES = {"--report": (".html", ".htm"), "--png": (".png",)}


def check_report_paths(report: Path | None, png: Path | None) -> None:
    """Refuse, before anything is computed or written, a --report that is not .html/.htm or a --png that is not
    .png: the file would hold a format its name does not say."""
    for option, path in (("--report", report), ("--png", png)):
        if path is None:
            continue
        suffixes = _REPORT_SUFFIXES[option]
        if path.suffix.lower() not in suffixes:
            raise ConfigError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")


def write_reports(obj, report: Path | None, png: Path | None, **kwargs) -> list[str]:
    """--report / --png for a Plan or a traced estimate; returns the paths written."""
    if report is None and png is None:
        return []
    check_report_paths(report, png)
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
