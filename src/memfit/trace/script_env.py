"""What a user's training script sees while `memfit.trace.script` runs it on fake tensors.

- "cuda" target: torch.cuda answers as one device of the target GPU (is_available, device_count, properties, memory
  queries), so the script takes its CUDA path. torch built for the CPU cannot hold CUDA tensors, not even fake ones
  (`.to("cuda")` and backward refuse: "PyTorch is not linked with support for cuda devices"), so a tensor asked for
  on "cuda" is a fake CPU tensor that the tracker counts as device memory, and one made on the CPU (a data loader's
  batch before `.to(device)`) is host memory, outside the device peak. `.to("cuda")` of a host tensor copies, as a
  real host-to-device copy does. `torch.autocast("cuda")` runs CPU autocast, and memfit.trace.kernels gives the
  CUDA kernels' memory behaviour, as `memfit trace` does for its own step.
- Model loading: transformers' `from_pretrained` builds the model from its config (a local path, a catalog name or
  a hub id memfit resolves offline: memfit.trace.hf.resolve_config), with no weights.
- Saving (`torch.save`, safetensors, `save_pretrained`) writes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError
from .hf import resolve_config


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _cpu(device: Any) -> Any:
    return "cpu" if _is_cuda(device) or isinstance(device, int) else device


# ---- torch.cuda as the target GPU --------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_cuda(name: str, memory_bytes: int, live: Callable[[], int], peak: Callable[[], int],
              count: int = 1) -> Iterator[None]:
    """torch.cuda reports `count` devices `name` of `memory_bytes` (one per rank of the node: Lightning checks the
    devices it is given exist); the script is on device 0, whose memory queries read the tracker (`live()`,
    `peak()`); seeding, synchronising, streams and cache calls do nothing. Compute capability 9.0 (bf16, flash)."""
    properties = SimpleNamespace(name=name, total_memory=memory_bytes, major=9, minor=0, multi_processor_count=132,
                                 is_integrated=False, is_multi_gpu_board=False, uuid="memfit-fake")
    nothing = lambda *args, **kwargs: None  # noqa: E731
    replacements = {
        "is_available": lambda: True, "device_count": lambda: count, "current_device": lambda: 0,
        "is_initialized": lambda: True, "_lazy_init": nothing, "init": nothing, "set_device": nothing,
        "get_device_properties": lambda device=None: properties, "get_device_name": lambda device=None: name,
        "get_device_capability": lambda device=None: (9, 0), "is_bf16_supported": lambda *a, **k: True,
        "synchronize": nothing, "empty_cache": nothing, "manual_seed": nothing, "manual_seed_all": nothing,
        "seed": nothing, "seed_all": nothing, "reset_peak_memory_stats": nothing, "reset_max_memory_allocated": nothing,
        "memory_allocated": lambda device=None: live(), "max_memory_allocated": lambda device=None: peak(),
        "memory_reserved": lambda device=None: live(), "max_memory_reserved": lambda device=None: peak(),
        "mem_get_info": lambda device=None: (max(0, memory_bytes - live()), memory_bytes),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(), "set_rng_state": nothing,
        "get_rng_state_all": lambda: [torch.get_rng_state()], "set_rng_state_all": nothing,
        "current_stream": lambda device=None: _FakeStream(), "default_stream": lambda device=None: _FakeStream(),
        "stream": lambda stream=None: contextlib.nullcontext(), "Stream": _FakeStream, "Event": _FakeEvent,
    }
    originals = {name: getattr(torch.cuda, name) for name in replacements if hasattr(torch.cuda, name)}
    with _patched(torch.cuda, replacements), _cuda_autocast_on_cpu(), _imports_see_the_cpu(originals):
        yield


@contextlib.contextmanager
def _imports_see_the_cpu(originals: dict[str, Any]) -> Iterator[None]:
    """A module imported while the script runs sees the real torch.cuda: libraries pick their kernels at import
    (bitsandbytes imports its CUDA backend when torch.cuda.is_available(), which then needs torch's CUDA
    bindings). Both import paths: the import statement and importlib.import_module (transformers' lazy modules)."""
    import builtins
    import importlib

    def unpatched(function):
        def importing(name, *args, **kwargs):
            if isinstance(name, str) and name in sys.modules and not any(args[2:4]):  # fromlist, level
                return function(name, *args, **kwargs)
            with _patched(torch.cuda, originals):
                return function(name, *args, **kwargs)
        return importing

    with _patched(builtins, {"__import__": unpatched(builtins.__import__)}), \
            _patched(importlib, {"import_module": unpatched(importlib.import_module)}):
        yield


class _FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _FakeEvent(_FakeStream):
    def record(self, *args) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _cuda_autocast_on_cpu() -> Iterator[None]:
    """`torch.autocast("cuda", ...)` (and torch.cuda.amp.autocast, which calls it) runs CPU autocast."""
    original = torch.amp.autocast_mode.autocast.__init__

    def init(self, device_type, *args, **kwargs):
        original(self, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    torch.amp.autocast_mode.autocast.__init__ = init
    try:
        yield
    finally:
        torch.amp.autocast_mode.autocast.__init__ = original


@contextlib.contextmanager
def _patched(owner: Any, replacements: dict[str, Any]) -> Iterator[None]:
    saved = {name: getattr(owner, name) for name in replacements if hasattr(owner, name)}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name in replacements:
            if name in saved:
                setattr(owner, name, saved[name])
            else:
                delattr(owner, name)


# ---- "cuda" tensors: fake CPU tensors counted on the device -------------------------------------------------------

_TO = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


class DeviceMap(TorchFunctionMode):
    """Rewrites the CUDA device of every torch call to the CPU, and tells the tracker (`set_host(bool) -> previous`)
    whether what the call makes lives on the device or on the host.

    Fake tensors all say "cpu", so `device=x.device` inside modelling code cannot tell: inside the step
    (`in_step()`: a module's forward, backward, the optimizer step) everything made is device memory unless moved
    with `.cpu()`; outside it (the data pipeline, logging) a call makes device memory when it asks for CUDA
    (`device="cuda"`, `.to("cuda")`, `.cuda()`, `with torch.device("cuda")`) or reads a device tensor."""

    def __init__(self, set_host: Callable[[bool], bool], is_device: Callable[[torch.Tensor], bool],
                 in_step: Callable[[], bool]) -> None:
        super().__init__()
        self._set_host = set_host
        self._is_device = is_device
        self._in_step = in_step

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TO:
            return self._to(func, args, kwargs)
        on_device = self._in_step()
        if "device" in kwargs:
            on_device = on_device or _is_cuda(kwargs["device"])
            kwargs["device"] = _cpu(kwargs["device"])
        if not on_device:
            on_device = any(self._is_device(t) for t in _tensors(args, kwargs))
        previous = self._set_host(not on_device)
        try:
            return func(*args, **kwargs)
        finally:
            self._set_host(previous)

    def _to(self, func, args, kwargs):
        tensor, rest = args[0], list(args[1:])
        here = self._is_device(tensor)
        if func is not torch.Tensor.to:
            there = func is torch.Tensor.cuda
            kwargs = {k: v for k, v in kwargs.items() if k == "non_blocking"}
            rest = []
        else:
            target = kwargs.pop("device", None)
            if rest and (isinstance(rest[0], (str, torch.device, int)) or rest[0] is None):
                target = rest.pop(0)
            elif rest and isinstance(rest[0], torch.Tensor):
                other = rest.pop(0)
                target = "cuda" if self._is_device(other) else "cpu"
                rest.insert(0, other.dtype)
            there = here if target is None or (not _is_cuda(target) and self._in_step()) else _is_cuda(target)
        copy = kwargs.pop("copy", False) or here != there
        previous = self._set_host(not there)
        try:
            return torch.Tensor.to(tensor, "cpu", *rest, copy=copy, **kwargs)
        finally:
            self._set_host(previous)


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


# ---- model loading and saving --------------------------------------------------------------------------------------

@contextlib.contextmanager
def weightless_loading(notes: list[str]) -> Iterator[None]:
    """transformers' from_pretrained (PreTrainedModel's and the Auto classes') builds the model from its config."""
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:
        yield
        return
    # transformers copies _BaseAutoModelClass.from_pretrained into each Auto class as it makes it
    # (models/auto/auto_factory.py `auto_class_update`): every class that has its own copy is patched.
    classes = [PreTrainedModel, *_subclasses(_BaseAutoModelClass)]
    originals = {cls: cls.__dict__["from_pretrained"] for cls in classes if "from_pretrained" in cls.__dict__}

    def from_pretrained(cls, name, *args, **kwargs):
        return _from_config(notes, cls, name, *args, **kwargs)

    for cls in originals:
        cls.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.from_pretrained = original


def _subclasses(cls) -> list[type]:
    found, todo = [cls], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


_IGNORED = ("low_cpu_mem_usage", "trust_remote_code", "revision", "cache_dir", "token", "local_files_only",
            "use_safetensors", "force_download", "device_map", "torch_dtype", "dtype", "quantization_config")


def _from_config(notes: list[str], cls, name, *args, **kwargs):
    from transformers import AutoConfig, PretrainedConfig

    if kwargs.get("quantization_config") is not None or kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit"):
        raise ConfigError(f"from_pretrained({name!r}) with a quantized base: not traced yet (size QLoRA with "
                          "`memfit plan --quant`)")
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        config = _config(str(name), AutoConfig)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    extra = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    for key in ("attn_implementation",):
        if key in extra:
            setattr(config, "_attn_implementation", extra.pop(key))
    build = cls.from_config if hasattr(cls, "_model_mapping") else cls._from_config
    with _default_dtype(dtype):
        model = build(config, **extra) if extra and build is cls.from_config else build(config)
    notes.append(f"from_pretrained({str(name)!r}): built from its config, no weights loaded")
    device_map = kwargs.get("device_map")
    if device_map is not None and not (isinstance(device_map, str) and device_map == "cpu"):
        model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    return model.train(False)  # from_pretrained returns the model in eval mode; Trainer / the loop call .train()


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _config(name: str, auto_config):
    from pathlib import Path

    if Path(name).expanduser().exists():
        return auto_config.from_pretrained(name)
    config = dict(resolve_config(name)[0])
    return auto_config.for_model(config.pop("model_type"), **config)


@contextlib.contextmanager
def nothing_saved(notes: list[str]) -> Iterator[None]:
    """torch.save, safetensors' writers and save_pretrained do nothing (a trace writes no files)."""
    saved: list[str] = []

    def skip(what: str):
        def skipped(*args, **kwargs) -> None:
            saved.append(what)
        return skipped

    patches = [(torch, {"save": skip("torch.save")})]
    try:
        import safetensors.torch as st

        patches.append((st, {"save_file": skip("safetensors save_file"), "save_model": skip("safetensors")}))
    except ImportError:
        pass
    try:
        from transformers import PreTrainedModel

        patches.append((PreTrainedModel, {"save_pretrained": skip("save_pretrained")}))
    except ImportError:
        pass
    with contextlib.ExitStack() as stack:
        for owner, replacements in patches:
            stack.enter_context(_patched(owner, replacements))
        yield
    if saved:
        notes.append(f"skipped {len(saved)} save call(s) ({', '.join(sorted(set(saved)))}): a trace writes no files")


@contextlib.contextmanager
def real_run_branches() -> Iterator[None]:
    """transformers takes other branches when it sees a FakeTensor (utils/import_utils.py `is_tracing`, for
    torch.compile's sake): masking_utils then builds a packed-sequence mask a real run does not. A script's trace
    must take the real run's branches, so FakeTensors are not 'tracing' to it (the tracker answers the value
    reads those branches make)."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    with _patched(import_utils, {"is_fake_tensor": lambda tensor: False}):
        yield


@contextlib.contextmanager
def eager_compile(notes: list[str]) -> Iterator[None]:
    """torch.compile returns what it was given: dynamo does not compile under the tracer's dispatch mode (as
    `memfit trace --compile` is refused for), so the script's compiled model is traced eager, and a note says so."""
    called = []

    def compile_(model=None, *args, **kwargs):
        called.append(True)
        if model is None:  # used as @torch.compile(...)
            return lambda function: function
        return model

    with _patched(torch, {"compile": compile_}):
        yield
    if called:
        notes.append(f"torch.compile was called {len(called)} time(s): traced eager (a compiled step keeps other "
                     "tensors; `memfit estimate --compile` sizes the compiled partition)")


@contextlib.contextmanager
def loaders_in_process() -> Iterator[None]:
    """DataLoaders load in this process (num_workers=0, no pinning): worker processes would get fake tensors
    from a fake mode they do not have, and what workers hold is host memory either way."""
    from torch.utils.data import DataLoader

    import inspect

    original = DataLoader.__init__
    signature = inspect.signature(original)
    in_process = {"num_workers": 0, "pin_memory": False, "prefetch_factor": None, "persistent_workers": False}

    @functools.wraps(original)  # Lightning re-makes a loader from its __init__'s signature (with a sampler)
    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments.update({k: v for k, v in in_process.items() if k in signature.parameters})
        original(*bound.args, **bound.kwargs)

    with _patched(DataLoader, {"__init__": init}):
        yield


# ---- Module.to on fake tensors -------------------------------------------------------------------------------------

@contextlib.contextmanager
def replacing_module_apply() -> Iterator[None]:
    """`module.to(...)` / `.cuda()` / `.half()` replace parameters instead of swapping them: torch swaps a
    FakeTensor parameter in place (nn/modules/module.py `_apply`, `isinstance(param, FakeTensor)`), which
    `torch.utils.swap_tensors` refuses for a tensor with weakrefs, as every fake tensor has. Tied parameters stay
    tied (one conversion per tensor within one call)."""
    from torch import nn
    original = nn.Module._apply
    memo: dict[int, Any] = {}
    depth = [0]

    def convert(fn, tensor, make):
        if id(tensor) not in memo:
            with torch.no_grad():
                applied = fn(tensor)
            memo[id(tensor)] = tensor if applied is tensor else make(applied)
        return memo[id(tensor)]

    def _apply(self, fn, recurse=True):
        depth[0] += 1
        try:
            for child in self.children() if recurse else ():
                child._apply(fn)
            for key, param in self._parameters.items():
                if param is not None:
                    new = convert(fn, param, lambda t, p=param: nn.Parameter(t, p.requires_grad))
                    if new is not param and param.grad is not None:
                        new.grad = convert(fn, param.grad, lambda t: t)
                    self._parameters[key] = new
            for key, buffer in self._buffers.items():
                if buffer is not None:
                    self._buffers[key] = convert(fn, buffer, lambda t: t)
        finally:
            depth[0] -= 1
            if not depth[0]:
                memo.clear()
        return self

    nn.Module._apply = _apply
    try:
        yield
    finally:
        nn.Module._apply = original
