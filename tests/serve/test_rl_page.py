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
    (["qwen2.5-7b", "--trainer", "ppo2"], None, "--trainer must be one of"),
])
def test_mistakes_are_one_line_400s(client, args, field, words):
    answer = client.post("/api/rl", json={"args": args})
    assert answer.status_code == 400
    assert words in answer.json()["error"] and answer.json()["field"] == field
    assert client.post("/api/rl", json={"argv": args}).status_code == 400


def test_the_rl_form_is_memfit_rls_own_options(client):
    """The RL section's inputs come from `memfit rl`'s options: the trainers from --trainer's metavar (the library's
    TRAINERS), the switches their two flags, and the initial recipe posts as a command line."""
    from memfit.rl.workload import TRAINERS, VLLM_MODES

    fields = {f["name"]: f for f in client.get("/api/options").json()["rl"]}
    assert fields["trainer"]["kind"] == "choice" and fields["trainer"]["choices"] == list(TRAINERS)
    assert fields["vllm_mode"]["choices"] == list(VLLM_MODES)
    assert fields["vllm"]["choices"] == ["--vllm", "--no-vllm"] and fields["lora"]["choices"] == ["--lora", "--full"]
    assert fields["precompute_ref"]["choices"] == ["--precompute-ref", "--online-ref"]
    assert fields["model"]["flag"] is None and fields["num_generations"]["default"] == "8"
    assert any(s["value"].startswith("H100") for s in fields["gpu"]["suggestions"])
    assert client.post("/api/rl", json={"args": _form_args(fields.values())}).status_code == 200


def _form_args(fields, **values) -> list[str]:
    """What the page's rlArgs() posts for the fields' initial values, `values` changed."""
    args = []
    for field in fields:
        value = values.get(field["name"], field["initial"])
        if not value:
            continue
        if field["flag"] is None:
            args.insert(0, value)
        else:
            args += [value] if field["kind"] == "switch" else [field["flag"], value]
    return args


# ---- in a real browser ------------------------------------------------------------------------------------------

_SUBMIT_JS = """
(async () => {
  const built = Date.now() + 20000;
  while (!document.getElementById('rl-f-model')) {  // the form is built from /api/options
    if (Date.now() > built) throw new Error('the RL form never came');
    await new Promise(r => setTimeout(r, 25));
  }
  const before = Number(document.body.dataset.rlUpdates || 0);
  for (const [name, value] of Object.entries(%(fields)s)) {
    const input = document.getElementById('rl-f-' + name);
    input.value = value;
    input.dispatchEvent(new Event('change'));
  }
  document.getElementById('rl-args').value = %(args)s;
  if (%(submit)s) document.getElementById('rl-form').requestSubmit();
  const deadline = Date.now() + 20000;
  const chart = document.getElementById('rl-phases');
  while (Number(document.body.dataset.rlUpdates || 0) <= before) {
    if (Date.now() > deadline) throw new Error('the RL bars never came');
    await new Promise(r => setTimeout(r, 25));
  }
  return {x: chart.data ? chart.data[0].x : null, y: chart.data ? chart.data.map(t => t.y) : null,
          verdict: document.getElementById('rl-verdict').textContent,
          command: document.getElementById('rl-command').textContent,
          error: document.getElementById('rl-error').hidden ? null : document.getElementById('rl-error').textContent};
})()
"""


@pytest.fixture(scope="module")
def browser():
    from browser_check import browser_for

    yield from browser_for("the RL bars' browser test", local_hosts=("127.0.0.1",))


def _run(tab, fields=None, args="", submit=False):
    return tab.evaluate(_SUBMIT_JS % {"fields": json.dumps(fields or {}), "args": json.dumps(args),
                                      "submit": json.dumps(submit)})


@pytest.mark.browser
def test_the_rl_bars_in_a_browser(browser, client):
    fields = client.get("/api/options").json()["rl"]
    expected = client.post("/api/rl", json={"args": _form_args(fields)}).json()
    with web.running() as url, browser.tab(url) as tab:
        drawn = _run(tab, submit=True)
        assert drawn["error"] is None
        assert drawn["x"] == expected["figure"]["data"][0]["x"]  # one bar per phase
        assert drawn["command"] == expected["command"]
        assert drawn["verdict"].startswith(f"peak: {expected['estimate']['peak_phase']}")
        # one field changed: the bars move by themselves, as the API answers for the same arguments
        more = _run(tab, {"completion_len": "2048"})
        moved = client.post("/api/rl", json={"args": _form_args(fields, completion_len="2048")}).json()
        assert more["error"] is None and more["command"] == moved["command"] and "--completion-len 2048" in \
            more["command"]
        assert more["y"] == [t["y"] for t in moved["figure"]["data"]] != drawn["y"]
        assert tab.report().problems == []
        mistake = _run(tab, args="--trainer ppo2", submit=True)
        assert "--trainer must be one of" in mistake["error"]
