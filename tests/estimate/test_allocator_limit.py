"""The caching allocator near the device limit: a failed cudaMalloc makes PyTorch's allocator free its cached
segments and retry before it raises OOM (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc), so a
step runs on less than it reserves with room to spare. memfit.estimate.allocator.least_capacity finds that least
capacity; memfit.diagnose judges fits on it and still reports the reserve with room."""

from __future__ import annotations

import pytest

from memfit.diagnose import diagnose
from memfit.estimate import allocator as al
from memfit.estimate.allocator import FREE, AllocatorConfig, least_capacity, replay
from memfit.estimate.analytic import estimate
from memfit.estimate.result import Category, MemoryEstimate, Phase, Term
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

MiB, GiB = al.MiB, 2**30
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_a_cached_free_segment_is_released_and_the_request_retried():
    """300 MiB freed whole stays cached (reserved 650 MiB with room); at the limit release_cached_blocks frees it
    and the 350 MiB cudaMalloc is retried: 350 MiB is enough, 348 is not."""
    events = [("a", 300 * MiB), ("a", FREE), ("b", 350 * MiB)]
    assert replay(events).peak_reserved == 650 * MiB
    assert least_capacity(events) == 350 * MiB
    assert not replay(events, capacity=350 * MiB).oom and replay(events, capacity=348 * MiB).oom
    assert replay(events, capacity=350 * MiB).released == 1


def test_a_split_segment_partly_in_use_cannot_be_released():
    """The freed 300 MiB serves 200 MiB and keeps a 100 MiB free rest in the same segment: only blocks "not split"
    are freed, so the 150 MiB request needs a segment beside it and the step needs all it reserves."""
    events = [("a", 300 * MiB), ("b", 4 * MiB), ("a", FREE), ("c", 200 * MiB), ("d", 150 * MiB)]
    assert replay(events).peak_allocated == 354 * MiB
    assert least_capacity(events) == replay(events).peak_reserved == 470 * MiB


def test_max_split_size_releases_oversize_segments_first():
    """With max_split_size the freed 300 MiB block is oversize: never split for the 200 MiB request (a segment of
    its own) and released first (release_available_cached_blocks) when the 150 MiB one does not fit."""
    config = AllocatorConfig(max_split_size=100 * MiB)
    events = [("a", 300 * MiB), ("b", 4 * MiB), ("a", FREE), ("c", 200 * MiB), ("d", 150 * MiB)]
    assert replay(events, config).peak_reserved == 670 * MiB
    least = least_capacity(events, config)
    assert least == 370 * MiB  # 20 MiB (b's segment) + 200 + 150: the cached 300 MiB is gone
    assert not replay(events, config, capacity=least).oom and replay(events, config, capacity=least - 2 * MiB).oom


def test_expandable_segments_need_only_the_pages_under_live_blocks():
    """Expandable segments unmap every free page at the limit (unmap_block); the pages that hold a live block stay:
    350 MiB live spans 18 pages of 20 MiB."""
    events = [("a", 300 * MiB), ("b", 4 * MiB), ("a", FREE), ("c", 200 * MiB), ("d", 150 * MiB)]
    assert least_capacity(events, EXPANDABLE) == 360 * MiB < replay(events, EXPANDABLE).peak_reserved
    assert least_capacity([("a", 1000), ("b", 3000)], EXPANDABLE) == 2 * MiB  # one small-pool page


def _traced_step(batches: tuple[int, ...]) -> list:
    """A 4-block MLP's steps (forward, backward, AdamW foreach), recorded by memfit's tracker on fake tensors: the
    event stream a trace replays. The second batch is shorter, so the first one's freed segments stay cached."""
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.trace.tracker import StepTracker

    tracker = StepTracker()
    with FakeTensorMode():
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                                for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        with tracker:
            for batch in batches:
                model(torch.randn(batch, 1024)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return tracker.allocation_events


def test_least_capacity_of_a_traced_step_is_the_least_any_capacity_survives():
    """On a real traced stream the search's answer is the first capacity (2 MiB steps up from the peak allocated)
    that the replay with the release-and-retry rule survives, and every larger one survives too."""
    events = _traced_step((768, 384))
    free_run = replay(events)
    least = least_capacity(events)
    assert free_run.peak_allocated <= least < free_run.peak_reserved  # the retry saves the cache of step 1
    capacities = range((free_run.peak_allocated - 1) // (2 * MiB) * 2 * MiB, free_run.peak_reserved + 1, 2 * MiB)
    survives = [not replay(events, capacity=c).oom for c in capacities]
    first = capacities[survives.index(True)]
    assert first == least and all(survives[survives.index(True):])


def _tight(reserve: int, at_limit: int | None, budget: int) -> MemoryEstimate:
    return MemoryEstimate(terms=(
        Term("parameters", Category.PARAMETERS, budget - 3 * GiB),
        Term("overhead/allocator_reserve", Category.OVERHEAD, reserve, figure="reserved", at_limit=at_limit),
        Term("overhead/cuda_context", Category.OVERHEAD, GiB, figure="outside")), peak_phase=Phase.FORWARD,
        method="analytic")


def test_the_verdict_is_decided_at_the_limit_and_the_reserve_with_room_still_reported():
    hw = make_hardware("A100-80GB")
    budget = int(hw.gpu.memory_bytes * 0.95)
    # 3 GiB of reserve puts it over the budget with room; at the limit only 1 GiB of it is needed
    d = diagnose(_tight(3 * GiB, GiB, budget), hw)
    assert d.fits and d.fits_by_retry
    assert d.reserved_bytes == budget  # what max_memory_reserved shows with room: reported unchanged
    assert d.with_room_bytes == budget + GiB and d.required_bytes == d.at_limit_bytes == budget - GiB
    assert "frees its cached segments and retries" in d.summary()
    assert d.to_dict()["with_room_bytes"] == budget + GiB
    # over even at the limit: does not fit, judged and reported on the reserve with room
    over = diagnose(_tight(6 * GiB, 5 * GiB, budget), hw)
    assert not over.fits and not over.fits_by_retry and over.required_bytes == budget + 4 * GiB
    # a reserve with no figure at the limit (a measured step's) is taken whole
    assert not diagnose(_tight(3 * GiB, None, budget), hw).fits
    # within the budget with room: nothing changes, and the JSON has no new key
    calm = diagnose(_tight(GiB, 0, budget), hw)
    assert calm.fits and not calm.fits_by_retry and "with_room_bytes" not in calm.to_dict()


def test_an_estimate_carries_its_reserve_at_the_limit():
    est = estimate(resolve_model("llama-3.1-8b"), TrainingSetup(micro_batch_size=2, seq_len=2048),
                   make_hardware("A100-80GB"))
    reserve = est.term("overhead/allocator_reserve")
    assert reserve.at_limit is not None and 0 <= reserve.at_limit_bytes() <= reserve.num_bytes
    assert "at_limit" not in reserve.to_dict()  # a verdict figure, not a term of the JSON
