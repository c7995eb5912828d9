"""The activation formulas as `saved` handlers per graph node kind (memfit.graph.saved).

The equality test recomputes the digests of tests/data/saved_snapshot.json: the outputs of the per-part functions
of memfit.estimate.activations and every term of `estimate(...)` for the tiny configs x precision x attention x
checkpointing x fine-tuning x tensor/sequence parallelism x GPU/CPU, recorded by `bench/saved_snapshot.py
--fixture`. It was first recorded from the per-family recipes these handlers replaced (and matched them byte for
byte when they were merged); since then it is the golden snapshot of the formulas: any byte that moves fails it, and
a formula changed on purpose regenerates it (`--fixture`) in the same commit, which says why. Regenerated once
since: the CPU-device terms a measured-step matrix added (checkpoint RNG states, bitsandbytes' CPU step scratch,
single-tensor AdamW's kept denominator).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from memfit.estimate import activations as act
from memfit.graph import Attention, Block, Node, Norm, handler
from memfit.graph.saved import Dtypes, SavedCtx, saved_by
from memfit.setup import Precision, TrainingSetup
from memfit.sources import resolve_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import saved_snapshot  # noqa: E402

FIXTURE = json.loads((ROOT / "tests" / "data" / "saved_snapshot.json").read_text())["groups"]
MODELS = sorted({key.split("|")[0] for key in FIXTURE})
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


@pytest.mark.parametrize("model", MODELS)
def test_numbers_equal_the_snapshot(model):
    now = {k: v for k, v in saved_snapshot.grouped(True, only=model).items()}
    expected = {k: v for k, v in FIXTURE.items() if k.split("|")[0] == model}
    assert now == expected


def test_estimate_names_no_model_type_but_peft_targets():
    """Architecture knowledge lives on the graph; the only model_type left is peft's own default-target table (and
    the raw config's own field read as a label for a cache file or a message, `config.get("model_type")`)."""
    hits = []
    for path in sorted((ROOT / "src" / "memfit" / "estimate").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            rest = re.sub(r"""config\.get\((["'])model_type\1\)""", "", line)
            if "model_type" in rest and not (path.name == "lora.py" and re.search(r"PEFT_DEFAULT_TARGETS|peft", line)):
                hits.append(f"{path.name}:{number}: {line.strip()}")
    assert hits == []
    assert not hasattr(act, "LAYER_RECIPES")


def test_linear_weights_are_read_off_the_graph_not_parameter_names():
    """The weights autocast caches a copy of come from the graph's Linear nodes (and the experts from its Experts
    nodes), never from fragments of parameter names; checked against the real modules' nn.Linear weights."""
    import inspect

    from memfit.estimate import backward_moments, forward_terms, moe, pipeline

    for function in (forward_terms.linear_weight_elems, moe.expert_weight_elems, moe.in_stacked_experts,
                     backward_moments.block_mlp_params, backward_moments.token_embedding_elems,
                     moe._stacked_expert_names,
                     pipeline._embedding_names):
        source = inspect.getsource(function)
        assert "p.name" not in source and "params_matching" not in source, function.__name__
    # the graph-less fallback's module names pick what the graph gives
    for name in ("llama-3.1-8b", "gpt2", "bert-base-uncased", "mixtral-8x7b", "opt-1.3b", "deepseek-v2-lite"):
        spec = resolve_model(name)
        assert pipeline._embedding_names(spec) == {p.name for p in spec.params if ".*." not in p.name and any(
            f in p.name for f in pipeline.EMBEDDING_FRAGMENTS)}, name
    torch = pytest.importorskip("torch")
    from memfit._torch.step import build_hf_model
    from tiny_configs import TINY_LLAMA
    from tiny_encdec import TINY_BART

    for config in (TINY_LLAMA, TINY_BART):  # untied LM head; BART's head tied to its shared embedding
        model = build_hf_model(dict(config), TrainingSetup())
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert forward_terms.linear_weight_elems(resolve_model(dict(config))) == linear, config["model_type"]


@dataclass(frozen=True)
class Mixer(Node):
    """A node kind nobody registered a 'saved' handler for."""

    hidden: int
    name: str = field(default="mixer", kw_only=True)


handler("params", Mixer)(lambda node: 0)


def _swap_attention(graph, new):
    stack = graph.stacks[0]
    nodes = tuple(new if isinstance(n, Attention) else n for n in stack.block.nodes)
    return replace(graph, stacks=(replace(stack, block=replace(stack.block, nodes=nodes)),))


def test_unknown_kind_or_subclass_never_borrows_a_formula():
    graph = resolve_model(dict(TINY, model_type="llama")).graph
    assert act.saved_problem(graph) is None
    problem = act.saved_problem(_swap_attention(graph, Mixer(64)))
    assert "no 'saved' handler for node kind 'Mixer'" in problem

    @dataclass(frozen=True)
    class Windowed(Attention):  # a subclass gets no handler of its parent's
        pass

    attention = next(n for n in graph.stacks[0].block.nodes if isinstance(n, Attention))
    windowed = Windowed(**{f: getattr(attention, f) for f in attention.__dataclass_fields__})
    assert "node kind 'Windowed'" in act.saved_problem(_swap_attention(graph, windowed))


def test_unmodelled_fields_go_to_the_derived_path():
    """Qwen3's q/k norms and Gemma 1's fp32 norms outside sandwich blocks have no formula: memfit.derive sizes
    them (its DerivedModel is attached), while Llama / Gemma 2 are sized by the handlers."""
    sized = {t: resolve_model(dict(TINY, model_type=t)) for t in ("qwen3", "gemma", "gemma2", "llama")}
    assert {t: s.derived is not None for t, s in sized.items()} == {"qwen3": True, "gemma": True, "gemma2": False,
                                                                   "llama": False}
    assert "q/k norms" in act.saved_problem(sized["qwen3"].graph)


def test_node_fields_carry_the_family_differences():
    """Gemma's RMSNorm keeps its normalised value in fp32 (4 B, not 2, under pure bf16); a parallel-residual
    block's norms share one saved input; GPT-NeoX's attention output is copied contiguous (one q-sized row more)."""
    ctx = SavedCtx(setup=TrainingSetup(precision=Precision.BF16), seq_len=8, d=Dtypes.of(Precision.BF16))
    plain, gemma = Norm("rms", 64), Norm("rms", 64, fp32_output=True)
    assert sum(ctx.d.bytes_of(r) for r in saved_by(gemma, ctx)) - sum(ctx.d.bytes_of(r) for r in saved_by(plain, ctx)) \
        == 2 * 64
    neox = resolve_model(dict(TINY, model_type="gpt_neox", num_key_value_heads=4)).graph.stacks[0].block
    sequential = replace(neox, parallel_residual=False)
    h = 64
    rows = lambda block: sum(ctx.d.bytes_of(r) for r in saved_by(block, ctx))  # noqa: E731
    assert rows(sequential) - rows(neox) == ctx.d.residual * h  # the second LayerNorm's own input copy
    attention = next(n for n in neox.nodes if isinstance(n, Attention))
    assert attention.contiguous_out
    copy = sum(ctx.d.bytes_of(r) for r in saved_by(attention, ctx)) - sum(
        ctx.d.bytes_of(r) for r in saved_by(replace(attention, contiguous_out=False), ctx))
    assert copy == ctx.d.compute * attention.q_heads * attention.head_dim


def test_block_of_a_sandwich_layer_counts_four_norms():
    graph = resolve_model(dict(TINY, model_type="gemma2", head_dim=16)).graph
    block = graph.stacks[0].block
    assert isinstance(block, Block) and block.sandwich_norms
    ctx = SavedCtx(setup=TrainingSetup(), seq_len=8, d=Dtypes.of(Precision.FP32))
    norm_rows = [r for r in saved_by(block, ctx) if r.group == "norms"]
    assert len(norm_rows) == 4 * 3  # four RMSNorms, three rows each


def _saved_per_token_bytes(module, x) -> int:
    """Bytes of the distinct per-token tensors autograd saves in one forward of `module`: every saved storage but
    the parameters', whose size is a multiple of B x T (B x T = 14 divides none of the weight sizes here)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.numel() % (x.shape[0] * x.shape[1]) == 0:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


def _check(module, node, dtype_name: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    x = torch.randn(2, 7, 64, dtype=dtype, requires_grad=True)
    precision = Precision.FP32 if dtype is torch.float32 else Precision.BF16
    ctx = SavedCtx(setup=TrainingSetup(precision=precision), seq_len=7, d=Dtypes.of(precision, on_cpu=True))
    assert _saved_per_token_bytes(module.to(dtype), x) == sum(ctx.d.bytes_of(r) for r in saved_by(node, ctx)) * 14


@pytest.mark.parametrize("dtype_name, gemma", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_norm_rows_match_what_the_real_module_saves(dtype_name, gemma):
    """LlamaRMSNorm / Gemma2RMSNorm (transformers) under saved_tensors_hooks: the Norm handler's rows, with and
    without fp32_output, give the bytes the real module keeps."""
    pytest.importorskip("torch")
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    _check(Gemma2RMSNorm(64) if gemma else LlamaRMSNorm(64), Norm("rms", 64, fp32_output=gemma), dtype_name)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_mlp_rows_match_what_the_real_module_saves(family, dtype_name):
    """LlamaMLP (gated silu: x, gate out, act out, up out, product) and GPT2MLP (Conv1D, gelu_new written out in
    Python: four I-sized tensors) under saved_tensors_hooks against the MLP handler's rows off the family's graph."""
    pytest.importorskip("torch")
    from transformers import GPT2Config, LlamaConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    from memfit.graph import MLP

    if family == "llama":
        config = dict(TINY, model_type="llama")
        module = LlamaMLP(LlamaConfig(**config))
    else:
        config = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=512, resid_pdrop=0.0)
        module = GPT2MLP(128, GPT2Config(**config))
    mlp = next(n for n in resolve_model(config).graph.stacks[0].block.nodes if isinstance(n, MLP))
    _check(module, mlp, dtype_name)
