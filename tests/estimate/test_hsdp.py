"""HSDP (FSDP2 on a 2D (replicate, shard) mesh; setup.dp_shard): static memory sharded over the shard group and
replicated across, the communication model's collectives per group, torchtitan's degrees, bad input. On paper: a
real 2-rank gloo run can only build a (2, 1) or (1, 2) mesh, which are plain replication and plain FSDP2, both
already measured in tests/engines/test_launch.py; a true 2 x 2 HSDP mesh needs 4 ranks."""

from __future__ import annotations

import pytest

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

SPEC = resolve_model("llama-3.1-8b")
HW = make_hardware("H100", gpus_per_node=8, num_nodes=4)


def _setup(shard: int, **changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=1, seq_len=4096, precision="bf16", optimizer="adamw", engine="torch",
                         num_gpus=32, sharding="zero3", checkpointing="full", dp_shard=shard).replace(**changes)


@pytest.mark.parametrize("shard", [2, 4, 8, 16])
def test_static_bytes_are_full_bytes_over_the_shard_group(shard):
    """Per rank: parameters, gradients and both Adam moments of the whole model / shard size (bf16: 2 + 2 + 2 x 2
    B per parameter), whatever the replica count; equal to plain FSDP over `shard` GPUs."""
    from memfit.estimate.static import full_static, shard as shard_static

    setup = _setup(shard)
    static = shard_static(SPEC, setup, full_static(SPEC, setup))
    est = estimate(SPEC, setup, HW)
    p = SPEC.num_params
    assert est.term("parameters").num_bytes == static.params_bytes == 2 * p // shard
    assert static.grads_bytes == 2 * p // shard  # all of them at the optimizer step
    assert 4 * p // shard <= static.optimizer_bytes <= 4 * p // shard + 4 * 32 * 12  # + the 0-d 'step' tensors
    plain = estimate(SPEC, _setup(0, num_gpus=shard), make_hardware("H100", gpus_per_node=min(shard, 8),
                                                                     num_nodes=max(1, shard // 8)))
    assert est.static_bytes == plain.static_bytes


def test_communication_splits_into_shard_group_and_replicas():
    """ZeRO-3 inside each shard group of 8 (all-gather twice, reduce-scatter: 3 Psi), then Psi / 8 all-reduced
    across the 4 replicas (2 Psi / 8 in the paper's convention); with shard groups inside a node only the
    all-reduce crosses the network."""
    setup = _setup(8)
    volume = comm_volume(SPEC, setup, HW)
    p, psi = SPEC.num_params, 2 * SPEC.num_params
    assert volume.payload_bytes() == {"all-gather": 2 * psi, "reduce-scatter": psi, "all-reduce": p // 8 * 2}
    assert volume.psi_multiple == pytest.approx(3 + 2 / 8, rel=1e-6)
    assert volume.replicas == 4 and volume.replicate_bytes == 2 * (p // 8) * 2
    assert volume.inter_node_bytes_per_node == volume.replicate_bytes * 3 // 4
    flat = comm_volume(SPEC, _setup(0), HW)  # FSDP over all 32 ranks: every collective spans the nodes
    assert flat.inter_node_bytes_per_node > 10 * volume.inter_node_bytes_per_node


def test_torchtitan_degrees():
    from memfit.emit.torchtitan import torchtitan_parallelism

    parallelism = torchtitan_parallelism(_setup(8))["parallelism"]
    assert parallelism["data_parallel_shard_degree"] == 8 and parallelism["data_parallel_replicate_degree"] == 4


@pytest.mark.parametrize("changes,message", [
    ({"dp_shard": 3}, "must divide the 32 data-parallel ranks"),
    ({"sharding": "zero1"}, "zero2 or zero3"),
    ({"engine": "deepspeed"}, "MiCS"),
    ({"dp_shard": -2}, "positive whole number"),
])
def test_bad_hsdp_setups_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as info:
        _setup(changes.pop("dp_shard", 8), **changes)
    assert "\n" not in str(info.value)


def test_cli_dp_shard(tmp_path):
    import json

    from typer.testing import CliRunner

    from memfit.cli.app import app

    args = ["estimate", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--nodes", "2", "-b", "1", "-s", "2048",
            "--zero", "zero3", "--engine", "torch", "--json"]
    result = CliRunner().invoke(app, [*args, "--dp-shard", "8"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["setup"]["dp_shard"] == 8
    bad = CliRunner().invoke(app, [*args[:-1], "--dp-shard", "5"])
    assert bad.exit_code == 2 and "must divide" in bad.output


def test_fsdp2_code_builds_the_2d_mesh():
    """The emitted FSDP2 module passes fully_shard a (replicate, shard) mesh; it compiles."""
    from memfit.emit import fsdp2_code

    code = fsdp2_code(_setup(8))
    assert 'init_device_mesh("cuda", (4, 8), mesh_dim_names=("replicate", "shard"))' in code
    assert '"mesh": mesh' in code
    compile(code, "fsdp2_shard.py", "exec")
    assert "init_device_mesh" not in fsdp2_code(_setup(0))
