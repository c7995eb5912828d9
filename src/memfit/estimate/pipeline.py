"""Pipeline parallelism, per stage."""
from __future__ import annotations


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (i < extra) for i in range(num_stages)]
