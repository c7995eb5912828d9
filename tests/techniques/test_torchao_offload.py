"""torchao's CPUOffloadOptimizer (memfit.techniques.torchao_offload): setup validation, the emitted line, and real CPU
steps of torchao's own class whose buffers, sorted by identity into what it keeps on the device and what it mirrors on
the host, equal memfit's figures.

CPUOffloadOptimizer asserts a CUDA or XPU device and pins its host buffers. On a CPU-only machine the test runs its
unchanged code with torch.cuda's stream calls replaced by no-op stand-ins and `pin_memory` dropped from empty_like
(pinning and the side stream change where and when bytes live, not how many); every tensor is then in host memory,
so the comparison reads the wrapper's own maps (param_d2h_map, optim_dict, d_opt) as the rank meter reads DeepSpeed's.
"""

from __future__ import annotations

import contextlib

import pytest

from memfit.errors import ConfigError
from memfit.hardware import make_hardware
from memfit.techniques.costs import CPU_ADAM_PARAMS_PER_S
from memfit.throughput import step_cost
from memfit.techniques import torchao_offload
from memfit.estimate.static import full_static, shard
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model
from tiny_configs import TINY_LLAMA

SPEC = resolve_model(TINY_LLAMA)
BASE = TrainingSetup(micro_batch_size=2, seq_len=32, precision="amp-bf16", optimizer="adamw-fused")


def test_refuses_what_the_wrapper_does_not_run():
    for bad, match in ((dict(num_gpus=2), "single-GPU"), (dict(optimizer="adamw-8bit"), "torch.optim"),
                       (dict(precision="bf16-master"), "no fp32 master"),
                       (dict(grad_accum_steps=4, cpu_offload_optimizer="grads"), "does not accumulate")):
        with pytest.raises(ConfigError, match=match):
            BASE.replace(cpu_offload_optimizer=bad.pop("cpu_offload_optimizer", "on"), **bad)
    assert BASE.replace(cpu_offload_optimizer="on", grad_accum_steps=4).grad_accum_steps == 4


def test_cli_option_and_one_line_refusal():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["estimate", "llama-3-8b", "--gpu", "H100", "--batch", "1", "--seq", "512",
                                      "--cpu-offload-optimizer", "grads", "--gpus", "2"])
    assert result.exit_code == 2 and "single-GPU" in result.output and "Traceback" not in result.output


def test_emitted_line_builds_the_wrapper_memfit_sized():
    line = torchao_offload.code(BASE.replace(cpu_offload_optimizer="grads"))
    assert line.splitlines() == ["from torchao.optim import CPUOffloadOptimizer",
                                 "optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, "
                                 "offload_gradients=True, fused=True)"]


@contextlib.contextmanager
def _cpu_only_torchao(monkeypatch):
    """torchao's CPUOffloadOptimizer with its CUDA stream calls as no-ops and unpinned host buffers."""
    torch = pytest.importorskip("torch")
    cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")

    class Event:
        def synchronize(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

        def record_event(self):
            return Event()

        def synchronize(self):
            pass

    empty_like = torch.empty_like
    monkeypatch.setattr(cpu_offload, "get_available_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **{k: v for k, v in kw.items()
                                                                            if k != "pin_memory"}))
    yield torch, cpu_offload.CPUOffloadOptimizer


def _state_bytes(optimizers) -> int:
    """Every state tensor: exp_avg, exp_avg_sq and the scalar `step` counter of each parameter."""
    return sum(t.nbytes for opt in optimizers for st in opt.state.values() for t in st.values())


@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
@pytest.mark.parametrize("mode", ["on", "grads"])
def test_real_torchao_step_holds_what_memfit_says(monkeypatch, mode, precision):
    transformers = pytest.importorskip("transformers")
    with _cpu_only_torchao(monkeypatch) as (torch, CPUOffloadOptimizer):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                                                          if k != "model_type"}))
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=mode == "grads")
        live = [0]  # device gradient bytes alive, sampled after each parameter's hook (torchao's runs first)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: live.append(sum(
                q.grad.nbytes for q in model.parameters() if q.grad is not None)))
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32))
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "amp-bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        device_grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        opt.step()
        host = sum(h.nbytes + h.grad.nbytes for h in opt.param_d2h_map.values()) + _state_bytes(
            opt.optim_dict.values())
        device_states = _state_bytes([opt.d_opt] if opt.d_opt else [])
        mirrored = sum(h.nbytes for h in opt.param_d2h_map.values())

    setup = BASE.replace(precision=precision, cpu_offload_optimizer=mode)
    full = full_static(SPEC, setup)
    s = shard(SPEC, setup, full)
    assert host > 0 and s.cpu_bytes == host
    assert s.optimizer_bytes == device_states > 0
    assert s.params_bytes == sum(p.nbytes for p in model.parameters())
    if mode == "on":
        assert s.grads_bytes == device_grads == s.params_bytes
    else:  # the retained small tensors' gradients, plus one offloaded gradient in flight on a GPU's side stream
        largest = max(p.nbytes for p in model.parameters() if p.numel() >= torchao_offload.MINIMAL_SIZE)
        assert device_grads == max(live) == s.grads_bytes - largest
    # PCIe per step: each mirrored gradient down in backward, each mirrored parameter up after the CPU step; the
    # technique's typed Cost is what the throughput model adds up (and the ladder's rung prints)
    cost = step_cost(SPEC, setup, make_hardware("A100-80GB"))
    assert cost.host_link_bytes == torchao_offload.traffic_bytes(SPEC, setup) == 2 * mirrored
    assert cost.cpu_step_seconds == sum(h.numel() for h in opt.param_d2h_map.values()) / CPU_ADAM_PARAMS_PER_S
    assert full.step_temp_bytes == 0  # fused AdamW: no temporaries for the on-device small tensors


def test_hf_trainer_file_says_how_to_pass_the_wrapper():
    from memfit.emit.hf_trainer import hf_trainer_file

    emitted = hf_trainer_file(BASE.replace(cpu_offload_optimizer="on"))
    text = "\n".join(emitted.notes)
    assert "optimizers=(optimizer, None)" in text and torchao_offload.code(
        BASE.replace(cpu_offload_optimizer="on")) in text
    assert not any("CPUOffloadOptimizer" in n for n in hf_trainer_file(BASE).notes)


def test_ladder_takes_it_only_where_deepspeeds_candidates_cannot_be_taken():
    """Pure bf16 pinned by --keep: DeepSpeed's CPU Adam would need bf16-master, so the rung was passed over; the
    torchao candidate keeps bf16 and fits. Where a DeepSpeed candidate fits, it stays the rung's choice."""
    from memfit.hardware import make_hardware
    from memfit.plan import plan

    spec = resolve_model("llama-3-8b")
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, precision="bf16", optimizer="adamw-fused")
    asked = frozenset({"precision", "optimizer", "micro_batch_size", "seq_len"})  # as the CLI marks them
    pinned = plan(spec, setup, make_hardware("A100-40GB"), keep=frozenset({"precision"}), explicit=asked)
    step = next(s for s in pinned.steps if s.technique == "cpu_offload")
    assert step.setup.cpu_offload_optimizer.value == "grads" and step.setup.precision.value == "bf16"
    assert "CPUOffloadOptimizer" in step.change
    free = plan(spec, setup.replace(precision="amp-bf16"), make_hardware("A100-40GB"), explicit=asked)
    step = next(s for s in free.steps if s.technique == "cpu_offload")  # DeepSpeed's, as before
    assert step.setup.engine.value == "deepspeed" and step.setup.cpu_offload_optimizer.value == "off"


def test_torchtune_recipe_with_the_wrapper_reads_as_it(tmp_path):
    """torchtune's recipes take `optimizer._component_: torchao.optim.CPUOffloadOptimizer` (its docs' low-memory
    example): the reader sets the wrapper and its base optimizer, fused as torchao makes it."""
    from memfit.readers import read_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\ndtype: bf16\n"
                      "gradient_accumulation_steps: 1\noptimizer:\n  _component_: torchao.optim.CPUOffloadOptimizer\n"
                      "  optimizer_class: torch.optim.AdamW\n  offload_gradients: True\n  lr: 2e-5\n")
    fields = read_config(recipe).overrides
    assert fields["cpu_offload_optimizer"] == "grads" and fields["optimizer"].value == "adamw-fused"
    recipe.write_text(recipe.read_text().replace("torch.optim.AdamW", "torch.optim.SGD"))
    with pytest.raises(ConfigError, match="around torch.optim.AdamW"):
        read_config(recipe)


def test_apply_says_how_to_wrap_the_optimizer_it_sized():
    """Its runtime conversion runs with the optimizer's (memfit.techniques.convert): apply_ on a live model reports
    the wrapper line memfit sized, after the base optimizer's own line, and changes nothing on the model."""
    pytest.importorskip("transformers")
    from memfit._torch.step import build_hf_model
    from memfit.apply import apply_

    setup = BASE.replace(cpu_offload_optimizer="grads")
    changes = [c for c in apply_(build_hf_model(TINY_LLAMA, setup), setup).changes if c.name == "optimizer"]
    assert len(changes) == 2 and not any(c.changed for c in changes)
    assert changes[1].detail.endswith(torchao_offload.code(setup).replace("\n", "; "))
    assert len([c for c in apply_(build_hf_model(TINY_LLAMA, BASE), BASE).changes if c.name == "optimizer"]) == 1
