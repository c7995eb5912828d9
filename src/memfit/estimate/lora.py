"""LoRA and QLoRA: what peft and bitsandbytes really keep, as a transform of the ModelSpec the estimator sizes.

`adapted_spec(spec, setup)` rewrites the model graph with memfit.graph.with_lora (every targeted Linear becomes a
frozen base plus trainable A and B) and returns a spec whose `params` are the trainable tensors (so gradients,
optimizer states and their temporaries follow from the same formulas as a full fine-tune) and whose `frozen`
tensors carry their storage bytes:

- adapters: fp32 whatever the base (peft `get_peft_model(..., autocast_adapter_dtype=True)`, the default, upcasts
  bf16/fp16 adapter weights: peft/tuners/tuners_utils.py `cast_adapter_dtype`);
- frozen base in bf16 / fp16 / fp32: 2 / 2 / 4 B per element;
- 4-bit base (bitsandbytes Linear4bit, QLoRA, Dettmers et al. 2023 arXiv:2305.14314 sec. 3): every Linear inside
  the blocks packed two weights per byte, plus one absmax per 64-element block, fp32, or under double quantization
  uint8 absmax with one fp32 second-level absmax per 256 of them, the 256-entry fp32 map and an fp32 offset
  (bitsandbytes.functional.quantize_4bit / QuantState); the 16-entry code of the 4-bit type;
- 8-bit base (LLM.int8, Dettmers et al. 2022 arXiv:2208.07339): int8 weights and one fp32 scale per output row
  (bitsandbytes Int8Params.SCB);
- what bitsandbytes leaves unquantized: the embedding, the LM head (transformers' `get_keys_to_not_convert`), norms
  and biases; peft's `prepare_model_for_kbit_training` (called by TRL's SFTTrainer, axolotl and the QLoRA
  reference script for a quantized base) upcasts those to fp32.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, BaseWeights, Finetune
from ..graph import Linear, LoraLinear, with_lora
from ..graph.kinds.heads import ClassificationHead, LMHead, MaskedLMHead, Seq2SeqLMHead
from ..graph.registry import walk
from ..model_spec import ModelSpec, ParamTensor
from ..setup import TrainingSetup, deepspeed_casts_module, fsdp2_mixed_precision
from . import dora

BNB_4BIT_BLOCK = 64  # bnb_4bit_blocksize default (BitsAndBytesConfig / bnb.nn.Params4bit blocksize=64)
BNB_NESTED_BLOCK = 256  # double quantization: absmax quantized in blocks of 256 (quantize_blockwise default)
BNB_NESTED_CODE = 256  # the dynamic map of the nested quantization, fp32[256]
BNB_4BIT_CODE = 16  # the NF4 / FP4 code, fp32[16]
ADAPTER_BYTES = 4  # peft keeps adapters in fp32 (autocast_adapter_dtype=True)

PEFT_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    # peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft 0.21), for the model types
    # memfit builds graphs for; a type missing here has no peft default (peft asks for target_modules)
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"), "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"), "gemma3_text": ("q_proj", "v_proj"), "opt": ("q_proj", "v_proj"),
    "gptj": ("q_proj", "v_proj"), "stablelm": ("q_proj", "v_proj"), "bart": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"), "gpt2": ("c_attn",), "gpt_neox": ("query_key_value",),
    "falcon": ("query_key_value",), "bert": ("query", "value"), "t5": ("q", "v"),
}

_HEADS = (LMHead, MaskedLMHead, Seq2SeqLMHead, ClassificationHead)


def adapted_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """The spec as the optimizer sees it under `setup.finetune`: unchanged for a full fine-tune."""
    ft = setup.finetune
    if not ft.adapters:
        return spec
    if spec.graph is None:
        raise ConfigError(f"sizing {ft.method} needs the architecture of '{spec.name}' as a graph: give a catalog "
                          "name, a config.json or a config dict of a supported family (or a peft model)")
    if is_adapted(spec.graph):
        return spec
    graph = spec.graph
    targets = lora_targets(graph, ft)
    adapted = with_lora(graph, ft.rank, targets, alpha=ft.alpha)
    _check_targets(graph, adapted, targets)
    _check_rank(adapted, ft)
    base = ft.base_storage(setup.precision.compute_dtype)
    quantizable = _quantizable_weights(adapted)
    save_names = _modules_to_save(adapted, ft.modules_to_save)
    other_bytes = 4 if base.quantized else _dtype_bytes(base)  # prepare_model_for_kbit_training upcasts to fp32
    trainable, frozen = [], []
    adapter_bytes = 2 if deepspeed_casts_module(setup) else ADAPTER_BYTES  # DeepSpeed casts the adapters too
    for t in adapted.tensors():
        if t.trainable:
            trainable.append(ParamTensor(t.name, t.numel, t.count, adapter_bytes * t.numel))
            continue
        if t.name in quantizable and base.quantized:
            rows = quantizable[t.name]
            frozen.append(ParamTensor(t.name, t.numel, t.count, quantized_weight_bytes(t.numel, rows, base,
                                                                                      ft.double_quant)))
        else:
            frozen.append(ParamTensor(t.name, t.numel, t.count, other_bytes * t.numel))
        if any(t.name.startswith(prefix + ".") for prefix in save_names):
            # peft's ModulesToSaveWrapper: the original stays (frozen) and a trainable copy is made, same dtype
            trainable.append(ParamTensor(t.name.replace(".weight", ".modules_to_save.weight"), t.numel, t.count,
                                         other_bytes * t.numel))
    if ft.dora:  # one trainable magnitude vector per adapted Linear (memfit.estimate.dora)
        trainable += dora.magnitude_tensors(trainable, ft.rank)
    return replace(spec, params=tuple(trainable), frozen=tuple(frozen), graph=adapted)


def is_adapted(graph) -> bool:
    """Whether the graph already holds LoRA adapters (adapted_spec ran, or a peft model was read)."""
    return any(isinstance(node, LoraLinear) for _, node in graph.linears())


def rung_targets(spec: ModelSpec) -> tuple[str, ...]:
    """What the LoRA rung targets: peft's default for the architecture (()), or every projection where peft has
    none (it would ask for target_modules)."""
    return () if spec.graph is not None and spec.graph.model_type in PEFT_DEFAULT_TARGETS else (ALL_LINEAR,)


def lora_targets(graph, ft: Finetune) -> tuple[str, ...]:
    """peft's target_modules: the names given, every projection but the head for 'all-linear', or peft's
    default for the architecture."""
    if ft.targets and ft.targets != (ALL_LINEAR,):
        return ft.targets
    if ft.targets == (ALL_LINEAR,):
        return tuple(dict.fromkeys(path for path, _ in _block_linears(graph)))
    default = PEFT_DEFAULT_TARGETS.get(graph.model_type)
    if default is None:
        names = sorted({path.rsplit(".", 1)[-1] for path, _ in graph.linears()})
        raise ConfigError(f"peft has no default LoRA targets for '{graph.model_type}': give --lora-targets "
                          f"(all-linear, or names from: {', '.join(names)})")
    return default


def _block_linears(graph) -> list[tuple[str, Linear]]:
    """Every Linear that is not a head's output projection (peft 'all-linear' leaves the output layer out) nor a
    stacked expert weight (a 3-D parameter, not an nn.Linear: peft cannot adapt it, and with_lora skips it)."""
    from ..graph.transforms import _in_stacked_experts

    out = []
    for path, node, parents in walk(graph):
        if _in_stacked_experts(parents):
            continue
        if isinstance(node, Linear) and not any(isinstance(p, _HEADS) and field in ("proj", "decoder")
                                                 for p, field in parents):
            if not any(isinstance(p, LoraLinear) for p, _ in parents):
                out.append((path, node))
    return out


def _check_targets(graph, adapted, targets: tuple[str, ...]) -> None:
    """Every target name must name a projection (peft ignores one that matches nothing when another matches; a
    typo would then silently size fewer adapters)."""
    paths = [path for path, node in adapted.linears() if isinstance(node, LoraLinear)]
    missing = [t for t in targets if not any(p == t or p.endswith("." + t) for p in paths)]
    if missing:
        names = sorted({path.rsplit(".", 1)[-1] for path, _ in graph.linears()})
        raise ConfigError(f"LoRA target(s) {', '.join(missing)} match no Linear in '{graph.name}'; its "
                          f"projections are named: {', '.join(names)}")


def _check_rank(graph, ft: Finetune) -> None:
    for path, node in graph.linears():
        if isinstance(node, LoraLinear) and ft.rank > min(node.in_features, node.out_features):
            raise ConfigError(f"LoRA rank {ft.rank} is above the smaller dimension of {path} "
                              f"({node.in_features} x {node.out_features}): the update would not be low-rank")


def _quantizable_weights(graph) -> dict[str, int]:
    """Weight tensor name -> output rows, for the Linears bitsandbytes quantizes: every nn.Linear but the output
    head (transformers' bnb integration skips `get_keys_to_not_convert`, the output embeddings)."""
    out = {}
    for path, node in _block_linears(graph):
        out[f"{path}.weight"] = node.out_features
    for path, node, parents in walk(graph):  # LoRA bases: <path>.base_layer
        if isinstance(node, LoraLinear):
            out[f"{path}.base_layer.weight"] = node.base.out_features
    return out


def _modules_to_save(graph, names: tuple[str, ...]) -> tuple[str, ...]:
    if not names:
        return ()
    found = []
    known = set()
    for path, node, _ in walk(graph):
        if path:
            known.add(path.rsplit(".", 1)[-1])
        if path and any(path == n or path.endswith("." + n) for n in names):
            found.append(path)
    missing = [n for n in names if not any(p == n or p.endswith("." + n) for p in found)]
    if missing:
        raise ConfigError(f"modules_to_save {missing} not found in the model; its modules include: "
                          f"{', '.join(sorted(k for k in known if '*' not in k)[:20])}")
    return tuple(found)


def _dtype_bytes(base: BaseWeights) -> int:
    return 4 if base is BaseWeights.FP32 else 2


def quantized_weight_bytes(numel: int, out_rows: int, base: BaseWeights, double_quant: bool) -> int:
    """Bytes bitsandbytes holds for one quantized weight of `numel` elements (`out_rows` output features)."""
    if base is BaseWeights.INT8:
        return numel + 4 * out_rows  # int8 weight + Int8Params.SCB (fp32 absmax per row)
    blocks = math.ceil(numel / BNB_4BIT_BLOCK)
    packed = math.ceil(numel / 2)
    code = 4 * BNB_4BIT_CODE
    if not double_quant:
        return packed + 4 * blocks + code
    nested = math.ceil(blocks / BNB_NESTED_BLOCK)
    return packed + blocks + 4 * nested + 4 * BNB_NESTED_CODE + 4 + code


BASE_SOURCE = ("bitsandbytes Linear4bit / Int8Params storage and QuantState; peft prepare_model_for_kbit_training "
               "(non-quantized parameters upcast to fp32)")


def base_label(spec: ModelSpec, setup: TrainingSetup) -> str:
    """How the frozen base is stored, in words: 'bf16', 'nf4 + double quantization; the rest fp32'."""
    ft = setup.finetune
    base = ft.base_storage(setup.precision.compute_dtype)
    if not base.quantized:
        return str(base)
    label = f"{base}{' + double quantization' if ft.double_quant and base.four_bit else ''}"
    return f"{label} Linear weights; embeddings, head and norms fp32"


# --- activations ----------------------------------------------------------------------------------------------------
# What peft's lora.Linear saves (peft/tuners/lora/layer.py Linear.forward: base_layer(x); x cast to the adapter
# dtype; lora_B(lora_A(dropout(x))) * scaling), read off saved_tensors_hooks on real layers
# (bench/results/lora_mechanisms.md): lora_A saves its input, lora_B the rank-r intermediate; the scaling, the add
# and the casts save nothing. The input lora_A saves is x itself only when x is fp32 already and there is no
# autocast and no dropout (then it is shared with any other saver of x); otherwise each adapted Linear keeps its
# own copy: fp32 (peft casts a bf16 x to the adapter dtype) or bf16 (autocast casts it back), or the dropout output,
# plus the dropout mask (CPU: a float mask of the fp32 input; CUDA: native_dropout's bool mask).

_ROLE_OF = {("Attention", "qkv"): "qkv", ("Attention", "out"): "out", ("MLP", "up"): "up", ("MLP", "down"): "down"}
_GROUP_OF_ROLE = {"qkv": "attention", "out": "attention", "up": "mlp", "down": "mlp"}


def adapted_roles(spec: ModelSpec) -> dict[str, list[LoraLinear]]:
    """The LoRA-adapted projections of one block, by role (the first stack's block stands for every layer)."""
    roles: dict[str, list[LoraLinear]] = {}
    if spec.graph is None or not spec.graph.stacks:
        return roles
    for _, node, parents in walk(spec.graph.stacks[0].block):
        if isinstance(node, LoraLinear) and parents:
            role = _ROLE_OF.get((type(parents[-1][0]).__name__, parents[-1][1]))
            if role is not None:
                roles.setdefault(role, []).append(node)
    return roles


def adapted_layer(spec: ModelSpec, setup: TrainingSetup, items: list, d) -> list:
    """One layer's saved tensors (activations.Saved rows) under LoRA: what only a frozen weight's gradient needed
    is gone, and each adapter's own tensors are added."""
    from .activations import Saved

    ft = setup.finetune
    roles = adapted_roles(spec)
    # FSDP2's MixedPrecisionPolicy casts the gathered adapters to the compute dtype: peft's cast of x is then a no-op
    in_compute = fsdp2_mixed_precision(setup) or deepspeed_casts_module(setup)  # (DeepSpeed: a 16-bit module)
    shares_x = ft.dropout == 0 and (in_compute or (not d.autocast and d.compute == 4 and d.residual == 4))
    low = "c16" if d.autocast or in_compute else "f32"
    kept = []
    for item in items:
        if not item.role:
            kept.append(item)
        elif item.role in roles and shares_x:  # lora_A saves the very tensor the base Linear would have
            kept.append(replace(item, role="", readers=1))
        elif item.role in _GROUP_OF_ROLE and int8_keeps_inputs(setup, d):
            kept.append(replace(item, role="int8", readers=1))
    for role, linears in roles.items():
        group = _GROUP_OF_ROLE[role]
        for node in linears:
            if not shares_x:
                # its own copy of x: bf16 under autocast (or FSDP2's bf16 adapters), else fp32 (peft's cast, or
                # the dropout output)
                kept.append(Saved(group, node.in_features, low))
            if ft.dropout > 0:
                kept.append(Saved(group, node.in_features, _mask(d)))
            kept.append(Saved(group, node.rank, low))  # lora_A's output, kept by lora_B
    if ft.dora:
        kept += dora.saved_rows(roles, _GROUP_OF_ROLE, low)
    return kept


def first_layer_unsaved(spec: ModelSpec, setup: TrainingSetup, d) -> float:
    """Per-token bytes layer 0 does not save under LoRA when nothing before it needs a gradient (a frozen
    embedding, and no peft `enable_input_require_grads`, which the Trainer calls only with checkpointing): its
    first norm keeps no input for an input gradient nobody asks for."""
    from .activations import Saved, first_norm_input_rows

    if not spec.frozen or setup.checkpointing.value != "none":
        return 0.0
    # a post-norm layer 0 starts with its projections (the embedding LayerNorm is counted there)
    rows = first_norm_input_rows(spec, d)
    if setup.finetune.dropout > 0:  # the first adapters' dropout keeps no mask: their input needs no gradient
        rows += [Saved("norms", node.in_features, _mask(d)) for node in adapted_roles(spec).get("qkv", [])]
    return sum(d.bytes_of(r) for r in rows)


def _mask(d) -> str:
    """Dtype class of a LoRA dropout mask: on CPU the composite dropout's float mask of the (fp32) input; on CUDA
    native_dropout's bool mask."""
    return "f32" if d.on_cpu else "u8"


def dequantized_weight_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The transient a quantized frozen Linear makes in backward: bitsandbytes dequantizes the whole weight
    (MatMul4Bit.backward: dequantize_4bit in the dtype it was quantized from, bf16 here; int8: CB * SCB / 127 in
    the input's dtype), one weight at a time: the largest one sets it."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if not base.quantized:
        return 0
    largest = max((p.numel for p in spec.frozen if p.nbytes < 2 * p.numel), default=0)
    per = 2 if base.four_bit or setup.precision.is_autocast else 4
    return per * largest


def autocast_copies(spec: ModelSpec, setup: TrainingSetup, checkpointing: bool) -> int:
    """Bytes of bf16 weight copies autocast makes and backward keeps, under LoRA: the adapters' (cached, as a
    trainable leaf's cast is), and a fresh copy per call of every frozen fp32 Linear the gradient flows through
    (autocast caches only leaves that require grad) — the whole fp32 base, or with a quantized base only the
    fp32 LM head prepare_model_for_kbit_training left; under checkpointing only the head's outlives its block."""
    adapters = sum(p.total for p in spec.params if dora.MAGNITUDE not in p.name)  # no matmul takes a magnitude
    extra = dora.autocast_copies(spec, setup)
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    head = sum(node.base.weight_numel if isinstance(node, LoraLinear) else node.weight_numel
               for path, node in spec.graph.linears() if not _inside_stack(spec.graph, path)) if spec.graph else 0
    if spec.tie_word_embeddings:  # a tied head multiplies by the (fp32 after preparation) embedding matrix
        head += spec.vocab_size * spec.hidden_size
    if checkpointing:  # the blocks' casts are not saved (recomputed); the cache is gone once autocast exits
        return 2 * head if base.quantized or base is BaseWeights.FP32 else 0
    if base.quantized:
        return 2 * (adapters + head) + extra
    if base is not BaseWeights.FP32:
        return 2 * adapters + extra
    frozen = sum(_frozen_linear_elems(spec.graph))
    return 2 * (adapters + frozen) + extra


def _inside_stack(graph, path: str) -> bool:
    return any(path.startswith(stack.name + ".") for stack in graph.stacks)


def _frozen_linear_elems(graph):
    """Weight elements of every frozen projection, per layer counted once per layer (LoRA bases included)."""
    for stack in graph.stacks:
        for _, node in stack_linears(stack):
            yield stack.count * (node.base.weight_numel if isinstance(node, LoraLinear) else node.weight_numel)
    for path, node in graph.linears():
        if not _inside_stack(graph, path):
            yield node.base.weight_numel if isinstance(node, LoraLinear) else node.weight_numel


def stack_linears(stack):
    from ..graph import linears_of

    return linears_of(stack.block, f"{stack.name}.*")


def recomputed_casts(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Under checkpointing and autocast the recomputed block casts its weights again and keeps the casts for its
    backward: the adapters' (and an fp32 frozen base's) bf16 copies of one block."""
    if not setup.precision.is_autocast or spec.graph is None or not spec.graph.stacks:
        return 0
    stack = spec.graph.stacks[0]
    adapters = frozen = 0
    for _, node in stack_linears(stack):
        if isinstance(node, LoraLinear):
            adapters += node.a.weight_numel + node.b.weight_numel
            frozen += node.base.weight_numel
        elif not node.trainable:
            frozen += node.weight_numel
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    return 2 * (adapters + (frozen if base is BaseWeights.FP32 else 0))


# --- checkpointed LoRA steps: what a block's recompute and its frozen MLP's backward hold ---------------------------
# Measured on allocation timelines of real checkpointed peft steps (profiler memory events, module-labelled):
# - torch.utils.checkpoint (non-reentrant, preserve_rng_state=True) keeps the CPU generator state per layer until
#   that layer's backward (torch.get_rng_state(): the mt19937 state, 5,056 bytes) and takes one more in each
#   recompute; it lives on the device only when the device is the CPU.
# - the recompute stops early (_StopRecomputationError once the last saved tensor is packed), so the Python locals
#   of the decoder layer, its MLP and peft's lora.Linear.forward are still alive at that moment: the residual sum,
#   the MLP input, down_proj's input, base_layer(x), peft's fp32 cast of x, the dropout output;
# - a frozen gated MLP's backward holds the product's gradient and both factors' (3 x B x T x I) with the
#   residual gradient, all of the block's saved tensors still alive;
# - with an fp32 residual stream the first RMSNorm's x.to(float32) is x itself: the checkpoint, not a new tensor;
# - peft's enable_input_require_grads makes the embedding output a leaf that autograd keeps to the end of backward.

CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state() on the CPU generator: the mt19937 state as a uint8 tensor."""


def checkpointed_moments(step, moments: dict) -> dict:
    """The backward moments of a checkpointed LoRA step of a gated-MLP decoder (the Llama family's recipe):
    the last block's recompute (R) and frozen-MLP backward (B), and the same for block 0 once every other
    block's adapters have their gradients; the loss backward with the RNG states. Other families keep the
    generic moments (bench/lora_accuracy.py lists how close they are)."""
    from .activations import rms_gated_layer
    from .result import Category, Phase, Term

    spec, setup, d = step.spec, step.setup, step.dtypes
    if not rms_gated_layer(spec):
        # GPT-2 / BERT: the token embedding is followed by adds, so the leaf peft's enable_input_require_grads
        # makes is a tensor of its own, kept to the end of backward (the rest of their recompute is not modelled)
        leaf = Term("activations/embedding_leaf", Category.ACTIVATIONS, step.tokens * spec.hidden_size * d.residual,
                    "the embedding output, a leaf autograd keeps to the end (peft enable_input_require_grads)",
                    "torch autograd AccumulateGrad")
        return {name: (phase, list(terms) + [leaf]) for name, (phase, terms) in moments.items()
                if phase is Phase.BACKWARD and terms}
    ft = setup.finetune
    n, h, inter, layers = step.tokens, spec.hidden_size, spec.intermediate_size, spec.num_layers
    res, cmp = d.residual, d.compute
    mlp = res if d.mlp_in_residual else cmp
    base = ft.base_storage(setup.precision.compute_dtype)
    shares_x = not d.autocast and cmp == 4 and res == 4 and ft.dropout == 0
    roles = adapted_roles(spec)
    down = roles.get("down", [None])[0]
    rng = CPU_RNG_STATE_BYTES if d.on_cpu else 0

    def term(name: str, num_bytes: int, formula: str, category=Category.TEMPORARIES) -> Term:
        return Term(name, category, int(num_bytes), formula, "torch.utils.checkpoint recompute, peft lora.Linear")

    def without_layer_temps(name: str) -> list[Term]:
        return [t for t in moments[name][1] if t.name != "temporaries/layer_backward"]

    first_norm = n * h * res if res == 4 else 0
    # R: the recompute's own peak, inside down_proj's adapter (or at the frozen down_proj)
    locals_ = n * h * res if res == 2 else 0  # the post-attention residual sum (an fp32 one the norm saves)
    if down is not None:
        if not shares_x:
            locals_ += n * h * res + n * inter * mlp  # the MLP input, down_proj's input
        locals_ += n * h * mlp  # base_layer(x)
        locals_ += n * inter * 4 if mlp != 4 else 0  # peft's fp32 cast of x
        locals_ += n * inter * 4 if ft.dropout > 0 and d.autocast else 0  # the dropout output (its cast is saved)
        locals_ -= 2 * down.rank * h if d.autocast else 0  # lora_B's cast, not made yet
        incoming = n * h * res + n * h * cmp  # the residual gradient and lora_B's output gradient
    else:
        locals_ += n * h * res  # the MLP input (frozen gate/up keep nothing)
        locals_ += 0 if base.four_bit else n * inter * mlp  # the product (a 4-bit down_proj packs nothing)
        incoming = n * h * res
    recompute = [term("temporaries/recompute_locals", locals_, "the layer's forward locals still alive when the "
                      "recompute stops at its last saved tensor"),
                 term("temporaries/incoming_gradient", incoming, "the gradient flowing into the block")]
    # B: the frozen gated MLP's backward (the product's and both factors' gradients + the residual gradient)
    freed = 0
    if down is not None:
        freed = n * down.rank * (2 if d.autocast else 4) + (n * inter * 4 if ft.dropout > 0 and d.on_cpu else 0)
        freed += 0 if shares_x else n * inter * (2 if d.autocast else 4)
    mlp_backward = [term("temporaries/frozen_mlp_backward", n * h * res + 3 * n * inter * mlp - freed,
                         "B x T x h residual gradient + 3 x B x T x I: the gradients of act * up and of both "
                         "factors, in the MLP's dtype")]

    def with_rng(terms: list[Term], states: int) -> list[Term]:
        if not states:
            return terms
        return terms + [term("activations/rng_states", states * rng, f"{states} x {rng} B: torch.get_rng_state() "
                             "kept per checkpointed layer (CPU device)", Category.ACTIVATIONS)]

    def minus_first_norm(terms: list[Term]) -> list[Term]:
        if not first_norm:
            return terms
        return [replace(t, num_bytes=t.num_bytes - first_norm) if t.name == "activations/recomputed_block" else t
                for t in terms]

    last = minus_first_norm(without_layer_temps("first block backward"))
    first = minus_first_norm(without_layer_temps("end of backward"))
    leaf = [term("activations/embedding_leaf", n * h * res, "the embedding output, a leaf autograd keeps to the "
                 "end (peft enable_input_require_grads)", Category.ACTIVATIONS)]
    return {
        "loss backward": (Phase.BACKWARD, with_rng(list(moments["loss backward"][1]), layers)),
        "first block backward": (Phase.BACKWARD, with_rng(last + recompute, layers + 1)),
        "first block MLP backward": (Phase.BACKWARD, with_rng(last + mlp_backward, layers)),
        "end of backward": (Phase.BACKWARD, with_rng(first + leaf + recompute, 2)),
        "block 0 MLP backward": (Phase.BACKWARD, with_rng(first + leaf + mlp_backward, 1)),
    }


def int8_keeps_inputs(setup: TrainingSetup, d) -> bool:
    """bitsandbytes' CPU int8 matmul (MatMul8bitFp, used in training on CPU) keeps its input as `ctx.A`, outside
    save_for_backward, even for a frozen weight: every int8 Linear's input stays alive (checkpointing cannot drop
    it). Measured on CPU without autocast; the autocast and CUDA LLM.int8 paths are not modelled."""
    return (d.on_cpu and not d.autocast
            and setup.finetune.base_storage(setup.precision.compute_dtype) is BaseWeights.INT8)


def int8_checkpointed_inputs(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int, d) -> int:
    """Under checkpointing, the int8 inputs (int8_keeps_inputs) of every layer, which the recompute cannot free."""
    from .activations import projection_input_rows

    if not int8_keeps_inputs(setup, d):
        return 0
    rows = projection_input_rows(spec, setup, seq_len, d)
    return int(spec.num_layers * tokens * sum(d.bytes_of(r) for r in rows))
