"""The analytic estimate against real measured training steps (profiler memory events on CPU).

Tolerances from the issue: total peak within 5%, and static (parameters + gradients + optimizer) and activation
(activations + temporaries) memory each within 10% at the peak. bench/accuracy.py prints the full matrix.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from accuracy_cases import FAST, make_setup  # noqa: E402
from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.sources import resolve_model  # noqa: E402

pytest.importorskip("torch")
from memfit.measure import measure  # noqa: E402

CPU = make_hardware(cpu_device(64 * 1024**3))


@pytest.mark.parametrize("family,overrides", FAST, ids=[f"{f}-{'-'.join(map(str, o.values())) or 'base'}"
                                                        for f, o in FAST])
def test_analytic_matches_measured_step(family, overrides):
    config = TINY_CONFIGS[family]
    setup = make_setup(overrides)
    measured = measure(config, setup, steps=2)
    predicted = estimate(resolve_model(config), setup, CPU)

    assert predicted.total_bytes == predicted.tensor_bytes  # a CPU device has no runtime overhead term
    error = (predicted.tensor_bytes - measured.tensor_bytes) / measured.tensor_bytes
    assert abs(error) < 0.05, f"total: predicted {predicted.tensor_bytes:,} vs measured {measured.tensor_bytes:,}"
    for name, pred, meas in (("static", predicted.static_bytes, measured.static_bytes),
                             ("activations", predicted.activation_bytes, measured.activation_bytes)):
        assert abs(pred - meas) <= 0.10 * meas + 64 * 1024, f"{name}: predicted {pred:,} vs measured {meas:,}"
