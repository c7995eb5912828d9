"""A replay of PyTorch's CUDA caching allocator: a stream of (allocate, free) events in, peak allocated and peak
reserved bytes out. Pure Python, no torch.

The rules are those of c10/cuda/CUDACachingAllocator.cpp (constants in c10/core/AllocatorConfig.h), one stream:

- every request is rounded up to a multiple of 512 B (kMinBlockSize); with `roundup_power2_divisions` = d > 1, a
  request above d x 512 B is rounded up to the next of d equal steps between two powers of two instead;
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB (kSmallBuffer); larger
  ones from the large pool: a request under 10 MiB (kMinLargeAlloc) that no cached block serves gets a 20 MiB
  segment (kLargeBuffer), a larger one a segment of its own rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest cached free block that fits (best fit: by size, then address);
- the block is split when the remainder is >= 512 B (small pool, or expandable segments) or > 1 MiB (large pool);
  otherwise the whole block is handed out and its slack counts as allocated (`max_memory_allocated` sums block
  sizes, not requests);
- `max_split_size_mb`: blocks of at least that size are never split, are not used for smaller requests, and serve
  a larger one only within `max_non_split_rounding_mb` (20 MiB) of its size;
- a freed block merges with free neighbours of the same segment and stays cached: reserved never shrinks unless a
  new segment would not fit the device, when every cached segment with no block in use is released (cudaFree)
  and the request retried (release_cached_blocks);
- `expandable_segments:True`: one segment per pool that grows by mapping pages at its end (2 MiB pages for the
  small pool, 20 MiB for the large one, per the allocator's "Expandable Segments" note), blocks split down to
  512 B.

Requested bytes (`peak_requested`) are the sum of live request sizes: what memfit's tensor terms count.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: below this a large request gets a kLargeBuffer segment
LARGE_BUFFER = 20 * MiB  # kLargeBuffer (large_segment_size default)
ROUND_LARGE = 2 * MiB  # kRoundLarge
MAX_NON_SPLIT_ROUNDING = 20 * MiB  # max_non_split_rounding_mb default
EXPANDABLE_PAGE = {True: 2 * MiB, False: 20 * MiB}  # expandable segment page size: small pool, large pool
SOURCE = "PyTorch c10/cuda/CUDACachingAllocator.cpp, c10/core/AllocatorConfig.h"
FREE = -1
"""An event (key, FREE) frees the block allocated under `key`; (key, n >= 0) allocates n bytes under it."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF options that change the numbers."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    """Bytes (max_split_size_mb x 2**20); None = unlimited, the default."""
    roundup_power2_divisions: int = 0
    """One division count for every size (the per-interval list form is not modelled); 0 or 1 = off, the default."""
    max_non_split_rounding: int = MAX_NON_SPLIT_ROUNDING

    def describe(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.roundup_power2_divisions > 1:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        return ",".join(parts) or "defaults"


@dataclass(frozen=True)
class ReplayResult:
    peak_requested: int
    """Peak of the live request sizes."""
    peak_allocated: int
    """torch.cuda.max_memory_allocated: peak of the live block sizes."""
    peak_reserved: int
    """torch.cuda.max_memory_reserved: peak of the segments held."""
    segments: int
    """cudaMalloc calls (or page mappings with expandable segments)."""
    released: int
    """Segments released to fit the capacity (cudaFree retries)."""
    oom: bool
    """A request could not be served within the capacity even after releasing the cache."""
    events: int
    peak_mapped_live: int = 0
    """Expandable segments: peak bytes of the pages under live blocks (what no release can unmap)."""


def round_size(size: int, divisions: int = 0) -> int:
    """The allocator's round_size: 512 B multiples, or power-of-two divisions when configured."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """get_allocation_size: the cudaMalloc made for a rounded request no cached block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "requested", "allocated", "prev", "next", "small", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: int) -> None:
        self.addr, self.size, self.small, self.segment = addr, size, small, segment
        self.requested = 0
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class CachingAllocator:
    """One device, one stream. `malloc(n)` returns a handle for `free`. `capacity` (bytes the allocator may reserve)
    turns on the release-and-retry path; None = unlimited."""

    def __init__(self, config: AllocatorConfig | None = None, capacity: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.capacity = capacity
        self._free = {True: [], False: []}  # pool -> sorted [(size, addr)]
        self._by_key: dict[tuple[bool, int, int], _Block] = {}
        self._next_addr = 1 << 40
        self._segments = 0
        self._expand = {True: None, False: None}  # expandable: pool -> (base, mapped bytes, last block)
        self.requested = self.allocated = self.reserved = 0
        self.peak_requested = self.peak_allocated = self.peak_reserved = 0
        self.cuda_mallocs = 0
        self.released = 0
        self.oom = False
        self._pages: dict[tuple[bool, int], int] = {}  # expandable: (pool, page) -> live blocks on it
        self.mapped_live = self.peak_mapped_live = 0

    # ---- pool bookkeeping ------------------------------------------------------------------------------------

    def _insert(self, block: _Block) -> None:
        key = (block.size, block.addr)
        insort(self._free[block.small], key)
        self._by_key[(block.small,) + key] = block

    def _remove(self, block: _Block) -> None:
        keys = self._free[block.small]
        key = (block.size, block.addr)
        del keys[bisect_left(keys, key)]
        del self._by_key[(block.small,) + key]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        keys = self._free[small]
        i = bisect_left(keys, (size, 0))
        if i == len(keys):
            return None
        found = keys[i][0]
        limit = self.config.max_split_size
        if limit is not None and not small and not self.config.expandable_segments:
            if size < limit <= found:
                return None  # an oversize block is not handed to a smaller request
            if size >= limit and found >= size + self.config.max_non_split_rounding:
                return None
        block = self._by_key[(small,) + keys[i]]
        self._remove(block)
        return block

    def _new_segment(self, alloc: int, small: bool) -> _Block | None:
        if self.capacity is not None and self.reserved + alloc > self.capacity:
            if self.config.max_split_size is not None:
                self._release_oversize(alloc)
            if self.reserved + alloc > self.capacity:
                self._release_cached()
            if self.reserved + alloc > self.capacity:
                self.oom = True  # counted anyway: the figures say how far over it goes
        addr = self._next_addr
        self._next_addr += alloc + (1 << 30)
        self._segments += 1
        self.cuda_mallocs += 1
        self.reserved += alloc
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(addr, alloc, small, self._segments)

    def _release_oversize(self, alloc: int) -> None:
        """release_available_cached_blocks (only with max_split_size): cudaFree cached oversize segments (at least
        max_split_size, never split) before anything else: the smallest one that covers the new segment, else the
        largest ones until they do."""
        limit = self.config.max_split_size
        oversize = [self._by_key[(False, size, addr)] for size, addr in self._free[False] if size >= limit]
        oversize = [block for block in oversize if self._whole(block)]  # by size, then address
        need = self.reserved + alloc - self.capacity
        cover = [b for b in oversize if b.size >= need]
        for block in cover[:1] or reversed(oversize):
            if need <= 0:
                break
            self._remove(block)
            self.reserved -= block.size
            self.released += 1
            need -= block.size

    def _whole(self, block: _Block) -> bool:
        return block.prev is None and block.next is None and self._expand[block.small] is None

    def _release_cached(self) -> None:
        """release_cached_blocks: cudaFree every cached segment that has no block in use (one whole free block)."""
        for small in (True, False):
            for size, addr in list(self._free[small]):
                block = self._by_key[(small, size, addr)]
                if block.prev is None and block.next is None and self._expand[small] is None:
                    self._remove(block)
                    self.reserved -= block.size
                    self.released += 1

    def _grow_expandable(self, size: int, small: bool) -> _Block:
        """Map pages at the end of the pool's one segment until its free tail holds `size`."""
        page = EXPANDABLE_PAGE[small]
        state = self._expand[small]
        if state is None:
            base = self._next_addr
            self._next_addr += 1 << 44
            self._segments += 1
            state = self._expand[small] = [base, 0, None]
        base, mapped, last = state
        tail = last if last is not None and not last.allocated else None
        have = tail.size if tail is not None else 0
        grow = -(-(size - have) // page) * page
        if self.capacity is not None and self.reserved + grow > self.capacity:
            self.oom = True
        self.cuda_mallocs += 1
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if tail is not None:
            self._remove(tail)
            tail.size += grow
            block = tail
        else:
            block = _Block(base + mapped, grow, small, 0)
            block.prev = last
            if last is not None:
                last.next = block
        state[1] = mapped + grow
        state[2] = block
        return block

    # ---- the two calls -----------------------------------------------------------------------------------------

    def malloc(self, orig: int) -> _Block:
        config = self.config
        size = round_size(orig, config.roundup_power2_divisions)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            if config.expandable_segments:
                block = self._grow_expandable(size, small)
            else:
                block = self._new_segment(segment_size(size), small)
        remaining = block.size - size
        if small or config.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = remaining > SMALL_SIZE and (config.max_split_size is None or size < config.max_split_size)
        if split:
            rest = _Block(block.addr + size, remaining, small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            state = self._expand[small]
            if state is not None and state[2] is block:
                state[2] = rest
            self._insert(rest)
        block.allocated = True
        block.requested = orig
        if config.expandable_segments:
            self._count_pages(block, 1)
        self.allocated += block.size
        self.requested += orig
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block

    def _count_pages(self, block: _Block, step: int) -> None:
        """Expandable segments: the pages a live block lies on, which no release can unmap."""
        page = EXPANDABLE_PAGE[block.small]
        pages = self._pages
        start = block.addr - self._expand[block.small][0]  # pages are counted from the segment's base
        for index in range(start // page, (start + block.size - 1) // page + 1):
            key = (block.small, index)
            count = pages.get(key, 0) + step
            if count:
                pages[key] = count
            else:
                del pages[key]
            if count == step == 1:
                self.mapped_live += page
            elif count == 0:
                self.mapped_live -= page
        if self.mapped_live > self.peak_mapped_live:
            self.peak_mapped_live = self.mapped_live

    def free(self, block: _Block) -> None:
        block.allocated = False
        if self.config.expandable_segments:
            self._count_pages(block, -1)
        self.allocated -= block.size
        self.requested -= block.requested
        state = self._expand[block.small]
        for other in (block.prev, block.next):
            if other is None or other.allocated:
                continue
            self._remove(other)
            if other is block.prev:
                block.addr = other.addr
                block.prev = other.prev
                if other.prev is not None:
                    other.prev.next = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
            if state is not None and state[2] is other:
                state[2] = block
        self._insert(block)

    def result(self, events: int = 0) -> ReplayResult:
        return ReplayResult(peak_requested=self.peak_requested, peak_allocated=self.peak_allocated,
                            peak_reserved=self.peak_reserved, segments=self.cuda_mallocs, released=self.released,
                            oom=self.oom, events=events, peak_mapped_live=self.peak_mapped_live)


def replay(events: Iterable[tuple[object, int]], config: AllocatorConfig | None = None, *,
           capacity: int | None = None) -> ReplayResult:
    """Replay (key, nbytes) allocations and (key, FREE) frees; a key may be reused once freed. Zero-byte requests
    take no block (the allocator returns a null pointer); unknown frees are ignored."""
    allocator = CachingAllocator(config, capacity)
    live: dict[object, _Block] = {}
    count = 0
    malloc, free = allocator.malloc, allocator.free
    for key, nbytes in events:
        count += 1
        if nbytes == FREE:
            block = live.pop(key, None)
            if block is not None:
                free(block)
        elif nbytes > 0:
            old = live.get(key)
            if old is not None:
                free(old)
            live[key] = malloc(nbytes)
    return allocator.result(count)


def least_capacity(events: Iterable[tuple[object, int]], config: AllocatorConfig | None = None) -> int:
    """The fewest bytes the allocator can be given (device memory less what lives outside it) and still run the
    stream without an out-of-memory error: the OOM condition, where `replay`'s peak_reserved is what it holds when
    there is room.

    When cudaMalloc fails the allocator does not raise at once (CUDACachingAllocator.cpp, DeviceCachingAllocator::
    malloc): it frees cached oversize segments (release_available_cached_blocks, with max_split_size only), then
    every cached segment with no block in use (release_cached_blocks: blocks "not split") and retries. A segment
    that is split and partly in use cannot be freed, so the step OOMs when the segments holding live blocks plus
    the new one exceed the device, which can be well under the peak it reserves with room to spare.

    Default segments: the caching layout depends on when segments are freed, so the capacity is searched (in
    2 MiB, cudaMalloc's granularity for these segment sizes) between the peak allocated and the peak reserved,
    replaying with the release-and-retry rule at each. Expandable segments: release_cached_blocks unmaps every
    free page (unmap_block) and a free block keeps its place when unmapped, so the layout is the same at any
    capacity and the answer is the peak of the pages under live blocks (2 MiB pages in the small pool, 20 MiB in
    the large one)."""
    config = config or AllocatorConfig()
    events = list(events)
    free_run = replay(events, config)
    if config.expandable_segments:
        return free_run.peak_mapped_live
    low = (free_run.peak_allocated - 1) // ROUND_LARGE  # 2 MiB units known too few: under the peak allocated
    high = -(-free_run.peak_reserved // ROUND_LARGE)  # enough: the run with room never reaches it
    while high - low > 1:
        middle = (low + high) // 2
        if replay(events, config, capacity=middle * ROUND_LARGE).oom:
            low = middle
        else:
            high = middle
    return min(high * ROUND_LARGE, free_run.peak_reserved)
