"""DeepSpeed's ZeRO knobs as the user's config sets them, and what each changes in a rank's bytes (DeepSpeed 0.19;
runtime/zero/config.py and offload_config.py for the defaults, transformers integrations/deepspeed.py for "auto").

Sized (they change what a rank holds on its GPU):

- `reduce_bucket_size` (elements): the gradient bucket ZeRO-1/2 allocates before each backward (stage_1_and_2.py
  setup_buckets, `torch.empty(reduce_bucket_size)` in the gradient-reduction dtype) and the ipg bucket ZeRO-3
  allocates at start-up (stage3.py `bucket.buffer = torch.empty(self.reduce_bucket_size)`), both only under
  `contiguous_gradients`; the contiguous gradient buffer of ZeRO-Offload.
- `overlap_comm`: ZeRO-1/2 with contiguous gradients allocates a second bucket of the same size (setup_buckets
  "double buffers", swapped on each reduce); ZeRO-3 keeps one bucket either way (it only picks the reduction stream).
  Left out, DeepSpeed turns it on at stage 3 only (config.py overlap_comm_valid): None here.
- `contiguous_gradients` (default on): off, ZeRO-1/2 and ZeRO-3 allocate no bucket (offload forces it on,
  stage_1_and_2.py `contiguous_gradients or cpu_offload`).
- `stage3_param_persistence_threshold` (elements): a ZeRO-3 parameter of at most this many elements stays whole on
  every rank (mark_persistent_parameters).
- `stage3_max_reuse_distance` (elements of the recorded trace): a ZeRO-3 parameter used again within this distance
  stays gathered from its forward into its backward (PartitionedParameterCoordinator.__params_to_release).
- `stage3_prefetch_bucket_size` and `stage3_max_live_parameters` (elements): once the trace is recorded, each fetch
  also gathers the parameters the trace uses next, whole parameters until min(prefetch bucket, max live - elements
  already gathered) is reached (partitioned_param_coordinator.py fetch_sub_module). max_live_parameters caps only
  the prefetch: nothing is released because of it. Both matter only where the reuse distance lets parameters go.
- `sub_group_size` (elements): ZeRO-3 steps its optimizer one sub-group of the rank's partition at a time; each
  sub-group's gradient is flattened and cast to fp32 for the step (stage3.py _create_fp16_sub_groups,
  _prepare_fp32_grad_for_sub_group), so the step's temporary is the largest sub-group's, not the partition's.

Recorded, no GPU bytes (the reader says so rather than dropping them):

- `allgather_bucket_size`: ZeRO-1/2 gathers the updated partitions with all_gather_into_tensor straight into the
  flat 16-bit group (runtime/utils.py all_gather_dp_groups), no bucket is allocated;
- `round_robin_gradients`: reorders which rank owns which gradients, same sizes;
- `offload_optimizer.pin_memory` / `offload_param.pin_memory` (default on): page-locked host RAM for the offloaded
  buffers; the same bytes, on the host, which the OS cannot swap out;
- `stage3_gather_16bit_weights_on_model_save`: at save time only, each module's parameters are gathered in turn
  (GatheredParameters over module.parameters(recurse=False)) and rank 0 copies them to host RAM: one module's
  16-bit parameters on the GPU beside the step's resident bytes (below its activation peak), the whole 16-bit model
  in rank 0's host RAM (engine.py _zero3_consolidated_16bit_state_dict).

Three sources, three values: the HF Trainer / accelerate fill "auto" from the model (hidden^2, 0.9 x hidden^2,
10 x hidden), which is what memfit emits and assumes when nothing is read (None here); a key the JSON leaves out takes
DeepSpeed's own default (`DEEPSPEED_DEFAULTS`: 5e8, 1e5, 1e9, 5e7 ...; a 5e8-element bf16 bucket is 1 GB per rank); a
number is used as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .errors import ConfigError

AUTO_PERSISTENCE_FACTOR = 10
"""stage3_param_persistence_threshold "auto" = 10 x hidden elements (transformers integrations/deepspeed.py)."""
AUTO_PREFETCH_FACTOR = 0.9
"""stage3_prefetch_bucket_size "auto" = int(0.9 x hidden^2) elements (transformers integrations/deepspeed.py)."""
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
"""stage3_max_reuse_distance: DeepSpeed's default, which no "auto" overrides."""
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_ALLGATHER_BUCKET_SIZE = 500_000_000
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000

_COUNTS = ("reduce_bucket_size", "param_persistence_threshold", "max_reuse_distance", "prefetch_bucket_size",
           "max_live_parameters", "allgather_bucket_size", "sub_group_size")
_SWITCHES = ("overlap_comm", "contiguous_gradients", "round_robin_gradients", "offload_pin_memory",
             "gather_16bit_weights_on_model_save")
_NONE_IS_AUTO = ("reduce_bucket_size", "param_persistence_threshold", "prefetch_bucket_size", "overlap_comm")


@dataclass(frozen=True)
class ZeroKnobs:
    """The ZeRO knobs of a DeepSpeed run; None is the HF "auto" value computed from the model (overlap_comm: None is
    DeepSpeed's own stage-dependent default)."""

    reduce_bucket_size: int | None = None
    """Elements of the gradient reduce bucket (None: "auto", hidden^2)."""
    param_persistence_threshold: int | None = None
    """ZeRO-3: parameters of at most this many elements stay whole on every rank (None: "auto", 10 x hidden)."""
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    """ZeRO-3: a parameter used again within this many trace elements stays gathered into backward."""
    prefetch_bucket_size: int | None = None
    """ZeRO-3: elements each fetch gathers ahead of use (None: "auto", 0.9 x hidden^2)."""
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    """ZeRO-3: gathered elements beyond which nothing more is prefetched."""
    allgather_bucket_size: int = DEFAULT_ALLGATHER_BUCKET_SIZE
    """ZeRO-1/2: read and emitted, no GPU bytes (all_gather_into_tensor into the flat group)."""
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    """ZeRO-3: elements of the partition stepped at a time (the step's fp32 gradient temporary)."""
    overlap_comm: bool | None = None
    """ZeRO-1/2: a second reduce bucket when on (None: DeepSpeed's default, on at stage 3 only)."""
    contiguous_gradients: bool = True
    """Off: no reduce bucket (offload turns it back on)."""
    round_robin_gradients: bool = False
    """Read and emitted, no GPU bytes."""
    offload_pin_memory: bool = True
    """Pinned host RAM for offloaded buffers (offload_optimizer / offload_param pin_memory): host only."""
    gather_16bit_weights_on_model_save: bool = False
    """ZeRO-3 save-time gather: no bytes of the training step."""

    def __post_init__(self) -> None:
        problems = []
        for name in _COUNTS:
            value = getattr(self, name)
            if value is None and name in _NONE_IS_AUTO:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a whole number of elements (>= 0)"
                                f"{' or None' if name in _NONE_IS_AUTO else ''}, got {value!r}")
        for name in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in _NONE_IS_AUTO):
                problems.append(f"{name} must be true or false, got {value!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def is_auto(self) -> bool:
        return self == ZeroKnobs()

    def reduce_bucket_elems(self, hidden_size: int) -> int:
        """The reduce bucket's elements: the set size, or "auto"'s hidden^2. Allocated whole however few elements
        are trained (stage3.py `torch.empty(self.reduce_bucket_size)`, stage_1_and_2.py setup_buckets)."""
        return hidden_size**2 if self.reduce_bucket_size is None else self.reduce_bucket_size

    def reduce_buckets(self, stage: int, offload: bool = False) -> int:
        """How many reduce buckets a rank allocates: none without contiguous gradients (offload forces them on at
        ZeRO-1/2), two at ZeRO-1/2 under overlap_comm (setup_buckets' double buffer), else one."""
        if not (self.contiguous_gradients or (offload and stage <= 2)):
            return 0
        overlap = stage >= 3 if self.overlap_comm is None else self.overlap_comm
        return 2 if overlap and stage <= 2 else 1

    def persistence_threshold(self, hidden_size: int) -> int:
        if self.param_persistence_threshold is None:
            return AUTO_PERSISTENCE_FACTOR * hidden_size
        return self.param_persistence_threshold

    def prefetch_elems(self, hidden_size: int) -> int:
        """stage3_prefetch_bucket_size in elements: the set size, or "auto"'s int(0.9 x hidden^2)."""
        if self.prefetch_bucket_size is None:
            return int(AUTO_PREFETCH_FACTOR * hidden_size * hidden_size)
        return self.prefetch_bucket_size

    def to_dict(self) -> dict:
        return asdict(self)

    def changed(self) -> dict:
        """The knobs that differ from memfit's defaults ("auto"), by field name."""
        default = ZeroKnobs()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def __str__(self) -> str:
        if self.is_auto:
            return "auto"
        names = {"reduce_bucket_size": "reduce bucket", "param_persistence_threshold": "persistence",
                 "max_reuse_distance": "reuse distance", "prefetch_bucket_size": "prefetch bucket",
                 "max_live_parameters": "max live", "allgather_bucket_size": "allgather bucket",
                 "sub_group_size": "sub-group"}
        shown = [f"{names[name]} {'auto' if value is None else f'{value:,}'}" for name, value in (
            (name, getattr(self, name)) for name in ("reduce_bucket_size", "param_persistence_threshold",
                                                     "max_reuse_distance"))]
        shown += [f"{names.get(name, name.replace('_', ' '))} "
                  f"{value if isinstance(value, bool) else f'{value:,}'}"
                  for name, value in self.changed().items() if name not in (
                      "reduce_bucket_size", "param_persistence_threshold", "max_reuse_distance")]
        return ", ".join(shown)


DEEPSPEED_DEFAULTS = ZeroKnobs(reduce_bucket_size=500_000_000, param_persistence_threshold=100_000,
                               max_reuse_distance=DEFAULT_MAX_REUSE_DISTANCE, prefetch_bucket_size=50_000_000)
"""What DeepSpeed uses for a key the JSON leaves out (runtime/zero/config.py: ZERO_REDUCE_BUCKET_SIZE_DEFAULT 5e8,
param_persistence_threshold 1e5, max_reuse_distance 1e9, prefetch_bucket_size 5e7, max_live_parameters 1e9,
allgather_bucket_size 5e8, sub_group_size 1e9, contiguous_gradients on, round_robin_gradients off; offload
pin_memory on in offload_config.py; overlap_comm on at stage 3 only)."""
