"""Several ranks for a script trace (memfit.trace.script): torchrun's command line read, and the script run as rank 0
of a fake process group, as memfit.trace.distributed runs memfit's own FSDP2 step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import ConfigError
from .script_env import _cpu, _patched

_TORCHRUN_FLAGS = {"--standalone"}
_TORCHRUN_VALUES = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                    "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_backend",
                    "--rdzv-backend", "--rdzv_endpoint", "--rdzv-endpoint", "--rdzv_id", "--rdzv-id"}


def torchrun_options(argv: list[str]) -> tuple[list[str], int]:
    """(the script's own argv, ranks per node) from torchrun's options; one node only."""
    values: dict[str, str] = {}
    module = False
    while argv and argv[0].startswith("-"):
        option, _, value = argv.pop(0).partition("=")
        if option in ("-m", "--module"):
            module = True
            continue
        if option in _TORCHRUN_FLAGS:
            continue
        if option not in _TORCHRUN_VALUES:
            raise ConfigError(f"torchrun option {option} is not supported by memfit trace")
        if not value:
            if not argv:
                raise ConfigError(f"torchrun {option} needs a value")
            value = argv.pop(0)
        values[option.replace("-", "_")] = value
    nodes = values.get("__nnodes", "1")
    if nodes not in ("1", "1:1"):
        raise ConfigError(f"torchrun --nnodes {nodes}: memfit traces one node (rank 0 of it)")
    ranks = values.get("__nproc_per_node", "1")
    if not ranks.isdigit() or int(ranks) < 1:
        raise ConfigError(f"torchrun --nproc_per_node {ranks}: give a whole number of processes")
    return (["-m", *argv] if module else argv), int(ranks)



@contextlib.contextmanager
def fake_launch(world_size: int, launched: bool, notes: list[str]) -> Iterator[None]:
    """The script is rank 0 of `world_size`: torchrun's environment (when `launched`), and every
    init_process_group joins torch's fake backend (torch.testing._internal.distributed.fake_pg: collectives return
    at once), as memfit.trace.distributed does for its own FSDP2 step. Device meshes asked for on "cuda" are the
    CPU's (fake tensors are CPU tensors). The process group is destroyed afterwards."""
    import os

    import torch.distributed as dist
    from torch.distributed import device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("a torch.distributed process group already exists in this process: trace the script in "
                          "a fresh process")
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"} if launched else {}
    saved = {name: os.environ.get(name) for name in env}
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original_init, original_mesh = dist.init_process_group, device_mesh.init_device_mesh
    original_mesh_init = device_mesh.DeviceMesh.__init__
    joined = []

    def mesh_init(self, device_type, *args, **kwargs):
        """FACTS.md: a mesh is made outside FakeTensorMode (its coordinates come from a nonzero() over its rank
        tensor). A rank tensor made inside it (init_device_mesh's `arange(world).view(shape)`) has no values:
        it is made again for real, the identity layout init_device_mesh builds."""
        with unset_fake_temporarily():
            args = tuple(_real_ranks(a) for a in args)
            kwargs = {k: _real_ranks(v) for k, v in kwargs.items()}
            original_mesh_init(self, _cpu(device_type), *args, **kwargs)

    def init_process_group(*args, **kwargs):
        joined.append(True)
        original_init("fake", store=FakeStore(), rank=0, world_size=world_size)

    def init_device_mesh(device_type, *args, **kwargs):
        return original_mesh(_cpu(device_type), *args, **kwargs)

    os.environ.update(env)
    try:
        with _patched(dist, {"init_process_group": init_process_group}), \
                _patched(dist.distributed_c10d, {"init_process_group": init_process_group}), \
                _patched(device_mesh, {"init_device_mesh": init_device_mesh}), \
                _patched(device_mesh.DeviceMesh, {"__init__": mesh_init}), \
                _patched(dist, {"init_device_mesh": init_device_mesh} if hasattr(dist, "init_device_mesh") else {}):
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if joined:
        notes.append(f"the script joined a fake process group of {world_size} ranks as rank 0 (no communication): "
                     "the figures are rank 0's")


def _real_ranks(value):
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        return torch.arange(value.numel(), dtype=value.dtype).view(tuple(value.shape))
    return value
