"""Padded vs packed sequences: which length sets the run's peak (TrainingSetup.peak_seq_len,
memfit.estimate.padding), checked against a measured CPU step of a padded batch."""

import json

import pytest

from memfit.errors import ConfigError
from memfit.setup import Padding, TrainingSetup
from tiny_configs import TINY_LLAMA


def test_the_longest_sample_sets_the_peak_and_seq_still_truncates():
    padded = TrainingSetup(seq_len=4096, padding="padded", longest_sample_len=1300)
    assert padded.padding is Padding.LONGEST and padded.peak_seq_len == 1300
    assert padded.replace(longest_sample_len=9000).peak_seq_len == 4096  # truncated at seq_len
    assert padded.replace(longest_sample_len=None).peak_seq_len == 4096  # unknown: the bound truncation gives
    assert TrainingSetup(seq_len=4096, padding="packed").peak_seq_len == 4096
    with pytest.raises(ConfigError, match="longest sample length needs padding longest"):
        TrainingSetup(seq_len=4096, longest_sample_len=1300)
    with pytest.raises(ConfigError, match="longest_sample_len must be a positive whole number"):
        TrainingSetup(padding="longest", longest_sample_len=0)


def test_estimate_of_a_padded_run_is_its_longest_batch():
    from memfit.estimate.analytic import estimate
    from memfit.hardware import make_hardware
    from memfit.sources import resolve_model

    spec, hw = resolve_model("llama-3.2-1b"), make_hardware("A100-80GB")
    padded = estimate(spec, TrainingSetup(precision="bf16", micro_batch_size=2, seq_len=4096, padding="longest",
                                          longest_sample_len=1300), hw)
    fixed = estimate(spec, TrainingSetup(precision="bf16", micro_batch_size=2, seq_len=1300), hw)
    packed = estimate(spec, TrainingSetup(precision="bf16", micro_batch_size=2, seq_len=4096), hw)
    assert padded.allocated_bytes == fixed.allocated_bytes < packed.allocated_bytes
    assert padded.setup.seq_len == 4096 and padded.setup.longest_sample_len == 1300  # what was asked
    assert any("the run peaks at the batch holding the longest sample, 1300 tokens" in n for n in padded.notes)


def test_a_padded_batch_measures_as_its_longest_sample(tmp_path):
    """Tiny Llama fp32, one row of 40 tokens padded to the other's 64 as torchtune pads unpacked data (pad tokens,
    labels -100, no attention mask: causal SDPA over the whole row): the measured step is the estimate at
    padding longest / longest sample 64 within 0.5%, though --seq is 256."""
    torch = pytest.importorskip("torch")
    from memfit._torch.step import build_hf_model
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.measure import measure
    from memfit.sources import resolve_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    setup = TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=256, optimizer="adamw", padding="longest",
                          longest_sample_len=64)
    predicted = estimate(resolve_model(str(path)), setup, make_hardware(cpu_device(64 * 1024**3)))
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    ids[0, 40:], labels[0, 40:] = 0, -100
    model = build_hf_model(TINY_LLAMA, setup.replace(seq_len=64, padding="max-length", longest_sample_len=None))
    measured = measure(model, setup, steps=2, batches={"input_ids": ids, "labels": labels})
    assert abs(predicted.tensor_bytes - measured.tensor_bytes) <= 0.005 * measured.tensor_bytes


def test_cli_padding_options_reach_the_json_and_bad_input_exits_2():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"})
    common = ["estimate", "llama-3.2-1b", "--gpu", "A100-80GB", "--precision", "bf16", "-b", "2", "-s", "4096"]
    result = runner.invoke(app, [*common, "--padding", "longest", "--longest-sample", "1300", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    fixed = json.loads(runner.invoke(app, [*common[:-1], "1300", "--json"]).stdout)
    assert data["setup"]["padding"] == "longest" and data["setup"]["longest_sample_len"] == 1300
    assert data["estimate"]["device_memory"] == fixed["estimate"]["device_memory"]
    bad = runner.invoke(app, [*common, "--longest-sample", "1300"])
    assert bad.exit_code == 2 and "needs padding longest" in bad.output


def test_trace_and_measure_run_the_longest_batch():
    pytest.importorskip("torch")
    from memfit.measure import measure
    from memfit.trace.run import trace

    setup = TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=256, optimizer="adamw", padding="longest",
                          longest_sample_len=64)
    fixed = setup.replace(seq_len=64, padding="max-length", longest_sample_len=None)
    traced = trace(TINY_LLAMA, setup).tensor_bytes
    assert traced == trace(TINY_LLAMA, fixed).tensor_bytes == measure(TINY_LLAMA, setup, steps=2,
                                                                         device="cpu").tensor_bytes
