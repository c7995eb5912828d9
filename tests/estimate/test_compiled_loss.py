"""The cross-entropy under torch.compile (memfit.estimate.compiled_loss): inductor's fused kernels measured on CPU
with the profiler, and the estimator's loss moments with it."""

from __future__ import annotations

import pytest

from memfit.estimate import compiled_loss
from memfit.estimate.analytic import estimate
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

from test_float8 import _peak_growth
from tiny_configs import TINY_LLAMA

torch = pytest.importorskip("torch")


def test_the_compiled_cross_entropy_keeps_8_bytes_per_token_and_writes_one_bf16_gradient():
    from memfit._torch.step import _compiled_cross_entropy

    batch, seq, vocab = 2, 256, 1024
    labels = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    pred = torch.randn(batch, seq, vocab, dtype=torch.bfloat16, requires_grad=True)
    loss_fn = _compiled_cross_entropy()
    loss_fn(pred, labels).backward()  # compile once
    pred.grad = None
    kept = {}
    forward = _peak_growth(lambda: kept.setdefault("loss", loss_fn(pred, labels)))
    backward = _peak_growth(lambda: kept["loss"].backward())
    tokens = batch * seq
    assert forward <= compiled_loss.STATS_BYTES_PER_TOKEN * tokens + 64  # two fp32 per token (+ the scalar loss)
    assert backward - 2 * tokens * vocab <= compiled_loss.STATS_BYTES_PER_TOKEN * tokens + 64  # the bf16 gradient only


def test_the_compiled_loss_drops_the_fp32_logits_and_keeps_the_bf16_ones():
    spec, hw = resolve_model("llama-3.2-1b"), make_hardware("H100-80GB")
    setup = TrainingSetup(micro_batch_size=8, seq_len=4096, precision="bf16", checkpointing="full")
    eager, fused = estimate(spec, setup, hw), estimate(spec, setup.replace(loss="compiled"), hw)
    tokens = 8 * 4096
    logits = spec.vocab_size * tokens
    assert eager.peak_phase.value == fused.peak_phase.value == "backward"
    assert fused.term("temporaries/loss_backward").num_bytes == 2 * logits  # its one bf16 gradient
    assert fused.term("activations/logits").num_bytes == 2 * logits  # kept for the compiled backward
    assert fused.term("activations/loss").num_bytes == (compiled_loss.STATS_BYTES_PER_TOKEN + 8) * tokens
    # eager: 4 B log-softmax + 8 B of gradients per logit at that moment, its bf16 logits already freed
    assert eager.tensor_bytes - fused.tensor_bytes == (4 + 8 - 2 - 2) * logits - compiled_loss.STATS_BYTES_PER_TOKEN * tokens
