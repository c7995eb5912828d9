"""GPUs and the machine around them. The catalog is data (data/gpus.json), each entry with its source."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from .errors import ConfigError, suggest
from .estimate.allocator import AllocatorConfig
from .setup import Precision, needs_bf16
from .units import GiB, MiB, parse_size

DEFAULT_GPU = "A100-80GB"
"""The GPU the commands size for when none is named (memfit plan, memfit rl, the page)."""


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
    compute_capability: float = 0.0
    """CUDA compute capability (8.0 A100, 9.0 H100); 0 = unknown or not CUDA. Picks the cuBLAS workspace size."""
    nvlink: bool = False
    """GPUs linked by NVLink/NVSwitch (SXM boards) rather than PCIe only: NCCL opens more channels."""


@dataclass(frozen=True)
class Hardware:
    gpu: GPU
    gpus_per_node: int = 1
    num_nodes: int = 1
    cpu_ram_bytes: int = 256 * GiB
    """Host RAM per node (offloaded optimizer states must fit here)."""
    cuda_runtime: str = "lazy"
    """How CUDA loads kernels, which sizes the context: 'lazy' (CUDA >= 11.7, PyTorch >= 1.13's default), 'eager'
    (CUDA_MODULE_LOADING=EAGER) or 'legacy' (CUDA < 11.7, every kernel loaded). See data/cuda_runtime.json."""
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    """PYTORCH_CUDA_ALLOC_CONF as the caching-allocator replay sees it (expandable_segments, max_split_size_mb)."""
    cuda_context_bytes: int | None = None
    """CUDA context outside PyTorch's allocator; None = from `cuda_runtime` (data/cuda_runtime.json)."""
    cublas_workspace_bytes: int | None = None
    """One cuBLAS workspace (allocated through the caching allocator); None = the size PyTorch picks for the GPU."""
    nccl_bytes_per_communicator: int | None = None
    """NCCL's buffers per communicator, outside the allocator; None = from the GPU's interconnect."""
    nccl_communicators: int = 1
    """Communicators a rank opens (one process group: 1)."""

    @property
    def device(self) -> DeviceConstants:
        """The runtime's own memory on this hardware, each figure with its source."""
        return device_constants(self)

    def __post_init__(self) -> None:
        problems = [f"{n} must be a positive whole number" for n in ("gpus_per_node", "num_nodes")
                    if not isinstance(getattr(self, n), int) or getattr(self, n) < 1]
        if self.cpu_ram_bytes <= 0:
            problems.append("cpu RAM must be positive")
        if self.cuda_runtime not in CUDA_RUNTIMES:
            problems.append(f"cuda_runtime must be one of {', '.join(CUDA_RUNTIMES)}, got {self.cuda_runtime!r}")
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


CUDA_RUNTIMES = ("lazy", "eager", "legacy")


@dataclass(frozen=True)
class DeviceConstants:
    """Per-process memory of the CUDA runtime on one GPU: what `memfit.estimate.device` adds to the tensors."""

    cuda_context_bytes: int
    cuda_context_source: str
    cublas_workspace_bytes: int
    cublas_workspaces: int
    cublas_source: str
    nccl_bytes_per_communicator: int
    nccl_formula: str
    nccl_source: str


@lru_cache(maxsize=1)
def cuda_runtime_data() -> dict:
    return json.loads(resources.files("memfit").joinpath("data/cuda_runtime.json").read_text())


@lru_cache(maxsize=64)
def device_constants(hardware: "Hardware") -> DeviceConstants:
    if hardware.is_cpu:
        return DeviceConstants(0, "host memory: no CUDA context", 0, 0, "", 0, "", "")
    data = cuda_runtime_data()
    context = data["cuda_context"][hardware.cuda_runtime]
    blas = data["cublas_workspace"]
    hopper = hardware.gpu.compute_capability >= 9.0
    workspace = blas["bytes_sm90_and_newer"] if hopper else blas["bytes_older"]
    nccl = data["nccl"]
    link = "nvlink" if hardware.gpu.nvlink else "pcie"
    channels = nccl["channels"][link]
    per_set = nccl["simple_bytes"] + nccl["ll_bytes"] + nccl["ll128_bytes"]
    nccl_bytes = channels * nccl["buffer_sets_per_channel"] * per_set
    return DeviceConstants(
        cuda_context_bytes=(hardware.cuda_context_bytes if hardware.cuda_context_bytes is not None
                            else context["bytes"]),
        cuda_context_source=(f"{hardware.cuda_runtime} module loading: {context['what']}. {context['source']}"
                             if hardware.cuda_context_bytes is None else "given"),
        cublas_workspace_bytes=(hardware.cublas_workspace_bytes if hardware.cublas_workspace_bytes is not None
                                else workspace),
        cublas_workspaces=blas["per_step"], cublas_source=f"{blas['what']} {blas['source']}",
        nccl_bytes_per_communicator=(hardware.nccl_bytes_per_communicator
                                     if hardware.nccl_bytes_per_communicator is not None else nccl_bytes),
        nccl_formula=(f"{channels} channels ({link}) x {nccl['buffer_sets_per_channel']} buffer sets x "
                      f"{per_set / MiB:.2f} MiB (SIMPLE + LL + LL128)"),
        nccl_source=f"{nccl['what']} {nccl['source']}")


def cpu_device(memory_bytes: int) -> GPU:
    """A CPU 'device' for comparing with measured CPU steps: no CUDA context, no allocator reserve."""
    return GPU(name="cpu", memory_bytes=memory_bytes, bf16=True, source="host memory")


def make_hardware(gpu: str | GPU, *, gpus_per_node: int = 1, num_nodes: int = 1,
                  cpu_ram: int | str | None = None, cuda_runtime: str = "lazy",
                  expandable_segments: bool = False, allocator: AllocatorConfig | None = None) -> Hardware:
    """`expandable_segments` is a shorthand for `allocator=AllocatorConfig(expandable_segments=True)`."""
    device = get_gpu(gpu) if isinstance(gpu, str) else gpu
    kwargs = {}
    if cpu_ram is not None:
        kwargs["cpu_ram_bytes"] = parse_size(cpu_ram) if isinstance(cpu_ram, str) else int(cpu_ram)
    if allocator is None:
        allocator = AllocatorConfig(expandable_segments=expandable_segments)
    if device.name == "cpu":
        kwargs.update(cuda_context_bytes=0, cublas_workspace_bytes=0, nccl_bytes_per_communicator=0)
    return Hardware(gpu=device, gpus_per_node=gpus_per_node, num_nodes=num_nodes, cuda_runtime=cuda_runtime,
                    allocator=allocator, **kwargs)
