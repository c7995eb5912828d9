"""Activation offloading (torchtune OffloadActivations, memfit.estimate.offload_activations) when the base is frozen:
which packs LoRA / QLoRA change.

What a frozen projection saves, read off torch's autograd formulas (tools/autograd/derivatives.yaml: `mm` saves
`mat2` for self's gradient and `self` for mat2's) and counted with the offload hooks on real tiny peft steps
(tests/estimate/test_offload_lora.py):

- a frozen Linear saves only its weight (`weight.t()`, a view of the parameter: packed, nothing freed) for the input
  gradient, never its input: the repeated packs of a full fine-tune's shared inputs (q / k / v, gate / up) and of
  SDPA's output (o_proj's input) are gone;
- a 4-bit base saves nothing through the hooks: bitsandbytes' MatMul4Bit keeps the packed weight as `ctx.tensors`
  (bitsandbytes/autograd/_functions.py), torchao's NF4 linear as `ctx.nf4_weight`;
- each adapter saves its input (lora_A) and the rank-r intermediate (lora_B), and each its fp32 weight's view, or
  under autocast its cached bf16 cast; where several adapters read the very same x (fp32, no dropout) it is packed
  once per adapter;
- layer 0 under a frozen embedding (no `enable_input_require_grads` without checkpointing): its first norm saves
  nothing, q / k / v see an input that needs no gradient, so their bases and lora_A save no weight, and only the
  rotary multiplies of an adapted q or k save the tables;
- a saved tensor under 1024 bytes stays on the device (min_offload_size): with small adapters, their casts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..finetune import BaseWeights
from ..graph import Linear, LoraLinear
from ..graph.registry import walk
from ..model_spec import ModelSpec
from ..setup import TrainingSetup
from . import activations as act

_ROLE_OF = {("Attention", "qkv"): "qkv", ("Attention", "out"): "out", ("MLP", "up"): "up", ("MLP", "down"): "down"}


@dataclass(frozen=True)
class Projection:
    """One projection of a block: its role (qkv / out / up / down) and node (a frozen Linear or a LoraLinear)."""

    role: str
    node: Linear | LoraLinear

    @property
    def base(self) -> Linear:
        return self.node.base if isinstance(self.node, LoraLinear) else self.node


def projections(spec: ModelSpec) -> list[Projection]:
    """The first stack's block projections (the block stands for every layer), nested LoRA parts left out."""
    out = []
    for _, node, parents in walk(spec.graph.stacks[0].block):
        if isinstance(node, (Linear, LoraLinear)) and parents and not isinstance(parents[-1][0], LoraLinear):
            role = _ROLE_OF.get((type(parents[-1][0]).__name__, parents[-1][1]))
            if role is not None:
                out.append(Projection(role, node))
    return out


def first_layer_unsaved(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """Layer 0's q / k / v inputs need no gradient (a frozen embedding, no checkpointing: memfit.estimate.lora)."""
    return bool(spec.frozen) and setup.checkpointing.value == "none"


def _base_bytes(setup: TrainingSetup) -> int:
    """Bytes per element of a saved frozen weight: its storage dtype; 0 for a 4-bit base (nothing saved)."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    return 0 if base.four_bit else 4 if base is BaseWeights.FP32 else 2


def _saved_weights(spec: ModelSpec, setup: TrainingSetup, layer0: bool) -> list[tuple[int, bool]]:
    """(elements, is_adapter) of each weight one block's Linears save for the input gradient; layer 0 under
    first_layer_unsaved: not q / k / v's bases nor their lora_A."""
    out = []
    for proj in projections(spec):
        first = layer0 and proj.role == "qkv"
        if not first and not proj.base.conv1d:  # transformers Conv1D saves the nn.Parameter itself: not packed
            out.append((proj.base.weight_numel, False))
        if isinstance(proj.node, LoraLinear):
            if not first:
                out.append((proj.node.a.weight_numel, True))
            out.append((proj.node.b.weight_numel, True))
    return out


def _per_block(spec: ModelSpec, setup: TrainingSetup, plain_blocks: int):
    """Each plain block's saved weights: layer 0 on its own where its first projections save none."""
    if not plain_blocks:
        return []
    if first_layer_unsaved(spec, setup):
        return [_saved_weights(spec, setup, True)] + [_saved_weights(spec, setup, False)] * (plain_blocks - 1)
    return [_saved_weights(spec, setup, False)] * plain_blocks


def weight_pack_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, plain_blocks: int) -> int:
    """The saved weights that are views of the parameters, packed (copied to the host) when at least
    min_offload_size, with no device saving: without autocast the fp32 adapters' and the base's (in its storage
    dtype); under autocast only a base stored in the compute dtype (autocast casts nothing for it)."""
    from .offload_activations import MIN_OFFLOAD_BYTES
    base = _base_bytes(setup)
    if d.autocast and base != d.compute:
        return 0
    sizes = [numel * (4 if adapter else base) for block in _per_block(spec, setup, plain_blocks)
             for numel, adapter in block if not (adapter and d.autocast)]
    return sum(b for b in sizes if b >= MIN_OFFLOAD_BYTES)


def saved_casts(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, plain_blocks: int) -> tuple[int, int]:
    """(offloaded, kept) bytes of the bf16 weight casts autocast makes that the blocks save: the adapters' (cached)
    and an fp32 base's (a fresh copy per call); one under min_offload_size stays on the device."""
    from .offload_activations import MIN_OFFLOAD_BYTES
    if not d.autocast:
        return 0, 0
    fp32_base = setup.finetune.base_storage(setup.precision.compute_dtype) is BaseWeights.FP32
    sizes = [2 * numel for block in _per_block(spec, setup, plain_blocks) for numel, adapter in block
             if adapter or fp32_base]
    return (sum(b for b in sizes if b >= MIN_OFFLOAD_BYTES), sum(b for b in sizes if b < MIN_OFFLOAD_BYTES))


def head_cast_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes) -> int:
    """The LM head's bf16 weight cast under autocast (kept on the device with the head): made when the head is
    fp32, an fp32 base's or a quantized base's (prepare_model_for_kbit_training upcasts it)."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if not d.autocast or not (base.quantized or base is BaseWeights.FP32):
        return 0
    return 2 * spec.vocab_size * spec.hidden_size


def repacked_bytes(spec: ModelSpec, setup: TrainingSetup, d: act.Dtypes, plain_blocks: int, rotary: int) -> int:
    """Bytes packed again in a Llama-shaped block with a frozen base: each RMSNorm's fp32 input and rsqrt
    (saved by pow / rsqrt and again by mul; layer 0's first norm saves none under first_layer_unsaved), the x that
    several adapters read when they share it (fp32, no dropout, no autocast), the rotary tables (each multiply of
    a q or k that needs a gradient saves cos and sin; the first two packs are the tables themselves), the final
    norm's input and rsqrt."""
    h, tokens = spec.hidden_size, setup.tokens_per_micro_step
    norm = (4 * h + 4) * tokens
    if not plain_blocks:
        return norm
    unsaved = first_layer_unsaved(spec, setup)
    total = (2 * plain_blocks - (1 if unsaved else 0) + 1) * norm
    from .lora import adapted_roles
    roles = adapted_roles(spec)
    if setup.finetune.dropout == 0 and not d.autocast and d.compute == 4 and d.residual == 4:
        for role in ("qkv", "up"):  # the adapters of one norm output: one pack each, the first is the tensor
            total += plain_blocks * tokens * sum(4 * n.in_features for n in roles.get(role, [])[1:])
    layer0_qk = sum(1 for n in roles.get("qkv", []) if n.name.rsplit(".", 1)[-1] in ("q_proj", "k_proj"))
    table_packs = 2 * (2 * (plain_blocks - 1) + (layer0_qk if unsaved else 2))
    return total + rotary * max(table_packs - 2, 0)
