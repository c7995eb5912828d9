"""The launch commands `memfit plan` prints name memfit_setup.json (MEMFIT_SETUP_FILE) instead of carrying ~1,000
characters of setup JSON on every node's line; `--emit DIR` writes the file, and a launched rank rebuilds exactly
the planned setup from it (memfit.launch.setup_from_env, which still reads an inline MEMFIT_SETUP first)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.errors import ConfigError
from memfit.hardware import make_hardware
from memfit.launch import (ENV_ENGINE, ENV_SETUP, ENV_SETUP_FILE, SETUP_FILE, launch_plan, setup_env,
                           setup_from_env)
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

ROOT = Path(__file__).resolve().parents[2]
SPEC = resolve_model("llama-2-70b")
SIXTEEN_NODES = make_hardware("H100", gpus_per_node=8, num_nodes=16)
SETUP = TrainingSetup(micro_batch_size=1, seq_len=4096, precision="bf16", optimizer="adamw", checkpointing="full",
                      sharding="zero3", num_gpus=128, engine="torch")
PLAN_16_NODES = ("plan", "llama-3.1-70b", "--gpu", "H100", "--gpus", "8", "--nodes", "16")


def _env_of(shell_line: str) -> dict[str, str]:
    """The VAR=value words in front of a pasted command, as the shell reads them."""
    words = shlex.split(shell_line)
    return dict(w.split("=", 1) for w in words[:next(i for i, w in enumerate(words) if "=" not in w)])


def test_commands_name_the_file_and_the_file_holds_the_setup(tmp_path):
    launch = launch_plan(SETUP, SIXTEEN_NODES, "train.py", spec=SPEC, setup_file=SETUP_FILE)
    assert len(launch.commands) == 16
    for command in launch.commands:
        env = dict(command.env)
        assert env == {ENV_ENGINE: "torch", ENV_SETUP_FILE: SETUP_FILE} and len(command.shell()) < 220
    (tmp_path / SETUP_FILE).write_text(launch.files[SETUP_FILE])
    assert setup_from_env({ENV_SETUP_FILE: str(tmp_path / SETUP_FILE)}) == SETUP
    # inline, as `memfit launch` runs one node itself: the same setup, ~1,000 characters on the line
    inline = launch_plan(SETUP, SIXTEEN_NODES, "train.py", spec=SPEC)
    assert setup_from_env(dict(inline.commands[0].env)) == SETUP and len(inline.commands[0].shell()) > 900


def test_the_deepspeed_launcher_forwards_the_file_name():
    launch = launch_plan(SETUP, SIXTEEN_NODES, "train.py", spec=SPEC, engine="deepspeed", launcher="deepspeed",
                         setup_file=SETUP_FILE)
    forwarded = dict(line.split("=", 1) for line in launch.files[".deepspeed_env"].splitlines())
    assert forwarded == {ENV_ENGINE: "deepspeed", ENV_SETUP_FILE: SETUP_FILE}
    assert json.loads(launch.files[SETUP_FILE])["engine"] == "deepspeed"


def test_setup_from_env_reads_inline_first_and_says_what_is_wrong_with_the_file(tmp_path):
    inline = setup_env(SETUP.replace(micro_batch_size=2))
    assert setup_from_env({**inline, ENV_SETUP_FILE: str(tmp_path / "none.json")}).micro_batch_size == 2
    with pytest.raises(ConfigError, match=f"cannot read {ENV_SETUP_FILE} .*none.json"):
        setup_from_env({ENV_SETUP_FILE: str(tmp_path / "none.json")})
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        setup_from_env({ENV_SETUP_FILE: str(tmp_path / "bad.json")})
    assert setup_from_env({}) is None and ENV_SETUP not in setup_env(SETUP, setup_file="x.json")


@pytest.mark.processes
def test_plan_on_16_nodes_prints_short_commands_and_emit_writes_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env={"COLUMNS": "80"})
    plain = runner.invoke(app, list(PLAN_16_NODES))
    assert plain.exit_code == 0, plain.output
    assert "MEMFIT_SETUP=" not in plain.stdout and "memfit_setup.json is not written yet" in " ".join(
        plain.stdout.split())
    result = runner.invoke(app, [*PLAN_16_NODES, "--emit", "configs"])
    assert result.exit_code == 0, result.output
    commands = [line.strip() for line in result.stdout.splitlines() if "torchrun" in line]
    assert len(commands) == 3  # nodes 0, 1 and 15; the rest differ in --node-rank
    assert all(len(line) < 250 and "MEMFIT_SETUP_FILE=configs/memfit_setup.json" in line for line in commands)
    data = json.loads(runner.invoke(app, [*PLAN_16_NODES, "--emit", "configs", "--json"]).stdout)
    launch = data["launch"]
    assert len(launch["commands"]) == 16 and {c["env"][ENV_SETUP_FILE] for c in launch["commands"]} == {
        "configs/memfit_setup.json"}
    written = (tmp_path / "configs" / SETUP_FILE).read_text()
    assert written == launch["files"]["configs/memfit_setup.json"]
    planned = TrainingSetup(**{k: v for k, v in data["final_setup"].items() if k != "notes"})
    # A real process started with node 15's environment, in the launch directory, rebuilds the planned setup.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **_env_of(commands[-1])}
    code = "from memfit.launch import setup_from_env; import json; print(json.dumps(setup_from_env().to_dict()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == planned.to_dict()
