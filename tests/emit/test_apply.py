"""apply_(): each item of a setup really changes the live model (checked by its behaviour, not only its flags), a
second apply says so, and a planned setup brings a measured step under a budget the original step exceeds."""

from __future__ import annotations

import types

import pytest

from memfit import ConfigError, TrainingSetup
from tiny_configs import TINY_CONFIGS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit._torch.master import MasterWeightsOptimizer  # noqa: E402
from memfit._torch.step import build_hf_model, hf_checkpointing_is_on, make_batch, training_step  # noqa: E402
from memfit.apply import apply_  # noqa: E402
from memfit.measure import measure  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(torch_cpu):
    """One intra-op thread: on a loaded 2-core runner, OpenMP's spinning threads make tiny steps 10x slower."""


BASE = TrainingSetup(micro_batch_size=2, seq_len=32, precision="fp32", optimizer="adamw")


def _forward_calls_per_step(model, block, setup, batches) -> int:
    calls = []
    handle = block.register_forward_pre_hook(lambda module, args: calls.append(1))
    training_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, setup)
    handle.remove()
    return len(calls)


def test_hf_checkpointing_really_recomputes_and_a_second_apply_says_already_on():
    model = build_hf_model(TINY_CONFIGS["llama"], BASE)
    batch = make_batch(TINY_CONFIGS["llama"], BASE)
    layer = model.model.layers[0].mlp  # inner modules run again when the layer is recomputed
    assert _forward_calls_per_step(model, layer, BASE, batch) == 1
    applied = apply_(model, BASE.replace(checkpointing="full"))
    assert applied["checkpointing"].changed and hf_checkpointing_is_on(model)
    assert _forward_calls_per_step(model, layer, BASE, batch) == 2  # once in forward, once recomputed in backward
    again = apply_(model, BASE.replace(checkpointing="full"))
    assert not again["checkpointing"].changed and "already on" in again["checkpointing"].detail
    off = apply_(model, BASE)
    assert off["checkpointing"].changed and not hf_checkpointing_is_on(model)


def test_plain_module_blocks_are_wrapped_in_checkpoint_without_changing_the_result(make_plain_lm):
    model = make_plain_lm()
    batch = make_batch({"vocab_size": 512}, BASE)
    expected = model(**batch).item()
    applied = apply_(model, BASE.replace(checkpointing="full"))
    change = applied["checkpointing"]
    assert change.changed and "4 blocks of 'blocks'" in change.detail
    assert model(**batch).item() == expected
    assert sorted(model.state_dict()) == sorted(make_plain_lm().state_dict())  # keys untouched
    assert _forward_calls_per_step(model, model.blocks[0].mlp, BASE, batch) == 2
    again = apply_(model, BASE.replace(checkpointing="full"))
    assert not again["checkpointing"].changed and "already on" in again["checkpointing"].detail
    assert apply_(model, BASE)["checkpointing"].changed
    assert _forward_calls_per_step(model, model.blocks[0].mlp, BASE, batch) == 1


def test_plain_module_without_a_module_list_is_told_why(make_plain_lm):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    change = apply_(model, BASE.replace(checkpointing="full"))["checkpointing"]
    assert not change.changed and change.detail.startswith("not applicable")
    attention = apply_(make_plain_lm(), BASE)["attention"]
    assert not attention.changed and attention.detail.startswith("not applicable")


def test_attention_implementation_is_switched_on_hf_models():
    model = build_hf_model(TINY_CONFIGS["llama"], BASE.replace(attention="eager"))
    applied = apply_(model, BASE)
    assert applied["attention"].changed and model.config._attn_implementation == "sdpa"
    assert apply_(model, BASE)["attention"].detail == "already sdpa"


def test_adamw_8bit_factory_builds_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    model = build_hf_model(TINY_CONFIGS["llama"], BASE)
    applied = apply_(model, BASE.replace(optimizer="adamw-8bit"))
    assert isinstance(applied.make_optimizer(model), bnb.optim.AdamW8bit)
    assert "AdamW8bit" in applied["optimizer"].detail and not applied["optimizer"].changed


def test_bf16_casts_parameters_and_bf16_master_keeps_fp32_masters():
    model = build_hf_model(TINY_CONFIGS["llama"], BASE)
    applied = apply_(model, BASE.replace(precision="bf16"))
    assert applied["precision"].changed and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not apply_(model, BASE.replace(precision="bf16"))["precision"].changed
    master = apply_(model, BASE.replace(precision="bf16-master"))
    optimizer = master.make_optimizer(model)
    assert isinstance(optimizer, MasterWeightsOptimizer)
    assert {p.dtype for p in optimizer.master_params} == {torch.float32}
    assert apply_(model, BASE)["precision"].changed and {p.dtype for p in model.parameters()} == {torch.float32}


def test_amp_leaves_weights_fp32_and_hands_back_autocast():
    model = build_hf_model(TINY_CONFIGS["llama"], BASE)
    applied = apply_(model, types.SimpleNamespace(final_setup=BASE.replace(precision="amp-bf16")))  # a Plan-like
    assert not applied["precision"].changed and "autocast" in applied["precision"].detail
    with applied.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with apply_(model, BASE).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


def test_every_item_is_reported_and_engines_are_not_pretended():
    model = build_hf_model(TINY_CONFIGS["llama"], BASE)
    applied = apply_(model, BASE.replace(sharding="zero3", num_gpus=8, micro_batch_size=1, grad_accum_steps=4))
    names = [c.name for c in applied.changes]
    assert names == ["precision", "attention", "checkpointing", "optimizer", "batching", "engine"]
    assert all(c.detail for c in applied.changes)
    assert not applied["engine"].changed and "zero3" in applied["engine"].detail
    assert (applied.micro_batch_size, applied.grad_accum_steps) == (1, 4)
    assert "gradient_accumulation_steps=4" in applied["batching"].detail
    with pytest.raises(ConfigError):
        apply_(model, "fp32")


# ------------------------------------------------------------------------------------ proof that the plan works


def _train(model, optimizer, batches, setup, num_steps: int = 10) -> list[float]:
    return [training_step(model, optimizer, batches, setup) for _ in range(num_steps)]


def test_planned_setup_brings_a_real_hf_step_under_the_budget_and_still_learns():
    from memfit import as_spec
    from memfit.hardware import cpu_device, make_hardware
    from memfit.plan import plan

    config = TINY_CONFIGS["llama"]
    original = TrainingSetup(micro_batch_size=8, seq_len=128, precision="fp32", optimizer="adamw")
    model = build_hf_model(config, original)
    before = measure(model, original)
    budget = int(0.6 * before.total_bytes)
    the_plan = plan(as_spec(dict(config)), original, make_hardware(cpu_device(budget)))
    assert the_plan.fits, the_plan.to_dict()["skipped"]
    applied = apply_(model, the_plan)
    setup = applied.setup
    assert "checkpointing" in applied.changed
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch(config, setup, generator=generator) for _ in range(setup.grad_accum_steps)]
    optimizer = applied.make_optimizer(model)
    after = measure(model, setup, batches=batches, optimizer=optimizer)
    assert before.total_bytes > budget > after.total_bytes
    losses = _train(model, optimizer, batches, setup)
    assert losses[-1] < losses[0] - 0.5


def test_traced_plan_brings_a_plain_pytorch_step_under_the_budget_and_still_learns(make_plain_lm):
    # A plain module has no architecture for the analytic model: the planner sizes each rung with a trace instead.
    from memfit.hardware import cpu_device, make_hardware
    from memfit.plan import plan
    from memfit.sources import from_module
    from memfit.trace import traced_estimator

    model = make_plain_lm()
    original = TrainingSetup(micro_batch_size=8, seq_len=128, precision="fp32", optimizer="adamw")
    before = measure(model, original, batches=make_batch({"vocab_size": 512}, original))
    budget = int(0.6 * before.total_bytes)
    estimator = traced_estimator(make_plain_lm, input_builder=lambda s: make_batch({"vocab_size": 512}, s),
                                 loss_fn=lambda m, batch: m(**batch))
    the_plan = plan(from_module(model), original, make_hardware(cpu_device(budget)), estimator=estimator)
    assert the_plan.fits and not the_plan.initial_diagnosis.fits
    applied = apply_(model, the_plan)
    setup = applied.setup
    assert applied.changed  # at least one real change (checkpointing wraps the blocks; batching re-chunks)
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch({"vocab_size": 512}, setup, generator=generator) for _ in range(setup.grad_accum_steps)]
    optimizer = applied.make_optimizer(model)
    after = measure(model, setup, batches=batches, optimizer=optimizer)
    assert before.total_bytes > budget > after.total_bytes
    assert abs(after.total_bytes - the_plan.final_estimate.tensor_bytes) <= 0.05 * after.total_bytes
    losses = _train(model, optimizer, batches, setup)
    assert losses[-1] < losses[0] - 0.5


def test_one_block_finder_and_one_checkpoint_wrapper_for_apply_the_engines_and_the_trace(make_plain_lm):
    """memfit._torch.blocks is the only finder: apply_, FSDP2's units (engine.transformer_blocks), the tracer's units
    and checkpointing (trace.session, trace.hf) all get the same modules; the engines checkpoint with apply_'s
    wrapper, which leaves state_dict keys as they are (torch's checkpoint_wrapper renamed them)."""
    from torch import nn

    from memfit._torch import blocks, engine
    from memfit.trace import hf, session

    plain = make_plain_lm()
    assert blocks.find_blocks(plain) == list(plain.blocks)  # the ModuleList of 4 blocks, not the MLPs inside them
    llama = build_hf_model(TINY_CONFIGS["llama"], BASE)
    assert blocks.find_blocks(llama) == list(llama.model.layers)  # _no_split_modules: LlamaDecoderLayer
    stages = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)))
    assert blocks.find_blocks(stages) == list(stages)
    assert blocks.find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))) == []  # leaves only
    for model in (plain, llama, stages):
        assert session.repeated_blocks(model) == engine.transformer_blocks(model) == blocks.find_blocks(model)
    assert hf.block_finder(llama) == blocks.find_blocks(llama)

    keys = sorted(plain.state_dict())
    engine._prepare_precision_and_checkpointing(plain, BASE.replace(checkpointing="full"))
    assert all(blocks.is_checkpointed(block) for block in plain.blocks) and sorted(plain.state_dict()) == keys
    assert not apply_(plain, BASE.replace(checkpointing="full"))["checkpointing"].changed  # the same wrapper
    fresh = make_plain_lm()
    assert session.checkpoint_repeated_blocks(fresh) == 4 and all(blocks.is_checkpointed(b) for b in fresh.blocks)
    batch = make_batch({"vocab_size": 512}, BASE)
    assert _forward_calls_per_step(fresh, fresh.blocks[0].mlp, BASE, batch) == 2  # recomputed in backward
