"""memfit.diffusion's levers: the per-block fit against the whole trace, the fp8 base against a real CPU step, the
block swap's host bytes against the blocks' own weights, and the ladder's order and stop."""

import dataclasses
import os
import subprocess
import sys

import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from memfit.diffusion import ladder  # noqa: E402
from memfit.diffusion.api import DiffusionEstimate, diffusion_setup, estimate_diffusion  # noqa: E402
from memfit.diffusion.latents import shapes  # noqa: E402
from memfit.diffusion.model import trace_denoiser  # noqa: E402
from memfit.diffusion.presets import tiny_model  # noqa: E402
from memfit.diffusion.swap import most_blocks  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402


def _deeper(family: str, **blocks) -> object:
    model = tiny_model(family)
    config = {k: v for k, v in model.denoiser.config.items() if k != "dual_attention_layers"}
    return dataclasses.replace(model, denoiser=dataclasses.replace(model.denoiser, config={**config, **blocks}))


def test_per_block_fit_is_the_whole_trace(tmp_path, monkeypatch):
    # SD3 and other setups: bench/diffusion.py (fit vs whole trace rows)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    family = "flux"
    model = _deeper(family, num_layers=4, num_single_layers=5)
    setup = diffusion_setup(family=family, method="lora", rank=4, batch=2)
    fitted = estimate_diffusion(model, resolution=64, batch=2, setup=setup)
    whole = estimate_diffusion(model, resolution=64, batch=2, setup=setup, exact=True)
    assert fitted.fitted and not whole.fitted
    assert fitted.memory.tensor_bytes == whole.memory.tensor_bytes
    assert {t.name: t.num_bytes for t in fitted.memory.terms} == {t.name: t.num_bytes for t in whole.memory.terms}
    assert (fitted.denoiser_params, fitted.trainable_params) == (whole.denoiser_params, whole.trainable_params)
    assert list(tmp_path.glob("diffusion-*.json"))  # cached: the second call reads it
    again = estimate_diffusion(model, resolution=64, batch=2, setup=setup)
    assert again.memory.tensor_bytes == fitted.memory.tensor_bytes


MEASURE_FP8 = """
from memfit.diffusion.api import diffusion_setup
from memfit.diffusion.latents import shapes
from memfit.diffusion.model import measure_denoiser
from memfit.diffusion.presets import tiny_model
model = tiny_model("sd3")
setup = diffusion_setup(family="sd3", method="lora", rank=4, batch=2, base_dtype="fp8")
print(measure_denoiser(model, shapes(model, 64, 64), setup, batch=2, base_dtype="fp8").tensor_bytes)
"""


@pytest.mark.processes
def test_fp8_base_trace_matches_a_real_cpu_step():
    # the real step in a process of its own: after other diffusion steps in this process it measured 1.6% less
    # (534,408 B against the trace's 542,760 B; alone it is within 0.5%, every run so far): cause not found yet
    model = tiny_model("sd3")
    shp = shapes(model, 64, 64)
    setup = diffusion_setup(family="sd3", method="lora", rank=4, batch=2, base_dtype="fp8")
    run = subprocess.run([sys.executable, "-c", MEASURE_FP8], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-2000:]
    measured = int(run.stdout.split()[-1])
    traced = trace_denoiser(model, shp, setup, batch=2, kernels="cpu", base_dtype="fp8").tensor_bytes
    assert abs(traced - measured) / measured < 0.005, (measured, traced)


def test_block_swap_moves_the_last_blocks_linear_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    model = _deeper("flux", num_layers=4, num_single_layers=6)
    setup = diffusion_setup(family="flux", method="lora", rank=4, batch=1)
    plain = estimate_diffusion(model, resolution=64, setup=setup)
    swapped = estimate_diffusion(model, resolution=64, setup=setup, blocks_to_swap=3)
    net = diffusers.FluxTransformer2DModel.from_config(model.denoiser.config)
    # kohya flux_models.enable_block_swap(3): 3 // 2 = 1 double block, (3 - 1) x 2 = 4 single blocks, the last ones
    blocks = [net.transformer_blocks[-1], *net.single_transformer_blocks[-4:]]
    weights = sum(m.weight.numel() for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    assert swapped.swap.swapped == (("double-stream blocks", 1), ("single-stream blocks", 4))
    assert swapped.swap.host_bytes == 2 * weights  # bf16 under amp-bf16
    assert plain.memory.tensor_bytes - swapped.memory.tensor_bytes == swapped.swap.host_bytes
    assert swapped.memory.cpu_bytes == swapped.swap.host_bytes
    # at most 4 - 2 double and 6 - 2 single blocks: N = 4 (2 + 4), N = 5 would be 2 + 6
    assert most_blocks(model) == 4 and most_blocks(tiny_model("sdxl")) == 0
    with pytest.raises(ConfigError):
        estimate_diffusion(model, resolution=64, setup=setup, blocks_to_swap=5)
    with pytest.raises(ConfigError):
        estimate_diffusion(tiny_model("sdxl"), resolution=64, blocks_to_swap=1)


def test_ladder_climbs_cheapest_first_and_stops(monkeypatch):
    saving = {"cache_text": 9, "cache_latents": 1, "checkpointing": 20, "optimizer": 0, "base_dtype": 11}
    seen = []

    def size_run(model, *, resolution, gpu, **values):
        seen.append(dict(values))
        required = 60 - sum(v for k, v in saving.items() if values.get(k) not in (None, False, "bf16"))
        result = DiffusionEstimate(model="m", family="flux", shapes=None, batch=1, method="lora", rank=16,
                                   targets=(), cache_latents=False, cache_text=False, denoiser_params=0,
                                   trainable_params=0, memory=None, frozen=(), phases=())
        return result, None, (required <= 22, required, 22)

    monkeypatch.setattr(ladder, "size_run", size_run)
    _, rungs = ladder.plan("flux.1-dev", resolution=(1024, 1024), cache_latents=True, method="lora")
    assert [r.title for r in rungs] == ["cache text-encoder outputs", "gradient checkpointing", "8-bit AdamW",
                                        "fp8 base"]
    assert [r.required for r in rungs] == [50, 30, 30, 19] and [r.fits for r in rungs] == [False] * 3 + [True]
    assert seen[-1]["base_dtype"] == "fp8" and seen[-1]["cache_latents"]
