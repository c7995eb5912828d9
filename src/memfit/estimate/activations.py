"""What autograd keeps for backward, tensor by tensor, read off the model graph.

Each node kind of memfit.graph carries its own `saved` handler (memfit.graph.saved: the rows, their dtype classes
and where each formula was read); this module walks a spec's graph with the step's context and turns rows into
bytes: per layer (by group), after the last layer (final norm and head) and before the first (the embedding).
A graph with a node no handler models goes to memfit.derive (a fit of a traced 1- and 2-block copy), never to
another family's formula.
"""

from __future__ import annotations

from dataclasses import replace

from ..graph.saved import (Dtypes, NotModelledError, Saved, SavedCtx,  # noqa: F401  (Dtypes, Saved re-exported)
                           core_recomputed, saved_by)
from ..model_spec import ModelSpec
from ..setup import Attention, Checkpointing, TrainingSetup, fsdp2_mixed_precision
from . import derived


def dtypes(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> Dtypes:
    """The dtype classes of a step: the precision's, or with a LoRA base stored in 16 bits a 16-bit residual
    stream (the embedding and norms are bf16 too), or with a quantized base an fp32 one (peft's
    prepare_model_for_kbit_training upcasts the embedding and norms; the 4-bit Linears return their input's dtype;
    torchtune, and frameworks that skip the preparation (Finetune.kbit_prep False), upcast nothing: a 16-bit one)."""
    d = Dtypes.of(setup.precision, on_cpu)
    if setup.float8.is_on and on_cpu and d.autocast:  # memfit.estimate.float8: CPU autocast leaves the input as is
        return replace(d, float8_hp_input=True)
    if not spec.frozen:
        return d
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if base.quantized and fsdp2_mixed_precision(setup):
        # FSDP2's MixedPrecisionPolicy all-gathers the fp32 norms (and embedding) in bf16, so the residual stream
        # is bf16 too; the 4-bit Linears return their input's dtype (bench/lora_fsdp.py, 2 gloo ranks)
        return Dtypes(residual=2, compute=2, autocast=False, on_cpu=on_cpu, mlp_in_residual=True)
    if base.quantized and not setup.finetune.upcasts_unquantized():
        # torchtune, or no k-bit preparation: the embedding and norms stay in the model's dtype; linear_nf4 and
        # bitsandbytes' Linear4bit return their input's dtype
        return Dtypes(residual=2, compute=2, autocast=d.autocast, on_cpu=on_cpu)
    if base.quantized:
        return Dtypes(residual=4, compute=2 if d.autocast else 4, autocast=d.autocast, on_cpu=on_cpu,
                      mlp_in_residual=True)
    if base.value in ("bf16", "fp16"):
        return Dtypes(residual=2, compute=2, autocast=d.autocast, on_cpu=on_cpu)
    return d


def _graph(spec: ModelSpec):
    if spec.graph is None:
        raise NotModelledError(f"'{spec.name}' has no model graph to read its saved tensors off")
    return spec.graph


def _block(spec: ModelSpec):
    """The layer the formulas size (one stack of identical blocks: saved_problem checks it)."""
    return _graph(spec).stacks[0].block


def _attention(spec: ModelSpec):
    from ..graph import Attention as AttentionNode
    return next(n for n in _block(spec).nodes if isinstance(n, AttentionNode))


def _ctx(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> SavedCtx:
    """The step's context as a node of the spec's layer sees it: with that block's dropouts."""
    from ..graph import Dropout
    dropout = tuple((n.where, n.p) for n in _block(spec).nodes if isinstance(n, Dropout))
    return SavedCtx(setup=setup, seq_len=seq_len, d=d, frozen=bool(spec.frozen), dropout=dropout)


def layer_rows(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """The rows one layer keeps for backward (before LoRA's changes), off the graph's Block handler."""
    return saved_by(_block(spec), _ctx(spec, setup, seq_len, d))


_PROBLEMS: dict[int, tuple[object, str | None]] = {}
"""saved_problem's answers by the graph's id, each held with its graph (so the id names it while it is kept)."""
_PROBLEMS_KEPT = 256


def saved_problem(graph) -> str | None:
    """Why the `saved` handlers cannot size this graph (a node kind without one, a field no formula models, more
    than one kind of block), or None when they can. Remembered per graph (a frozen value): every estimate asks it
    two or three times (rms_gated_layer, separate_projections_layer), and a walk of the graph with a probe step
    was an eighth of a plan's time."""
    kept = _PROBLEMS.get(id(graph))
    if kept is not None and kept[0] is graph:
        return kept[1]
    problem = _saved_problem(graph)
    if len(_PROBLEMS) >= _PROBLEMS_KEPT:
        _PROBLEMS.clear()
    _PROBLEMS[id(graph)] = (graph, problem)
    return problem


def _saved_problem(graph) -> str | None:
    from ..graph import Embedding, Stack

    if graph is None:
        return "no model graph"
    if len({s.block for s in graph.stacks}) != 1 or not all(type(s) is Stack for s in graph.stacks):
        return "its layers are not one kind of block"
    if graph.stacks[0].after:
        return "nodes after its layers are not sized yet"
    setup = TrainingSetup()
    probe = SavedCtx(setup=setup, seq_len=1, d=Dtypes.of(setup.precision))
    nodes = [graph.embed, *graph.stacks[0].before, graph.stacks[0].block,
             *(n for n in (graph.final_norm, graph.head) if n is not None)]
    nodes += [n for n in graph.extra_params if type(n) is Embedding]
    try:
        for node in nodes:
            saved_by(node, probe)
    except NotModelledError as error:
        return str(error)
    except (TypeError, ValueError) as error:  # UnknownNodeKindError is a TypeError
        return str(error).split(";")[0]
    return None


def _rmsnorm(spec: ModelSpec, d: Dtypes, count: int = 1) -> list[Saved]:
    """The rows of the layer's first norm, `count` times (the MoE rows: memfit.estimate.moe)."""
    from ..graph import Norm
    norm = next(n for n in _block(spec).nodes if isinstance(n, Norm))
    return saved_by(norm, SavedCtx(setup=TrainingSetup(), seq_len=1, d=d)) * count


def _attention_core(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """q, k, v, output and softmax statistics (SDPA) or the T x T probabilities (eager) of the layer's attention."""
    from ..graph.kinds.attention import core_saved
    return core_saved(_attention(spec), _ctx(spec, setup, seq_len, d))


def rebuilt_core_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int, on_cpu: bool = False) -> int:
    """Bytes one layer's recomputed eager core rebuilds in its backward: its saved tensors without checkpointing,
    less what the checkpointed core keeps."""
    if not core_recomputed(setup):
        return 0
    plain = layer_saved_bytes(spec, setup.replace(checkpointing=Checkpointing.NONE), tokens, seq_len, on_cpu)
    kept = layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    return plain["attention"] - kept["attention"]


def _matmul_widths(spec: ModelSpec) -> list[tuple[str, int]]:
    """(group, output width) of each matmul of one layer, in the order the forward runs them."""
    from ..graph import dispatch
    if spec.graph is not None:
        return dispatch("matmuls", _block(spec))
    # a spec without a graph (a derived hub model): separate q/k/v and its numbers' MLP
    h, kv, inter = spec.hidden_size, spec.kv_dim, spec.intermediate_size
    q = spec.num_attention_heads * spec.head_dim or h
    mlp = [("mlp", inter), ("mlp", inter)] if spec.gated_mlp else [("mlp", inter)]
    return [("attention", q), ("attention", kv), ("attention", kv), ("attention", h)] + mlp + [("mlp", h)]


def selective_kept(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """What the selective-op policy keeps of one layer (memfit._torch.blocks.selective_op_context, torchtitan's op
    SAC): the 1st, 3rd, ... matmul outputs in the compute dtype, and the SDPA kernel's output and fp32 log-sum-exp.
    Eager attention's bmm / softmax are not on the list: recomputed. CPU SDPA with dropout takes the math path,
    whose ops are recomputed too."""
    rows = [Saved(group, width, "cmp") for i, (group, width) in enumerate(_matmul_widths(spec)) if i % 2 == 0]
    if _ctx(spec, setup, seq_len, d).sdpa_kernel:
        q = spec.num_attention_heads * spec.head_dim or spec.hidden_size
        rows += [Saved("attention", q, "cmp"), Saved("attention", spec.num_attention_heads, "f32")]
    return rows


def selective_kept_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                         on_cpu: bool = False) -> int:
    """Bytes one layer keeps between its forward and backward under selective-op (beyond its input)."""
    d = dtypes(spec, setup, on_cpu)
    return int(sum(d.bytes_of(r) for r in selective_kept(spec, setup, seq_len, d)) * tokens)


def eager_softmax_dtype(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> str:
    """The dtype class of the layer's eager softmax (memfit.graph.kinds.attention.eager_softmax_dtype)."""
    from ..graph.kinds.attention import eager_softmax_dtype as of_node
    return of_node(_attention(spec), _ctx(spec, setup, setup.seq_len, Dtypes.of(setup.precision, on_cpu)))


def attention_backward_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                             on_cpu: bool = False) -> int:
    """Transient T x T gradients while an eager (or CPU math-path) attention runs backward: the gradient of the
    probabilities and of the scores, in the softmax's dtype, beside its saved tensors."""
    d = Dtypes.of(setup.precision, on_cpu)
    ctx = _ctx(spec, setup, seq_len, d)
    if ctx.sdpa_kernel:
        return 0
    dtype = "f32" if setup.attention is Attention.SDPA else eager_softmax_dtype(spec, setup, on_cpu)
    # an fp32 softmax (Llama family) backward holds the gradient of its cast copy and its own; others hold one
    count = 2 if setup.attention is Attention.EAGER and dtype == "f32" else 1
    per_token = count * d.bytes_of(Saved("attention", spec.num_attention_heads * seq_len, dtype))
    if count == 2 and d.compute == 2 and not ctx.attention_dropout:
        # the probabilities' bf16 copy (saved for the matmul with v) is released once that matmul's backward ran
        per_token -= d.bytes_of(Saved("attention", spec.num_attention_heads * seq_len, "cmp"))
    return int(per_token * tokens)


def checkpointed_mask_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int) -> int:
    """Eager attention in a causal LM gets a B x 1 x T x T additive mask (model dtype) from transformers' masking
    utilities; under checkpointing it is an input of every checkpointed block, so it lives through backward."""
    if setup.attention is not Attention.EAGER or not spec.is_decoder:
        return 0
    return int(Dtypes.of(setup.precision).residual * tokens * seq_len)


def mask_kept(setup: TrainingSetup, num_layers: int) -> bool:
    """Whether some checkpoint holds the eager mask through backward (a checkpointed block's or core's input)."""
    return setup.checkpointing.checkpointed_blocks(num_layers) > 0 or core_recomputed(setup)


def activation_backward_factor(spec: ModelSpec) -> int:
    """I-sized gradients alive at once in the MLP's backward, net of the down-projection's saved input, freed once
    its backward ran: gelu_new's Python formula chains three (measured), torch's activations one."""
    return 2 if spec.hidden_act == "gelu_new" else 1


def layer_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                      on_cpu: bool = False) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward, by group (attention / mlp / norms)."""
    from . import moe
    if moe.applies(spec, setup):  # a graph with Experts: the MoE recipe (memfit.estimate.moe), not the derived model
        return moe.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    if spec.derived is not None:  # no formula for its nodes: memfit.derive's fit of a traced 1- and 2-block copy
        return derived.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    d = dtypes(spec, setup, on_cpu)
    items = layer_rows(spec, setup, seq_len, d)
    if spec.frozen:
        from .lora import adapted_layer
        items = adapted_layer(spec, setup, items, d)
    out = {"attention": 0.0, "mlp": 0.0, "norms": 0.0}
    for item in items:
        out[item.group] += d.bytes_of(item) * tokens
    # sequence parallelism: norms, residual dropouts (and the stream) are sequence-sharded between the TP ranks; the
    # projections' inputs ('lin' rows) are the all-gathered full tensors torch's PrepareModuleInput makes
    out["norms"] /= _sequence_share(setup)
    return {k: int(v) for k, v in out.items()}


def _sequence_share(setup: TrainingSetup) -> int:
    return setup.tp if setup.sequence_parallel else 1


def head_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, *, head_input: bool = True) -> dict[str, int]:
    """Bytes saved after the last layer and before the logits: the final norm's and the head's rows (BERT's MLM
    head: its transform too). `head_input=False`: a fused loss keeps no LM-head input (it saves the input's
    gradient instead)."""
    from . import moe
    spec = moe.as_recipe(spec, setup)
    if spec.derived is not None:
        return derived.head_saved_bytes(spec, setup, tokens)
    d = dtypes(spec, setup)
    graph = _graph(spec)
    ctx = SavedCtx(setup=setup, seq_len=setup.seq_len, d=d, frozen=bool(spec.frozen))
    rows = [r for node in (graph.final_norm, graph.head) if node is not None for r in saved_by(node, ctx)]
    if spec.frozen:  # a frozen final norm and LM head keep nothing for their weights
        rows = [r for r in rows if not r.role]
    if not head_input:
        rows = [r for r in rows if r.role != "head"]
    share = _sequence_share(setup)  # SP: the final norm is sequence-sharded, the head's input gathered whole
    return {"head": int(sum(d.bytes_of(r) / (1 if r.role == "head" else share) for r in rows) * tokens)}


def embedding_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                          on_cpu: bool = False) -> int:
    """What the input side keeps: the tables' indices (int64; a learned position table's once per position),
    the dropout mask and LayerNorm run on the embedding (BERT, GPT-2, Phi-3), and the rotary cos/sin tables
    shared by all layers."""
    from ..graph import Dropout, Embedding, Norm
    from . import moe
    spec = moe.as_recipe(spec, setup)
    if spec.derived is not None:
        return derived.embedding_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    d = dtypes(spec, setup, on_cpu)
    graph = _graph(spec)
    stack = graph.stacks[0]
    ctx = SavedCtx(setup=setup, seq_len=seq_len, d=d, frozen=bool(spec.frozen))
    tables = [graph.embed, *(n for n in graph.extra_params if type(n) is Embedding)]
    ids = int(sum(d.bytes_of(r) for t in tables for r in saved_by(t, ctx)) * tokens)
    ids += sum(8 * seq_len for t in tables if t.lookup == "positions" and not spec.frozen)
    # Under LoRA the embedding output needs a gradient only when peft's enable_input_require_grads marks it (the
    # Trainer does so with checkpointing); until then dropout keeps no mask and a LayerNorm no input.
    needs_grad = not spec.frozen or (setup.checkpointing is not Checkpointing.NONE
                                     and setup.finetune.asks_input_gradient())
    if needs_grad and any(type(n) is Dropout and n.where == "embedding" and n.p > 0 for n in stack.before):
        ids += int(d.bytes_of(Saved("norms", graph.embed.dim, d.mask)) * tokens)
    if needs_grad:
        ids += sum(int(sum(d.bytes_of(r) for r in saved_by(n, ctx)) * tokens) for n in stack.before if type(n) is Norm)
    attention = _attention(spec)
    if attention.position == "rope":
        # rotary cos/sin tables (1 x T x head_dim, shared by every layer), fp32 unless the model is pure bf16
        rotary = attention.head_dim * attention.rotary_fraction
        ids += int(2 * seq_len * rotary * d.residual)
    return ids


# ---- facts other estimators read off the layer (no family names) ------------------------------------------------

def _nodes_of(spec: ModelSpec, kind: type) -> list:
    if spec.graph is None or not spec.graph.stacks:
        return []
    return [n for n in spec.graph.stacks[0].block.nodes if type(n) is kind]


def first_norm_input_rows(spec: ModelSpec, d: Dtypes) -> list[Saved]:
    """What layer 0's first node keeps for its input's gradient alone: a pre-norm block's first norm (RMSNorm: the
    fp32 input and rsqrt; LayerNorm: its input, mean and rstd); nothing for a post-norm block, which starts with
    its projections."""
    from ..graph import Norm
    if spec.graph is None:  # a spec built without a graph: its norm kind says
        norm = Norm("layer" if spec.norm == "layernorm" else "rms", spec.hidden_size)
    else:
        norm = _block(spec).nodes[0]
        if type(norm) is not Norm:
            return []
    return [r for r in saved_by(norm, SavedCtx(setup=TrainingSetup(), seq_len=1, d=d)) if not r.role]


def rms_gated_layer(spec: ModelSpec) -> bool:
    """Whether the formulas size the layer and it is a pre-norm RMSNorm block with a gated MLP (the Llama-style
    layer whose checkpointed LoRA moments were measured: tests/lora/test_lora.py)."""
    from ..graph import MLP, Norm
    if spec.derived is not None or saved_problem(spec.graph) is not None:
        return False
    first, mlps = _block(spec).nodes[0], _nodes_of(spec, MLP)
    return type(first) is Norm and first.kind == "rms" and len(mlps) == 1 and mlps[0].gated


def separate_projections_layer(spec: ModelSpec) -> bool:
    """An RMSNorm pre-norm block with separate q/k/v and gate/up projections and no sandwich or parallel residual
    (the layer whose late-backward moments tests/estimate/test_loss_and_inbwd.py measured)."""
    from ..graph import MLP, Norm
    from ..graph import Attention as AttentionNode
    if not rms_gated_layer(spec):
        return False
    block = _block(spec)
    attention, mlp = _nodes_of(spec, AttentionNode), _nodes_of(spec, MLP)
    return (not block.sandwich_norms and not block.parallel_residual and len(attention) == 1
            and not attention[0].fused_qkv and len(mlp[0].up) == 2
            and not any(n.fp32_output for n in _nodes_of(spec, Norm)))


def column_parallel_inputs(spec: ModelSpec) -> int:
    """Column-parallel projections per layer whose input gradient tensor parallelism all-reduces: q, k, v (one when
    fused) and gate, up (one when fused, or a plain MLP's fc1)."""
    from ..graph import MLP
    from ..graph import Attention as AttentionNode
    return sum(len(n.qkv) for n in _nodes_of(spec, AttentionNode)) + sum(len(n.up) for n in _nodes_of(spec, MLP))


def logits_upcast(spec: ModelSpec) -> bool:
    """Whether the loss upcasts the logits to fp32 (the head's `logits_upcast`; causal LMs when no graph says)."""
    head = spec.graph.head if spec.graph is not None else None
    return bool(getattr(head, "logits_upcast", True))


def attention_softcapped(spec: ModelSpec) -> bool:
    """Whether the layer's attention soft-caps its logits (Gemma 2), which torch SDPA cannot do."""
    from ..graph import Attention as AttentionNode
    return any(n.softcap for n in _nodes_of(spec, AttentionNode))


def projection_input_rows(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """The projections' inputs of one layer, one row per input tensor (q/k/v share one, gate/up one), by group:
    the sized layer's own rows where the formulas size it, else each Attention's and MLP's inputs off the graph."""
    from ..graph import MLP
    from ..graph import Attention as AttentionNode
    from .lora import _GROUP_OF_ROLE
    if spec.derived is None and saved_problem(spec.graph) is None:
        return [replace(r, readers=1) for r in layer_rows(spec, setup, seq_len, d) if r.role in _GROUP_OF_ROLE]
    rows: list[Saved] = []
    for n in _nodes_of(spec, AttentionNode):
        rows += [Saved("attention", n.hidden, "lin", role="qkv"), Saved("attention", n.out.in_features, "cmp",
                                                                          role="out")]
    for n in _nodes_of(spec, MLP):
        rows += [Saved("mlp", n.hidden, "lin", role="up"), Saved("mlp", n.down.in_features, "cmp", role="down")]
    return rows
