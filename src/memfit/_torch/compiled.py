"""torch.compile on the torch side: what AOTAutograd's partitioner saves for backward in one compiled block, read on
fake tensors, and the switch that compiles a real model's blocks for a measured step.

torch.compile's memory effect on training is AOTAutograd's: the joint forward + backward graph of the compiled
region is cut by `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py, the partitioner inductor
uses, `compile_fx.py` `partition_fn`), which saves the cheapest set of tensors backward needs and recomputes
pointwise chains (norm internals, activations, rotary) in backward; matmul / SDPA outputs are never recomputed.
Fused kernels do not materialise their intermediates, and a saved tensor is exactly a forward-graph output the
backward graph takes. So the saved bytes of a compiled block are the forward graph's saved outputs, sized from their
fake values, with views resolved to the storage they alias (a `t()` of a weight keeps nothing new, a q/k/v split of
the fused projection keeps the projection's output once).

memfit assumes per-block compile, as torchtune (`training.compile_model`: each layer) and torchtitan
(`apply_compile`: each TransformerBlock) do it: embedding, final norm, LM head and loss stay eager here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..derive.fit import build_short, quiet_transformers
from ..trace.kernels import device_kernels
from ..trace.session import make_hf_batch
from .blocks import named_blocks
from .step import autocast_factory, chunk_cross_entropy, unpacked_sequences

PARTITION_SOURCE = "torch/_functorch/partitioners.py min_cut_rematerialization_partition(compiler='inductor')"


class _Captured(Exception):
    """Stops the model's forward once the first block's inputs are seen."""


def block_inputs(model: torch.nn.Module, block: torch.nn.Module, batch: dict) -> tuple[tuple, dict]:
    """The (args, kwargs) the model's forward passes its first block (hidden state, mask, rotary tables ...)."""
    seen: dict[str, Any] = {}

    def grab(_module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with unpacked_sequences():
            model(**{k: v for k, v in batch.items() if k != "labels"})
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise RuntimeError("the model's forward never called its first block")
    return seen["args"], seen["kwargs"]


def partition_block(block: torch.nn.Module, args: tuple, kwargs: dict, *, autocast=None) -> dict[str, Any]:
    """Compile `block` with torch.compile and an AOTAutograd backend whose partition is inductor's min-cut one and
    whose compilers keep the partitioned graphs as they are (no codegen), run it once on these (fake) inputs, and
    return the forward graph and which of its inputs are parameters / buffers and the hidden state.

    Through dynamo, not aot_function on the module: dynamo decides what the compiled region sees (a CPU autocast
    casts the inputs of the ops an SDPA math path decomposes into, which eager autocast leaves fp32), and a graph
    break shows up as a second graph, which is refused."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, list] = {"forward": [], "inputs": []}
    counts: dict[str, int] = {}

    def keep(name: str) -> Callable:
        def compiler(gm, _example_inputs):
            graphs[name].append(gm)
            return gm
        return compiler

    def partition(joint, joint_inputs, **kw):
        counts["forward_outputs"] = kw["num_fwd_outputs"]
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kw)

    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=lambda gm, _inputs: gm, partition_fn=partition)

    def backend(gm, example_inputs):
        graphs["inputs"].append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return aot(gm, example_inputs)

    compiled = torch.compile(block, backend=backend, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20), \
            unpacked_sequences(), (autocast or _null)():
        compiled(*args, **kwargs)
    if len(graphs["forward"]) != 1:
        raise RuntimeError(f"torch.compile made {len(graphs['forward'])} graphs of one block (graph breaks): what "
                           "the eager code between them keeps is not sized")
    names = graphs["inputs"][0]
    static = {i for i, name in enumerate(names) if "_parameters_" in name or "_buffers_" in name}
    inputs = [i for i in range(len(names)) if i not in static]
    hidden = next((i for i in inputs if "hidden_states" in names[i]), inputs[0] if inputs else None)
    return {"forward": graphs["forward"][0], "static": static, "hidden": hidden,
            "num_forward_outputs": counts["forward_outputs"]}


def saved_bytes(partitioned: dict[str, Any]) -> dict[str, int]:
    """Bytes the compiled block keeps for backward, by where: 'attention' (made before the first residual add: the
    input norm, q/k/v, attention), 'mlp' (after it), 'norms' (the block's input, when saved), 'shared' (inputs every
    block gets: masks, rotary tables; sized once by the estimator, not per block). Parameters are not counted.

    Each storage counts once, whichever views of it are saved: the fake values keep the storage a view aliases, so
    `t()` of a weight, a split of a fused projection or an `_unsafe_view` (no view op in the schema, but it aliases
    at run time) resolve to the tensor that owns the memory."""
    from torch.multiprocessing.reductions import StorageWeakRef

    gm = partitioned["forward"]
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    hidden = placeholders[partitioned["hidden"]] if partitioned["hidden"] is not None else None
    owner: dict = {}  # storage -> the first node whose value lives in it
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            owner.setdefault(StorageWeakRef(value.untyped_storage()), node)
    static = {placeholders[i] for i in partitioned["static"]}
    outputs = next(n for n in nodes if n.op == "output").args[0]
    residual = _first_residual_add(nodes, hidden)
    position = {n: i for i, n in enumerate(nodes)}
    out = {"attention": 0, "mlp": 0, "norms": 0, "shared": 0}
    seen: set = set()
    for node in outputs[partitioned["num_forward_outputs"]:]:
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, torch.Tensor):
            continue  # a SymInt
        storage = StorageWeakRef(value.untyped_storage())
        base = owner[storage]
        if storage in seen or base in static:
            continue
        seen.add(storage)
        num_bytes = value.untyped_storage().nbytes()
        if base is hidden:
            out["norms"] += num_bytes
        elif base.op == "placeholder":
            out["shared"] += num_bytes
        else:
            out["attention" if residual is None or position[base] < position[residual] else "mlp"] += num_bytes
    return out


def _first_residual_add(nodes, hidden):
    if hidden is None:
        return None
    for node in nodes:
        if node.op == "call_function" and "add" in str(node.target) and hidden in node.args:
            return node
    return None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def traced_saved_bytes(config: dict, kind_setup, kernels: str, shapes) -> list[dict[str, int]]:
    """`saved_bytes` of the first block of a 1-block copy of `config`, partitioned on fake tensors at each
    (micro-batch, sequence) of `shapes` under the setup a kind stands for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    with quiet_transformers():
        model, _notes = build_short(config, 1, kind_setup, fake_mode)
    blocks = named_blocks(model)
    if not blocks:
        raise RuntimeError(f"model_type '{config.get('model_type')}': no repeated blocks to compile")
    block = blocks[0][1]
    autocast = autocast_factory(kind_setup, "cpu")
    out = []
    for batch_size, seq_len in shapes:
        setup = kind_setup.replace(micro_batch_size=batch_size, seq_len=seq_len)
        with fake_mode, device_kernels(kernels), _named_swaps(), quiet_transformers():
            batch = make_hf_batch(config, model, setup)
            with autocast():
                args, kwargs = block_inputs(model, block, batch)
            out.append(saved_bytes(partition_block(block, args, kwargs, autocast=autocast)))
    return out


@contextlib.contextmanager
def _named_swaps():
    """memfit.trace.kernels swaps torch.nn.functional functions for functools.partial objects, which dynamo cannot
    trace (they have no __name__): the same calls behind named functions while the block is compiled."""
    import torch.nn.functional as F

    swapped = {name: getattr(F, name) for name in dir(F) if isinstance(getattr(F, name), functools.partial)}
    for name, partial in swapped.items():
        def call(*args, _partial=partial, **kwargs):
            return _partial(*args, **kwargs)
        call.__name__ = call.__qualname__ = name
        setattr(F, name, call)
    try:
        yield
    finally:
        for name, partial in swapped.items():
            setattr(F, name, partial)


def compile_blocks(model: torch.nn.Module, backend: str | Callable = "inductor") -> int:
    """Compile each repeated block in place (`nn.Module.compile`), as torchtune and torchtitan do; returns how many.
    `backend="partitioned"`: AOTAutograd with the min-cut partitioner whose graphs run as they are (no codegen):
    the same saved tensors as inductor's, without a C++ compiler."""
    from torch._subclasses.fake_tensor import is_fake

    on_fake = any(is_fake(p) for p in model.parameters())  # a trace: the partition without codegen, same tensors
    chosen = partitioned_backend() if backend == "partitioned" or on_fake else backend
    blocks = named_blocks(model)
    for _name, block in blocks:
        block.compile(backend=chosen)
    return len(blocks)


def partitioned_backend():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def run_as_is(gm, _example_inputs):
        return make_boxed_func(gm.forward)

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is, partition_fn=partition)


_COMPILED_CROSS_ENTROPY: list = []


def compiled_cross_entropy() -> Callable:
    """One chunk's cross-entropy compiled as torchtune compiles its loss (training.compile_loss: torch.compile of
    CEWithChunkedOutputLoss.compute_cross_entropy, inductor by default), one compiled function per process.

    Inductor, not the 'partitioned' backend, even on CPU: inductor decomposes log-softmax (its decomposition table)
    before the min-cut partition, so the graph saves the bf16 chunk and two per-row statistics instead of the fp32
    log-softmax, and its fused kernels never write the fp32 upcast; run as is, those graphs would."""
    if not _COMPILED_CROSS_ENTROPY:
        _COMPILED_CROSS_ENTROPY.append(torch.compile(chunk_cross_entropy, backend="inductor"))
    return _COMPILED_CROSS_ENTROPY[0]


def cross_entropy_saved(rows: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each tensor the compiled chunk cross-entropy keeps for backward, read off the min-cut
    partition of the joint graph after inductor's decompositions (torch._inductor.decomposition.select_decomp_table),
    on fake tensors: what `compiled_cross_entropy` saves at run time, without codegen."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    found: dict[str, Any] = {}

    def partition(joint, joint_inputs, **kw):
        found["forward_outputs"] = kw["num_fwd_outputs"]
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kw)

    def keep(gm, _inputs):
        found.setdefault("forward", gm)
        return gm

    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _inputs: gm, partition_fn=partition,
                           decompositions=select_decomp_table())
    import torch._dynamo

    torch._dynamo.reset()
    with FakeTensorMode():
        logits = torch.empty(rows, vocab, dtype=dtype, requires_grad=True)
        labels = torch.zeros(rows, dtype=torch.long)
        torch.compile(chunk_cross_entropy, backend=backend, dynamic=False)(logits, labels)
    torch._dynamo.reset()
    outputs = next(n for n in found["forward"].graph.nodes if n.op == "output").args[0]
    return [(tuple(n.meta["val"].shape), str(n.meta["val"].dtype).removeprefix("torch."))
            for n in outputs[found["forward_outputs"]:] if isinstance(n.meta.get("val"), torch.Tensor)]
