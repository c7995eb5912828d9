"""memfit serve: the page's API gives what `memfit plan --json` gives, bad input is a 400 with the CLI's own line,
the form's choices are memfit's vocabularies; and the page itself, in a real headless Chromium, loads cleanly from
the local server only, redraws its chart when an input changes and shows a mistake inline, keeping the chart.

The browser test needs Debian's chromium (`sudo bash scripts/install_test_browser.sh`); without it, it is skipped
with that hint (it fails under CI=true or MEMFIT_REQUIRE_BROWSER=1)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("starlette", reason="memfit serve needs the serve extra: pip install -e '.[test]'")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memfit.cli.app import app as cli_app  # noqa: E402
from memfit.hardware import gpu_catalog  # noqa: E402
from memfit.serve import core, web  # noqa: E402
from memfit.setup import Attention, Checkpointing, Engine, Offload, Optimizer, Precision, Sharding  # noqa: E402
from memfit.sources import catalog_names  # noqa: E402

from browser_check import browser_for, origin_of  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with TestClient(web.create_app()) as test_client:
        yield test_client


def cli(args: list[str]):
    """`memfit ARGS` in process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli_app, args)
    return result.exit_code, result.stdout, result.stderr


def flag(name: str) -> str:
    return next(f["flag"] for f in core.form_fields() if f["name"] == name)


# ---- the API -----------------------------------------------------------------------------------------------------

SETUPS = [
    {"model": "llama-3.1-8b", "gpu": "A100-80GB"},
    {"model": "llama-3.1-8b", "gpu": "RTX-4090"},
    {"model": "gpt2", "gpu": "T4", "batch": "16", "seq": "1024", "precision": "amp-fp16", "optimizer": "adamw-8bit"},
    {"model": "llama-2-70b", "gpu": "H100", "gpus": "8", "zero": "zero3", "checkpointing": "full",
     "engine": "torch", "keep": "precision"},
    {"model": "mistral-7b", "gpu": "24GiB", "batch": "4", "seq": "4096", "attention": "eager", "accum": "2",
     "margin": "0.1"},
    {"model": "llama-3.1-8b", "gpu": "L4", "offload": "optimizer", "cpu_ram": "64GiB", "nodes": "2", "gpus": "2"},
]


@pytest.mark.parametrize("values", SETUPS, ids=lambda v: "-".join(v.values())[:40])
def test_the_plan_is_what_the_cli_prints_with_json(client, values):
    reply = client.post("/api/plan", json=values)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    args = shlex.split(answer["command"])
    assert args[:3] == ["memfit", "plan", values["model"]]
    assert dict(zip(args[3::2], args[4::2])) == {flag(k): v for k, v in values.items() if k != "model"}
    code, out, _ = cli([*args[1:], "--json"])
    assert code in (0, 1)
    assert answer["plan"] == json.loads(out)
    assert answer["view"]["fits"] is answer["plan"]["fits"] is (code == 0)


def test_the_view_and_chart_carry_the_plans_numbers(client):
    answer = client.post("/api/plan", json={"model": "llama-3.1-8b", "gpu": "A100-80GB"}).json()
    plan, view = answer["plan"], answer["view"]
    assert len(view["rungs"]) == len(plan["steps"]) + 1
    gib = [f"{b / 2**30:.2f}" for b in [plan["initial_estimate"]["total_bytes"]]
           + [s["total_bytes"] for s in plan["steps"]]]
    assert [r["gib"] for r in view["rungs"]] == gib
    assert [r["fits"] for r in view["rungs"][1:]] == [s["fits"] for s in plan["steps"]]
    assert [r["title"] for r in view["rungs"][1:]] == [s["title"] for s in plan["steps"]]
    budget = plan["final_diagnosis"]["budget_bytes"] / 2**30
    assert view["fits"] and f"of {budget:.2f} GiB usable" in view["verdict"]
    assert any("TrainingArguments" in label for label in view["snippets"])
    bars = [t for t in answer["figure"]["data"] if t["type"] == "bar"]
    stacked = [sum(t["y"][i] for t in bars) for i in range(len(view["rungs"]))]
    assert stacked == pytest.approx([float(g) for g in gib], abs=0.01)


BAD = [
    ({"model": "llama-3.1-8b", "batch": "0"}, "batch"),
    ({"model": "llama-3.1-8bx"}, "model"),
    ({"model": "gpt2", "seq": "99999999"}, "seq"),
    ({"model": "gpt2", "gpu": "3XB"}, "gpu"),
    ({"model": "gpt2", "precision": "fp8"}, "precision"),
    ({"model": "gpt2", "batch": "-3"}, "batch"),
    ({"model": "gpt2", "zero": "zero3", "engine": "torch"}, None),  # DeepSpeed runs ZeRO on one rank; FSDP2 does not
]


@pytest.mark.parametrize("values,field", BAD, ids=lambda v: "-".join(v.values()) if isinstance(v, dict) else "")
def test_bad_input_is_a_400_with_the_clis_one_line(client, values, field):
    reply = client.post("/api/plan", json=values)
    assert reply.status_code == 400
    error = reply.json()
    assert error["field"] == field
    assert "\n" not in error["error"] and error["error"]
    code, _, err = cli(["plan", values["model"], *[f"{flag(k)}={v}" for k, v in values.items() if k != "model"]])
    assert code == 2
    assert err.strip() == f"error: {error['error']}"


def test_what_the_cli_cannot_be_asked_is_a_400_too(client):
    for body, words in [(b"not json", "JSON object"), (b"[1, 2]", "JSON object"),
                        (json.dumps({"model": "gpt2", "emit": "/tmp/x"}).encode(), "unknown field"),
                        (json.dumps({"model": "gpt2", "config": "a.yaml"}).encode(), "unknown field"),
                        (json.dumps({"batch": "4"}).encode(), "choose a model"),
                        (json.dumps({"model": "./my-model/config.json"}).encode(), "catalog models"),
                        (json.dumps({"model": "gpt2", "seq": "9" * 500}).encode(), "at most")]:
        reply = client.post("/api/plan", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and words in reply.json()["error"], body


def test_the_options_are_memfits_own_vocabularies(client):
    options = client.get("/api/options").json()
    fields = {f["name"]: f for f in options["fields"]}
    assert [s["value"] for s in fields["model"]["suggestions"]] == catalog_names()
    assert {s["value"] for s in fields["gpu"]["suggestions"]} == set(gpu_catalog())
    for name, enum in [("precision", Precision), ("optimizer", Optimizer), ("checkpointing", Checkpointing),
                       ("attention", Attention), ("zero", Sharding), ("offload", Offload), ("engine", Engine)]:
        assert fields[name]["kind"] == "choice" and fields[name]["choices"] == [m.value for m in enum]
    for name in ("batch", "seq", "accum", "gpus", "nodes", "cpu_ram", "margin", "keep"):
        assert fields[name]["kind"] == "text"
    assert fields["precision"]["default"] == "amp-bf16" and fields["gpu"]["default"] == "A100-80GB"
    assert "config" not in fields and options["initial"]["model"] in catalog_names()
    # every option of `memfit plan` in the setup and hardware panels is on the page: model, GPU and method first,
    # then GPUs, micro-batch and sequence length; the rest folded by section, each section in --help order
    from memfit.cli.options import option_parameters

    help_order = ["model", *[p.name for p in option_parameters(planning=True) if p.name != "config"]]
    assert sorted(fields) == sorted(help_order)
    assert list(fields)[:6] == ["model", "gpu", "method", "gpus", "batch", "seq"]
    sections = [s["name"] for s in options["sections"]]
    assert [s["open"] for s in options["sections"]] == [True] + [False] * (len(sections) - 1)
    assert {f["section"] for f in fields.values()} == set(sections)
    assert [f["section"] for f in fields.values()] == sorted((f["section"] for f in fields.values()),
                                                             key=sections.index)
    for section in sections[1:]:
        names = [n for n, f in fields.items() if f["section"] == section]
        assert names == [n for n in help_order if n in names]
    assert {f["panel"] for f in fields.values()} == set(options["panels"])


def test_the_page_and_its_scripts_are_served_locally(client):
    from plotly.offline import get_plotlyjs

    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text and "/static/plotly.min.js" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http" not in page.text.replace("http-equiv", "")  # nothing on the page points elsewhere
    assert client.get("/static/plotly.min.js").text == get_plotlyjs()
    assert "fetch(\"/api/plan\"" in client.get("/static/app.js").text
    assert client.get("/static/style.css").status_code == 200
    assert client.get("/static/../core.py").status_code == 404
    assert client.get("/static/nothing.js").status_code == 404


def test_on_loopback_it_answers_loopback_host_names_only():
    with TestClient(web.create_app(allowed_hosts=web.LOOPBACK_NAMES), base_url="http://attacker.example") as other:
        assert other.get("/api/options").status_code == 400
    with TestClient(web.create_app(allowed_hosts=web.LOOPBACK_NAMES), base_url="http://127.0.0.1:8765") as local:
        assert local.get("/api/options").status_code == 200


def _python(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                          **kwargs)


@pytest.mark.processes
def test_the_cli_imports_no_web_framework_until_serve_runs():
    result = _python("import sys; import memfit.cli.app, memfit.serve, memfit.serve.core; "
                     "print(sorted(m for m in ('starlette', 'uvicorn', 'plotly') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.processes
def test_serve_without_the_extra_is_one_line_and_exit_2():
    result = _python("import sys; sys.modules['starlette'] = None; sys.argv = ['memfit', 'serve', '--no-browser']; "
                     "from memfit.cli import main; main()")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'memfit[serve]'" in lines[0] and result.stdout == ""


@pytest.mark.processes
def test_memfit_serve_listens_on_localhost_and_stops_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-c", "from memfit.cli import main; main()", "serve", "--port", "0",
                             "--no-browser"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("memfit serve: http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[2]
        with urllib.request.urlopen(url + "api/options", timeout=10) as reply:
            assert json.load(reply)["fields"][0]["name"] == "model"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_a_taken_port_is_one_line_and_exit_2():
    with web.running() as url:
        port = url.rstrip("/").rsplit(":", 1)[1]
        code, _, err = cli(["serve", "--port", port, "--no-browser"])
    assert code == 2 and err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


# ---- in a real browser ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    yield from browser_for("the page's browser test", local_hosts=("127.0.0.1",))


# Sets an input as a person would (value, then the input event) and waits for the page's answer to land.
_CHANGE_JS = """
(async () => {
  const before = Number(document.body.dataset.updates);
  const input = document.getElementById(%(id)s);
  input.value = %(value)s;
  input.dispatchEvent(new Event('input', {bubbles: true}));
  const deadline = Date.now() + 20000;
  while (Number(document.body.dataset.updates) <= before) {
    if (Date.now() > deadline) throw new Error('the page did not update');
    await new Promise(r => setTimeout(r, 25));
  }
  return document.body.dataset.state;
})()
"""
_FIRST_JS = """
(async () => {
  const deadline = Date.now() + 20000;
  while (Number(document.body.dataset.updates) < 1) {
    if (Date.now() > deadline) throw new Error('the page never showed a plan');
    await new Promise(r => setTimeout(r, 25));
  }
  return document.body.dataset.state;
})()
"""
# The form as a person sees it: the inputs shown (not folded away), in page order, and the folded sections.
_FORM_JS = """(() => ({
  shown: [...document.querySelectorAll('#fields input, #fields select')]
           .filter(n => n.checkVisibility()).map(n => n.name),
  all: [...document.querySelectorAll('#fields input, #fields select')].map(n => n.name),
  folded: [...document.querySelectorAll('#fields details')].filter(d => !d.open)
           .map(d => d.querySelector('summary').textContent)}))()"""
_CHART_JS = "JSON.stringify(document.getElementById('memfit-breakdown').data.map(t => [t.name, t.y, t.x]))"
_ERROR_JS = """(() => { const box = document.getElementById('form-error');
  return {shown: !box.hidden && box.offsetHeight > 0, text: box.textContent,
          invalid: [...document.querySelectorAll('[aria-invalid=true]')].map(n => n.name),
          stale: !document.getElementById('stale').hidden}; })()"""


def change(tab, field: str, value: str) -> str:
    return tab.evaluate(_CHANGE_JS % {"id": json.dumps("f-" + field), "value": json.dumps(value)})


def test_the_page_in_a_browser(browser):
    with web.running() as url, browser.tab(url) as tab:
        assert tab.evaluate(_FIRST_JS) == "ready"
        first = tab.report()
        assert first.problems == [], "the page did not load cleanly from the local server"
        assert first.img_count == 0
        plot = first.plots["memfit-breakdown"]
        assert plot["bars_drawn"] > 0 and plot["shapes"] == 2  # stacked bars, the capacity and budget lines
        assert "fits after" in first.text and "Ladder" in first.text and "TrainingArguments" in first.text
        chart = tab.evaluate(_CHART_JS)

        # model, GPU and method first, then GPUs, micro-batch and sequence length; nothing else shown until opened
        form = tab.evaluate(_FORM_JS)
        assert form["shown"] == ["model", "gpu", "method", "gpus", "batch", "seq"] == form["all"][:6]
        assert form["all"] == [f["name"] for f in core.form_fields()]
        sections = [s["name"] for s in core.options()["sections"][1:]]
        assert [text.rsplit(" (", 1)[0] for text in form["folded"]] == sections

        assert change(tab, "batch", "2") == "ready"
        smaller = tab.evaluate(_CHART_JS)
        assert smaller != chart, "a smaller micro-batch did not change the chart's data"
        assert "--batch 2" in tab.evaluate("document.getElementById('command').textContent")

        assert change(tab, "model", "gpt2") == "ready"
        other_model = tab.evaluate(_CHART_JS)
        assert other_model != smaller, "another model did not change the chart's data"
        assert tab.report().problems == []

        expected = {}
        for field, value in [("batch", "0"), ("model", "llama-3.1-8bx")]:
            with TestClient(web.create_app()) as api:
                values = {"model": "gpt2", "batch": "2", field: value}
                expected[field] = api.post("/api/plan", json=values).json()["error"]
            assert change(tab, field, value) == "error"
            error = tab.evaluate(_ERROR_JS)
            assert error == {"shown": True, "text": expected[field], "invalid": [field], "stale": True}
            assert tab.evaluate(_CHART_JS) == other_model, "a mistake must leave the last chart as it was"
            change(tab, field, {"batch": "2", "model": "gpt2"}[field])  # put it back before the next mistake

        assert tab.evaluate(_ERROR_JS)["shown"] is False
        assert change(tab, "accum", "0") == "error"  # a mistake in a folded section opens it, marked
        assert tab.evaluate(_ERROR_JS)["invalid"] == ["accum"] and "accum" in tab.evaluate(_FORM_JS)["shown"]
        assert change(tab, "accum", "") == "ready"
        assert tab.evaluate(_CHART_JS) == other_model
        last = tab.report()
        # the only console lines: Chromium's own note on each 400 answer
        assert [m for m in last.console_errors if "status of 400" not in m] == []
        assert sum("status of 400" in m for m in last.console_errors) == 3
        assert last.exceptions == last.external_requests == last.failed_requests == last.dialogs == []
        requests = tab.requests()
        assert requests and all(origin_of(r) == origin_of(url) for r in requests)
        assert origin_of(url).startswith("http://127.0.0.1:")
