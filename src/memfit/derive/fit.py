"""Derive a block memory model by tracing shortened copies of a transformers model on fake tensors.

For one setup kind: build the model with 1 and with 2 blocks, run forward and backward (memfit's own step, without
the optimizer) at a few small (micro-batch, sequence) shapes under memfit's StepTracker, and fit

- per block: what forward leaves alive with 2 blocks minus with 1 (split by group from the allocating modules);
- the embedding side: what the modules that run before the first block keep (ids, position tables, masks);
- the head side: what the modules after the last block keep, except the LM head's logits and the loss, which the
  estimator sizes from the vocabulary itself;
- one block's backward temporaries: the live bytes at each moment of the last block's backward, beyond what the
  estimator already counts then (every block's saved tensors, the embedding's, the LM head's gradient). Each moment
  is linear in the shape; the peak is the largest of them, so the envelope of those lines is kept.

The fit is checked on a held-out shape; a model whose memory is not linear in these terms is refused.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from .._version import __version__
from ..errors import ModelSourceError
from .model import GROUPS, KindFit, Linear, kind_adapters, kind_setup

FIT_SHAPES = ((2, 16), (3, 16), (2, 32), (3, 48))
CHECK_SHAPE = (4, 40)
"""Micro-batches of 2 or more: at 1 some reshapes are views where they are copies otherwise."""
TOLERANCE = 2e-3
"""Relative error allowed on the held-out shape (plus a few hundred bytes for scalars)."""

_ATTENTION_WORDS = ("attn", "attention")
_MLP_WORDS = ("mlp", "ffn", "feed_forward", "experts", "moe", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h",
              "intermediate", "c_fc")

Progress = Callable[[str, float], None]


DENSE_PREFIX_KEY = "first_k_dense_replace"
"""DeepSeek-style MoE: the first k blocks have a dense MLP, the rest routed experts."""


def dense_prefix(config: dict[str, Any], num_layers: int) -> int:
    """How many leading blocks are dense in a model whose config says `first_k_dense_replace` (0 otherwise)."""
    value = config.get(DENSE_PREFIX_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return 0
    return min(value, num_layers)


def short_config(config: dict[str, Any], num_layers: int, *, dense: bool = False,
                 layer_type: str | None = None) -> dict[str, Any]:
    """The config with `num_layers` blocks (per-layer lists such as `layer_types` cut to match, or every layer of
    `layer_type`). A config with a dense prefix (`first_k_dense_replace`) gets copies of its repeated, routed-expert
    block (`dense=False`) or of its dense block (`dense=True`): a 1- or 2-block copy would otherwise hold only dense
    blocks."""
    from .._torch.step import hf_config_from_dict

    hf = hf_config_from_dict(config)
    if getattr(hf, "is_encoder_decoder", False):
        raise ModelSourceError(f"model_type '{config.get('model_type')}' is an encoder-decoder: memfit.derive "
                               "sizes one stack of repeated blocks (decoder-only and encoder-only models)")
    out = copy.deepcopy(dict(config))
    names = [k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in out]
    key = hf.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    for name in set(names) | {key}:
        out[name] = num_layers
    for name, value in list(out.items()):
        if isinstance(value, list) and name in ("layer_types", "layers_block_type", "block_types") and value:
            out[name] = (value * num_layers)[:num_layers]
    if layer_type is not None:
        out["layer_types"] = [layer_type] * num_layers
    if dense_prefix(config, int(getattr(hf, "num_hidden_layers", 0) or 0)):
        out[DENSE_PREFIX_KEY] = num_layers if dense else 0
    return out


def num_layers_of(config: dict[str, Any]) -> int:
    from .._torch.step import hf_config_from_dict

    return int(getattr(hf_config_from_dict(config), "num_hidden_layers", 0) or 0)


def build_short(config: dict[str, Any], num_layers: int, setup, fake_mode, *, dense: bool = False,
                layer_type: str | None = None):
    from ..trace.session import build_hf_model

    notes: list[str] = []
    with fake_mode:
        model = build_hf_model(short_config(config, num_layers, dense=dense, layer_type=layer_type), setup, notes)
    return model, notes


def layer_type_counts(config: dict[str, Any]) -> dict[str, int]:
    """How many layers of each type a model with several (`layer_types`: Gemma 3's sliding and full attention
    layers, five to one) has; empty for one type."""
    from .._torch.step import hf_config_from_dict

    hf = hf_config_from_dict(config)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    types = getattr(text, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(set(types)) < 2:
        return {}
    return {t: list(types).count(t) for t in dict.fromkeys(types)}


def _blocks(model) -> list[tuple[str, Any]]:
    from .._torch.blocks import named_blocks

    return named_blocks(model)


def _group(name: str) -> str:
    low = name.lower()
    if any(w in low for w in _ATTENTION_WORDS):
        return "attention"
    if any(w in low for w in _MLP_WORDS):
        return "mlp"
    return "norms"


def _input_grads_runs(config: dict[str, Any], base, shapes, kernels: str) -> list[dict[str, Any]]:
    """The 1-block copy whose embedding output requires grad (peft's enable_input_require_grads), measured at
    `shapes`: its block 0 keeps what every later block keeps."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    model, _ = build_short(config, 1, base, fake_mode)
    model.enable_input_require_grads()
    return [_measure(model, config, base.replace(micro_batch_size=batch, seq_len=seq), kernels, fake_mode)
            for batch, seq in shapes]


def _first_block_unsaved(input_grads: dict[str, Any], one: dict[str, Any]) -> int:
    """Under LoRA, what block 0 keeps less than the others: what the 1-block copy keeps more with its input
    requiring grad, but the embedding output that copy holds as a leaf where it is not block 0's input itself."""
    return input_grads["forward_end"] - one["forward_end"] - input_grads["leaf_bytes"]


class _Probe:
    """What _measure's hooks record through one forward + backward: the order modules first ran in, the storages at
    the block stack's edges (block 0's input, the embedding output, the last block's output, the logits; weak
    references), their bytes when backward starts, and the tracker's event count where the last block's backward
    starts and ends (gradient hooks on its output and on its input)."""

    def __init__(self, model, tracker):
        import torch

        self.tensor = torch.Tensor
        self.tracker = tracker
        self.names = {id(m): n for n, m in model.named_modules()}
        self.marks: dict[str, int] = {}
        self.order: list[str] = []
        self.seen: set[str] = set()
        self.edges: dict[str, weakref.ref] = {}
        self.edge_bytes: dict[str, int] = {}
        self.lm_head = ""

    def attach(self, model, first, last) -> list:
        """Install the hooks on `model` (block 0 `first`, the last block `last`); the handles to remove."""
        from torch.nn.modules import module as nn_module

        output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.lm_head = self.names.get(id(output_embeddings), "") if output_embeddings is not None else ""
        handles = [nn_module.register_module_forward_pre_hook(self.first_call),
                   first.register_forward_pre_hook(self.first_in, with_kwargs=True),
                   last.register_forward_pre_hook(self.block_in, with_kwargs=True),
                   last.register_forward_hook(self.block_out, with_kwargs=True)]
        if output_embeddings is not None:
            handles.append(output_embeddings.register_forward_hook(self.head_out))
        input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if input_embeddings is not None:
            handles.append(input_embeddings.register_forward_hook(self.embedding_out))
        return handles

    def first_call(self, module, _args):
        name = self.names.get(id(module))
        if name is not None and name not in self.seen:
            self.seen.add(name)
            self.order.append(name)

    def _hidden(self, args, kwargs):
        return args[0] if args else next((v for v in kwargs.values() if isinstance(v, self.tensor)), None)

    def first_in(self, _module, args, kwargs):
        hidden = self._hidden(args, kwargs)
        if isinstance(hidden, self.tensor):
            self.edges.setdefault("in", weakref.ref(hidden.untyped_storage()))
            self.edge_bytes.setdefault("leaf", _apart_bytes(self.edges.get("embedding"), hidden))

    def embedding_out(self, _module, _args, output):
        if isinstance(output, self.tensor):
            self.edges.setdefault("embedding", weakref.ref(output.untyped_storage()))

    def block_in(self, _module, args, kwargs):
        hidden = self._hidden(args, kwargs)
        if isinstance(hidden, self.tensor) and hidden.requires_grad:
            hidden.register_hook(lambda g: self.marks.setdefault("end", self.tracker.events) and None)

    def block_out(self, _module, _args, _kwargs, output):
        out = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
        if isinstance(out, self.tensor):
            self.edges["out"] = weakref.ref(out.untyped_storage())
            if out.requires_grad:
                out.register_hook(lambda g: self.marks.setdefault("start", self.tracker.events) and None)

    def head_out(self, _module, _args, output):
        if isinstance(output, self.tensor):
            self.edges["logits"] = weakref.ref(output.untyped_storage())

    def phase(self, phase):
        """The step's phase callback: the edges' bytes as backward starts, then the tracker's mark."""
        if str(phase) == "backward" and "in" not in self.edge_bytes:
            self.edge_bytes.update({edge: activation_bytes(self.tracker, self.edges.get(edge))
                                    for edge in ("in", "out", "logits")})
        self.tracker.mark(phase)

    def result(self, blocks: list[tuple[str, Any]], counted: tuple[int, ...]) -> dict[str, Any]:
        """_measure's answer; `counted`: the tracker's kinds (columns of its history) that are not static."""
        tracker = self.tracker
        history = tracker._history  # live bytes per kind after each event

        def live(index: int) -> int:
            return sum(history[index - 1][k] for k in counted) if index > 0 else 0

        backward_at = next(e for e, _s, phase in tracker.marks if str(getattr(phase, "value", phase)) == "backward")
        start, end = self.marks.get("start", backward_at), self.marks.get("end", tracker.events)
        edge = self.edge_bytes
        return {"forward_end": live(backward_at), "saved": dict(tracker.saved_by_module), "order": self.order,
                "blocks": [n for n, _ in blocks], "in_bytes": edge.get("in", 0), "out_bytes": edge.get("out", 0),
                "logits_bytes": edge.get("logits", 0), "leaf_bytes": edge.get("leaf", 0), "lm_head": self.lm_head,
                "window": [live(i) for i in range(max(start, 1), max(end, start) + 1)]}


def _measure(model, config: dict[str, Any], setup, kernels: str, fake_mode) -> dict[str, Any]:
    """One forward + backward at `setup`'s shape: live bytes at forward end, saved bytes per allocating module, the
    order modules first ran in, and the live (non-static) bytes through the last block's backward."""
    from .._torch import step as runner
    from ..trace.kernels import device_kernels, hidden_scratch
    from ..trace.session import make_hf_batch, routed_experts
    from ..trace.tracker import StepTracker, _Kind

    with fake_mode:
        batch = make_hf_batch(config, model, setup)
    blocks = _blocks(model)
    if not blocks:
        raise ModelSourceError(f"model_type '{config.get('model_type')}': no repeated blocks found to derive from")
    tracker = StepTracker(num_steps=1, hidden_scratch=hidden_scratch(kernels))  # the trace's kernel model
    probe = _Probe(model, tracker)
    handles = probe.attach(model, blocks[0][1], blocks[-1][1])
    try:
        tracker.watch_module(model)
        tracker.register_tree(batch, _Kind.INPUTS)
        with device_kernels(kernels), routed_experts(), fake_mode, tracker:
            runner.forward_backward(model, None, batch, setup.replace(grad_accum_steps=1), phase_callback=probe.phase)
    finally:
        for handle in handles:
            handle.remove()
        for param in model.parameters():
            param.grad = None
    static = (_Kind.PARAMETERS, _Kind.BUFFERS, _Kind.OPTIMIZER, _Kind.GATHERED)
    return probe.result(blocks, tuple(k for k in _Kind if k not in static))


def _apart_bytes(embedded: weakref.ref | None, hidden) -> int:
    """Bytes of the embedding output when it is a storage apart from block 0's input `hidden` (learned positions
    added to it), else 0."""
    alive = embedded() if embedded is not None else None
    return alive.nbytes() if alive is not None and alive._cdata != hidden.untyped_storage()._cdata else 0


def activation_bytes(tracker, storage: weakref.ref | None) -> int:
    """The bytes of a storage the tracker counts as an activation, 0 when it is dead or something else. Held by a
    weak reference, not by id(): the hidden state entering the first block or leaving the last (and a 16-bit
    logits tensor the loss upcasts) is often freed before backward (a norm that upcasts saves its fp32 copy), and
    CPython then gives its address to another object, so an id looked up later could name an unrelated live
    storage: how much depends on what the process allocated before (a fit that came out non-linear in its
    embedding group only after other tests, under CI's -n 2)."""
    from ..trace.tracker import _Kind

    alive = storage() if storage is not None else None
    if alive is None:
        return 0
    record = tracker._records.get(id(alive))
    return record.nbytes if record is not None and record.kind is _Kind.ACTIVATIONS else 0


def _split(measure: dict[str, Any], block_index: int) -> dict[str, int]:
    """Saved bytes by where they were allocated: 'embedding' (before the first block), block groups (under block
    `block_index`), 'head' (after the last block, except the LM head and the loss), 'lm_head', 'root'."""
    blocks = measure["blocks"]
    order = measure["order"]
    last_block = blocks[-1]
    after_last = max((i for i, n in enumerate(order) if n == last_block or n.startswith(last_block + ".")),
                     default=len(order))
    target = blocks[block_index]
    out = {"embedding": 0, "head": -measure["logits_bytes"], "root": 0, **{g: 0 for g in GROUPS}}
    known = set(order)
    for name, num_bytes in measure["saved"].items():
        if name == "(model)" or name not in known:  # the loss (in the root's forward, or a loss module it makes)
            out["root"] += num_bytes
            continue
        if name == target or name.startswith(target + "."):
            out[_group(name[len(target):])] += num_bytes
            continue
        if any(name == b or name.startswith(b + ".") for b in blocks):
            continue
        position = order.index(name) if name in order else -1
        out["head" if position > after_last else "embedding"] += num_bytes
    return out


def _block_groups(one: dict[str, Any], two: dict[str, Any]) -> dict[str, int]:
    """What the second block of a 2-block copy keeps, by group (the rest of the difference to the 1-block copy is
    the norms' and the block's own glue)."""
    split = _split(two, 1)
    block_total = two["forward_end"] - one["forward_end"]
    grouped = {"attention": split["attention"], "mlp": split["mlp"]}
    grouped["norms"] = block_total - grouped["attention"] - grouped["mlp"]
    return grouped


def _solve(rows: list[list[int]], values: list[int]) -> Linear:
    """Exact solution of the 4 x 4 system (basis tokens, tokens x seq, seq, 1)."""
    n = len(rows)
    m = [[Fraction(x) for x in row] + [Fraction(v)] for row, v in zip(rows, values)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if m[r][col] != 0)
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return Linear(*(float(m[i][n] / m[i][i]) for i in range(n)))


def _basis(batch: int, seq: int) -> list[int]:
    return [batch * seq, batch * seq * seq, seq, 1]


def _envelope(lines: list[Linear], shapes: list[tuple[int, int]]) -> tuple[Linear, ...]:
    """The lines that are the largest somewhere on a grid of real shapes (and at the fit shapes)."""
    grid = [(b, t) for b in (1, 2, 4, 8, 16, 64) for t in (16, 48, 128, 512, 2048, 8192, 32768, 131072)]
    grid += shapes
    keep: list[Linear] = []
    for b, t in grid:
        best = max(lines, key=lambda line: line(b * t, t))
        if best not in keep:
            keep.append(best)
    return tuple(keep)


def derive_kind(config: dict[str, Any], kind: str, *, progress: Progress | None = None) -> KindFit:
    """Trace the 1- and 2-block copies at FIT_SHAPES and CHECK_SHAPE under `kind`, fit and check. A model with a
    sliding window under sdpa is fitted on each side of it (KindFit.beyond: the same shapes moved past the window),
    or past it only where the window falls among the shapes."""
    window = sliding_window(config, kind)
    if window <= min(seq for _, seq in FIT_SHAPES):  # no window, or every shape is past it
        return _derive(config, kind, FIT_SHAPES, CHECK_SHAPE, progress)
    beyond = _derive(config, kind, tuple((b, window + t) for b, t in FIT_SHAPES),
                     (CHECK_SHAPE[0], window + CHECK_SHAPE[1]), progress)
    if window <= max(seq for _, seq in (*FIT_SHAPES, CHECK_SHAPE)):
        return beyond  # the shapes straddle the window: below it, this over-counts the sliding layers' mask
    below = _derive(config, kind, FIT_SHAPES, CHECK_SHAPE, progress)
    return replace(below, window=window, beyond=beyond)


def sliding_window(config: dict[str, Any], kind: str) -> int:
    """The sliding window past which transformers builds sliding layers' sdpa mask; 0 without one (or under eager
    attention, whose mask is always built)."""
    if "/eager/" in kind:
        return 0
    from .._torch.step import hf_config_from_dict

    hf = hf_config_from_dict(config)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if (not isinstance(window, int) or isinstance(window, bool) or window <= 0
            or getattr(text, "use_sliding_window", True) is False
            or (layer_types and "sliding_attention" not in layer_types)):
        return 0
    return window


@dataclass(frozen=True)
class _Depth:
    """Which short copies a model needs: the repeated block's, with a dense prefix (`first_k_dense_replace`) the
    dense block's too, and with several layer types (`layer_types`) one per type; the estimator multiplies one
    block by the depth, so the derived block is their depth-weighted mean."""

    num_layers: int
    num_dense: int
    mix: dict[str, int]
    """layer type -> how many layers have it (empty with a dense prefix or one type)"""

    @classmethod
    def of(cls, config: dict[str, Any]) -> _Depth:
        num_layers = num_layers_of(config)
        num_dense = dense_prefix(config, num_layers)
        return cls(num_layers, num_dense, {} if num_dense else layer_type_counts(config))

    @property
    def copies(self) -> list[tuple[bool, str | None]]:
        """(dense, layer type) of each copy to build at 1 and 2 blocks."""
        return [(False, None)] + ([(True, None)] if self.num_dense else []) + [(False, t) for t in self.mix]

    def block(self, runs: dict, i: int, grouped: dict[str, int]) -> dict[str, int]:
        """The block at shape `i`: the repeated copy's `grouped`, or the depth-weighted mean of the copies'."""
        if self.num_dense:
            # DeepSeek's first_k_dense_replace: the leading blocks have a dense MLP and keep other tensors than the
            # routed ones (modeling_deepseek_v2.DeepseekV2DecoderLayer picks DeepseekV2MLP or DeepseekV2MoE by
            # layer index). Exact for what all blocks keep together.
            dense = _block_groups(runs[(True, None), 1][i], runs[(True, None), 2][i])
            routed = self.num_layers - self.num_dense
            return {g: round(Fraction(self.num_dense * dense[g] + routed * grouped[g], self.num_layers))
                    for g in GROUPS}
        if self.mix:
            # layers of several types (Gemma 3 under sdpa: a sliding layer keeps the float mask its memory-efficient
            # kernel is handed, a full layer none; ATen sdp_utils convert_boolean_attn_mask): the same mean
            by_type = {t: _block_groups(runs[(False, t), 1][i], runs[(False, t), 2][i]) for t in self.mix}
            return {g: round(Fraction(sum(n * by_type[t][g] for t, n in self.mix.items()), self.num_layers))
                    for g in GROUPS}
        return grouped


def _trace_copies(config: dict[str, Any], kind: str, depth: _Depth, shapes: list[tuple[int, int]],
                  progress: Progress | None) -> dict:
    """(copy, 1 or 2 blocks) -> _measure at each of `shapes`; under LoRA also ((False, 'input-grads'), 1): the
    1-block copy again, its embedding output requiring grad (block 0 under LoRA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    base, kernels = kind_setup(kind)
    adapters = kind_adapters(kind) is not None
    runs: dict[tuple[tuple[bool, str | None], int], list[dict[str, Any]]] = {}
    total = (2 * len(depth.copies) + adapters) * len(shapes)
    done = 0
    if adapters:
        runs[(False, "input-grads"), 1] = _input_grads_runs(config, base, shapes, kernels)
        done += len(shapes)
    for dense, layer_type in depth.copies:
        for layers in (1, 2):
            fake_mode = FakeTensorMode()
            model, _notes = build_short(config, layers, base, fake_mode, dense=dense, layer_type=layer_type)
            runs[(dense, layer_type), layers] = []
            what = "dense " if dense else f"{layer_type} " if layer_type else ""
            for batch, seq in shapes:
                if progress is not None:
                    progress(f"{layers}-block {what}copy, batch {batch} x seq {seq}", done / total)
                setup = base.replace(micro_batch_size=batch, seq_len=seq)
                runs[(dense, layer_type), layers].append(_measure(model, config, setup, kernels, fake_mode))
                done += 1
    if progress is not None:
        progress("fitting", 1.0)
    return runs


def _shape_terms(runs: dict, i: int, tokens: int, depth: _Depth, adapters: bool, head_grad: int) -> dict[str, Any]:
    """What the traces at shape `i` (`tokens` = batch x seq) give each fitted term: the block by group, the
    embedding and head sides, block 0's LoRA terms, and the last block's backward window beyond what the estimator
    counts then (`head_grad`: the LM head's gradient bytes)."""
    one, two = runs[(False, None), 1][i], runs[(False, None), 2][i]
    split_one = _split(one, 0)
    grouped = _block_groups(one, two)
    routed_total = sum(grouped.values())  # the 2-block copy's backward window holds two of these
    first = _first_block_unsaved(runs[(False, "input-grads"), 1][i], one) if adapters else 0
    reference = 2 * routed_total - first + split_one["embedding"] - one["in_bytes"] + 16 * tokens + head_grad
    # the hidden state entering the first block is allocated by the embedding side but saved by the block (its
    # norm reads it), the last block's output is saved by the head's final norm: count them where they are saved
    return {"block": depth.block(runs, i, grouped), "embedding": split_one["embedding"] - one["in_bytes"],
            "head": split_one["head"] + one["out_bytes"], "first": first, "leaf": one["leaf_bytes"],
            "window": [v - reference for v in two["window"]]}


@dataclass(frozen=True)
class _Fitted:
    """The lines fitted at the fit shapes."""

    block: dict[str, Linear]
    embedding: Linear
    head: Linear
    temporaries: tuple[Linear, ...]
    lora: dict[str, Linear]

    @classmethod
    def of(cls, per_shape: list[dict[str, Any]], fit_shapes, shapes: list[tuple[int, int]],
           adapters: bool) -> _Fitted:
        fit_rows = [_basis(b, t) for b, t in fit_shapes]
        n_fit = len(fit_shapes)

        def fit(values: list[int]) -> Linear:
            return _solve(fit_rows, values[:n_fit])

        lengths = {len(s["window"]) for s in per_shape}
        if len(lengths) == 1:
            lines = [fit([s["window"][j] for s in per_shape]) for j in range(lengths.pop())]
        else:  # the op sequence changed with the shape: fit the peak itself
            lines = [fit([max(s["window"]) for s in per_shape])]
        return cls(block={g: fit([s["block"][g] for s in per_shape]) for g in GROUPS},
                   embedding=fit([s["embedding"] for s in per_shape]), head=fit([s["head"] for s in per_shape]),
                   temporaries=_envelope(lines, shapes) if lines else (Linear(),),
                   lora={what: fit([s[what] for s in per_shape]) for what in ("first", "leaf")} if adapters else {})


def _check(config: dict[str, Any], fitted: _Fitted, per_shape: list[dict[str, Any]], fit_shapes,
           check_shape: tuple[int, int]) -> float:
    """The largest relative error of the fitted lines at the held-out `check_shape` (per_shape's last); a line
    off by more than TOLERANCE is refused."""
    check_b, check_t = check_shape
    held = per_shape[-1]
    checks = {f"block {g}": (fitted.block[g], held["block"][g]) for g in GROUPS}
    checks.update({"embedding": (fitted.embedding, held["embedding"]), "head": (fitted.head, held["head"])})
    checks.update({f"block 0 under LoRA ({what})": (line, held[what]) for what, line in fitted.lora.items()})
    worst = 0.0
    for what, (line, measured) in checks.items():
        predicted = line(check_b * check_t, check_t)
        error = abs(predicted - measured)
        scale = max(abs(measured), sum(abs(v) for v in held["block"].values()))
        if error > TOLERANCE * scale + 512:
            part = what.removeprefix("block ")
            traced = ", ".join(f"{b}x{t}: {(s['block'][part] if what.startswith('block ') else s[part]):,} B"
                               for (b, t), s in zip(fit_shapes, per_shape))
            raise ModelSourceError(
                f"model_type '{config.get('model_type')}': what a block keeps is not linear in batch and sequence "
                f"({what}: fit {predicted:,} B vs traced {measured:,} B at batch {check_b} x seq {check_t}; traced "
                f"at the fit shapes {traced}); use `memfit trace` for this model")
        worst = max(worst, error / max(scale, 1))
    predicted_peak = max(t(check_b * check_t, check_t) for t in fitted.temporaries)
    measured_peak = max(held["window"]) if held["window"] else 0
    scale = sum(abs(v) for v in held["block"].values())
    if abs(predicted_peak - measured_peak) > TOLERANCE * scale + 512:
        raise ModelSourceError(
            f"model_type '{config.get('model_type')}': a block's backward peak is not linear in batch and sequence "
            f"(fit {predicted_peak:,} B vs traced {measured_peak:,} B); use `memfit trace` for this model")
    return max(worst, abs(predicted_peak - measured_peak) / max(scale, 1))


def _derive(config: dict[str, Any], kind: str, fit_shapes, check_shape, progress: Progress | None) -> KindFit:
    """Trace the short copies at `fit_shapes` and `check_shape`, fit each term on the first and check it on the
    second."""
    base, _kernels = kind_setup(kind)
    shapes = list(fit_shapes) + [check_shape]
    depth = _Depth.of(config)
    adapters = kind_adapters(kind) is not None
    runs = _trace_copies(config, kind, depth, shapes, progress)
    vocab, hidden = _vocab_hidden(config)
    # under LoRA the LM head is frozen: no gradient of it to count as the estimator's
    head_grad = 0 if adapters else vocab * hidden * base.precision.param_bytes
    per_shape = [_shape_terms(runs, i, batch * seq, depth, adapters, head_grad)
                 for i, (batch, seq) in enumerate(shapes)]
    fitted = _Fitted.of(per_shape, fit_shapes, shapes, adapters)
    worst = _check(config, fitted, per_shape, fit_shapes, check_shape)
    return KindFit(kind=kind, block=fitted.block, head=fitted.head, embedding=fitted.embedding,
                   temporaries=fitted.temporaries, fit_error=worst, shapes=tuple(shapes), versions=versions(),
                   lora=fitted.lora)


def _vocab_hidden(config: dict[str, Any]) -> tuple[int, int]:
    from .._torch.step import hf_config_from_dict

    hf = hf_config_from_dict(config)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return int(getattr(text, "vocab_size", 0) or 0), int(getattr(text, "hidden_size", 0) or 0)


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "memfit": __version__}


@contextlib.contextmanager
def quiet_transformers():
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
