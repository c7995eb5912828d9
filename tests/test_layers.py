"""memfit's layers (docs/design.md, "Layers"): a module imports only from its own layer and the layers below it, at
module level or inside a function, and memfit's modules form no import cycle. What is left is listed here, each with
why, and the lists only shrink: a new upward import fails, and so does an entry that is no longer needed."""

from __future__ import annotations

import fnmatch
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what a training setup, a GPU and a model are, and their memory by formula: no torch, no file formats
    ("core", ("memfit._version", "memfit.change", "memfit.errors", "memfit.units", "memfit.atomic", "memfit.choice", "memfit.zero_knobs",
              "memfit.optimizers", "memfit.readers.files", "memfit.readers._reader", "memfit.finetune", "memfit.way_out", "memfit.setup", "memfit.hardware",
              "memfit.model_spec", "memfit.graph", "memfit.graph.*", "memfit.estimate", "memfit.estimate.*",
              "memfit.diagnose", "memfit.derive.model")),
    # a model loaded (catalog, config, hub, nn.Module) and what only a trace can tell (fits, the torch side)
    ("model", ("memfit.sources", "memfit.sources.*", "memfit.derive", "memfit.derive.*", "memfit._torch",
               "memfit._torch.*", "memfit.trace", "memfit.trace.*")),
    # what to do about it: the ladder, the searches, config files read and written, a live model changed or measured
    ("planning", ("memfit.techniques", "memfit.techniques.*", "memfit.ladder", "memfit.search", "memfit.plan",
                  "memfit.solve", "memfit.throughput", "memfit.verify", "memfit.readers", "memfit.readers.*",
                  "memfit.emit", "memfit.emit.*", "memfit.apply", "memfit.fit", "memfit.measure", "memfit.launch",
                  "memfit._torch.engine", "memfit._torch.rank_memory", "memfit.api")),
    # the library's face: the public functions and what prints or draws a result
    ("library", ("memfit", "memfit.callbacks", "memfit.plan_output", "memfit.render", "memfit.report", "memfit.report.*",
                 "memfit.config_snippets")),
    # the front ends: they call the library
    ("front", ("memfit.serve", "memfit.serve.*", "memfit.cli", "memfit.cli.*")),
)

UPWARD: dict[tuple[str, str], str] = {
    # (importing module, imported module): why it is still there
}
"""Imports from a layer above, still to remove (each one a function-local import)."""

CYCLES: list[list[str]] = [
]
"""Import cycles (strongly connected components, counting function-local imports) still to break."""


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
    assert best is not None, f"{module} is in no layer: add it to LAYERS (tests/test_layers.py, docs/design.md)"
    return best[0]


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


def test_no_new_import_cycle():
    s, modules, _ = _edges()
    graph, _ = s._imports(modules)
    found = sorted(s._cycles(graph))
    assert found == sorted(CYCLES), f"import cycles now: {found}"


def test_the_layers_are_disjoint_and_ordered():
    assert layer_of("memfit.derive.model") == 0 and layer_of("memfit.derive.fit") == 1
    assert layer_of("memfit.estimate.comm.runtime") == 0 and layer_of("memfit.cli.app") == len(LAYERS) - 1
