"""Paged (bitsandbytes) and low-bit (torchao, bitsandbytes Lion) optimizers: state bytes against the libraries' real
state tensors, the paged states outside the allocator's figures, and the TrainingArguments names."""

import warnings

import pytest

from memfit.estimate.analytic import estimate
from memfit.estimate.static import full_static, paged_state_bytes
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import Optimizer, TrainingSetup
from memfit.sources import resolve_model

torch = pytest.importorskip("torch")


def _model():
    # 512x512 (>= 1e5 elements: paged), 300x256 (>= 4096, not a multiple of 128: torchao keeps it full), small ones
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(256, 300, bias=False),
                               torch.nn.Linear(300, 40), torch.nn.LayerNorm(40))


def _state_bytes(opt) -> int:
    """Every distinct storage the optimizer's state holds (torchao subclasses: their inner tensors)."""
    storages = {}

    def add(t):
        inner = getattr(t, "tensor_attrs", None)
        if inner:
            for name in inner:
                add(getattr(t, name))
            return
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                add(value)
    return sum(storages.values())


def _one_step(model, opt):
    x = torch.randn(3, 512)
    out = model[3](model[2](model[1](model[0](x)[:, :256])))
    out.sum().backward()
    opt.step()


@pytest.mark.parametrize("name", ["paged-adamw-8bit", "paged-adamw", "lion-8bit", "lion", "adamw-8bit"])
def test_bitsandbytes_state_bytes_match_the_real_state(name):
    pytest.importorskip("bitsandbytes")
    from memfit._torch.step import make_optimizer
    from memfit.sources import from_module

    model = _model()
    setup = TrainingSetup(precision="fp32", optimizer=name)
    opt = make_optimizer(model, setup)
    _one_step(model, opt)
    assert full_static(from_module(model), setup).states_bytes == _state_bytes(opt)
    if setup.optimizer.is_paged:  # on CPU bitsandbytes falls back to ordinary tensors, and make_optimizer says so
        assert any("unpaged equivalent" in n for n in opt.memfit_notes)


@pytest.mark.parametrize("name", ["adamw-ao-8bit", "adamw-4bit", "adamw-fp8"])
def test_torchao_state_bytes_match_the_real_state(name, monkeypatch):
    pytest.importorskip("torchao")
    from memfit._torch.step import make_optimizer
    from memfit.sources import from_module

    model = _model()
    setup = TrainingSetup(precision="fp32", optimizer=name)
    opt = make_optimizer(model, setup)
    # the step eager instead of torch.compile'd (seconds per optimizer on CPU): the same state tensors
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _one_step(model, opt)
    assert full_static(from_module(model), setup).states_bytes == _state_bytes(opt)


def test_low_bit_fractions_of_adamw():
    spec = resolve_model("llama-3.2-1b")
    full = full_static(spec, TrainingSetup(precision="fp32", optimizer="adamw")).states_bytes
    per = {o: full_static(spec, TrainingSetup(precision="fp32", optimizer=o)).states_bytes / full
           for o in ("adamw-8bit", "adamw-ao-8bit", "adamw-fp8", "adamw-4bit", "lion-8bit", "lion")}
    assert per["adamw-8bit"] == pytest.approx(0.254, abs=0.002)  # 2 x (1 + 4/256) / 8
    assert per["adamw-ao-8bit"] == pytest.approx(0.254, abs=0.002)
    assert per["adamw-fp8"] == pytest.approx(0.254, abs=0.002)
    assert per["adamw-4bit"] == pytest.approx(0.133, abs=0.002)  # 2 x (0.5 + 4/128) / 8
    assert per["lion-8bit"] == pytest.approx(0.127, abs=0.002)
    assert per["lion"] == pytest.approx(0.5, abs=0.001)


def test_paged_states_are_outside_allocated_and_reserved():
    spec = resolve_model("llama-3.2-1b")
    hw = make_hardware("A100-80GB")
    base = TrainingSetup(micro_batch_size=1, seq_len=512, precision="bf16")
    plain = estimate(spec, base.replace(optimizer="adamw-8bit"), hw)
    paged = estimate(spec, base.replace(optimizer="paged-adamw-8bit"), hw)
    term = next(t for t in paged.terms if t.name == "optimizer/paged_states")
    assert term.device_figure == "outside" and "evict" in term.formula
    assert term.num_bytes == paged_state_bytes(spec, base.replace(optimizer="paged-adamw-8bit")) > 0
    # the same bytes in all: the paged part leaves allocated / reserved and shows up outside the allocator
    assert paged.allocated_bytes == pytest.approx(plain.allocated_bytes - term.num_bytes, abs=64 * 2**20)
    assert paged.reserved_bytes < plain.reserved_bytes - term.num_bytes + 64 * 2**20
    assert paged.outside_allocator_bytes == plain.outside_allocator_bytes + term.num_bytes
    assert paged.tensor_bytes == plain.tensor_bytes - term.num_bytes
    assert any("unified memory" in n for n in paged.notes)
    # on a CPU device bitsandbytes does not page: the states are ordinary tensors
    cpu = estimate(spec, base.replace(optimizer="paged-adamw-8bit"), make_hardware(cpu_device(64 * 2**30)))
    assert not any(t.name == "optimizer/paged_states" for t in cpu.terms)


def test_paged_32bit_states_are_fp32_whatever_the_params():
    spec = resolve_model("llama-3.2-1b")
    bf16 = full_static(spec, TrainingSetup(precision="bf16", optimizer="paged-adamw")).states_bytes
    assert bf16 == 8 * spec.num_params  # bitsandbytes 32-bit states: fp32 even for bf16 parameters


@pytest.mark.parametrize("name,optim", [("paged-adamw-8bit", "paged_adamw_8bit"), ("paged-adamw", "paged_adamw_32bit"),
                                        ("adamw-ao-8bit", "adamw_torch_8bit"), ("adamw-4bit", "adamw_torch_4bit"),
                                        ("lion-8bit", "lion_8bit"), ("lion", "lion_32bit")])
def test_emitted_optim_names_are_accepted_by_training_arguments(name, optim, tmp_path):
    transformers = pytest.importorskip("transformers")
    from memfit.emit.hf_trainer import hf_trainer_kwargs
    from memfit.readers.hf import OPTIMIZERS

    setup = TrainingSetup(precision="fp32", optimizer=name)
    kwargs = hf_trainer_kwargs(setup)
    kwargs = getattr(kwargs, "content", kwargs)
    assert kwargs["optim"] == optim
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim=optim, report_to=[], use_cpu=True)
    assert str(getattr(args.optim, "value", args.optim)) == optim
    assert OPTIMIZERS[optim] is Optimizer.parse(name)  # and read back to the same optimizer


def test_old_alias_no_longer_folds_paged_into_unpaged():
    assert Optimizer.parse("paged-adamw-8bit") is Optimizer.PAGED_ADAMW_8BIT
    assert Optimizer.parse("adamw-torch-4bit") is Optimizer.ADAMW_4BIT
    with pytest.raises(Exception):
        TrainingSetup(optimizer="adamw-4bit", offload="optimizer", sharding="zero2", num_gpus=2)


def test_paged_states_do_not_decide_the_out_of_memory_verdict():
    """Paged states sit on the device while there is room and are evicted to host RAM when a device allocation needs
    it (that is what paging is for): device used shows them, the verdict does not count them."""
    from memfit.diagnose import diagnose
    from memfit.estimate.analytic import estimate
    from memfit.hardware import make_hardware
    from memfit.setup import TrainingSetup
    from memfit.sources import resolve_model

    spec, hw = resolve_model("llama-3.2-1b"), make_hardware("L4")
    setup = TrainingSetup(micro_batch_size=4, seq_len=2048, precision="bf16", checkpointing="full")
    paged = estimate(spec, setup.replace(optimizer="paged-adamw-8bit"), hw)
    plain = estimate(spec, setup.replace(optimizer="adamw-8bit"), hw)
    states = sum(t.num_bytes for t in paged.terms if t.name == "optimizer/paged_states")
    assert states > 2 * 2**30 and paged.device_used_bytes > paged.reserved_bytes + states - 1
    verdict = diagnose(paged, hw)
    assert verdict.evictable_bytes == states
    assert verdict.required_bytes == paged.reserved_bytes + paged.outside_allocator_bytes - states
    assert verdict.required_bytes < diagnose(plain, hw).required_bytes
    assert "paged to host RAM" in verdict.summary()
