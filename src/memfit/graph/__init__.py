"""memfit.graph: a typed model graph the estimator can walk.

A model is a ModelGraph of node kinds (Embedding, Attention, MLP, Experts, Norm, heads...), each a frozen
dataclass with handlers registered per kind (`params_of`, `tensors_of`, `saved_by`: what it keeps for
backward). Builders turn an HF config into a graph (`graph_from_config`, one small builder per model_type); LoRA and tensor parallelism are pure
transforms over it. Importing this package imports neither torch nor transformers.
"""

from .builders import builder, graph_from_config, graph_model_types
from .kinds.attention import Attention, LatentKV
from .kinds.embedding import Embedding, Param, PatchEmbedding
from .kinds.heads import ClassificationHead, LMHead, MaskedLMHead, Seq2SeqLMHead
from .kinds.linear import Linear, LoraLinear, Shard
from .kinds.mlp import MLP, Experts
from .kinds.norm import Dropout, Norm
from .model import Block, ModelGraph, Stack, linear_copies, linears_of
from .registry import (GraphTensor, Node, UnknownNodeKindError, dispatch, handler, params_of, registered_kinds,
                       tensors_of, walk)
from .saved import NotModelledError, Saved, SavedCtx, saved_by
from .transforms import rewrite, with_lora, with_tensor_parallel

__all__ = [
    "MLP", "Attention", "Block", "ClassificationHead", "Dropout", "Embedding", "Experts", "GraphTensor", "LMHead",
    "LatentKV", "Linear", "LoraLinear", "MaskedLMHead", "ModelGraph", "Node", "Norm", "NotModelledError", "Param",
    "PatchEmbedding", "Saved", "SavedCtx", "Seq2SeqLMHead", "Shard", "Stack", "UnknownNodeKindError", "builder",
    "dispatch", "graph_from_config", "graph_model_types", "handler", "linear_copies", "linears_of", "params_of",
    "registered_kinds", "rewrite", "saved_by", "tensors_of", "walk", "with_lora", "with_tensor_parallel",
]
