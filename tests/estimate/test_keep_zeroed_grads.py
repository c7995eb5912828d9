"""zero_grad(set_to_none=False): gradients zeroed and kept between steps (torch < 2.0's default) live through the
next forward, as under accumulation; checked against measured CPU steps."""

import json

import pytest

from memfit.errors import ConfigError
from memfit.setup import TrainingSetup
from tiny_configs import TINY_BERT


def test_kept_gradients_are_in_the_measured_peak(tmp_path):
    """Tiny BERT fp32, eager attention: the second step starts with the first one's gradients, zeroed; the
    estimate is the measured peak within 0.5%, a whole P x 4 B above the freed-gradients step."""
    pytest.importorskip("torch")
    from memfit._torch.step import build_hf_model
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.measure import measure
    from memfit.sources import resolve_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_BERT))
    spec, hw = resolve_model(str(path)), make_hardware(cpu_device(64 * 1024**3))
    setup = TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=64, optimizer="adamw", attention="eager",
                          keep_zeroed_grads=True)
    predicted = estimate(spec, setup, hw)
    measured = measure(build_hf_model(TINY_BERT, setup), setup, steps=2)
    assert abs(predicted.tensor_bytes - measured.tensor_bytes) <= 0.005 * measured.tensor_bytes
    freed = estimate(spec, setup.replace(keep_zeroed_grads=False), hw)
    assert predicted.tensor_bytes - freed.tensor_bytes == spec.num_params * 4
    with pytest.raises(ConfigError, match="keep_zeroed_grads must be true or false"):
        TrainingSetup(keep_zeroed_grads="yes")
