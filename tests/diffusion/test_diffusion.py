"""memfit.diffusion: the catalog's exact parameter counts against diffusers / transformers on the meta device, the
latent and token counts of a resolution, the denoiser's traced step against real CPU steps of tiny configs
(the full matrix: bench/diffusion.py), the phases, and the `memfit diffusion` command."""

import json

import pytest
import torch
from typer.testing import CliRunner

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from memfit.cli.app import app  # noqa: E402
from memfit.diffusion.api import diffusion_setup, estimate_diffusion  # noqa: E402
from memfit.diffusion.latents import shapes  # noqa: E402
from memfit.diffusion.model import measure_denoiser, trace_denoiser  # noqa: E402
from memfit.diffusion.presets import CATALOG, resolve_model, tiny_model  # noqa: E402


def _count(spec: dict) -> int:
    config = dict(spec["config"])
    with torch.device("meta"):
        if hasattr(diffusers, spec["class"]):
            module = getattr(diffusers, spec["class"]).from_config(config)
        else:
            kind = config.pop("model_type")
            hf = transformers.T5Config(**config) if kind == "t5" else transformers.CLIPTextConfig(**config)
            module = getattr(transformers, spec["class"])(hf)
    return sum(p.numel() for p in module.parameters())


def test_catalog_parameter_counts_are_the_libraries():
    catalog = json.loads(CATALOG.read_text())
    specs = [*catalog["components"].values(), *(entry["denoiser"] for entry in catalog["models"].values())]
    assert [spec["params"] for spec in specs] == [_count(spec) for spec in specs]
    # the published sizes: FLUX.1-dev 11.9B, SD3.5 Large 8.1B, SDXL's UNet 2.6B, T5-XXL's encoder 4.8B
    models = catalog["models"]
    assert round(models["flux.1-dev"]["denoiser"]["params"] / 1e9, 1) == 11.9
    assert round(models["sd3.5-large"]["denoiser"]["params"] / 1e9, 1) == 8.1
    assert models["sdxl-base"]["denoiser"]["params"] == 2_567_463_684


def test_latents_and_tokens_of_a_resolution():
    flux = shapes(resolve_model("black-forest-labs/FLUX.1-dev"), 1024, 768)
    assert flux.latent == (16, 128, 96) and flux.image_tokens == 64 * 48 and flux.text_tokens == 512
    sd3 = shapes(resolve_model("sd3.5-large"), 1024, 1024)
    assert sd3.latent == (16, 128, 128) and sd3.image_tokens == 4096 and sd3.text_tokens == 77 + 256
    sdxl = shapes(resolve_model("sdxl"), 1024, 1024)
    assert sdxl.latent == (4, 128, 128) and sdxl.image_tokens == 0 and sdxl.text_tokens == 77
    assert (sdxl.text_dim, sdxl.pooled_dim) == (2048, 1280)


@pytest.mark.parametrize("family, fields", [
    ("flux", dict(method="lora", rank=4, precision="fp32", checkpointing=True)),
    ("sd3", dict(method="full", precision="amp-bf16")),
    ("sdxl", dict(method="lora", rank=4, precision="fp32", targets="all")),
])
def test_trace_matches_a_real_cpu_step(family, fields):
    model = tiny_model(family)
    shp = shapes(model, 64, 64)
    setup = diffusion_setup(family=family, batch=2, **fields)
    measured = measure_denoiser(model, shp, setup, batch=2).tensor_bytes
    traced = trace_denoiser(model, shp, setup, batch=2, kernels="cpu").tensor_bytes
    assert abs(traced - measured) / measured < 0.005, (measured, traced)


def test_phases_of_caching():
    model = tiny_model("sd3")
    setup = diffusion_setup(family="sd3", method="lora", rank=4, batch=1)
    plain = estimate_diffusion(model, resolution=64, setup=setup)
    assert [p.name for p in plain.phases] == ["encoding in each step", "training step (denoiser)"]
    cached = estimate_diffusion(model, resolution=64, setup=setup, cache_latents=True)
    assert [p.name for p in cached.phases] == ["caching (once, before training)", "training step (denoiser)"]
    vae = next(f for f in plain.frozen if f.kind == "vae")
    # the VAE's weights are in the step unless cached; its forward's transient only in the encoding phases
    assert plain.phases[-1].bytes - cached.phases[-1].bytes == vae.weight_bytes
    assert vae.forward_bytes > 0 and cached.phases[0].parts[-1] == ("largest encoder forward", vae.forward_bytes)


def test_cli_json_and_errors(tmp_path):
    model = tiny_model("flux")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": model.denoiser.cls, **model.denoiser.config}))
    runner = CliRunner()
    result = runner.invoke(app, ["diffusion", str(path), "--resolution", "64", "--rank", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["image_tokens"] == 16 and data["latent"] == [4, 8, 8] and data["fits"]
    step = data["phases"][-1]
    assert step["name"] == "training step (denoiser)" and step["bytes"] == sum(step["parts"].values()) > 0
    assert data["denoiser_params"] == _count({"class": model.denoiser.cls, "config": model.denoiser.config})
    for args, words in ((["flux.1-dev", "--resolution", "1000"], "multiple of 16"),
                        (["no-such-model"], "unknown diffusion model"),
                        (["flux.1-dev", "--method", "qlora"], "full or lora")):
        bad = runner.invoke(app, ["diffusion", *args])
        assert bad.exit_code == 2 and words in bad.output and "Traceback" not in bad.output
