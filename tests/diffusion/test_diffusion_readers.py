"""memfit.diffusion.readers: each trainer's config (fixtures written from the projects' documented examples, in
tests/data/configs/diffusion) -> size_run's keywords, every key read or left out with a reason, bad files refused
in one line, and `memfit diffusion --config` end to end on a tiny Flux."""

import inspect
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.errors import ConfigError
from memfit.diffusion.readers import LEVERS, read_diffusion_config, split_words, with_config
from memfit.diffusion.readers.commandline import parse, split_text
from memfit.diffusion.readers.common import BLOCK_LINEARS
from memfit.readers import NOT_RELEVANT, NOT_SIZED
from memfit.readers._reader import OFF
from memfit.readers.files import flatten

DATA = Path(__file__).resolve().parents[1] / "data" / "configs" / "diffusion"
FLUX_LINEARS = ",".join(BLOCK_LINEARS["flux"])


def _read(name, **kwargs):
    return read_diffusion_config(DATA / name, **kwargs)


def _accounted(reading) -> set[str]:
    return {e.field for e in reading.read} | {e.field for e in reading.ignored}


def test_kohya_command_line_and_its_dataset_config():
    reading = _read("kohya_flux_lora.sh")
    assert reading.format == "kohya" and reading.model is None  # a local .safetensors: MODEL decides
    assert reading.kwargs == {
        "method": "lora", "rank": 16, "targets": FLUX_LINEARS, "precision": "amp-fp16", "lora_dtype": "fp32",
        "checkpointing": True, "cache_latents": True, "cache_text": True, "optimizer": "adamw-8bit",
        "blocks_to_swap": 18, "resolution": (1024, 1024), "batch": 1}
    assert reading.levers == {"blocks_to_swap": 18}
    assert [(f.path.endswith(n), f.format) for f, n in zip(reading.files, ("kohya_flux_lora.sh",
                                                                          "kohya_flux_dataset.toml"))] == [
        (True, "kohya"), (True, "kohya dataset config")]
    # dataset 0 (1 x 1024^2 px) outweighs dataset 1 (2 x 768 x 512): its values set the run, dataset 1's are read
    read = {e.field: e for e in reading.read}
    assert dict(read["datasets.0.resolution"].sets) == {"resolution": (1024, 1024)}
    assert read["datasets.1.batch_size"].sets == () and read["datasets.1.resolution"].sets == ()
    ignored = {e.field: e.why for e in reading.ignored}
    assert ignored["sdpa"].startswith(NOT_RELEVANT) and ignored["sdpa"] != NOT_RELEVANT
    assert ignored["learning_rate"] == NOT_RELEVANT
    args = parse(split_text((DATA / "kohya_flux_lora.sh").read_text(), "f"), "f").args
    assert set(args) <= _accounted(reading)


def test_kohya_toml_tables_merged():
    reading = _read("kohya_flux_lora.toml")
    assert reading.kwargs == {
        "resolution": (1024, 1024), "batch": 1, "method": "lora", "rank": 16, "targets": FLUX_LINEARS,
        "precision": "amp-bf16", "lora_dtype": "bf16", "base_dtype": "fp8", "checkpointing": True,
        "cache_latents": True, "cache_text": True, "optimizer": "adafactor"}
    read = {e.field: e for e in reading.read}
    assert read["network_alpha"].sets == () and read["network_train_unet_only"].sets == ()
    flat = {k.split(".")[-1] for k, _ in flatten(__import__("tomllib").loads((DATA / "kohya_flux_lora.toml")
                                                                              .read_text()))}
    assert flat <= _accounted(reading)


def test_kohya_full_fine_tune_and_width_first():
    reading = _read("kohya_sdxl_full.toml")
    assert reading.model == "sdxl-base"
    assert reading.kwargs == {"resolution": (1024, 1024), "batch": 1, "method": "full", "precision": "bf16",
                              "checkpointing": True, "cache_latents": True, "cache_text": True,
                              "optimizer": "adafactor"}
    # sd-scripts' --resolution is 'width,height'; the command line wins over --config_file's TOML
    words = ["accelerate", "launch", "sdxl_train.py", "--config_file", str(DATA / "kohya_sdxl_full.toml"),
             "--resolution", "1344,768", "--train_batch_size=2", "--optimizer_type", "PagedAdamW8bit"]
    over = read_diffusion_config(command=words)
    assert (over.kwargs["resolution"], over.kwargs["batch"], over.kwargs["optimizer"]) == (
        (768, 1344), 2, "paged-adamw-8bit")
    assert [f.format for f in over.files] == ["kohya", "kohya"] and over.files[1].via


def test_a_local_checkpoint_is_left_to_model_unopened(tmp_path):
    (tmp_path / "flux1-dev.safetensors").write_bytes(b"\x00\xff" * 64)
    (tmp_path / "run.toml").write_text(f"pretrained_model_name_or_path = '{tmp_path / 'flux1-dev.safetensors'}'\n"
                                       "network_module = 'networks.lora_flux'\n")
    reading = read_diffusion_config(tmp_path / "run.toml")
    assert reading.model is None and reading.family == "flux"
    assert [e.sets for e in reading.read if e.field == "pretrained_model_name_or_path"] == [()]


def test_kohya_dataset_config_falls_back_to_general_then_arguments(tmp_path):
    (tmp_path / "data.toml").write_text("[general]\nresolution = [1344, 768]\n\n[[datasets]]\n"
                                        "[[datasets.subsets]]\nimage_dir = 'img'\n")
    (tmp_path / "run.toml").write_text("network_module = 'networks.lora'\ntrain_batch_size = 3\n"
                                       "resolution = '512,512'\ndataset_config = 'data.toml'\n")
    reading = read_diffusion_config(tmp_path / "run.toml")
    # [general]'s [width, height] over --resolution; no batch_size there: --train_batch_size stays
    assert (reading.kwargs["resolution"], reading.kwargs["batch"]) == ((768, 1344), 3)
    assert {e.field for e in reading.read if e.sets} >= {"general.resolution", "train_batch_size"}


@pytest.mark.parametrize("words, expected", [
    # sd-scripts' defaults: network_dim 4, mixed_precision no; LoRA for SDXL on the Transformer2DModel Linears
    (["sdxl_train_network.py", "--network_module", "networks.lora"],
     {"method": "lora", "rank": 4, "targets": "all", "precision": "fp32"}),
    (["flux_train_network.py", "--network_module", "networks.lora_flux", "--mixed_precision", "bf16",
      "--full_bf16", "--use_8bit_adam", "--fp8_base_unet"],
     {"method": "lora", "rank": 4, "targets": FLUX_LINEARS, "precision": "amp-bf16", "lora_dtype": "bf16",
      "optimizer": "adamw-8bit", "base_dtype": "fp8"}),
    (["sd3_train_network.py", "--network_module", "networks.lora_sd3", "--mixed_precision", "fp16",
      "--optimizer_type", "bitsandbytes.optim.Lion8bit", "--blocks_to_swap", "0"],
     {"method": "lora", "rank": 4, "targets": ",".join(BLOCK_LINEARS["sd3"]), "precision": "amp-fp16",
      "lora_dtype": "fp32", "optimizer": "lion-8bit"}),
])
def test_kohya_defaults(words, expected, tmp_path):
    toml = tmp_path / "off.toml"
    toml.write_text("fp8_base = false\ncache_latents = false\n")
    reading = read_diffusion_config(command=words + ["--config_file", str(toml)])
    assert reading.kwargs == expected
    assert {e.field: e.why for e in reading.ignored if e.field in ("fp8_base", "cache_latents")} == {
        "fp8_base": OFF, "cache_latents": OFF}


def test_diffusers_script():
    reading = _read("diffusers_flux_lora.sh")
    assert reading.format == "diffusers" and reading.model == "flux.1-dev"
    assert reading.kwargs == {"resolution": (512, 512), "batch": 1, "method": "lora", "rank": 16,
                              "precision": "amp-bf16", "lora_dtype": "bf16", "checkpointing": True,
                              "optimizer": "adamw-8bit", "cache_latents": True, "cache_text": True}
    args = parse(split_text((DATA / "diffusers_flux_lora.sh").read_text(), "f"), "f").args
    assert set(args) <= _accounted(reading)
    # the scripts' own defaults (batch 4, rank 4, 512 px); prior preservation doubles the batch; fp16 casts the
    # adapters to fp32; captions per image keep the text encoders; accelerate launch's precision when none given
    plain = read_diffusion_config(command=["python", "train_dreambooth_lora_sd3.py", "--with_prior_preservation",
                                           "--dataset_name", "x", "--caption_column", "text", "--lora_layers",
                                           "attn.to_q,attn.to_v"])
    assert plain.kwargs == {"resolution": (512, 512), "batch": 8, "method": "lora", "rank": 4,
                            "targets": "attn.to_q,attn.to_v", "precision": "fp32", "lora_dtype": "fp32",
                            "cache_text": False}
    assert len(plain.notes) == 1  # its 77 T5 tokens (memfit sizes 256)
    fp16 = read_diffusion_config(command=["accelerate", "launch", "--mixed_precision", "fp16",
                                          "train_dreambooth_flux.py", "--resolution", "1024"])
    assert fp16.kwargs == {"resolution": (1024, 1024), "batch": 4, "method": "full", "precision": "amp-fp16",
                           "cache_text": True}


def test_ai_toolkit():
    reading = _read("ai_toolkit_flux_24gb.yaml")
    assert reading.format == "ai-toolkit" and reading.model == "flux.1-dev"
    assert reading.kwargs == {"base_dtype": "fp8", "resolution": (1024, 1024), "cache_latents": True, "batch": 1,
                              "checkpointing": True, "optimizer": "adamw-8bit", "precision": "amp-bf16",
                              "method": "lora", "rank": 16, "lora_dtype": "fp32", "targets": FLUX_LINEARS}
    ignored = {e.field: e.why for e in reading.ignored}
    assert ignored["config.process.0.train.ema_config.use_ema"].startswith(NOT_SIZED)
    assert "config.process.0.datasets.0.caption_ext" in ignored


def test_an_option_overrides_what_cannot_be_read():
    with pytest.raises(ConfigError, match="optimizer='prodigy'"):
        _read("diffusers_flux_prodigy.sh")
    reading = _read("diffusers_flux_prodigy.sh", overridden={"optimizer": "--optimizer"})
    assert "optimizer" not in reading.kwargs and reading.model is None  # $MODEL_NAME: MODEL decides
    values = {"optimizer": "adamw", "batch": 3, "rank": 16}
    merged, model, _ = with_config(values, {"optimizer", "batch"}, "flux.1-dev", DATA / "diffusers_flux_prodigy.sh",
                                   None)
    assert (merged["optimizer"], merged["batch"], merged["rank"], model) == ("adamw", 3, 4, "flux.1-dev")
    with pytest.raises(ConfigError, match="give MODEL"):
        with_config(values, {"optimizer"}, None, DATA / "diffusers_flux_prodigy.sh", None)
    with pytest.raises(ConfigError, match="not both"):
        with_config(values, set(), None, DATA / "diffusers_flux_lora.sh", ["sdxl_train.py"])
    # MODEL wins over the model the config names; the config's is recorded as read
    _, model, reading = with_config(values, set(), "flux-dev", DATA / "diffusers_flux_lora.sh", None)
    assert model == "flux-dev" and reading.model is None and reading.family == "flux"
    assert [e.sets for e in reading.read if e.field == "pretrained_model_name_or_path"] == [()]
    with pytest.raises(ConfigError, match="trains a flux model"):
        with_config(values, set(), "sdxl", DATA / "kohya_flux_lora.toml", None)


def test_split_words():
    assert split_words("flux.1-dev", None) == ("flux.1-dev", [])
    assert split_words("accelerate", ["launch", "x.py"]) == (None, ["accelerate", "launch", "x.py"])
    assert split_words("train_dreambooth_lora_flux.py", ["--rank", "8"])[0] is None
    assert split_words("sdxl", ["--rank", "8"]) == ("sdxl", ["--rank", "8"])


@pytest.mark.parametrize("name, text, words", [
    ("a.yaml", "foo: 1\nbar: 2\n", "unknown diffusion config"),
    ("st.json", '{"--model_type": "lora", "--lora_rank": 16}', "SimpleTuner"),
    ("d.toml", "[general]\nresolution = 1024\n[[datasets]]\nbatch_size = 1\n", "dataset config"),
    ("bad.toml", "resolution = \n", "not valid TOML"),
    ("m.sh", "accelerate launch flux_kontext_train_network.py --network_dim 16\n", "musubi-tuner"),
    ("w.toml", "network_module = 'networks.lora_wan'\nnetwork_dim = 32\n", "musubi-tuner"),
    ("o.sh", "python train_text_to_image.py --resolution 512\n", "not a script memfit reads"),
    ("args.txt", "--resolution 512 --seed 1\n", "name the training script"),
    ("r.sh", "python flux_train_network.py --resolution big --network_module networks.lora_flux\n",
     "resolution='big'"),
    ("n.sh", "python sdxl_train_network.py --network_module lycoris.kohya\n", "LyCORIS"),
    ("t.sh", "python train_dreambooth_lora_sdxl.py --train_text_encoder\n", "text encoders"),
    ("f.sh", "python sdxl_train.py --mixed_precision fp16 --full_fp16\n", "pure fp16"),
    ("two.sh", "python sdxl_train.py\npython flux_train.py\n", "2 training scripts"),
    ("ref.sh", "python sdxl_train_network.py --dataset_config nope.toml --network_module networks.lora\n",
     "no such file"),
])
def test_bad_files_are_one_line(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        read_diffusion_config(path)
    result = CliRunner().invoke(app, ["diffusion", "sdxl", "--config", str(path)])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_levers_a_config_sets_are_size_runs_keywords():
    """fp8 / NF4 bases and block swap, as the readers set them, are keywords memfit.diffusion.api.size_run takes
    (and the CLI options that override them are the ones OPTIONS names)."""
    pytest.importorskip("torch")
    from memfit.diffusion import api
    from memfit.diffusion.readers.common import OPTIONS

    assert set(LEVERS) <= set(inspect.signature(api.size_run).parameters)
    assert {OPTIONS[k] for k in LEVERS} == {"--base-dtype", "--blocks-to-swap"}


def test_block_linears_are_every_linear_of_the_blocks():
    """The diffusers names memfit gives kohya's and ai-toolkit's LoRA networks match exactly the Linears inside the
    blocks (transformer_blocks / single_transformer_blocks) of diffusers' Flux and SD3 transformers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from memfit.diffusion.presets import tiny_model

    import diffusers

    for family in ("flux", "sd3"):
        spec = tiny_model(family)
        with torch.device("meta"):
            net = getattr(diffusers, spec.denoiser.cls).from_config(spec.denoiser.config)
        linears = {n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)
                   and "transformer_blocks." in n}
        matched = {n for n in linears if any(n == t or n.endswith("." + t) for t in BLOCK_LINEARS[family])}
        assert matched == linears and len(linears) > 10


def test_cli_reads_the_config_and_options_override_it(tmp_path):
    pytest.importorskip("diffusers")
    from memfit.diffusion.presets import tiny_model

    model = tiny_model("flux")
    config = {"_class_name": model.denoiser.cls, **model.denoiser.config}
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["diffusion", str(tmp_path / "tiny.json"), "--config",
                                      str(DATA / "diffusers_flux_lora.sh"), "--resolution", "64", "--rank", "4",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    # from the file: LoRA, 8-bit AdamW, checkpointing, both caches, batch 1; from the options: 64 px, rank 4
    assert (data["resolution"], data["rank"], data["batch"], data["cache_latents"], data["cache_text"]) == (
        [64, 64], 4, 1, True, True)
    assert "rank" not in data["config"]["kwargs"] and data["config"]["format"] == "diffusers"
    entries = {e["field"]: e for e in data["config"]["read"]}
    assert entries["rank"]["sets"] == {} and "--rank" in entries["rank"]["note"]
