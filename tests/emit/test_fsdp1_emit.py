"""The FSDP1 configs memfit emits (--fsdp-version 1), read back by accelerate's own launcher and plugin and by
TrainingArguments: the strategy, use_orig_params and offload that memfit.estimate.fsdp1 sized."""

from __future__ import annotations

import pytest

from memfit import emit
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup

HARDWARE = make_hardware("A100-80GB", gpus_per_node=4)


@pytest.mark.parametrize("sharding,offload,method", [("zero3", "none", "lora"), ("zero2", "none", "full"),
                                                     ("zero3", "optimizer+params", "full")])
def test_accelerate_reads_the_fsdp1_yaml(sharding, offload, method, tmp_path, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    setup = TrainingSetup(engine="torch", sharding=sharding, offload=offload, num_gpus=4, fsdp_version="1",
                          finetune=method)
    emitted = emit.accelerate_file(setup, HARDWARE)
    path = tmp_path / "accelerate.yaml"
    path.write_text(emitted.render())
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    assert env["FSDP_SYNC_MODULE_STATES"] == "true"
    for key in ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING"):  # both ask an accelerator at once
        monkeypatch.setenv(key, "false")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy.name == ("FULL_SHARD" if sharding == "zero3" else "SHARD_GRAD_OP")
    assert plugin.use_orig_params is True and plugin.limit_all_gathers is True
    assert plugin.cpu_offload.offload_params is (offload != "none")
    assert emit.fsdp2_unsupported(setup).startswith("the plan runs FSDP1")


def test_trainer_fsdp_config_is_fsdp1():
    from transformers import TrainingArguments

    setup = TrainingSetup(engine="torch", sharding="zero3", num_gpus=2, fsdp_version="1", finetune="lora")
    part = emit.hf_trainer._engine_part(setup, deepspeed_path="ds.json")[0]
    assert part["fsdp_config"]["version"] == 1
    args = TrainingArguments(output_dir="out", fsdp=part["fsdp"], fsdp_config=part["fsdp_config"], use_cpu=True)
    assert args.fsdp and "full_shard" in str(part["fsdp"])
    assert int(args.fsdp_config["version"]) == 1 and str(args.fsdp_config["use_orig_params"]).lower() == "true"
