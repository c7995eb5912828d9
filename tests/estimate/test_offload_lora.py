"""Activation offloading (torchtune OffloadActivations) with LoRA / QLoRA: the formulas' offloaded, host, weight and
kept bytes against what the very hooks pack on real tiny peft steps (memfit.estimate.offload_lora), and the
combination planned on a full-size model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_activation_offload import packed_on_a_real_step, setup_of  # noqa: E402
from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate import lora, offload_activations  # noqa: E402
from memfit.estimate.analytic import estimate, forward_activation_terms  # noqa: E402
from memfit.finetune import Finetune  # noqa: E402
from memfit.hardware import make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
import memfit.techniques  # noqa: E402,F401  (registers the technique sections: activation_offload)
from memfit.sources import resolve_model  # noqa: E402

pytest.importorskip("peft")

QV = dict(method="lora", rank=4)
ALL = dict(method="lora", rank=4, dropout=0.1, targets=("all-linear",))
CASES = [("llama", "fp32", "none", QV), ("llama", "bf16", "none", ALL), ("llama", "amp-bf16", "none", QV),
         ("llama", "amp-bf16", "none", dict(QV, base="fp32")), ("llama", "amp-bf16", "full", ALL),
         ("qwen2", "amp-bf16", "none", ALL), ("gpt2", "fp32", "none", ALL)]
QLORA = [("llama", "amp-bf16", "none", dict(method="qlora", rank=4, dropout=0.1, targets=("all-linear",))),
         ("mistral", "fp32", "none", dict(method="qlora", rank=4))]


def predicted(family: str, setup: TrainingSetup) -> offload_activations.OffloadSizes:
    spec = lora.adapted_spec(resolve_model(TINY_CONFIGS[family]), setup)
    return offload_activations.sizes(spec, setup, forward_activation_terms(spec, setup, on_cpu=True))


def _check(family, precision, checkpointing, ft):
    setup = setup_of(precision=precision, checkpointing=checkpointing, finetune=Finetune(**ft))
    counts, sizes = packed_on_a_real_step(family, setup), predicted(family, setup)
    assert sizes.offloaded_bytes == counts.offloaded_bytes
    assert sizes.host_bytes == counts.packed_bytes
    assert sizes.weight_bytes == counts.weight_packed_bytes
    assert 0 <= counts.kept_bytes - sizes.kept_bytes <= 64, (counts.kept_bytes, sizes.kept_bytes)


@pytest.mark.parametrize("family,precision,checkpointing,ft", CASES,
                         ids=[f"{f}-{p}-{c}-{'all' if 'targets' in t else 'qv'}-{t.get('base', 'auto')}"
                              for f, p, c, t in CASES])
def test_lora_packs_are_what_the_hooks_count(family, precision, checkpointing, ft):
    _check(family, precision, checkpointing, ft)


@pytest.mark.parametrize("family,precision,checkpointing,ft", QLORA, ids=[f"{f}-{p}" for f, p, _, _ in QLORA])
def test_qlora_packs_are_what_the_hooks_count(family, precision, checkpointing, ft):
    """bitsandbytes' MatMul4Bit keeps the packed weight as a ctx attribute: a 4-bit base packs no weight."""
    pytest.importorskip("bitsandbytes")
    _check(family, precision, checkpointing, ft)


def test_lora_with_offload_plans_on_a_gpu():
    spec = resolve_model("llama-3.2-3b")
    hw = make_hardware("a100-80gb")
    for method in ("lora", "qlora"):
        base = TrainingSetup(micro_batch_size=2, seq_len=4096, precision="bf16", checkpointing="none",
                             finetune=Finetune(method=method, rank=64, alpha=128, targets=("all-linear",)))
        plain, offloaded = estimate(spec, base, hw), estimate(spec, base.replace(activation_offload=True), hw)
        assert offloaded.cpu_bytes > 10 * 1024**3 and offloaded.total_bytes < plain.total_bytes - 10 * 1024**3


def test_what_it_does_not_size_says_so():
    for ft in (dict(QV, base="int8"), dict(QV, dora=True), dict(QV, modules_to_save=("lm_head",))):
        with pytest.raises(ConfigError, match="activation offloading with lora is sized for adapters"):
            setup_of(finetune=Finetune(**ft))
