"""Sequence classification (BertForSequenceClassification, LlamaForSequenceClassification): the graph's parameters
against the real HF module's, and the formulas and the trace against real measured CPU steps of tiny classifiers."""

from __future__ import annotations

import pytest

from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.sources.task import task_config, with_task
from tiny_configs import TINY_BERT, TINY_LLAMA

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from memfit.measure import measure  # noqa: E402
from memfit.trace import trace  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))
TINY = {"bert": TINY_BERT, "llama": TINY_LLAMA}


def _hf_classifier(config: dict):
    values = dict(config)
    model_type = values.pop("model_type")
    values.pop("architectures")
    with torch.device("meta"):
        return transformers.AutoModelForSequenceClassification.from_config(
            transformers.AutoConfig.for_model(model_type, **values))


@pytest.mark.parametrize("config", [TINY_BERT, TINY_LLAMA, "bert-large-uncased"],
                         ids=["tiny-bert", "tiny-llama", "bert-large"])
def test_parameters_are_the_real_classifiers(config):
    spec = with_task(resolve_model(config), "sequence-classification", 3)
    model = _hf_classifier(task_config(spec.graph.config, 3))
    assert type(model).__name__.endswith("ForSequenceClassification") and spec.num_labels == 3
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    names = {n for n, _ in model.named_parameters()}
    assert {"classifier.weight", "score.weight"} & names and not any("lm_head" in n or "cls." in n for n in names)
    assert spec.auto_class == "AutoModelForSequenceClassification"


def test_bert_large_two_labels_is_the_published_count():
    # the HF one-GPU doc's BERT-large classifier (shared/gpu-published P003: 335,143,938 parameters, meta-built)
    spec = with_task(resolve_model("bert-large-uncased"), "sequence-classification", 2)
    assert spec.num_params == 335_143_938 and not spec.is_decoder


CASES = [("bert", "fp32", "none"), ("llama", "amp-bf16", "full")]
"""Two of the 8 family x precision x checkpointing cases (bench/seq_classification.py measures all of them, at two
shapes): both families, both precisions, with and without checkpointing."""


@pytest.mark.parametrize("family,precision,checkpointing", CASES, ids=["-".join(c) for c in CASES])
def test_formulas_and_trace_match_a_measured_step(family, precision, checkpointing):
    config = task_config(TINY[family], 2)
    setup = TrainingSetup(micro_batch_size=4, seq_len=128, precision=precision, checkpointing=checkpointing,
                          optimizer="adamw", attention="sdpa")
    measured = measure(config, setup, steps=2).tensor_bytes
    predicted = estimate(resolve_model(config), setup, CPU).tensor_bytes
    # Llama amp-bf16 + full: the recomputed block's moment is 3.0% high (oneDNN's bf16 matmul scratch, in the measured
    # peak on CPUs with native bf16 until it became its own overhead term, hid it); bench/seq_classification.py has the
    # BERT fp32 + full rows at +3.3% (the block's checkpointed backward, as on BertForMaskedLM)
    tolerance = 0.035 if (family, precision, checkpointing) == ("llama", "amp-bf16", "full") else 0.02
    assert abs(predicted - measured) <= tolerance * measured, f"formulas {predicted:,} vs measured {measured:,}"
    # the trace on CPU kernels is the measured step's tensor peak (oneDNN's bf16 matmul scratch, which depends on the
    # CPU's instruction set, is the measurement's own overhead term, not in tensor_bytes)
    traced = trace(config, setup, kernels="cpu").tensor_bytes
    assert abs(traced - measured) <= 0.005 * measured, f"trace {traced:,} vs measured {measured:,}"


def test_no_vocabulary_logits_for_a_classifier():
    spec = with_task(resolve_model("bert-large-uncased"), "sequence-classification", 2)
    setup = TrainingSetup(micro_batch_size=4, seq_len=512, precision="fp32")
    est, mlm = estimate(spec, setup, make_hardware("A100-80GB")), estimate(resolve_model("bert-large-uncased"),
                                                                           setup, make_hardware("A100-80GB"))
    logits = {t.name: t.num_bytes for t in estimate(spec, setup, CPU).terms}
    assert logits.get("activations/logits", 0) <= 4 * 2 * 4  # B x num_labels x 4 B
    assert est.total_bytes < mlm.total_bytes


def test_bad_task_input_is_one_clear_error():
    with pytest.raises(ConfigError, match="sequence classification is modelled for"):
        with_task(resolve_model("gpt2"), "sequence-classification", 2)
    with pytest.raises(ConfigError, match="--num-labels"):
        with_task(resolve_model("bert-base-uncased"), "sequence-classification", 0)
    spec = with_task(resolve_model("llama-3.2-1b"), "sequence-classification", 2)
    with pytest.raises(ConfigError, match="not sized with LoRA"):
        estimate(spec, TrainingSetup(finetune="lora"), make_hardware("A100-80GB"))
