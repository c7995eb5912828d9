"""memfit.sources: every catalog model against the real transformers module (meta device, exact per-tensor counts),
config.json / dict / hub / module resolution, and the one-line errors for what cannot be resolved."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import memfit
from memfit.errors import ModelSourceError, UnknownNameError
from memfit.model_spec import ModelSpec
from memfit.sources import (
    SUPPORTED_MODEL_TYPES,
    catalog_config,
    catalog_entry,
    catalog_names,
    from_config_file,
    from_hf_config,
    from_module,
    resolve_model,
)

REQUIRED_CATALOG = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base-uncased", "bert-large-uncased", "llama-2-7b",
    "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b",
    "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "gemma-2-2b", "gemma-2-9b", "phi-3-mini",
    "pythia-160m", "pythia-410m", "pythia-1b", "pythia-1.4b", "pythia-2.8b", "pythia-6.9b", "pythia-12b",
    # families without a recipe (parameters and activations through memfit.derive, shipped in data/derived)
    "mixtral-8x7b", "mixtral-8x22b", "qwen3-8b", "qwen3-32b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "gemma-3-1b",
    "gemma-3-4b-text", "gemma-3-12b-text", "gemma-3-27b-text", "phi-4", "falcon-7b", "falcon-40b", "opt-1.3b",
    "opt-6.7b", "gpt-j-6b", "stablelm-2-1.6b", "olmoe-1b-7b", "deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b",
    "gpt-oss-120b",
]

# Published totals, independent of transformers: model cards / papers (Pythia: the suite's README table; BERT:
# BertForMaskedLM = the checkpoint's 109,482,240 / 335,141,888 minus the pooler plus the MLM head transform and bias).
PUBLISHED_TOTALS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "bert-base-uncased": 109_482_240 - (768 * 768 + 768) + (768 * 768 + 768 + 2 * 768 + 30522),
    "bert-large-uncased": 335_141_888 - (1024 * 1024 + 1024) + (1024 * 1024 + 1024 + 2 * 1024 + 30522),
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824, "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648,
    "gemma-2-2b": 2_614_341_888, "gemma-2-9b": 9_241_705_984, "phi-3-mini": 3_821_079_552,
    "pythia-160m": 162_322_944, "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
}


# Published totals given rounded (model cards, papers: the `source` of each catalog entry), with the relative
# difference allowed and, where it is more than rounding, why. bench/results/catalog.md tabulates them.
PUBLISHED_ROUNDED = {
    "mixtral-8x7b": (46.7e9, 0.001), "mixtral-8x22b": (141e9, 0.005), "qwen3-8b": (8.2e9, 0.005),
    "qwen3-32b": (32.8e9, 0.005), "qwen1.5-moe-a2.7b": (14.3e9, 0.005), "qwen3-30b-a3b": (30.5e9, 0.005),
    "gemma-3-1b": (1.0e9, 0.005), "phi-4": (14.7e9, 0.005), "olmoe-1b-7b": (6.9e9, 0.005),
    "deepseek-v2-lite": (15.7e9, 0.005), "gpt-oss-20b": (20.91e9, 0.001), "gpt-oss-120b": (116.83e9, 0.001),
    # the 671B of the paper: the checkpoint's 685B adds the multi-token-prediction module, which is not built
    "deepseek-v3": (671e9, 0.001),
    # only the model's name: OPT's Table 1 sizes, "7B" / "40B" for Falcon (the checkpoints hold 6.92B / 41.3B)
    "opt-1.3b": (1.3e9, 0.015), "opt-6.7b": (6.7e9, 0.01), "falcon-7b": (7e9, 0.015), "falcon-40b": (40e9, 0.035),
    # the model cards' exact figures: GPT-J's (counted on the JAX checkpoint) is 2,498,560 above the HF layout;
    # StableLM 2's is 98,304 = 24 layers x 2 x 2048 below it (two of the three q/k/v bias vectors per layer)
    "gpt-j-6b": (6_053_381_344, 0.0005), "stablelm-2-1.6b": (1_644_417_024, 0.0001),
    # Llama 3: the 3.1 tensors (8.03B, 70.6B); Mistral 7B v0.3: v0.1's layers with 768 more vocabulary rows
    "llama-3-8b": (8.03e9, 0.001), "llama-3-70b": (70.6e9, 0.001), "mistral-7b-v0.3": (7.25e9, 0.001),
}
# Gemma 3 text towers: the technical report's non-embedding counts (Table 1), which match to the million; its
# embedding column is 4-6M above vocab x hidden, so the totals are checked this way.
GEMMA3_NON_EMBEDDING = {"gemma-3-1b": 698e6, "gemma-3-4b-text": 3_209e6, "gemma-3-12b-text": 10_759e6,
                        "gemma-3-27b-text": 25_600e6}


def torch_and_transformers():
    """Imported when a test needs them (skipped without), so collecting this file imports neither."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def build_on_meta(config: dict):
    """The class memfit sizes for this config, built by transformers without memory."""
    torch, transformers = torch_and_transformers()
    kwargs = dict(config)
    model_type = kwargs.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        if model_type == "bert":
            return transformers.BertForMaskedLM(hf_config)
        if getattr(hf_config, "is_encoder_decoder", False):  # t5, bart
            return transformers.AutoModelForSeq2SeqLM.from_config(hf_config)
        if model_type in ("vit", "dinov2"):
            return transformers.AutoModelForImageClassification.from_config(hf_config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def module_rows(model) -> Counter:
    """(name with layer index as '*', numel) -> how many such tensors the module has (tied ones once)."""
    return Counter((re.sub(r"(?<=\.)\d+(?=\.)", "*", n), p.numel()) for n, p in model.named_parameters())


def spec_rows(spec: ModelSpec) -> Counter:
    rows: Counter = Counter()
    for p in spec.params:
        rows[(p.name, p.numel)] += p.count
    return rows


def assert_matches_module(spec: ModelSpec, model) -> None:
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    spec_numels = sorted(n for p in spec.params for n in [p.numel] * p.count)
    assert spec_numels == sorted(p.numel() for p in model.parameters())
    assert spec_rows(spec) == module_rows(model)


# --- the catalog against the real modules ---------------------------------------------------------------------


def test_catalog_has_the_required_models():
    names = catalog_names()
    assert len(names) == len(set(names))
    assert set(REQUIRED_CATALOG) <= set(names)


@pytest.mark.parametrize("name", catalog_names())
def test_catalog_model_matches_transformers_module_tensor_by_tensor(name):
    spec = resolve_model(name)
    assert_matches_module(spec, build_on_meta(catalog_config(name)))


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_catalog_model_matches_published_total(name):
    assert resolve_model(name).num_params == PUBLISHED_TOTALS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED))
def test_catalog_model_is_near_its_published_rounded_total(name):
    published, tolerance = PUBLISHED_ROUNDED[name]
    assert abs(resolve_model(name).num_params - published) <= tolerance * published


@pytest.mark.parametrize("name", sorted(GEMMA3_NON_EMBEDDING))
def test_gemma3_non_embedding_parameters_match_the_report(name):
    spec = resolve_model(name)
    embedding = spec.vocab_size * spec.hidden_size
    assert abs(spec.num_params - embedding - GEMMA3_NON_EMBEDDING[name]) < 0.5e6


def test_every_catalog_entry_cites_its_source_and_states_exclusions():
    raw = json.loads(Path(memfit.__file__).with_name("data").joinpath("models.json").read_text())
    for entry in raw["models"]:
        if entry["name"] in REQUIRED_CATALOG[:28]:  # the original entries predate the source field
            continue
        assert "huggingface.co/" in entry["source"] and entry["published_params"], entry["name"]
    excluded = {e["name"]: e for e in raw["excluded"]}
    assert {"clip-vit-large-patch14-vision", "siglip-so400m-vision"} <= set(excluded)
    assert all(e["reason"] and e["hub_id"] for e in excluded.values())
    assert not set(excluded) & set(catalog_names())


def test_catalog_architecture_numbers():
    llama = resolve_model("llama-3.1-8b")
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.num_kv_heads) == (32, 4096, 32, 8)
    assert (llama.head_dim, llama.kv_dim, llama.vocab_size) == (128, 1024, 128256)
    assert llama.gated_mlp and llama.norm == "rmsnorm" and not llama.tie_word_embeddings and llama.is_decoder
    gemma = resolve_model("gemma-2-2b")
    assert gemma.head_dim == 256 and gemma.tie_word_embeddings and gemma.hidden_act == "gelu_pytorch_tanh"
    # family details live on the typed graph's nodes (memfit.graph), where the estimator reads them
    from memfit.graph.kinds.attention import Attention

    def attention(spec):
        return spec.graph.nodes(Attention)[0][1]

    assert gemma.logit_softcap == 30.0 and attention(gemma).softcap == 50.0 and gemma.graph.stacks[0].block.sandwich_norms
    gpt2 = resolve_model("gpt2")
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings, gpt2.tie_word_embeddings) == (3072, 1024, True)
    assert gpt2.norm == "layernorm" and not gpt2.gated_mlp
    assert [lin.conv1d for _, lin in gpt2.graph.linears()] == [True] * 4  # c_attn, c_proj, c_fc, c_proj
    bert = resolve_model("bert-base-uncased")
    assert not bert.is_decoder and bert.extra == {"hub_id": "google-bert/bert-base-uncased"}
    assert bert.auto_class == "AutoModelForMaskedLM" and bert.logit_softcap is None
    assert not any("pooler" in p.name for p in bert.params)
    pythia = resolve_model("pythia-160m")
    assert pythia.graph.stacks[0].block.parallel_residual and attention(pythia).rotary_fraction == 0.25
    assert all(lin.bias for lin in attention(resolve_model("qwen2.5-7b")).qkv)
    assert [lin.name for lin in attention(resolve_model("phi-3-mini")).qkv] == ["qkv_proj"]


def test_derived_catalog_architecture_numbers():
    def shape(name):
        spec = resolve_model(name)
        return spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.vocab_size

    assert shape("mixtral-8x7b") == (32, 4096, 32, 8, 32000)
    assert shape("deepseek-v3") == (61, 7168, 128, 128, 129280)
    assert shape("gpt-oss-120b") == (36, 2880, 64, 8, 201088)
    assert shape("falcon-7b")[3] == 1 and shape("falcon-40b")[3] == 8  # multi-query; grouped (new architecture)
    assert resolve_model("gemma-3-1b").tie_word_embeddings and not resolve_model("qwen3-30b-a3b").tie_word_embeddings
    v3 = {p.name: p.count for p in resolve_model("deepseek-v3").params}
    assert v3["model.layers.*.mlp.gate_proj.weight"] == 3 and v3["model.layers.*.mlp.experts.gate_up_proj"] == 58


def test_catalog_families_are_contiguous():
    """`memfit models` draws a rule between families: each family's entries are next to each other."""
    families = [catalog_entry(name)["family"] for name in catalog_names()]
    runs = [f for i, f in enumerate(families) if i == 0 or families[i - 1] != f]
    assert len(runs) == len(set(runs))


def test_per_layer_tensors_are_one_row_each_with_layer_count():
    spec = resolve_model("llama-2-7b")
    q = [p for p in spec.params if p.name == "model.layers.*.self_attn.q_proj.weight"]
    assert q == [type(q[0])("model.layers.*.self_attn.q_proj.weight", 4096 * 4096, 32)]
    tied = resolve_model("llama-3.2-1b")
    assert not any(p.name == "lm_head.weight" for p in tied.params)


def test_catalog_lookup_is_case_insensitive_and_knows_aliases_and_hub_ids():
    assert resolve_model("GPT2-XL").name == "gpt2-xl"
    assert resolve_model("Llama2-7B").name == "llama-2-7b"
    assert resolve_model("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"  # offline: the catalog has it
    assert resolve_model("gpt2", name="my-gpt").name == "my-gpt"
    for name in catalog_names():
        entry = catalog_entry(name)
        for alias in [entry["hub_id"], *entry["aliases"]]:
            assert resolve_model(alias).name == name


def test_catalog_entry_summarises_a_model():
    entry = catalog_entry("mistral-7b")
    assert entry["hub_id"] == "mistralai/Mistral-7B-v0.1" and "v0.1" in entry["note"]
    assert (entry["num_params"], entry["num_layers"], entry["num_kv_heads"]) == (7_241_732_096, 32, 8)
    assert {"name", "family", "hidden_size", "num_attention_heads", "vocab_size",
            "max_position_embeddings"} <= set(entry)
    assert "BertForMaskedLM" in catalog_entry("bert-base-uncased")["note"]


def test_unknown_name_suggests_close_catalog_names():
    with pytest.raises(UnknownNameError, match="llama-3.1-8b"):
        resolve_model("llama-3.1-8")
    with pytest.raises(UnknownNameError, match="pythia"):
        catalog_entry("pythia-16m")


# --- layouts beyond the catalog: tiny configs that flip each switch ----------------------------------------------

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=101)
VARIANTS = {
    "llama biases": dict(TINY, model_type="llama", num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "llama tied, wide heads": dict(TINY, model_type="llama", num_key_value_heads=1, head_dim=48,
                                   tie_word_embeddings=True),
    "llama no kv key": dict(TINY, model_type="llama"),
    "mistral": dict(TINY, model_type="mistral", num_key_value_heads=2),
    "qwen2 tied": dict(TINY, model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(TINY, model_type="qwen3", num_key_value_heads=2, head_dim=32),
    "qwen3 biased": dict(TINY, model_type="qwen3", num_key_value_heads=2, head_dim=32, attention_bias=True),
    "gemma": dict(TINY, model_type="gemma", num_key_value_heads=1, head_dim=16),
    "gemma no head_dim": dict(TINY, model_type="gemma", num_key_value_heads=1),
    "gemma2 untied": dict(TINY, model_type="gemma2", num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "phi3 gqa": dict(TINY, model_type="phi3", num_key_value_heads=2, pad_token_id=0),
    "gpt2 n_inner untied": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_inner=80, n_positions=40,
                                vocab_size=101, tie_word_embeddings=False),
    "gpt2 defaults": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=101),
    "gpt_neox no attention bias, tied": dict(TINY, model_type="gpt_neox", attention_bias=False,
                                             tie_word_embeddings=True),
    "bert untied, 3 token types": dict(TINY, model_type="bert", type_vocab_size=3, max_position_embeddings=64,
                                       tie_word_embeddings=False),
}


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_layout_switches_match_transformers(label):
    config = VARIANTS[label]
    spec = resolve_model(config)
    assert_matches_module(spec, build_on_meta(config))


def test_every_supported_model_type_is_exercised():
    exercised = {c["model_type"] for c in VARIANTS.values()} | {catalog_config(n)["model_type"]
                                                                for n in catalog_names()}
    assert set(SUPPORTED_MODEL_TYPES) <= exercised


def test_kv_heads_default_to_heads_and_head_dim_to_hidden_over_heads():
    spec = resolve_model(VARIANTS["llama no kv key"])
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)
    wide = resolve_model(VARIANTS["llama tied, wide heads"])
    assert (wide.num_kv_heads, wide.head_dim, wide.kv_dim) == (1, 48, 48)


# --- live modules and config objects -------------------------------------------------------------------------------


def test_pretrained_model_gives_exact_tensors_and_config_numbers():
    torch, transformers = torch_and_transformers()
    config = transformers.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    spec = resolve_model(model)
    assert spec.source == "module" and spec.model_type == "llama"
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.num_params == resolve_model(config).num_params  # the config alone predicts the module
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    assert spec_rows(spec) == module_rows(model)


def test_plain_module_gives_params_only_with_tied_weights_once():
    torch, _ = torch_and_transformers()
    embed = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), head)
    spec = from_module(model)
    assert spec.num_params == 50 * 8 + 2 * (8 * 8 + 8) == sum(p.numel() for p in model.parameters())
    assert spec.model_type == "custom" and spec.num_layers == 0 and not spec.is_transformer
    assert ("*.weight", 64, 2) in {(p.name, p.numel, p.count) for p in spec.params}


def test_frozen_parameters_are_counted_and_reported():
    torch, _ = torch_and_transformers()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    spec = resolve_model(model, name="probe")
    assert spec.name == "probe" and spec.num_params == 20 + 10 and spec.extra["num_frozen_params"] == 20


def test_pretrained_model_without_a_memfit_layout_still_gives_exact_tensors():
    torch, transformers = torch_and_transformers()
    config = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=2,
                                    vocab_size=97, max_position_embeddings=64, word_embed_proj_dim=32)
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config)
    spec = resolve_model(model)
    assert spec.model_type == "opt" and spec.extra["layout_known"] is False
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads) == (2, 32, 4)


def test_pretrained_config_object_and_dict_resolve_alike():
    torch, transformers = torch_and_transformers()
    config = transformers.Qwen2Config(**TINY, num_key_value_heads=2)
    from_object = resolve_model(config)
    from_dict = resolve_model(config.to_dict())
    assert from_object.num_params == from_dict.num_params == sum(
        p.numel() for p in build_on_meta(dict(TINY, model_type="qwen2", num_key_value_heads=2)).parameters())
    gpt2 = resolve_model(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101))
    assert gpt2.hidden_size == 64 and gpt2.num_layers == 2


# --- config.json files and their errors ----------------------------------------------------------------------------


def write_config(folder, config) -> object:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return path


def test_config_json_path_and_folder(tmp_path):
    path = write_config(tmp_path / "my-llama", catalog_config("llama-3.2-1b"))
    by_file = resolve_model(str(path))
    by_folder = resolve_model(tmp_path / "my-llama")
    assert by_file.num_params == by_folder.num_params == 1_235_814_400
    assert by_file.name == "my-llama" and by_file.source == str(path)
    assert from_config_file(path, name="x").name == "x"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"model_type": "llama", "hidden_size": 64,', "not valid JSON"),
        ("[1, 2, 3]", "JSON object"),
        ('{"hidden_size": 64}', "'model_type'"),
    ],
)
def test_malformed_config_json_is_one_line(tmp_path, text, fragment):
    path = write_config(tmp_path / "bad", text)
    with pytest.raises(ModelSourceError, match=re.escape(fragment)) as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


def test_unreadable_config_path(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ModelSourceError, match="cannot read"):
        from_config_file(tmp_path / "absent.json")
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ModelSourceError, match="cannot read"):
        resolve_model(str(tmp_path / "empty-dir"))


def broken(**changes):
    config = dict(TINY, model_type="llama", num_key_value_heads=2)
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


@pytest.mark.parametrize(
    "config, fragment",
    [
        (broken(num_hidden_layers=...), "'num_hidden_layers' is missing"),
        (broken(vocab_size=...), "'vocab_size' is missing"),
        (broken(intermediate_size=...), "'intermediate_size' is missing"),
        (broken(hidden_size=-64), "'hidden_size' must be a positive whole number, got -64"),
        (broken(num_attention_heads=0), "'num_attention_heads' must be a positive whole number"),
        (broken(num_hidden_layers=2.5), "'num_hidden_layers' must be a positive whole number, got 2.5"),
        (broken(vocab_size=True), "'vocab_size' must be a positive whole number, got True"),
        (broken(num_key_value_heads=3), "'num_key_value_heads' (3) must divide 'num_attention_heads' (4)"),
        (broken(num_attention_heads=5, num_key_value_heads=5), "must divide 'hidden_size' (64)"),
        (broken(tie_word_embeddings="yes"), "'tie_word_embeddings' must be true or false"),
        (dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=5, vocab_size=10), "'n_head' (5) must divide 'n_embd'"),
        (dict(model_type="gpt2", n_embd=64, n_head=4, vocab_size=10), "'n_layer' is missing"),
    ],
)
def test_bad_numbers_name_the_key(config, fragment):
    with pytest.raises(ModelSourceError, match=re.escape(fragment)) as info:
        from_hf_config(config, name="bad", source="config.json")
    assert str(info.value).startswith("config.json: ") and "\n" not in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ModelSourceError) as info:
        from_hf_config(broken(hidden_size=-1, vocab_size=...), name="bad", source="x")
    assert "'hidden_size'" in str(info.value) and "'vocab_size'" in str(info.value)


def test_head_dim_given_lifts_the_divisibility_rule():
    spec = from_hf_config(broken(num_attention_heads=5, num_key_value_heads=5, head_dim=16), name="ok", source="x")
    assert spec.head_dim == 16


def test_unsupported_model_type_names_supported_ones_and_the_module_route():
    # a bare vision tower: transformers has no causal LM, masked LM or image classifier for it
    with pytest.raises(ModelSourceError) as info:
        resolve_model({"model_type": "clip_vision_model", "hidden_size": 768})
    message = str(info.value)
    assert "clip_vision_model" in message and "llama" in message and "gpt_neox" in message and "nn.Module" in message


def test_a_family_without_sdpa_still_gets_exact_parameters():
    """Parameters are read off copies built with eager attention: mamba (no attention) and gpt_oss (sinks) have
    no sdpa path in transformers, which `memfit plan` then defaults away from."""
    config = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 101}
    spec = resolve_model(config)
    assert spec.extra["supports_sdpa"] is False
    assert_matches_module(spec, build_on_meta(config))


def test_unresolvable_objects_and_empty_text():
    with pytest.raises(ModelSourceError, match="empty model reference"):
        resolve_model("  ")
    with pytest.raises(ModelSourceError, match="cannot read a model from a int"):
        resolve_model(42)


# --- the Hub ------------------------------------------------------------------------------------------------------


def test_hub_id_offline_fails_fast_naming_alternatives(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(ModelSourceError) as info:
        resolve_model("someone-else/Llama-3.1-8B-finetuned")
    message = str(info.value)
    assert time.monotonic() - started < 10
    assert "someone-else/Llama-3.1-8B-finetuned" in message and "offline" in message
    assert "'llama-3.1-8b'" in message and "local config.json" in message and "\n" not in message
    with pytest.raises(ModelSourceError, match="pass a catalog name .* or a local config.json path"):
        resolve_model("acme/widget-xyz")


# --- import hygiene -----------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_importing_and_resolving_from_the_catalog_imports_neither_torch_nor_transformers():
    code = ("import sys, memfit.sources as s; s.resolve_model('llama-3.1-8b'); s.catalog_entry('gpt2'); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.processes
def test_every_catalog_model_plans_without_torch():
    """Derived catalog models (Mixtral, DeepSeek, Gemma 3...) read their architecture numbers and parameters from
    the shipped derivation, so sizing one imports neither torch nor transformers (a CLI plan stays well under 1.5 s)."""
    code = ("import sys\nfrom memfit.sources import resolve_model\nfrom memfit.sources.catalog import catalog_names\n"
            "from memfit.estimate.analytic import estimate\nfrom memfit.hardware import make_hardware\n"
            "from memfit.setup import TrainingSetup\n"
            "from memfit.api import typical_setup\n"

            "hardware = make_hardware('H100')\n"
            "for name in catalog_names():\n"
            "    spec = resolve_model(name)\n"

            "    given = dict(micro_batch_size=1)\n"
            "    if spec.extra.get('supports_sdpa') is False:\n"
            "        given['attention'] = 'eager'  # gpt-oss: eager only\n"
            "    try:\n"
            "        setup = typical_setup(spec, hardware, **given)\n"
            "    except Exception:\n"
            "        setup = typical_setup(spec, hardware, target_len=128, **given)  # an encoder-decoder\n"
            "    estimate(spec, setup, hardware)\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
