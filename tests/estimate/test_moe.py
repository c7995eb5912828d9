"""MoE formulas (memfit.estimate.moe): the Experts-node recipe against fake-tensor traces and a real measured CPU
step, the routing assumption and its range, expert parallelism, bad input. CPU, offline, tiny configs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate import moe  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.estimate.comm import comm_volume  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import Checkpointing, Precision, TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=1024)
MOE = {
    "mixtral": dict(_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96),
}
SHAPE = dict(micro_batch_size=4, seq_len=96)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "derived"))


def _error(predicted: int, truth: int) -> float:
    return abs(predicted - truth) / truth


def test_the_recipe_replaces_the_derived_model():
    spec = resolve_model(dict(MOE["qwen2_moe"]))
    assert moe.applies(spec)
    node = moe.experts_nodes(spec)[0]
    assert (node.num_experts, node.top_k, node.expert.intermediate) == (4, 2, 48)
    assert node.shared_experts is not None and node.shared_gate is not None and not node.normalize_topk
    result = estimate(spec, TrainingSetup(**SHAPE), CPU)
    assert not any("memfit.derive" in note for note in result.notes)
    assert any(note.startswith("MoE routing assumption: balanced top-2 of 4 experts") for note in result.notes)
    assert result.moe["assumption"] == "balanced" and result.moe["worst_case"] == "dropless"
    assert result.moe["rows_per_rank"] == [384 * 2, 384 * 2]  # dropless grouped_mm on one rank: no range


@pytest.mark.parametrize("family", sorted(MOE))
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.AMP_BF16])
@pytest.mark.parametrize("ckpt", [Checkpointing.NONE, Checkpointing.FULL])
def test_formulas_within_1_percent_of_the_trace(family, precision, ckpt):
    from memfit.trace import trace

    setup = TrainingSetup(precision=precision, checkpointing=ckpt, **SHAPE)
    predicted = estimate(resolve_model(dict(MOE[family])), setup, CPU).tensor_bytes
    traced = trace(dict(MOE[family]), setup, steps=2)
    assert any("top_k experts" in note for note in traced.notes)
    assert _error(predicted, traced.tensor_bytes) < 0.01, (predicted, traced.tensor_bytes)


def test_formulas_within_2_percent_of_a_measured_cpu_step():
    from memfit.measure import measure

    for family in MOE:
        setup = TrainingSetup(precision=Precision.AMP_BF16, **SHAPE)
        measured = measure(dict(MOE[family]), setup, device="cpu").tensor_bytes
        predicted = estimate(resolve_model(dict(MOE[family])), setup, CPU).tensor_bytes
        assert _error(predicted, measured) < 0.02, (family, predicted, measured)


def test_expert_parallel_splits_the_experts_and_names_the_routing_range():
    spec = resolve_model(dict(MOE["mixtral"]))
    hw = make_hardware("A100-80GB", gpus_per_node=4)
    one = estimate(spec, TrainingSetup(num_gpus=4, **SHAPE), hw)
    two = estimate(spec, TrainingSetup(num_gpus=4, expert_parallel=2, **SHAPE), hw)
    expert = moe.expert_weight_elems(spec)
    assert expert == 2 * 4 * 3 * 64 * 128
    p_bytes = lambda e: e.term("parameters").num_bytes  # noqa: E731
    assert p_bytes(one) - p_bytes(two) == 4 * expert // 2
    assert two.moe["rows_per_rank"] == [768, 2 * 384 * 2]  # dropless worst: the whole EP group's tokens
    assert two.moe["expert_activations_bytes"][1] > two.moe["expert_activations_bytes"][0]
    assert any(note.startswith("routing range (best = balanced, worst = dropless)") for note in two.notes)
    capped = estimate(spec, TrainingSetup(num_gpus=4, expert_parallel=2, capacity_factor=1.25, **SHAPE), hw)
    assert capped.moe["rows_per_rank"] == [768, 960] and capped.moe["worst_case"] == "capacity"
    volume = comm_volume(spec, TrainingSetup(num_gpus=4, expert_parallel=2, **SHAPE), hw)
    a2a = [c for c in volume.collectives if c.name == "all-to-all"]
    assert a2a and a2a[0].payload_bytes == 4 * 2 * 768 * 64 * 2  # 4 per layer x 2 layers x T k h x bf16
    assert json.loads(json.dumps(two.to_dict()))["moe"]["expert_parallel"] == 2


def test_bad_moe_input_is_one_line():
    with pytest.raises(ConfigError, match="does not divide num_gpus"):
        TrainingSetup(num_gpus=4, expert_parallel=3)
    with pytest.raises(ConfigError, match="below 1"):
        TrainingSetup(capacity_factor=0.5)
    spec = resolve_model(dict(MOE["mixtral"]))
    with pytest.raises(ConfigError, match="does not divide the 4 experts"):
        estimate(spec, TrainingSetup(num_gpus=8, expert_parallel=8, **SHAPE), make_hardware("A100-80GB",
                                                                                           gpus_per_node=8))


@pytest.mark.parametrize("args", [["--ep", "3", "--gpus", "4"], ["--capacity-factor", "0.5"]])
@pytest.mark.processes
def test_cli_bad_moe_options_exit_2(tmp_path, args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE["mixtral"]))
    done = subprocess.run([str(Path(sys.executable).parent / "memfit"), "plan", str(path), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
