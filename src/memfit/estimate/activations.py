"""What autograd keeps for backward, tensor by tensor, for the transformer families memfit knows.

Each family is a *recipe*: the tensors one layer saves, per token, with their dtype class. The recipes were read off
the transformers 5.x modelling code and checked tensor by tensor with `torch.autograd.graph.saved_tensors_hooks` on
tiny real models (tests/test_estimate_accuracy.py measures whole steps against the profiler).

Dtype classes: 'f32' always fp32; 'res' the residual stream (fp32 under fp32 and autocast, bf16 when pure bf16);
'cmp' a matmul output (fp32, or bf16/fp16 under autocast and pure bf16); 'lin' the input a Linear saves: under
autocast every Linear casts its fp32 input to its own bf16 copy (autocast caches casts of weights only), otherwise
all Linears reading one tensor share it, so 'lin' rows carry how many Linears read the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_spec import ModelSpec
from ..setup import Attention, Checkpointing, Precision, TrainingSetup


@dataclass(frozen=True)
class Saved:
    """Per-token elements of one saved tensor (or `readers` Linears' inputs) in one layer."""

    group: str  # attention / mlp / norms
    elems: float
    dtype: str  # f32 / res / cmp / lin
    readers: int = 1
    role: str = ""
    """Saved only for a weight's gradient, and so not when that weight is frozen: 'norm' (a norm's normalised
    value, which its weight multiplies), or the projection whose input it is ('qkv', 'out', 'up', 'down', 'head')."""


@dataclass(frozen=True)
class Dtypes:
    residual: int
    compute: int
    autocast: bool
    on_cpu: bool = False
    """CPU kernels differ: dropout keeps a mask in the input's dtype (CUDA: bool), and SDPA with dropout falls
    back to the math path that materialises T x T (CUDA's flash / memory-efficient kernels do not)."""
    mlp_in_residual: bool = False
    """The MLP's matmul outputs come back in the residual dtype: a bitsandbytes-quantized frozen Linear returns
    its input's dtype (Linear4bit.forward `.to(inp_dtype)`), fp32 once prepare_model_for_kbit_training made the
    norms fp32, even under autocast."""

    @classmethod
    def of(cls, precision: Precision, on_cpu: bool = False) -> "Dtypes":
        if precision.is_autocast:
            return cls(residual=4, compute=2, autocast=True, on_cpu=on_cpu)
        if precision.param_dtype == "bf16":
            return cls(residual=2, compute=2, autocast=False, on_cpu=on_cpu)
        return cls(residual=4, compute=4, autocast=False, on_cpu=on_cpu)

    @property
    def mask(self) -> str:
        """Dtype class of a dropout mask."""
        return "cmp" if self.on_cpu else "u8"

    def bytes_of(self, item: Saved) -> float:
        if item.dtype == "f32":
            return 4 * item.elems
        if item.dtype == "res" or (item.dtype == "cmp" and self.mlp_in_residual and item.group == "mlp"):
            return self.residual * item.elems
        if item.dtype in ("cmp", "c16"):  # c16: the compute dtype whatever the group (an autocast cast)
            return self.compute * item.elems
        if item.dtype == "u8":
            return item.elems
        if item.dtype == "i64":  # index tensors (top-k indices, MoE token permutations)
            return 8 * item.elems
        # 'lin': one shared copy in the residual dtype, or one bf16 copy per reading Linear under autocast
        copies = item.readers if self.autocast else 1
        size = self.compute if self.autocast else self.residual
        return copies * size * item.elems


def dtypes(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> Dtypes:
    """The dtype classes of a step: the precision's, or with a LoRA base stored in 16 bits a 16-bit residual
    stream (the embedding and norms are bf16 too), or with a quantized base an fp32 one (peft's
    prepare_model_for_kbit_training upcasts the embedding and norms; the 4-bit Linears return their input's dtype)."""
    d = Dtypes.of(setup.precision, on_cpu)
    if not spec.frozen:
        return d
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if base.quantized:
        return Dtypes(residual=4, compute=2 if d.autocast else 4, autocast=d.autocast, on_cpu=on_cpu,
                      mlp_in_residual=True)
    if base.value in ("bf16", "fp16"):
        return Dtypes(residual=2, compute=2, autocast=d.autocast, on_cpu=on_cpu)
    return d


def _rmsnorm(spec: ModelSpec, d: Dtypes, count: int = 1) -> list[Saved]:
    # LlamaRMSNorm: x.to(fp32) (saved by pow and mul), rsqrt (B*T*1), normalised x cast back (saved by weight mul).
    # Gemma2RMSNorm keeps the normalised value in fp32: `_norm(x.float()) * (1 + w.float())`.
    normed = "f32" if spec.model_type == "gemma2" else "res"
    h = spec.hidden_size
    return [Saved("norms", h, "f32"), Saved("norms", 1, "f32"), Saved("norms", h, normed, role="norm")] * count


def _layernorm(spec: ModelSpec, count: int = 1, input_saved: bool = True) -> list[Saved]:
    # aten.native_layer_norm saves its input plus fp32 mean and rstd (B*T*1 each).
    rows = [Saved("norms", 1, "f32"), Saved("norms", 1, "f32")]
    if input_saved:
        rows.append(Saved("norms", spec.hidden_size, "res"))
    return rows * count


def _attention_core(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """q, k, v, output and softmax statistics (SDPA) or the T x T probabilities (eager)."""
    h, kv, heads = spec.hidden_size, spec.kv_dim, spec.num_attention_heads
    q = heads * spec.head_dim or h  # the query/output width (Gemma 2: 8 x 256 = 2048 beside a 2304 hidden size)
    dropout = spec.extra.get("attention_dropout", 0.0) > 0
    if core_recomputed(setup):
        return _checkpointed_core(spec, q, kv)
    if setup.attention is Attention.SDPA and not (dropout and d.on_cpu):
        # Flash / memory-efficient SDPA saves q, k, v (k, v at kv-head width: GQA is passed through), the output
        # and the fp32 log-sum-exp per head and token; never the T x T matrix.
        k_v = 2 * kv
        if spec.extra.get("fused_qkv") or spec.model_type in ("gpt2", "gpt_neox"):
            # q/k/v are views of one fused projection output; v (and, without rotary, q/k) keep it all alive.
            fused = q + 2 * kv
            rotated = 0 if spec.model_type == "gpt2" else q + kv  # rotary writes new q, k tensors
            # Phi-3 and GPT-NeoX make the attention output contiguous before the output projection: one more
            # q-sized copy (read off saved_tensors_hooks on a real tiny GPTNeoXForCausalLM, transformers 5.24)
            rows = [Saved("attention", fused, "cmp"), Saved("attention", rotated, "cmp"),
                    Saved("attention", q, "cmp"), Saved("attention", heads, "f32")]
            if spec.model_type in ("phi3", "gpt_neox"):
                rows.append(Saved("attention", q, "cmp", role="out"))  # saved by the output projection only
            return rows
        return [Saved("attention", q + k_v, "cmp"), Saved("attention", q, "cmp"), Saved("attention", heads, "f32")]
    # Eager (or CPU SDPA with dropout, which takes the math path): q and k (repeated to all heads) for QK^T, the
    # softmax output, v repeated, and the transposed output copy fed to o_proj. The probabilities that meet v are
    # the softmax cast back to the compute dtype, or with dropout its mask and the dropped probabilities.
    if setup.attention is Attention.SDPA:
        # CPU math fallback: computes in fp32 whatever the input dtype (q, k, v, output; softmax, mask, dropped)
        return [Saved("attention", 3 * q, "f32"), Saved("attention", q, "f32", role="out"),
                Saved("attention", 3 * heads * seq_len, "f32")]
    softmax = eager_softmax_dtype(spec, setup, d.on_cpu)
    # (the output copy is the output projection's input, saved for its weight gradient only)
    rows = [Saved("attention", 3 * q, "cmp"), Saved("attention", q, "cmp", role="out"),
            Saved("attention", heads * seq_len, softmax)]
    if spec.extra.get("attn_logit_softcapping"):
        rows.append(Saved("attention", heads * seq_len, "cmp"))  # Gemma 2: tanh(scores / cap) keeps its output
    if dropout:
        rows += [Saved("attention", heads * seq_len, d.mask), Saved("attention", heads * seq_len, "cmp")]
    elif d.compute == 2 and softmax == "f32":
        rows.append(Saved("attention", heads * seq_len, "cmp"))
    return rows


def core_recomputed(setup: TrainingSetup) -> bool:
    """Megatron's selective recompute on an eager attention: the core (QK^T, softmax, dropout, x V) runs under
    checkpoint, so its T x T tensors are rebuilt in backward. SDPA's kernels keep no T x T: there it changes
    nothing and memfit leaves the attention as it is."""
    return setup.checkpointing is Checkpointing.ATTENTION and setup.attention is Attention.EAGER


def _checkpointed_core(spec: ModelSpec, q: int, kv: int) -> list[Saved]:
    """What a layer keeps of a checkpointed eager core: its inputs q, k, v (the checkpoint holds them; k and v at
    kv-head width, repeat_kv is inside the core) and its output, which the output projection saves. A fused
    projection's q/k/v are views that keep the whole q + 2 kv output alive; rotary on a fused output (Phi-3,
    GPT-NeoX) writes new q, k beside it. Korthikanti et al. 2022 sec. 4.2: the 5·a·s/h term (softmax, dropout mask,
    dropout output) is what goes; the 2 x 2sbh of Q, K and the V input stay."""
    fused = spec.extra.get("fused_qkv") or spec.model_type in ("gpt2", "gpt_neox")
    rotary = spec.model_type not in ("gpt2", "bert")
    if fused:
        rows = [Saved("attention", q + 2 * kv, "cmp")]
        if rotary:
            rows.append(Saved("attention", q + kv, "res"))
    elif rotary:
        # rotary multiplies by the fp32 cos/sin tables: under autocast q and k come out fp32 (the residual dtype)
        rows = [Saved("attention", q + kv, "res"), Saved("attention", kv, "cmp")]
    else:
        rows = [Saved("attention", q + 2 * kv, "cmp")]
    return rows + [Saved("attention", q, "cmp", role="out")]


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
    h, kv, inter = spec.hidden_size, spec.kv_dim, spec.intermediate_size
    q = spec.num_attention_heads * spec.head_dim or h
    if spec.model_type in ("gpt2", "gpt_neox"):
        return [("attention", q + 2 * kv), ("attention", h), ("mlp", inter), ("mlp", h)]
    if spec.model_type == "bert":
        return [("attention", q), ("attention", kv), ("attention", kv), ("attention", h), ("mlp", inter), ("mlp", h)]
    attention = [("attention", q + 2 * kv)] if spec.extra.get("fused_qkv") else [
        ("attention", q), ("attention", kv), ("attention", kv)]
    if spec.gated_mlp:
        mlp = [("mlp", 2 * inter)] if spec.extra.get("fused_gate_up") else [("mlp", inter), ("mlp", inter)]
    else:
        mlp = [("mlp", inter)]
    return attention + [("attention", h)] + mlp + [("mlp", h)]


def selective_kept(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    """What the selective-op policy keeps of one layer (memfit._torch.blocks.selective_op_context, torchtitan's op
    SAC): the 1st, 3rd, ... matmul outputs in the compute dtype, and the SDPA kernel's output and fp32 log-sum-exp.
    Eager attention's bmm / softmax are not on the list: recomputed. CPU SDPA with dropout takes the math path,
    whose ops are recomputed too."""
    rows = [Saved(group, width, "cmp") for i, (group, width) in enumerate(_matmul_widths(spec)) if i % 2 == 0]
    dropout = spec.extra.get("attention_dropout", 0.0) > 0
    if setup.attention is Attention.SDPA and not (dropout and d.on_cpu):
        q = spec.num_attention_heads * spec.head_dim or spec.hidden_size
        rows += [Saved("attention", q, "cmp"), Saved("attention", spec.num_attention_heads, "f32")]
    return rows


def selective_kept_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                         on_cpu: bool = False) -> int:
    """Bytes one layer keeps between its forward and backward under selective-op (beyond its input)."""
    d = dtypes(spec, setup, on_cpu)
    return int(sum(d.bytes_of(r) for r in selective_kept(spec, setup, seq_len, d)) * tokens)


def eager_softmax_dtype(spec: ModelSpec, setup: TrainingSetup, on_cpu: bool = False) -> str:
    """The Llama family's eager attention takes the softmax in fp32 (`softmax(..., dtype=torch.float32)`);
    GPT-2's and BERT's take it in the scores' dtype. Under autocast the scores are fp32 anyway on CUDA (autocast's
    CUDA fp32 list has softmax), and on CPU for causal models (the fp32 additive mask promotes them); CPU autocast
    leaves BERT's in bf16."""
    if spec.model_type not in ("gpt2", "bert"):
        return "f32"
    if setup.precision.is_autocast and (not on_cpu or spec.is_decoder):
        return "f32"
    return "cmp"


def attention_backward_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                             on_cpu: bool = False) -> int:
    """Transient T x T gradients while an eager (or CPU math-path) attention runs backward: the gradient of the
    probabilities and of the scores, in the softmax's dtype, beside its saved tensors."""
    dropout = spec.extra.get("attention_dropout", 0.0) > 0
    if setup.attention is Attention.SDPA and not (dropout and on_cpu):
        return 0
    d = Dtypes.of(setup.precision, on_cpu)
    dtype = "f32" if setup.attention is Attention.SDPA else eager_softmax_dtype(spec, setup, on_cpu)
    # an fp32 softmax (Llama family) backward holds the gradient of its cast copy and its own; others hold one
    count = 2 if setup.attention is Attention.EAGER and dtype == "f32" else 1
    per_token = count * d.bytes_of(Saved("attention", spec.num_attention_heads * seq_len, dtype))
    if count == 2 and d.compute == 2 and not dropout:
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


def _residual_dropouts(spec: ModelSpec, d: Dtypes, count: int) -> list[Saved]:
    """Dropout on a branch output keeps only its mask."""
    if spec.extra.get("residual_dropout", 0.0) <= 0:
        return []
    return [Saved("norms", spec.hidden_size, d.mask)] * count


def _llama_layer(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    h, inter = spec.hidden_size, spec.intermediate_size
    sandwich = 2 if spec.extra.get("sandwich_norms") else 1  # gemma2 norms before and after attention and MLP
    rows = _rmsnorm(spec, d, 2 * sandwich)
    qkv_readers = 1 if spec.extra.get("fused_qkv") else 3
    rows += [Saved("attention", h, "lin", qkv_readers, role="qkv")] + _attention_core(spec, setup, seq_len, d)
    up_readers = 1 if spec.extra.get("fused_gate_up") else 2
    if spec.gated_mlp:
        # gate out (saved by act), act out and up out (saved by mul), product (saved by down_proj)
        rows += [Saved("mlp", h, "lin", up_readers, role="up"), Saved("mlp", (2 + _act_saved(spec)) * inter, "cmp"),
                 Saved("mlp", inter, "cmp", role="down")]
    else:
        rows += [Saved("mlp", h, "lin", role="up"), Saved("mlp", inter, "cmp"), Saved("mlp", inter, "cmp", role="down")]
    return rows


def _gpt2_layer(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    h, inter = spec.hidden_size, spec.intermediate_size
    rows = _layernorm(spec, 2)
    rows += [Saved("attention", h, "lin", role="qkv")] + _attention_core(spec, setup, seq_len, d)
    rows += [Saved("mlp", h, "lin", role="up"), Saved("mlp", _act_saved(spec) * inter, "cmp"),
             Saved("mlp", inter, "cmp", role="down")]
    return rows + _residual_dropouts(spec, d, 2)


def activation_backward_factor(spec: ModelSpec) -> int:
    """I-sized gradients alive at once in the MLP's backward, net of the down-projection's saved input, freed once
    its backward ran: gelu_new's Python formula chains three (measured), torch's activations one."""
    return 2 if spec.hidden_act == "gelu_new" else 1


def _act_saved(spec: ModelSpec) -> int:
    """I-sized tensors the activation saves: gelu_new is written out in Python (pow, tanh, two muls) and saves
    four; torch's own silu/gelu/relu save their input only."""
    return 4 if spec.hidden_act == "gelu_new" else 1


def _neox_layer(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    h, inter = spec.hidden_size, spec.intermediate_size
    # Parallel residual: both LayerNorms read the same x, saved once.
    rows = _layernorm(spec, 2, input_saved=False) + [Saved("norms", h, "res")]
    rows += [Saved("attention", h, "lin", role="qkv")] + _attention_core(spec, setup, seq_len, d)
    rows += [Saved("mlp", h, "lin", role="up"), Saved("mlp", _act_saved(spec) * inter, "cmp"),
             Saved("mlp", inter, "cmp", role="down")]
    return rows


def _bert_layer(spec: ModelSpec, setup: TrainingSetup, seq_len: int, d: Dtypes) -> list[Saved]:
    h, inter = spec.hidden_size, spec.intermediate_size
    rows = [Saved("attention", h, "lin", 3, role="qkv")] + _attention_core(spec, setup, seq_len, d)
    rows += _layernorm(spec, 2)  # post-LN after attention and after the MLP (inputs are residual sums)
    # gelu input, output.dense input
    rows += [Saved("mlp", h, "lin", role="up"), Saved("mlp", inter, "cmp"), Saved("mlp", inter, "cmp", role="down")]
    return rows + _residual_dropouts(spec, d, 2)


LAYER_RECIPES = {
    "llama": _llama_layer, "mistral": _llama_layer, "qwen2": _llama_layer, "gemma2": _llama_layer,
    "phi3": _llama_layer, "gpt2": _gpt2_layer, "gpt_neox": _neox_layer, "bert": _bert_layer,
}


def layer_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                      on_cpu: bool = False) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward, by group (attention / mlp / norms)."""
    from . import moe
    if moe.applies(spec, setup):  # a graph with Experts: the MoE recipe (memfit.estimate.moe), not the derived model
        return moe.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    if spec.derived is not None:  # no recipe: memfit.derive's fit of a traced 1- and 2-block copy
        from .. import derive
        return derive.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    recipe = LAYER_RECIPES[spec.model_type]
    d = dtypes(spec, setup, on_cpu)
    items = recipe(spec, setup, seq_len, d)
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
    """Bytes saved after the last layer and before the logits: final norm, LM-head input (and BERT's MLM transform).
    `head_input=False`: a fused loss keeps no LM-head input (it saves the input's gradient instead)."""
    from . import moe
    spec = moe.as_recipe(spec, setup)
    if spec.derived is not None:
        from .. import derive
        return derive.head_saved_bytes(spec, setup, tokens)
    d = dtypes(spec, setup)
    h = spec.hidden_size
    if spec.model_type == "bert":
        rows = ([Saved("norms", h, "lin", role="head"), Saved("norms", h, "cmp")] + _layernorm(spec)
                + [Saved("norms", h, "lin", role="head")])
    elif spec.norm == "layernorm":
        rows = _layernorm(spec) + [Saved("norms", h, "lin", role="head")]
    else:
        rows = _rmsnorm(spec, d) + [Saved("norms", h, "lin", role="head")]
    if spec.frozen:  # a frozen final norm and LM head keep nothing for their weights
        rows = [r for r in rows if not r.role]
    if not head_input:
        rows = [r for r in rows if r.role != "head"]
    share = _sequence_share(setup)  # SP: the final norm is sequence-sharded, the head's input gathered whole
    return {"head": int(sum(d.bytes_of(r) / (1 if r.role == "head" else share) for r in rows) * tokens)}


def embedding_saved_bytes(spec: ModelSpec, setup: TrainingSetup, tokens: int, seq_len: int,
                          on_cpu: bool = False) -> int:
    """Token ids kept by the embedding backward (int64), position tables shared by all layers."""
    from . import moe
    spec = moe.as_recipe(spec, setup)
    if spec.derived is not None:
        from .. import derive
        return derive.embedding_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    d = dtypes(spec, setup, on_cpu)
    ids = 0 if spec.frozen else 8 * tokens  # a frozen embedding needs no indices for a weight gradient
    # Under LoRA the embedding output needs a gradient only when peft's enable_input_require_grads marks it (the
    # Trainer does so with checkpointing); until then dropout keeps no mask and a LayerNorm no input.
    needs_grad = not spec.frozen or setup.checkpointing is not Checkpointing.NONE
    if spec.extra.get("embedding_dropout", 0.0) > 0 and needs_grad:
        ids += int(d.bytes_of(Saved("norms", spec.hidden_size, d.mask)) * tokens)
    if spec.model_type == "bert":
        # token-type and position ids (for the tables' gradients), and the embedding LayerNorm
        ids += 0 if spec.frozen else 8 * tokens + 8 * seq_len
        if needs_grad:
            ids += int(sum(d.bytes_of(r) for r in _layernorm(spec)) * tokens)
    elif spec.model_type == "gpt2":
        ids += 0 if spec.frozen else 8 * seq_len
    else:
        # rotary cos/sin tables (1 x T x head_dim, shared by every layer), fp32 unless the model is pure bf16
        rotary = spec.head_dim * spec.extra.get("rotary_pct", 1.0)
        ids += int(2 * seq_len * rotary * d.residual)
    return ids
