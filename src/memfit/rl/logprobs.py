"""The per-token log-probs an RL loss takes from the LM head, in a no-grad forward (reference / old policy) and in
the policy's forward + backward. Three ways (workload.LOGPROB_HEADS):

- 'fused': TRL 1.x `add_fused_lm_head` (trl/trainer/utils.py) -> trl/kernels/chunked_logprob.py
  ChunkedLogProbFunction. The head runs on `rows` tokens in tiles: a [min(rows, TOKEN_CHUNK_SIZE=4096),
  chunk_size=32768] buffer in the compute dtype (sized by chunk_size even when the vocabulary is smaller), seven fp32
  [rows] online-logsumexp statistics, the hidden states gathered to [rows, h]. On Triton the tile is folded in
  place and only the labelled tokens are rows; the torch fallback (CPU, `_forward_tile` / `_backward_tile`) scores
  every position and holds fp32 temporaries of the tile (3 in forward, 7 + a bool mask in backward, as measured).
  Backward adds grad_hidden [rows, h] and grad_weight [V, h], both fp32 accumulators.
- 'selective': TRL 0.x: logits [B, C + 1, V] from `logits_to_keep`, divided by the temperature (a copy), then
  `selective_log_softmax` row by row (trl/trainer/utils.py), which never holds a full log-softmax; backward
  holds each row's log-softmax output and the logits' gradient.
- 'full': `log_softmax(logits.float()).gather(...)`: the fp32 B x C x V log-softmax is saved for backward.
All three are measured on CPU (bench/rl.py): 'fused' inside real GRPO / DPO steps, the other two on the model alone
(trl 1.x's trainers no longer call them)."""

from __future__ import annotations

from ..estimate.result import Category, Term
from ..estimate.terms import TermKey
from ..model_spec import ModelSpec
from .workload import term

TOKEN_CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 32768
"""trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE; trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE."""
FALLBACK_FORWARD_TILES = 3
FALLBACK_BACKWARD_TILES = 7
STATS = 7
FUSED = "trl/kernels/chunked_logprob.py ChunkedLogProbFunction"


def head_rows(batch: int, seq: int, completion: int, triton: bool) -> int:
    """Tokens the fused head scores: the labelled ones (completion tokens) on Triton, every shifted position on
    the torch fallback (trl/trainer/utils.py `_fused_forward`: `compact = _use_triton(device)`)."""
    return batch * completion if triton else batch * (seq - 1)


def fused_forward_terms(spec: ModelSpec, rows: int, batch: int, seq: int, *, compute_bytes: int,
                        hidden_bytes: int, triton: bool) -> list[Term]:
    """The fused head's no-grad forward at its peak (the last tile), with the backbone's last hidden state."""
    h, v = spec.hidden_size, spec.vocab_size
    tile = min(rows, TOKEN_CHUNK_SIZE)
    terms = [term(TermKey.LOGPROB_TILE, Category.TEMPORARIES, tile * VOCAB_CHUNK_SIZE * compute_bytes,
                  f"[min(rows, 4096), 32768] x {compute_bytes} B", FUSED),
             term(TermKey.LOGPROB_HIDDEN, Category.TEMPORARIES,
                  batch * seq * h * hidden_bytes + rows * h * hidden_bytes + (STATS + 2) * rows * 4,
                  "last hidden [B, T, h] + gathered [rows, h] + 9 fp32 [rows] statistics", FUSED)]
    if not triton:
        terms.append(term(TermKey.LOGPROB_FOLD, Category.TEMPORARIES,
                          FALLBACK_FORWARD_TILES * tile * min(v, VOCAB_CHUNK_SIZE) * 4,
                          "torch fallback: 3 fp32 tile temporaries", FUSED + " _forward_tile"))
    return terms


def fused_backward_terms(spec: ModelSpec, rows: int, *, compute_bytes: int, hidden_bytes: int, triton: bool,
                         head_trainable: bool) -> list[Term]:
    """The fused head's backward at its peak; its saved tensors (the gathered hidden, log_z, entropy) with it."""
    h, v = spec.hidden_size, spec.vocab_size
    tile = min(rows, TOKEN_CHUNK_SIZE)
    accumulators = rows * h * 4 + (v * h * 4 if head_trainable else 0)
    terms = [term(TermKey.LOGPROB_SAVED, Category.ACTIVATIONS, rows * h * hidden_bytes + 3 * rows * 4,
                  "gathered hidden [rows, h] + log_z, entropy, log-probs [rows] fp32", FUSED),
             term(TermKey.LOGPROB_TILE, Category.TEMPORARIES, tile * VOCAB_CHUNK_SIZE * compute_bytes,
                  f"[min(rows, 4096), 32768] x {compute_bytes} B, recomputed in backward", FUSED),
             term(TermKey.LOGPROB_GRAD_ACCUMULATORS, Category.TEMPORARIES, accumulators,
                  "fp32 grad_hidden [rows, h]" + (" + grad_weight [V, h]" if head_trainable else ""), FUSED)]
    if not triton:
        terms.append(term(TermKey.LOGPROB_FOLD, Category.TEMPORARIES,
                          (FALLBACK_BACKWARD_TILES * 4 + 1) * tile * min(v, VOCAB_CHUNK_SIZE),
                          "torch fallback: 7 fp32 tile temporaries + a bool target mask", FUSED + " _backward_tile"))
    return terms


def logits_forward_terms(spec: ModelSpec, batch: int, completion: int, *, kind: str,
                         logits_bytes: int) -> list[Term]:
    """'selective' / 'full' in a no-grad pass, at the larger of two moments: the division by the temperature
    (the logits [B, C + 1, V] and their scaled copy [B, C, V]; the logits are freed once the name is rebound), and
    for 'full' the log-softmax (the scaled copy, its fp32 upcast when the logits are not fp32, the fp32 result).
    'selective' adds one row's logsumexp temporary [C, V] after the division, never more than the first moment."""
    v = spec.vocab_size
    size = batch * completion * v
    division = batch * (completion + 1) * v * logits_bytes + size * logits_bytes
    if kind == "selective":
        return [term(TermKey.LOGITS_TEMPORARY, Category.TEMPORARIES, division,
                     "logits [B, C+1, V] + logits / temperature [B, C, V]",
                     "trl/trainer/utils.py selective_log_softmax")]
    softmax = size * logits_bytes + (size * 4 if logits_bytes != 4 else 0) + size * 4
    return [term(TermKey.LOGITS_TEMPORARY, Category.TEMPORARIES, max(division, softmax),
                 "the larger of logits + scaled copy, and scaled copy + fp32 log_softmax [B, C, V]",
                 "torch log_softmax over the materialised logits")]


def logits_backward_terms(spec: ModelSpec, batch: int, completion: int, *, kind: str,
                          logits_bytes: int) -> list[Term]:
    """'selective' / 'full' at their backward's peak. Saved: 'selective' the scaled logits (fp32: each row's
    logsumexp keeps its input) or each row's log-softmax output (bf16), one [B, C, V] in the logits' dtype; 'full'
    the fp32 log-softmax. Temporaries: 'selective' two [B, C, V] (the rows' gradients gathered and the logits'
    gradient); 'full' three (gather's and log_softmax's backward and the slice's zero-filled [B, C + 1, V]), as a
    measured tiny Llama shows (bench/rl.py)."""
    size = batch * completion * spec.vocab_size
    if kind == "selective":
        saved, temps = size * logits_bytes, 2 * size * logits_bytes
        source = "trl/trainer/utils.py selective_log_softmax"
    else:
        saved, temps, source = size * 4, 3 * size * logits_bytes, "aten log_softmax_backward, gather / slice backward"
    return [term(TermKey.LOG_SOFTMAX, Category.ACTIVATIONS, saved, "saved for backward: one [B, C, V]", source),
            term(TermKey.LOGITS_BACKWARD, Category.TEMPORARIES, temps, f"{temps // max(1, size * logits_bytes)}"
                 " x [B, C, V] gradients", source)]


PREFERENCE = "trl/experimental/orpo/orpo_trainer.py, cpo/cpo_trainer.py concatenated_forward"


def preference_head_terms(spec: ModelSpec, rows: int, seq: int, *, nll: bool, logits_bytes: int, triton: bool,
                          head_trainable: bool) -> list[Term]:
    """ORPO / CPO / SimPO's head at the policy's backward peak (its first op): the whole [2B, T, V] logits the model
    returns (kept by `selective_log_softmax`, whose backward reads them), the fp32 log-softmax of the chosen half
    that the NLL term (`nn.CrossEntropyLoss` over `logits[:B, :-1]`; cross_entropy runs in fp32 under autocast)
    saves, the LM head's saved input and the final norm's saved `weight * x` operand ([2B, T, h] each; only when
    those weights train: a LoRA policy's frozen head and norm save neither, as measured), and the
    backward of `selective_log_softmax` over the shifted [2B, T - 1, V]: on the torch path (CPU, fp32) each row's
    logsumexp gradient and their stack (UnbindBackward), two [2B, T - 1, V] fp32; with TRL's Triton kernel
    (trl/kernels/logprob_entropy.py) its grad_logits [2B, T - 1, V] and the slice's zero-filled [2B, T, V] input
    gradient, both in the logits' dtype."""
    v, h = spec.vocab_size, spec.hidden_size
    logits = rows * seq * v * logits_bytes
    operands = 2 * rows * seq * h * logits_bytes if head_trainable else 0
    terms = [term(TermKey.LOGITS_SAVED, Category.ACTIVATIONS, logits + operands, "logits [2B, T, V]" + (
        " + the LM head's input and the final norm's operand [2B, T, h]" if head_trainable else ""), PREFERENCE)]
    if nll:
        terms.append(term(TermKey.NLL_LOG_SOFTMAX, Category.ACTIVATIONS, rows // 2 * (seq - 1) * v * 4,
                          "the NLL's fp32 log-softmax of the chosen half [B, T - 1, V]", PREFERENCE))
    shifted = rows * (seq - 1) * v
    if triton:
        grads, formula = shifted * logits_bytes + logits, "grad_logits [2B, T-1, V] + the slice's [2B, T, V]"
    else:
        grads, formula = 2 * shifted * 4, "2 x [2B, T-1, V] fp32: the rows' logsumexp gradients and their stack"
    terms.append(term(TermKey.LOGITS_BACKWARD, Category.TEMPORARIES, grads, formula,
                      "trl/trainer/utils.py selective_log_softmax" + (" (Triton)" if triton else "")))
    return terms


def rl_loss_terms(batch: int, completion: int, *, trainer: str, with_reference: bool) -> list[Term]:
    """The loss's own per-token fp32 tensors over the completions (grpo_trainer.py `_compute_loss`: log-probs,
    old log-probs, ratio, clipped ratio, the two surrogate terms, the masked loss; + the reference log-probs and
    the per-token KL when beta > 0) or DPO's per-token log-probs of policy and reference."""
    count = {"grpo": 7 + (2 if with_reference else 0),
             # rloo_trainer.py `_compute_loss`: the per-token log-probs, entropies and their masked product; the
             # ratio and surrogates are per sequence
             "rloo": 3,
             # PPO's clipped surrogate per token (old / new log-probs, ratio, clipped ratio, advantages, the two
             # surrogates); the KL sits in the reward (verl core_algos.compute_policy_loss)
             "ppo": 7,
             # the value loss per token: values, old values, returns, clipped values, two squared errors (verl
             # core_algos.compute_value_loss)
             "critic": 6,
             # ORPO / CPO / SimPO get_batch_logps over every shifted position: the per-token log-probs and
             # their masked product
             "orpo": 2, "cpo": 2, "simpo": 2}.get(trainer, 2 if with_reference else 1)
    return [term(TermKey.RL_LOSS, Category.ACTIVATIONS, count * batch * completion * 4,
                 f"{count} fp32 [B, C] per-token tensors", "trl grpo_trainer.py / dpo_trainer.py _compute_loss")]
