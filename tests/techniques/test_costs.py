"""Each technique's typed Cost carries the numbers its ladder text shows, and memfit.throughput weighs exactly
those numbers; `plan --optimize` combines the values the registered techniques yield."""

from __future__ import annotations

import itertools

from memfit.errors import ConfigError
from memfit.estimate.comm import comm_volume
from memfit.hardware import make_hardware
from memfit.search import candidate_setups
from memfit.setup import Checkpointing, TrainingSetup
from memfit.sources import resolve_model
from memfit.techniques import REGISTRY
from memfit.techniques.base import SEARCH
from memfit.techniques.costs import checkpointing_cost, offload_cost, offload_traffic_bytes, zero_cost
from memfit.plan import plan
from memfit.throughput import relative_step_time, step_cost
from memfit.units import format_bytes

SPEC = resolve_model("llama-3.1-8b")
H100x8 = make_hardware("H100", gpus_per_node=8)


def test_the_step_cost_is_each_techniques_numbers():
    setup = TrainingSetup(precision="bf16-master", optimizer="adamw", checkpointing="full", sharding="zero3",
                          offload="optimizer", engine="deepspeed", num_gpus=8)
    cost = step_cost(SPEC, setup, H100x8)
    assert cost.recompute_fraction == 1 / 3  # one extra forward of three
    assert cost.wire_bytes == comm_volume(SPEC, setup).per_rank_bytes
    assert cost.host_link_bytes == offload_traffic_bytes(SPEC, setup) > 0
    assert cost.host_link_seconds == cost.host_link_bytes / (H100x8.gpu.host_link_gb_per_s * 1e9)
    assert cost.cpu_step_seconds > 0 and cost.step_time_factor == 1
    assert step_cost(SPEC, TrainingSetup(optimizer="adamw-8bit"), H100x8).step_time_factor == 1.01
    plain = step_cost(SPEC, TrainingSetup(), make_hardware("H100"))
    assert (plain.recompute_fraction, plain.wire_bytes, plain.host_link_bytes, plain.step_time_factor) == (0, 0, 0, 1)


def test_the_ladder_text_is_rendered_from_the_cost():
    setup = TrainingSetup(checkpointing="full", sharding="zero3", offload="optimizer", engine="deepspeed", num_gpus=8)
    zero = zero_cost(SPEC, setup)
    assert zero.text.startswith(f"{format_bytes(zero.wire_bytes)} per rank per step over the interconnect")
    offload = offload_cost(SPEC, setup, H100x8)
    assert offload.text.startswith(f"{format_bytes(offload.host_link_bytes)} over PCIe per step")
    assert f"~{offload.host_link_seconds:.2f} s" in offload.text
    assert checkpointing_cost(SPEC, setup).text.startswith("+33% compute")


def test_precision_and_attention_speed_are_their_techniques_costs():
    """fp32 (TF32 tensor cores at half the bf16 rate) and eager attention slow a step through their techniques'
    mfu_factor, the one number memfit.throughput reads for them."""
    h100 = make_hardware("H100")
    fast = TrainingSetup(precision="bf16", attention="sdpa")
    assert step_cost(SPEC, fast, h100).mfu_factor == 1
    assert step_cost(SPEC, fast.replace(precision="fp32", attention="eager"), h100).mfu_factor == 0.5 * 0.85
    time = relative_step_time(SPEC, fast, h100)
    assert relative_step_time(SPEC, fast.replace(precision="fp32"), h100) == 2 * time
    assert relative_step_time(SPEC, fast.replace(attention="eager"), h100) == time / 0.85


def test_each_rung_carries_its_typed_cost():
    """The ladder keeps each rung's typed Cost beside the text it prints (rendered from it): the full fine-tune on a
    24 GB card goes through pure bf16 and 8-bit AdamW (its step-time factor) to LoRA (a different method), then full
    checkpointing (one extra forward of three)."""
    result = plan(SPEC, TrainingSetup(micro_batch_size=1, seq_len=2048), make_hardware("RTX-4090", cpu_ram=64 * 2**30))
    steps = {s.technique: s for s in result.steps}
    assert all(s.cost == s.typed_cost.text for s in result.steps)
    assert steps["adam_8bit"].typed_cost.step_time_factor == 1.01
    assert steps["lora"].typed_cost.new_method and not steps["adam_8bit"].typed_cost.new_method
    assert list(steps) == ["mixed_precision", "adam_8bit", "lora", "checkpointing"]
    assert steps["checkpointing"].typed_cost.recompute_fraction == 1 / 3


def test_optimize_combines_the_values_the_searched_techniques_yield():
    setup, hardware = TrainingSetup(micro_batch_size=4), make_hardware("A100-80GB")
    values = {}
    for key in SEARCH:
        values.update(REGISTRY[key].search_values(setup, hardware))
    assert set(values) == {"precision", "optimizer", "checkpointing", "micro_batch_size", "sharding", "offload",
                           "engine", "attention"}
    assert values["checkpointing"] == list(Checkpointing) and values["micro_batch_size"] == [1, 2, 4]
    found = set(candidate_setups(setup, hardware))
    assert found and all(c.micro_batch_size * c.grad_accum_steps == 4 for c in found)
    accepted = set()
    for combo in itertools.product(*values.values()):
        fields = dict(zip(values, combo))
        try:
            accepted.add(setup.replace(**fields, grad_accum_steps=4 // fields["micro_batch_size"], num_gpus=1))
        except ConfigError:  # TrainingSetup refuses the combination
            continue
    assert found == accepted
