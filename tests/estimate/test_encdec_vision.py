"""Encoder-decoder (T5, BART) and vision (ViT, DINOv2) models: catalog parameter counts, the inputs they take, and
memfit.derive.stacks' estimate against the trace and a real CPU step measured through the profiler.

The derivations run on tiny configs (tests/tiny_encdec.py) into a temporary cache; bench/encdec_vision.py runs the
whole matrix (precisions, checkpointing, attention, shapes)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_encdec import SHAPES, TINY_ENCDEC_VISION, setup_fields  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.api import typical_setup  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
A100 = make_hardware("A100-40GB")

# name -> (published total, tolerance, why they differ): the figures the catalog's sources give
PUBLISHED = {
    "t5-base": (220e6, 0.02, "the paper counts the LM head apart from the shared embedding (222.9M + 24.7M)"),
    "t5-large": (770e6, 0.05, "as t5-base: 737.7M here + the 32.9M head counted separately = 770.6M"),
    "flan-t5-base": (248e6, 0.11, "transformers 5 ties every T5 head (T5Config): 222.9M + the card's untied "
                                  "24.7M head = 247.6M"),
    "flan-t5-large": (783e6, 0.05, "as flan-t5-base: 750.3M + 32.9M = 783.2M"),
    "flan-t5-xl": (2.85e9, 0.03, "as flan-t5-base: 2,784.0M + 65.8M = 2,849.8M"),
    "bart-base": (139e6, 0.01, "rounding"),
    "bart-large": (406e6, 0.01, "rounding"),
    "vit-base-patch16-224": (86e6, 0.01, "+ the 1000-class head (0.77M)"),
    "vit-large-patch16-224": (307e6, 0.01, "the paper's 307M rounds up; 303.3M backbone + 1.0M head"),
    "vit-huge-patch14-224-in21k": (632e6, 0.01, "+ the 1000-class head (1.3M)"),
    "dinov2-small": (21e6, 0.09, "+ the 1000-class head over 2 x 384 features (0.77M) and the 37 x 37 position table"),
    "dinov2-base": (86e6, 0.03, "+ the 1000-class head over 2 x 768 features (1.5M)"),
    "dinov2-large": (300e6, 0.03, "+ the 1000-class head over 2 x 1024 features (2.0M)"),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "derived"))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_total_is_near_the_published_figure(name):
    published, tolerance, _why = PUBLISHED[name]
    spec = resolve_model(name)
    assert spec.derived is not None and getattr(spec.derived, "stacked", False)
    assert abs(spec.num_params - published) <= tolerance * published


def test_aliases_and_architecture_numbers():
    t5 = resolve_model("google-t5/t5-large")
    assert (t5.name, t5.num_layers, t5.hidden_size, t5.extra["stacks"]) == ("t5-large", 48, 1024,
                                                                           {"encoder": 24, "decoder": 24})
    assert resolve_model("vit-l/16").name == "vit-large-patch16-224"
    assert resolve_model("dinov2-s").num_params == 22_825_576


@pytest.mark.parametrize("model, given, message", [
    ("t5-large", {}, "give the decoder length with --target-len"),
    ("gpt2", {"target_len": 64}, "drop --target-len"),
    ("gpt2", {"image_size": 224}, "drop --image-size"),
    ("vit-large", {"seq_len": 197}, "give --image-size instead of --seq"),
    ("vit-large", {"image_size": 225}, "not a multiple of"),
    ("vit-large", {"target_len": 8}, "drop --target-len"),
])
def test_inputs_a_model_does_not_take_are_one_line_errors(model, given, message):
    with pytest.raises(ConfigError, match=message) as error:
        typical_setup(resolve_model(model), A100, **given)
    assert "\n" not in str(error.value)


def test_vision_tokens_come_from_the_image():
    assert typical_setup(resolve_model("vit-large"), A100).seq_len == 14 * 14 + 1
    assert typical_setup(resolve_model("vit-huge"), A100, image_size=448).seq_len == 32 * 32 + 1
    assert typical_setup(resolve_model("dinov2-base"), A100).seq_len == 37 * 37 + 1


def test_cli_refuses_a_decoder_length_on_a_decoder_only_model():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "gpt2", "--gpu", "A100-40GB", "--target-len", "64"])
    assert result.exit_code == 2
    assert "drop --target-len" in result.output


@pytest.mark.parametrize("family, precision, checkpointing, attention", [
    ("t5", "fp32", "full", "eager"),  # two stacks of different depths, checkpointed, the T x S eager scores
    ("vit", "amp-bf16", "none", "sdpa"),  # tokens from the image, autocast
])  # one derivation each (T5: ~20 s on one core); bench/encdec_vision.py runs BART, DINOv2 and the rest
def test_estimate_matches_the_trace_and_a_measured_step(family, precision, checkpointing, attention):
    from memfit.measure import measure
    from memfit.trace import trace

    config = TINY_ENCDEC_VISION[family]
    setup = TrainingSetup(precision=precision, checkpointing=checkpointing, attention=attention, optimizer="adamw",
                          **setup_fields(family, SHAPES[family][0]))
    predicted = estimate(resolve_model(dict(config)), setup, CPU).tensor_bytes
    traced = trace(dict(config), setup, kernels="cpu").tensor_bytes
    measured = measure(dict(config), setup, device="cpu").tensor_bytes
    assert abs(predicted / traced - 1) < 0.01
    assert abs(predicted / measured - 1) < 0.05


@pytest.mark.parametrize("args, field, value", [
    (["t5-large", "--seq", "512", "--target-len", "128", "--batch", "64"], "target_len", 128),
    (["vit-large", "--image-size", "384", "--batch", "512"], "seq_len", 24 * 24 + 1),
])
def test_cli_plans_t5_and_vit_end_to_end_from_the_shipped_fits(args, field, value):
    import json

    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", *args, "--gpu", "A100-40GB", "--json"])
    assert result.exit_code in (0, 1), result.output
    plan = json.loads(result.output)
    assert plan["final_setup"][field] == value
    assert plan["fits"] and plan["final_setup"]["checkpointing"] == "full"  # the ladder's first rung
    assert plan["initial_estimate"]["total_bytes"] > 2 * plan["steps"][-1]["estimate"]["total_bytes"]


@pytest.mark.parametrize("args, auto_class, setup_words", [
    (["t5-base", "--seq", "512", "--target-len", "128"], "AutoModelForSeq2SeqLM", "seq 512, target 128"),
    (["vit-b-16", "--image-size", "384"], "AutoModelForImageClassification", "image 384 px (577 tokens)"),
    (["bert-large-uncased", "--seq", "512"], "AutoModelForMaskedLM", "seq 512,"),
    (["gpt2", "--seq", "512"], "AutoModelForCausalLM", "seq 512,"),
])
def test_plan_output_names_the_class_that_builds_the_model_and_its_input_shape(args, auto_class, setup_words,
                                                                              tmp_path):
    """The loading code (printed and emitted) names transformers' class for the model memfit sized, as the step
    memfit measures builds it (memfit._torch.step.build_hf_model), and the setup line shows every input length."""
    from typer.testing import CliRunner

    from memfit._torch.step import build_hf_model
    from memfit.cli.app import app

    spec = resolve_model(args[0])
    result = CliRunner().invoke(app, ["plan", *args, "--gpu", "A100-80GB", "--emit", str(tmp_path / "out")],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"{auto_class}.from_pretrained(" in result.output
    assert setup_words in " ".join(result.output.split())
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"{auto_class}.from_pretrained" in readme
    tiny = {"t5-base": "t5", "vit-b-16": "vit", "bert-large-uncased": "bert", "gpt2": "gpt2"}[args[0]]
    assert spec.auto_class == auto_class
    if tiny in TINY_ENCDEC_VISION:  # the class memfit's own measured step builds agrees
        model = build_hf_model(TINY_ENCDEC_VISION[tiny], TrainingSetup(micro_batch_size=1, seq_len=8))
        assert type(model).__name__.endswith({"AutoModelForSeq2SeqLM": "ForConditionalGeneration",
                                              "AutoModelForImageClassification": "ForImageClassification"}[auto_class])
