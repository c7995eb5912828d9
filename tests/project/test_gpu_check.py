"""bench/gpu_check.py runs end to end on the CPU (the device CI has): real steps through memfit.measure, every column
written, CPU peaks within 5% of memfit's CPU prediction, and a failing case recorded without stopping the run."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")


gc_bench = load_bench("gpu_check")


def test_cpu_quick_run_writes_every_column_within_5_percent(tmp_path):
    assert gc_bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    rows = data["rows"]
    assert [r["case"] for r in rows] == [c.name for c in gc_bench.quick_cases("tiny")]
    assert {r["family"] for r in rows} == {"llama", "gpt2", "qwen2"}
    for row in rows:
        assert set(row) == set(gc_bench.COLUMNS) == set(data["columns"])
        assert row["status"] == "ok" and row["error"] is None, row
        # CPU: the profiler's peak, next to memfit's prediction for a CPU device (no overhead terms)
        assert row["measured_allocated_bytes"] > 0 and row["params"] > 0
        assert abs(row["err_allocated_pct"]) <= 5.0, row
        assert row["memfit_total_bytes"] == row["memfit_tensor_bytes"] == row["memfit_reserved_bytes"]
        for absent in ("measured_reserved_bytes", "nvml_used_bytes", "nvml_process_bytes", "err_reserved_pct",
                       "err_nvml_pct"):
            assert row[absent] is None
        assert row["measured_peak_phase"] in ("forward", "backward", "optimizer")
    assert data["info"]["device"] == "cpu" and data["info"]["size"] == "tiny"
    md = (tmp_path / "gpu_check_cpu.md").read_text()
    assert all(r["case"] in md for r in rows)
    assert not (tmp_path / "gpu_check.md").exists()  # a CPU run never overwrites GPU results


def test_a_failing_case_is_recorded_and_the_run_goes_on(tmp_path):
    too_long = gc_bench.Case("gpt2", micro_batch_size=1, seq_len=1024)  # the tiny gpt2 has 512 positions
    good = gc_bench.Case("llama", micro_batch_size=1, seq_len=32)
    rows, info = gc_bench.run_cases([too_long, good], device="cpu", size="tiny")
    failed, ok = rows
    assert failed["status"] == "failed" and failed["error"]
    assert failed["measured_allocated_bytes"] is None and failed["err_allocated_pct"] is None
    assert set(failed) == set(gc_bench.COLUMNS)
    assert ok["status"] == "ok" and abs(ok["err_allocated_pct"]) <= 5.0
    md, _ = gc_bench.write_results(rows, info, tmp_path)
    text = md.read_text()
    assert "1 failed" in text and "## Failed cases" in text and too_long.name in text


def test_full_matrix_covers_the_requested_axes():
    cases = gc_bench.full_matrix("small")
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    main = {(c.family, c.precision, c.checkpointing, c.attention, c.optimizer) for c in cases
            if (c.micro_batch_size, c.seq_len) == gc_bench.SHAPE["small"] and not c.technique
            and c.optimizer in gc_bench.OPTIMIZERS}
    assert len(main) == 3 * 3 * 2 * 2 * len(gc_bench.OPTIMIZERS)
    techniques = {(c.technique, c.checkpointing) for c in cases if c.technique}
    assert techniques == {(t, ckpt) for t in gc_bench.TECHNIQUES for ckpt in ("none", "full")}
    assert {c.setup().finetune.method.value for c in cases} >= {"full", "lora", "qlora"}
    assert any(c.optimizer == "muon" for c in cases)
    assert {c.micro_batch_size for c in cases} >= {1, 2, 4, 8, 16}
    assert {c.seq_len for c in cases} >= {128, 512, 2048}
    for case in cases:
        case.setup()  # every case is a valid TrainingSetup


def test_cuda_report_compares_each_reading_with_its_memfit_figure(tmp_path):
    """The CUDA report, rendered offline from a made-up row: allocated vs tensor, reserved vs tensor + allocator
    reserve, NVML (this process) vs the total."""
    row = dict.fromkeys(gc_bench.COLUMNS)
    mib = 2**20
    row.update(case="llama-bf16-adamw-ckpt_none-sdpa-b4-s512", family="llama", params=124_000_000, status="ok",
               seconds=1.0, measured_allocated_bytes=1000 * mib, measured_reserved_bytes=1100 * mib,
               nvml_used_bytes=2000 * mib, nvml_process_bytes=1600 * mib, memfit_tensor_bytes=1010 * mib,
               memfit_reserved_bytes=1060 * mib, memfit_total_bytes=1572 * mib, measured_peak_phase="backward",
               memfit_peak_phase="backward")
    row["err_allocated_pct"] = gc_bench._pct(row["memfit_tensor_bytes"], row["measured_allocated_bytes"])
    info = {"device": "cuda", "name": "NVIDIA H200", "torch": "2.x", "size": "small", "steps": 2,
            "cuda_context_bytes": 520 * mib, "memfit_cuda_context_bytes": 512 * mib, "nvml": "pynvml"}
    md, js = gc_bench.write_results([row], info, tmp_path)
    assert md.name == "gpu_check.md" and js.name == "gpu_check.json"
    text = md.read_text()
    assert "CUDA context of this process" in text and "520.0 MiB" in text
    assert "allocated (max_memory_allocated" in text and "reserved (max_memory_reserved)" in text
    assert "| 1000.0 | 1100.0 | 1600.0 | 1010.0 | 1060.0 | 1572.0 | +1.0 |" in text


@pytest.mark.parametrize("case", [gc_bench.Case("llama", "amp-bf16", "adamw-foreach", "full", "sdpa", 2, 64,
                                                technique="lora-r16-attn"),
                                  gc_bench.Case("llama", "bf16", "muon", "none", "sdpa", 2, 64)],
                         ids=lambda c: c.name)
def test_technique_cases_run_on_the_cpu_within_5_percent(case):
    rows, _ = gc_bench.run_cases([case], device="cpu", size="tiny")
    assert rows[0]["status"] == "ok", rows[0]["error"]
    assert abs(rows[0]["err_allocated_pct"]) <= 5.0 and rows[0]["technique"] == (case.technique or None)


def test_max_seconds_stops_starting_cases_and_still_writes_the_results(tmp_path):
    cases = [gc_bench.Case("llama", micro_batch_size=1, seq_len=16), gc_bench.Case("gpt2", micro_batch_size=1,
                                                                                   seq_len=16)]
    rows, info = gc_bench.run_cases(cases, device="cpu", size="tiny", max_seconds=0.0)
    assert [r["case"] for r in rows] == [cases[0].name] and info["not_run"] == [cases[1].name]
    md, _ = gc_bench.write_results(rows, info, tmp_path)
    assert "1 not started (--max-seconds)" in md.read_text()
