"""The GPU catalog (data/gpus.json) read through memfit.hardware: every entry loads, names and aliases resolve,
and each usable-memory figure sits where a driver-reported figure can sit relative to the size sold."""

from __future__ import annotations

import re

import pytest

from memfit.errors import UnknownNameError
from memfit.hardware import get_gpu, gpu_catalog
from memfit.units import GiB, MiB

REQUIRED = ["A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "T4", "V100-16GB", "V100-32GB", "A10G", "L40S",
            "RTX-3090", "RTX-4090", "MI300X"]


def nominal_gib(nominal: str) -> float:
    """'80 GB HBM3' -> 80. Vendors' memory 'GB' is the binary size of the chips (80 GB H100: 81559 MiB in
    nvidia-smi), so the driver-reported figure is compared with it as GiB."""
    return float(re.match(r"\s*(\d+(?:\.\d+)?)\s*GB", nominal).group(1))


def test_catalog_has_the_required_gpus():
    assert set(REQUIRED) <= set(gpu_catalog())


@pytest.mark.parametrize("name", sorted(gpu_catalog()))
def test_every_entry_loads_by_its_name(name):
    gpu = get_gpu(name)
    assert gpu.name == name
    assert gpu.memory_bytes % MiB == 0 and gpu.peak_tflops_bf16 > 0 and gpu.host_link_gb_per_s in (12.0, 25.0, 50.0)
    assert gpu.source and ("https://" in gpu.source or gpu.source.startswith("Estimated"))


@pytest.mark.parametrize("name", sorted(gpu_catalog()))
def test_usable_memory_is_a_little_under_the_size_sold(name):
    gpu = get_gpu(name)
    ratio = gpu.memory_bytes / GiB / nominal_gib(gpu.nominal)
    assert 0.90 <= ratio <= 1.005, f"{name}: {gpu.memory_bytes / GiB:.2f} GiB vs {gpu.nominal}"


@pytest.mark.parametrize(
    "alias, name",
    [
        ("h100", "H100-80GB"), ("A100-80GB", "A100-80GB"), ("a100_80gb", "A100-80GB"), ("4090", "RTX-4090"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("AMD Instinct MI300X", "MI300X"), ("nvidia l4", "L4"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"), ("h200", "H200"), ("a10g", "A10G"), ("l40s", "L40S"),
    ],
)
def test_aliases_and_device_names_resolve(alias, name):
    assert get_gpu(alias).name == name


def test_aliases_are_unambiguous():
    owners: dict[str, str] = {}
    for gpu in gpu_catalog().values():
        for spelling in (gpu.name, *gpu.aliases):
            key = spelling.lower().replace("_", "-").replace(" ", "-")
            assert owners.setdefault(key, gpu.name) == gpu.name, f"{spelling} names two GPUs"


def test_unknown_gpu_suggests_close_ones():
    with pytest.raises(UnknownNameError, match="A100-80GB"):
        get_gpu("A100-90GB")
    with pytest.raises(UnknownNameError, match="RTX-4090"):
        get_gpu("RTX-4080")


def test_bf16_and_relative_sizes():
    catalog = gpu_catalog()
    assert {n for n, g in catalog.items() if not g.bf16} == {"T4", "V100-16GB", "V100-32GB"}
    assert catalog["A100-80GB"].memory_bytes > catalog["A100-40GB"].memory_bytes
    assert catalog["V100-32GB"].memory_bytes > catalog["V100-16GB"].memory_bytes
    assert catalog["H200"].memory_bytes > catalog["H100-80GB"].memory_bytes
    tflops = {n: g.peak_tflops_bf16 for n, g in catalog.items()}
    assert tflops["MI300X"] > tflops["H100-80GB"] > tflops["A100-80GB"] > tflops["L4"] > tflops["T4"]


def test_explicit_sizes_still_work_beside_the_catalog():
    assert get_gpu("24GB").memory_bytes == 24 * 10**9
