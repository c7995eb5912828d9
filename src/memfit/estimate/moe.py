"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, OLMoE): what they keep for backward, read off the graph's
`Experts` node, and the routing assumption those bytes rest on.

Sources: transformers 5.24 modelling code, read and checked tensor by tensor with saved_tensors_hooks on tiny real
models (CPU, torch 2.13): the routers (`MixtralTopKRouter`, `Qwen2MoeTopKRouter`, `OlmoeTopKRouter`), the experts'
`grouped_mm` and `eager` implementations (transformers/integrations/moe.py, `grouped_mm_experts_forward` and the
per-expert loop each `*Experts.forward` keeps) and `load_balancing_loss_func` (modeling_mixtral.py).

What one MoE layer keeps, per token (T tokens, top_k = k, E experts, expert intermediate I, hidden h):

- router: its input (a Linear's), the fp32 softmax over E logits, the k top-k indices (int64); with
  normalize_topk the sum and the normalised k weights (fp32);
- grouped_mm experts, per routed row (T x k of them): the token gathered in expert order (h), the gate/up output
  (2I: silu keeps the gate half, the product keeps the up half, both views of one tensor), silu's output (I), the
  product (I, the down projection's input), the down output (h, kept by the routing-weight multiply), the routing
  weight (1) and three int64 index vectors (gather, weight gather, inverse permutation). These run in the experts'
  parameter dtype: torch's grouped_mm is not an autocast op, so under amp the experts compute in fp32;
- eager (looped) experts: the same rows per expert slice, but each F.linear autocasts: under amp the rows are bf16
  copies and every expert's weight slice is cast (no autocast cache for a non-leaf slice) and saved;
- shared expert (Qwen2-MoE): a dense gated MLP, and its sigmoid gate's output and the gated MLP's output.

Routing: fake tensors have no values, so a trace sends every token to exactly k experts, balanced (memfit.trace
MOE_NOTE); transformers' experts are dropless, so T x k rows go through the experts however the tokens route and
the saved bytes above do not depend on balance. What does: one expert's share (the eager loop's per-expert
temporaries), and with expert parallelism the rows a rank receives (balanced T x k; a capacity factor c caps it at
c x T x k; dropless, up to ep x T x min(k, E / ep)). memfit sizes the balanced case and shows the worst as a named
range.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..model_spec import ModelSpec, ParamTensor
from ..setup import TrainingSetup
from .activations import Dtypes, Saved
from .result import Category, Term
from .terms import TermKey

SOURCE = "transformers 5.24 integrations/moe.py + *TopKRouter, checked with saved_tensors_hooks on tiny real models"
IMPLEMENTATIONS = ("grouped_mm", "eager")


@dataclass(frozen=True)
class MoeBlock:
    """One kind of layer of an MoE model: `count` of them; `experts` None for a dense layer (Qwen2-MoE's
    mlp_only_layers), then `mlp` is its MLP node."""

    count: int
    attention: object
    experts: object | None
    mlp: object | None


def _blocks(spec: ModelSpec) -> tuple[MoeBlock, ...] | None:
    graph = getattr(spec, "graph", None)
    if graph is None:
        return None
    from ..graph.kinds.attention import Attention
    from ..graph.kinds.mlp import MLP, Experts

    cached = _CACHE.get(id(graph))
    if cached is not None and cached[0] is graph:
        return cached[1]
    found: list[MoeBlock] | None = []
    for stack in graph.stacks:
        block = stack.block
        attn = [n for n in block.nodes if isinstance(n, Attention)]
        experts = [n for n in block.nodes if isinstance(n, Experts)]
        mlps = [n for n in block.nodes if isinstance(n, MLP)]
        # OLMoE's q/k norms: their rows are written (_attention_rows) but the block's backward peak with them is not
        # checked yet (+1.5-1.9% on measured tiny steps): memfit.derive sizes it
        if (len(attn) != 1 or attn[0].latent_kv is not None or attn[0].kind != "causal" or attn[0].norms
                or block.parallel_residual
                or block.sandwich_norms or len(experts) + len(mlps) != 1):
            found = None
            break
        found.append(MoeBlock(stack.count, attn[0], experts[0] if experts else None, mlps[0] if mlps else None))
    result = tuple(found) if found and any(b.experts is not None for b in found) else None
    if result is not None and not all(_recipe_fits(b.experts) for b in result if b.experts is not None):
        result = None
    _CACHE[id(graph)] = (graph, result)
    return result


_CACHE: dict[int, tuple[object, tuple[MoeBlock, ...] | None]] = {}


def _recipe_fits(experts) -> bool:
    """Stacked gated experts (gate_up_proj + down_proj), a softmax top-k router, a gated shared expert or none."""
    e = experts.expert
    shared_ok = experts.shared_experts is None or experts.shared_experts.gated
    return (experts.stacked and e.gated and len(e.up) == 1 and experts.implementation in IMPLEMENTATIONS
            and shared_ok and not e.bias)


def applies(spec: ModelSpec, setup: TrainingSetup | None = None) -> bool:
    """Whether the MoE recipe sizes this model (its graph has Experts with standard attention blocks) under
    `setup`; DeepSeek's latent attention, LoRA on an MoE model (adapters are not in these rows), 16-bit parameters
    (Mixtral's fp32 routing weights upcast the experts' output and its backward: not checked yet) and anything else
    stay with memfit.derive."""
    if setup is not None and setup.precision.param_dtype != "fp32":
        return False
    return not spec.frozen and _blocks(spec) is not None


def has_experts(spec: ModelSpec) -> bool:
    """Whether the model routes tokens to experts, whichever path sizes it: an Experts node anywhere in its graph,
    or, for a derived model without a graph (Qwen3-MoE, gpt-oss), experts found in its built copy
    (memfit.derive.spec records them with the parameters)."""
    graph = getattr(spec, "graph", None)
    if graph is not None:
        from ..graph.kinds.mlp import Experts

        return bool(graph.nodes(Experts))
    return bool(spec.extra.get("routed_experts"))


def experts_nodes(spec: ModelSpec) -> list:
    return [b.experts for b in _blocks(spec) or () if b.experts is not None]


def moe_layers(spec: ModelSpec) -> int:
    return sum(b.count for b in _blocks(spec) or () if b.experts is not None)


def as_recipe(spec: ModelSpec, setup: TrainingSetup | None = None) -> ModelSpec:
    """The spec the estimator sizes with formulas: a derived MoE spec loses its derived model (the recipe here
    replaces it) and gets the attention facts the dense rows read."""
    if not applies(spec, setup) or spec.derived is None:
        return spec
    config = getattr(spec.derived, "config", {}) or {}
    extra = dict(spec.extra, moe_recipe=True)
    for key in ("attention_dropout",):
        if isinstance(config.get(key), (int, float)):
            extra[key] = float(config[key])
    return replace(spec, derived=None, extra=extra, norm="rmsnorm", gated_mlp=True)


# ---- routing -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Routing:
    """Rows (token-expert pairs) one rank's experts process per micro-step, balanced and at worst, and why."""

    tokens: int
    top_k: int
    num_experts: int
    ep: int
    capacity: float

    @property
    def balanced_rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def worst_rows(self) -> int:
        """Rows one rank may receive: its share under a capacity factor, else (dropless) every token of the EP
        group sent to its local experts (each token at most once per expert)."""
        local = self.num_experts // self.ep
        dropless = self.ep * self.tokens * min(self.top_k, local)
        if self.capacity:
            return min(dropless, int(self.capacity * self.tokens * self.top_k))
        return dropless

    @property
    def per_expert_balanced(self) -> float:
        """Rows per expert under balanced routing: the EP group's tokens x top_k over the experts."""
        return self.ep * self.tokens * self.top_k / self.num_experts

    @property
    def per_expert_worst(self) -> int:
        """One expert's rows at worst: every token of the EP group (dropless), or the capacity c x T x k / E."""
        dropless = self.ep * self.tokens
        if self.capacity:
            return min(dropless, int(self.capacity * self.ep * self.tokens * self.top_k / self.num_experts))
        return dropless

    @property
    def name(self) -> str:
        return "capacity" if self.capacity else "dropless"


def routing(spec: ModelSpec, setup: TrainingSetup) -> Routing | None:
    nodes = experts_nodes(spec)
    if not nodes:
        return None
    e = nodes[0]
    return Routing(setup.tokens_per_micro_step, e.top_k, e.num_experts, setup.expert_parallel,
                   float(setup.capacity_factor))


def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    """Expert parallelism and the capacity factor against the model: one-line ConfigErrors."""
    nodes = [getattr(b, "experts", None) for b in _blocks(spec) or ()]
    nodes = [n for n in nodes if n is not None]
    ep = setup.expert_parallel
    if not nodes:
        if ep > 1 or setup.capacity_factor:
            raise ConfigError(f"expert_parallel / capacity_factor apply to mixture-of-experts models; "
                              f"'{spec.name}' has no experts memfit's MoE formulas size")
        return
    for node in nodes:
        if node.num_experts % ep:
            raise ConfigError(f"expert_parallel {ep} does not divide the {node.num_experts} experts of "
                              f"'{spec.name}'")


# ---- what a layer keeps ------------------------------------------------------------------------------------------

def _attention_rows(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes, attn) -> list[Saved]:
    from . import activations as act

    rows = act._rmsnorm(spec, d, 2)
    qkv = [p for p in attn.qkv]
    rows += [Saved("attention", spec.hidden_size, "lin", len(qkv), role="qkv")]
    for norm in attn.norms:  # OLMoE's q_norm / k_norm: fp32 copy of q (k), rsqrt, normalised value cast back
        rows += [Saved("attention", norm.dim, "f32"), Saved("attention", 1, "f32"),
                 Saved("attention", norm.dim, "cmp", role="norm")]
    return rows + act._attention_core(spec, setup, seq_len, d)


def router_rows(experts, d: Dtypes) -> list[Saved]:
    """Per token: softmax over E (fp32), top-k indices (int64); normalised: the sum (fp32) and the divided k."""
    k, n = experts.top_k, experts.num_experts
    rows = [Saved("mlp", n, "f32"), Saved("mlp", k, "i64")]
    if experts.normalize_topk:
        rows += [Saved("mlp", 1, "f32"), Saved("mlp", k, "f32")]
    return rows


def expert_rows(experts, d: Dtypes, rows_per_token: float) -> list[Saved]:
    """Per token, `rows_per_token` routed rows (k when balanced on one rank) through the experts."""
    h, inter = experts.expert.hidden, experts.expert.intermediate
    r = rows_per_token
    if experts.implementation == "eager":
        # per expert slice: gathered input (an autocast copy under amp), gate/up, silu, product, down output, weight,
        # token and top-k position indices (torch.where)
        return [Saved("mlp", r * h, "lin", role="up"), Saved("mlp", r * 4 * inter, "cmp"),
                Saved("mlp", r * h, "cmp"), Saved("mlp", r, experts.scores_dtype), Saved("mlp", 2 * r, "i64")]
    # grouped_mm: experts in their parameter dtype (grouped_mm is no autocast op): 'res'
    return [Saved("mlp", r * (2 * h + 4 * inter), "res"), Saved("mlp", r, experts.scores_dtype),
            Saved("mlp", 3 * r, "i64")]


def _shared_rows(experts) -> list[Saved]:
    s = experts.shared_experts
    if s is None:
        return []
    rows = [Saved("mlp", 3 * s.intermediate, "cmp"), Saved("mlp", s.intermediate, "cmp", role="down")]
    if experts.shared_gate is not None:  # sigmoid(gate(x)) (kept by sigmoid and the multiply) and the MLP output
        rows += [Saved("mlp", 1, "cmp"), Saved("mlp", s.hidden, "cmp")]
    return rows


def _input_readers(experts) -> int:
    """Linears reading the MoE input: the router, the shared expert's input projections, its gate."""
    readers = 1
    if experts.shared_experts is not None:
        readers += len(experts.shared_experts.up)
    if experts.shared_gate is not None:
        readers += 1
    return readers


def moe_mlp_rows(experts, d: Dtypes, rows_per_token: float | None = None) -> list[Saved]:
    h = experts.expert.hidden
    rows = [Saved("mlp", h, "lin", _input_readers(experts), role="up")] + router_rows(experts, d)
    rows += expert_rows(experts, d, experts.top_k if rows_per_token is None else rows_per_token)
    return rows + _shared_rows(experts)


def _dense_rows(mlp, spec: ModelSpec) -> list[Saved]:
    readers = len(mlp.up)
    return [Saved("mlp", mlp.hidden, "lin", readers, role="up"), Saved("mlp", 3 * mlp.intermediate, "cmp"),
            Saved("mlp", mlp.intermediate, "cmp", role="down")]


def layer_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                      on_cpu: bool = False, *, worst: bool = False) -> dict[str, int]:
    """Bytes one layer keeps, by group, averaged over the layers (Qwen2-MoE mixes dense and MoE layers);
    `worst`: the experts' rows at the routing's worst case for one rank."""
    from . import activations as act

    d = act.dtypes(spec, setup, on_cpu)
    out = {"attention": 0.0, "mlp": 0.0, "norms": 0.0}
    blocks = _blocks(spec) or ()
    route = routing(spec, setup)
    per_token = None
    if worst and route is not None:
        per_token = route.worst_rows / max(route.tokens, 1)
    layers = sum(b.count for b in blocks) or 1
    for b in blocks:
        rows = _attention_rows(spec, setup, seq_len, d, b.attention)
        rows += moe_mlp_rows(b.experts, d, per_token) if b.experts is not None else _dense_rows(b.mlp, spec)
        for item in rows:
            out[item.group] += d.bytes_of(item) * tokens * b.count
    return {g: int(v / layers) for g, v in out.items()}


def block_temporaries(spec: ModelSpec, setup: TrainingSetup, tokens: int, d: Dtypes, *, worst: bool = False) -> int:
    """One MoE layer's backward peak beyond its saved tensors, net of what it has freed by then: right after the
    experts' down projection ran backward (read off traced and measured CPU steps). Alive: the residual-stream
    gradients (2 x T x h) and the MoE output's (T x h); per routed row the output gradient's copy, its gather back
    into expert order and the weighted gradient (3 h), the down projection's input gradient (I) and the routing
    weight's (1); and the down projection's weight gradient for every local expert (E / ep x h x I). Freed by then:
    the rows the down projection and the weighting kept (I + h + 1, and the int64 inverse permutation).
    Eager (looped) experts hold one expert's rows at a time: balanced T x k / E, at worst per_expert_worst."""
    nodes = experts_nodes(spec)
    if not nodes:
        return 0
    e = nodes[0]
    h, inter = e.expert.hidden, e.expert.intermediate
    route = routing(spec, setup)
    residual = 3 * tokens * spec.hidden_size * d.residual
    local = e.num_experts // max(route.ep, 1)
    down_grad = local * h * inter * (2 if setup.precision.param_dtype == "bf16" else 4)
    if e.implementation == "eager":
        rows = route.per_expert_worst if worst else route.per_expert_balanced
        size = d.compute
    else:
        rows = route.worst_rows if worst else route.balanced_rows
        size = d.residual
    held = rows * (3 * h + inter + 1) * size
    freed = rows * (inter + h + 1) * size + 8 * rows
    experts = residual + down_grad + held - freed
    shared = 0
    if e.shared_gate is not None:
        # Qwen2-MoE: the sigmoid-gated shared branch runs backward first; by its gate's weight gradient eight
        # T x h gradients are alive (residual pair, the output's, the gated product's two, the gate's input) and
        # the gated MLP output and the sigmoid are freed (measured on tiny real steps)
        shared = 8 * tokens * h * d.residual - tokens * d.compute
    elif e.shared_experts is not None:
        shared = 2 * tokens * spec.hidden_size * d.residual + tokens * e.shared_experts.intermediate * d.compute
    return int(max(experts, shared))


def expert_weight_elems(spec: ModelSpec) -> int:
    """Elements of the stacked expert weights (all layers, all experts), from the graph's Experts nodes: torch's
    grouped_mm is no autocast op, so autocast caches no bf16 copy of them (the eager loop casts each expert slice,
    uncached: `eager_weight_casts`)."""
    if spec.graph is None:
        return 0
    from ..graph import linear_copies

    return sum(node.weight_numel * copies for node, copies, parents in linear_copies(spec.graph)
               if in_stacked_experts(parents))


def in_stacked_experts(parents: tuple) -> bool:
    """Whether a node (by its ancestry) is a projection of the stacked experts' MLP (3-D gate_up_proj / down_proj)."""
    from ..graph.kinds.mlp import Experts

    return any(isinstance(node, Experts) and node.stacked and field_name == "expert" for node, field_name in parents)


def eager_weight_casts(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Eager experts under autocast: each expert's weight slice cast to bf16 by F.linear, saved for backward."""
    nodes = experts_nodes(spec)
    if not nodes or nodes[0].implementation != "eager" or not setup.precision.is_autocast:
        return 0
    return 2 * expert_weight_elems(spec) // setup.expert_parallel


# ---- expert parallelism ------------------------------------------------------------------------------------------

def ep_local_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """Each EP rank holds num_experts / ep of every stacked expert tensor: parameters, gradients and optimizer
    states of the experts divide by ep; the router, shared experts, attention and embeddings stay whole."""
    ep = setup.expert_parallel
    if ep <= 1 or not applies(spec):
        return spec
    stacked = _stacked_expert_names(spec)
    params = tuple(ParamTensor(p.name, p.numel // ep, p.count, p.nbytes // ep if p.nbytes else 0)
                   if (p.name in stacked if stacked is not None else
                       ".experts." in p.name and p.name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj", "up_proj"))
                   else p for p in spec.params)
    return replace(spec, params=params)


def _stacked_expert_names(spec: ModelSpec) -> frozenset[str] | None:
    """The stacked routed-expert tensors (E x out x in), by name, from the graph's Experts nodes (their router and
    shared experts apart); None without a graph (then the modules' own names: experts.gate_up_proj / down_proj)."""
    if spec.graph is None:
        return None
    from ..graph.kinds.mlp import Experts
    from ..graph.registry import children_of, tensors_of, walk

    names: set[str] = set()
    for path, node, _ in walk(spec.graph):
        if isinstance(node, Experts) and node.stacked:
            other = {t.name for field_name, _, child, child_path in children_of(node, path) if field_name != "expert"
                     for t in tensors_of(child, child_path)}
            names |= {t.name for t in tensors_of(node, path)} - other
    return frozenset(names)


def all_to_all_bytes(spec: ModelSpec, setup: TrainingSetup, d: Dtypes, *, worst: bool = False) -> int:
    """One layer's dispatch and combine buffers under EP: the rows sent out (T x k x h) and received back, in the
    experts' dtype; the received side grows to the routing's worst case."""
    route = routing(spec, setup)
    if route is None or route.ep <= 1:
        return 0
    h = experts_nodes(spec)[0].expert.hidden
    received = route.worst_rows if worst else route.balanced_rows
    return int((route.balanced_rows + received) * h * d.residual)


def aux_loss_bytes(spec: ModelSpec, setup: TrainingSetup, d: Dtypes) -> int:
    """output_router_logits: load_balancing_loss_func takes a softmax of every layer's logits (fp32, kept) and their
    top-k (int64 indices kept), alive from the loss until its backward."""
    nodes = experts_nodes(spec)
    if not nodes or not nodes[0].aux_loss:
        return 0
    e = nodes[0]
    return moe_layers(spec) * setup.tokens_per_micro_step * (4 * e.num_experts + 8 * e.top_k)


def terms(spec: ModelSpec, setup: TrainingSetup, d: Dtypes) -> list[Term]:
    """MoE terms beside the layers' saved tensors: eager experts' weight casts, the aux loss' inputs."""
    out: list[Term] = []
    if not applies(spec, setup):  # the derived model's traces already hold them
        return out
    casts = eager_weight_casts(spec, setup)
    if casts:
        out.append(Term(TermKey.EXPERT_WEIGHT_CASTS, Category.ACTIVATIONS, casts,
                        "2 B x expert weights (/ ep): eager experts' F.linear casts each expert slice to bf16, "
                        "uncached (not a leaf), saved for backward", SOURCE))
    aux = aux_loss_bytes(spec, setup, d)
    if aux:
        out.append(Term(TermKey.ROUTER_AUX_LOSS, Category.ACTIVATIONS, aux,
                        "L_moe x B x T x (4 E + 8 k) B: the load-balancing loss' fp32 softmax and top-k indices "
                        "per MoE layer", "transformers load_balancing_loss_func (output_router_logits)"))
    return out


def notes(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> tuple[str, ...]:
    """The routing assumption, named, with the range its worst case opens."""
    route = routing(spec, setup)
    if route is None:
        return ()
    from . import activations as act

    e = experts_nodes(spec)[0]
    d = act.dtypes(spec, setup, on_cpu)
    tokens = setup.tokens_per_micro_step
    best = layer_saved_bytes(spec, setup, tokens, setup.seq_len, on_cpu)
    worst = layer_saved_bytes(spec, setup, tokens, setup.seq_len, on_cpu, worst=True)
    layers = spec.num_layers
    lines = [f"MoE routing assumption: balanced top-{e.top_k} of {e.num_experts} experts "
             f"({route.per_expert_balanced:,.0f} rows per expert, {route.balanced_rows:,} rows per rank); "
             f"{e.implementation} experts, {route.name} routing"
             + (f", capacity factor {route.capacity:g}" if route.capacity else "")]
    act_best = layers * best["mlp"]
    act_worst = layers * worst["mlp"]
    tmp_best = block_temporaries(spec, setup, tokens, d)
    tmp_worst = block_temporaries(spec, setup, tokens, d, worst=True)
    a2a_best, a2a_worst = all_to_all_bytes(spec, setup, d), all_to_all_bytes(spec, setup, d, worst=True)
    if route.ep > 1:
        lines.append(f"expert parallelism: ep={route.ep}, {e.num_experts // route.ep} experts per rank; expert "
                     f"parameters, gradients and optimizer states / {route.ep}; all-to-all dispatch + combine "
                     f"buffers {a2a_best:,} B per layer (balanced), up to {a2a_worst:,} B")
    if act_worst == act_best and tmp_worst == tmp_best:
        lines.append(f"routing range: none for {e.implementation} on one rank: dropless experts process "
                     f"{route.balanced_rows:,} rows (tokens x top_k) however the tokens route")
    else:
        lines.append(f"routing range (best = balanced, worst = {route.name}): MoE-layer activations (L x mlp group) "
                     f"{act_best:,} .. {act_worst:,} B, one layer's backward temporaries {tmp_best:,} .. "
                     f"{tmp_worst:,} B" + (f", all-to-all {a2a_best:,} .. {a2a_worst:,} B" if route.ep > 1 else ""))
    return tuple(lines)


def routing_range(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> dict | None:
    """The named best / worst routing figures, for JSON."""
    route = routing(spec, setup)
    if route is None:
        return None
    from . import activations as act

    d = act.dtypes(spec, setup, on_cpu)
    tokens = setup.tokens_per_micro_step
    best = layer_saved_bytes(spec, setup, tokens, setup.seq_len, on_cpu)
    worst = layer_saved_bytes(spec, setup, tokens, setup.seq_len, on_cpu, worst=True)
    return {"assumption": "balanced", "worst_case": route.name, "capacity_factor": route.capacity,
            "expert_parallel": route.ep, "rows_per_rank": [route.balanced_rows, route.worst_rows],
            "expert_activations_bytes": [spec.num_layers * best["mlp"], spec.num_layers * worst["mlp"]],
            "block_temporaries_bytes": [block_temporaries(spec, setup, tokens, d),
                                        block_temporaries(spec, setup, tokens, d, worst=True)],
            "all_to_all_bytes": [all_to_all_bytes(spec, setup, d), all_to_all_bytes(spec, setup, d, worst=True)]}
