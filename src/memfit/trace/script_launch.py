"""Launchers in front of a traced script (memfit.trace.script): `accelerate launch` and `deepspeed` read with the
launcher's own argument parser, giving the script, its arguments, the number of processes on this node and the
environment the launcher sets for each process (accelerate's ACCELERATE_* settings: mixed precision, FSDP, DeepSpeed
config; DeepSpeed's `--local_rank` argument). Without the launcher installed its command is refused in one line."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Launch:
    """What a launcher runs on rank 0: the script (`python` argv form), the number of processes per node and the
    environment variables it adds."""

    argv: tuple[str, ...]
    world_size: int
    env: tuple[tuple[str, str], ...]


def launcher_name(argv: Sequence[str]) -> str | None:
    """'accelerate' or 'deepspeed' when `argv` starts with that launcher, else None."""
    head = os.path.basename(argv[0]) if argv else ""
    if head == "accelerate" and argv[1:2] == ["launch"]:
        return "accelerate"
    if head == "deepspeed":
        return "deepspeed"
    if head in ("accelerate", "lightning", "fabric"):
        return head
    return None


def read_launcher(argv: Sequence[str]) -> Launch:
    name = launcher_name(argv)
    if name == "accelerate":
        return _accelerate(list(argv[2:]))
    if name == "deepspeed":
        return _deepspeed(list(argv[1:]))
    raise ConfigError(f"{' '.join(argv[:3])}: this launcher is not traced yet: run the script with torchrun "
                      "(memfit trace -- torchrun --nproc_per_node N train.py ARGS), accelerate launch, deepspeed "
                      "or python")


def _parsed(parser, argv: list[str], launcher: str):
    """argparse's answer, or its complaint as one line (argparse exits; its message goes to stderr)."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parser.parse_args(argv)
    except SystemExit:
        lines = [line for line in complaint.getvalue().splitlines() if line.strip()]
        raise ConfigError(f"{launcher}: {lines[-1] if lines else 'bad arguments'}") from None


def _accelerate(argv: list[str]) -> Launch:
    """`accelerate launch [OPTIONS] script.py ARGS`: accelerate's parser and config-file merge
    (commands/launch.py `_validate_launch_command`), then the environment its launcher would set
    (utils/launch.py: `prepare_deepspeed_cmd_env`, `prepare_multi_gpu_env` or `prepare_simple_launcher_cmd_env`)."""
    try:
        from accelerate.commands import launch as accelerate_launch
        from accelerate.utils import launch as accelerate_env
    except ImportError as error:
        raise ConfigError(f"accelerate launch: accelerate is not installed here ({error.name})") from None
    args = _parsed(accelerate_launch.launch_command_parser(), argv, "accelerate launch")
    try:
        # accelerate names each default it used, on stdout / stderr: not what the script would print
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, _defaults, _ = accelerate_launch._validate_launch_command(args)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(f"accelerate launch: {error}") from None
    if args.num_machines and int(args.num_machines) > 1:
        raise ConfigError(f"accelerate launch --num_machines {args.num_machines}: memfit traces one node (rank 0)")
    if args.no_python:
        raise ConfigError("accelerate launch --no_python: memfit traces a Python script")
    saved = dict(os.environ)
    try:
        if args.use_deepspeed:
            _, env = accelerate_env.prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = accelerate_env.prepare_multi_gpu_env(args)
        else:
            _, env = accelerate_env.prepare_simple_launcher_cmd_env(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    script = ["-m", args.training_script] if args.module else [args.training_script]
    added = tuple(sorted((k, v) for k, v in env.items() if saved.get(k) != v))
    return Launch(argv=("python", *script, *args.training_script_args), world_size=int(args.num_processes or 1),
                  env=added)


def _deepspeed(argv: list[str]) -> Launch:
    """`deepspeed [--num_gpus N] script.py ARGS` on one node: DeepSpeed's runner parser (launcher/runner.py); its
    per-node launcher (launcher/launch.py) appends `--local_rank=0` to rank 0's arguments unless --no_local_rank."""
    try:
        from deepspeed.launcher import runner  # noqa: F401 - the parser's module, imported once here
    except ImportError as error:
        raise ConfigError(f"deepspeed: DeepSpeed is not installed here ({error.name})") from None
    args = _parsed(_DeepSpeedParser, argv, "deepspeed")
    if args.num_nodes not in (-1, 1) or args.hostfile_given:
        raise ConfigError("deepspeed --num_nodes / --hostfile: memfit traces one node (rank 0)")
    if args.include or args.exclude:
        raise ConfigError("deepspeed --include / --exclude: give the number of processes with --num_gpus")
    if args.num_gpus < 1:
        raise ConfigError("deepspeed: give the number of processes with --num_gpus N (memfit cannot count "
                          "the target's GPUs)")
    script = ["-m", args.user_script] if args.module else [args.user_script]
    local_rank = [] if args.no_local_rank else ["--local_rank=0"]
    return Launch(argv=("python", *script, *args.user_args, *local_rank), world_size=args.num_gpus, env=())


class _DeepSpeedParser:
    """deepspeed.launcher.runner.parse_args as a parser: it calls parse_args on the list it is given."""

    @staticmethod
    def parse_args(argv: list[str]):
        from deepspeed.launcher import runner

        args = runner.parse_args(argv)
        args.hostfile_given = "-H" in argv or any(a.split("=")[0] == "--hostfile" for a in argv)
        return args
