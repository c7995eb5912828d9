"""The device side: the caching-allocator replay against hand-worked cases of the allocator's documented rules, and
the three labelled figures (allocated <= reserved <= device used) through the estimate, JSON and the fit verdict."""

from __future__ import annotations

import json
import time

import pytest

from memfit.diagnose import diagnose
from memfit.estimate import allocator as al
from memfit.estimate.allocator import FREE, AllocatorConfig, replay, round_size, segment_size
from memfit.estimate.analytic import estimate
from memfit.estimate.result import Category, MemoryEstimate, Phase, Term
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import Precision, TrainingSetup
from memfit.sources import resolve_model

MiB = 2**20


def test_round_size_and_segment_size_follow_the_allocator_constants():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert round_size(1_000_000) == 1_000_448  # next multiple of 512
    # roundup_power2_divisions:4 -> 1 MiB..2 MiB in 256 KiB steps; powers of two are kept
    assert round_size(1 * MiB + 1, 4) == 1 * MiB + 256 * 1024
    assert round_size(4 * MiB, 4) == 4 * MiB
    assert segment_size(512) == 2 * MiB and segment_size(1 * MiB) == 2 * MiB  # small pool
    assert segment_size(1 * MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_one_2mib_segment():
    r = replay([(i, 1000) for i in range(4)])
    assert r.peak_requested == 4000 and r.peak_allocated == 4 * 1024 and r.peak_reserved == 2 * MiB
    assert r.segments == 1


def test_a_mid_size_request_splits_a_20mib_segment_and_the_rest_serves_the_next():
    r = replay([("a", 3 * MiB), ("b", 5 * MiB), ("c", 11 * MiB)])
    # a and b fit one 20 MiB segment (12 MiB left, split); c (11 MiB) best-fits the 12 MiB remainder: split leaves
    # 1 MiB, not more than kSmallSize, so the whole 12 MiB block is handed out and counts as allocated
    assert r.peak_reserved == 20 * MiB and r.segments == 1
    assert r.peak_allocated == 20 * MiB and r.peak_requested == 19 * MiB


def test_freed_blocks_stay_reserved_and_merge_with_free_neighbours():
    events = [("a", 4 * MiB), ("b", 4 * MiB), ("a", FREE), ("b", FREE), ("c", 8 * MiB)]
    r = replay(events)
    assert r.peak_reserved == 20 * MiB and r.segments == 1  # c reuses a+b merged, no new cudaMalloc
    # a: its own 12 MiB segment (>= 10 MiB); b: 2 of a 20 MiB segment; c (13 MiB) cannot use a's freed 12 MiB
    # but best-fits b's 18 MiB remainder (split: 5 MiB > 1 MiB left): no third segment
    r = replay([("a", 12 * MiB), ("b", 2 * MiB), ("a", FREE), ("c", 13 * MiB)])
    assert r.peak_reserved == 32 * MiB and r.segments == 2


def test_best_fit_picks_the_smallest_cached_block():
    events = [("big", 40 * MiB), ("small", 12 * MiB), ("big", FREE), ("small", FREE), ("x", 12 * MiB)]
    allocator = al.CachingAllocator()
    blocks = {}
    for key, size in events:
        if size == FREE:
            allocator.free(blocks.pop(key))
        else:
            blocks[key] = allocator.malloc(size)
    assert blocks["x"].size == 12 * MiB and allocator.reserved == 52 * MiB


def test_fragmentation_makes_reserved_exceed_allocated():
    # 10 x 12 MiB, free every other one, then 10 MiB + ... a 24 MiB request cannot use the 12 MiB holes
    events = [(i, 12 * MiB) for i in range(10)] + [(i, FREE) for i in range(0, 10, 2)] + [("big", 24 * MiB)]
    r = replay(events)
    assert r.peak_reserved == 10 * 12 * MiB + 24 * MiB
    assert r.peak_allocated == 10 * 12 * MiB  # the peak was before the frees
    assert r.peak_reserved - r.peak_allocated == 24 * MiB


def test_capacity_releases_whole_free_segments_before_oom():
    events = [("a", 40 * MiB), ("a", FREE), ("b", 60 * MiB)]
    assert replay(events).peak_reserved == 100 * MiB
    limited = replay(events, capacity=64 * MiB)
    assert limited.released == 1 and limited.peak_reserved == 60 * MiB and not limited.oom
    assert replay([("a", 40 * MiB), ("b", 60 * MiB)], capacity=64 * MiB).oom


def test_max_split_size_keeps_oversize_blocks_whole():
    events = [("a", 100 * MiB), ("a", FREE), ("b", 30 * MiB)]
    assert replay(events).peak_reserved == 100 * MiB  # split and reused by default
    config = AllocatorConfig(max_split_size=64 * MiB)
    assert replay(events, config).peak_reserved == 130 * MiB  # an oversize block is not handed to a smaller request


def test_expandable_segments_grow_in_pages_and_avoid_the_holes():
    events = [(i, 12 * MiB) for i in range(10)] + [(i, FREE) for i in range(0, 10, 2)] + [("big", 24 * MiB)]
    r = replay(events, AllocatorConfig(expandable_segments=True))
    # the ten 12 MiB blocks tile six 20 MiB pages exactly; the 24 MiB request maps two more at the end
    assert r.peak_reserved == 160 * MiB and r.peak_allocated == 120 * MiB
    steady = [(i, 12 * MiB) for i in range(10)] + [(i, FREE) for i in range(10)] + [("x", 30 * MiB)]
    assert replay(steady, AllocatorConfig(expandable_segments=True)).peak_reserved == 120 * MiB  # merged, reused
    assert replay(steady).peak_reserved == 150 * MiB  # ten separate 12 MiB segments cannot merge
    small = replay([(i, 1000) for i in range(3)], AllocatorConfig(expandable_segments=True))
    assert small.peak_reserved == 2 * MiB


def _est(model="llama-3.2-3b", gpu="A100-80GB", **setup):
    spec = resolve_model(model)
    s = TrainingSetup(**{"micro_batch_size": 1, "seq_len": 1024, "precision": Precision.BF16, **setup})
    hw = make_hardware(gpu, gpus_per_node=s.num_gpus)
    return estimate(spec, s, hw), hw


def test_three_figures_are_ordered_and_add_up_to_the_total():
    est, _ = _est()
    figures = est.device_figures()
    assert est.tensor_bytes < figures["allocated"] <= figures["reserved"] < figures["device_used"]
    assert figures["device_used"] == est.total_bytes
    assert est.term("overhead/cuda_context").device_figure == "outside"
    assert est.term("overhead/allocator_reserve").device_figure == "reserved"
    assert est.term("overhead/cublas_workspace").num_bytes == 2 * (4096 * 2 + 16 * 8) * 1024  # pre-Hopper default
    hopper, _ = _est(gpu="H100")
    assert hopper.term("overhead/cublas_workspace").num_bytes == 2 * 32 * MiB
    multi, _ = _est(num_gpus=8)
    assert multi.term("overhead/nccl").num_bytes == 32 * 2 * (4 * MiB + 512 * 1024 + 4_915_200)


def test_cpu_device_has_no_device_terms():
    spec = resolve_model("llama-3.2-3b")
    est = estimate(spec, TrainingSetup(micro_batch_size=1, seq_len=256), make_hardware(cpu_device(512 * 2**30)))
    assert est.total_bytes == est.tensor_bytes == est.allocated_bytes == est.reserved_bytes


def test_context_depends_on_module_loading():
    lazy = make_hardware("A100-80GB").device.cuda_context_bytes
    legacy = make_hardware("A100-80GB", cuda_runtime="legacy").device.cuda_context_bytes
    assert 300 * MiB < lazy < legacy


def test_expandable_segments_lower_or_keep_the_reserve():
    spec = resolve_model("bert-large-uncased")
    s = TrainingSetup(micro_batch_size=4, seq_len=512)
    plain = estimate(spec, s, make_hardware("V100-16GB"))
    expandable = estimate(spec, s, make_hardware("V100-16GB", expandable_segments=True))
    assert expandable.reserved_bytes <= plain.reserved_bytes
    assert expandable.tensor_bytes == plain.tensor_bytes


def test_json_carries_the_three_figures():
    est, _ = _est()
    data = json.loads(json.dumps(est.to_dict()))
    dm = data["device_memory"]
    assert dm["allocated"] <= dm["reserved"] <= dm["device_used"] == data["total_bytes"]
    assert "max_memory_reserved" in dm["metrics"]["reserved"] and "nvidia-smi" in dm["metrics"]["device_used"]
    assert {t["figure"] for t in data["terms"]} == {"allocated", "reserved", "outside"}


def test_fit_verdict_uses_reserved_plus_outside():
    est, hw = _est()
    d = diagnose(est, hw)
    assert d.required_bytes == est.reserved_bytes + est.outside_allocator_bytes == est.device_used_bytes
    # a step whose allocated figure fits the budget but whose reserved + context does not: it does not fit
    budget = int(hw.gpu.memory_bytes * 0.95)
    terms = (Term("parameters", Category.PARAMETERS, budget - 2 * 2**30),
             Term("overhead/allocator_reserve", Category.OVERHEAD, 2 * 2**30, figure="reserved"),
             Term("overhead/cuda_context", Category.OVERHEAD, 2**30, figure="outside"))
    tight = MemoryEstimate(terms=terms, peak_phase=Phase.FORWARD, method="analytic")
    assert tight.allocated_bytes < budget and not diagnose(tight, hw).fits


def test_traced_stream_is_exposed_and_replays():
    torch = pytest.importorskip("torch")
    from memfit.trace.tracker import StepTracker

    tracker = StepTracker()
    with tracker:
        tracker.mark("forward")
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        b = torch.empty(1000, dtype=torch.uint8)
        del a
        c = torch.empty(2 * MiB, dtype=torch.uint8)
    events = tracker.allocation_events
    sizes = [n for _, n in events if n != FREE]
    assert 3 * MiB in sizes and 1000 in sizes and 2 * MiB in sizes and FREE in [n for _, n in events]
    r = replay(events)
    assert r.peak_requested == 3 * MiB + 1000 and r.peak_reserved == 20 * MiB + 2 * MiB
    del b, c


def test_formula_replay_is_fast_for_70b():
    spec = resolve_model("llama-3.1-70b")
    hw = make_hardware("H100")
    s = TrainingSetup(micro_batch_size=1, seq_len=4096, precision=Precision.BF16)
    from memfit.estimate import device

    device._replayed.cache_clear()
    start = time.perf_counter()
    est = estimate(spec, s, hw)
    assert time.perf_counter() - start < 0.5
    assert est.term("overhead/allocator_reserve").num_bytes >= 0
