"""DeepSpeed's ZeRO knobs that size buffers a rank holds, as the user's config sets them.

A DeepSpeed JSON decides three things memfit sizes (DeepSpeed 0.19, runtime/zero/config.py for the defaults):

- `reduce_bucket_size` (elements): the gradient bucket ZeRO-1/2 fills before a reduce, the ipg bucket ZeRO-3
  allocates at start-up (stage3.py `bucket.buffer = torch.empty(self.reduce_bucket_size)`), the contiguous
  gradient buffer of ZeRO-Offload;
- `stage3_param_persistence_threshold` (elements): a ZeRO-3 parameter of at most this many elements stays whole on
  every rank (mark_persistent_parameters);
- `stage3_max_reuse_distance` (elements of the recorded trace): a ZeRO-3 parameter used again within this distance
  stays gathered from its forward into its backward (PartitionedParameterCoordinator.__params_to_release).

Three sources, three values: the HF Trainer / accelerate fill "auto" from the model (hidden^2, 10 x hidden), which is
what memfit emits and assumes when nothing is read (None here); a key the JSON leaves out takes DeepSpeed's own
default (`DEEPSPEED_DEFAULTS`: 5e8, 1e5, 1e9; a 5e8-element bf16 bucket is 1 GB per rank); a number is used as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

AUTO_PERSISTENCE_FACTOR = 10
"""stage3_param_persistence_threshold "auto" = 10 x hidden elements (transformers integrations/deepspeed.py)."""
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
"""stage3_max_reuse_distance: DeepSpeed's default, which no "auto" overrides."""


@dataclass(frozen=True)
class ZeroKnobs:
    """The ZeRO buffer sizes of a DeepSpeed run; None is the HF "auto" value computed from the model."""

    reduce_bucket_size: int | None = None
    """Elements of the gradient reduce bucket (None: "auto", hidden^2)."""
    param_persistence_threshold: int | None = None
    """ZeRO-3: parameters of at most this many elements stay whole on every rank (None: "auto", 10 x hidden)."""
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    """ZeRO-3: a parameter used again within this many trace elements stays gathered into backward."""

    def __post_init__(self) -> None:
        problems = [f"{name} must be a whole number of elements (>= 0) or None, got {value!r}"
                    for name, value in (("reduce_bucket_size", self.reduce_bucket_size),
                                        ("param_persistence_threshold", self.param_persistence_threshold),
                                        ("max_reuse_distance", self.max_reuse_distance))
                    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0)]
        if self.max_reuse_distance is None:
            problems.append("max_reuse_distance must be a whole number of elements, got None")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def is_auto(self) -> bool:
        return self == ZeroKnobs()

    def reduce_bucket_elems(self, hidden_size: int) -> int:
        """The reduce bucket's elements: the set size, or "auto"'s hidden^2. Allocated whole however few elements
        are trained (stage3.py `torch.empty(self.reduce_bucket_size)`, stage_1_and_2.py setup_buckets)."""
        return hidden_size**2 if self.reduce_bucket_size is None else self.reduce_bucket_size

    def persistence_threshold(self, hidden_size: int) -> int:
        if self.param_persistence_threshold is None:
            return AUTO_PERSISTENCE_FACTOR * hidden_size
        return self.param_persistence_threshold

    def to_dict(self) -> dict:
        return {"reduce_bucket_size": self.reduce_bucket_size,
                "param_persistence_threshold": self.param_persistence_threshold,
                "max_reuse_distance": self.max_reuse_distance}

    def __str__(self) -> str:
        if self.is_auto:
            return "auto"
        return ", ".join(f"{what} {'auto' if value is None else f'{value:,}'}" for what, value in (
            ("reduce bucket", self.reduce_bucket_size), ("persistence", self.param_persistence_threshold),
            ("reuse distance", self.max_reuse_distance)))


DEEPSPEED_DEFAULTS = ZeroKnobs(reduce_bucket_size=500_000_000, param_persistence_threshold=100_000,
                               max_reuse_distance=DEFAULT_MAX_REUSE_DISTANCE)
"""What DeepSpeed uses for a key the JSON leaves out (runtime/zero/config.py: ZERO_REDUCE_BUCKET_SIZE_DEFAULT 5e8,
param_persistence_threshold 1e5, max_reuse_distance 1e9)."""
