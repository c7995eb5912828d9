"""A setup is the same whatever was imported first (issue 20): the technique sections' fields are there once
`memfit.setup` is, without importing `memfit.techniques` by hand (memfit.fields.load_sections loads the registry
by name the first time the core needs it), and loading it brings in no torch and none of the torch side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from memfit.setup import FIELD_LABELS, KEEP_NAMES, TrainingSetup, field_names, parse_keep
from memfit.fields import TECHNIQUE_SECTIONS
setup = TrainingSetup(activation_offload=True, cpu_offload_optimizer="on", checkpointing="full")
print(json.dumps({
    "sections": list(TECHNIQUE_SECTIONS), "labels": list(FIELD_LABELS), "keep": {k: list(v) for k, v in
                                                                                  KEEP_NAMES.items()},
    "fields": list(field_names()), "setup": setup.to_dict(), "pinned": sorted(parse_keep("activation_offload")),
    "read": [setup.activation_offload, str(setup.cpu_offload_optimizer)],
    "torch_side": sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "memfit._torch",
                                                                                  "memfit.trace", "memfit.cli"))),
}))
"""


def _probe(*first: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *first], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.processes
def test_a_setup_from_memfit_setup_alone_knows_every_section():
    registry_first = _probe("memfit.techniques")
    assert {"torchao_offload", "activation_offload", "float8"} <= set(registry_first["sections"])
    assert registry_first["read"] == [True, "on"]
    for first in ((), ("memfit.fields",), ("memfit.estimate.static",), ("memfit.estimate.analytic",)):
        alone = _probe(*first)
        assert alone == registry_first, first
        assert alone["torch_side"] == []  # the technique modules import the core only until a conversion runs


def test_the_library_takes_a_section_field_wherever_it_takes_the_setup_own():
    """memfit.check and memfit.plan_memory list the setup's fields with field_names (the sections' included)."""
    from memfit.callbacks import check
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        check("llama-3.2-1b", gpu="A100-80GB", float8="tensorwise", activation_offload=True, bogus=1)
    assert str(error.value).startswith("unknown setup field(s) bogus:")
