"""No circle between two refusals: every way out a refusal spells as flags (`use --engine torch --offload
optimizer+params`, `or --zero zero2 --offload optimizer`) is read back from the message and must be a setup memfit
accepts (memfit.way_out builds them by trying them). The grid crosses engine, ZeRO stage, offload, method (DoRA
too), precision, optimizer, GPU count and the model-parallel degrees: every refusal among them is checked."""

from __future__ import annotations

import itertools
import re

import pytest
from typer.testing import CliRunner

from memfit.errors import ConfigError
from memfit.setup import TrainingSetup

FLAGS = {"engine": "engine", "zero": "sharding", "offload": "offload", "gpus": "num_gpus"}
GRID = dict(engine=["torch", "deepspeed"], sharding=["none", "zero1", "zero2", "zero3"],
            offload=["none", "optimizer", "optimizer+params"], method=["full", "lora", "qlora", "dora"],
            precision=["amp-bf16", "bf16-master", "fp32"], optimizer=["adamw", "adamw-8bit"], num_gpus=[1, 2, 4],
            tp=[1, 2], pp=[1, 2], cp=[1, 2])


def suggested_changes(message: str) -> list[dict]:
    """Each alternative after ': use ' that is spelled as --engine / --zero / --offload / --gpus flags, as field
    changes."""
    found = []
    for problem in message.split("; "):
        if ": use " not in problem:
            continue
        for alternative in problem.split(": use ", 1)[1].split(", or "):
            pairs = re.findall(r"--(engine|zero|offload|gpus) ([a-z0-9+]+)", alternative.split(" (")[0])
            if alternative.startswith("--") and pairs:
                found.append({FLAGS[flag]: int(value) if flag == "gpus" else value for flag, value in pairs})
    return found


def _grid():
    for values in itertools.product(*GRID.values()):
        kw = dict(zip(GRID, values))
        method = kw.pop("method")
        if kw["tp"] * kw["pp"] * kw["cp"] > kw["num_gpus"]:
            continue
        finetune = {"method": "lora", "dora": True} if method == "dora" else {"method": method}
        yield dict(micro_batch_size=1, seq_len=128, finetune=finetune, **kw)


def test_every_suggested_command_is_accepted():
    refused = checked = 0
    engines = set()
    for kw in _grid():
        try:
            TrainingSetup(**kw)
            continue
        except ConfigError as error:
            message = str(error)
        refused += 1
        for changes in suggested_changes(message):
            checked += 1
            engines.add(changes.get("engine"))
            try:
                TrainingSetup(**{**kw, **changes})
            except ConfigError as again:
                pytest.fail(f"{kw}\n refused: {message}\n suggested {changes}, refused again: {again}")
    assert refused > 1000 and checked > 500 and {"torch", "deepspeed"} <= engines


def test_the_fsdp_qlora_offload_pair_no_longer_circles():
    """The pair of issue 19: FSDP2 + CPU offload of a QLoRA base is accepted; DeepSpeed ZeRO-3 points to it."""
    recipe = dict(micro_batch_size=1, seq_len=2048, num_gpus=2, finetune="qlora", sharding="zero3",
                  checkpointing="full", offload="optimizer+params")
    assert TrainingSetup(engine="torch", **recipe).offload.value == "optimizer+params"
    with pytest.raises(ConfigError) as info:
        TrainingSetup(engine="deepspeed", **recipe)
    assert suggested_changes(str(info.value))[0] == {"engine": "torch"}
    with pytest.raises(ConfigError) as info:  # one GPU: DeepSpeed's ZeRO-Offload does not size a packed base
        TrainingSetup(engine="deepspeed", **dict(recipe, num_gpus=1))
    assert suggested_changes(str(info.value))[0] == {"engine": "torch", "num_gpus": 2}  # FSDP2 over two ranks
    with pytest.raises(ConfigError) as info:  # LoRA on a 16-bit base: ZeRO-Offload of the adapters keeps one GPU
        TrainingSetup(engine="deepspeed", **dict(recipe, num_gpus=1, finetune="lora"))
    assert suggested_changes(str(info.value)) == [{"sharding": "zero2", "offload": "optimizer"}]


def test_the_cli_answers_the_suggestion():
    from memfit.cli.app import app

    runner = CliRunner()
    base = ["plan", "llama-3.1-8b", "--gpu", "RTX-3090", "--gpus", "2", "--method", "qlora", "-b", "1", "-s", "512",
            "--zero", "zero3", "--checkpointing", "full", "--offload", "optimizer+params"]
    refused = runner.invoke(app, [*base, "--engine", "deepspeed"])
    assert refused.exit_code == 2 and "use --engine torch" in refused.output
    assert runner.invoke(app, [*base, "--engine", "torch"]).exit_code == 0
