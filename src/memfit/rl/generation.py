"""The rollout's memory beyond the weights: HF `generate`'s KV cache as transformers grows it, and vLLM's engine as
vLLM allocates it (its gpu_memory_utilization budget, the KV cache pre-reserved in blocks, sleep mode)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..estimate.result import Category, Term
from ..estimate.terms import TermKey
from ..graph.kinds.attention import Attention
from ..graph.registry import walk
from ..model_spec import ModelSpec
from .workload import term

GiB = 1 << 30


@dataclass(frozen=True)
class KVLayer:
    """What one attention layer caches per token: `kv_heads` heads of `key_dim` (+ `value_dim`) values, over a
    `window` of tokens (None: all of them); MLA caches one latent of `latent_dim` instead (vLLM) ."""

    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None
    latent_dim: int = 0
    count: int = 1


def kv_layers(spec: ModelSpec) -> tuple[KVLayer, ...]:
    """The decoder's attention layers from memfit's graph, grouped (a stack of N identical blocks is one entry)."""
    if spec.graph is None:
        return (KVLayer(spec.num_kv_heads, spec.head_dim, spec.head_dim, None, count=spec.num_layers),)
    layers = []
    for _path, node, parents in walk(spec.graph):
        if type(node) is not Attention or node.kind == "bidirectional":
            continue
        count = 1
        for parent, field_name in parents:
            if field_name == "block" and hasattr(parent, "count"):
                count *= parent.count
        latent = node.latent_kv
        value_dim = latent.v_head_dim if latent is not None else node.head_dim
        latent_dim = latent.kv_lora_rank + latent.rope_head_dim if latent is not None else 0
        heads = node.q_heads if latent is not None else node.kv_heads  # HF's MLA caches per-head k and v
        layers.append(KVLayer(heads, node.head_dim, value_dim, node.window, latent_dim, count))
    return tuple(layers)


def hf_kv_cache_bytes(spec: ModelSpec, batch: int, length: int, dtype_bytes: int) -> int:
    """transformers' DynamicCache after `length` tokens: per layer keys [B, kv_heads, L, head_dim] and values
    (cache_utils.DynamicLayer.update grows them with torch.cat); a sliding-window layer keeps min(L, window)
    (DynamicSlidingWindowLayer: the last window - 1 plus the new token, a view of the concatenation)."""
    total = 0
    for layer in kv_layers(spec):
        kept = length if layer.window is None else min(length, layer.window)
        total += layer.count * batch * layer.kv_heads * kept * (layer.key_dim + layer.value_dim) * dtype_bytes
    return total


def hf_generate_terms(spec: ModelSpec, batch: int, prompt: int, completion: int, dtype_bytes: int) -> list[Term]:
    """HF `generate` (TRL's use_vllm=False rollout) beyond the weights, at the larger of its two peaks."""
    decode, prefill = _decode_terms(spec, batch, prompt, completion, dtype_bytes), _prefill_terms(
        spec, batch, prompt, dtype_bytes)
    return decode if sum(t.num_bytes for t in decode) >= sum(t.num_bytes for t in prefill) else prefill


_GENERATE = "transformers cache_utils.DynamicLayer.update (torch.cat), generation/utils.py _sample"


def _decode_terms(spec: ModelSpec, batch: int, prompt: int, completion: int, dtype_bytes: int) -> list[Term]:
    """The last decode step. generate runs the prefill and completion - 1 decode steps, so the cache ends at
    prompt + completion - 1 tokens. Each step's `torch.cat` holds the layer's old keys while it builds the new ones:
    one more [B, kv, L - 1, d] at the peak. The step's own tensors: the last position's logits in fp32 (generate
    asks for logits_to_keep=1 and upcasts: generation/utils.py `_sample`), the processed scores and the sampling
    probabilities (3 x B x V x 4), and the growing input_ids (two int64 [B, L] while one is concatenated)."""
    length = prompt + completion - 1
    cache = hf_kv_cache_bytes(spec, batch, length, dtype_bytes)
    first = kv_layers(spec)[0]
    kept = length - 1 if first.window is None else min(length - 1, first.window)
    growing = batch * first.kv_heads * kept * first.key_dim * dtype_bytes
    step = 3 * batch * spec.vocab_size * 4 + 2 * batch * length * 8
    return [term(TermKey.KV_CACHE, Category.ACTIVATIONS, cache,
                 f"{batch} sequences x {length} tokens x per-layer K+V ({dtype_bytes} B)", _GENERATE),
            term(TermKey.KV_CACHE_GROWTH, Category.TEMPORARIES, growing,
                 "one layer's keys before torch.cat frees them", _GENERATE),
            term(TermKey.DECODE_STEP, Category.TEMPORARIES, step,
                 "3 x B x V x 4 B (last-position logits, scores, probs) + 2 x B x L int64 ids", _GENERATE)]


def _prefill_terms(spec: ModelSpec, batch: int, prompt: int, dtype_bytes: int) -> list[Term]:
    """The prefill's last MLP: the whole prompt's KV cache, four hidden-sized [B, P, h] tensors (the embeddings the
    model's forward keeps, the residual, the normed input, the attention's output) and the MLP's gate, up and
    act(gate) [B, P, I] (counts read off a measured tiny Llama)."""
    tokens = batch * prompt
    return [term(TermKey.KV_CACHE, Category.ACTIVATIONS, hf_kv_cache_bytes(spec, batch, prompt, dtype_bytes),
                 f"{batch} sequences x {prompt} prompt tokens x per-layer K+V", _GENERATE),
            term(TermKey.PREFILL, Category.TEMPORARIES,
                 tokens * (4 * spec.hidden_size + 3 * spec.intermediate_size) * dtype_bytes + 2 * tokens * 8,
                 "B x P x (4h + 3I) + int64 ids and mask", "transformers models/llama/modeling_llama.py forward")]


# --- vLLM -------------------------------------------------------------------------------------------------------

VLLM_BLOCK_SIZE = 16
"""CacheConfig.block_size's default on CUDA (vllm/config/cache.py)."""

SAMPLER_BYTES_PER_SEQ_VOCAB = 38.5
"""The profiling run's activation peak per (max_num_seqs x vocab entry). vLLM's profile_run ends with a dummy
sampler run over max_num_seqs rows of logits (gpu_model_runner.py `_dummy_sampler_run`): fp32 logits, the
processed copies, softmax and top-k/p sort buffers, so the peak scales with rows x vocab. 38.5 B fits three
published H100 logs within 1.5% (llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md,
max_num_seqs 1024: Llama-3.1-8B 4.76 GiB at vocab 128,256; Qwen3-0.6B 5.56 GiB at 151,936; gpt-oss-20b 7.38 GiB at
201,088). An empirical constant, not a formula read from the code."""

NON_TORCH_BYTES = {1: int(0.13 * GiB), 2: int(0.55 * GiB)}
"""vLLM's `non_torch_increase` (NCCL, CUDA graphs' driver memory): 0.13 GiB at TP=1, 0.55 GiB at TP=2 in the same
published logs."""

CUDA_GRAPH_BYTES = int(0.4 * GiB)
"""CUDA graph pools: not taken from the budget unless VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is set (gpu_worker.py
`cudagraph_memory_estimate_applied`), so they sit beyond it; -0.45 to +1.03 GiB in the published logs."""


def kv_dtype_bytes(kv_cache_dtype: str | None, model_dtype_bytes: int = 2) -> int:
    """CacheConfig.cache_dtype: 'auto' is the model's dtype; 'fp8', 'fp8_e4m3', 'fp8_e5m2' store one byte
    (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE)."""
    if kv_cache_dtype in (None, "auto", "bfloat16", "float16", "half"):
        return model_dtype_bytes
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype.startswith("int8"):
        return 1
    if kv_cache_dtype == "float32":
        return 4
    raise ValueError(f"unknown vllm kv_cache_dtype {kv_cache_dtype!r}: auto, bfloat16, float16, fp8, fp8_e4m3, "
                     "fp8_e5m2")


def vllm_page_size_bytes(layer: KVLayer, dtype_bytes: int, block_size: int = VLLM_BLOCK_SIZE,
                         tp: int = 1) -> int:
    """One layer's page of `block_size` tokens (vllm/v1/kv_cache_interface.py): FullAttentionSpec /
    SlidingWindowSpec `block_size x num_kv_heads x (head_size + head_size_v) x dtype`, MLAAttentionSpec
    `block_size x 1 x (kv_lora_rank + qk_rope_head_dim) x dtype` (one latent, replicated across TP ranks).
    Under tensor parallelism each rank holds max(1, kv_heads // tp) heads (replicated when fewer heads than
    ranks: vllm/model_executor/models/llama.py LlamaAttention)."""
    if layer.latent_dim:
        return block_size * layer.latent_dim * dtype_bytes
    heads = max(1, layer.kv_heads // tp)
    return block_size * heads * (layer.key_dim + layer.value_dim) * dtype_bytes


def vllm_bytes_per_token(spec: ModelSpec, dtype_bytes: int, tp: int = 1) -> int:
    """KV bytes per token summed over layers, per rank (the hybrid allocator gives sliding-window layers their own
    groups; their blocks are freed once out of the window, but the pool is sized with the same page per layer:
    kv_cache_utils.get_num_blocks `available_memory // page_size // num_layers`)."""
    return sum(layer.count * vllm_page_size_bytes(layer, dtype_bytes, 1, tp) for layer in kv_layers(spec))


@dataclass(frozen=True)
class VllmBudget:
    """vLLM's memory on one GPU once the engine is up (vllm/v1/worker/gpu_worker.py determine_available_memory):
    requested = ceil(total x gpu_memory_utilization) (vllm/v1/worker/utils.py request_memory); the KV cache gets
    requested - (weights + profile-run activation peak + non-torch memory)."""

    total: int
    utilization: float
    weights: int
    activation_peak: int
    non_torch: int
    cuda_graphs: int
    bytes_per_token: int
    block_size: int = VLLM_BLOCK_SIZE

    @property
    def requested(self) -> int:
        return math.ceil(self.total * self.utilization)

    @property
    def kv_cache(self) -> int:
        """Whole blocks only (kv_cache_utils.get_num_blocks floors)."""
        available = self.requested - self.weights - self.activation_peak - self.non_torch
        page = self.bytes_per_token * self.block_size
        return max(0, available // page * page) if page else 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_cache // self.bytes_per_token if self.bytes_per_token else 0

    def resident(self, sleep_level: int) -> int:
        """What the engine holds on the GPU between rollouts: everything but the profile run's activations (freed
        to the shared caching allocator), less what sleep frees: level 1 offloads the weights to CPU and discards the
        KV cache, level 2 discards both (worker `sleep`: CuMemAllocator.sleep(offload_tags=('weights',)) at level
        1); the non-torch memory and CUDA graph pools stay."""
        if sleep_level:
            return self.non_torch + self.cuda_graphs
        return self.weights + self.kv_cache + self.non_torch + self.cuda_graphs

    def generating(self) -> int:
        """During generation: everything, the activations at their profiled peak included."""
        return self.weights + self.kv_cache + self.activation_peak + self.non_torch + self.cuda_graphs


def default_max_num_seqs(gpu_memory_bytes: int, gpu_name: str) -> int:
    """vllm/engine/arg_utils.py get_batch_defaults: 1024 on a GPU with >= 70 GiB that is not an A100, else 256."""
    return 1024 if gpu_memory_bytes >= 70 * GiB and "a100" not in gpu_name.lower() else 256


def vllm_budget(spec: ModelSpec, *, total: int, utilization: float, weights: int, max_num_seqs: int,
                tp: int = 1, kv_cache_dtype: str | None = None, enforce_eager: bool = False) -> VllmBudget:
    activation = int(SAMPLER_BYTES_PER_SEQ_VOCAB * max_num_seqs * spec.vocab_size)
    return VllmBudget(total=total, utilization=utilization, weights=weights, activation_peak=activation,
                      non_torch=NON_TORCH_BYTES[1 if tp == 1 else 2], cuda_graphs=0 if enforce_eager
                      else CUDA_GRAPH_BYTES, bytes_per_token=vllm_bytes_per_token(spec, kv_dtype_bytes(
                          kv_cache_dtype), tp))


def vllm_terms(budget: VllmBudget, *, generating: bool, sleep_level: int) -> list[Term]:
    source = "vllm/v1/worker/gpu_worker.py determine_available_memory; vllm/v1/kv_cache_interface.py"
    if not generating and sleep_level:
        return [term(TermKey.VLLM_NON_TORCH, Category.OVERHEAD, budget.non_torch + budget.cuda_graphs,
                     f"sleep level {sleep_level}: weights and KV cache released; non-torch + CUDA graphs stay",
                     source, "outside")]
    terms = [term(TermKey.VLLM_WEIGHTS, Category.PARAMETERS, budget.weights,
                  "the engine's own copy of the policy (model dtype, / TP)", source),
             term(TermKey.VLLM_KV_CACHE, Category.ACTIVATIONS, budget.kv_cache,
                  f"util {budget.utilization:g} x total - weights - profile peak - non-torch, whole blocks of "
                  f"{budget.block_size} tokens x {budget.bytes_per_token:,} B", source)]
    if generating:
        terms.append(term(TermKey.VLLM_ACTIVATIONS, Category.TEMPORARIES, budget.activation_peak,
                          "the profile run's peak: max_num_seqs x vocab x 38.5 B", source))
    terms.append(term(TermKey.VLLM_NON_TORCH, Category.OVERHEAD, budget.non_torch + budget.cuda_graphs,
                      "NCCL / driver memory + CUDA graph pools", source, "outside"))
    return terms
