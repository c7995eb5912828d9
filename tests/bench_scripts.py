"""Load a `bench/` script as a module, for the tests that run a short subset of it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str):
    """bench/<name>.py as the module `memfit_bench_<name>` (registered, so its dataclasses resolve their module)."""
    spec = importlib.util.spec_from_file_location(f"memfit_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
