"""A technique is one module (issue 20): torchao's CPUOffloadOptimizer lives in memfit/techniques/torchao_offload.py,
activation offloading in memfit/techniques/activation_offload.py, and one registry line imports each. No other source
file names the first; the second's sizing and torch hooks still live in their own modules (listed below: the list only
shrinks). memfit without a module (its import replaced by an empty module, in a fresh interpreter) has no such field,
option, --keep name, rung or note, yet sizes and plans every other setup to the same JSON answer, the field aside."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "memfit"


@dataclass(frozen=True)
class Case:
    module: str
    names: str
    """A regular expression matching how source text names the technique."""
    elsewhere: tuple[str, ...]
    """The other source files that still name it (the registry line aside), and why in a comment."""
    section: str
    field: str
    option: str
    keep: tuple[str, ...]
    """The --keep names the section adds."""
    techniques: tuple[str, ...]
    takes: dict
    refused: tuple[str, ...]


CASES = {
    "torchao_offload": Case(
        "torchao_offload", r"cpu_offload_optimizer|CpuOffloadOptimizer|CPUOffloadOptimizer|torchao_offload|"
        r"cpu-offload-optim", (), "torchao_offload", "cpu_offload_optimizer", "--cpu-offload-optimizer", (),
        ("torchao_offload",), {"cpu_offload_optimizer": "on"}, ("--cpu-offload-optimizer", "on")),
    "activation_offload": Case(
        "activation_offload", r"activation_offload|ActivationOffload|OffloadActivations|offload_activations|"
        r"activation-offload",
        ("_torch/offload_activations.py",  # the saved-tensor hooks (torch), which the module imports on first use
         "estimate/offload_activations.py",  # its sizing, tensor by tensor, in the core the module calls
         "estimate/offload_lora.py",  # the same with a frozen base (adapters)
         "readers/_mapper.py", "readers/axolotl.py", "readers/torchtune.py"),  # axolotl's and torchtune's switches
        # and the mappers' shared helper (a reader slot next)
        "activation_offload", "activation_offload", "--activation-offload", ("activation_offload",),
        ("activation_offload",), {"activation_offload": True}, ("--activation-offload",)),
}


NAMED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # float8 training's fields, checks, words, conversion and torchtitan tables live in memfit/techniques/float8.py;
    # the step model still reads setup.float8 directly (the hooks next), so memfit without the module is not probed
    "float8": ("float8", r"float8|Float8", (
        "choices.py",  # the Float8 choice, which the step model compares
        "setup_checks.py",  # FSDP1's refusal, in the words it shares with torch.compile
        "estimate/float8.py",  # its sizing
        "estimate/activations.py", "estimate/analytic.py", "estimate/comm/__init__.py", "estimate/forward_terms.py",
        "estimate/heads.py", "estimate/moments.py", "estimate/static.py", "estimate/terms.py",
        "graph/saved.py",  # the step model reading setup.float8 (a section hook each, next)
        "_torch/float8.py",  # the Float8Linear swap (torch), which the module imports on first use
        "techniques/convert.py",  # the conversions' order (torchtitan's converters before checkpointing)
        "emit/torchtitan.py", "launch.py",  # torchtitan's tables and launch (an emitter slot next)
        "readers/float8.py", "readers/axolotl.py", "readers/torchtune.py",  # the config keys (a reader slot next)
        "optimizers.py",  # AdamWFp8's float8 moments: another thing of the same name
        "diffusion/readers/kohya.py", "diffusion/readers/ai_toolkit.py",  # a diffusion base stored in float8: the same
        "diffusion/model.py", "diffusion/ladder.py",  # word, another thing (diffusers' layerwise-cast fp8 base weights)
        "solve.py")),  # a docstring
}
"""Techniques whose names are pinned to a list that only shrinks (module, how source text names it, the others)."""


@pytest.mark.parametrize("case", [*CASES.values(), *(Case(m, n, e, *[""] * 3, (), (), {}, ()) for m, n, e in
                                                      NAMED.values())], ids=[*CASES, *NAMED])
def test_no_other_source_file_names_it(case):
    names = re.compile(case.names)
    module = SRC / "techniques" / f"{case.module}.py"
    found = {str(path.relative_to(SRC)) for path in sorted(SRC.rglob("*.py")) if path != module
             and names.search(path.read_text())}
    assert found == {"techniques/__init__.py", *case.elsewhere}
    registry = [line for line in (SRC / "techniques" / "__init__.py").read_text().splitlines() if names.search(line)]
    assert len(registry) == 1 and re.search(rf"\bimport\b.*\b{case.module}\b", registry[0])


_PROBE = r"""
import json, sys, types
case = json.loads(sys.argv[2])
if sys.argv[1] == "without":
    name = "memfit.techniques." + case["module"]
    sys.modules[name] = types.ModuleType(name)
from typer.testing import CliRunner
from memfit.cli.app import app
from memfit.cli.options import SETUP_FIELD_OPTIONS
from memfit.fields import TECHNIQUE_SECTIONS
from memfit.setup import FIELD_LABELS, KEEP_NAMES, TrainingSetup
from memfit.techniques import LADDERS, REGISTRY
runner = CliRunner()
def answer(*args):
    result = runner.invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code == 0 else result.output
try:
    TrainingSetup(**case["takes"])
    takes = True
except TypeError:
    takes = False
print(json.dumps({
    "sections": list(TECHNIQUE_SECTIONS), "labels": list(FIELD_LABELS), "keep": sorted(KEEP_NAMES),
    "options": [o.flags[0] for _, o in SETUP_FIELD_OPTIONS], "techniques": sorted(REGISTRY), "takes": takes,
    "ladders": {str(k): list(v) for k, v in LADDERS.items()},
    "estimate": answer("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", "--optimizer", "adamw-fused"),
    "plan": answer("plan", "llama-3.1-8b", "--gpu", "A100-80GB"),
    "pinned": answer("plan", "llama-3.1-8b", "--gpu", "A100-40GB", "-b", "1", "--precision", "bf16",
                     "--optimizer", "adamw-fused", "--keep", "precision"),
    "refused": answer("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", *case["refused"]),
}))
"""


def _probe(which: str, case: Case) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, which, json.dumps(case.__dict__)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def _without_field(data, field):
    """The JSON answer with the module's one field taken out of every setup in it."""
    if isinstance(data, dict):
        return {k: _without_field(v, field) for k, v in data.items() if k != field}
    if isinstance(data, list):
        return [_without_field(v, field) for v in data]
    return data


@pytest.mark.processes
@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_memfit_without_the_module_knows_nothing_of_it_and_answers_the_same(case):
    with_it, without = _probe("with", case), _probe("without", case)
    assert case.section in with_it["sections"] and case.section not in without["sections"]
    assert set(with_it["sections"]) - {case.section} == set(without["sections"])
    assert with_it["takes"] and not without["takes"]
    assert set(with_it["labels"]) - set(without["labels"]) == {case.field}
    assert set(with_it["keep"]) - set(without["keep"]) == set(case.keep)
    assert set(with_it["options"]) - set(without["options"]) == {case.option}
    assert set(with_it["techniques"]) - set(without["techniques"]) == set(case.techniques)
    for ladder, rungs in with_it["ladders"].items():  # its rung, if any, is the only one the ladders lose
        assert [r for r in rungs if r not in case.techniques] == without["ladders"][ladder]
    for case_name in ("estimate", "plan"):  # every number and word the same, the field aside
        assert with_it[case_name][0] == 0 and _without_field(with_it[case_name], case.field) == without[case_name]
        assert case.field in json.dumps(with_it[case_name])
    assert with_it["refused"][0] == 0 and without["refused"][0] == 2  # no such option without it
    if case.module == "torchao_offload":
        assert "CPUOffloadOptimizer" not in json.dumps(without["estimate"]) + json.dumps(without["plan"])
        # pure bf16 pinned on a 40 GB card: the CPU offload rung takes the wrapper only when the module is there
        steps = {s["technique"]: s for s in with_it["pinned"][1]["steps"]}
        assert "CPUOffloadOptimizer" in steps["cpu_offload"]["change"]
        assert "cpu_offload" not in {s["technique"] for s in without["pinned"][1]["steps"]}
    else:  # pinned: the same plan; its rung is the one more the ladder passed over, and only with the module
        pinned = _without_field(with_it["pinned"][1], case.field)
        ours = [s for s in pinned["skipped"] if s["technique"] == "activation offloading to the CPU"]
        assert len(ours) == 1 and "static memory alone was over the budget" in ours[0]["reason"]
        assert {**pinned, "skipped": [s for s in pinned["skipped"] if s not in ours]} == without["pinned"][1]
