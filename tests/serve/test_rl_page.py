"""The page's RL phase bars (`/api/rl`, memfit.serve.rl): the answer is `memfit rl --json`'s own estimate, one bar
per phase stacked by category with the same bytes, and a mistake is a 400 with the command line's one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="memfit serve needs the serve extra: pip install -e '.[test]'")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memfit.cli.app import app as cli_app  # noqa: E402
from memfit.serve import web  # noqa: E402

ARGS = ["qwen2.5-7b", "--trainer", "grpo", "--vllm", "--vllm-util", "0.4", "--lora", "--gpu", "H100", "--beta",
        "0.04"]


@pytest.fixture(scope="module")
def client():
    with TestClient(web.create_app()) as test_client:
        yield test_client


def test_phase_bars_are_the_clis_estimate(client):
    answer = client.post("/api/rl", json={"args": ARGS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    cli = CliRunner().invoke(cli_app, ["rl", *ARGS, "--json"])
    assert cli.exit_code == 0, cli.output
    assert body["estimate"] == {k: v for k, v in json.loads(cli.output).items() if k != "framework"}
    assert body["command"].startswith("memfit rl qwen2.5-7b")
    phases = body["estimate"]["phases"]
    traces = body["figure"]["data"]
    assert len(traces[0]["x"]) == len(phases)  # one bar per phase, never a sum of phases
    for i, phase in enumerate(phases):
        stacked = sum(t["y"][i] for t in traces)
        assert stacked == pytest.approx(phase["total_bytes"] / (1 << 30), abs=0.01)
    assert body["figure"]["layout"]["barmode"] == "stack"


@pytest.mark.parametrize("args, field, words", [
    (["qwen2.5-7b", "--trainer", "grpo", "--batch", "zero"], "batch", "zero"),
    (["qwen2.5-7b", "--config", "grpo.yaml"], "config", "reads no files"),
    (["./my-model"], "model", "catalog models"),
    (["qwen2.5-7b", "--trainer", "orpo"], None, "--trainer must be one of"),
])
def test_mistakes_are_one_line_400s(client, args, field, words):
    answer = client.post("/api/rl", json={"args": args})
    assert answer.status_code == 400
    assert words in answer.json()["error"] and answer.json()["field"] == field
    assert client.post("/api/rl", json={"argv": args}).status_code == 400


# ---- in a real browser ------------------------------------------------------------------------------------------

_SUBMIT_JS = """
(async () => {
  const before = Number(document.body.dataset.rlUpdates || 0);
  document.getElementById('rl-args').value = %(args)s;
  document.getElementById('rl-form').requestSubmit();
  const deadline = Date.now() + 20000;
  const chart = document.getElementById('rl-phases');
  while (Number(document.body.dataset.rlUpdates || 0) <= before) {
    if (Date.now() > deadline) throw new Error('the RL bars never came');
    await new Promise(r => setTimeout(r, 25));
  }
  return {x: chart.data ? chart.data[0].x : null, verdict: document.getElementById('rl-verdict').textContent,
          error: document.getElementById('rl-error').hidden ? null : document.getElementById('rl-error').textContent};
})()
"""


@pytest.fixture(scope="module")
def browser():
    from browser_check import browser_for

    yield from browser_for("the RL bars' browser test", local_hosts=("127.0.0.1",))


@pytest.mark.browser
def test_the_rl_bars_in_a_browser(browser, client):
    expected = client.post("/api/rl", json={"args": ARGS}).json()
    with web.running() as url, browser.tab(url) as tab:
        drawn = tab.evaluate(_SUBMIT_JS % {"args": json.dumps(" ".join(ARGS))})
        assert drawn["error"] is None
        assert drawn["x"] == expected["figure"]["data"][0]["x"]  # one bar per phase
        assert drawn["verdict"].startswith(f"peak: {expected['estimate']['peak_phase']}")
        assert tab.report().problems == []
        mistake = tab.evaluate(_SUBMIT_JS % {"args": json.dumps("qwen2.5-7b --trainer orpo")})
        assert "--trainer must be one of" in mistake["error"]
