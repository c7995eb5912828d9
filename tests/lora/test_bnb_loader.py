"""What transformers' bitsandbytes loader really packs, for every family memfit has a graph of and every catalog
family it sizes by derived fits: the 4-bit quantizer's own `_process_model_before_weight_loading` (its
modules_to_not_convert: get_keys_to_not_convert and the model's _keep_in_fp32_modules, then replace_with_bnb_linear,
which converts a module whose type is exactly nn.Linear or Conv1D) run on the meta-device model, against the weights
memfit's QLoRA formulas size as 4-bit (memfit.estimate.lora._quantizable_weights) and the Linears memfit's torch side
quantizes for a measured or traced step (memfit._torch.lora.unpacked_linears)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from memfit.errors import ConfigError
from memfit.estimate.lora import _quantizable_weights, adapted_spec
from memfit.finetune import Finetune
from memfit.graph import graph_from_config
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from test_graph import TINY, _INDEX, build_on_meta

pytest.importorskip("bitsandbytes")

DERIVED = {  # catalog families with no graph builder (sized by memfit.derive): tiny configs of each
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=256),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=256),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        max_position_embeddings=256, n_group=1, topk_group=1),
}


def _packed_by_transformers(model) -> set[str]:
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True))._process_model_before_weight_loading(model,
                                                                                                   device_map=None)
    return {_INDEX.sub("*", f"{name}.weight") for name, module in model.named_modules()
            if type(module).__name__ == "Linear4bit"}


def _packed_by_memfits_torch_side(model) -> set[str]:
    from torch import nn

    from memfit._torch.lora import unpacked_linears

    kept = set(map(id, unpacked_linears(model)))
    return {_INDEX.sub("*", f"{name}.weight") for name, module in model.named_modules()
            if type(module) is nn.Linear and id(module) not in kept}


@pytest.mark.parametrize("label", sorted(TINY))
def test_the_weights_sized_as_4bit_are_those_transformers_packs(label):
    config = TINY[label]
    packed = _packed_by_transformers(build_on_meta(copy.deepcopy(config)))
    sized = {_INDEX.sub("*", name) for name in _quantizable_weights(graph_from_config(copy.deepcopy(config)))}
    assert sized == packed


@pytest.mark.parametrize("label", sorted(k for k, c in {**TINY, **DERIVED}.items() if c["model_type"] != "gpt2"))
def test_the_torch_side_quantizes_what_transformers_packs(label):
    # gpt2 apart: its Conv1D projections are packed by transformers and left 16-bit by memfit's torch side
    config = {**TINY, **DERIVED}[label]
    assert _packed_by_memfits_torch_side(build_on_meta(copy.deepcopy(config))) == \
        _packed_by_transformers(build_on_meta(copy.deepcopy(config)))


def test_falcon_keeps_its_block_projections_16_bit():
    # modeling_falcon.py's FalconLinear subclasses nn.Linear: the loader's `type(module) is nn.Linear` skips it
    assert not _packed_by_transformers(build_on_meta(TINY["falcon"]))


def test_t5_keeps_wo_16_bit_and_memfit_sizes_it_so():
    # T5PreTrainedModel._keep_in_fp32_modules = ["wo"] joins the quantizer's modules_to_not_convert
    packed = _packed_by_transformers(build_on_meta(copy.deepcopy(TINY["t5"])))
    assert packed and not any(name.endswith(".wo.weight") for name in packed)
    setup = TrainingSetup(precision="bf16", finetune=Finetune(method="qlora", targets=("q", "v"), kbit_prep=False))
    spec = adapted_spec(replace(resolve_model(copy.deepcopy(TINY["t5"])), derived=None), setup)  # the graph's bytes
    wo = [p for p in spec.frozen if p.name.endswith(".wo.weight")]
    assert wo and all(p.nbytes == 2 * p.numel for p in wo)  # bf16, as loaded
    with pytest.raises(ConfigError, match="memfit.derive.stacks"):  # its stacked fits have no adapters yet: one line
        adapted_spec(resolve_model(copy.deepcopy(TINY["t5"])), setup)


def test_a_biased_classifier_is_packed():
    # get_keys_to_not_convert keeps "the last module" by its last parameter's name minus ".weight": a classifier's
    # bias names no module, so ViT's classifier is converted
    assert "classifier.weight" in _packed_by_transformers(build_on_meta(copy.deepcopy(TINY["vit"])))
    assert "classifier.weight" in _quantizable_weights(graph_from_config(copy.deepcopy(TINY["vit"])))
