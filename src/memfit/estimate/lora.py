"""LoRA and QLoRA: what peft and bitsandbytes really keep, as a transform of the ModelSpec the estimator sizes.

`adapted_spec(spec, setup)` rewrites the model graph with memfit.graph.with_lora (every targeted Linear becomes a
frozen base plus trainable A and B) and returns a spec whose `params` are the trainable tensors (so gradients,
optimizer states and their temporaries follow from the same formulas as a full fine-tune) and whose `frozen`
tensors carry their storage bytes:

- adapters: under peft fp32 whatever the base (`get_peft_model(..., autocast_adapter_dtype=True)`, the default,
  upcasts bf16/fp16 adapter weights: peft/tuners/tuners_utils.py `cast_adapter_dtype`); under torchtune the
  model's dtype (memfit.finetune.LoraRecipe);
- frozen base in bf16 / fp16 / fp32: 2 / 2 / 4 B per element;
- 4-bit base (bitsandbytes Linear4bit, QLoRA, Dettmers et al. 2023 arXiv:2305.14314 sec. 3): every Linear inside
  the blocks packed two weights per byte, plus one absmax per 64-element block, fp32, or under double quantization
  uint8 absmax with one fp32 second-level absmax per 256 of them, the 256-entry fp32 map and an fp32 offset
  (bitsandbytes.functional.quantize_4bit / QuantState); the 16-entry code of the 4-bit type;
- 8-bit base (LLM.int8, Dettmers et al. 2022 arXiv:2208.07339): int8 weights and one fp32 scale per output row
  (bitsandbytes Int8Params.SCB);
- what bitsandbytes leaves unquantized: the embedding, the LM head (transformers' `get_keys_to_not_convert`), norms
  and biases; peft's `prepare_model_for_kbit_training` (called by the QLoRA reference script, and by TRL's
  SFTTrainer up to v0.26 outside FSDP / ZeRO-3) upcasts those to fp32, unless Finetune.kbit_prep is False
  (fsdp_qlora, LitGPT, axolotl, LLaMA-Factory, TRL >= 0.27: the model's dtype);
- torchtune's 4-bit base (quantize_base): torchao's NF4Tensor (torchao.quantization...nf4_tensor `to_nf4`, block
  64, scaler block 256) for every block Linear, adapted or not (FrozenNF4Linear): the packed codes (0.5 B), an int8
  scaler per 64 elements, one quantization factor per 256 scalers and the scalers' mean in the weight's dtype, and
  its 16-entry NF4 table in that dtype; embeddings, norms and head stay in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import ConfigError
from ..finetune import ALL_LINEAR, BaseWeights, Finetune
from ..graph import Linear, LoraLinear, with_lora
from ..graph.kinds.heads import ClassificationHead, LMHead, MaskedLMHead, Seq2SeqLMHead
from ..graph.registry import walk
from ..derive.model import Adapters
from ..model_spec import ModelSpec, ParamTensor
from ..setup import TrainingSetup, deepspeed_casts_module, fsdp2_mixed_precision
from ..units import DTYPE_BYTES
from . import derived as derive
from . import dora, fsdp1, lora_checkpoint
from .moe import has_experts

BNB_4BIT_BLOCK = 64  # bnb_4bit_blocksize default (BitsAndBytesConfig / bnb.nn.Params4bit blocksize=64)
BNB_NESTED_BLOCK = 256  # double quantization: absmax quantized in blocks of 256 (quantize_blockwise default)
BNB_NESTED_CODE = 256  # the dynamic map of the nested quantization, fp32[256]
BNB_4BIT_CODE = 16  # the NF4 / FP4 code, fp32[16]
TORCHAO_NF4_BLOCK = 64  # torchao to_nf4(block_size=64)
TORCHAO_NF4_SCALER_BLOCK = 256  # to_nf4(scaler_block_size=256): the int8 scalers' own blocks

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
    compute = setup.precision.compute_dtype
    if spec.derived is not None and not hasattr(spec.derived, "with_adapters"):
        # a stacked model (memfit.derive.stacks: encoder-decoders, vision encoders) has no traced adapter fits yet
        raise ConfigError(f"{ft.method} on '{spec.name}' is not sized yet: its activations come from traces of "
                          "copies per stack (memfit.derive.stacks), which carry no adapters; use `memfit trace`, or "
                          "size a full fine-tune")
    if spec.derived is not None and _traces_adapters(spec, setup):
        # a family sized by derived formulas: its fits are traced with these adapters on the copies (issue 20)
        spec = replace(spec, derived=spec.derived.with_adapters(Adapters.of(ft, compute, derive_targets(graph, ft))))
    base = ft.base_storage(compute)
    quantizable = _quantizable_weights(adapted)
    save_names = _modules_to_save(adapted, ft.modules_to_save)
    other_bytes = unquantized_bytes(ft, base, compute)
    trainable, frozen = [], []
    a_bytes = adapter_bytes(setup)
    for t in adapted.tensors():
        if t.trainable:
            trainable.append(ParamTensor(t.name, t.numel, t.count, a_bytes * t.numel))
            continue
        if t.name in quantizable and base.quantized:
            rows = quantizable[t.name]
            stored = (torchao_nf4_bytes(t.name, t.numel, _DTYPE_BYTES[compute]) if ft.torchtune else
                      quantized_weight_bytes(t.numel, rows, base, ft.double_quant))
            frozen.append(ParamTensor(t.name, t.numel, t.count, stored))
        else:
            frozen.append(ParamTensor(t.name, t.numel, t.count, other_bytes * t.numel))
        if any(t.name.startswith(prefix + ".") for prefix in save_names):
            # peft's ModulesToSaveWrapper: the original stays (frozen) and a trainable copy is made, same dtype
            trainable.append(ParamTensor(t.name.replace(".weight", ".modules_to_save.weight"), t.numel, t.count,
                                         other_bytes * t.numel))
    if ft.dora:  # one trainable magnitude vector per adapted Linear (memfit.estimate.dora)
        trainable += dora.magnitude_tensors(trainable, ft.rank)
    return replace(spec, params=tuple(trainable), frozen=tuple(frozen), graph=adapted)


def derives_adapters(setup: TrainingSetup) -> bool:
    """Whether a derived family's fits are traced with the LoRA adapters on (memfit.derive.model.Adapters): peft's
    fp32 adapters as a single device runs them (no engine casting them to 16 bits)."""
    return (Adapters.supported(setup.finetune, setup.precision.compute_dtype) and adapter_bytes(setup) == 4
            and not fsdp2_mixed_precision(setup))


def _traces_adapters(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """derives_adapters, for a model without experts: on a tiny Mixtral (bench/lora_derived.py, not in its
    table) peft's 'all-linear' adapts more than the trace's Linears (the stacked experts), and fp32 experts keep
    other tensors in the trace's balanced routing than in the real step: MoE keeps the formulas until measured."""
    return derives_adapters(setup) and not has_experts(spec)


def adapted_derived(spec: ModelSpec) -> bool:
    """Whether the spec's derived fits already hold what its LoRA adapters keep."""
    return spec.derived is not None and getattr(spec.derived, "adapters", None) is not None


def derive_targets(graph, ft: Finetune) -> tuple[str, ...]:
    """peft's target_modules as the traced copy gets them: 'all-linear' (resolved on the copy), the names given,
    or peft's default for the architecture."""
    return (ALL_LINEAR,) if ft.targets == (ALL_LINEAR,) else lora_targets(graph, ft)


def adapter_bytes(setup: TrainingSetup) -> int:
    """Bytes per adapter element as the run holds them: peft's fp32, torchtune's model dtype
    (Finetune.adapter_bytes), or 16-bit where DeepSpeed's engine casts the whole module (deepspeed_casts_module)."""
    if deepspeed_casts_module(setup):
        return 2
    return setup.finetune.adapter_bytes(setup.precision.compute_dtype)


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
    head (transformers' bnb integration skips `get_keys_to_not_convert`, the output embeddings), but a subclass
    of it, which the loader leaves as it is, and but a model's `_keep_in_fp32_modules` (Linear.bnb_quantized);
    a biased classification head is packed (below)."""
    out = {}
    for path, node in _block_linears(graph):
        if node.bnb_quantized:
            out[f"{path}.weight"] = node.out_features
    for path, node, parents in walk(graph):
        # a classifier with a bias is packed too: get_keys_to_not_convert (transformers 5 quantizers/base.py) keeps
        # the output embeddings (a classifier has none) and "the last module", found as the last parameter's name
        # with ".weight" removed: the classifier's bias names no module, so its Linear is converted (ViT, BERT)
        if (isinstance(node, Linear) and node.bias and node.bnb_quantized and parents
                and isinstance(parents[-1][0], ClassificationHead) and parents[-1][1] == "proj"):
            out[f"{path}.weight"] = node.out_features
    for path, node, parents in walk(graph):  # LoRA bases: <path>.base_layer
        if isinstance(node, LoraLinear) and node.base.bnb_quantized:
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


_DTYPE_BYTES = DTYPE_BYTES  # the one dtype table (memfit.units); the private name kept for lora_sharded


def unquantized_bytes(ft: Finetune, base: BaseWeights, compute_dtype: str) -> int:
    """Bytes per element of what the base does not quantize (embeddings, norms, head): fp32 after peft's
    prepare_model_for_kbit_training, else the model's dtype; a 16/32-bit base: its dtype."""
    if not base.quantized:
        return _DTYPE_BYTES[base.value]
    return 4 if ft.upcasts_unquantized() else _DTYPE_BYTES[compute_dtype]


def torchao_nf4_bytes(name: str, numel: int, dtype_bytes: int) -> int:
    """Bytes of torchao's NF4Tensor for a weight of `numel` elements quantized from `dtype_bytes`-byte floats
    (NF4Tensor.from_tensor: quantized_data uint8[numel / 2], quantized_scalers int8[numel / 64],
    quantization_factor[numel / 64 / 256] and scaler_mean[] in the weight's dtype, the nf4 table [16] likewise).
    to_nf4 asserts both divisions are exact."""
    if numel % (TORCHAO_NF4_BLOCK * TORCHAO_NF4_SCALER_BLOCK):
        raise ConfigError(f"torchao NF4 cannot quantize {name} ({numel:,} elements): to_nf4 needs a multiple of "
                          f"{TORCHAO_NF4_BLOCK * TORCHAO_NF4_SCALER_BLOCK:,} (block 64 x scaler block 256); use "
                          "--lora-recipe peft (bitsandbytes pads the last block)")
    blocks = numel // TORCHAO_NF4_BLOCK
    return numel // 2 + blocks + dtype_bytes * (blocks // TORCHAO_NF4_SCALER_BLOCK + 1 + BNB_4BIT_CODE)


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
               "(non-quantized parameters upcast to fp32); torchtune: torchao NF4Tensor")


def base_label(spec: ModelSpec, setup: TrainingSetup) -> str:
    """How the frozen base is stored, in words: 'bf16', 'nf4 + double quantization; the rest fp32'."""
    ft = setup.finetune
    base = ft.base_storage(setup.precision.compute_dtype)
    if not base.quantized:
        return str(base)
    if ft.torchtune:
        return f"torchao NF4 Linear weights; embeddings, head and norms {setup.precision.compute_dtype}"
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
    shares_x, low = adapter_reads(setup, d)
    kept = []
    for item in items:
        if not item.role:
            kept.append(item)
        elif item.role in roles and shares_x:  # lora_A saves the very tensor the base Linear would have
            kept.append(replace(item, role="", readers=1))
        elif item.role in _GROUP_OF_ROLE and int8_keeps_inputs(setup, d):
            kept.append(replace(item, role="int8", readers=1))
        elif fsdp1.mixes_frozen(setup):  # FSDP1: the frozen weights' views require grad (memfit.estimate.fsdp1)
            kept.append(item)
    for role, linears in roles.items():
        group = _GROUP_OF_ROLE[role]
        for node in linears:
            if not shares_x:
                # its own copy of x: bf16 under autocast (or FSDP2's bf16 adapters), else fp32 (peft's cast, or
                # the dropout output)
                kept.append(Saved(group, node.in_features, low))
            if ft.dropout > 0:
                kept.append(Saved(group, node.in_features, _mask(setup, d)))
            kept.append(Saved(group, node.rank, low))  # lora_A's output, kept by lora_B
    if ft.dora:
        kept += dora.saved_rows(roles, _GROUP_OF_ROLE, low,
                                ft.base_storage(setup.precision.compute_dtype).quantized)
    return kept


def adapter_reads(setup: TrainingSetup, d) -> tuple[bool, str]:
    """(whether lora_A saves the very x its base Linear reads, the dtype class of the adapters' own saved tensors).
    peft casts x to the adapters' dtype and autocast casts it to bf16: each cast of a tensor already in that dtype
    is the tensor itself. So x is shared when there is no dropout and x is already in the dtype the adapters compute
    in: fp32 adapters on an fp32 stream without autocast; 16-bit adapters (torchtune, or FSDP2's MixedPrecisionPolicy
    casting the gathered adapters) on a 16-bit stream."""
    ft = setup.finetune
    if fsdp1.adapters_cast_input(setup):  # FSDP1 + peft's policy: lora_A keeps its own bf16 x
        return False, "c16"
    if fsdp1.mixes_frozen(setup):  # one dtype per flat parameter: the adapters compute in the base's
        return ft.dropout == 0, "c16" if d.compute == 2 else "f32"
    in_compute = fsdp2_mixed_precision(setup) or adapter_bytes(setup) == 2
    if in_compute:
        same = d.compute == 2 and d.residual == 2 or fsdp2_mixed_precision(setup)
    else:
        same = not d.autocast and d.compute == 4 and d.residual == 4
    return ft.dropout == 0 and same, "c16" if d.autocast or in_compute else "f32"


def first_layer_unsaved(spec: ModelSpec, setup: TrainingSetup, d) -> float:
    """Per-token bytes layer 0 does not save under LoRA when nothing before it needs a gradient (a frozen
    embedding, and no peft `enable_input_require_grads`, which the Trainer calls only with checkpointing): its
    first norm keeps no input for an input gradient nobody asks for."""
    from .activations import Saved, first_norm_input_rows

    if not spec.frozen or setup.checkpointing.value != "none" and setup.finetune.asks_input_gradient():
        return 0.0
    if adapted_derived(spec):  # traced: the 1-block copy with and without its input requiring grad

        tokens = setup.tokens_per_micro_step
        return derive.lora_bytes(spec, setup, "first", tokens, setup.seq_len, d.on_cpu) / tokens
    # a post-norm layer 0 starts with its projections (the embedding LayerNorm is counted there)
    rows = first_norm_input_rows(spec, d)
    if setup.finetune.dropout > 0:  # the first adapters' dropout keeps no mask: their input needs no gradient
        rows += [Saved("norms", node.in_features, _mask(setup, d)) for node in adapted_roles(spec).get("qkv", [])]
    return sum(d.bytes_of(r) for r in rows)


def first_layer_groups(spec: ModelSpec, first: int, per_layer: dict[str, int], layers: int) -> dict[str, int]:
    """Which saved groups layer 0's `first` unsaved bytes come off: its first norm's under the formulas; for a
    derived family whatever it is (a parallel-residual block with q/v-only adapters keeps no MLP tensor in layer
    0: nothing in its MLP needs a gradient), taken from the norms, then the MLP, then attention."""
    if not adapted_derived(spec):
        return {"norms": first}
    out = {}
    for group in ("norms", "mlp", "attention"):
        out[group] = min(first, max(0, layers * per_layer[group]))
        first -= out[group]
    return out


def _mask(setup: TrainingSetup, d) -> str:
    """Dtype class of a LoRA dropout mask: on CPU the composite dropout's float mask of its input, which peft has
    cast to the adapters' dtype (fp32, or 16-bit under torchtune); on CUDA native_dropout's bool mask."""
    if not d.on_cpu:
        return "u8"
    return "c16" if adapter_bytes(setup) == 2 else "f32"


def dequantized_weight_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The transient a quantized frozen Linear makes in backward: bitsandbytes dequantizes the whole weight
    (MatMul4Bit.backward: dequantize_4bit in the dtype it was quantized from, bf16 here; int8: CB * SCB / 127 in
    the input's dtype), one weight at a time: the largest one sets it."""
    ft = setup.finetune
    base = ft.base_storage(setup.precision.compute_dtype)
    if not base.quantized:
        return 0
    largest = max((p.numel for p in spec.frozen if p.nbytes < 2 * p.numel), default=0)
    if ft.torchtune:
        return int(torchao_dequantize_bytes_per_elem(_DTYPE_BYTES[setup.precision.compute_dtype], setup.compile)
                   * largest)
    per = 2 if base.four_bit or setup.precision.is_autocast else 4
    return per * largest


def torchao_dequantize_bytes_per_elem(dtype_bytes: int, compiled: bool) -> float:
    """Bytes per weight element alive at the peak of torchao's NF4 dequantization (linear_nf4, forward and
    backward: `weight.to(dtype)` -> NF4Tensor.get_original_weight). Eager, every local of get_original_weight is
    alive when torch.stack makes the result: the two int64 code halves (2 x numel / 2 x 8 B), the two looked-up
    halves, the two scaled halves and the stacked weight (3 x numel x dtype) and the dequantized scalers
    (numel / 64 x dtype): 14.03 B per element from bf16 (measured: 14.031 on CPU). Compiled (torchtune compiles
    each layer), inductor fuses the chain into the dequantized weight alone."""
    if compiled:
        return dtype_bytes
    return 8 + 3 * dtype_bytes + dtype_bytes / TORCHAO_NF4_BLOCK


def autocast_copies(spec: ModelSpec, setup: TrainingSetup, checkpointing: bool) -> int:
    """Bytes of bf16 weight copies autocast makes and backward keeps, under LoRA: the adapters' (cached, as a
    trainable leaf's cast is), and a fresh copy per call of every frozen fp32 Linear the gradient flows through
    (autocast caches only leaves that require grad) — the whole fp32 base, or with a quantized base only the
    fp32 LM head prepare_model_for_kbit_training left; under checkpointing only the head's outlives its block."""
    ft = setup.finetune
    # no matmul takes a magnitude; a 16-bit adapter (torchtune) is already in autocast's dtype: no copy
    fp32_adapters = adapter_bytes(setup) == 4
    adapters = sum(p.total for p in spec.params if dora.MAGNITUDE not in p.name) if fp32_adapters else 0
    extra = dora.autocast_copies(spec, setup)
    base = ft.base_storage(setup.precision.compute_dtype)
    head = sum(node.base.weight_numel if isinstance(node, LoraLinear) else node.weight_numel
               for path, node in spec.graph.linears() if not _inside_stack(spec.graph, path)) if spec.graph else 0
    if spec.tie_word_embeddings:  # a tied head multiplies by the (fp32 after preparation) embedding matrix
        head += spec.vocab_size * spec.hidden_size
    if base.quantized and not ft.upcasts_unquantized():
        head = 0  # torchtune: the head stays 16-bit, autocast's cast of it is the tensor itself
    if adapted_derived(spec):  # the blocks' casts are in its traced blocks (KindFit.block_bytes): the head's
        return 2 * head if base.quantized or base is BaseWeights.FP32 else 0
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
    if not setup.precision.is_autocast or spec.graph is None or not spec.graph.stacks or adapted_derived(spec):
        return 0  # a derived family under LoRA: its traced block holds its casts (KindFit.block_bytes)
    stack = spec.graph.stacks[0]
    adapters = frozen = 0
    for _, node in stack_linears(stack):
        if isinstance(node, LoraLinear):
            adapters += node.a.weight_numel + node.b.weight_numel
            frozen += node.base.weight_numel
        elif not node.trainable:
            frozen += node.weight_numel
    ft = setup.finetune
    base = ft.base_storage(setup.precision.compute_dtype)
    adapters *= adapter_bytes(setup) == 4  # 16-bit adapters are not cast
    return 2 * (adapters + (frozen if base is BaseWeights.FP32 else 0))


def checkpointed_moments(step, moments: dict) -> dict:
    """The backward moments of a checkpointed LoRA step (memfit.estimate.lora_checkpoint)."""
    return lora_checkpoint.checkpointed_moments(step, moments)


def int8_keeps_inputs(setup: TrainingSetup, d) -> bool:
    """bitsandbytes' CPU int8 matmul (MatMul8bitFp, used in training on CPU) keeps its input as `ctx.A`, outside
    save_for_backward, even for a frozen weight: every int8 Linear's input stays alive (checkpointing cannot drop
    it). Measured on CPU; the CUDA LLM.int8 path is not modelled."""
    return (d.on_cpu and not d.autocast
            and setup.finetune.base_storage(setup.precision.compute_dtype) is BaseWeights.INT8)


def int8_checkpointed_inputs(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int, d) -> int:
    """Under checkpointing, the int8 inputs (int8_keeps_inputs) of every layer, which the recompute cannot free."""
    from .activations import projection_input_rows

    if not int8_keeps_inputs(setup, replace(d, autocast=False)):
        return 0
    # autocast casts no input of a custom autograd Function: ctx.A is the tensor the layer was given, in the
    # residual stream's dtype, one per distinct input (measured under amp-bf16: fp32 norm outputs, kept to the
    # loss backward)
    plain = replace(d, autocast=False)
    rows = projection_input_rows(spec, setup, seq_len, plain)
    return int(spec.num_layers * tokens * sum(plain.bytes_of(r) for r in rows))
