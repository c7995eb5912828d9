"""Several ranks for a script trace (memfit.trace.script): torchrun's command line read, and the script run as rank 0
of a fake process group, as memfit.trace.distributed runs memfit's own FSDP2 step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
def fake_launch(world_size: int, launched: bool, notes: list[str],
                on_bucket: Callable[[torch.Tensor], None] = lambda bucket: None) -> Iterator[None]:
    """The script is rank 0 of `world_size`: torchrun's environment (when `launched`), and every
    init_process_group joins torch's fake backend (torch.testing._internal.distributed.fake_pg: collectives return
    at once), as memfit.trace.distributed does for its own FSDP2 step. Device meshes asked for on "cuda" are the
    CPU's (fake tensors are CPU tensors); DistributedDataParallel runs as `fake_ddp` says, each gradient bucket handed
to `on_bucket` as it is reduced. The process group is destroyed afterwards."""
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
        with fake_ddp(notes, on_bucket), _patched(dist, {"init_process_group": init_process_group}), \
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


# ---- DistributedDataParallel on a fake process group ---------------------------------------------------------------

@contextlib.contextmanager
def fake_ddp(notes: list[str], on_bucket: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """torch's DistributedDataParallel runs for real on the fake process group, its C++ Reducer included: the
    gradient buckets it allocates (one flat tensor per bucket and dtype, together the size of the trainable
    parameters; bucket_cap_mb, the 1 MiB first bucket after the rebuild, gradient_as_bucket_view) are its own
    allocations, on fake tensors. Three calls cannot run as they are, and are replaced by what they do on rank 0
    of ranks that agree:

    - `_verify_param_shape_across_processes` (all-gathers every rank's shapes and compares them): nothing to check;
    - the allreduce of each bucket: the fake group's work completes with no value, which the Reducer refuses
      ("expected the hook result is either a Tensor or a TensorList"), so a communication hook returns the bucket
      itself, reduced in place as allreduce leaves it (torch/csrc/distributed/c10d/reducer.cpp; with a hook the
      Reducer copies each gradient into its bucket view instead of multiplying it in, the same bytes);
    - the bucket rebuild before the second forward (`Reducer::rebuild_buckets`) writes rank 0's bucket order into
      small int tensors it reads back: while the DDP forward runs, tensors made from no fake tensor (those int
      tensors) are real, so the rebuild and its new buckets run as on rank 0.

    A communication hook of the script's own (`register_comm_hook`) is refused in one line: its collectives'
    futures carry no value on the fake group either."""
    try:
        from torch.nn.parallel import distributed as ddp
    except ImportError:  # torch built without distributed
        yield
        return
    cls = ddp.DistributedDataParallel
    original_init, original_pre, original_hook = cls.__init__, cls._pre_forward, cls.register_comm_hook
    wrapped: list[int] = []

    def init(self, module, *args, **kwargs):
        # a fake tensor is a CPU tensor: DDP takes `device_ids` (one CUDA device per rank) for a CPU module's
        # mistake; without them it leaves the inputs where they are, on the device already
        args = (None, None, *args[2:]) if args else ()
        kwargs.update({k: None for k in ("device_ids", "output_device") if k in kwargs})
        original_init(self, module, *args, **kwargs)
        if getattr(self, "reducer", None) is not None:
            original_hook(self, on_bucket, _reduced_in_place)
            wrapped.append(sum(p.numel() * p.element_size() for p in self.parameters() if p.requires_grad))

    def register_comm_hook(self, state, hook):
        raise ConfigError(f"DistributedDataParallel.register_comm_hook({getattr(hook, '__name__', hook)}): a "
                          "communication hook cannot run on a fake process group (its collectives return no "
                          "value); trace the script without it (the hook changes what DDP sends, not what it holds)")

    def pre_forward(self, *args, **kwargs):
        with _RealOutsideFake():
            return original_pre(self, *args, **kwargs)

    with _patched(ddp, {"_verify_param_shape_across_processes": lambda *args, **kwargs: None}), \
            _patched(cls, {"__init__": init, "_pre_forward": pre_forward, "register_comm_hook": register_comm_hook}):
        yield
    if wrapped:
        notes.append(f"DistributedDataParallel ran on the fake process group: its gradient buckets "
                     f"({sum(wrapped):,} B per model, as many bytes as the trainable parameters) are in the figures")


def _reduced_in_place(on_bucket, bucket):
    on_bucket(bucket.buffer())
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class _RealOutsideFake(TorchDispatchMode):
    """An op none of whose tensor arguments is fake, that makes an int tensor or reads only real tensors, runs for
    real, below every mode; everything else goes on to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made_int = not tensors and kwargs.get("dtype") in (torch.int32, torch.int64)
        if (made_int or tensors) and not any(isinstance(t, FakeTensor) for t in tensors):
            with torch._C._DisableTorchDispatch():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
