"""bench/structure.py's figures are computed right: the cycle finder and the import resolver on known inputs."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _structure():
    spec = importlib.util.spec_from_file_location("bench_structure", ROOT / "bench" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cycles_are_the_strongly_connected_components():
    s = _structure()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert sorted(s._cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_relative_imports_resolve_to_modules():
    s = _structure()
    node = ast.parse("from ..setup import Sharding").body[0]
    assert s._resolve("memfit.techniques.zero", node, False) == ["memfit.setup"]
    node = ast.parse("from . import lora").body[0]
    assert s._resolve("memfit.estimate", node, True) == ["memfit.estimate.lora"]


def test_the_tree_is_measured(tmp_path):
    figures = _structure().measure(ROOT, timing=False)
    assert figures["modules"] > 100 and figures["function-local memfit imports"] > 0


def test_term_names_written_as_strings_are_counted():
    """A literal term name, a category prefix and an f-string's leading name count; prose and setup fields do not."""
    s = _structure()
    code = ('a = "activations/head"\nb = t.name.startswith("optimizer/")\nc = f"activations/{stack}_blocks"\n'
            'd = "the gradients of activations/head"\ne = {"optimizer": 1}\nf = TermKey.HEAD\n')
    assert s.term_name_strings(ast.parse(code)) == 3
