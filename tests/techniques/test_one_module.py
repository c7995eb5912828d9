"""A technique is one module (issue 20): torchao's CPUOffloadOptimizer lives in memfit/techniques/torchao_offload.py
and one registry line imports it. No other source file names it, and memfit without that module (its import
replaced by an empty module, in a fresh interpreter) has no such field, option, --keep name or note, yet sizes and
plans every other setup to the same JSON answer, the field aside."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "memfit"
MODULE = SRC / "techniques" / "torchao_offload.py"
NAMES = re.compile(r"cpu_offload_optimizer|CpuOffloadOptimizer|CPUOffloadOptimizer|torchao_offload|cpu-offload-optim")


def test_no_other_source_file_names_it():
    found = [f"{path.relative_to(SRC)}:{n}: {line.strip()}" for path in sorted(SRC.rglob("*.py")) if path != MODULE
             for n, line in enumerate(path.read_text().splitlines(), 1) if NAMES.search(line)]
    assert found == ["techniques/__init__.py:6: from . import torchao_offload  # noqa: F401"]


_PROBE = r"""
import json, sys, types
if sys.argv[1] == "without":
    sys.modules["memfit.techniques.torchao_offload"] = types.ModuleType("memfit.techniques.torchao_offload")
from typer.testing import CliRunner
from memfit.cli.app import app
from memfit.cli.options import SETUP_FIELD_OPTIONS
from memfit.fields import TECHNIQUE_SECTIONS
from memfit.setup import FIELD_LABELS, KEEP_NAMES, TrainingSetup
from memfit.techniques import REGISTRY
runner = CliRunner()
def answer(*args):
    result = runner.invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code == 0 else result.output
try:
    TrainingSetup(cpu_offload_optimizer="on")
    takes = True
except TypeError:
    takes = False
print(json.dumps({
    "sections": list(TECHNIQUE_SECTIONS), "labels": list(FIELD_LABELS), "keep": sorted(KEEP_NAMES),
    "options": [o.flags[0] for _, o in SETUP_FIELD_OPTIONS], "techniques": sorted(REGISTRY), "takes": takes,
    "estimate": answer("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", "--optimizer", "adamw-fused"),
    "plan": answer("plan", "llama-3.1-8b", "--gpu", "A100-80GB"),
    "pinned": answer("plan", "llama-3.1-8b", "--gpu", "A100-40GB", "-b", "1", "--precision", "bf16",
                     "--optimizer", "adamw-fused", "--keep", "precision"),
    "refused": answer("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", "--cpu-offload-optimizer", "on"),
}))
"""


def _probe(which: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, which], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _without_field(data):
    """The JSON answer with the module's one field taken out of every setup in it."""
    if isinstance(data, dict):
        return {k: _without_field(v) for k, v in data.items() if k != "cpu_offload_optimizer"}
    if isinstance(data, list):
        return [_without_field(v) for v in data]
    return data


@pytest.mark.processes
def test_memfit_without_the_module_knows_nothing_of_it_and_answers_the_same():
    with_it, without = _probe("with"), _probe("without")
    assert with_it["sections"] == ["torchao_offload"] and without["sections"] == []
    assert with_it["takes"] and not without["takes"]
    assert set(with_it["labels"]) - set(without["labels"]) == {"cpu_offload_optimizer"}
    assert with_it["keep"] == without["keep"]  # it declares no --keep name of its own (its field name serves)
    assert set(with_it["options"]) - set(without["options"]) == {"--cpu-offload-optimizer"}
    assert set(with_it["techniques"]) - set(without["techniques"]) == {"torchao_offload"}
    for case in ("estimate", "plan"):  # every number and word the same, the field aside
        assert with_it[case][0] == 0 and _without_field(with_it[case]) == without[case]
        assert "cpu_offload_optimizer" in json.dumps(with_it[case])
        assert "CPUOffloadOptimizer" not in json.dumps(without[case])
    # pure bf16 pinned on a 40 GB card: the CPU offload rung takes the wrapper only when the module is there
    steps = {s["technique"]: s for s in with_it["pinned"][1]["steps"]}
    assert "CPUOffloadOptimizer" in steps["cpu_offload"]["change"]
    assert "cpu_offload" not in {s["technique"] for s in without["pinned"][1]["steps"]}
    assert with_it["refused"][0] == 0 and without["refused"][0] == 2  # no such option without it
