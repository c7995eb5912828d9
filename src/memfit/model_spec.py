"""ModelSpec: the architecture numbers a memory estimate needs, and nothing else (no torch, no transformers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParamTensor:
    """`count` parameter tensors named `name`, each of `numel` elements (e.g. 32 x 'layers.*.self_attn.q_proj.weight')."""

    name: str
    numel: int
    count: int = 1
    nbytes: int = 0
    """Bytes of one such tensor at rest when it is not stored in the training's parameter dtype (a LoRA adapter
    kept in fp32, a frozen base weight in bf16 or 4-bit with its quantization state); 0: the training's dtype."""

    @property
    def total(self) -> int:
        return self.numel * self.count

    def total_bytes(self, elem_bytes: int) -> int:
        """Bytes of all `count` tensors, `elem_bytes` per element unless the tensor says otherwise."""
        return (self.nbytes or self.numel * elem_bytes) * self.count


@dataclass(frozen=True)
class ModelSpec:
    """A transformer (or any model) described by numbers. Built by memfit.sources from a catalog entry, an HF
    config, a hub id or a live nn.Module.

    `params` lists every trainable parameter tensor once (tied weights once), so `num_params` is exact and the
    optimizer terms that depend on tensor sizes (8-bit AdamW keeps tensors under 4096 elements in fp32, Adafactor
    factors matrices) can be computed.
    """

    name: str
    model_type: str
    """HF model_type: llama, mistral, qwen2, gemma2, phi3, gpt2, gpt_neox, bert... ('custom' for plain modules)."""
    params: tuple[ParamTensor, ...]
    hidden_size: int = 0
    num_layers: int = 0
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0
    is_decoder: bool = True
    """Decoder-only, causal attention (a causal LM, or a Llama-family sequence classifier) vs encoder (BERT)."""
    gated_mlp: bool = True
    """SwiGLU/GeGLU (gate, up, down) vs a plain two-matrix MLP."""
    hidden_act: str = "silu"
    norm: str = "rmsnorm"
    """'rmsnorm' or 'layernorm'."""
    tie_word_embeddings: bool = False
    source: str = "catalog"
    """Where the numbers came from: 'catalog', a config.json path, 'hub:<id>', 'module'."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Where the spec came from beyond its numbers (hub_id, a derived model's class and stacks, a live module's frozen
    count, supports_sdpa); the family details the estimator reads live on `graph`'s typed nodes."""
    frozen: tuple[ParamTensor, ...] = ()
    """Parameters that are not trained (a LoRA base): no gradients, no optimizer state; their `nbytes` at rest."""
    buffer_bytes: int = 0
    """Device bytes of the model's buffers as it builds them (GPT-J's max_positions x rotary_dim fp32 sin/cos table):
    read off the built copies for derived models, 0 where not known (a recipe's rotary inverse frequencies, a few
    hundred bytes)."""
    finetune: Any = field(default=None, compare=False, hash=False)
    """The memfit.finetune.Finetune a live LoRA model was built with (read off its adapters), else None."""
    graph: Any = field(default=None, compare=False, hash=False, repr=False)
    """The typed model graph (memfit.graph.ModelGraph) when the architecture has a builder: what transforms such
    as LoRA rewrite."""
    derived: object | None = field(default=None, compare=False, hash=False, repr=False)
    """A memfit.derive.DerivedModel where the family has no hand-written activation recipe: the estimator's
    activation terms then come from a trace of a 1- and 2-block copy of the model."""

    @property
    def num_params(self) -> int:
        """Trainable parameter elements (what gradients and optimizer states are kept for)."""
        return sum(p.total for p in self.params)

    @property
    def num_frozen_params(self) -> int:
        return sum(p.total for p in self.frozen)

    @property
    def frozen_bytes(self) -> int:
        return sum(p.total_bytes(0) for p in self.frozen)

    @property
    def is_transformer(self) -> bool:
        """Whether the analytic activation model applies (otherwise only `memfit trace` can size activations)."""
        return self.num_layers > 0 and self.hidden_size > 0

    @property
    def logit_softcap(self) -> float | None:
        """Final-logit soft-capping (Gemma 2: tanh(logits / cap) x cap), read off the graph's head."""
        return getattr(getattr(self.graph, "head", None), "softcap", None)

    @property
    def auto_class(self) -> str:
        """The transformers Auto class that builds this model for training, as emitted loading code names it: an
        encoder-decoder LM (T5, BART) or an image classifier (ViT, DINOv2) for a model sized per stack, a sequence
        classifier for a text model with a classification head, a masked LM for an encoder (BERT), a causal LM
        otherwise (what memfit._torch.step builds for each)."""
        if "stacks" in self.extra:
            return "AutoModelForImageClassification" if not self.vocab_size else "AutoModelForSeq2SeqLM"
        if self.num_labels:
            return "AutoModelForSequenceClassification"
        return "AutoModelForCausalLM" if self.is_decoder else "AutoModelForMaskedLM"

    @property
    def num_labels(self) -> int:
        """The classes of a text sequence classifier's head (BertForSequenceClassification,
        LlamaForSequenceClassification: memfit.sources.with_task), else 0."""
        head = getattr(self.graph, "head", None)
        return head.num_labels if self.vocab_size and getattr(head, "pool", "") in ("first", "last") else 0

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def params_matching(self, *fragments: str) -> int:
        """Elements in parameter tensors whose name contains any of `fragments`."""
        return sum(p.total for p in self.params if any(f in p.name for f in fragments))
