"""memfit.graph: every family's graph against the real transformers module (meta device, exact per-tensor counts),
the catalog, the LoRA transform against peft, the tensor-parallel split by hand, and the one-line errors."""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
from collections import Counter

import pytest

from memfit.errors import ConfigError, ModelSourceError
from memfit.graph import (
    Block,
    Embedding,
    Linear,
    LoraLinear,
    ModelGraph,
    Node,
    Stack,
    UnknownNodeKindError,
    graph_from_config,
    graph_model_types,
    linears_of,
    params_of,
    tensors_of,
    walk,
    with_lora,
    with_tensor_parallel,
)
from memfit.sources import catalog_config, catalog_names, resolve_model

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
_MOE = dict(_BASE, num_experts=4, num_experts_per_tok=2)

# Tiny configs (2 layers): each family once, plus the variants whose parameter layout differs.
TINY: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama"),
    "llama-biases-tied": dict(_BASE, model_type="llama", attention_bias=True, mlp_bias=True, head_dim=32,
                              tie_word_embeddings=True),
    "mistral": dict(_BASE, model_type="mistral", sliding_window=64),
    "qwen2": dict(_BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(_BASE, model_type="qwen3", head_dim=32, attention_bias=True),
    "qwen3-default-head-dim": dict(_BASE, model_type="qwen3"),
    "gemma": dict(_BASE, model_type="gemma", head_dim=32),
    "gemma2": dict(_BASE, model_type="gemma2", head_dim=32),
    "gemma3_text": dict(_BASE, model_type="gemma3_text", head_dim=32),
    "phi3": dict(_BASE, model_type="phi3", pad_token_id=0),
    "phi": dict(_BASE, model_type="phi", num_key_value_heads=4),
    "phi-qk-layernorm-tied": dict(_BASE, model_type="phi", qk_layernorm=True, tie_word_embeddings=True),
    "stablelm": dict(_BASE, model_type="stablelm"),
    "stablelm-qk-parallel": dict(_BASE, model_type="stablelm", qk_layernorm=True, use_parallel_residual=True,
                                 use_qkv_bias=True),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=512, max_position_embeddings=256),
    "gpt_neox-no-bias-sequential": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                                        attention_bias=False, use_parallel_residual=False, tie_word_embeddings=True),
    "gptj": dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256, rotary_dim=8,
                 bos_token_id=0, eos_token_id=0),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=512, max_position_embeddings=256),
    "opt-proj-postnorm": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                              num_attention_heads=4, vocab_size=512, max_position_embeddings=256,
                              word_embed_proj_dim=32, do_layer_norm_before=False, tie_word_embeddings=False),
    "falcon": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                   bos_token_id=0, eos_token_id=0),
    "falcon-new-arch": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_kv_heads=2, vocab_size=512, new_decoder_architecture=True, bias=True,
                            bos_token_id=0, eos_token_id=0),
    "falcon-sequential-mha": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=512, multi_query=False, parallel_attn=False, alibi=True,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=512, max_position_embeddings=256),
    "bert-untied": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, vocab_size=512, max_position_embeddings=256, type_vocab_size=3,
                        tie_word_embeddings=False),
    "t5": dict(model_type="t5", d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512),
    "t5-gated-asymmetric": dict(model_type="t5", d_model=64, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=3,
                                num_heads=4, vocab_size=512, feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False),
    "bart": dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512,
                 max_position_embeddings=256),
    "bart-untied-asymmetric": dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=128,
                                   decoder_ffn_dim=96, vocab_size=512, max_position_embeddings=256,
                                   tie_word_embeddings=False),
    "vit": dict(model_type="vit", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, image_size=32, patch_size=8, num_labels=5),
    "mixtral": dict(_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_MOE, model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen2_moe-sparse-step": dict(_MOE, model_type="qwen2_moe", num_hidden_layers=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, decoder_sparse_step=2, mlp_only_layers=[3]),
    "olmoe": dict(_MOE, model_type="olmoe", pad_token_id=0, eos_token_id=0),
    "deepseek_v2": dict(_BASE, model_type="deepseek_v2", num_hidden_layers=3, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16),
    "deepseek_v2-no-q-lora": dict(_BASE, model_type="deepseek_v2", n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, attention_bias=True),
}

_AUTO = {"bert": "AutoModelForMaskedLM", "t5": "AutoModelForSeq2SeqLM", "bart": "AutoModelForSeq2SeqLM",
         "vit": "AutoModelForImageClassification"}


def torch_and_transformers():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def build_on_meta(config: dict):
    """The model transformers builds for this config (the Auto class memfit's graph describes), without memory."""
    torch, transformers = torch_and_transformers()
    kwargs = copy.deepcopy(config)
    model_type = kwargs.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    auto = getattr(transformers, _AUTO.get(model_type, "AutoModelForCausalLM"))
    with torch.device("meta"):
        return auto.from_config(hf_config)


_INDEX = re.compile(r"(?<=\.)(\d+|\*)(?=\.|$)")


def _rows(pairs) -> Counter:
    """(name with every layer index as '*', numel) -> number of such tensors."""
    rows: Counter = Counter()
    for name, numel, count in pairs:
        rows[(_INDEX.sub("*", name), numel)] += count
    return rows


def module_rows(model, strip: str = "") -> Counter:
    return _rows((n.removeprefix(strip), p.numel(), 1) for n, p in model.named_parameters())


def graph_rows(graph: ModelGraph, **kwargs) -> Counter:
    return _rows((t.name, t.numel, t.count) for t in graph.param_tensors(**kwargs))


def assert_graph_matches(graph: ModelGraph, model) -> None:
    assert graph.num_params == sum(p.numel() for p in model.parameters())  # unique parameters, tied ones once
    assert graph_rows(graph) == module_rows(model)


# --- every family against the module transformers builds ----------------------------------------------------


@pytest.mark.parametrize("label", sorted(TINY))
def test_tiny_family_matches_transformers_exactly(label):
    config = TINY[label]
    model = build_on_meta(config)
    assert_graph_matches(graph_from_config(config), model)
    assert_graph_matches(graph_from_config(model.config), model)  # a PretrainedConfig (all defaults filled in)


def test_every_builder_has_a_tiny_config():
    assert set(graph_model_types()) == {c["model_type"] for c in TINY.values()}


# --- the catalog ------------------------------------------------------------------------------------------------


GRAPHLESS_CATALOG_TYPES = {"qwen3_moe", "deepseek_v3", "gpt_oss", "dinov2"}
"""Catalog families without a graph builder yet: sized through memfit.derive; LoRA on them says it needs a graph."""
GRAPH_CATALOG = [n for n in catalog_names() if catalog_config(n)["model_type"] not in GRAPHLESS_CATALOG_TYPES]


def test_every_other_catalog_family_has_a_graph_builder():
    types = {catalog_config(n)["model_type"] for n in catalog_names()}
    assert types - set(graph_model_types()) == GRAPHLESS_CATALOG_TYPES


@pytest.mark.parametrize("name", GRAPH_CATALOG)
def test_catalog_model_matches_transformers_exactly(name):
    config = catalog_config(name)
    assert_graph_matches(graph_from_config(config, name=name), build_on_meta(config))


@pytest.mark.parametrize("name", GRAPH_CATALOG)
def test_catalog_graph_tensors_equal_model_spec_params(name):
    """param_tensors() holds what ModelSpec.params holds, so the current estimator can be fed from a graph."""
    spec = resolve_model(name)
    graph = graph_from_config(catalog_config(name), name=name)
    assert graph_rows(graph) == _rows((p.name, p.numel, p.count) for p in spec.params)
    assert graph.num_params == spec.num_params


# --- LoRA against peft ------------------------------------------------------------------------------------------

_ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("label, targets", [
    ("llama", ["q_proj", "v_proj"]),
    ("llama", _ALL_LLAMA),
    ("llama-biases-tied", ["self_attn.q_proj", "mlp.down_proj"]),
    ("gpt2", ["c_attn"]),
    ("bert", ["dense"]),
    ("mixtral", ["q_proj", "o_proj", "down_proj"]),
])
def test_lora_matches_peft(label, targets):
    peft = pytest.importorskip("peft")
    torch_and_transformers()
    config = TINY[label]
    model = peft.get_peft_model(build_on_meta(config), peft.LoraConfig(r=8, target_modules=targets))
    graph = with_lora(graph_from_config(config), 8, targets)
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert graph.num_trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert graph_rows(graph) == module_rows(model, strip="base_model.model.")
    trainable = _rows((n.removeprefix("base_model.model."), p.numel(), 1)
                      for n, p in model.named_parameters() if p.requires_grad)
    assert graph_rows(graph, trainable=True) == trainable


def test_lora_is_pure_and_structural():
    graph = graph_from_config(TINY["llama"])
    adapted = with_lora(graph, 4, ["q_proj"])
    assert graph.num_trainable_params == graph.num_params  # the input is untouched
    lora = [node for path, node in adapted.linears() if isinstance(node, LoraLinear)]
    attention = adapted.stacks[0].block.nodes[1]
    assert [path for path, _ in linears_of(attention, "self_attn")] == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    assert len(lora) == 1 and lora[0].rank == 4 and not lora[0].base.trainable
    assert (lora[0].a.in_features, lora[0].a.out_features, lora[0].b.out_features) == (64, 4, 64)
    per_layer = 4 * (64 + 64)  # A: 64 x 4, B: 4 x 64
    assert adapted.num_trainable_params == 2 * per_layer
    assert adapted.num_params == graph.num_params + 2 * per_layer


def test_lora_without_a_match_names_the_projections():
    with pytest.raises(ConfigError) as info:
        with_lora(graph_from_config(TINY["llama"]), 8, ["query_key_value"])
    message = str(info.value)
    assert "\n" not in message and "query_key_value" in message and "q_proj" in message
    with pytest.raises(ConfigError, match="rank"):
        with_lora(graph_from_config(TINY["llama"]), 0, ["q_proj"])


# --- tensor parallelism -----------------------------------------------------------------------------------------


def test_tensor_parallel_per_rank_params_by_hand():
    """Tiny llama (hidden 64, 4 heads of 16, 2 kv heads, intermediate 128, vocab 512, untied), degree 2:
    q/k/v/gate/up split by output, o/down by input, embedding and lm_head by vocabulary, norms whole."""
    graph = graph_from_config(TINY["llama"])
    tp = with_tensor_parallel(graph, 2)
    h, kv, inter, vocab = 64, 2 * 16, 128, 512
    layer = (h * h // 2 + 2 * (h * kv // 2) + h * h // 2  # q, k, v (column), o (row)
             + 2 * (h * inter // 2) + inter * h // 2      # gate, up (column), down (row)
             + 2 * h)                                     # two RMSNorm weights, replicated
    by_hand = vocab * h // 2 + 2 * layer + h + vocab * h // 2
    assert tp.num_params_per_rank == by_hand == 69_952
    assert tp.num_params == graph.num_params == 139_584  # the whole model is unchanged
    q = next(node for path, node in tp.linears() if path.endswith("q_proj"))
    o = next(node for path, node in tp.linears() if path.endswith("o_proj"))
    assert (q.shard.style, o.shard.style, tp.embed.shard.style) == ("column", "row", "vocab")
    assert graph.embed.shard is None  # pure: the input graph is untouched
    assert with_tensor_parallel(graph, 1) is graph


def test_tensor_parallel_row_bias_stays_whole_and_lora_follows_its_base():
    config = dict(TINY["llama-biases-tied"])
    graph = graph_from_config(config)
    tp = with_tensor_parallel(graph, 2)
    local = {t.name: t.local for t in tp.tensors()}
    assert local["model.layers.*.self_attn.q_proj.bias"] == 128 // 2  # column: bias split
    assert local["model.layers.*.self_attn.o_proj.bias"] == 64  # row: bias whole
    assert local["model.layers.*.mlp.down_proj.weight"] == 64 * 128 // 2
    lora_then_tp = with_tensor_parallel(with_lora(graph, 8, ["q_proj", "o_proj"]), 2)
    tp_then_lora = with_lora(tp, 8, ["q_proj", "o_proj"])
    assert lora_then_tp.tensors() == tp_then_lora.tensors()
    local = {t.name: t.local for t in lora_then_tp.tensors()}
    assert local["model.layers.*.self_attn.q_proj.lora_A.default.weight"] == 64 * 8  # A whole
    assert local["model.layers.*.self_attn.q_proj.lora_B.default.weight"] == 8 * 128 // 2  # B by output
    assert local["model.layers.*.self_attn.o_proj.lora_A.default.weight"] == 128 * 8 // 2  # A by input
    assert local["model.layers.*.self_attn.o_proj.lora_B.default.weight"] == 8 * 64  # B whole
    assert lora_then_tp.num_trainable_params_per_rank == 2 * (64 * 8 + 8 * 64 + 64 * 8 + 8 * 64)


@pytest.mark.parametrize("label, degree, expected", [
    ("llama", 3, "q_heads (4)"),
    ("llama", 4, "kv_heads (2)"),
    ("falcon", 2, "kv_heads (1)"),  # multi-query: one key/value head cannot be split
    ("llama", 256, "intermediate (128)"),
])
def test_tensor_parallel_degree_must_divide_heads(label, degree, expected):
    with pytest.raises(ConfigError) as info:
        with_tensor_parallel(graph_from_config(TINY[label]), degree)
    message = str(info.value)
    assert "\n" not in message and expected in message and f"degree {degree}" in message


def test_tensor_parallel_shards_mla_and_experts():
    tp = with_tensor_parallel(graph_from_config(TINY["deepseek_v2"]), 2)
    local = {t.name: (t.numel, t.local) for t in tp.tensors()}
    assert local["model.layers.*.self_attn.kv_a_proj_with_mqa.weight"] == (64 * 24, 64 * 24)  # replicated
    assert local["model.layers.*.self_attn.kv_b_proj.weight"] == (16 * 128, 16 * 64)  # split by heads
    assert local["model.layers.*.mlp.experts.gate_up_proj"] == (4 * 64 * 64, 4 * 64 * 32)
    assert local["model.layers.*.mlp.gate.weight"] == (4 * 64, 4 * 64)  # router replicated


# --- the registry and its errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("label", sorted(TINY))
def test_every_node_params_equal_its_tensors(label):
    graph = graph_from_config(TINY[label])
    for path, node, _ in walk(graph):
        assert params_of(node) == sum(t.total for t in tensors_of(node, path)), path


@dataclasses.dataclass(frozen=True)
class _Conv(Node):
    channels: int
    name: str = "conv"


@dataclasses.dataclass(frozen=True)
class _MyLinear(Linear):
    """A subclass of a known kind: it must not borrow Linear's formula."""


def test_unknown_node_kind_is_one_clear_line():
    graph = graph_from_config(TINY["llama"])
    stack = graph.stacks[0]
    odd = dataclasses.replace(graph, stacks=(dataclasses.replace(
        stack, block=Block((*stack.block.nodes, _Conv(3)))),))
    with pytest.raises(UnknownNodeKindError) as info:
        odd.num_params
    assert "\n" not in str(info.value) and "'_Conv'" in str(info.value) and "params" in str(info.value)
    with pytest.raises(UnknownNodeKindError, match="'_MyLinear'"):
        params_of(_MyLinear("x", 2, 2))


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "mamba", "hidden_size": 64}, "'mamba'"),
    ({"hidden_size": 64}, "no 'model_type'"),
    ({"model_type": "gemma3", "text_config": {}}, "'gemma3'"),  # the multimodal wrapper: only gemma3_text
    ({**_BASE, "model_type": "llama", "hidden_size": None}, "'hidden_size' is missing"),
    ({**_BASE, "model_type": "llama", "num_attention_heads": 0}, "'num_attention_heads'"),
    ({**_BASE, "model_type": "llama", "num_key_value_heads": 3}, "must divide"),
])
def test_bad_model_type_or_config_is_one_clear_line(config, expected):
    with pytest.raises(ModelSourceError) as info:
        graph_from_config(config)
    assert "\n" not in str(info.value) and expected in str(info.value)


@pytest.mark.processes
def test_importing_the_graph_imports_neither_torch_nor_transformers():
    code = ("import sys, memfit.graph as g; g.graph_from_config({'model_type': 'llama', 'hidden_size': 8, "
            "'intermediate_size': 16, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'vocab_size': 32}); "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_graph_structure_reads_like_the_module():
    graph = graph_from_config(TINY["deepseek_v2"])
    assert [(s.name, s.first, s.count) for s in graph.stacks] == [("model.layers", 0, 1), ("model.layers", 1, 2)]
    assert graph.num_layers == 3
    attention = graph.stacks[1].block.nodes[1]
    assert attention.latent_kv.kv_lora_rank == 16 and attention.head_dim == 24
    t5 = graph_from_config(TINY["t5"])
    assert [(s.name, s.seq_axis) for s in t5.stacks] == [("encoder.block", "source"), ("decoder.block", "target")]
    assert [n.kind for n in t5.stacks[1].block.nodes if hasattr(n, "q_heads")] == ["causal", "cross"]
    gemma2 = graph_from_config(TINY["gemma2"])
    assert gemma2.head.softcap == 30.0 and gemma2.stacks[0].block.sandwich_norms
    assert gemma2.stacks[0].block.nodes[1].softcap == 50.0 and gemma2.head.tied
    neox = graph_from_config(TINY["gpt_neox"])
    assert neox.stacks[0].block.parallel_residual and neox.stacks[0].block.nodes[1].rotary_fraction == 0.25
    assert neox.stacks[0].block.nodes[1].fused_qkv
    assert isinstance(graph_from_config(TINY["gpt2"]).extra_params[0], Embedding)
    assert isinstance(graph.stacks[0], Stack)
