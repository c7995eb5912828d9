"""Regenerate the compiled-block fits memfit ships (src/memfit/data/derived/<config hash>-compile-<kind>.json), so
that `memfit plan NAME --compile` needs no trace for the catalog's main dense models.

    python scripts/ship_compiled.py            # fit what is missing
    python scripts/ship_compiled.py --force    # fit everything again (after a change to memfit.estimate.compiled)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "memfit" / "data" / "derived"
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b")
KINDS = ("compile-amp-bf16/sdpa/cuda", "compile-bf16/sdpa/cuda")


def main() -> int:
    from memfit.derive.cache import config_hash, library_versions, shipped_name
    from memfit.derive.compiled import fit_kind
    from memfit.sources import catalog_config

    force = "--force" in sys.argv
    for name in MODELS:
        config = catalog_config(name)
        for kind in KINDS:
            path = OUT / shipped_name(config, kind)
            if path.exists() and not force:
                continue
            started = time.perf_counter()
            fit, error = fit_kind(config, kind)
            payload = {"kind": kind, "catalog_name": name, "model_type": config.get("model_type"),
                       "config_hash": config_hash(config), "versions": library_versions(), "fit_error": error,
                       "fit": {g: line.to_list() for g, line in fit.items()}}
            path.write_text(json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")
            print(f"{name} {kind}: {time.perf_counter() - started:.1f} s -> {path.name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
