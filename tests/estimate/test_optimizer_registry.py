"""memfit.optimizers: one record per optimizer, checked against the libraries themselves (each record's class is
the one its library exports, builds with memfit's arguments, and keeps the number of states it declares), against
transformers' own list of `optim` names, and against every --optimizer value."""

import pytest

torch = pytest.importorskip("torch")

from memfit.optimizers import BY_NAME, KINDS, config_class_names, hf_optim_names  # noqa: E402
from memfit.setup import Optimizer  # noqa: E402


def test_every_optimizer_has_exactly_one_record():
    assert sorted(BY_NAME) == sorted(o.value for o in Optimizer) and len(KINDS) == len(BY_NAME)
    spellings = [s for k in KINDS for s in (k.name, *k.aliases)]
    assert len(spellings) == len(set(spellings))
    assert all(Optimizer.parse(alias) is Optimizer(k.name) for k in KINDS for alias in k.aliases)


def test_hf_optim_names_are_transformers_own():
    from transformers.training_args import OptimizerNames

    names = {n.value for n in OptimizerNames}
    assert {k.hf_optim for k in KINDS if k.hf_optim} <= names
    assert set(hf_optim_names()) <= names
    assert hf_optim_names()["adamw_torch"] == "adamw-foreach"  # torch's default on CUDA


def _importable(kind) -> bool:
    import importlib.util

    return importlib.util.find_spec(kind.library) is not None


@pytest.mark.parametrize("kind", [k for k in KINDS], ids=lambda k: k.name)
def test_record_builds_the_library_class_and_keeps_its_declared_states(kind):
    """Every record's class exists in its library and steps a real 2-D parameter on the CPU; the states it then
    holds per parameter are the ones the record declares (Adam 2, Lion / SGD 1; Adafactor's factored second
    moment: its row and column vectors and the RMS scalar, no first moment)."""
    import warnings

    if not _importable(kind):
        pytest.skip(f"{kind.library} is not installed")
    weight = torch.nn.Parameter(torch.randn(128, 64))  # >= 4096 elements: the 8-bit states are quantised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = kind.build([weight], 1e-3)
        weight.grad = torch.randn_like(weight)
        optimizer.step()
    assert type(optimizer).__name__ == kind.cls.rpartition(".")[2]
    state = optimizer.state[weight]
    full = [v for v in state.values() if torch.is_tensor(v) and v.numel() == weight.numel()]
    if kind.name == "adafactor":
        assert not full and {"exp_avg_sq_row", "exp_avg_sq_col"} <= set(state)
    else:
        assert len(full) == kind.states
        assert {_bits(v) for v in full} == {kind.state_bits}


def _bits(state) -> float:
    """Bits per element of a state tensor; torchao's quantised states are subclasses holding `codes` (two 4-bit
    codes per byte for AdamW4bit)."""
    codes = getattr(state, "codes", None)
    if codes is None:
        return state.element_size() * 8
    return codes.element_size() * 8 * codes.numel() / state.numel()


def test_config_class_names_cover_torchtune_spellings():
    names = config_class_names()
    assert names["bitsandbytes.optim.pagedadamw8bit"] == "paged-adamw-8bit"
    assert names["torchao.prototype.low_bit_optim.adamw4bit"] == "adamw-4bit"
    assert "torch.optim.adamw" not in names  # read with its foreach / fused flags by the torchtune reader


def test_emitted_call_is_python_that_builds_the_planned_optimizer():
    """`call()` is what the FSDP2 emitter writes, for every optimizer that can step FSDP2's parameters."""
    model = torch.nn.Linear(8, 8)
    for kind in KINDS:
        if not _importable(kind) or kind.fsdp2:
            continue
        namespace = {"model": model, "lr": 1e-3, "torch": torch}
        module = kind.cls.split(".")[0]
        exec(f"import {kind.cls.rpartition('.')[0]}\nopt = {kind.call()}", {**namespace, module: __import__(module)},
             namespace)
        assert type(namespace["opt"]).__name__ == kind.cls.rpartition(".")[2]
