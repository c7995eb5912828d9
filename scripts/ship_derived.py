"""Regenerate src/memfit/data/derived: the derivations memfit ships for catalog models without a recipe, so that
`memfit plan NAME` and `memfit models` need no trace on a fresh machine.

For each catalog entry whose spec is derived (memfit.derive), this writes one file per setup kind that
`memfit plan` uses by default (autocast bf16 and pure bf16, CUDA kernels) plus one for its parameter tensors, named
`<config hash>-<kind>.json` as memfit.derive.cache looks them up. A family transformers cannot build with sdpa
(gpt_oss) gets its eager kinds instead, since that is what it trains with.

    python scripts/ship_derived.py            # derive what is missing or of an older format (cache.FIT_FORMAT)
    python scripts/ship_derived.py --force    # derive everything again (after a change to memfit.derive)
    python scripts/ship_derived.py NAME ...   # only these catalog entries
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "memfit" / "data" / "derived"
KINDS = ("amp-bf16/sdpa/cuda", "bf16/sdpa/cuda")


def _write(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")


def _kinds(config: dict) -> tuple[str, ...]:
    from memfit._torch.step import hf_config_from_dict
    import transformers

    hf = hf_config_from_dict(config)
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(hf), None)
    if model_class is not None and getattr(model_class, "_supports_sdpa", True) is False:
        return tuple(kind.replace("/sdpa/", "/eager/") for kind in KINDS)
    return KINDS


def ship(name: str, force: bool) -> list[str]:
    from memfit.derive.cache import config_hash, library_versions, shipped_name
    from memfit.derive.fit import derive_kind, quiet_transformers
    from memfit.derive.spec import PARAMS_FORMAT, PARAMS_KIND, _param_rows, arch_numbers
    from memfit.sources import catalog_config, resolve_model

    config = catalog_config(name)
    spec = resolve_model(name)
    if spec.derived is None:
        return []
    written = []
    base = {"model_type": config.get("model_type"), "config_hash": config_hash(config),
            "versions": library_versions(), "catalog_name": name}
    from memfit.sources.hf_config import SUPPORTED_MODEL_TYPES

    if getattr(spec.derived, "stacked", False):  # encoder-decoder / vision: memfit.derive.stacks
        return _ship_stacked(config, base, force)
    params_path = OUT / shipped_name(config, PARAMS_KIND)
    if config["model_type"] not in SUPPORTED_MODEL_TYPES and (force or _format(params_path) != PARAMS_FORMAT):
        with quiet_transformers():
            rows, facts = _param_rows(config, spec.num_layers, name)
        _write(params_path, {**base, "kind": PARAMS_KIND, "format": PARAMS_FORMAT,
                             "params": [[p.name, p.numel, p.count] for p in rows], "facts": facts,
                             "arch": arch_numbers(config, name)})
        written.append(params_path.name)
    from memfit.derive.cache import FIT_FORMAT

    return written + _ship_fits(config, base, _kinds(config), derive_kind, force, FIT_FORMAT)


STACKED_KINDS = tuple(f"{kind}/{ckpt}" for kind in KINDS for ckpt in ("nockpt", "ckpt"))
"""memfit.derive.stacks kinds also say whether blocks are checkpointed (another timeline)."""


def _ship_stacked(config: dict, base: dict, force: bool) -> list[str]:
    from memfit.derive.cache import shipped_name
    from memfit.derive.stacks import derive_stacks
    from memfit.derive.stacks_spec import PARAMS_KIND, _param_rows

    written = []
    params_path = OUT / shipped_name(config, PARAMS_KIND)
    if force or not params_path.exists():
        rows, facts = _param_rows(config, base["catalog_name"])
        _write(params_path, {**base, "kind": PARAMS_KIND, "format": 1,
                             "params": [[p.name, p.numel, p.count] for p in rows], "facts": facts})
        written.append(params_path.name)
    from memfit.derive.stacks_estimate import FORMAT

    return written + _ship_fits(config, base, STACKED_KINDS, derive_stacks, force, FORMAT)


def _ship_fits(config: dict, base: dict, kinds, derive, force: bool, format_version: int) -> list[str]:
    """Derive and write each kind's fit that is missing or of another format (or every one with --force); the file
    names written."""
    from memfit.derive.cache import shipped_name

    written = []
    for kind in kinds:
        path = OUT / shipped_name(config, kind)
        if _format(path) == format_version and not force:
            continue
        started = time.perf_counter()
        fit = derive(config, kind)
        _write(path, {**base, "kind": kind, "format": format_version,
                      "derive_seconds": round(time.perf_counter() - started, 3), "fit": fit.to_dict()})
        written.append(path.name)
    return written


def _format(path: Path) -> int | None:
    """The format a shipped file records (1 where it records none), None where there is no file."""
    return json.loads(path.read_text(encoding="utf-8")).get("format", 1) if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="catalog names (default: every catalog entry)")
    parser.add_argument("--force", action="store_true", help="derive again even where a file exists")
    args = parser.parse_args()
    os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-ship-")  # never the user's cache
    from memfit.sources import catalog_names

    OUT.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names or catalog_names():
        try:
            written = ship(name, args.force)
        except Exception as error:  # noqa: BLE001 - report every entry that cannot be derived, then go on
            failed += 1
            print(f"{name}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:300]}", flush=True)
            continue
        if written:
            print(f"{name}: {', '.join(written)}", flush=True)
    total = sum(p.stat().st_size for p in OUT.glob("*.json"))
    print(f"{len(list(OUT.glob('*.json')))} files, {total:,} bytes in {OUT.name}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
