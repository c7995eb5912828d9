"""Multi-node on paper (pure, no torch): the command each node runs, the communication volume per step of each
ZeRO stage as the launch plan shows it (memfit.estimate.comm's numbers; tests/estimate/test_comm.py checks the model itself),
and the per-rank memory, which is the estimator's own number."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import make_hardware
from memfit.estimate import comm
from memfit.launch import (ENV_ENGINE, ENV_SETUP, comm_volume, engine_description, engine_from_env,
                           engine_unsupported, launch_plan, launch_section, local_command, setup_env, setup_from_env)
from memfit.plan import plan
from memfit.setup import Engine, TrainingSetup
from memfit.sources import resolve_model
from memfit.techniques.costs import zero_cost, zero_traffic_bytes

SPEC_70B = resolve_model("llama-2-70b")
FOUR_BY_EIGHT = make_hardware("H100", gpus_per_node=8, num_nodes=4)
SETUP_70B = TrainingSetup(micro_batch_size=1, seq_len=4096, precision="bf16", optimizer="adamw",
                          checkpointing="full", sharding="zero3", num_gpus=32, engine="torch")


def _flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_torchrun_command_per_node_on_one_rendezvous():
    launch = launch_plan(SETUP_70B, FOUR_BY_EIGHT, "train.py", spec=SPEC_70B, master_addr="10.1.2.3",
                         script_args=["--lr", "1e-5"])
    assert [c.node_rank for c in launch.commands] == [0, 1, 2, 3]
    for node, command in enumerate(launch.commands):
        argv = command.argv
        assert argv[0] == "torchrun" and argv[-3:] == ("train.py", "--lr", "1e-5")
        assert _flag(argv, "--nnodes") == "4" and _flag(argv, "--nproc-per-node") == "8"
        assert _flag(argv, "--node-rank") == str(node)
        assert _flag(argv, "--rdzv-backend") == "c10d"
        assert _flag(argv, "--rdzv-endpoint") == "10.1.2.3:29500"
        env = dict(command.env)
        assert env[ENV_ENGINE] == "torch" and launch.engine is Engine.TORCH
        assert setup_from_env(env) == SETUP_70B  # every rank trains the planned setup
        # The pasted line is the same command: the shell splits it back into the environment and argv.
        words = shlex.split(command.shell())
        assert words[len(env):] == list(argv) and words[:len(env)] == [f"{k}={v}" for k, v in command.env]
    assert len({_flag(c.argv, "--rdzv-id") for c in launch.commands}) == 1
    assert len({c.env for c in launch.commands}) == 1


def test_one_node_is_standalone_and_the_local_run_uses_this_python():
    hardware = make_hardware("H100", gpus_per_node=2)
    setup = SETUP_70B.replace(num_gpus=2)
    (command,) = launch_plan(setup, hardware, "train.py", spec=SPEC_70B).commands
    assert command.argv == ("torchrun", "--standalone", "--nproc-per-node", "2", "train.py")
    local = local_command(setup, 2, "train.py", ["--steps", "3"], engine="deepspeed", python="/venv/bin/python")
    assert local.argv[:3] == ("/venv/bin/python", "-m", "torch.distributed.run")
    assert local.argv[3:] == ("--standalone", "--nproc-per-node", "2", "train.py", "--steps", "3")
    assert dict(local.env)[ENV_ENGINE] == "deepspeed"


def test_deepspeed_launcher_runs_one_command_from_a_hostfile():
    launch = launch_plan(SETUP_70B, FOUR_BY_EIGHT, "train.py", spec=SPEC_70B, engine="deepspeed",
                         launcher="deepspeed", hostnames=["a", "b", "c", "d"])
    (command,) = launch.commands
    argv = command.argv
    assert argv[0] == "deepspeed" and _flag(argv, "--hostfile") == "hostfile"
    assert _flag(argv, "--num_nodes") == "4" and _flag(argv, "--num_gpus") == "8"
    assert launch.files["hostfile"] == "a slots=8\nb slots=8\nc slots=8\nd slots=8\n"
    # The deepspeed launcher forwards only some variables to other nodes; .deepspeed_env carries memfit's.
    forwarded = dict(line.split("=", 1) for line in launch.files[".deepspeed_env"].splitlines())
    assert setup_from_env(forwarded) == SETUP_70B.replace(engine="deepspeed") and forwarded[ENV_ENGINE] == "deepspeed"


@pytest.mark.parametrize("sharding,engine,multiple", [
    ("none", "torch", 2), ("zero1", "torch", 3), ("zero2", "torch", 2), ("zero3", "torch", 3),
    ("none", "deepspeed", 2), ("zero1", "deepspeed", 3), ("zero2", "deepspeed", 3), ("zero3", "deepspeed", 2.99)])
def test_launch_comm_is_the_one_models_on_four_nodes(sharding, engine, multiple):
    """bf16 weights on 32 ranks (DeepSpeed: bf16-master, its bf16 mode): Psi = P in bf16. The paper's 2 / 2 / 2 /
    3 Psi where the engine does what the paper does; torch's ZeRO-1 broadcasts and DeepSpeed's ZeRO-1/2 all-reduce
    (3 Psi); DeepSpeed's ZeRO-3 keeps 5e8 elements gathered into backward (2.99 Psi for 69B parameters)."""
    setup = SETUP_70B.replace(sharding=sharding, engine=engine,
                              precision="bf16" if engine == "torch" else "bf16-master")
    launch = comm_volume(SPEC_70B, setup, FOUR_BY_EIGHT)
    psi = 2 * SPEC_70B.num_params
    assert launch == comm.comm_volume(SPEC_70B, setup, FOUR_BY_EIGHT)  # one model, launch only shows it
    assert launch.psi_multiple == pytest.approx(multiple, abs=0.005)
    assert launch.per_rank_bytes == zero_traffic_bytes(SPEC_70B, setup)  # techniques/costs.py is the same model
    assert launch.per_rank_bytes == round(launch.psi_multiple * psi)
    # A ring over 32 ranks, ordered by node: each node's link carries one rank's volume, (N-1)/N of Psi per call.
    assert launch.inter_node_bytes_per_node == launch.per_rank_bytes * 31 // 32
    assert launch.inter_node_peer_fraction == pytest.approx(24 / 31)


def test_comm_volume_dtypes_engines_and_nodes():
    fp32 = comm_volume(SPEC_70B, SETUP_70B.replace(precision="fp32"), FOUR_BY_EIGHT)
    assert fp32.per_rank_bytes == 3 * 4 * SPEC_70B.num_params
    # FSDP2 under mixed precision gathers bf16 parameters but reduces gradients in fp32 (reduce_dtype).
    amp = comm_volume(SPEC_70B, SETUP_70B.replace(precision="amp-bf16"), FOUR_BY_EIGHT)
    assert {c.name: c.dtype_bytes for c in amp.collectives} == {"all-gather": 2, "reduce-scatter": 4}
    # The engine argument replaces the setup's engine; a string alias names the same engine.
    assert comm_volume(SPEC_70B, SETUP_70B, FOUR_BY_EIGHT, "ds") == comm_volume(
        SPEC_70B, SETUP_70B.replace(engine="deepspeed"), FOUR_BY_EIGHT)
    zero1 = comm_volume(SPEC_70B, SETUP_70B.replace(sharding="zero1"), FOUR_BY_EIGHT)
    assert zero1.psi_multiple == 3 and zero1.per_rank_bytes == 3 * 2 * SPEC_70B.num_params
    one_node = comm_volume(SPEC_70B, SETUP_70B.replace(num_gpus=8), make_hardware("H100", gpus_per_node=8))
    assert one_node.inter_node_bytes_per_node == 0
    zero3 = zero_cost(SPEC_70B, SETUP_70B)  # the ZeRO rung's cost: ZeRO-3's 3 Psi, 1.5x the DP all-reduce's 2 Psi
    volume = comm.comm_volume(SPEC_70B, SETUP_70B)
    assert zero3.wire_bytes == volume.per_rank_bytes and volume.psi_multiple == 3
    assert zero3.wire_bytes == 1.5 * comm.data_parallel_bytes(SPEC_70B, SETUP_70B)


def test_per_rank_memory_is_the_estimate_of_the_sharded_setup():
    launch = launch_plan(SETUP_70B, FOUR_BY_EIGHT, "train.py", spec=SPEC_70B)
    assert launch.per_rank_bytes == estimate(SPEC_70B, SETUP_70B, FOUR_BY_EIGHT).total_bytes
    # A setup written for another world size is re-sized to the hardware's 32 ranks.
    resized = launch_plan(SETUP_70B.replace(num_gpus=8), FOUR_BY_EIGHT, "train.py", spec=SPEC_70B)
    assert resized.setup.num_gpus == 32 and resized.per_rank_bytes == launch.per_rank_bytes
    assert launch.per_rank_bytes < estimate(SPEC_70B, SETUP_70B.replace(num_gpus=8),
                                            make_hardware("H100", gpus_per_node=8)).total_bytes


def test_plan_of_70b_on_four_nodes_carries_its_launch():
    result = plan(SPEC_70B, TrainingSetup(micro_batch_size=1, seq_len=4096, num_gpus=32), FOUR_BY_EIGHT)
    section = launch_section(result)
    assert result.fits and section is not None
    assert section.setup == result.final_setup and section.per_rank_bytes == result.final_estimate.total_bytes
    assert len(section.commands) == 4 and section.engine is result.final_setup.engine
    assert launch_section(plan(SPEC_70B, TrainingSetup(num_gpus=1), make_hardware("H100"))) is None


def test_engine_choice_and_refusals():
    # One engine vocabulary: setup.Engine. The setup names its engine; aliases (fsdp, ds) parse to it; what torch's
    # engines cannot express is refused when the setup is built.
    assert launch_plan(SETUP_70B, FOUR_BY_EIGHT, "t.py", spec=SPEC_70B).engine is Engine.TORCH
    assert launch_plan(SETUP_70B, FOUR_BY_EIGHT, "t.py", spec=SPEC_70B, engine="ds").engine is Engine.DEEPSPEED
    assert engine_from_env({ENV_ENGINE: "fsdp"}) is Engine.TORCH and engine_from_env({}) is Engine.TORCH
    assert engine_from_env({}, default=None) is None
    assert engine_description(SETUP_70B) == "FSDP2 fully_shard, reshard_after_forward=True (ZeRO-3)"
    assert engine_description(SETUP_70B.replace(sharding="none", precision="bf16-master"),
                              "deepspeed") == "DeepSpeed ZeRO stage 0"
    with pytest.raises(ConfigError, match="FSDP2"):
        SETUP_70B.replace(optimizer="adamw-8bit")
    with pytest.raises(ConfigError, match="ZeRO-1"):
        SETUP_70B.replace(sharding="zero1", precision="bf16-master")
    offloaded = SETUP_70B.replace(engine="deepspeed", offload="optimizer")
    assert "ZeRO-Offload" in engine_unsupported(offloaded, "fsdp")
    assert engine_unsupported(offloaded, "deepspeed") is None
    with pytest.raises(ConfigError, match="engine 'torch' cannot run"):
        launch_plan(offloaded, FOUR_BY_EIGHT, "t.py", spec=SPEC_70B, engine="fsdp")
    with pytest.raises(ConfigError, match="unknown engine"):
        launch_plan(SETUP_70B, FOUR_BY_EIGHT, "t.py", spec=SPEC_70B, engine="megatron")
    with pytest.raises(ConfigError, match="needs the hardware and the model spec"):
        launch_plan(SETUP_70B, FOUR_BY_EIGHT, "t.py")
    with pytest.raises(ConfigError, match="master port"):
        launch_plan(SETUP_70B, FOUR_BY_EIGHT, "t.py", spec=SPEC_70B, master_port=70000)


def test_setup_round_trips_through_the_environment():
    setup = TrainingSetup(micro_batch_size=3, seq_len=512, grad_accum_steps=4, precision="bf16-master",
                          optimizer="sgd", checkpointing="full", attention="eager", sharding="zero2", num_gpus=16,
                          notes=("dropped on the way",))
    env = setup_env(setup, "fsdp2")
    assert env[ENV_ENGINE] == "torch" and setup_from_env(env) == setup.replace(engine="torch")
    assert setup_from_env({}) is None
    with pytest.raises(ConfigError, match=ENV_SETUP):
        setup_from_env({ENV_SETUP: "{not json"})
    with pytest.raises(ConfigError, match="does not know"):
        setup_from_env({ENV_SETUP: json.dumps({"micro_batch": 2})})


NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}


def test_cli_plan_shows_launch_and_communication_and_json_carries_them():
    args = ["plan", "llama-2-70b", "--gpu", "H100", "--gpus", "8", "--nodes", "4", "-b", "1", "-s", "4096"]
    runner = CliRunner(env=NARROW)
    text = runner.invoke(app, args)
    assert text.exit_code == 0, text.output
    assert "Launch (per node)" in text.output and "Communication per step" in text.output
    assert "--node-rank 3" in text.output and "Psi" in text.output
    # Everything but the pasteable commands (printed whole on one line each, never wrapped) fits 80 columns.
    assert max(len(line) for line in text.output.splitlines() if "torchrun" not in line) <= 80
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    launch = data["launch"]
    assert [c["node_rank"] for c in launch["commands"]] == [0, 1, 2, 3]
    final = data["steps"][-1]["total_bytes"] if data["steps"] else data["initial_estimate"]["total_bytes"]
    assert launch["per_rank_bytes"] == final
    assert launch["communication"]["per_rank_bytes"] == sum(c["bytes"] for c in launch["communication"]
                                                           ["collectives"])
    single = json.loads(runner.invoke(app, ["plan", "gpt2", "--json"]).stdout)
    assert single["launch"] is None


def test_cli_launch_dry_run_prints_each_nodes_command():
    runner = CliRunner(env=NARROW)
    result = runner.invoke(app, ["launch", "train.py", "--gpus", "8", "--nodes", "4", "--zero", "zero3",
                                 "--model", "llama-2-70b", "--gpu", "H100", "--master-addr", "head", "--dry-run",
                                 "--", "--steps", "10"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("node ")]
    assert len(lines) == 4 and all(f"--node-rank {n}" in line for n, line in enumerate(lines))
    assert all("--rdzv-endpoint head:29500" in line and line.endswith("train.py --steps 10") for line in lines)
    # DeepSpeed ZeRO-3 (the setup's default engine): 3 Psi less the 5e8 elements kept gathered into backward.
    assert "per rank:" in result.output and "2.99275 x Psi" in result.output
    data = json.loads(runner.invoke(app, ["launch", "train.py", "--gpus", "8", "--nodes", "4", "--zero", "zero3",
                                          "--dry-run", "--json"]).stdout)
    assert data["per_rank_bytes"] is None and len(data["commands"]) == 4  # no --model: no memory
