"""What the page's updates keep between plans must move no number: the catalog spec read once per name
(memfit.serve.core._catalog_spec), saved_problem per graph (memfit.estimate.activations) and the hardware-free
part of an estimate per frozen arguments (memfit.estimate.analytic._kept_step, reused on other GPUs of the same
count). Each case is planned with every cache empty, then again, in a shuffled order, after the other cases (the
same setups on other GPUs, counts and methods) have filled them, and the two page answers are compared whole."""

from __future__ import annotations

import random

import pytest

from memfit.estimate import activations, analytic
from memfit.estimate.analytic import estimate
from memfit.hardware import Hardware, get_gpu
from memfit.serve import core
from memfit.sources import resolve_model
from memfit.errors import ConfigError
from memfit.setup import Loss, Sharding, TrainingSetup

BASE = {"model": "llama-3.1-8b", "batch": "4", "seq": "2048"}
CASES = [
    {**BASE, "gpu": gpu} for gpu in ("A100-80GB", "H100-80GB", "RTX-4090", "L4", "A10G", "L40S")  # one setup, 6 GPUs
] + [
    {**BASE, "gpu": "A100-80GB", "gpus": "8"},                                        # same setup, 8 GPUs: ZeRO
    {**BASE, "gpu": "A100-80GB", "gpus": "8", "zero": "zero3", "offload": "optimizer"},
    {**BASE, "gpu": "H100-80GB", "gpus": "8", "zero": "zero3"},
    {**BASE, "gpu": "RTX-4090", "method": "lora"},
    {**BASE, "gpu": "L4", "method": "lora"},
    {**BASE, "gpu": "RTX-4090", "method": "qlora", "seq": "4096"},
    {**BASE, "gpu": "RTX-4090", "checkpointing": "full"},
    {**BASE, "gpu": "A100-80GB", "gpus": "2", "pp": "2"},                               # pipelined: not kept
    {"model": "mixtral-8x7b", "gpu": "H100-80GB", "gpus": "8", "method": "qlora"},     # MoE: its routing dict
    {"model": "mixtral-8x7b", "gpu": "A100-80GB", "gpus": "8", "method": "qlora"},
    {"model": "gemma-2-9b", "gpu": "L40S", "batch": "2"},
    {"model": "gemma-2-9b", "gpu": "A100-80GB", "batch": "2"},
    {"model": "gpt2", "gpu": "T4", "batch": "8"},                                      # no bf16: fp16
    {"model": "t5-base", "gpu": "RTX-4090", "batch": "8", "target_len": "128"},  # encoder-decoder stacks
    {"model": "t5-base", "gpu": "A10G", "batch": "8", "target_len": "128"},
]


def _forget() -> None:
    core._catalog_spec.cache_clear()
    analytic._steps.clear()
    activations._PROBLEMS.clear()


@pytest.fixture(scope="module")
def fresh() -> list[dict]:
    answers = []
    for values in CASES:
        _forget()
        answers.append(core.plan_page(values))
    return answers


def test_a_kept_answer_is_the_fresh_one(fresh):
    _forget()
    order = list(range(len(CASES)))
    random.Random(22).shuffle(order)
    for i in order:
        assert core.plan_page(CASES[i]) == fresh[i], CASES[i]
    assert len(analytic._steps) > 0 and len(activations._PROBLEMS) > 0  # the caches were used


def test_the_same_setup_on_another_gpu_reuses_its_tensors_and_sizes_its_runtime():
    """The second GPU adds no kept step (it is found) and its estimate equals a fresh one: its own cuBLAS
    workspace (Hopper's is larger), device name and allocator figures, the same tensors."""
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=2, seq_len=1024)
    first = estimate(spec, setup, Hardware(get_gpu("A100-80GB")))
    for gpu in ("H100-80GB", "RTX-4090", "L4"):
        hardware = Hardware(get_gpu(gpu))
        kept = len(analytic._steps)
        again = estimate(spec, setup, hardware)
        assert len(analytic._steps) == kept
        assert again.to_dict() == estimate(resolve_model("llama-3.1-8b"), setup, hardware).to_dict()
        assert again.device_name == gpu
        tensors = [t for t in again.terms if t.category.value != "overhead"]
        assert tensors == [t for t in first.terms if t.category.value != "overhead"]


def test_a_kept_estimate_is_not_shared():
    """Two estimates from one kept step do not share what a caller could change (phase peaks, the MoE dict)."""
    spec = resolve_model("mixtral-8x7b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=512)
    one = estimate(spec, setup, Hardware(get_gpu("H100-80GB")))
    two = estimate(spec, setup, Hardware(get_gpu("H200")))
    assert one.phase_peaks == two.phase_peaks and one.phase_peaks is not two.phase_peaks
    assert one.moe == two.moe and (one.moe is None or one.moe is not two.moe)


def test_a_refusal_is_not_kept():
    """A setup the estimator refuses (a fused loss on a model with final logit softcapping) is refused again."""
    spec = resolve_model("gemma-2-9b")
    for _ in range(2):
        with pytest.raises(ConfigError, match="softcapping"):
            estimate(spec, TrainingSetup(loss=Loss.FUSED), Hardware(get_gpu("L4")))


def test_the_gpu_count_is_part_of_what_is_kept():
    """A ZeRO-3 setup sized on the hardware's GPU count (memfit.estimate.analytic: the world size wins over the
    setup's num_gpus): 8 GPUs, then 2, each equal to a fresh estimate."""
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(sharding=Sharding.ZERO3, num_gpus=8)
    for count in (8, 2):
        hardware = Hardware(get_gpu("A100-80GB"), gpus_per_node=count)
        assert estimate(spec, setup, hardware).to_dict() == \
            estimate(resolve_model("llama-3.1-8b"), setup, hardware).to_dict()
