"""memfit.vlm's memory: the traced step of tiny Qwen2-VL / Qwen2.5-VL configs against real CPU training steps of
the same model and processor-shaped batch (torch.profiler allocation events, memfit.measure), the search for what
fits, and the `memfit vlm` command (vision-token counts: tests/vlm/test_vlm_tokens.py)."""

import json

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.finetune import Finetune
from memfit.setup import TrainingSetup
from memfit.vlm import tokens as vt
from memfit.vlm.api import estimate_vlm, image_tokens, largest, max_pixels_ladder
from memfit.vlm.model import VlmInputs, measure_vlm, trace_vlm
from memfit.vlm.presets import tiny_config


@pytest.mark.parametrize("family, fields, tower", [
    ("qwen2_vl", dict(precision="amp-bf16", attention="eager"), "frozen"),
    ("qwen2_5_vl", dict(precision="fp32", attention="eager", checkpointing="full"), "trained"),
    ("qwen2_5_vl", dict(precision="bf16", attention="eager", finetune=Finetune(method="lora", rank=8)), "frozen"),
    ("llava", dict(precision="amp-bf16", attention="sdpa"), "trained"),
])
def test_trace_matches_a_real_cpu_step(family, fields, tower):
    config = tiny_config(family)
    image = image_tokens(config, (300, 500), max_pixels=200_704)
    inputs = VlmInputs((image, image), 24, 2, 0 if family == "llava" else 2)
    setup = TrainingSetup(**fields)
    measured = measure_vlm(config, inputs, setup, tower=tower).tensor_bytes
    traced = trace_vlm(config, inputs, setup, tower=tower, kernels="cpu").tensor_bytes
    assert abs(traced - measured) / measured < 0.01, (measured, traced)


def test_more_pixels_more_memory_and_the_stacks():
    setup = TrainingSetup(precision="bf16", finetune=Finetune(method="lora", rank=4))
    small = estimate_vlm(tiny_config("qwen2_vl"), image_size=(448, 448), max_pixels=50_176, setup=setup)
    large = estimate_vlm(tiny_config("qwen2_vl"), image_size=(448, 448), max_pixels=200_704, setup=setup)
    assert (small.image.lm_tokens, large.image.lm_tokens) == (64, 256)
    assert large.lm_seq == 512 + 256 + 2 and large.patches == 1024
    assert large.memory.tensor_bytes > small.memory.tensor_bytes
    stacks = {s.name: s for s in large.stacks}
    assert stacks["vision tower"].trainable == 0 and stacks["language model"].trainable > 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_a_sample_without_images_is_text_only(family):
    config = tiny_config(family)
    inputs = VlmInputs((), 24, 2)
    setup = TrainingSetup(precision="fp32", attention="eager")
    measured = measure_vlm(config, inputs, setup).tensor_bytes
    traced = trace_vlm(config, inputs, setup, kernels="cpu").tensor_bytes
    assert abs(traced - measured) / measured < 0.01


def test_largest_finds_the_last_fitting_candidate_in_few_calls():
    calls = []

    def cost(n):
        calls.append(n)
        return 1000 + 37 * n + (n * n) // 50  # about linear, as a step in the vision tokens

    candidates = list(range(0, 400))
    expected = max(c for c in candidates if 1000 + 37 * c + (c * c) // 50 <= 9000)
    best, traced = largest(candidates, cost, 9000, tries=6)
    assert best == expected and len(calls) <= 6 and set(traced) <= set(candidates)
    assert largest(candidates, cost, 10)[0] is None


def test_max_pixels_ladder_gives_distinct_growing_token_counts():
    ladder = max_pixels_ladder((768, 1024))
    tokens = [vt.qwen_image(768, 1024, max_pixels=m).lm_tokens for m in ladder]
    assert tokens == sorted(set(tokens)) and tokens[-1] == vt.qwen_image(768, 1024).lm_tokens


def test_cli_json_and_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("qwen2_vl")))
    runner = CliRunner()
    result = runner.invoke(app, ["vlm", str(path), "--images", "2", "--image-size", "300x500", "--max-pixels",
                                 "200704", "--text-len", "24", "--gpu", "A100-80GB", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    image = vt.qwen_image(300, 500, max_pixels=200_704)
    assert data["vision_tokens_per_sample"] == 2 * image.lm_tokens
    assert data["lm_seq"] == 24 + 2 * (image.lm_tokens + 2) and data["fits"] is True
    for args in (["vlm", "no-such-vlm"], ["vlm", str(path), "--image-size", "7x"],
                 ["vlm", str(path), "--tower", "sideways"]):
        bad = runner.invoke(app, args)
        assert bad.exit_code == 2 and bad.output.count("error:") == 1, bad.output


def test_cli_takes_the_shared_setup_options_and_its_own_spellings(tmp_path):
    """`memfit vlm` takes the generated setup and hardware options (cli/options.with_setup_options): --method /
    --lora-rank and its older --finetune / --rank size the same step, --zero and --gpus reach the traced setup, and
    a shared option that does not apply to a VLM step is one error line."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("qwen2_vl")))
    runner = CliRunner()
    base = ["vlm", str(path), "--image-size", "300x500", "--max-pixels", "200704", "--text-len", "24", "--json"]
    shared = json.loads(runner.invoke(app, [*base, "--method", "lora", "-r", "4", "--gpus", "2", "--zero", "3"]).output)
    older = json.loads(runner.invoke(app, [*base, "--finetune", "lora", "--rank", "4", "--gpus", "2",
                                           "--zero", "3"]).output)
    assert shared == older
    setup = shared["estimate"]["setup"]
    assert (setup["finetune"]["method"], setup["finetune"]["rank"], setup["sharding"], setup["num_gpus"]) == (
        "lora", 4, "zero3", 2)
    assert (setup["micro_batch_size"], setup["precision"], setup["seq_len"]) == (1, "bf16", shared["lm_seq"])
    bad = runner.invoke(app, [*base, "--seq", "128"])
    assert bad.exit_code == 2 and bad.output.count("error:") == 1 and "Traceback" not in bad.output
