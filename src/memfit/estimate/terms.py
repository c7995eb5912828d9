"""The names of the terms memfit's estimates are made of: one `TermKey` per name, its category read off it.

A `Term.name` is a `TermKey` (a `StrEnum`: it compares, hashes, formats and serialises as its text, so the JSON
output is the same as when names were plain strings). Code looks terms up by member, never by a string literal
(bench/structure.py counts the ones left: "term lookups by string").

The one escape: the per-stack terms of an encoder-decoder or vision model (memfit.derive.stacks_estimate), named after
the model's own stacks (`activations/encoder_blocks`, `activations/vision_blocks`, ...). Their names come from
`stack_blocks(stack)`, and `is_term_name` accepts them (DYNAMIC_NAME); tests/estimate/test_term_keys.py checks every estimate's
terms against both.
"""

from __future__ import annotations

import re
from enum import Enum, StrEnum


class Category(str, Enum):
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    OVERHEAD = "overhead"

    def __str__(self) -> str:
        return self.value

    @property
    def is_static(self) -> bool:
        """The seed's 'static memory': parameters + gradients + optimizer states."""
        return self in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER)


class TermKey(StrEnum):
    """Every term name an analytic estimate, a trace or a measured step produces."""

    # parameters
    PARAMETERS = "parameters"
    FROZEN = "parameters/frozen"
    BUFFERS = "parameters/buffers"
    GATHERED = "parameters/gathered"
    PREFETCHED = "parameters/prefetched"
    # gradients
    GRADIENTS = "gradients"
    COMM_BUFFERS = "gradients/comm_buffers"
    DOWN_ADAPTERS = "gradients/down_adapters"
    FUSED_HEAD = "gradients/fused_head"
    IN_BACKWARD = "gradients/in_backward"
    ROOT_UNSHARDED = "gradients/root_unsharded"
    TIED_EMBEDDING = "gradients/tied_embedding"
    UNSHARDED_ACCUMULATED = "gradients/unsharded_accumulated"
    # optimizer
    OPTIMIZER = "optimizer"
    STATES = "optimizer/states"
    PAGED_STATES = "optimizer/paged_states"
    MASTER_WEIGHTS = "optimizer/master_weights"
    # activations
    ACTIVATIONS = "activations"
    ATTENTION = "activations/attention"
    MLP = "activations/mlp"
    NORMS = "activations/norms/residual"
    CHECKPOINTS = "activations/checkpoints"
    CHECKPOINT0 = "activations/checkpoint0"
    SELECTIVE_KEPT = "activations/selective_kept"
    RNG_STATES = "activations/rng_states"
    INT8_INPUTS = "activations/int8_inputs"
    EMBEDDINGS = "activations/embeddings"
    EMBEDDING_LEAF = "activations/embedding_leaf"
    HEAD = "activations/head"
    LOGITS = "activations/logits"
    LOGIT_SOFTCAP = "activations/logit_softcap"
    LOSS = "activations/loss"
    AUTOCAST_WEIGHT_COPIES = "activations/autocast_weight_copies"
    RECOMPUTED_BLOCK = "activations/recomputed_block"
    BLOCK0 = "activations/block0"
    EXPERT_WEIGHT_CASTS = "activations/expert_weight_casts"
    ROUTER_AUX_LOSS = "activations/router_aux_loss"
    OFFLOAD_STASH = "activations/offload_stash"
    OFFLOAD_IN_FLIGHT = "activations/offload_in_flight"
    ZERO3_HEAD_INPUT = "activations/zero3_head_input"
    PIPELINE_LAYERS = "activations/pipeline_layers"
    STAGE_OUTPUTS = "activations/stage_outputs"
    P2P_BUFFERS = "activations/p2p_buffers"
    STEP = "activations/step"
    """A stacked model's fitted live tensors at one moment (memfit.derive.stacks_estimate)."""
    INPUTS = "activations/inputs"
    # temporaries
    TEMPORARIES = "temporaries"
    LAYER_BACKWARD = "temporaries/layer_backward"
    LOSS_BACKWARD = "temporaries/loss_backward"
    LOGITS_FP32 = "temporaries/logits_fp32"
    LOSS_CHUNK = "temporaries/loss_chunk"
    HEAD_GRADIENT = "temporaries/head_gradient"
    HIDDEN_GRADIENT = "temporaries/hidden_gradient"
    HIDDEN_GRADIENTS = "temporaries/hidden_gradients"
    NORM_BACKWARD = "temporaries/norm_backward"
    OPTIMIZER_STEP = "temporaries/optimizer_step"
    MASTER_GRADIENTS = "temporaries/master_gradients"
    GRAD_REDUCE_SCATTER = "temporaries/grad_reduce_scatter"
    REDUCE_SCATTER_HELD = "temporaries/reduce_scatter_held"
    RING_ATTENTION = "temporaries/ring_attention"
    FLOAT8_BACKWARD = "temporaries/float8_backward"
    DORA_WEIGHT_NORM = "temporaries/dora_weight_norm"
    DORA_RECOMPUTE = "temporaries/dora_recompute"
    RECOMPUTE_LOCALS = "temporaries/recompute_locals"
    INCOMING_GRADIENT = "temporaries/incoming_gradient"
    DEQUANTIZED_WEIGHT = "temporaries/dequantized_weight"
    FROZEN_MLP_BACKWARD = "temporaries/frozen_mlp_backward"
    MLP_BACKWARD = "temporaries/mlp_backward"
    ATTENTION_RECOMPUTE = "temporaries/attention_recompute"
    P2P_SEND = "temporaries/p2p_send"
    HOST = "temporaries/host"
    PREEXISTING = "temporaries/preexisting"
    # runtime overhead
    ALLOCATOR_ROUNDING = "overhead/allocator_rounding"
    CUBLAS_WORKSPACE = "overhead/cublas_workspace"
    ALLOCATOR_RESERVE = "overhead/allocator_reserve"
    CUDA_CONTEXT = "overhead/cuda_context"
    NCCL = "overhead/nccl"
    ONEDNN_SCRATCH = "overhead/onednn_scratch"

    # RL post-training phases (memfit.rl): generation (HF generate's KV cache, vLLM's budget), log-probs, the loss
    KV_CACHE = "activations/kv_cache"
    LOG_SOFTMAX = "activations/log_softmax"
    LOGPROB_SAVED = "activations/logprob_saved"
    RL_LOSS = "activations/rl_loss"
    VLLM_KV_CACHE = "activations/vllm_kv_cache"
    ROLLOUT_INPUTS = "activations/rollout_inputs"
    VLLM_NON_TORCH = "overhead/vllm_non_torch"
    REFERENCE = "parameters/reference"
    CRITIC = "parameters/critic"
    CRITIC_OPTIMIZER = "optimizer/critic"
    REWARD_MODEL = "parameters/reward_model"
    VLLM_WEIGHTS = "parameters/vllm_weights"
    DECODE_STEP = "temporaries/decode_step"
    FORWARD_LAYER = "temporaries/forward_layer"
    KV_CACHE_GROWTH = "temporaries/kv_cache_growth"
    LOGITS_TEMPORARY = "temporaries/logits"
    LOGITS_BACKWARD = "temporaries/logits_backward"
    LOGPROB_FOLD = "temporaries/logprob_fold"
    LOGPROB_GRAD_ACCUMULATORS = "temporaries/logprob_grad_accumulators"
    LOGPROB_HIDDEN = "temporaries/logprob_hidden"
    LOGPROB_TILE = "temporaries/logprob_tile"
    PREFILL = "temporaries/prefill"
    VLLM_ACTIVATIONS = "temporaries/vllm_activations"
    LOGITS_SAVED = "activations/logits_saved"
    NLL_LOG_SOFTMAX = "activations/nll_log_softmax"

    @property
    def category(self) -> Category:
        """The category is the name's first part: 'activations/head' is an activation."""
        return Category(self.value.split("/", 1)[0])


# the per-stack blocks of a stacked model: `activations/<stack>_blocks` (the stack's own name, lower case)
DYNAMIC_NAME = re.compile(r"activations/[a-z][a-z0-9_]*_blocks")


def stack_blocks(stack: str) -> str:
    """The name of a stacked model's term for `stack`'s blocks still holding their saved tensors (the escape)."""
    name = f"activations/{stack}_blocks"
    if not DYNAMIC_NAME.fullmatch(name):
        raise ValueError(f"no term name for stack {stack!r}")
    return name


def is_term_name(name: str) -> bool:
    """Whether `name` is a name memfit produces: a TermKey, or a stacked model's per-stack term."""
    return name in TermKey.__members__.values() or bool(DYNAMIC_NAME.fullmatch(name))


def category_of(name: str) -> Category:
    """A term name's category (TermKey.category, for the per-stack names too)."""
    return Category(str(name).split("/", 1)[0])


__all__ = ["DYNAMIC_NAME", "Category", "TermKey", "category_of", "is_term_name", "stack_blocks"]
