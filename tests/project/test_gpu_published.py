"""bench/gpu_published.py: published GPU points map to the right memfit setups, what memfit cannot express is named,
and the report covers every in-scope point exactly once."""

from __future__ import annotations

import json
import re
import time

import pytest

import memfit.techniques  # noqa: F401  (registers the technique sections: activation_offload)
from memfit.choices import Float8
from memfit.setup import Attention, Checkpointing, Engine, Optimizer, Precision, Sharding
from bench_scripts import load_bench  # noqa: E402


gp = load_bench("gpu_published")
POINTS = gp.points_path(None)
pytestmark = pytest.mark.skipif(not POINTS.is_file(),
                                reason=f"published points not found at {gp.DEFAULT_POINTS} (relative to the repo root)")


@pytest.fixture(scope="module")
def points() -> dict[str, dict]:
    return {p["normalized"]["id"]: p for p in gp.load_points(POINTS)}


def test_torchtitan_fsdp_point_maps_to_zero3_over_its_world_size(points):
    for pid, world in (("P085", 8), ("P088", 128)):
        m = gp.map_point(points[pid])
        setup = m.setup
        assert (setup.sharding, setup.num_gpus, setup.engine) == (Sharding.ZERO3, world, Engine.TORCH)
        assert setup.precision is Precision.BF16_MASTER  # FSDP2 MixedPrecisionPolicy over fp32 shards
        assert (setup.micro_batch_size, setup.seq_len, setup.attention) == (2, 8192, Attention.SDPA)
        assert m.hardware.world_size == world and m.hardware.gpus_per_node == 8
        assert m.spec.name == "llama-3.1-8b"
        # torchtitan's selective op-level checkpointing: sized as such now, so the point is compared
        assert m.features == [] and m.expressible
        assert setup.checkpointing is Checkpointing.SELECTIVE_OP
    compiled = gp.map_point(points["P087"])  # torch.compile and float8 are expressible now
    assert compiled.expressible and compiled.setup.compile and compiled.setup.float8 is Float8.TENSORWISE
    assert gp.map_point(points["P103"]).setup.float8_all_gather  # --float8.enable_fsdp_float8_all_gather


def test_context_parallel_rows_keep_their_whole_sequence(points):
    """memfit divides seq_len by cp itself: the CP rows map to the whole sequence, so every rank sees the same
    32768 tokens and the estimate stays flat with CP, as the measured 84 GiB does."""
    one = gp.predict(gp.map_point(points["P091"]))
    for pid, cp in (("P092", 2), ("P093", 4), ("P094", 8)):
        m = gp.map_point(points[pid])
        assert (m.setup.cp, m.setup.seq_len // m.setup.cp) == (cp, 32768)
        assert gp.predict(m).predicted_gib == pytest.approx(one.predicted_gib, rel=0.02)


def test_lora_qlora_and_paged_rows_map_to_memfit(points):
    """LoRA / QLoRA and paged 8-bit AdamW are expressible, and so are the chunked loss, the optimizer in backward,
    activation offloading, tensor and context parallelism and torch.compile; P020-P021 (LoRA / QLoRA with torchtune's
    activation offloading) are compared."""
    from memfit.finetune import BaseWeights, Method
    from memfit.setup import Loss, Optimizer

    lora = gp.map_point(points["P020"])
    assert lora.expressible and lora.setup.activation_offload and lora.setup.finetune.method is Method.LORA
    assert lora.setup.finetune.torchtune  # torchtune's LoRALinear: bf16 adapters, nothing upcast
    ft = gp._map_lora(gp.Mapped(points["P020"]), points["P020"]["normalized"]["lora"])["finetune"]
    assert (ft.method, ft.rank, ft.alpha, ft.recipe.value) == (Method.LORA, 64, 128.0, "torchtune")
    assert set(ft.targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    qlora = gp.map_point(points["P021"])
    assert qlora.expressible and qlora.setup.activation_offload
    assert gp._map_lora(gp.Mapped(points["P021"]), points["P021"]["normalized"]["lora"])["finetune"].base \
        is BaseWeights.NF4
    # the recipe, not a fitted factor, is what closes them: +10.7% / +81.5% under peft's layout
    for pid, bound in (("P020", 6), ("P021", 10)):
        assert abs(gp.predict(gp.map_point(points[pid])).err_pct) < bound, pid
    eight_bit = gp.map_point(points["P019"])  # its states are in the measured active bytes: not paged
    assert eight_bit.expressible and eight_bit.setup.optimizer is Optimizer.ADAMW_8BIT
    assert eight_bit.setup.optimizer_in_backward  # the table is cumulative (the point's techniques say so)
    assert eight_bit.setup.activation_offload and eight_bit.setup.loss is Loss.CHUNKED
    plain = gp.map_point(points["P031"])  # torchtune llama2/7B_lora_single_device: nothing missing
    assert plain.expressible and plain.setup.finetune.targets == ("q_proj", "v_proj")
    row = gp.predict(plain)
    assert row.figure == "allocated" and abs(row.err_pct) < 25
    lora_rows = gp.evaluate(gp.lora_points(list(points.values())))
    assert sum(r.mapped.expressible for r in lora_rows) >= 8
    tp = gp.map_point(points["P095"])  # FSDP 32 x TP 8
    assert gp.TP not in tp.features and (tp.setup.tp, tp.setup.num_gpus) == (8, 256)
    cp = gp.map_point(points["P092"])
    assert gp.CP not in cp.features and cp.setup.cp == 2
    assert gp.map_point(points["P015"]).setup.loss is Loss.CHUNKED
    assert gp.map_point(points["P017"]).setup.optimizer_in_backward
    t0 = gp.map_point(points["P137"])
    assert gp.NOT_IN_CATALOG in t0.features and t0.setup is None


def test_expressible_points_map_their_precision_optimizer_and_metric(points):
    bert = gp.map_point(points["P003"])
    assert bert.expressible and bert.spec.name == "bert-large-uncased"
    s = bert.setup
    assert (s.micro_batch_size, s.seq_len, s.precision, s.optimizer, s.attention, s.checkpointing) == (
        4, 512, Precision.FP32, Optimizer.ADAMW, Attention.EAGER, Checkpointing.NONE)
    assert bert.hardware.gpu.name == "V100-16GB"
    # the 2-label AutoModelForSequenceClassification the source trains, no MLM head (memfit.sources.task)
    assert bert.spec.num_labels == 2 and bert.spec.num_params == 335_143_938 and not bert.approx
    accum = gp.map_point(points["P007"]).setup
    assert (accum.micro_batch_size, accum.grad_accum_steps, accum.precision, accum.checkpointing) == (
        1, 4, Precision.AMP_FP16, Checkpointing.FULL)
    assert gp.map_point(points["P010"]).setup.optimizer is Optimizer.ADAMW_8BIT
    assert gp.map_point(points["P008"]).setup.optimizer is Optimizer.ADAFACTOR
    tune = gp.map_point(points["P013"])
    assert tune.expressible and tune.setup.precision is Precision.BF16 and tune.setup.seq_len == 4096
    row = gp.predict(tune)
    assert (row.metric, row.figure) == ("active", "allocated") and row.predicted_gib > 0
    assert gp.predict(bert).figure == "device_used"  # nvml: the whole device
    assert bert.hardware.cuda_runtime == "legacy"  # a 2022-01 source: before PyTorch 1.13's lazy loading
    assert tune.hardware.cuda_runtime == "lazy"
    assert s.keep_zeroed_grads and not tune.setup.keep_zeroed_grads  # zero_grad before / after PyTorch 2.0
    padded = gp.map_point(points["P012"])  # torchtune logs each step's peak: one typical alpaca step
    assert padded.setup.seq_len == gp.TORCHTUNE_TYPICAL_STEP and padded.setup.optimizer is Optimizer.ADAMW_FUSED


def test_each_metric_gets_its_memfit_figure(points):
    from memfit.estimate.analytic import estimate

    m = gp.map_point(points["P085"])  # multi-GPU: context, reserve and NCCL terms all present
    est = estimate(m.spec, m.setup, m.hardware)
    names = {t.name for t in est.terms}
    assert {"overhead/cuda_context", "overhead/nccl", "overhead/allocator_reserve"} <= names
    context_nccl = est.term("overhead/cuda_context").num_bytes + est.term("overhead/nccl").num_bytes
    assert gp.figure_bytes(est, "reserved") == (est.total_bytes - context_nccl, "reserved")
    assert gp.figure_bytes(est, "allocated") == (est.allocated_bytes, "allocated")
    assert est.tensor_bytes < est.allocated_bytes <= est.reserved_bytes
    assert gp.figure_bytes(est, "nvml") == (est.total_bytes, "device_used")


def test_runs_end_to_end_and_lists_every_in_scope_point_once(points, tmp_path):
    out, js = tmp_path / "report.md", tmp_path / "rows.json"
    start = time.perf_counter()
    assert gp.main(["--out", str(out), "--json", str(js)]) == 0
    assert time.perf_counter() - start < 10
    text = out.read_text().split("## LoRA / QLoRA points")[0]  # that section lists LoRA rows in scope or not
    in_scope = sorted(pid for pid, p in points.items() if p["normalized"]["in_scope"])
    listed = re.findall(r"^\| (P\d+)~? \|", text, flags=re.M)
    for pid in in_scope:
        assert listed.count(pid) == 1, pid
    assert not set(listed) - set(in_scope) - {pid for pid, p in points.items()
                                             if p["normalized"]["measured"].get("is_oom")}
    for heading in ("median |error|", "90th percentile", "OOM rows in scope", "## Not expressible (the roadmap)",
                    "Which memfit figure is compared with which measured metric"):
        assert heading in text
    data = json.loads(js.read_text())
    assert sorted(r["id"] for r in data["rows"]) == in_scope
    assert all(r["expressible"] or r["reason"] for r in data["rows"])  # every skip says why
    stats = data["summary"]
    assert stats["expressible"] + stats["not_expressible"] == len(in_scope)
    assert stats["expressible"] >= 5 and stats["median_abs_error_pct"] is not None
    assert gp.LORA not in stats["features"] and gp.PAGED not in stats["features"]  # both expressible now
    assert "## LoRA / QLoRA points" in out.read_text() and data["lora"]


def test_missing_points_file_is_one_error(tmp_path, capsys):
    assert gp.main(["--points", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "r.md")]) == 2
    assert "no points file" in capsys.readouterr().err


def test_a_classification_point_on_a_model_without_a_classifier_is_not_expressible(points, tmp_path):
    """A classification-head point on a model memfit builds no sequence classifier for (a ViT, here P003's BERT
    setup with the model swapped) is marked not expressible with memfit's own reason, and the run goes on."""
    vit = json.loads(json.dumps(points["P003"]))
    vit["normalized"].update(id="P900", model={"key": "vit-base-patch16-224", "layers": 12, "hidden": 768})
    mapped = gp.map_point(vit)
    assert not mapped.expressible and mapped.features == [gp.CLASSIFIER]
    assert "'vit'" in mapped.reason()
    path = tmp_path / "points.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in (points["P003"], vit)) + "\n")
    out, js = tmp_path / "r.md", tmp_path / "r.json"
    assert gp.main(["--points", str(path), "--out", str(out), "--json", str(js)]) == 0
    rows = {r["id"]: r for r in json.loads(js.read_text())["rows"]}
    assert rows["P003"]["expressible"] and rows["P003"]["memfit_gib"] > 0
    assert not rows["P900"]["expressible"] and gp.CLASSIFIER in rows["P900"]["reason"]
