"""Chunked / fused loss and the optimizer step in backward: formulas against real measured CPU steps, the trace
against the measured step, the ladder's rungs, the emitted TrainingArguments and the CLI.

The fused loss is measured on memfit's pure-torch reference of Liger's fused linear cross-entropy
(memfit._torch.step.FusedLinearCrossEntropy): Liger's Triton kernel does not run on a CPU.
"""

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.finetune import Finetune  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import Loss, TrainingSetup  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

torch = pytest.importorskip("torch")
from memfit.measure import measure  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))


def setup_of(**changes) -> TrainingSetup:
    base = dict(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw")
    return TrainingSetup(**{**base, **changes})


# One case of each technique against a real measured step (bench/loss_inbwd.py runs the full matrix, 23 cases):
# (family, setup changes, tolerance). 1% where the formulas model every tensor at the peak; 3% for an amp-bf16 moment
# that is the peak once the loss no longer is (block 0's recompute under checkpointing).
ACCURACY = [
    ("llama", dict(loss="chunked"), 0.01),
    ("qwen2", dict(loss="fused", optimizer_in_backward=True, checkpointing="full"), 0.01),
    ("llama", dict(loss="chunked", precision="amp-bf16", checkpointing="full"), 0.03),
    ("qwen2", dict(optimizer_in_backward=True, precision="amp-bf16"), 0.01),
    ("qwen2", dict(loss="chunked", finetune=Finetune(method="lora", rank=8)), 0.01),
]


@pytest.mark.parametrize("family,changes,tolerance", ACCURACY,
                         ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in c.items())}".replace(" ", "")
                              for f, c, _ in ACCURACY])
def test_formulas_match_the_measured_step(family, changes, tolerance):
    setup = setup_of(**changes)
    measured = measure(TINY_CONFIGS[family], setup, steps=2)
    predicted = estimate(resolve_model(TINY_CONFIGS[family]), setup, CPU)
    error = (predicted.tensor_bytes - measured.tensor_bytes) / measured.tensor_bytes
    assert abs(error) < tolerance, (f"predicted {predicted.tensor_bytes:,} vs measured {measured.tensor_bytes:,} "
                                    f"({100 * error:+.2f}%)")


@pytest.mark.parametrize("family,changes", [("llama", dict(loss="fused", precision="amp-bf16")),
                                            ("llama", dict(loss="chunked", precision="amp-bf16", checkpointing="full")),
                                            ("qwen2", dict(loss="fused", precision="amp-bf16", checkpointing="full"))],
                         ids=["llama-fused-amp", "llama-chunked-amp-ckpt", "qwen2-fused-amp-ckpt"])
def test_amp_moments_match_the_trace(family, changes):
    """The CUDA side: the trace with CUDA's kernel choices against the estimate for a CUDA device. (A CPU trace also
    counts the CPU's promotion copies of mixed-dtype elementwise ops, memfit.trace.kernels: 65 KB more in the fused
    loss's forward under autocast here, which a CUDA kernel never makes and the formulas do not carry.)"""
    from memfit.hardware import make_hardware
    from memfit.trace import trace

    setup = setup_of(**changes)
    traced = trace(copy.deepcopy(TINY_CONFIGS[family]), setup, kernels="cuda").tensor_bytes
    predicted = estimate(resolve_model(TINY_CONFIGS[family]), setup, make_hardware("A100-80GB")).tensor_bytes
    assert abs(predicted - traced) <= 0.02 * traced, (predicted, traced)


def test_the_chunked_and_fused_losses_equal_the_standard_one():
    from memfit._torch import step as torch_step

    setup = setup_of(seq_len=32)
    torch.manual_seed(0)
    model = torch_step.build_hf_model(TINY_CONFIGS["llama"], setup)
    batch = torch_step.make_batch(TINY_CONFIGS["llama"], setup)
    batch["labels"][0, 3:7] = -100
    results = {}
    for name, loss_fn in (("standard", torch_step.default_loss), ("chunked", torch_step.chunked_loss),
                          ("fused", torch_step.fused_loss)):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        results[name] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    for name in ("chunked", "fused"):
        assert results[name][0] == pytest.approx(results["standard"][0], rel=1e-5)
        for got, want in zip(results[name][1], results["standard"][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_optimizer_in_backward_steps_like_the_optimizer_after_it():
    from memfit._torch import step as torch_step

    setups = (setup_of(seq_len=32), setup_of(seq_len=32, optimizer_in_backward=True))
    weights = []
    for setup in setups:
        torch.manual_seed(0)
        model = torch_step.build_hf_model(TINY_CONFIGS["llama"], setup)
        optimizer = torch_step.make_optimizer(model, setup)
        batch = torch_step.make_batch(TINY_CONFIGS["llama"], setup, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            torch_step.training_step(model, optimizer, batch, setup)
        assert all(p.grad is None for p in model.parameters())
        weights.append([p.detach().clone() for p in model.parameters()])
    for after, inside in zip(*weights):
        torch.testing.assert_close(inside, after, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("changes", [dict(loss="chunked"), dict(loss="fused"), dict(optimizer_in_backward=True),
                                     dict(loss="chunked", optimizer_in_backward=True, checkpointing="full")],
                         ids=["chunked", "fused", "in-backward", "chunked-in-backward-ckpt"])
def test_the_trace_equals_the_measured_step(changes):
    from memfit.trace import trace

    setup = setup_of(**changes)
    traced = trace(copy.deepcopy(TINY_CONFIGS["llama"]), setup, kernels="cpu")
    measured = measure(TINY_CONFIGS["llama"], setup, steps=2)
    # within tests/trace/test_trace.py's tolerance (0.5%): fake tensors miss a few small CPU allocations
    # (the chunked loss: its 8 label-chunk copies, 2 KiB here)
    assert abs(traced.tensor_bytes - measured.tensor_bytes) <= 0.005 * measured.tensor_bytes, (
        traced.tensor_bytes, measured.tensor_bytes)


def test_what_cannot_combine_is_one_line():
    for changes, words in ((dict(grad_accum_steps=2), "accum 1"), (dict(precision="amp-fp16"), "GradScaler"),
                           (dict(sharding="zero2", num_gpus=2), "one GPU")):
        with pytest.raises(ConfigError, match=words):
            setup_of(optimizer_in_backward=True, **changes)
    with pytest.raises(ConfigError, match="not sized yet"):
        setup_of(loss="fused", finetune="lora")
    with pytest.raises(ConfigError, match="causal LMs"):
        estimate(resolve_model(TINY_CONFIGS["bert"]), setup_of(loss="chunked"), CPU)
    assert Loss.parse("liger") is Loss.FUSED and Loss.parse("torchtune") is Loss.CHUNKED


def test_clipping_is_refused_in_the_loop():
    from memfit._torch import step as torch_step

    setup = setup_of(seq_len=16, optimizer_in_backward=True)
    model = torch_step.build_hf_model(TINY_CONFIGS["llama"], setup)
    optimizer = torch_step.make_optimizer(model, setup)
    batch = torch_step.make_batch(TINY_CONFIGS["llama"], setup)
    with pytest.raises(ConfigError, match="clipping"):
        torch_step.training_step(model, optimizer, batch, setup, hooks=torch_step.EngineHooks(max_grad_norm=1.0))


def test_the_formulas_shrink_what_they_should():
    spec = resolve_model("llama-3.1-8b")
    hw = make_hardware("H100-80GB")
    base = TrainingSetup(micro_batch_size=4, seq_len=4096, precision="bf16", optimizer="adamw",
                         checkpointing="full")
    sizes = {loss: estimate(spec, base.replace(loss=loss), hw).tensor_bytes for loss in ("standard", "chunked",
                                                                                         "fused")}
    assert sizes["fused"] <= sizes["chunked"] < sizes["standard"]
    static = TrainingSetup(micro_batch_size=1, seq_len=512, precision="bf16", optimizer="adamw")
    plain, inside = (estimate(spec, static.replace(optimizer_in_backward=flag), hw) for flag in (False, True))
    assert inside.tensor_bytes < plain.tensor_bytes
    assert not any(t.name == "gradients" for t in inside.terms)


def test_the_ladder_takes_the_loss_rung_after_flash_attention():
    from memfit.plan import plan
    from memfit.techniques import LADDERS
    from memfit.diagnose import Bottleneck

    assert LADDERS[Bottleneck.ACTIVATIONS].index("fused_loss") > LADDERS[Bottleneck.ACTIVATIONS].index(
        "flash_attention")
    assert LADDERS[Bottleneck.STATIC].index("optimizer_in_backward") < LADDERS[Bottleneck.STATIC].index("zero")
    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=4, seq_len=4096, precision="bf16", optimizer="adamw-8bit",
                          checkpointing="full")
    from memfit.cli.options import gpu

    keep = frozenset({"micro_batch_size", "seq_len", "precision", "optimizer"})
    result = plan(spec, setup, make_hardware(gpu("52GiB")), keep=keep)
    techniques = [s.technique for s in result.steps]
    assert "fused_loss" in techniques, techniques
    assert result.final_setup.loss is not Loss.STANDARD


def test_emitted_kwargs_are_accepted_by_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memfit.emit.hf_trainer import hf_trainer_file, hf_trainer_kwargs

    fused = setup_of(loss="fused", precision="amp-bf16")
    kwargs = hf_trainer_kwargs(fused)
    assert kwargs["use_liger_kernel"] is True
    args = transformers.TrainingArguments(output_dir=str(tmp_path), **{**kwargs, "bf16": False})
    assert args.use_liger_kernel is True
    notes = " ".join(hf_trainer_file(setup_of(loss="chunked", optimizer_in_backward=True)).notes)
    assert "CEWithChunkedOutputLoss" in notes and "optimizer_in_bwd" in notes
    assert "use_liger_kernel" not in hf_trainer_kwargs(setup_of(loss="chunked"))


def test_cli_options_show_in_the_plan_and_its_json():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["plan", "llama-3.2-1b", "--loss", "fused", "--optimizer-in-backward", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["initial_setup"]["loss"] == "fused" and data["initial_setup"]["optimizer_in_backward"] is True
    chunked = json.loads(runner.invoke(app, ["plan", "llama-3.2-1b", "--loss", "chunked", "--json"]).output)
    assert chunked["initial_setup"]["loss"] == "chunked"
    for bad in (["--loss", "bogus"], ["--optimizer-in-backward", "--accum", "4"]):
        result = runner.invoke(app, ["plan", "llama-3.2-1b", *bad])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_fused_loss_with_lora_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="fused loss with lora is not sized yet") as info:
        setup_of(loss="fused", finetune=Finetune(method="lora", rank=8))
    assert "\n" not in str(info.value)
