"""LitGPT's config written by memfit (memfit.emit.litgpt) and the ladder speaking LitGPT (memfit.frameworks): the
written file reads back, through memfit's LitGPT reader, as the setup that was written; its keys are those of
litgpt's own setup() / TrainArgs; a rung LitGPT's scripts cannot make is passed over, and the plan of a LitGPT
config ends on a setup LitGPT runs."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memfit.api import as_hardware
from memfit.cli.app import app
from memfit.emit.litgpt import litgpt_config, litgpt_file
from memfit.errors import ConfigError
from memfit.finetune import Method
from memfit.frameworks import runs_as
from memfit.plan import plan
from memfit.readers import InMemory, read_config
from memfit.setup import Checkpointing, Optimizer, Precision
from memfit.sources import resolve_model

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
FILES = ("litgpt_lora.yaml", "litgpt_qlora.yaml", "litgpt_full.yaml")


def _setup(name: str, gpu: str = "L4", **given):
    reading = read_config(str(CONFIGS / name))
    spec = resolve_model(reading.model)
    hardware = as_hardware(gpu, gpus_per_node=reading.overrides.get("num_gpus", 1))
    return spec, hardware, reading.setup(spec, hardware, **given)


def _written(spec, setup) -> dict:
    return litgpt_config(setup, hub_id=spec.extra["hub_id"], model_type=spec.model_type)


@pytest.mark.parametrize("name", FILES)
def test_the_written_config_reads_back_as_the_setup(name):
    spec, hardware, setup = _setup(name)
    written = _written(spec, setup)
    back = read_config(InMemory("litgpt.yaml", written)).setup(spec, hardware)
    assert dataclasses.replace(back, notes=()) == dataclasses.replace(setup, notes=())
    assert written["checkpoint_dir"] == f"checkpoints/{spec.extra['hub_id']}"


@pytest.mark.parametrize("name", FILES)
def test_every_key_is_one_litgpts_setup_takes(name):
    """The top-level keys are parameters of litgpt's finetune_lora / finetune_full setup(); `train:` keys are
    TrainArgs fields (litgpt's own code, not memfit's reader)."""
    finetune = pytest.importorskip("litgpt.finetune.lora" if "full" not in name else "litgpt.finetune.full")
    args = pytest.importorskip("litgpt.args")
    spec, _, setup = _setup(name)
    written = _written(spec, setup)
    assert set(written) <= set(inspect.signature(finetune.setup).parameters)
    assert set(written["train"]) <= {f.name for f in dataclasses.fields(args.TrainArgs)}
    yaml.safe_load(litgpt_file(setup, hub_id=spec.extra["hub_id"]).render())  # valid YAML with its comments


@pytest.mark.parametrize("change, refusal", [
    (dict(checkpointing="full"), "no checkpointing switch"),
    (dict(activation_offload=True, checkpointing="full"), "no activation offload"),
    (dict(precision="amp-bf16"), "mixed precision"),  # QLoRA under LitGPT is -true only
    (dict(optimizer="adamw-8bit"), "PagedAdamW only"),
])
def test_what_litgpt_cannot_run_is_one_line(change, refusal):
    spec, _, setup = _setup("litgpt_qlora.yaml")
    with pytest.raises(ConfigError, match=refusal):
        _written(spec, setup.replace(**change))


def test_the_ladder_speaks_litgpt():
    """Llama-3.1-8B from a LitGPT LoRA config on a 24 GB card: checkpointing and activation offload are passed
    over (LitGPT has no switch for them on one device), every step is a change of LitGPT's config, the QLoRA rung
    sizes what LitGPT's --quantize runs (no k-bit preparation, bf16-true, PagedAdamW), and the final setup is one
    the written config reads back as."""
    spec = resolve_model("llama-3.1-8b")
    hardware = as_hardware("RTX-4090")
    setup = read_config(str(CONFIGS / "litgpt_lora.yaml")).setup(spec, hardware, seq_len=1024)
    result = plan(spec, setup, hardware)
    assert result.fits
    skipped = dict(result.skipped)
    assert "no checkpointing switch" in skipped["gradient checkpointing"]
    assert "no activation offload" in skipped["activation offloading to the CPU"]
    assert all(step.change.startswith("litgpt finetune_lora config: ") for step in result.steps)
    final = result.final_setup
    assert final.checkpointing is Checkpointing.NONE and final.finetune.method is Method.QLORA
    assert final.finetune.kbit_prep is False and final.precision is Precision.BF16
    assert final.optimizer is Optimizer.PAGED_ADAMW
    back = read_config(InMemory("litgpt.yaml", _written(spec, final))).setup(spec, hardware)
    assert dataclasses.replace(back, notes=()) == dataclasses.replace(final, notes=())


def test_more_gpus_are_litgpts_sharded_checkpointed_run():
    """On more than one device LitGPT's finetune_lora shards the model and checkpoints every block: that is the
    setup memfit sizes for a LitGPT config scaled out."""
    spec, _, setup = _setup("litgpt_lora.yaml")
    scaled = runs_as(spec, setup.replace(num_gpus=4, sharding="zero3", engine="torch"))
    assert scaled.checkpointing is Checkpointing.FULL
    assert read_config(InMemory("litgpt.yaml", _written(spec, scaled))).overrides["num_gpus"] == 4


def test_emit_writes_litgpts_config_alone(tmp_path):
    result = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--config", str(CONFIGS / "litgpt_lora.yaml"),
                                      "--gpu", "RTX-4090", "-s", "1024", "--emit", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == [
        "README.md", "litgpt.yaml"]
    written = yaml.safe_load((tmp_path / "out" / "litgpt.yaml").read_text())
    assert written["quantize"] == "bnb.nf4-dq" and written["train"]["micro_batch_size"] == 1


def test_a_litgpt_plan_on_several_gpus_launches_with_litgpt():
    """LitGPT starts its ranks itself: the plan's launch part names LitGPT's command, not memfit's torchrun line
    (which would run the Hugging Face model); the communication per step is still there."""
    result = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--gpu", "A100-80GB", "--config",
                                      str(CONFIGS / "litgpt_full.yaml")])
    assert result.exit_code == 0, result.output
    launch = " ".join(result.output[result.output.index("Launch (per node)"):].split())
    assert "litgpt finetune_full --config litgpt.yaml" in launch and "torchrun --standalone" not in launch
    assert "Communication per step" in launch
