"""The config memfit prints and emits is the setup it sized: for representative plans, `memfit plan --emit DIR` is
run as a user runs it, every file it wrote is read back with memfit's own readers (memfit.readers.read_config),
the setup they describe is re-estimated, and the figure must equal the one the plan printed, byte for byte.

What the files cannot say and the test therefore gives: the sequence length (it belongs to the data, not to
TrainingArguments) and the model (the files are the step's, not the checkpoint's); both come from the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit.api import as_spec
from memfit.cli.app import app
from memfit.estimate.analytic import estimate
from memfit.hardware import make_hardware
from memfit.readers import read_config
from memfit.setup import Checkpointing, TrainingSetup

NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}

PLANS = {
    "8b-full-a100": ["llama-3.1-8b", "--gpu", "A100-80GB"],
    "8b-full-a100-optimize": ["llama-3.1-8b", "--gpu", "A100-80GB", "--optimize"],
    "8b-lora-4090": ["llama-3.1-8b", "--gpu", "RTX-4090", "--method", "lora"],
    "8b-lora-4090-long": ["llama-3.1-8b", "--gpu", "RTX-4090", "--method", "lora", "-s", "8192"],
    "8b-qlora-4090-long": ["llama-3.1-8b", "--gpu", "RTX-4090", "--method", "qlora", "-s", "8192"],
    "8b-full-4xa100-40-deepspeed": ["llama-3.1-8b", "--gpu", "A100-40GB", "--gpus", "4"],
    "1b-full-4xh100-data-parallel": ["llama-3.2-1b", "--gpu", "H100", "--gpus", "4"],
    "8b-full-4xa100-40-fsdp": ["llama-3.1-8b", "--gpu", "A100-40GB", "--gpus", "4", "--engine", "torch",
                               "--zero", "zero3"],
    "7b-full-4090-zero3-offload-one-gpu": ["qwen2.5-7b", "--gpu", "RTX-4090", "-s", "8192"],
    "7b-full-4x4090-fused-loss": ["qwen2.5-7b", "--gpu", "RTX-4090", "--gpus", "4", "-s", "8192"],
    "70b-qlora-a100": ["llama-3.1-70b", "--gpu", "A100-80GB", "--method", "qlora", "-b", "1", "-s", "2048"],
    "70b-qlora-2x48-fsdp-offload": ["llama-3.1-70b", "--gpu", "48GB", "--gpus", "2", "--method", "qlora", "-b", "1",
                                    "-s", "2048", "--engine", "torch", "--zero", "zero3", "--checkpointing", "full",
                                    "-r", "16", "--lora-targets", "all-linear", "--activation-offload"],
}

# Files another route uses instead of the Trainer's (accelerate_fsdp2.yaml is the FSDP2 alternative to
# accelerate.yaml; fsdp2_shard.py is code); README.md is prose.
NOT_READ = {"README.md", "fsdp2_shard.py", "accelerate_fsdp2.yaml", ".memfit-emit.json", "memfit_setup.json"}
"""memfit_setup.json is the launch commands' copy of the setup itself (memfit.launch reads it): checked apart."""


def _emit(args: list[str], directory: Path) -> dict:
    result = CliRunner(env=NARROW).invoke(app, ["plan", *args, "--emit", str(directory), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _sized_bytes(data: dict) -> int:
    """The figure the plan gives for the setup it wrote: the --optimize choice's, else the ladder's last step's."""
    if data["emitted_setup"] == "optimized":
        return data["optimized"]["total_bytes"]
    return (data["steps"][-1]["estimate"] if data["steps"] else data["initial_estimate"])["total_bytes"]


def _sized_setup(data: dict) -> dict:
    return data["optimized"]["setup"] if data["emitted_setup"] == "optimized" else data["final_setup"]


@pytest.mark.parametrize("name", list(PLANS))
def test_emitted_files_re_estimate_to_the_printed_figure(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the files name each other relative to where memfit ran
    data = _emit(PLANS[name], Path("out"))
    files = sorted(p for p in Path("out").iterdir() if p.name not in NOT_READ)
    reading = read_config(*files)
    sized = _sized_setup(data)
    spec = as_spec(data["model"])
    args = PLANS[name]
    hardware = make_hardware(args[args.index("--gpu") + 1], gpus_per_node=data["world_size"])
    setup = reading.setup(spec, hardware, seq_len=sized["seq_len"])
    assert estimate(spec, setup, hardware).total_bytes == _sized_bytes(data), (name, reading.overrides)
    launched = Path("out") / "memfit_setup.json"
    if launched.exists():  # what every node's command runs is the sized setup, field for field
        from memfit.launch import setup_from_env

        assert setup_from_env({"MEMFIT_SETUP_FILE": str(launched)}).to_dict() == {
            **TrainingSetup(**{k: v for k, v in sized.items() if k != "notes"}).to_dict(), "notes": []}
    if sized["checkpointing"] not in ("none", "full") or sized["activation_offload"]:
        assert (Path("out") / "memfit_apply.json").exists()  # what TrainingArguments cannot carry is written


def test_a_loss_the_trainer_cannot_run_is_said_with_the_config():
    """torchtune's chunked loss has no TrainingArguments switch and no apply_ item, so its plan cannot round-trip
    through the Trainer's files (they re-size with the standard loss): the printed config says so, and where the
    loss is expressed instead."""
    result = CliRunner(env=NARROW).invoke(app, ["plan", "llama-3.2-1b", "--gpu", "RTX-4090", "-s", "8192", "--json"])
    assert json.loads(result.stdout)["final_setup"]["loss"] == "chunked"
    text = " ".join(CliRunner(env=NARROW).invoke(app, ["plan", "llama-3.2-1b", "--gpu", "RTX-4090", "-s", "8192"])
                    .output.split())
    assert "the HF Trainer cannot run it" in text and "CEWithChunkedOutputLoss" in text


def test_the_optimize_choice_that_training_arguments_cannot_carry_is_printed_with_the_line_that_applies_it():
    """The flagship --optimize plan chooses selective-op checkpointing: the printed config says how to apply it."""
    result = CliRunner(env=NARROW).invoke(app, ["plan", "llama-3.1-8b", "--gpu", "A100-80GB", "--optimize"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "memfit.apply_(model, {'checkpointing': 'selective-op'})" in text


def test_apply_takes_the_emitted_file_and_changes_only_its_items(tmp_path, monkeypatch):
    """memfit.apply_(model, 'memfit_apply.json') on a real module: the blocks are wrapped as the setup says, and
    the parameters' dtype (another setup item) is left alone."""
    torch = pytest.importorskip("torch")
    from memfit import apply_
    from memfit._torch import blocks
    from memfit.emit import write_all

    setup = TrainingSetup(checkpointing="every-2", precision="bf16")
    monkeypatch.chdir(tmp_path)
    write_all(setup, make_hardware("A100-80GB"), "out")
    assert json.loads(Path("out/memfit_apply.json").read_text()) == {"memfit_apply": {"checkpointing": "every-2"}}
    assert read_config("out/memfit_apply.json").overrides == {"checkpointing": Checkpointing.parse("every-2")}

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)

    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    applied = apply_(model, "out/memfit_apply.json")
    assert applied.changed == ("checkpointing",)
    assert [blocks.is_checkpointed(b) for b in model] == [False, True, False, True]  # every 2nd block
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # precision bf16 is not in the file
