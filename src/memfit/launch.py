"""Launching a sharded training job: the command each node runs, what each rank holds, and what goes over the wire.

Pure: no torch. `launch_plan(plan_or_setup, hardware, script)` gives a `MultiNodePlan` with the per-rank memory
(the estimator's), one command per node and the communication volume per step of the chosen sharding. The running
script learns its setup and engine from two environment variables the commands set (MEMFIT_SETUP, MEMFIT_ENGINE) and
calls `prepare(model, setup)` (memfit._torch.engine, imported lazily) on every rank.

Engines: "fsdp" runs torch.distributed (FSDP2 for ZeRO-2/3, ZeroRedundancyOptimizer for ZeRO-1, all-reduced
gradients without sharding); "deepspeed" runs `deepspeed.initialize` with memfit's DeepSpeed config. Launchers:
"torchrun" (both engines; DeepSpeed reads torchrun's RANK/WORLD_SIZE/MASTER_ADDR) or "deepspeed" (its own launcher:
one command on node 0 that reaches the others over ssh/pdsh through a hostfile).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import ConfigError
from .hardware import Hardware
from .model_spec import ModelSpec
from .setup import Engine, Offload, Precision, Sharding, TrainingSetup

ENGINES = ("fsdp", "deepspeed")
LAUNCHERS = ("torchrun", "deepspeed")
ENV_SETUP = "MEMFIT_SETUP"
ENV_ENGINE = "MEMFIT_ENGINE"
DEFAULT_PORT = 29500
DEFAULT_MASTER = "NODE0_HOST"
"""Placeholder for node 0's address in printed commands: replace it with the host name or IP of node 0."""


# ------------------------------------------------------------------------------------- setup over the environment


def setup_env(setup: TrainingSetup, engine: str) -> dict[str, str]:
    """The environment a launched script reads its setup and engine from (`setup_from_env`, `engine_from_env`)."""
    data = {key: value for key, value in setup.to_dict().items() if key != "notes"}
    return {ENV_ENGINE: check_engine(engine), ENV_SETUP: json.dumps(data, separators=(",", ":"))}


def setup_from_env(environ: Mapping[str, str] | None = None) -> TrainingSetup | None:
    """The TrainingSetup `memfit launch` passed to this process, or None when it was not launched by memfit."""
    text = (os.environ if environ is None else environ).get(ENV_SETUP)
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{ENV_SETUP} is not JSON ({error}): relaunch with memfit launch") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{ENV_SETUP} must be a JSON object of TrainingSetup fields")
    data.pop("notes", None)
    try:
        return TrainingSetup(**data)
    except TypeError as error:
        raise ConfigError(f"{ENV_SETUP} has a field TrainingSetup does not know ({error})") from None


def engine_from_env(environ: Mapping[str, str] | None = None, default: str = "fsdp") -> str:
    return check_engine((os.environ if environ is None else environ).get(ENV_ENGINE) or default)


def check_engine(engine: str) -> str:
    name = str(engine).strip().lower()
    name = {"fsdp2": "fsdp", "torch": "fsdp", "ds": "deepspeed"}.get(name, name)
    if name not in ENGINES:
        raise ConfigError(f"unknown engine '{engine}': choose one of {', '.join(ENGINES)}")
    return name


# ---------------------------------------------------------------------------------- which engine runs the setup


def engine_unsupported(setup: TrainingSetup, engine: str) -> str | None:
    """Why `engine` cannot run the setup, or None when it can. torch's limits are TrainingSetup's own validation
    (engine torch); DeepSpeed's are what its config builder refuses."""
    try:
        if check_engine(engine) == "deepspeed":
            from .emit import deepspeed_config

            deepspeed_config(setup)
        else:
            setup.replace(engine=Engine.TORCH)
    except ConfigError as error:
        return str(error)
    return None


def default_engine(setup: TrainingSetup) -> str:
    """The setup's engine (TrainingSetup.engine: 'torch' runs as DDP / ZeroRedundancyOptimizer / FSDP2 here)."""
    return "fsdp" if setup.engine is Engine.TORCH else "deepspeed"


def engine_description(setup: TrainingSetup, engine: str) -> str:
    if check_engine(engine) == "deepspeed":
        return f"DeepSpeed ZeRO stage {max(setup.sharding.stage, 1 if setup.offload is not Offload.NONE else 0)}"
    return {Sharding.NONE: "torch data parallel (gradients all-reduced)",
            Sharding.ZERO1: "torch ZeroRedundancyOptimizer (ZeRO-1)",
            Sharding.ZERO2: "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)",
            Sharding.ZERO3: "FSDP2 fully_shard, reshard_after_forward=True (ZeRO-3)"}[setup.sharding]


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


@dataclass(frozen=True)
class Collective:
    name: str
    """'all-gather', 'reduce-scatter', 'all-reduce' or 'broadcast'."""
    what: str
    elements: int
    """Elements each rank moves per optimizer step (ZeRO paper convention: Psi per collective over P elements)."""
    dtype_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.elements * self.dtype_bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "elements": self.elements, "dtype_bytes": self.dtype_bytes,
                "bytes": self.num_bytes}


@dataclass(frozen=True)
class CommVolume:
    """Bytes each rank sends per optimizer step, split by collective. Source: ZeRO (Rajbhandari et al. 2020,
    arXiv:1910.02054) sec. 7: DDP and ZeRO-1/2 move 2 Psi (reduce-scatter of gradients + all-gather of parameters,
    which is what a ring all-reduce is), ZeRO-3 3 Psi (parameters gathered in forward and again in backward).
    A ring collective over N ranks sends (N-1)/N of Psi per rank; the paper (and these totals) round that to Psi."""

    collectives: tuple[Collective, ...]
    num_params: int
    world_size: int
    num_nodes: int
    gpus_per_node: int
    notes: tuple[str, ...] = ()

    @property
    def per_rank_bytes(self) -> int:
        return sum(c.num_bytes for c in self.collectives)

    @property
    def psi_multiple(self) -> float:
        """Total elements over P: 2 for DDP and ZeRO-1/2, 3 for ZeRO-3 (torch's ZeRO-1 adds a broadcast: 3)."""
        return sum(c.elements for c in self.collectives) / self.num_params if self.num_params else 0.0

    @property
    def inter_node_bytes_per_node(self) -> int:
        """Bytes per step crossing each node's network link. A ring over all ranks, ordered by node, sends on every
        link what each rank sends, (N-1)/N of Psi per collective; one link out of each node crosses the network,
        so each node's link carries one rank's volume and the node-local links (NVLink) carry the rest."""
        if self.num_nodes < 2:
            return 0
        return self.per_rank_bytes * (self.world_size - 1) // self.world_size

    @property
    def inter_node_peer_fraction(self) -> float:
        """Share of each rank's peers on other nodes, (N - G) / (N - 1): the share of its traffic that would cross
        the network without a node-aware (ring or hierarchical) algorithm."""
        if self.world_size < 2:
            return 0.0
        return (self.world_size - self.gpus_per_node) / (self.world_size - 1)

    def to_dict(self) -> dict:
        return {"per_rank_bytes": self.per_rank_bytes, "psi_multiple": self.psi_multiple,
                "collectives": [c.to_dict() for c in self.collectives],
                "inter_node_bytes_per_node": self.inter_node_bytes_per_node,
                "inter_node_peer_fraction": self.inter_node_peer_fraction, "world_size": self.world_size,
                "num_nodes": self.num_nodes, "notes": list(self.notes)}


def comm_volume(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware, engine: str = "fsdp") -> CommVolume:
    """What each rank sends per optimizer step for the setup's sharding on `engine` (gradient accumulation: FSDP2
    and DeepSpeed still reduce once per micro-step unless told not to; counted here once per optimizer step)."""
    engine = check_engine(engine)
    params = spec.num_params
    gather_bytes = 4 if setup.precision is Precision.FP32 else 2  # parameters travel in the compute dtype
    reduce_bytes = _reduce_dtype_bytes(setup, engine)
    gather = Collective("all-gather", "parameters (before forward)", params, gather_bytes)
    scatter = Collective("reduce-scatter", "gradients (after backward)", params, reduce_bytes)
    notes: list[str] = []
    stage = setup.sharding.stage
    if stage == 0:
        collectives = (Collective("all-reduce", "gradients (a ring all-reduce: reduce-scatter + all-gather)",
                                  2 * params, reduce_bytes),)
    elif stage == 3:
        collectives = (gather, Collective("all-gather", "parameters again in backward", params, gather_bytes),
                       scatter)
    elif stage == 1 and engine == "fsdp":
        collectives = (Collective("all-reduce", "whole gradients", 2 * params, reduce_bytes),
                       Collective("broadcast", "updated parameters from their owner", params, gather_bytes))
        notes.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) all-reduces whole gradients and broadcasts the "
                     "updated parameters: 3 Psi, where DeepSpeed's ZeRO-1 reduce-scatters (2 Psi)")
    else:
        collectives = (Collective("reduce-scatter", "gradients (after backward)", params, reduce_bytes),
                       Collective("all-gather", "updated parameters (after the step)" if engine == "deepspeed"
                                  else "parameters (before forward, kept until backward)", params, gather_bytes))
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        notes.append("parameter offload adds host<->device copies (techniques.costs.offload_traffic_bytes), not "
                     "network traffic")
    return CommVolume(collectives, params, hardware.world_size, hardware.num_nodes, hardware.gpus_per_node,
                      tuple(notes))


def _reduce_dtype_bytes(setup: TrainingSetup, engine: str) -> int:
    """FSDP2 as memfit configures it reduces in fp32 under mixed precision (reduce_dtype=float32); DeepSpeed
    communicates in the model's dtype (communication_data_type defaults to bf16/fp16 when those are on)."""
    if setup.precision is Precision.FP32:
        return 4
    if setup.precision is Precision.BF16:
        return 2
    return 4 if engine == "fsdp" else 2


# ------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class MultiNodePlan:
    setup: TrainingSetup
    hardware: Hardware
    engine: str
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
    def per_rank_bytes(self) -> int | None:
        return None if self.per_rank is None else self.per_rank.total_bytes

    def to_dict(self) -> dict:
        return {"engine": self.engine, "engine_description": engine_description(self.setup, self.engine),
                "launcher": self.launcher, "world_size": self.hardware.world_size,
                "num_nodes": self.hardware.num_nodes, "gpus_per_node": self.hardware.gpus_per_node,
                "per_rank_bytes": self.per_rank_bytes,
                "per_rank_tensor_bytes": None if self.per_rank is None else self.per_rank.tensor_bytes,
                "commands": [c.to_dict() for c in self.commands], "communication": self.comm.to_dict(),
                "files": dict(self.files), "notes": list(self.notes), "setup": self.setup.to_dict()}


def launch_plan(plan_or_setup, hardware: Hardware | None = None, script: str = "train.py", *,
                spec: ModelSpec | None = None, engine: str | None = None, launcher: str = "torchrun",
                master_addr: str = DEFAULT_MASTER, master_port: int = DEFAULT_PORT,
                script_args: Sequence[str] = (), hostnames: Sequence[str] = ()) -> MultiNodePlan:
    """How to launch a setup (or a Plan's final setup) on `hardware`: per-rank memory, one command per node, and
    the communication volume per step. `spec` is needed with a setup (a Plan carries its own); `engine` defaults to
    torch's (FSDP2, ZeroRedundancyOptimizer) where it can express the setup, else DeepSpeed."""
    from .estimate.analytic import estimate

    setup, hardware, spec, per_rank = _resolve_plan(plan_or_setup, hardware, spec)
    if setup.num_gpus != hardware.world_size:
        setup, per_rank = setup.replace(num_gpus=hardware.world_size), None
    engine = default_engine(setup) if engine is None else check_engine(engine)
    why_not = engine_unsupported(setup, engine)
    if why_not:
        raise ConfigError(f"engine '{engine}' cannot run this setup: {why_not}")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"unknown launcher '{launcher}': choose one of {', '.join(LAUNCHERS)}")
    if per_rank is None and spec.is_transformer:
        per_rank = estimate(spec, setup, hardware)
    env = setup_env(setup, engine)
    files: dict[str, str] = {}
    notes = [f"replace {DEFAULT_MASTER} with node 0's host name or IP"] if (
        hardware.num_nodes > 1 and master_addr == DEFAULT_MASTER) else []
    if launcher == "deepspeed":
        commands = deepspeed_commands(hardware, script, script_args, env=env, master_addr=master_addr,
                                      master_port=master_port)
        files = deepspeed_files(hardware, env, hostnames=hostnames)
        notes.append("run the one command on node 0; it starts the other nodes over ssh (pdsh) from the hostfile")
    else:
        commands = torchrun_commands(hardware, script, script_args, env=env, master_addr=master_addr,
                                     master_port=master_port)
    comm = comm_volume(spec, setup, hardware, engine)
    return MultiNodePlan(setup, hardware, engine, launcher, per_rank, commands, comm, files,
                         tuple(notes) + comm.notes)


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


def launch_section(plan, *, script: str = "train.py") -> MultiNodePlan | None:
    """The launch part of `memfit plan` for more than one rank (None for one GPU, or when no engine runs the plan's
    final setup)."""
    if plan.hardware.world_size < 2:
        return None
    try:
        return launch_plan(plan, script=script)
    except ConfigError:
        return None


def local_command(setup: TrainingSetup, gpus_per_node: int, script: str, script_args: Sequence[str] = (), *,
                  engine: str = "fsdp", python: str | None = None) -> NodeCommand:
    """The one-node command `memfit launch` runs: torchrun --standalone with the setup in the environment. With
    `python`, torchrun is started as `python -m torch.distributed.run` (the same program, no PATH lookup)."""
    from .hardware import cpu_device

    hardware = Hardware(gpu=cpu_device(1), gpus_per_node=gpus_per_node)
    command = torchrun_commands(hardware, script, script_args, env=setup_env(setup, engine))[0]
    if python:
        command = NodeCommand(0, (python, "-m", "torch.distributed.run", *command.argv[1:]), command.env)
    return command


# --------------------------------------------------------------------------------- the in-process side (torch)


def prepare(model, setup: TrainingSetup | None = None, *, engine: str | None = None, **options):
    """Shard `model` on its engine and build its optimizer, on this rank (see memfit._torch.engine.prepare). With no
    setup/engine, the ones `memfit launch` put in the environment. Imports torch."""
    from ._torch import engine as torch_engine

    setup = setup or setup_from_env()
    if setup is None:
        raise ConfigError(f"no setup: pass one, or start the script with memfit launch (which sets {ENV_SETUP})")
    return torch_engine.prepare(model, setup, engine=engine or engine_from_env(), **options)


def shard(model, setup: TrainingSetup | None = None, **options):
    """FSDP2 `fully_shard` per block and on the root for a ZeRO-2/3 setup (memfit._torch.engine.shard). Imports
    torch."""
    from ._torch import engine as torch_engine

    setup = setup or setup_from_env()
    if setup is None:
        raise ConfigError(f"no setup: pass one, or start the script with memfit launch (which sets {ENV_SETUP})")
    return torch_engine.shard(model, setup, **options)
