"""What transformers' bitsandbytes loader really packs, for every family memfit has a graph of: its own
replace_with_bnb_linear (which converts a module whose type is exactly nn.Linear or Conv1D) run on the meta-device
model, against the weights memfit's QLoRA formulas size as 4-bit (memfit.estimate.lora._quantizable_weights)."""

from __future__ import annotations

import pytest

from memfit.estimate.lora import _quantizable_weights
from memfit.graph import graph_from_config
from test_graph import TINY, _INDEX, build_on_meta

pytest.importorskip("bitsandbytes")

DECODERS = sorted(k for k, c in TINY.items() if c["model_type"] not in ("bert", "t5", "bart", "vit"))


def _packed_by_transformers(model) -> set[str]:
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model),
                            quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    return {_INDEX.sub("*", f"{name}.weight") for name, module in model.named_modules()
            if type(module).__name__ == "Linear4bit"}


@pytest.mark.parametrize("label", DECODERS)
def test_the_weights_sized_as_4bit_are_those_transformers_packs(label):
    config = TINY[label]
    packed = _packed_by_transformers(build_on_meta(config))
    sized = {_INDEX.sub("*", name) for name in _quantizable_weights(graph_from_config(config))}
    assert sized == packed


def test_falcon_keeps_its_block_projections_16_bit():
    # modeling_falcon.py's FalconLinear subclasses nn.Linear: the loader's `type(module) is nn.Linear` skips it
    assert not _packed_by_transformers(build_on_meta(TINY["falcon"]))
