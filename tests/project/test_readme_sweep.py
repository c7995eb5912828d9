"""The docs' `memfit fit --sweep` example (docs/workflows.md) shows what the command prints: every cell of its
table (GiB and fits / no, per method) equals the same sweep's CSV, run now."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from typer.testing import CliRunner

from memfit.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "memfit fit llama-3.1-8b --gpu H100 --sweep --seqs 1024,2048,4096 --batches 1,2,4,8 --csv sweep.csv"
ROW = re.compile(r"^ (\d+)\s+(\d+)((?:\s+[\d.]+ (?:fits|no))+)\s*$")


def _readme_cells() -> list[tuple[int, int, str, str]]:
    readme = (ROOT / "docs" / "workflows.md").read_text(encoding="utf-8")  # the README links to it
    block = readme.split(f"$ {COMMAND}\n", 1)[1].split("```", 1)[0]
    cells = []
    for line in block.splitlines():
        match = ROW.match(line)
        if match:
            seq, batch = int(match[1]), int(match[2])
            cells += [(seq, batch, gib, verdict) for gib, verdict in re.findall(r"([\d.]+) (fits|no)", match[3])]
    return cells


def test_the_readme_sweep_table_is_the_real_output(tmp_path):
    target = tmp_path / "sweep.csv"
    args = COMMAND.split()[1:-1] + [str(target)]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, args)
    assert result.exit_code == 0, result.output
    with target.open() as handle:
        rows = list(csv.DictReader(handle))
    measured = [(int(r["seq_len"]), int(r["micro_batch_size"]), r["gib"], "fits" if r["fits"] == "yes" else "no")
                for r in rows]
    assert {r["method"] for r in rows} == {"full-bf16-adamw", "full-bf16-adamw8bit-ckpt", "lora-ckpt", "qlora-ckpt"}
    assert _readme_cells() == measured  # same order: by sequence, batch, then method as the columns
    assert "come when memfit sizes them" not in (ROOT / "docs" / "workflows.md").read_text(encoding="utf-8")
