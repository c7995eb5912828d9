"""The seed's framework: while static memory alone (parameters, gradients, optimizer states, the CUDA context) is over
the budget, no activation saving can make the step fit, so the ladder takes static rungs first and passes the
activation rungs over with that reason (one rule, in memfit.ladder via techniques.base.static_over_budget)."""

from __future__ import annotations

from memfit.hardware import make_hardware
from memfit.plan import plan
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from memfit.techniques import REGISTRY
from memfit.diagnose import static_floor_bytes
from memfit.techniques.base import STATIC_OVER
from memfit.units import format_bytes

ACTIVATION_RUNGS = {k for k, t in REGISTRY.items() if not t.cuts_static}


def _first_activation_step(result) -> int:
    return next((i for i, s in enumerate(result.steps) if s.technique in ACTIVATION_RUNGS), len(result.steps))


def test_the_activation_rungs_are_the_ones_that_cut_no_static_memory():
    assert ACTIVATION_RUNGS == {"checkpointing", "micro_batch", "flash_attention", "fused_loss", "activation_offload",
                                "compile"}


def test_a_70b_model_on_one_80gb_gpu_takes_static_rungs_first():
    # 2 TiB of host RAM: the optimizer-state offload rung can run, so the seed's static rungs alone bring it under
    spec, hw = resolve_model("llama-3.1-70b"), make_hardware("A100-80GB", cpu_ram="2TiB")
    result = plan(spec, TrainingSetup(), hw)
    budget = result.initial_diagnosis.budget_bytes
    assert static_floor_bytes(result.initial_estimate) > 10 * budget  # ~70.6e9 parameters, fp32 master + states
    first = _first_activation_step(result)
    assert [s.technique for s in result.steps[:first]] == ["mixed_precision", "adam_8bit", "cpu_offload"]
    assert static_floor_bytes(result.steps[first - 1].estimate) < budget  # the activation rungs open only now
    assert result.fits and result.steps[first].technique == "checkpointing"
    skipped = dict(result.skipped)
    # passed over while static memory was 8-bit AdamW's, before the offload: the reason quotes that figure
    floor = format_bytes(static_floor_bytes(result.steps[1].estimate))
    for title in ("smaller micro-batch + gradient accumulation", "chunked / fused cross-entropy",
                  "activation offloading to the CPU"):
        assert skipped[title] == (f"{STATIC_OVER} ({floor} of {format_bytes(budget)} usable): no activation saving "
                                  "could make the step fit")


def test_no_activation_rung_when_static_memory_never_fits():
    # a full fine-tune (LoRA pinned off), 256 GiB of host RAM (no offload), one GPU (no ZeRO): nothing shrinks
    # static memory under the budget, so no activation rung is taken nor suggested
    spec, hw = resolve_model("llama-3.1-70b"), make_hardware("A100-80GB", cpu_ram="256GiB")
    result = plan(spec, TrainingSetup(), hw, keep=frozenset({"finetune"}))
    assert not result.fits and result.steps
    assert all(REGISTRY[s.technique].cuts_static for s in result.steps)
    assert static_floor_bytes(result.final_estimate) > result.final_diagnosis.budget_bytes
    assert {t for t, r in result.skipped if r.startswith(STATIC_OVER)} == {
        REGISTRY[k].title for k in ACTIVATION_RUNGS}
    assert not any(s.startswith(("a shorter sequence", "gradient checkpointing:")) for s in result.suggestions)
    assert len([s for s in result.suggestions if s.startswith("more GPUs: it fits on")]) == 1
    walked = result.more_gpus.setup  # the walk on more GPUs: ZeRO-3, then the activation rungs
    assert (walked.sharding.value, walked.checkpointing.value) == ("zero3", "full")


def test_a_static_rung_that_grows_activations_is_still_progress():
    # QLoRA's fp32 residual stream (prepare_model_for_kbit_training) grows activations, yet it is the rung that
    # brings static memory under the budget: measured on static memory, it is taken
    spec, hw = resolve_model("llama-3.1-70b"), make_hardware("A100-80GB", cpu_ram="256GiB")
    result = plan(spec, TrainingSetup(), hw)
    keys = [s.technique for s in result.steps]
    assert keys[:4] == ["mixed_precision", "adam_8bit", "lora", "qlora"] and result.fits
    lora, qlora = result.steps[2], result.steps[3]
    assert qlora.diagnosis.required_bytes > lora.diagnosis.required_bytes
    assert static_floor_bytes(qlora.estimate) < qlora.diagnosis.budget_bytes < static_floor_bytes(lora.estimate)
