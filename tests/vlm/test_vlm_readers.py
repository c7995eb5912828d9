"""memfit vlm --config: ms-swift command lines, LLaMA-Factory and TRL YAML -> the VLM step's fields, each key read
or left out (memfit.vlm.readers); LLaMA-Factory's resize before the processor; the setting printed for a plan."""

from pathlib import Path

import pytest

from memfit.errors import ConfigError
from memfit.finetune import Method
from memfit.setup import Checkpointing, Precision
from memfit.vlm import tokens as vt
from memfit.vlm.readers import pixel_setting, pre_resized, read_swift, read_vlm_config

CONFIGS = Path(__file__).parents[1] / "data" / "configs" / "vlm"


def _fields(reading):
    return {entry.field for entry in reading.read}, {entry.field: entry.why for entry in reading.ignored}


def test_ms_swift_command_line_and_its_environment():
    reading = read_vlm_config(CONFIGS / "swift_qwen25vl_lora.sh")
    assert (reading.format, reading.model, reading.max_pixels, reading.tower) == (
        "ms-swift", "Qwen/Qwen2.5-VL-7B-Instruct", 1_003_520, "frozen")
    setup = reading.setup
    assert (setup["finetune"].method, setup["finetune"].rank, setup["finetune"].targets) == (Method.LORA, 8, ())
    assert (setup["micro_batch_size"], setup["grad_accum_steps"], setup["precision"], setup["checkpointing"]) == (
        1, 16, Precision.BF16, Checkpointing.FULL)
    read, ignored = _fields(reading)
    assert {"--model", "--train_type", "MAX_PIXELS", "--freeze_vit", "--gradient_checkpointing"} <= read
    assert {"--max_length", "--dataset", "--learning_rate"} <= set(ignored)


def test_ms_swift_argument_wins_over_the_environment_and_defaults_apply():
    reading = read_swift("MAX_PIXELS=1003520 swift sft --model m --max_pixels 200704 --freeze_vit false "
                         "--train_type full --gradient_checkpointing false")
    assert reading.max_pixels == 200_704 and reading.tower == "trained"
    assert reading.setup["finetune"].method is Method.FULL and reading.setup["checkpointing"] is Checkpointing.NONE
    with pytest.raises(ConfigError):
        read_swift("swift sft --model m --per_device_train_batch_size zero")


def test_llamafactory_processor_keys_and_freezing():
    reading = read_vlm_config(CONFIGS / "llamafactory_qwen25vl_lora.yaml")
    assert (reading.format, reading.pre_resize, reading.tower, reading.max_pixels) == (
        "llamafactory", (262_144, 1024), "frozen", None)
    assert "seq_len" not in reading.setup and reading.setup["finetune"].targets == ()
    read, ignored = _fields(reading)
    assert {"image_max_pixels", "image_min_pixels", "freeze_vision_tower", "freeze_multi_modal_projector"} <= read
    assert "video_max_pixels" in ignored and "cutoff_len" in ignored


def test_trl_sft_config_with_the_processor_pixels():
    reading = read_vlm_config(CONFIGS / "trl_sft.yaml")
    assert (reading.format, reading.model, reading.max_pixels, reading.min_pixels) == (
        "trl", "Qwen/Qwen2-VL-2B-Instruct", 401_408, 3136)
    assert reading.setup["micro_batch_size"] == 2 and reading.setup["checkpointing"] is Checkpointing.FULL


def test_llamafactory_resize_before_the_processor():
    """mm_plugin._preprocess_image: 4032 x 3024 at image_max_pixels 262,144 -> scaled by sqrt(262144 / 12192768),
    sides truncated; then Qwen's smart_resize at the hub's ceiling."""
    assert pre_resized((3024, 4032), (262_144, 1024)) == (443, 591)
    assert pre_resized((3024, 4032), None) == (3024, 4032)
    assert pre_resized((20, 20), (262_144, 1024)) == (32, 32)
    assert vt.qwen_image(443, 591).lm_tokens == (448 // 28) * (588 // 28)


def test_pixel_setting_in_each_configs_words():
    def tokens(size):
        return vt.qwen_image(*size).lm_tokens

    assert pixel_setting(read_swift("swift sft --model m"), 1_003_520, (3024, 4032), 0, tokens).startswith(
        "MAX_PIXELS=1003520")
    assert "max_pixels=1003520" in pixel_setting(None, 1_003_520, (3024, 4032), 0, tokens)
    lf = read_vlm_config(CONFIGS / "llamafactory_qwen25vl_lora.yaml")
    planned = vt.qwen_image(3024, 4032, max_pixels=1_003_520).lm_tokens
    line = pixel_setting(lf, 1_003_520, (3024, 4032), planned, tokens)
    value = int(line.split(": ")[1])
    assert tokens(pre_resized((3024, 4032), (value, 1024))) <= planned
    assert tokens(pre_resized((3024, 4032), (value + 28 * 28, 1024))) > planned or value == 1_003_520


def test_cli_config_gives_the_model_pixels_and_setup(tmp_path):
    """`memfit vlm --config swift.sh`: MODEL from --model, max_pixels from MAX_PIXELS, the setup from the
    arguments; an option on the command line wins over the file; what was read comes back under "config"."""
    import json

    from typer.testing import CliRunner

    from memfit.cli.app import app
    from memfit.vlm.presets import tiny_config

    model = tmp_path / "config.json"
    model.write_text(json.dumps(tiny_config("qwen2_vl")))
    script = tmp_path / "train.sh"
    script.write_text(f"MAX_PIXELS=200704 swift sft --model {model} --train_type lora --lora_rank 4 "
                      "--per_device_train_batch_size 2 --torch_dtype bfloat16 --max_length 4096\n")
    result = CliRunner().invoke(app, ["vlm", "--config", str(script), "--image-size", "300x500", "--text-len", "24",
                                      "--checkpointing", "none", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    setup = data["estimate"]["setup"]
    assert data["max_pixels"] == 200_704 and data["image"]["lm_tokens"] == vt.qwen_image(300, 500).lm_tokens
    assert (setup["finetune"]["method"], setup["finetune"]["rank"], setup["micro_batch_size"]) == ("lora", 4, 2)
    assert setup["checkpointing"] == "none" and data["config"]["format"] == "ms-swift"
    bad = CliRunner().invoke(app, ["vlm", "--config", str(tmp_path / "missing.sh")])
    assert bad.exit_code == 2 and bad.output.count("error:") == 1
