"""memfit.solve and `memfit fit`: every answer is checked against the estimator called here, independently: the
answer fits and the next candidate does not; sweep cells equal direct estimate calls; the cheapest GPU is the
smallest catalog GPU that fits and every smaller one does not."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest
from typer.testing import CliRunner

from memfit import solve
from memfit.cli.app import app
from memfit.diagnose import diagnose
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.estimate.result import Category, MemoryEstimate, Phase, Term
from memfit.hardware import GPU, check_precision, gpu_catalog, make_hardware
from memfit.plan import plan
from memfit.search import gpus_to_fit
from memfit.setup import Sharding, TrainingSetup
from memfit.sources import resolve_model

LLAMA8 = resolve_model("llama-3.1-8b")
LLAMA70 = resolve_model("llama-2-70b")
TINY = resolve_model({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
                      "max_position_embeddings": 512})
NARROW = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}


def fits(spec, setup, hw, margin=0.05) -> bool:
    return diagnose(estimate(spec, setup, hw), hw, margin=margin).fits


def layout(hw, n):
    return dataclasses.replace(hw, gpus_per_node=min(n, 8), num_nodes=max(1, n // 8))


SETUPS = [
    (LLAMA8, TrainingSetup(seq_len=2048, precision="bf16", optimizer="adamw-8bit", checkpointing="full"), "A100-80GB"),
    (LLAMA8, TrainingSetup(seq_len=4096, precision="bf16", optimizer="adamw-8bit"), "H200"),
    (LLAMA8, TrainingSetup(seq_len=1024, precision="amp-bf16", attention="eager", grad_accum_steps=4), "MI300X"),
    (TINY, TrainingSetup(seq_len=512, precision="fp32", optimizer="adamw"), "T4"),
]


# ------------------------------------------------------------------------------------------------- largest batch


@pytest.mark.parametrize("spec,setup,gpu", SETUPS)
def test_max_micro_batch_fits_and_one_more_does_not(spec, setup, gpu):
    hw = make_hardware(gpu)
    result = solve.max_micro_batch(spec, setup, hw)
    b = result.value
    assert b is not None and b >= 1
    assert fits(spec, setup.replace(micro_batch_size=b), hw)
    assert not fits(spec, setup.replace(micro_batch_size=b + 1), hw)
    assert result.best.total_bytes == estimate(spec, setup.replace(micro_batch_size=b), hw).total_bytes
    assert result.beyond.value == b + 1 and not result.beyond.fits
    assert result.held_fixed["seq_len"] == setup.seq_len and "micro_batch_size" not in result.held_fixed
    assert result.evaluations <= 2 * (b.bit_length() + 2)  # galloping + bisection, not a scan


def test_max_micro_batch_in_steps():
    hw, setup = make_hardware("H200"), SETUPS[0][1]
    result = solve.max_micro_batch(LLAMA8, setup, hw, step=4)
    assert result.value % 4 == 0 and result.step == 4
    assert fits(LLAMA8, setup.replace(micro_batch_size=result.value), hw)
    assert not fits(LLAMA8, setup.replace(micro_batch_size=result.value + 4), hw)
    exact = solve.max_micro_batch(LLAMA8, setup, hw).value
    assert result.value == exact // 4 * 4


def test_any_estimator_callable_and_the_limit():
    """A linear toy estimator: 1000 B per sequence + 5000 B; budget 100,000 B (margin 0) -> exactly 95."""
    def toy(spec, setup, hw):
        return MemoryEstimate((Term("toy", Category.ACTIVATIONS, 1000 * setup.micro_batch_size + 5000),),
                              Phase.BACKWARD, "toy", setup)

    hw = make_hardware(GPU("toy", 100_000))
    result = solve.max_micro_batch(TINY, TrainingSetup(), hw, estimator=toy, margin=0.0)
    assert result.value == 95 and result.beyond.value == 96 and result.limited_by == "memory"
    capped = solve.max_micro_batch(TINY, TrainingSetup(), hw, estimator=toy, margin=0.0, limit=50)
    assert capped.value == 50 and capped.beyond is None and capped.limited_by == "limit"


def test_nothing_fits_says_so():
    hw = make_hardware("1MiB")
    result = solve.max_micro_batch(LLAMA8, SETUPS[0][1], hw)
    assert result.value is None and not result.fits and result.best is None
    assert result.beyond.value == 1 and not result.beyond.fits
    assert "no micro-batch fits" in result.text()


def test_max_micro_batch_with_the_ladder():
    hw, setup = make_hardware("A100-80GB"), TrainingSetup(seq_len=2048)  # amp-bf16, AdamW, no checkpointing
    plain = solve.max_micro_batch(LLAMA8, setup, hw)
    laddered = solve.max_micro_batch(LLAMA8, setup, hw, with_ladder=True)
    b = laddered.value
    assert plain.value is None or b > plain.value
    keep = frozenset({"micro_batch_size"})
    at = plan(LLAMA8, setup.replace(micro_batch_size=b), hw, keep=keep)
    above = plan(LLAMA8, setup.replace(micro_batch_size=b + 1), hw, keep=keep)
    assert at.fits and not above.fits
    assert laddered.best.setup == at.final_setup and laddered.best.setup.micro_batch_size == b
    assert laddered.best.changes == tuple(s.title for s in at.steps) and laddered.best.changes
    assert laddered.held_fixed == {"gpu": "A100-80GB", "num_gpus": 1, "margin": 0.05}
    assert laddered.start["precision"] == "amp-bf16"


# ------------------------------------------------------------------------------------------------- longest seq


@pytest.mark.parametrize("step", [64, 1])
def test_max_seq_len_fits_and_one_step_more_does_not(step):
    hw = make_hardware("L4")
    setup = TrainingSetup(micro_batch_size=1, precision="bf16", optimizer="adamw-8bit", checkpointing="full")
    spec = resolve_model("llama-3.2-1b")
    result = solve.max_seq_len(spec, setup, hw, step=step)
    s = result.value
    assert s % step == 0 and result.limited_by == "memory"
    assert fits(spec, setup.replace(seq_len=s), hw) and not fits(spec, setup.replace(seq_len=s + step), hw)
    assert result.best.total_bytes == estimate(spec, setup.replace(seq_len=s), hw).total_bytes


def test_max_seq_len_stops_at_the_context():
    result = solve.max_seq_len(TINY, TrainingSetup(micro_batch_size=1), make_hardware("H200"))
    assert result.value == 512 and result.beyond is None and result.limited_by == "limit"
    assert any("context" in note for note in result.notes)


def test_max_seq_len_below_the_step():
    """A GPU just large enough for seq 40 (margin 0): 64 does not fit, and the search goes on in steps of 1."""
    setup = TrainingSetup(micro_batch_size=64, precision="fp32", optimizer="adamw")
    hw0 = make_hardware(GPU("tight", 141 * 2**30))  # the device terms of the same kind of GPU (no catalog values)
    need = estimate(TINY, setup.replace(seq_len=40), hw0).total_bytes
    hw = make_hardware(GPU("tight", need))
    result = solve.max_seq_len(TINY, setup, hw, margin=0.0)
    # the caching allocator reserves in 2 MiB / 20 MiB steps, so a few lengths past 40 need the same memory
    expected = max(q for q in range(40, 64) if fits(TINY, setup.replace(seq_len=q), hw, 0.0))
    assert result.value == expected < 64 and result.step == 1 and result.beyond.value == expected + 1
    assert not fits(TINY, setup.replace(seq_len=expected + 1), hw, 0.0)
    assert any("steps of 1" in note for note in result.notes)


# ------------------------------------------------------------------------------------------------- fewest GPUs


def test_fewest_gpus_zero3_when_the_setup_has_none():
    hw = make_hardware("H100")
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, precision="bf16", checkpointing="full")
    result = solve.fewest_gpus(LLAMA70, setup, hw)
    n = result.value
    assert n is not None and n > 1 and n & (n - 1) == 0
    assert result.best.setup.sharding is Sharding.ZERO3 and result.best.setup.num_gpus == n
    assert fits(LLAMA70, setup.replace(sharding="zero3", num_gpus=n), layout(hw, n))
    below = setup.replace(sharding="zero3", num_gpus=n // 2) if n > 2 else setup
    assert not fits(LLAMA70, below, layout(hw, n // 2))
    assert result.below.value == n // 2 and not result.below.fits
    assert not fits(LLAMA70, setup, hw)  # one GPU, unsharded, does not either
    assert gpus_to_fit(LLAMA70, setup, hw).num_gpus == n  # the one "how many GPUs" answer memfit gives


def test_fewest_gpus_keeps_the_setups_sharding_and_answers_one():
    hw = make_hardware("A100-40GB", gpus_per_node=2)
    setup = TrainingSetup(micro_batch_size=1, precision="bf16-master", checkpointing="full", sharding="zero2",
                          num_gpus=2)
    result = solve.fewest_gpus(LLAMA8, setup, hw)
    n = result.value
    assert n == 8 and result.best.setup.sharding is Sharding.ZERO2  # the stage is kept, not raised to zero3
    assert fits(LLAMA8, setup.replace(num_gpus=n), layout(hw, n))
    assert not fits(LLAMA8, setup.replace(num_gpus=n // 2), layout(hw, n // 2))
    assert solve.fewest_gpus(LLAMA8, setup.replace(sharding="zero1"), hw).value > n
    small = solve.fewest_gpus(TINY, TrainingSetup(seq_len=256, precision="fp32"), make_hardware("T4"))
    assert small.value == 1 and small.below is None


def test_fewest_gpus_with_the_ladder():
    hw = make_hardware("A100-40GB")
    setup = TrainingSetup(micro_batch_size=4, seq_len=2048)
    result = solve.fewest_gpus(LLAMA70, setup, hw, with_ladder=True)
    n = result.value
    keep = frozenset({"num_gpus"})
    assert plan(LLAMA70, setup.replace(num_gpus=n), layout(hw, n), keep=keep).fits
    if n > 1:  # one GPU: QLoRA with offloaded activations fits a 70B model on a 40 GB card
        assert not plan(LLAMA70, setup.replace(num_gpus=n // 2), layout(hw, n // 2), keep=keep).fits
    assert result.best.changes == tuple(
        st.title for st in plan(LLAMA70, setup.replace(num_gpus=n), layout(hw, n), keep=keep).steps)


# ------------------------------------------------------------------------------------------------- cheapest GPU


@pytest.mark.parametrize("setup", [
    TrainingSetup(micro_batch_size=2, seq_len=2048, precision="bf16", optimizer="adamw-8bit", checkpointing="full"),
    TrainingSetup(micro_batch_size=1, seq_len=1024, precision="amp-fp16", optimizer="adamw-8bit",
                  checkpointing="full"),
])
def test_cheapest_gpu_is_the_smallest_that_fits(setup):
    hw = make_hardware("A100-80GB")
    result = solve.cheapest_gpu(LLAMA8, setup, hw)
    gpu = result.gpu
    assert gpu is not None and fits(LLAMA8, setup, dataclasses.replace(hw, gpu=gpu))
    smaller = [g for g in gpu_catalog().values() if (g.memory_bytes, g.name) < (gpu.memory_bytes, gpu.name)]
    assert smaller and len(result.rejected) == len(smaller)
    for g in smaller:
        try:
            check_precision(setup.precision, g)
        except ConfigError:
            continue
        assert not fits(LLAMA8, setup, dataclasses.replace(hw, gpu=g)), g.name
    assert "no prices" in result.order


def test_cheapest_gpu_none_and_with_the_ladder():
    setup = TrainingSetup(micro_batch_size=8, seq_len=4096)
    none = solve.cheapest_gpu(LLAMA70, setup, make_hardware("H100"))
    assert none.gpu is None and len(none.rejected) == len(gpu_catalog())
    hw = make_hardware("H100")
    laddered = solve.cheapest_gpu(LLAMA8, setup, hw, with_ladder=True)
    assert plan(LLAMA8, setup, dataclasses.replace(hw, gpu=laddered.gpu)).fits
    for r in laddered.rejected:
        if r.point is not None:
            assert not plan(LLAMA8, setup, dataclasses.replace(hw, gpu=gpu_catalog()[r.gpu])).fits


# ------------------------------------------------------------------------------------------------------- sweep


def test_sweep_cells_equal_direct_estimates():
    hw = make_hardware("H100")
    setup = TrainingSetup(grad_accum_steps=2)
    result = solve.sweep(LLAMA8, setup, hw, seqs=[1024, 2048], batches=[1, 2, 4])
    assert [m.key for m in result.methods] == list(solve.DEFAULT_METHODS)
    assert len(result.cells) == 2 * 3 * len(solve.DEFAULT_METHODS)
    for cell in result.cells:
        method = solve.METHODS[cell.method]
        direct = estimate(LLAMA8, setup.replace(seq_len=cell.seq_len, micro_batch_size=cell.micro_batch_size,
                                                **method.fields), hw)
        assert cell.total_bytes == direct.total_bytes
        assert cell.fits == diagnose(direct, hw).fits
    assert result.any_fits and not all(c.fits for c in result.cells)
    rows = list(csv.DictReader(io.StringIO(result.to_csv())))
    assert len(rows) == len(result.cells)
    assert [int(r["total_bytes"]) for r in rows] == [c.total_bytes for c in result.cells]
    assert [r["fits"] == "yes" for r in rows] == [c.fits for c in result.cells]
    md = result.to_markdown().splitlines()
    assert md[2] == "| seq | micro-batch | " + " | ".join(m.title for m in result.methods) + " |"
    assert sum(line.startswith("| 1024 |") or line.startswith("| 2048 |") for line in md) == 6
    assert any("LoRA / QLoRA" in note for note in result.notes)


def test_sweep_methods_are_pluggable():
    calls = []

    def halve_vocab(spec, setup):
        calls.append(setup.seq_len)
        return dataclasses.replace(spec, vocab_size=spec.vocab_size // 2), setup

    custom = solve.Method("half-vocab", "toy method", {"precision": "bf16"}, transform=halve_vocab)
    hw = make_hardware("H100")
    result = solve.sweep(LLAMA8, TrainingSetup(), hw, seqs=[512], batches=[1], methods=[custom])
    direct = estimate(dataclasses.replace(LLAMA8, vocab_size=LLAMA8.vocab_size // 2),
                      TrainingSetup(seq_len=512, micro_batch_size=1, precision="bf16"), hw)
    assert calls == [512] and result.cells[0].total_bytes == direct.total_bytes
    with pytest.raises(ConfigError, match="unknown method 'dora'"):
        solve.get_methods("full-bf16-adamw,dora")
    t4 = solve.sweep(LLAMA8, TrainingSetup(precision="amp-fp16"), make_hardware("T4"), seqs=[512], batches=[1],
                     methods="setup,full-bf16-adamw")
    assert t4.cells[0].total_bytes is not None and t4.cells[1].total_bytes is None and "bf16" in t4.cells[1].note


# ------------------------------------------------------------------------------------------------------- the CLI


def invoke(*args):
    return CliRunner(env=NARROW).invoke(app, list(args))


def test_cli_max_batch_json_matches_the_library():
    result = invoke("fit", "llama-3.1-8b", "--gpu", "A100-80GB", "--max", "batch", "--precision", "bf16",
                    "--optimizer", "adamw-8bit", "--checkpointing", "full", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    setup = TrainingSetup(seq_len=2048, precision="bf16", optimizer="adamw-8bit", checkpointing="full")
    expected = solve.max_micro_batch(LLAMA8, setup, make_hardware("A100-80GB"))
    assert data["result"]["value"] == expected.value and data["fits"] is True
    assert data["result"]["best"]["total_bytes"] == expected.best.total_bytes
    assert not any("micro-batch 8" in note for note in data["notes"])  # searched, not assumed


@pytest.mark.parametrize("quantity,solver,key", [
    ("batch", solve.max_micro_batch, "value"), ("seq", solve.max_seq_len, "value"),
    ("gpus", solve.fewest_gpus, "value"), ("gpu", solve.cheapest_gpu, "gpu")])
def test_cli_max_each_quantity_is_the_library_answer(quantity, solver, key):
    flags = ("-b", "1", "--precision", "bf16", "--optimizer", "adamw-8bit", "--checkpointing", "full")
    spec = resolve_model("llama-3.2-1b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, precision="bf16", optimizer="adamw-8bit",
                          checkpointing="full")
    expected = solver(spec, setup, make_hardware("L4"))
    value = expected.gpu.name if key == "gpu" else expected.value
    result = invoke("fit", "llama-3.2-1b", "--gpu", "L4", "--max", quantity, *flags, "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert json.loads(result.stdout)["result"][key] == value
    text = invoke("fit", "llama-3.2-1b", "--gpu", "L4", "--max", quantity, *flags)
    assert text.exit_code == 0 and expected.text().split(":")[0] in text.stdout and "held fixed:" in text.stdout


def test_cli_max_nothing_fits_exits_1():
    result = invoke("fit", "llama-3.1-8b", "--gpu", "1GiB", "--max", "batch")
    assert result.exit_code == 1 and "no micro-batch fits" in result.stdout and result.stderr == ""


def test_cli_sweep_writes_csv_and_markdown(tmp_path):
    out_csv, out_md = tmp_path / "s.csv", tmp_path / "s.md"
    result = invoke("fit", "llama-3.1-8b", "--gpu", "H100", "--sweep", "--seqs", "1024,2048",
                    "--batches", "1,2,4,8", "--csv", str(out_csv), "--markdown", str(out_md))
    assert result.exit_code == 0, result.output
    expected = solve.sweep(LLAMA8, TrainingSetup(), make_hardware("H100"), seqs=[1024, 2048], batches=[1, 2, 4, 8])
    assert out_csv.read_text() == expected.to_csv() and out_md.read_text() == expected.to_markdown()
    assert "LoRA / QLoRA" in result.stdout and "full bf16 + AdamW" in result.stdout
    as_md = invoke("fit", "llama-3.1-8b", "--gpu", "H100", "--sweep", "--seqs", "1024,2048", "--batches", "1,2,4,8",
                   "--format", "markdown")
    assert as_md.stdout == expected.to_markdown()


def test_cli_sweep_nothing_fits_is_one_line_and_writes_nothing(tmp_path):
    out_csv = tmp_path / "s.csv"
    result = invoke("fit", "llama-2-70b", "--gpu", "T4", "--sweep", "--seqs", "4096", "--batches", "8",
                    "--methods", "setup", "--precision", "amp-fp16", "--csv", str(out_csv))
    assert result.exit_code == 2 and result.stdout == "" and not out_csv.exists()
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no point of the sweep fits on T4"), result.stderr


@pytest.mark.parametrize("args", [
    ("fit", "llama-3.1-8b"),
    ("fit", "llama-3.1-8b", "--max", "batch", "--sweep"),
    ("fit", "llama-3.1-8b", "--max", "bogus"),
    ("fit", "llama-3.1-8b", "--max", "gpu", "--step", "2"),
    ("fit", "llama-3.1-8b", "--max", "batch", "--csv", "x.csv"),
    ("fit", "llama-3.1-8b", "--sweep", "--seqs", "0,1"),
    ("fit", "llama-3.1-8b", "--sweep", "--methods", "dora"),
])
def test_cli_mistakes_are_one_line_exit_2(args):
    result = invoke(*args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_sweep_has_lora_and_qlora_columns_sized_as_plans_size_them():
    hw = make_hardware("RTX-4090")
    result = solve.sweep(LLAMA8, TrainingSetup(), hw, seqs=[1024, 4096], batches=[1, 4])
    keys = [m.key for m in result.methods]
    assert keys == ["full-bf16-adamw", "full-bf16-adamw8bit-ckpt", "lora-ckpt", "qlora-ckpt"]
    for cell in result.cells:
        method = solve.METHODS[cell.method]
        direct = estimate(LLAMA8, TrainingSetup(seq_len=cell.seq_len, micro_batch_size=cell.micro_batch_size)
                          .replace(**method.fields), hw)
        assert cell.total_bytes == direct.total_bytes
    by = {(c.seq_len, c.micro_batch_size, c.method): c for c in result.cells}
    assert by[(1024, 1, "qlora-ckpt")].fits and not by[(1024, 1, "full-bf16-adamw")].fits
    assert by[(1024, 1, "qlora-ckpt")].total_bytes < by[(1024, 1, "lora-ckpt")].total_bytes


def test_sweep_html_is_one_offline_page_with_a_heat_map_per_method(tmp_path):
    pytest.importorskip("plotly")
    out = tmp_path / "sweep.html"
    result = invoke("fit", "llama-3.1-8b", "--gpu", "RTX-4090", "--sweep", "--seqs", "1024,4096", "--batches",
                    "1,4", "--html", str(out))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "<script src" not in page and "<link" not in page  # plotly.js inlined: opens offline
    assert all(f'"name":"{key}"' in page for key in solve.DEFAULT_METHODS)  # one heat map trace per method
    sweep = solve.sweep(LLAMA8, TrainingSetup(), make_hardware("RTX-4090"), seqs=[1024, 4096], batches=[1, 4])
    from memfit.report.figures import sweep_figure

    figure = sweep_figure(sweep)
    for trace, method in zip(figure.data, sweep.methods):  # each cell's text is its GiB, "no" when it does not fit
        for row, seq in zip(trace.text, sweep.seqs):
            for text, batch in zip(row, sweep.batches):
                cell = sweep.cell(seq, batch, method.key)
                assert text == f"{cell.total_bytes / 2**30:.1f}" + ("" if cell.fits else " no")
    assert invoke("fit", "llama-3.1-8b", "--max", "batch", "--html", str(out)).exit_code == 2
