"""float8 training (torchao Float8Linear): setup checks, the kernels' bytes measured on CPU, whole measured steps
against the estimate, and the FSDP2 float8 all-gather against the real converted module (memfit.estimate.float8)."""

from __future__ import annotations

import pytest

from memfit.errors import ConfigError
from memfit.estimate import float8
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume
from memfit.hardware import cpu_device, make_hardware
from memfit.choices import Float8
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

from tiny_configs import TINY_LLAMA, TINY_QWEN2

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

CPU = make_hardware(cpu_device(64 * 1024**3))


@pytest.mark.parametrize("fields, fix", [
    ({"precision": "fp32"}, "precision fp32 cannot run it"),
    ({"precision": "amp-fp16"}, "use amp-bf16"),
    ({"float8_all_gather": True}, "--engine torch"),
    ({"float8": "rowwise", "float8_all_gather": True, "engine": "torch", "sharding": "zero3", "num_gpus": 2},
     "tensorwise scaling only"),
    ({"finetune": "lora"}, "method full"),
])
def test_bad_float8_setups_are_one_line_config_errors(fields, fix):
    with pytest.raises(ConfigError, match=fix):
        TrainingSetup(**{"float8": "tensorwise", "precision": "amp-bf16", **fields})
    with pytest.raises(ConfigError, match="needs float8 training"):
        TrainingSetup(float8_all_gather=True, engine="torch", sharding="zero3", num_gpus=2)


def _peak_growth(fn) -> int:
    """Peak bytes allocated above the start while `fn` runs (torch.profiler CPU memory events)."""
    from torch._C._profiler import _EventType

    from memfit._torch.measure_cpu import _walk

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = sorted((e.start_time_ns, e.extra_fields.alloc_size)
                   for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
                   if e.tag == _EventType.Allocation)
    live = peak = 0
    for _, size in sizes:
        live += size
        peak = max(peak, live)
    return peak


def test_an_eager_cast_peaks_at_nine_bytes_per_element():
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = torch.randn(384, 320, dtype=torch.bfloat16)
    peak = _peak_growth(lambda: hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig()))
    assert peak - 4 == float8.CAST_PEAK * x.numel()  # + the fp32 scale


@pytest.mark.parametrize("m, k, n", [(384, 160, 224), (320, 768, 96), (96, 768, 384)])
def test_cpu_scaled_mm_bytes_match_the_formula(m, k, n):
    """Each of the CPU kernel's three moments dominates one shape (the product, the first, the second operand). The
    kernel is ATen's emulated fallback (fp32 copies): where the CPU supports it (AMX here) ATen's CPU _scaled_mm
    runs oneDNN's float8 matmul instead (aten/src/ATen/native/mkldnn; 36 KB of scratch on the first shape), so
    oneDNN is switched off to size the same kernel on every x86 CPU."""
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    with torch.backends.mkldnn.flags(enabled=False):
        peak = _peak_growth(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    assert peak - 2 * m * n == pytest.approx(float8.cpu_gemm_bytes(m, k, n), abs=16)  # + the scales' reciprocals


def test_converted_weights_are_the_real_modules_float8_linears():
    from torchao.float8.float8_linear import Float8Linear

    from memfit._torch.step import build_hf_model

    setup = TrainingSetup(micro_batch_size=1, seq_len=32, precision="bf16", float8="tensorwise")
    model = build_hf_model(dict(TINY_LLAMA), setup)
    real = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    assert real == float8.converted_weight_elems(resolve_model(TINY_LLAMA), setup) > 0
    assert not isinstance(model.lm_head, Float8Linear)


@pytest.mark.parametrize("config, precision, ckpt", [(TINY_LLAMA, "amp-bf16", "none"), (TINY_QWEN2, "bf16", "full")])
def test_measured_float8_steps_match_the_estimate(config, precision, ckpt):
    from memfit.measure import measure

    base = TrainingSetup(micro_batch_size=2, seq_len=256, precision=precision, checkpointing=ckpt, optimizer="adamw")
    spec = resolve_model(config)
    on = base.replace(float8="tensorwise")
    measured_on = measure(config, on, steps=2).tensor_bytes
    assert estimate(spec, on, CPU).tensor_bytes == pytest.approx(measured_on, rel=0.01)
    if precision == "amp-bf16":  # the saving: autocast's weight casts and the CPU-autocast input copies
        measured_off = measure(config, base, steps=2).tensor_bytes
        saving = estimate(spec, base, CPU).tensor_bytes - estimate(spec, on, CPU).tensor_bytes
        assert saving == measured_off - measured_on > 0


def test_fsdp2_float8_all_gather_halves_the_gathered_float8_weights():
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=4096, precision="bf16-master", engine="torch",
                          sharding="zero3", num_gpus=8, float8="tensorwise")
    gathered = setup.replace(float8_all_gather=True)
    hw = make_hardware("H100-80GB", gpus_per_node=8)
    per_block = sum(s.a * s.b for s in float8.block_linears(spec))
    assert per_block == 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336  # q, k, v, o, gate, up, down

    def term(est, name):
        return sum(t.num_bytes for t in est.terms if t.name == name)

    assert (term(estimate(spec, setup, hw), "parameters/gathered")
            - term(estimate(spec, gathered, hw), "parameters/gathered")) == per_block
    moved = {c.what: c for c in comm_volume(spec, gathered).collectives}
    fp8 = [c for what, c in moved.items() if what.startswith("float8")]
    assert len(fp8) == 2 and all(c.dtype_bytes == 1 and c.num_elements == 32 * per_block for c in fp8)


def test_torchtune_and_axolotl_float8_keys_read_into_the_setup(tmp_path):
    from memfit.readers import read_config

    root = __import__("pathlib").Path(__file__).parents[1] / "data" / "configs"
    tune = tmp_path / "tune.yaml"
    tune.write_text((root / "torchtune_full.yaml").read_text() + "\nenable_fp8_training: true\n")
    reading = read_config(tune, num_gpus=8)
    assert reading.overrides["float8"] is Float8.TENSORWISE and reading.overrides["float8_all_gather"] is True
    tune.write_text((root / "torchtune_full.yaml").read_text() + "\nenable_fp8_training: true\n"
                    "fp8_recipe_name: rowwise\n")
    reading = read_config(tune, num_gpus=8)
    assert reading.overrides["float8"] is Float8.ROWWISE and "float8_all_gather" not in reading.overrides
    axo = tmp_path / "axolotl.yaml"
    axo.write_text((root / "axolotl_full.yaml").read_text() + "\nfp8: true\nfp8_enable_fsdp_float8_all_gather: true\n")
    reading = read_config(axo)
    assert reading.overrides["float8"] is Float8.TENSORWISE and reading.overrides["float8_all_gather"] is True


def test_torchtitan_emits_the_float8_converter():
    from memfit.emit.torchtitan import torchtitan_toml

    setup = TrainingSetup(precision="bf16-master", engine="torch", sharding="zero3", num_gpus=8, float8="tensorwise",
                          float8_all_gather=True)
    toml = torchtitan_toml(setup, 32)
    assert '[model]\nconverters = ["quantize.linear.float8"]' in toml
    assert "enable_fsdp_float8_all_gather = true" in toml and 'filter_fqns = ["output"]' in toml
    assert 'recipe_name = "rowwise"' in torchtitan_toml(setup.replace(float8="rowwise", float8_all_gather=False))


@pytest.mark.slow
@pytest.mark.processes
def test_fsdp2_float8_all_gather_on_two_gloo_ranks(tmp_path):
    """Real FSDP2 (memfit's engine) on 2 gloo ranks: the all-gathered bytes of a step equal the communication
    model's; each rank's peak is the estimate's plus the units whose all-gather for backward (prefetched, as gloo's
    timing falls) has already landed: the root's 65,600 bf16 parameters and one or two blocks, a block being
    82,176 B in bf16 and 41,216 B with its Linear weights gathered in float8."""
    import json
    from itertools import product

    from torchrun_job import rank_results, run_ranks

    base = dict(micro_batch_size=2, seq_len=64, precision="bf16-master", engine="torch", sharding="zero3", num_gpus=2,
                optimizer="adamw")
    setups = {"off": base, "all_gather": dict(base, float8="tensorwise", float8_all_gather=True)}
    worker = __import__("pathlib").Path(__file__).parents[1] / "float8_fsdp_worker.py"
    out = run_ranks(worker, dict(TINY_LLAMA), tmp_path, json.dumps(setups), "2", timeout=600)
    spec, hw = resolve_model(TINY_LLAMA), make_hardware(cpu_device(64 * 1024**3), gpus_per_node=2)
    root = 2 * spec.params_matching("embed_tokens", "lm_head", "model.norm")
    for name, fields in setups.items():
        setup, ranks = TrainingSetup(**fields), rank_results(out / name)
        gathered = sum(c.payload_bytes for c in comm_volume(spec, setup).collectives if c.name == "all-gather")
        assert [r["all_gather_bytes"] for r in ranks] == [gathered, gathered]
        block = 2 * spec.params_matching(".*.") // spec.num_layers - float8.gathered_saving_per_block(spec, setup, 2)
        predicted = estimate(spec, setup, hw).tensor_bytes
        landed = {r * root + b * block for r, b in product((0, 1), (0, 1, 2))}
        for rank in ranks:
            assert min(abs(rank["peak_bytes"] - predicted - extra) for extra in landed) <= 0.005 * predicted
