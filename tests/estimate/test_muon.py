"""torch.optim.Muon on the blocks' matrices + AdamW on the rest (memfit.estimate.muon, memfit._torch.muon): the
states against the real optimizers' tensors, the step against the trace (dispatch-level, what a CUDA step allocates)
where the step is the peak, the whole step against a real measured CPU step, and the refused combinations."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import TINY_CONFIGS  # noqa: E402

torch = pytest.importorskip("torch")
if not hasattr(torch.optim, "Muon"):
    pytest.skip("torch.optim.Muon needs torch 2.9 or later", allow_module_level=True)

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.estimate.static import full_static  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_states_equal_the_real_muon_and_adamw_states(family, precision):
    from memfit._torch.step import build_hf_model, make_optimizer

    setup = TrainingSetup(micro_batch_size=1, seq_len=4, precision=precision, optimizer="muon")
    model = build_hf_model(TINY_CONFIGS[family], setup)
    optimizer = make_optimizer(model, setup)
    muon, adamw = optimizer.parts
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])  # the blocks' matrices only
    assert type(muon).__name__ == "Muon" and type(adamw).__name__ == "AdamW"
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    real = sum(v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))
    assert full_static(resolve_model(TINY_CONFIGS[family]), setup).states_bytes == real


@pytest.mark.parametrize("family,precision", [("gpt2", "bf16"), ("llama", "fp32")])
def test_the_step_peak_equals_the_trace_where_the_step_is_the_peak(family, precision):
    """B=1 x 4 tokens: the Newton-Schulz step (or AdamW's group temporary) is the step's largest moment. The trace
    counts what each op allocates (CUDA's view: cuBLAS works in its own workspace); CPU bf16 GEMMs also allocate
    oneDNN scratch inside the kernel (34-100 KB per matmul on these shapes), which a CPU step shows on top."""
    from memfit.trace import trace

    setup = TrainingSetup(micro_batch_size=1, seq_len=4, precision=precision, optimizer="muon")
    traced = trace(TINY_CONFIGS[family], setup, kernels="cpu")
    predicted = estimate(resolve_model(TINY_CONFIGS[family]), setup, CPU)
    assert abs(predicted.tensor_bytes / traced.tensor_bytes - 1) < 0.001


def test_a_measured_training_step_agrees():
    from memfit.measure import measure

    setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="amp-bf16", optimizer="muon")
    measured = measure(TINY_CONFIGS["llama"], setup, steps=2)
    predicted = estimate(resolve_model(TINY_CONFIGS["llama"]), setup, CPU)
    assert abs(predicted.tensor_bytes / measured.tensor_bytes - 1) < 0.02
    assert measured.term("optimizer").num_bytes == full_static(resolve_model(TINY_CONFIGS["llama"]),
                                                                setup).states_bytes


@pytest.mark.parametrize("changes, message", [
    ({"sharding": "zero3", "num_gpus": 2}, "without sharding"),
    ({"precision": "bf16-master"}, "master copy"),
    ({"finetune": {"method": "lora"}}, "muon with lora"),
])
def test_combinations_muon_is_not_sized_for_are_one_line_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainingSetup(optimizer="muon", **changes)


def test_the_cli_plans_muon_and_the_hf_emitter_says_how_to_build_it():
    import json

    from typer.testing import CliRunner

    from memfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "llama-3.2-1b", "--optimizer", "muon", "--gpu", "A100-80GB",
                                      "--precision", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    terms = {t["name"]: t["bytes"] for t in plan["initial_estimate"]["terms"]}
    spec = resolve_model("llama-3.2-1b")
    assert terms["optimizer/states"] == full_static(spec, TrainingSetup(optimizer="muon", precision="bf16")).states_bytes
    from memfit.emit.hf_trainer import hf_trainer_file

    emitted = hf_trainer_file(TrainingSetup(optimizer="muon", precision="bf16"))
    assert any("make_optimizer(model)" in note and "optimizers=(optimizer, None)" in note for note in emitted.notes)
    bad = CliRunner().invoke(app, ["plan", "llama-3.2-1b", "--optimizer", "muon", "--zero", "zero3", "--gpus", "2"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output and "muon" in bad.output
