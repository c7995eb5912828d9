"""Tensor and sequence parallelism, per rank: what one rank of a `tp`-GPU group holds and saves.

Layout (torchtitan's parallelize_llama, torch DTensor; the column / row split is Megatron-LM's, Shoeybi et al. 2019,
arXiv:1909.08053): q/k/v and the MLP's input projections ColwiseParallel (split by output features, so by heads
and by intermediate), the attention output and MLP down projections RowwiseParallel (split by input features, the
partial sums all-reduced, or with sequence parallelism reduce-scattered), the token embedding and the LM head split
by vocabulary, the logits left vocabulary-sharded for loss_parallel. Norms, routers and position tables stay whole.

Per rank, from the graph (memfit.graph.with_tensor_parallel): the parameter tensors' local shards, and so the
gradients and optimizer states; ZeRO / FSDP2 then shard those over the num_gpus / tp data-parallel ranks (2D:
TP inside a node, FSDP across). Activations follow the recipe rows of memfit.estimate.activations with the rank's
heads, kv heads, intermediate size and vocabulary: q, k, v, the SDPA output and log-sum-exp, the MLP intermediates
and the logits / log-softmax are 1/tp; the layer input and norms stay whole on every rank without sequence
parallelism. With it, norms, dropout masks and the residual stream are 1/tp (sequence-sharded), but torch's
PrepareModuleInput all-gathers the attention's and the MLP's input and the projections save that full tensor for
their weight gradients, where Megatron-LM keeps it sharded and all-gathers it again in backward (Korthikanti et al.
2022, arXiv:2205.05198, sec. 4.2.2). So a torch SP layer saves 2 x B x T x h elements more than the paper's
sbh(34/t + 5as/(ht)) (see `korthikanti_layer_bytes`).
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
from ..model_spec import ModelSpec
from ..setup import TrainingSetup


def rank_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """The model as one tensor-parallel rank holds it: per-rank parameter tensors (graph.param_tensors(per_rank=
    True)) and per-rank heads, kv heads, intermediate size and vocabulary. `spec` itself when tp is 1."""
    tp = setup.tp
    if tp == 1:
        return spec
    if spec.graph is None:
        raise ConfigError(f"'{spec.name}' has no model graph memfit can split for tensor parallelism: use a catalog "
                          "model, an HF config or a live transformers model")
    from ..graph import with_tensor_parallel

    graph = with_tensor_parallel(spec.graph, tp)  # one-line ConfigError when tp does not divide heads / intermediate
    params = graph.param_tensors(trainable=True, per_rank=True)
    if sum(p.total for p in graph.param_tensors(trainable=True)) != spec.num_params:
        raise ConfigError(f"'{spec.name}': its graph does not hold the model's parameters; tensor parallelism "
                          "cannot be sized for it")
    extra = dict(spec.extra, tensor_parallel=tp)
    return dataclasses.replace(spec, params=params, num_attention_heads=spec.num_attention_heads // tp,
                               num_kv_heads=spec.num_kv_heads // tp, intermediate_size=spec.intermediate_size // tp,
                               vocab_size=math.ceil(spec.vocab_size / tp), graph=graph, extra=extra)


def sequence_share(setup: TrainingSetup) -> int:
    """What the sequence-sharded tensors (norms, dropout masks, residual stream) are divided by: tp with sequence
    parallelism, else 1."""
    return setup.tp if setup.sequence_parallel else 1


def korthikanti_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one Megatron-GPT layer saves for backward in 16-bit with dropout (Korthikanti et al. 2022, Table 2):
    sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh(34/t + 5as/(ht))
    with tensor and sequence parallelism. (The 10 unsplit: two LayerNorms' inputs 4, two dropout masks 2, and the
    inputs of the QKV and first MLP projections 4.)"""
    if sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
