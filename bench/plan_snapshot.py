"""Snapshot of what the CLI answers, to prove a refactor of the setup, the techniques or the CLI changes no output.

bench/saved_snapshot.py pins the estimator's numbers; this pins what sits above them: `plan` (ladder, verdict, what
would fit, `--optimize`), `estimate`, `fit` and `--emit` (every file written), over the flagship questions, every
config reader in tests/data/configs and one case per CLI option. Each case's `--json` answer (and its emitted files)
is reduced to a sha256; `--full` keeps the JSON to diff.

    python bench/plan_snapshot.py --write before.json     # before a change
    python bench/plan_snapshot.py --check before.json     # after: lists every case whose answer moved
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"

FLAGSHIP = (
    ("plan", "llama-3.1-8b", "--gpu", "A100-80GB"),
    ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--method", "lora", "--lora-targets", "all-linear"),
    ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--method", "qlora", "--lora-targets", "all-linear"),
    ("plan", "llama-3.1-70b", "--gpu", "48GB", "--method", "qlora", "-r", "16", "--lora-targets", "all-linear",
     "-b", "1", "-s", "2048"),
    ("plan", "llama-3.1-70b", "--gpu", "RTX-3090", "--gpus", "2", "--method", "qlora", "-b", "1", "-s", "2048"),
    ("plan", "llama-3.1-70b", "--gpu", "H100", "--gpus", "8"),
    ("plan", "llama-3.1-8b", "--gpu", "A100-80GB", "--optimize"),
    ("plan", "mistral-7b-v0.3", "--gpu", "A100-40GB", "--keep", "precision"),
    ("plan", "gpt2", "--gpu", "T4"),
    ("plan", "mixtral-8x7b", "--gpu", "H100", "--gpus", "8"),
    ("fit", "llama-3.1-70b", "--gpu", "H100", "--max", "gpus"),
    ("fit", "llama-3.1-8b", "--gpu", "A100-80GB", "--max", "batch"),
    ("fit", "llama-3.1-8b", "--gpu", "RTX-4090", "--method", "lora", "--max", "seq"),
)

OPTION_CASES = (
    ("--precision", "bf16"), ("--precision", "amp-fp16"), ("--precision", "bf16-master"),
    ("--optimizer", "adamw-8bit"), ("--optimizer", "adamw-fused"), ("--optimizer", "paged-adamw-8bit"),
    ("--checkpointing", "full"), ("--checkpointing", "selective-op"), ("--attention", "eager"),
    ("--zero", "2", "--gpus", "4"), ("--zero", "3", "--gpus", "8"), ("--zero", "3", "--gpus", "8", "--offload",
                                                                       "optimizer", "--engine", "deepspeed"),
    ("--tp", "2", "--gpus", "2"), ("--tp", "2", "--gpus", "2", "--sequence-parallel"), ("--pp", "2", "--gpus", "2"),
    ("--cp", "2", "--gpus", "2", "--attention", "flash"), ("--loss", "chunked"), ("--optimizer-in-backward",),
    ("--activation-offload",), ("--compile",), ("--float8", "tensorwise", "--gpu", "H100"),
    ("--method", "lora", "--lora-rank", "64", "--lora-dropout", "0.1"), ("--method", "lora", "--dora"),
    ("--method", "qlora", "--no-kbit-prep"), ("--method", "qlora", "--double-quant"),
    ("--cpu-offload-optimizer", "on"), ("--accum", "4", "-b", "2"), ("--padding", "longest"),
    ("--gpus", "16", "--nodes", "2", "--zero", "3"), ("--margin", "0.2"),
)

CONFIG_FILES = tuple(sorted(p.name for p in CONFIGS.glob("*") if p.suffix in (".json", ".yaml", ".yml")))


def cases() -> list[tuple[str, ...]]:
    out = [tuple(c) for c in FLAGSHIP]
    for option in OPTION_CASES:
        out.append(("estimate", "llama-3.1-8b", "--gpu", "A100-80GB", *option))
        out.append(("plan", "llama-3.1-8b", "--gpu", "A100-80GB", *option))
    for name in CONFIG_FILES:
        out.append(("plan", "llama-3.1-8b", "--gpu", "A100-80GB", "--config", str(CONFIGS / name)))
    return out


def run_case(runner: CliRunner, app, args: tuple[str, ...]) -> dict:
    """The case's JSON answer and, for plan, the files `--emit` writes (name -> text)."""
    result = runner.invoke(app, [*args, "--json"])
    answer = {"exit": result.exit_code, "stdout": _normalise(result.stdout)}
    if args[0] == "plan" and result.exit_code == 0:
        with tempfile.TemporaryDirectory() as tmp:
            emitted = runner.invoke(app, [*args, "--emit", tmp, "--json"])
            answer["emit_exit"] = emitted.exit_code
            answer["files"] = {p.name: _strip_emit_hashes(p.read_text().replace(tmp, "EMIT"))
                                for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    return answer


def _strip_emit_hashes(text: str) -> str:
    """The emit manifest's digests cover files that name the emit folder: compare the files, not the digests."""
    if '"files": {' not in text:
        return text
    data = json.loads(text)
    data["files"] = sorted(data["files"])
    return json.dumps(data, sort_keys=True)


def _normalise(text: str) -> object:
    """Parsed JSON when the output is JSON (so key order and paths of temporary folders do not count)."""
    try:
        data = json.loads(text)
    except ValueError:
        return text
    return json.loads(json.dumps(data, sort_keys=True).replace(str(CONFIGS), "CONFIGS"))


def digest(answer: dict) -> str:
    return hashlib.sha256(json.dumps(answer, sort_keys=True).encode()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write")
    parser.add_argument("--check")
    parser.add_argument("--full", action="store_true", help="store each case's JSON, not its digest")
    args = parser.parse_args()
    from memfit.cli.app import app

    runner = CliRunner()
    snapshot = {}
    for case in cases():
        answer = run_case(runner, app, case)
        key = " ".join(case).replace(str(CONFIGS) + "/", "")
        snapshot[key] = answer if args.full else digest(answer)
        print(f"{key}: exit {answer['exit']}", file=sys.stderr)
    if args.write:
        Path(args.write).write_text(json.dumps(snapshot, indent=1, sort_keys=True))
    if args.check:
        before = json.loads(Path(args.check).read_text())
        moved = [k for k in sorted(set(before) | set(snapshot)) if before.get(k) != snapshot.get(k)]
        print(f"{len(moved)} of {len(snapshot)} cases moved")
        for key in moved:
            print(f"  moved: {key}")
        return 1 if moved else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
