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
from memfit.vlm.model import VlmInputs, _hf_config, make_batch, measure_vlm, trace_vlm, wrapper_tokens
from memfit.vlm.presets import PRESETS, tiny_config


@pytest.mark.parametrize("family, fields, tower", [
    ("qwen2_vl", dict(precision="amp-bf16", attention="eager"), "frozen"),
    ("qwen2_5_vl", dict(precision="fp32", attention="eager", checkpointing="full"), "trained"),
    ("qwen2_5_vl", dict(precision="bf16", attention="eager", finetune=Finetune(method="lora", rank=8)), "frozen"),
    ("llava", dict(precision="amp-bf16", attention="sdpa"), "trained"),
    ("llava_next", dict(precision="bf16", attention="eager", finetune=Finetune(method="lora", rank=8)), "frozen"),
    ("gemma3", dict(precision="amp-bf16", attention="eager"), "trained"),
])
def test_trace_matches_a_real_cpu_step(family, fields, tower):
    config = tiny_config(family)
    image = image_tokens(config, (300, 500), max_pixels=200_704)
    inputs = VlmInputs((image, image), 24, 2, wrapper_tokens(config))
    setup = TrainingSetup(**fields)
    measured = measure_vlm(config, inputs, setup, tower=tower).tensor_bytes
    traced = trace_vlm(config, inputs, setup, tower=tower, kernels="cpu").tensor_bytes
    assert abs(traced - measured) / measured < 0.01, (measured, traced)


PARAMS = {"llava-hf/llava-v1.6-mistral-7b-hf": 7_566_747_648, "google/gemma-3-4b-it": 4_300_079_472}
"""transformers' own classes on the meta device; the hub cards give 7.57B and 4.3B (the Qwen and LLaVA-1.5 presets:
docs/vlm.md, checked when they were added; building every preset takes a minute on one core)."""


def test_presets_have_the_published_parameter_counts():
    import torch
    import transformers

    for name, expected in PARAMS.items():
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(_hf_config(PRESETS[name]))
        assert sum(p.numel() for p in model.parameters()) == expected, name


def test_batches_are_shaped_as_the_processors_make_them():
    """LLaVA-NeXT: every image's tiles + base image as crops, its original size in image_sizes; Gemma 3: begin /
    end of image around mm_tokens_per_image soft tokens, token_type_ids 1 on those."""
    config = tiny_config("llava_next")
    image = image_tokens(config, (300, 500))
    batch = make_batch(config, VlmInputs((image,), 24, 2, 0))
    assert tuple(batch["pixel_values"].shape) == (2, image.crops, 3, 112, 112) == (2, 5, 3, 112, 112)
    assert batch["image_sizes"].tolist() == [[300, 500]] * 2
    assert batch["input_ids"].shape[1] == 24 + image.lm_tokens
    config = tiny_config("gemma3")
    image = image_tokens(config, (300, 500))
    batch = make_batch(config, VlmInputs((image, image), 24, 2, wrapper_tokens(config)))
    assert image.lm_tokens == 16 + 2 and batch["input_ids"].shape[1] == 24 + 2 * 18
    assert batch["token_type_ids"].sum().item() == 2 * 2 * 16 and tuple(batch["pixel_values"].shape) == (4, 3, 112, 112)


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


def test_plan_takes_the_fewer_pixels_rung_and_it_fits(tmp_path):
    """`memfit vlm --plan`: two 1000 px images of the tiny Qwen2-VL do not fit 1 GB; the fewer-pixels rung
    (the largest max_pixels that fits, by the same search as --search max-pixels) is taken, re-estimated, and fits,
    with fewer vision tokens; fewer images is not needed."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("qwen2_vl")))
    result = CliRunner().invoke(app, ["vlm", str(path), "--image-size", "1000x1000", "--images", "2", "--text-len",
                                      "24", "--gpu", "1GB", "--precision", "fp32", "--attention", "eager", "--plan",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["fits"] is False and [rung["rung"] for rung in data["plan"]] == ["fewer pixels"]
    rung = data["plan"][0]
    assert rung["fits"] and rung["required_bytes"] <= data["budget_bytes"] < data["required_bytes"]
    assert rung["vision_tokens_before"] == 2 * 1296 and rung["vision_tokens_after"] < rung["vision_tokens_before"]
    assert rung["images"] == 2 and rung["max_pixels"] in max_pixels_ladder((1000, 1000))
