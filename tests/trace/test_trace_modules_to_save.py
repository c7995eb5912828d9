"""peft's modules_to_save on fake tensors: peft deep-copies each saved module, and a deep copy of a fake tensor
lands in a new FakeTensorMode, so the trace used to stop with 'Mixing fake modes'. The trace builds under the session's
_FakeDeepcopy (one fake mode) and equals the real CPU step; it runs under FSDP2 too, on a derived family (Phi)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tiny_derived_configs import DERIVED_CONFIGS, QV_TARGETS  # noqa: E402

from memfit import TrainingSetup  # noqa: E402
from memfit.finetune import Finetune, Method  # noqa: E402
from memfit.trace import trace  # noqa: E402


STEP = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from tiny_configs import TINY_CONFIGS
from memfit import TrainingSetup
from memfit._torch.step import build_hf_model
from memfit.finetune import Finetune, Method
from memfit.measure import measure
from memfit.trace import trace
setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="amp-bf16", optimizer="adamw",
                      finetune=Finetune(method=Method.LORA, rank=4, targets=("q_proj", "v_proj"),
                                        modules_to_save=("lm_head",)))
traced = trace(TINY_CONFIGS["llama"], setup, kernels="cpu").tensor_bytes
torch.manual_seed(0)
measured = measure(build_hf_model(TINY_CONFIGS["llama"], setup), setup, steps=2).tensor_bytes
print(json.dumps([traced, measured]))
"""


@pytest.mark.processes
def test_a_trace_with_modules_to_save_equals_the_real_step():
    """In a process of its own: the profiled real step after a fake-tensor trace with deep-copied fake modules
    segfaulted inside the pytest process (in its assertion rewriter or on exit, outside memfit), never in a
    plain one."""
    done = subprocess.run([sys.executable, "-c", STEP, str(Path(__file__).resolve().parents[1])],
                          capture_output=True, text=True, timeout=600, check=True)
    traced, measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert abs(traced - measured) / measured <= 0.005, (traced, measured)


def test_modules_to_save_trace_under_fsdp2_on_a_derived_family():
    ft = Finetune(method=Method.LORA, targets=QV_TARGETS["phi"], modules_to_save=("lm_head",))
    plain = Finetune(method=Method.LORA, targets=QV_TARGETS["phi"])
    common = dict(micro_batch_size=2, seq_len=16, sharding="zero3", num_gpus=2, engine="torch")
    saved = trace(dict(DERIVED_CONFIGS["phi"]), TrainingSetup(finetune=ft, **common))
    base = trace(dict(DERIVED_CONFIGS["phi"]), TrainingSetup(finetune=plain, **common))
    assert saved.tensor_bytes > base.tensor_bytes  # the trainable head copy, its gradient and AdamW states
