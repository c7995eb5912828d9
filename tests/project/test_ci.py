"""CI runs the README's test command: `.ci/run` chains the same steps as the README's "Test it" block (pip's -q
aside), so a step added to one (a browser, a prebuilt op) is added to the other."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _steps(text: str) -> list[str]:
    return [" ".join(re.sub(r" -q(?= )", "", step).split()) for step in re.split(r"&&", text) if step.strip()]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"\*\*Test it\*\*.*?```bash\n(.*?)\n```", readme, re.S)
    assert block is not None
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    chain = re.search(r"^(python3 -m venv .*?python -m pytest[^\n]*)$", script, re.S | re.M)
    assert chain is not None
    assert _steps(chain.group(1).replace("\\\n", " ")) == _steps(block.group(1))
    assert "scripts/build_deepspeed_ops.py" in block.group(1) and (ROOT / "scripts" / "build_deepspeed_ops.py").exists()
