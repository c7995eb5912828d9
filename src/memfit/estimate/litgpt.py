"""LitGPT's own GPT (setup.model_code litgpt): what its module keeps for backward beyond the Hugging Face model of
the same shape, and its loss as litgpt finetune_lora / finetune_full step it. Read from litgpt 0.5.13 (model.py
CausalSelfAttention / RMSNorm / GPT.forward, lora.py LoRAQKVLinear, utils.py chunked_cross_entropy, finetune/lora.py
`fit`) and lightning 2.6 (fabric wrappers _FabricModule.forward -> precision.convert_output); measured term by term
against the HF LlamaForCausalLM step on CPU (bench/litgpt_recipes.py, the profiler's live tensors at the peak).

Per block, beyond the HF rows (StepModel.per_layer), each measured against LlamaForCausalLM (peft for LoRA) at the
same shape with saved-tensor hooks, multi-head and grouped-query:
- fused qkv: `q, k, v = qkv.split(...)` are views of one B x T x (q + k + v) tensor. Multi-head: SDPA saves v, so the
  whole fused output stays alive (q + k widths more than HF's separate v). Grouped-query: k and v are
  repeat_interleave'd to every query head before SDPA, which saves those copies (HF's SDPA takes them grouped):
  2 x (q - kv) widths more, the fused output freed.
- LoRA on some but not all of q / k / v: LoRAQKVLinear.zero_pad index_copy_'s the conv1d update into a zero tensor
  and autograd keeps one of them: the B x T x (enabled widths) update (multi-head) or the zero-padded B x T x
  (q + k + v) result (grouped-query). With all three on, zero_pad returns the update as is and nothing stays.
- A trainable output projection (full fine-tune, lora_projection): SDPA's output is (B, heads, T, hs); its
  transpose's reshape to B x T x C copies, and the projection keeps that copy beside SDPA's own output.
- RMSNorm runs in fp32 (`x.float()`); with a trainable weight, `x_normed * weight.float()` saves the fp32 x_normed
  where HF saves it in the model's dtype: (4 - residual dtype) B more per token x h per norm (the final norm too).

The loss: GPT.forward(lm_head_chunk_size=128) returns the head in 128-token chunks; Fabric's precision plugin
(convert_output) casts every chunk to fp32, and `fit` holds that list (`logits`) until the next step's forward returns.
chunked_cross_entropy saves one fp32 log-softmax per chunk. In backward every chunk's cross-entropy runs before any
cast or head backward (their autograd nodes are newer), so at each chunk's log-softmax backward: the held fp32 logits
(B x T x V x 4), every chunk's log-softmax output or finished gradient (B x T x V x 4 together) and the chunk's two
fp32 gradients (nll's and log-softmax's).
"""

from __future__ import annotations

from dataclasses import replace

from ..choices import ModelCode
from ..finetune import Method
from ..model_spec import ModelSpec
from ..setup import TrainingSetup
from .result import Category, Term
from .terms import TermKey

HEAD_CHUNK = 128
"""finetune/lora.py and finetune/full.py `fit`: model(input_ids, lm_head_chunk_size=128)."""
SOURCE = "litgpt 0.5.13 model.py / lora.py / utils.py chunked_cross_entropy; lightning fabric convert_output"


def applies(setup: TrainingSetup) -> bool:
    return setup.model_code is ModelCode.LITGPT


def _widths(spec: ModelSpec) -> tuple[int, int]:
    head = spec.head_dim or spec.hidden_size // max(spec.num_attention_heads, 1)
    return spec.num_attention_heads * head, (spec.num_kv_heads or spec.num_attention_heads) * head


def _lora_qkv(setup: TrainingSetup) -> tuple[bool, bool, bool]:
    ft = setup.finetune
    if ft.method is Method.FULL:
        return (False, False, False)
    targets = set(ft.targets)
    if "all-linear" in targets:
        return (True, True, True)
    return tuple(name in targets for name in ("q_proj", "k_proj", "v_proj"))  # type: ignore[return-value]


def _projection_trains(spec: ModelSpec, setup: TrainingSetup) -> bool:
    if setup.finetune.method is Method.FULL:
        return True
    targets = set(setup.finetune.targets)
    return bool(targets & {"all-linear", "o_proj", "dense"})


def block_extra(spec: ModelSpec, setup: TrainingSetup, tokens: int, compute: int, residual: int) -> dict[str, int]:
    """Bytes one LitGPT block keeps beyond the HF rows, by StepModel.per_layer group (measured per block against
    LlamaForCausalLM / peft under saved-tensor hooks, MHA and GQA)."""
    q, kv = _widths(spec)
    grouped = kv < q
    # MHA: the fused qkv output, alive through v's view (HF keeps v alone); GQA: k and v repeat_interleave'd to
    # every query head and saved so by SDPA (HF's SDPA takes them grouped), the fused output freed
    attention = (2 * (q - kv) if grouped else q + kv) * tokens * compute
    enabled = _lora_qkv(setup)
    if any(enabled) and not all(enabled):  # zero_pad's index_copy_: MHA keeps its source, GQA its padded result
        attention += (q + 2 * kv if grouped else sum(w for w, on in zip((q, kv, kv), enabled) if on)) * tokens * compute
    if _projection_trains(spec, setup):  # y.reshape of SDPA's transposed output copies; proj keeps the copy
        attention += q * tokens * compute
    norms = 2 * norm_extra(spec, tokens, residual)
    return {"attention": attention, "norms": norms}


def norm_extra(spec: ModelSpec, tokens: int, residual: int) -> int:
    """One RMSNorm's fp32 x_normed beyond HF's copy in the residual dtype (none with a frozen weight)."""
    if spec.frozen or spec.norm != "rmsnorm":
        return 0
    return tokens * spec.hidden_size * max(4 - residual, 0)


def logits_bytes(spec: ModelSpec, tokens: int) -> int:
    """Fabric's fp32 copies of the head's chunks, held by `fit` through backward."""
    return tokens * spec.vocab_size * 4


def held_logits(spec: ModelSpec, tokens: int) -> Term:
    """The fp32 head chunks `fit` still holds while the layers' backward and the optimizer step run."""
    return Term(TermKey.LOGITS, Category.ACTIVATIONS, logits_bytes(spec, tokens),
                "B x T x V x 4 B: Fabric's fp32 head chunks, held by fit's `logits` until the next forward returns",
                SOURCE)


def loss_forward(forward: list[Term], spec: ModelSpec, tokens: int) -> list[Term]:
    """End of the loss's forward: the held fp32 logits (no further upcast: cross-entropy reads them as they are)."""
    return [replace(t, num_bytes=logits_bytes(spec, tokens),
                    formula="B x T x V x 4 B: Fabric's fp32 copies of the 128-token head chunks, held by fit",
                    source=SOURCE) if t.name == TermKey.LOGITS else t for t in forward]


def loss_backward(forward: list[Term], spec: ModelSpec, setup: TrainingSetup, tokens: int) -> list[Term]:
    """A chunk's log-softmax backward: held logits + every chunk's log-softmax or gradient + the chunk's two
    fp32 gradients."""
    chunk = setup.micro_batch_size * min(HEAD_CHUNK, setup.seq_len)
    kept = loss_forward(forward, spec, tokens)
    return kept + [Term(TermKey.LOSS_BACKWARD, Category.TEMPORARIES, 2 * chunk * spec.vocab_size * 4,
                        "2 x B x 128 x V x 4 B: one chunk's nll and log-softmax gradients (the other chunks' "
                        "log-softmax outputs or finished gradients stay in the loss term)", SOURCE)]
