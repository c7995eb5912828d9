"""Launching a sharded training job: the command each node runs, what each rank holds, and what goes over the wire.

Pure: no torch. `launch_plan(plan_or_setup, hardware, script)` gives a `MultiNodePlan` with the per-rank memory
(the estimator's), one command per node and the communication volume per step (memfit.estimate.comm, the one model
of it). The running script learns its setup from the environment the commands set (MEMFIT_SETUP, which carries the
engine; MEMFIT_ENGINE repeats it for scripts that read only that), or from the file MEMFIT_SETUP_FILE names (the
printed per-node commands: one short line each, the setup in memfit_setup.json), and calls `prepare(model, setup)`
on every rank;
that imports memfit._torch.engine lazily, and the torch side never imports this module.

Engines are `setup.Engine`: "torch" runs torch.distributed (DDP-style all-reduce without sharding,
ZeroRedundancyOptimizer for ZeRO-1, FSDP2 for ZeRO-2/3: `estimate.comm.runtime_of`), "deepspeed" runs
`deepspeed.initialize` with memfit's DeepSpeed config; the engine aliases (fsdp, fsdp2, ddp, ds) are accepted
wherever an engine is named. Launchers: "torchrun" (both engines; DeepSpeed reads torchrun's RANK/WORLD_SIZE/
MASTER_ADDR) or "deepspeed" (its own launcher: one command on node 0 that reaches the others over ssh/pdsh through a
hostfile).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .emit.deepspeed import deepspeed_config
from .emit.torchtitan import torchtitan_toml
from .errors import ConfigError
from .estimate import comm
from .estimate.comm import Collective, CommVolume  # noqa: F401  (re-exported: what MultiNodePlan.comm holds)
from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import Engine, Offload, Sharding, TrainingSetup

LAUNCHERS = ("torchrun", "deepspeed")
ENV_SETUP = "MEMFIT_SETUP"
ENV_SETUP_FILE = "MEMFIT_SETUP_FILE"
ENV_ENGINE = "MEMFIT_ENGINE"
SETUP_FILE = "memfit_setup.json"
"""The file `memfit plan --emit DIR` writes and the printed commands name (MEMFIT_SETUP_FILE): the setup as JSON,
~1,000 characters that would otherwise be repeated on every node's command line."""
DEFAULT_PORT = 29500
DEFAULT_MASTER = "NODE0_HOST"
"""Placeholder for node 0's address in printed commands: replace it with the host name or IP of node 0."""


# ------------------------------------------------------------------------------------- setup over the environment


def setup_fields(setup: TrainingSetup) -> dict:
    """The TrainingSetup fields a launched script rebuilds its setup from (MEMFIT_SETUP, memfit_setup.json)."""
    return {key: value for key, value in setup.to_dict().items() if key != "notes"}


def setup_env(setup: TrainingSetup, engine: Engine | str | None = None, *,
              setup_file: str | None = None) -> dict[str, str]:
    """The environment a launched script reads its setup (and so its engine) from: `setup_from_env`,
    `engine_from_env`. `engine` replaces the setup's. With `setup_file`, the environment names that file
    (MEMFIT_SETUP_FILE, which must hold `setup_fields` as JSON) instead of carrying the JSON itself."""
    setup = on_engine(setup, engine)
    if setup_file is not None:
        return {ENV_ENGINE: setup.engine.value, ENV_SETUP_FILE: setup_file}
    return {ENV_ENGINE: setup.engine.value, ENV_SETUP: json.dumps(setup_fields(setup), separators=(",", ":"))}


def setup_from_env(environ: Mapping[str, str] | None = None) -> TrainingSetup | None:
    """The TrainingSetup `memfit launch` / `memfit plan`'s commands passed to this process (MEMFIT_SETUP, else the
    file MEMFIT_SETUP_FILE names), or None when it was not launched by memfit."""
    environ = os.environ if environ is None else environ
    text, where = environ.get(ENV_SETUP), ENV_SETUP
    if not text and environ.get(ENV_SETUP_FILE):
        where = f"{ENV_SETUP_FILE} ({environ[ENV_SETUP_FILE]})"
        try:
            text = Path(environ[ENV_SETUP_FILE]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read {where}: {getattr(error, 'strerror', None) or error}: put the "
                              f"{SETUP_FILE} that memfit plan --emit wrote there on every node") from None
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{where} is not JSON ({error}): relaunch with memfit launch") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object of TrainingSetup fields")
    data.pop("notes", None)
    try:
        return TrainingSetup(**data)
    except TypeError as error:
        raise ConfigError(f"{where} has a field TrainingSetup does not know ({error})") from None


def engine_from_env(environ: Mapping[str, str] | None = None, default: Engine | str | None = Engine.TORCH
                    ) -> Engine | None:
    """The engine `memfit launch` chose (MEMFIT_ENGINE), else `default`."""
    name = (os.environ if environ is None else environ).get(ENV_ENGINE) or default
    return None if name is None else Engine.parse(name)


def on_engine(setup: TrainingSetup, engine: Engine | str | None) -> TrainingSetup:
    """The setup run by `engine` (None: its own). Refused, in one line, when that engine cannot express it: torch's
    limits are TrainingSetup's own validation, DeepSpeed's what its config builder refuses."""
    if engine is None:
        return setup
    chosen = Engine.parse(engine)
    try:
        moved = setup if chosen is setup.engine else setup.replace(engine=chosen)
        if chosen is Engine.DEEPSPEED:
            deepspeed_config(moved)
    except ConfigError as error:
        raise ConfigError(f"engine '{chosen}' cannot run this setup: {error}") from None
    return moved


def engine_unsupported(setup: TrainingSetup, engine: Engine | str) -> str | None:
    """Why `engine` cannot run the setup, or None when it can."""
    try:
        on_engine(setup, engine)
    except ConfigError as error:
        return str(error)
    return None


def engine_description(setup: TrainingSetup, engine: Engine | str | None = None) -> str:
    """What runs the setup, in words (estimate.comm.describe_runtime)."""
    return comm.describe_runtime(on_engine(setup, engine))


# --------------------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: environment variables, then the argument vector."""

    node_rank: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        """One line to paste into a shell on that node."""
        prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in self.env)
        return f"{prefix} {shlex.join(self.argv)}" if prefix else shlex.join(self.argv)

    def to_dict(self) -> dict:
        return {"node_rank": self.node_rank, "argv": list(self.argv), "env": dict(self.env), "shell": self.shell()}


def torchrun_commands(hardware: Hardware, script: str, script_args: Sequence[str] = (), *,
                      env: Mapping[str, str] | None = None, master_addr: str = DEFAULT_MASTER,
                      master_port: int = DEFAULT_PORT, job_id: str = "memfit") -> tuple[NodeCommand, ...]:
    """One torchrun command per node; one node runs `--standalone` (a local rendezvous, no endpoint needed).

    Multi-node: every node joins the same c10d rendezvous at node 0's address; `--node-rank` fixes the order (and
    so which ranks share a node), `--rdzv-id` names the job so that two jobs on the same endpoint never mix."""
    _check_port(master_port)
    pairs = tuple((env or {}).items())
    nproc = ("--nproc-per-node", str(hardware.gpus_per_node))
    if hardware.num_nodes == 1:
        return (NodeCommand(0, ("torchrun", "--standalone", *nproc, script, *script_args), pairs),)
    return tuple(NodeCommand(node, ("torchrun", "--nnodes", str(hardware.num_nodes), *nproc, "--node-rank",
                                    str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                    f"{master_addr}:{master_port}", "--rdzv-id", job_id, script, *script_args),
                             pairs)
                 for node in range(hardware.num_nodes))


def deepspeed_commands(hardware: Hardware, script: str, script_args: Sequence[str] = (), *,
                       env: Mapping[str, str] | None = None, master_addr: str = DEFAULT_MASTER,
                       master_port: int = DEFAULT_PORT, hostfile: str = "hostfile") -> tuple[NodeCommand, ...]:
    """The deepspeed launcher: one command, run on node 0, which starts every node's processes over ssh (pdsh)
    from the hostfile. Only node 0 runs a command; see `deepspeed_files` for the hostfile and .deepspeed_env."""
    _check_port(master_port)
    argv = ["deepspeed", "--num_gpus", str(hardware.gpus_per_node)]
    if hardware.num_nodes > 1:
        argv = ["deepspeed", "--hostfile", hostfile, "--num_nodes", str(hardware.num_nodes), "--num_gpus",
                str(hardware.gpus_per_node), "--master_addr", master_addr]
    argv += ["--master_port", str(master_port), script, *script_args]
    return (NodeCommand(0, tuple(argv), tuple((env or {}).items())),)


def deepspeed_files(hardware: Hardware, env: Mapping[str, str], *, hostnames: Sequence[str] = ()) -> dict[str, str]:
    """The deepspeed launcher's hostfile ('HOST slots=GPUS' per node) and .deepspeed_env: the launcher exports only
    a few variable prefixes to remote nodes, and every line of .deepspeed_env (in the working directory or home)."""
    hosts = list(hostnames) or [f"node{index}" for index in range(hardware.num_nodes)]
    if len(hosts) != hardware.num_nodes:
        raise ConfigError(f"{len(hosts)} host names for {hardware.num_nodes} nodes: give one per node")
    files = {".deepspeed_env": "".join(f"{key}={value}\n" for key, value in env.items())}
    if hardware.num_nodes > 1:
        files["hostfile"] = "".join(f"{host} slots={hardware.gpus_per_node}\n" for host in hosts)
    return files


def _check_port(port: int) -> None:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"master port must be a whole number from 1 to 65535, got {port!r}")


# ------------------------------------------------------------------------------------------ communication volume


def comm_volume(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware,
                engine: Engine | str | None = None) -> CommVolume:
    """What each rank sends per optimizer step: memfit.estimate.comm.comm_volume for the setup on `engine` (None:
    the setup's own), its ranks split into `hardware`'s nodes."""
    return comm.comm_volume(spec, on_engine(setup, engine), hardware)


# ------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MultiNodePlan:
    setup: TrainingSetup
    """The setup every rank trains; its `engine` is the engine that runs it."""
    hardware: Hardware
    launcher: str
    per_rank: object
    """The estimator's MemoryEstimate for one rank (memfit.estimate.analytic.estimate); None for a model the
    analytic estimator cannot size."""
    commands: tuple[NodeCommand, ...]
    comm: CommVolume
    files: dict[str, str] = field(default_factory=dict)
    """Files the launcher needs besides the script (deepspeed launcher: hostfile, .deepspeed_env)."""
    notes: tuple[str, ...] = ()

    @property
    def engine(self) -> Engine:
        return self.setup.engine

    @property
    def per_rank_bytes(self) -> int | None:
        return None if self.per_rank is None else self.per_rank.total_bytes

    def to_dict(self) -> dict:
        return {"engine": self.engine.value, "engine_description": engine_description(self.setup),
                "launcher": self.launcher, "world_size": self.hardware.world_size,
                "num_nodes": self.hardware.num_nodes, "gpus_per_node": self.hardware.gpus_per_node,
                "per_rank_bytes": self.per_rank_bytes,
                "per_rank_tensor_bytes": None if self.per_rank is None else self.per_rank.tensor_bytes,
                "commands": [c.to_dict() for c in self.commands], "communication": self.comm.to_dict(),
                "files": dict(self.files), "notes": list(self.notes), "setup": self.setup.to_dict()}


def launch_plan(plan_or_setup, hardware: Hardware | None = None, script: str = "train.py", *,
                spec: ModelSpec | None = None, engine: Engine | str | None = None, launcher: str = "torchrun",
                master_addr: str = DEFAULT_MASTER, master_port: int = DEFAULT_PORT,
                script_args: Sequence[str] = (), hostnames: Sequence[str] = (),
                setup_file: str | None = None) -> MultiNodePlan:
    """How to launch a setup (or a Plan's final setup) on `hardware`: per-rank memory, one command per node, and
    the communication volume per step. `spec` is needed with a setup (a Plan carries its own); `engine` replaces
    the setup's own (refused when it cannot run the setup). With `setup_file`, the commands name that file
    (MEMFIT_SETUP_FILE) instead of carrying the setup's JSON, and `files` holds its text."""
    from .estimate.analytic import estimate

    setup, hardware, spec, per_rank = _resolve_plan(plan_or_setup, hardware, spec)
    if setup.num_gpus != hardware.world_size:
        setup, per_rank = setup.replace(num_gpus=hardware.world_size), None
    moved = on_engine(setup, engine if engine is not None else setup.engine)
    if moved != setup:
        setup, per_rank = moved, None
    if launcher not in LAUNCHERS:
        raise ConfigError(f"unknown launcher '{launcher}': choose one of {', '.join(LAUNCHERS)}")
    if per_rank is None and spec.is_transformer:
        per_rank = estimate(spec, setup, hardware)
    env = setup_env(setup, setup_file=setup_file)
    files: dict[str, str] = {} if setup_file is None else {setup_file: setup_file_text(setup)}
    notes = [f"replace {DEFAULT_MASTER} with node 0's host name or IP"] if (
        hardware.num_nodes > 1 and master_addr == DEFAULT_MASTER) else []
    if setup_file is not None:
        notes.append(f"every rank reads the setup from {setup_file} ({ENV_SETUP_FILE}, relative to where the command "
                     "runs): the same file on every node")
    if launcher == "deepspeed":
        commands = deepspeed_commands(hardware, script, script_args, env=env, master_addr=master_addr,
                                      master_port=master_port)
        files.update(deepspeed_files(hardware, env, hostnames=hostnames))
        notes.append("run the one command on node 0; it starts the other nodes over ssh (pdsh) from the hostfile")
    else:
        commands = torchrun_commands(hardware, script, script_args, env=env, master_addr=master_addr,
                                     master_port=master_port)
    volume = comm.comm_volume(spec, setup, hardware)
    notes += tensor_parallel_notes(setup, hardware) + pipeline_notes(spec, setup, hardware)
    return MultiNodePlan(setup, hardware, launcher, per_rank, commands, volume, files, tuple(notes) + volume.notes)


def tensor_parallel_notes(setup: TrainingSetup, hardware: Hardware) -> list[str]:
    """How a tensor-parallel setup is launched: the same torchrun commands, a 2D device mesh in the script."""
    if setup.tp < 2:
        return []
    sp = "on" if setup.sequence_parallel else "off"
    if setup.pp > 1 or setup.cp > 1 or setup.dp_shard:
        # a larger mesh: torchtitan's order (pp, dp_replicate, dp_shard, cp, tp); its keys come from pipeline_notes
        notes = [f"device mesh in the script: tp {setup.tp} innermost, then cp {setup.cp}, dp {setup.dp_size}, pp "
                 f"{setup.pp} (torchtitan ParallelDims); parallelize_module on mesh['tp'] (sequence parallel {sp}), "
                 "fully_shard on the data-parallel dimensions"]
    else:
        notes = [f"2D mesh in the script: init_device_mesh('cuda', ({setup.dp_size}, {setup.tp}), "
                 f"mesh_dim_names=('dp', 'tp')); parallelize_module on mesh['tp'] (ColwiseParallel q/k/v and gate/up, "
                 f"RowwiseParallel o and down, sequence parallel {sp}), then fully_shard on mesh['dp'] "
                 "(memfit._torch.tensor_parallel)",
                 f"torchtitan: [parallelism] tensor_parallel_degree = {setup.tp}, data_parallel_shard_degree = "
                 f"{setup.dp_size if setup.sharding.stage >= 2 else 1} in its TOML (it always pairs TP with sequence "
                 "parallelism and loss_parallel)"]
    if setup.tp > hardware.gpus_per_node:
        notes.append(f"tp {setup.tp} spans more than one node ({hardware.gpus_per_node} GPUs each): its per-layer "
                     "collectives cross the network; keep tp within a node")
    return notes


def pipeline_notes(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> list[str]:
    """How a pipeline- or context-parallel, HSDP or float8 setup is launched: torchtitan's TOML keys
    (memfit.emit.torchtitan)."""
    if setup.pp < 2 and setup.cp < 2 and not setup.dp_shard and not setup.float8.is_on:
        return []
    toml = "; ".join(line for line in torchtitan_toml(setup, spec.num_layers).splitlines() if line)
    notes = [f"torchtitan: {toml}" + (" (pipeline stages on torch.distributed.pipelining; memfit._torch.pipeline "
                                      "cuts a transformers Llama the same way)" if setup.pp > 1 else "")]
    if setup.pp * setup.tp > hardware.gpus_per_node:
        notes.append(f"pp {setup.pp} x tp {setup.tp} spans nodes: the stage-to-stage sends (B x T x h per "
                     "micro-batch) cross the network, which point-to-point tolerates far better than TP")
    return notes


def setup_file_text(setup: TrainingSetup) -> str:
    """memfit_setup.json's text: `setup_fields` as JSON (what setup_from_env reads through MEMFIT_SETUP_FILE)."""
    return json.dumps(setup_fields(setup), indent=2) + "\n"


def launches(setup: TrainingSetup, world_size: int) -> bool:
    """Whether `memfit plan` prints launch commands for the setup on `world_size` ranks: more than one rank, or
    one GPU whose setup runs DeepSpeed's ZeRO with CPU offload (one process under a launcher)."""
    return world_size > 1 or one_gpu_offload(setup)


def one_gpu_offload(setup: TrainingSetup) -> bool:
    """A one-GPU setup that DeepSpeed runs as ZeRO-Offload / ZeRO-Infinity (memfit.setup allows ZeRO on one GPU only
    with offload, and only on DeepSpeed)."""
    return (setup.num_gpus == 1 and setup.engine is Engine.DEEPSPEED and setup.sharding is not Sharding.NONE
            and setup.offload is not Offload.NONE)


def _resolve_plan(plan_or_setup, hardware: Hardware | None, spec: ModelSpec | None):
    if isinstance(plan_or_setup, TrainingSetup):
        if spec is None or hardware is None:
            raise ConfigError("launch_plan(setup, hardware, script, spec=...) needs the hardware and the model spec "
                              "for a setup (a Plan carries both)")
        return plan_or_setup, hardware, spec, None
    final = getattr(plan_or_setup, "final_setup", None)
    if not isinstance(final, TrainingSetup):
        raise ConfigError(f"launch_plan takes a TrainingSetup or a Plan, got {type(plan_or_setup).__name__}")
    plan_hardware = plan_or_setup.hardware
    same = hardware is None or hardware == plan_hardware
    return (final, plan_hardware if hardware is None else hardware, spec or plan_or_setup.spec,
            plan_or_setup.final_estimate if same else None)


def launch_section(plan, *, script: str = "train.py", setup_file: str | None = SETUP_FILE) -> MultiNodePlan | None:
    """The launch part of `memfit plan` for more than one rank, or for one GPU whose final setup runs DeepSpeed's
    ZeRO with CPU offload (one process under a launcher: `deepspeed.initialize` joins a one-rank group). None
    otherwise, or when no engine runs the plan's final setup. The commands read the setup from `setup_file`."""
    if not launches(plan.final_setup, plan.hardware.world_size):
        return None
    try:
        return launch_plan(plan, script=script, setup_file=setup_file)
    except ConfigError:
        return None


def local_command(setup: TrainingSetup, gpus_per_node: int, script: str, script_args: Sequence[str] = (), *,
                  engine: Engine | str | None = None, python: str | None = None) -> NodeCommand:
    """The one-node command `memfit launch` runs: torchrun --standalone with the setup (on `engine`, default its
    own) in the environment. With `python`, torchrun is started as `python -m torch.distributed.run` (the same
    program, no PATH lookup)."""
    from .hardware import cpu_device

    hardware = Hardware(gpu=cpu_device(1), gpus_per_node=gpus_per_node)
    command = torchrun_commands(hardware, script, script_args, env=setup_env(setup, engine))[0]
    if python:
        command = NodeCommand(0, (python, "-m", "torch.distributed.run", *command.argv[1:]), command.env)
    return command


# --------------------------------------------------------------------------------- the in-process side (torch)


def prepare(model, setup: TrainingSetup | None = None, *, engine: Engine | str | None = None, **options):
    """Shard `model` on its engine and build its optimizer, on this rank (see memfit._torch.engine.prepare). With no
    setup, the one `memfit launch` put in the environment; with no engine, the environment's (MEMFIT_ENGINE), else
    the setup's own. Imports torch."""
    from ._torch import engine as torch_engine

    setup = setup or setup_from_env()
    if setup is None:
        raise ConfigError(f"no setup: pass one, or start the script with memfit launch (which sets {ENV_SETUP})")
    return torch_engine.prepare(model, setup, engine=engine or engine_from_env(default=None), **options)


def shard(model, setup: TrainingSetup | None = None, **options):
    """FSDP2 `fully_shard` per block and on the root for a ZeRO-2/3 setup (memfit._torch.engine.shard). Imports
    torch."""
    from ._torch import engine as torch_engine

    setup = setup or setup_from_env()
    if setup is None:
        raise ConfigError(f"no setup: pass one, or start the script with memfit launch (which sets {ENV_SETUP})")
    return torch_engine.shard(model, setup, **options)
