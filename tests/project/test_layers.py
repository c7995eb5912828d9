"""memfit's layers (docs/design.md, "Layers"): a module imports only from its own layer and the layers below it, at
module level or inside a function, and memfit's modules form no import cycle. What is left is listed here, each with
why, and the lists only shrink: a new upward import fails, and so does an entry that is no longer needed."""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what a training setup, a GPU and a model are, and their memory by formula: no torch, no config formats (the
    # bounded file reading that memfit.sources shares with the readers apart)
    ("core", ("memfit._version", "memfit.errors", "memfit.units", "memfit.fields", "memfit.libraries", "memfit.choices", "memfit.selective_op", "memfit.atomic", "memfit.choice",
              "memfit.change",
              "memfit.zero_knobs", "memfit.optimizers", "memfit.finetune", "memfit.way_out", "memfit.setup_checks",
              "memfit.setup",
              "memfit.hardware", "memfit.model_spec", "memfit.graph", "memfit.graph.*", "memfit.estimate",
              "memfit.estimate.*", "memfit.diagnose", "memfit.derive.model", "memfit.readers.files",
              "memfit.readers._reader")),
    # a model loaded (catalog, config, hub, nn.Module) and what only a trace can tell (fits, the torch side)
    ("model", ("memfit.sources", "memfit.sources.*", "memfit.derive", "memfit.derive.*", "memfit._torch",
               "memfit._torch.*", "memfit.trace", "memfit.trace.*",
               # a technique is one module: its sizing, checks, costs and its one conversion of a live model, which
               # the torch side runs (apply_, the HF builder, the trace, the engines)
               "memfit.techniques", "memfit.techniques.*")),
    # what to do about it: the ladder, the searches, config files read and written, a live model changed, measured
    # or launched (the sharded engines too), and the public functions over them (memfit.api)
    ("planning", ("memfit.ladder", "memfit.frameworks", "memfit.typical", "memfit.search", "memfit.plan",
                  "memfit.solve", "memfit.throughput", "memfit.verify", "memfit.readers", "memfit.readers.*",
                  "memfit.emit", "memfit.emit.*", "memfit.apply", "memfit.fit", "memfit.measure", "memfit.launch",
                  "memfit._torch.engine", "memfit._torch.rank_memory", "memfit.api", "memfit.rl", "memfit.rl.*",
                  "memfit.vlm", "memfit.vlm.*", "memfit.diffusion", "memfit.diffusion.*")),
    # the library's face: the package's lazy names, the HF callback, what prints or draws a result
    ("library", ("memfit", "memfit.callbacks", "memfit.plan_output", "memfit.render", "memfit.report",
                 "memfit.report.*", "memfit.config_snippets")),
    # the front ends: they call the library
    ("front", ("memfit.serve", "memfit.serve.*", "memfit.cli", "memfit.cli.*")),
)

UPWARD: dict[tuple[str, str], str] = {
    # (importing module, imported module): why it is still there. Empty: keep it so.
}
"""Imports from a layer above, still to remove."""

CYCLES: list[tuple[str, ...]] = [
    # The estimator's own tangle: estimate.analytic imports every technique's module at module level and several
    # import it (lora_checkpoint, offload_activations, pipeline) or each other (activations <-> lora / moe,
    # static <-> lora_sharded / deepspeed_zero3) back inside functions, until the step is a typed model the
    # techniques change (issue 20; a technique section's hooks are that model's first part: memfit.fields).
    ("memfit.derive.model", "memfit.diagnose", "memfit.estimate.*", "memfit.graph", "memfit.graph.*",
     "memfit.hardware", "memfit.setup"),
    # torch.compile on the torch side: _torch.step compiles blocks (_torch.compiled) and _torch.compiled traces a
    # block with the step's helpers (unpacked_sequences, chunk_cross_entropy, autocast_factory) and derive.fit's.
    # The techniques' conversions joined it: checkpointing's (the selective-op policy, blocks wrapped) runs on the
    # torch side and needs the step's block finder; to break by moving the policy text to an import-free module.
    ("memfit._torch.compiled", "memfit._torch.step", "memfit.derive.fit", "memfit.trace.session",
     "memfit._torch.blocks", "memfit._torch.muon", "memfit.techniques.checkpointing"),
    # a stacked model's trace (stacks_trace) and its fits (stacks) call each other
    ("memfit.derive.stacks", "memfit.derive.stacks_trace"),
]
"""Import cycles (strongly connected components, counting function-local imports) still to break: every cycle found
lies inside one of these groups (module patterns), and each group still holds one."""

LOCAL_IMPORTS = 297  # + cli/rl.py (6), cli/script.py (4): a command loads its package when it runs;
# + the techniques' conversions (5) and memfit.vlm's trace (5): torch only when a live model is built
"""Function-local memfit imports today (bench/structure.py): the count may only fall; lower it when it does."""


def _structure():
    spec = importlib.util.spec_from_file_location("bench_structure", ROOT / "bench" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def layer_of(module: str) -> int:
    """The index of `module`'s layer: its most specific pattern wins (memfit.derive.model is core, memfit.derive.*
    the model layer)."""
    best = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if fnmatch.fnmatchcase(module, pattern) and (best is None or len(pattern) > best[1]):
                best = (index, len(pattern))
    assert best is not None, f"{module} is in no layer: add it to LAYERS (tests/project/test_layers.py, docs/design.md)"
    return best[0]


@functools.lru_cache(maxsize=1)
def _edges():
    s = _structure()
    modules = s._modules(ROOT / "src")
    return s, modules, s._edges(modules)


def test_every_module_has_a_layer():
    _, modules, _ = _edges()
    for module in modules:
        layer_of(module)


def test_no_module_imports_from_a_layer_above():
    _, _, edges = _edges()
    upward = {}
    for source, target, line, _ in edges:
        if layer_of(target) > layer_of(source):
            upward.setdefault((source, target), line)
    new = {f"{s}:{line} imports {t} ({LAYERS[layer_of(s)][0]} -> {LAYERS[layer_of(t)][0]})"
           for (s, t), line in upward.items() if (s, t) not in UPWARD}
    assert not new, "imports from a layer above:\n" + "\n".join(sorted(new))
    gone = set(UPWARD) - set(upward)
    assert not gone, f"no longer imported upward, remove from UPWARD: {sorted(gone)}"


def _in_group(module: str, group: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in group)


def test_no_new_import_cycle():
    s, modules, _ = _edges()
    graph, _ = s._imports(modules)
    found = s._cycles(graph)
    for cycle in found:
        assert any(all(_in_group(m, group) for m in cycle) for group in CYCLES), f"a new import cycle: {cycle}"
    for group in CYCLES:
        assert any(all(_in_group(m, group) for m in cycle) for cycle in found), f"broken, remove from CYCLES: {group}"


def test_function_local_imports_only_fall():
    s, modules, _ = _edges()
    _, local = s._imports(modules)
    assert local <= LOCAL_IMPORTS, f"{local} function-local memfit imports (was {LOCAL_IMPORTS}): import at module level"


def test_the_layers_are_disjoint_and_ordered():
    assert layer_of("memfit.derive.model") == 0 and layer_of("memfit.derive.fit") == 1
    assert layer_of("memfit.estimate.comm.runtime") == 0 and layer_of("memfit.cli.app") == len(LAYERS) - 1


@pytest.mark.processes
def test_the_estimator_gets_its_fits_from_the_model_layer_without_torch():
    """Importing the estimator registers memfit.derive's fit sources (its __init__ runs before memfit.derive.model,
    which the estimator imports) and imports neither torch nor transformers: a fresh interpreter's modules."""
    code = ("import sys, memfit.estimate.analytic\nfrom memfit.estimate import fits\n"
            "print(sorted(fits._PROVIDED), sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}).stdout
    assert out.split("\n")[0] == "['compiled', 'derived', 'stacked'] []"
