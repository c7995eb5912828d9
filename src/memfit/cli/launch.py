"""`memfit launch SCRIPT`: start a training script on every rank with the setup the options describe, on FSDP2 or
DeepSpeed. The script reads the setup from the environment (memfit.launch.prepare). Commands are printed as plain
lines, so they paste into a shell."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError
from ..units import format_bytes
from .common import app, examples, print_json
from .options import HARDWARE_PANEL, JsonOpt, SetupOptions, with_setup_options

LAUNCH_PANEL = "Launch"

ScriptArg = Annotated[str, typer.Argument(
    metavar="SCRIPT", show_default=False,
    help="The training script every rank runs; it calls memfit.launch.prepare(model) (see "
         "examples/sharded_train.py).")]
ScriptArgs = Annotated[Optional[list[str]], typer.Argument(
    metavar="[-- SCRIPT_ARGS...]", show_default=False, help="Arguments for the script, after --.")]
LauncherOpt = Annotated[str, typer.Option(
    "--launcher", metavar="torchrun|deepspeed", rich_help_panel=LAUNCH_PANEL,
    help="torchrun (one command per node; both engines) or the deepspeed launcher (one command on node 0, "
         "hostfile; printed with --dry-run).")]
DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", rich_help_panel=LAUNCH_PANEL, help="Print each node's command instead of running it.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", metavar="MODEL", rich_help_panel=LAUNCH_PANEL, show_default=False,
    help="The model the script trains (catalog name, config.json, hub id): adds the per-rank memory and the "
         "communication volume per step.")]
MasterOpt = Annotated[str, typer.Option(
    "--master-addr", metavar="HOST", rich_help_panel=HARDWARE_PANEL,
    help="Node 0's host name or IP (the rendezvous endpoint); printed as a placeholder by default.")]
PortOpt = Annotated[int, typer.Option(
    "--master-port", metavar="PORT", rich_help_panel=HARDWARE_PANEL, min=1, max=65535,
    help="The rendezvous port on node 0.")]


@app.command("launch", epilog=examples(
    "memfit launch train.py --gpus 2 --zero zero3 -b 4 -s 1024",
    "memfit launch train.py --gpus 8 --nodes 4 --zero zero3 --model llama-2-70b --dry-run",
    "memfit launch train.py --gpus 2 --zero zero2 --engine deepspeed -- --steps 100"))
@with_setup_options
def launch_command(script: ScriptArg, opts: SetupOptions, script_args: ScriptArgs = None,
                   launcher: LauncherOpt = "torchrun", dry_run: DryRunOpt = False,
                   model: ModelOpt = None, master_addr: MasterOpt = "", master_port: PortOpt = 29500,
                   json_output: JsonOpt = False) -> None:
    """Run SCRIPT on every GPU of every node with the setup the options describe, sharded by FSDP2 or DeepSpeed.

    Without --dry-run it runs the local node's command (one node only); with it, it prints every node's command.
    """
    from ..launch import DEFAULT_MASTER, SETUP_FILE, launch_plan, local_command

    args = list(script_args or [])
    # Printed commands name memfit_setup.json (printed once, above them); the local run passes the setup inline.
    plan = launch_plan(*_setup(model, opts), script, spec=_spec(model), launcher=launcher,
                       master_addr=master_addr or DEFAULT_MASTER, master_port=master_port, script_args=args,
                       setup_file=SETUP_FILE if dry_run else None)
    if dry_run:
        if json_output:
            print_json(plan.to_dict())
        else:
            _print_plan(plan, with_memory=model is not None)
        return
    if plan.hardware.num_nodes > 1:
        raise ConfigError(f"{plan.hardware.num_nodes} nodes: run each node's command on its node (print them with "
                          "--dry-run); memfit launch runs one node itself")
    if launcher != "torchrun":
        raise ConfigError("memfit launch runs the torchrun command itself; print the deepspeed launcher's with "
                          "--dry-run")
    if not Path(script).is_file():
        raise ConfigError(f"no script at {script}: give the path of the training script")
    command = local_command(plan.setup, plan.hardware.gpus_per_node, script, args, engine=plan.engine,
                            python=sys.executable)
    typer.echo(f"memfit launch: {command.shell()}", err=True)
    raise typer.Exit(_run(list(command.argv), {**os.environ, **dict(command.env)}))


def _run(argv: list[str], env: dict[str, str]) -> int:
    """The job's exit code. On Ctrl-C the job gets SIGINT (a `kill -INT` of memfit alone reaches it too) and stops
    its workers itself, as torchrun does on SIGINT: memfit ends (exit 130) without killing it, which
    subprocess.run would do a quarter second later, leaving torchrun's workers orphaned."""
    import signal

    job = subprocess.Popen(argv, env=env)
    try:
        return job.wait()
    except KeyboardInterrupt:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
        raise


def _spec(model: Optional[str]):
    if model is None:
        from ..model_spec import ModelSpec

        # No model: the setup's defaults need no architecture, and no memory is shown.
        return ModelSpec(name="script", model_type="custom", params=())
    from ..sources import resolve_model

    return resolve_model(model)


def _setup(model: Optional[str], opts: SetupOptions):
    hardware = opts.hardware()
    return opts.setup(_spec(model), hardware), hardware


def _print_plan(plan, *, with_memory: bool) -> None:
    from ..launch import engine_description

    hardware, comm = plan.hardware, plan.comm
    typer.echo(f"{engine_description(plan.setup, plan.engine)} over {hardware.world_size} ranks "
               f"({hardware.num_nodes} node(s) x {hardware.gpus_per_node} GPUs)")
    if with_memory:
        typer.echo(f"per rank: {format_bytes(plan.per_rank_bytes)} ({plan.per_rank.method} estimate, "
                   f"{plan.per_rank.model_name} on {hardware.gpu.name})")
        parts = ", ".join(f"{c.name} {format_bytes(c.num_bytes)} ({c.what})" for c in comm.collectives)
        typer.echo(f"communication per step per rank: {format_bytes(comm.per_rank_bytes)} = "
                   f"{comm.psi_multiple:g} x Psi: {parts}")
        if hardware.num_nodes > 1:
            typer.echo(f"over each node's network link: {format_bytes(comm.inter_node_bytes_per_node)} per step")
    for note in plan.notes:
        typer.echo(f"note: {note}")
    for name, text in plan.files.items():
        typer.echo(f"file {name}:")
        for line in text.splitlines():
            typer.echo(f"  {line}")
    for command in plan.commands:
        typer.echo(f"node {command.node_rank}: {command.shell()}")

