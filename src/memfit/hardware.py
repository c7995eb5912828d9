"""GPUs and the machine around them. The catalog is data (data/gpus.json), each entry with its source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .errors import ConfigError, suggest
from .setup import Precision, needs_bf16
from .units import GiB, MiB, parse_size


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    """Usable memory as the driver reports it (torch.cuda.get_device_properties(0).total_memory)."""
    nominal: str = ""
    """What the vendor sells it as, e.g. '80 GB HBM3'."""
    bf16: bool = True
    peak_tflops_bf16: float = 0.0
    """Dense bf16/fp16 tensor-core TFLOP/s, for the throughput model."""
    host_link_gb_per_s: float = 25.0
    """Host<->device bandwidth in GB/s (PCIe 4.0 x16 ~ 25 effective) for offload costs."""
    source: str = ""
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hardware:
    gpu: GPU
    gpus_per_node: int = 1
    num_nodes: int = 1
    cpu_ram_bytes: int = 256 * GiB
    """Host RAM per node (offloaded optimizer states must fit here)."""
    cuda_context_bytes: int = 512 * MiB
    """CUDA context + cuBLAS workspace outside PyTorch's statistics (0.3-0.6 GiB with lazy loading)."""
    allocator_reserve_fraction: float = 0.05
    """Caching-allocator fragmentation: reserved exceeds allocated by about this fraction of the peak."""
    nccl_bytes_per_communicator: int = 1 * GiB
    """NCCL buffers per communicator when more than one GPU trains (0.5-1.6 GiB observed)."""

    def __post_init__(self) -> None:
        problems = [f"{n} must be a positive whole number" for n in ("gpus_per_node", "num_nodes")
                    if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if self.cpu_ram_bytes <= 0:
            problems.append("cpu RAM must be positive")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def is_cpu(self) -> bool:
        return self.gpu.name == "cpu"


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPU]:
    raw = json.loads(resources.files("memfit").joinpath("data/gpus.json").read_text())
    gpus = {}
    for entry in raw["gpus"]:
        entry = dict(entry)
        entry["memory_bytes"] = int(entry.pop("memory_mib") * MiB)
        entry["aliases"] = tuple(entry.get("aliases", ()))
        gpus[entry["name"]] = GPU(**entry)
    return gpus


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-").replace("nvidia-", "")


def get_gpu(name: str) -> GPU:
    """A catalog GPU by name or alias ('H100', 'a100-80gb', '4090'), or an explicit size ('80GiB', '24GB')."""
    key = _normalise(name)
    catalog = gpu_catalog()
    for gpu in catalog.values():
        if key == _normalise(gpu.name) or key in (_normalise(a) for a in gpu.aliases):
            return gpu
    if key[:1].isdigit():
        try:
            return GPU(name=f"custom-{name}", memory_bytes=parse_size(name), source="given on the command line")
        except ConfigError:
            pass
    raise suggest(name, list(catalog), "gpu")


def check_precision(precision: Precision | str, gpu: GPU) -> None:
    """Refuse a precision that computes or stores in bf16 on a GPU without bf16 (T4, V100): one ConfigError line."""
    precision = Precision.parse(precision)
    if needs_bf16(precision) and not gpu.bf16:
        raise ConfigError(f"{gpu.name} has no bf16, so precision {precision} cannot run on it: use amp-fp16 "
                          "(fp16 autocast with loss scaling) or fp32")


def cpu_device(memory_bytes: int) -> GPU:
    """A CPU 'device' for comparing with measured CPU steps: no CUDA context, no allocator reserve."""
    return GPU(name="cpu", memory_bytes=memory_bytes, bf16=True, source="host memory")


def make_hardware(gpu: str | GPU, *, gpus_per_node: int = 1, num_nodes: int = 1,
                  cpu_ram: int | str | None = None) -> Hardware:
    device = get_gpu(gpu) if isinstance(gpu, str) else gpu
    kwargs = {}
    if cpu_ram is not None:
        kwargs["cpu_ram_bytes"] = parse_size(cpu_ram) if isinstance(cpu_ram, str) else int(cpu_ram)
    if device.name == "cpu":
        kwargs.update(cuda_context_bytes=0, allocator_reserve_fraction=0.0, nccl_bytes_per_communicator=0)
    return Hardware(gpu=device, gpus_per_node=gpus_per_node, num_nodes=num_nodes, **kwargs)
