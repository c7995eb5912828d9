"""Activation offloading to the CPU: what leaves the device, what stays, what is back in flight, and what the host
holds.

The mechanism is torchtune's OffloadActivations (torchtune/training/_activation_offloading.py; TRL's and axolotl's
`activation_offloading` run a copy of it), a `torch.autograd.graph.saved_tensors_hooks` pair:

- `pack_tensor`: every tensor saved for backward of at least `min_offload_size` = 1024 bytes that is neither an
  nn.Parameter nor a buffer gets its own pinned host copy (`torch.empty_like(..., pin_memory=True, device="cpu")`
  and `copy_(non_blocking=True)`). Each pack copies, so a tensor that several ops save (the input of q, k and v; the
  input and rsqrt of an RMSNorm, which `pow` and `mul` both save) crosses and sits in host RAM once per op.
- `get_act_offloading_ctx_manager` wraps the output head in a NoOpManager, and the recipe computes the loss outside
  the context: the head's and the loss's saved tensors stay on the device.
- with streams (the default), the forward stash keeps the last `max_fwd_stash_size` = 5 packed tensors alive until
  their copy is done: at the end of forward those are the final norm's (its 5 packs), on the device until its
  backward unpacks them; in backward each unpacked tensor stays until the next autograd node's post-hook, so what
  is back on the device at a time is two nodes' saved tensors, within one block: sized as one block's share.
- under torch.utils.checkpoint (non-reentrant) only each checkpointed block's positional input is saved through the
  outer hooks (`_NoopSaveInputs`); the recompute runs in backward, on the device.

Each pack of the rules above was counted with the same hooks on real tiny Llama and GPT-2 steps
(tests/estimate/test_activation_offload.py), byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..model_spec import ModelSpec
from ..setup import TrainingSetup
from . import activations as act
from . import moe
from .result import Category, Phase, Term
from .moments import Moment, StepMoments
from .terms import TermKey

SOURCE = ("torchtune training/_activation_offloading.py OffloadActivations (pack_tensor: saved tensors >= 1024 B, "
          "not parameters; output head under NoOpManager; forward stash of 5); memfit._torch.offload_activations")
MIN_OFFLOAD_BYTES = 1024
"""torchtune OffloadActivations(min_offload_size=1024): smaller saved tensors stay on the device."""

STACK_TERMS = (TermKey.ATTENTION, TermKey.MLP, TermKey.NORMS, TermKey.CHECKPOINTS)


def _block_nodes(spec: ModelSpec) -> tuple:
    graph = spec.graph
    return graph.stacks[0].block.nodes if graph is not None and graph.stacks else ()


def _conv1d_block(spec: ModelSpec) -> bool:
    """A block of transformers Conv1D projections (GPT-2): each saves its nn.Parameter, not a weight view."""
    from ..graph import Linear
    return any(isinstance(n, Linear) and n.conv1d for _, n in (spec.graph.linears() if spec.graph else ()))


def _packed_once(spec: ModelSpec) -> bool:
    """Every saved tensor of the block is packed once: fused LayerNorms, one fused qkv input, one MLP input (GPT-2)."""
    from ..graph import MLP, Attention, Norm
    nodes = _block_nodes(spec)
    return (bool(nodes) and all(n.kind == "layer" for n in nodes if isinstance(n, Norm))
            and all(len(n.qkv) == 1 for n in nodes if isinstance(n, Attention))
            and all(not n.gated for n in nodes if isinstance(n, MLP)))


def _llama_shaped(spec: ModelSpec) -> bool:
    """The block whose repeated packs were counted op by op (Llama / Mistral / Qwen2): RMSNorms cast back to the
    residual dtype, separate q / k / v, a gated MLP with separate gate and up, sequential residual."""
    from ..graph import MLP, Attention, Block, Norm
    nodes = _block_nodes(spec)
    block = spec.graph.stacks[0].block if nodes else None
    return (isinstance(block, Block) and not block.parallel_residual and not block.sandwich_norms
            and all(n.kind == "rms" and not n.fp32_output for n in nodes if isinstance(n, Norm))
            and all(len(n.qkv) == 3 and n.softcap is None for n in nodes if isinstance(n, Attention))
            and all(n.gated and len(n.up) == 2 for n in nodes if isinstance(n, MLP)))


@dataclass(frozen=True)
class OffloadSizes:
    """One micro-step's activation offload, in bytes."""

    offloaded_bytes: int
    """Device storages that leave for the host in forward (each once)."""
    host_bytes: int
    """Pinned host RAM: one copy per pack, so a tensor several ops save counts once per op."""
    kept_bytes: int
    """Saved tensors that stay on the device (parameters aside): the LM head's input (and bf16 weight cast), the
    loss's."""
    stash_bytes: int
    """The final norm's saved tensors, kept on the device by the forward stash until its backward."""
    in_flight_bytes: int
    """One block's saved tensors, brought back from the host during its backward."""
    weight_bytes: int = 0
    """Of host_bytes, the Linear weights the packs copy (pure fp32 / bf16): no device saving, traffic both ways."""
    repacked_exact: bool = True
    """Whether the repeated packs of this family were counted (otherwise host_bytes counts each tensor once)."""


def sizes(spec: ModelSpec, setup: TrainingSetup, acts: list[Term]) -> OffloadSizes:
    """What offloading moves, given the activation terms alive at the end of forward without it."""
    by_name = {t.name: t.num_bytes for t in acts}
    tokens, layers = setup.tokens_per_micro_step, max(spec.num_layers, 1)
    d = act.dtypes(spec, setup)
    mask = _checkpoint_mask(spec, setup, by_name)
    stack = sum(by_name.get(name, 0) for name in STACK_TERMS) - mask
    norm = act.head_saved_bytes(spec, setup, tokens, head_input=False)["head"]
    head_input = by_name.get(TermKey.HEAD, 0) - norm
    emb_saved = by_name.get(TermKey.EMBEDDINGS, 0) - 2 * 8 * tokens
    rotary = _rotary_table_bytes(spec, setup, d)
    wrapped = setup.checkpointing.checkpointed_blocks(spec.num_layers)
    if wrapped:  # the tables reach checkpointed blocks through the recompute's closure, never packed
        emb_saved -= 2 * rotary
    casts = by_name.get(TermKey.AUTOCAST_WEIGHT_COPIES, 0)
    head_cast = 2 * spec.vocab_size * spec.hidden_size if casts else 0
    if spec.frozen:  # a frozen base: the packs LoRA / QLoRA change (memfit.estimate.offload_lora)
        return _frozen_base_sizes(spec, setup, d, by_name, (stack, norm, emb_saved), head_input, layers - wrapped,
                                  rotary)
    offloaded = stack + norm + emb_saved + casts - head_cast
    repacked, exact = _repacked_bytes(spec, setup, d, layers - wrapped, rotary)
    weights = _weight_pack_bytes(spec, setup, d, layers - wrapped)
    kept = head_input + head_cast + _loss_kept(by_name)
    return OffloadSizes(offloaded_bytes=offloaded, host_bytes=offloaded + repacked + weights, kept_bytes=kept,
                        stash_bytes=norm, in_flight_bytes=(stack + casts - head_cast + weights) // layers,
                        weight_bytes=weights, repacked_exact=exact)


def _loss_kept(by_name: dict[str, int]) -> int:
    return sum(by_name.get(n, 0) for n in (TermKey.LOSS, TermKey.LOGIT_SOFTCAP))


def _frozen_base_sizes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, by_name: dict[str, int],
                       saved: tuple[int, int, int], head_input: int, plain_blocks: int, rotary: int) -> OffloadSizes:
    """`saved`: the stack's, the final norm's and the embedding's saved tensors (offloaded as they are); the weight
    packs, the casts and the repeated packs of a frozen base from memfit.estimate.offload_lora."""
    from . import offload_lora

    casts, small_casts = offload_lora.saved_casts(spec, setup, d, plain_blocks)
    head_cast = offload_lora.head_cast_bytes(spec, setup, d)
    weights = offload_lora.weight_pack_bytes(spec, setup, d, plain_blocks)
    exact = _llama_shaped(spec) or _packed_once(spec)
    repacked = offload_lora.repacked_bytes(spec, setup, d, plain_blocks, rotary) if _llama_shaped(spec) else 0
    stack, norm, total = saved[0], saved[1], sum(saved)
    return OffloadSizes(offloaded_bytes=total + casts, host_bytes=total + casts + repacked + weights,
                        kept_bytes=head_input + head_cast + small_casts + _loss_kept(by_name), stash_bytes=norm,
                        in_flight_bytes=(stack + casts + weights) // max(spec.num_layers, 1), weight_bytes=weights,
                        repacked_exact=exact)


def _weight_pack_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, plain_blocks: int) -> int:
    """Without autocast each Linear saves its weight as `weight.t()`, a view and not an nn.Parameter, so torchtune's
    pack copies it to the host too (and backward brings a device copy back): the plain blocks' Linear weights.
    Under autocast the saved weights are the bf16 casts (activations/autocast_weight_copies)."""
    if d.autocast or not plain_blocks or _conv1d_block(spec):
        return 0  # GPT-2's Conv1D saves the nn.Parameter itself (addmm(bias, x, weight)): not packed
    from .forward_terms import linear_weight_elems
    block_elems = linear_weight_elems(spec) - spec.vocab_size * spec.hidden_size
    p_bytes = 2 if setup.precision.param_dtype == "bf16" else 4
    return block_elems * p_bytes * plain_blocks // max(spec.num_layers, 1)


def _checkpoint_mask(spec: ModelSpec, setup: TrainingSetup, by_name: dict[str, int]) -> int:
    """The eager B x T x T mask a checkpointed block keeps: a keyword argument, held by the recompute, not packed."""
    if TermKey.CHECKPOINTS not in by_name:
        return 0
    return act.checkpointed_mask_bytes(spec, setup, setup.tokens_per_micro_step, setup.seq_len)


def _rotary_table_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes) -> int:
    """One of the cos / sin tables (1 x T x rotary dims, the residual dtype), as activations.embedding_saved_bytes
    counts them; learned positions (GPT-2, BERT) have none."""
    from ..graph import Attention
    att = next((n for n in _block_nodes(spec) if isinstance(n, Attention)), None)
    if att is None or att.position != "rope":
        return 0
    return int(setup.seq_len * att.head_dim * att.rotary_fraction * d.residual)


def _repacked_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, plain_blocks: int,
                    rotary: int) -> tuple[int, bool]:
    """Bytes packed again (a tensor already packed by an earlier op), read off the transformers modelling code and
    counted with the hooks. Llama / Mistral / Qwen2, per plain (not checkpointed) block and token:
    LlamaRMSNorm's fp32 input and rsqrt are saved by `pow`/`rsqrt` and again by `mul` (2 norms: 2 x (4h + 4));
    SDPA's output is o_proj's input (q width x compute dtype); without autocast q, k, v share one input (2 more) and
    gate, up another (1 more), under autocast each Linear saves its own cast; each block's rotary multiply saves
    cos and sin twice (q and k), all copies of the two tables. The final norm repeats its input and rsqrt once.
    GPT-2 packs every tensor once (fused LayerNorm, one c_attn, one c_fc). Other families: counted once (a lower
    bound), and said."""
    if _packed_once(spec):
        return 0, True
    if not _llama_shaped(spec) or spec.derived is not None or moe.applies(spec):
        return 0, False
    h, tokens = spec.hidden_size, setup.tokens_per_micro_step
    wrapped = spec.num_layers - plain_blocks
    q_width = spec.num_attention_heads * spec.head_dim
    per_token = 2 * (4 * h + 4) + q_width * d.compute
    if not d.autocast:
        per_token += 3 * h * d.residual
    rope = 4 * plain_blocks * rotary - (0 if wrapped else 2 * rotary)  # the two tables themselves are counted once
    final_norm = (4 * h + 4) * tokens
    return plain_blocks * per_token * tokens + rope + final_norm, True


def applies(setup: TrainingSetup) -> bool:
    return bool(getattr(setup, "activation_offload", False))




def check(spec: ModelSpec, setup: TrainingSetup) -> None:
    """Activation offloading is sized where the saved tensors are known tensor by tensor: one-line ConfigError."""
    if not applies(setup):
        return
    if not spec.is_decoder or spec.derived is not None or moe.applies(spec) or act.saved_problem(spec.graph):
        raise ConfigError(f"activation offloading is sized for decoders whose layers the graph's formulas size "
                          f"tensor by tensor; '{spec.name}' is not one (a derived, MoE or encoder model): drop "
                          "--activation-offload")


def on_device(moments: StepMoments, spec: ModelSpec, setup: TrainingSetup, acts: list[Term]) -> StepMoments:
    """Each moment's terms as they are on the device with offloading: the stack's saved tensors gone (one block's
    share back in flight where a block's backward runs), the final norm's in the forward stash until its backward,
    autocast's cast cache on the device until autocast exits (end of forward and loss)."""
    offload = sizes(spec, setup, acts)
    return moments.map(lambda m: Moment(m.phase, _moment(m.terms, m.phase, offload, spec, setup)))


def _moment(terms: list[Term], phase: Phase, offload: OffloadSizes, spec: ModelSpec,
            setup: TrainingSetup) -> list[Term]:
    names = {t.name for t in terms}
    out: list[Term] = []
    for term in terms:
        if term.name in STACK_TERMS:
            continue
        if term.name == TermKey.HEAD:
            term = replace(term, num_bytes=term.num_bytes - offload.stash_bytes,
                           formula="LM-head input, kept on the device (the head runs under torchtune's NoOpManager)")
        elif term.name == TermKey.EMBEDDINGS:
            term = replace(term, num_bytes=2 * 8 * setup.tokens_per_micro_step + _kept_tables(spec, setup),
                           formula="token ids and labels the loop holds (the embedding's saved ids are offloaded)")
        elif term.name == TermKey.AUTOCAST_WEIGHT_COPIES and phase is not Phase.FORWARD:
            head_cast = _head_cast_bytes(spec, setup) if TermKey.HEAD in names else 0
            term = replace(term, num_bytes=head_cast, formula="the LM head's bf16 weight cast (kept with the head; "
                                                              "the others' casts are offloaded)")
        out.append(term)
    if TermKey.HEAD in names:
        out.append(Term(TermKey.OFFLOAD_STASH, Category.ACTIVATIONS, offload.stash_bytes,
                        "the final norm's saved tensors: torchtune's forward stash (the last 5 packs) keeps them on "
                        "the device until their backward", SOURCE))
    if names & set(STACK_TERMS) and TermKey.HEAD not in names and phase is Phase.BACKWARD:
        out.append(Term(TermKey.OFFLOAD_IN_FLIGHT, Category.ACTIVATIONS, offload.in_flight_bytes,
                        "one block's saved tensors, brought back from the host for its backward (each unpacked "
                        "tensor is freed after the next autograd node)", SOURCE))
    return out


def _head_cast_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The LM head's bf16 weight cast, kept with the head: a trained head's, or a frozen fp32 one's (offload_lora)."""
    if spec.frozen:
        from .offload_lora import head_cast_bytes
        return head_cast_bytes(spec, setup, act.dtypes(spec, setup))
    return 2 * spec.vocab_size * spec.hidden_size


def _kept_tables(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The rotary tables stay on the device when a checkpointed block's recompute holds them."""
    if not setup.checkpointing.checkpointed_blocks(spec.num_layers):
        return 0
    return 2 * _rotary_table_bytes(spec, setup, act.dtypes(spec, setup))


def host_term_notes(offload: OffloadSizes) -> tuple[str, ...]:
    if offload.repacked_exact:
        return ()
    return ("activation offload: the host RAM counts each saved tensor once; torchtune's hooks copy a tensor once "
            "per op that saves it, which memfit counted for Llama, Mistral, Qwen2 and GPT-2 only",)

