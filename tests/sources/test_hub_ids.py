"""Hub ids of catalog models resolve offline to their catalog entry, and a hub id memfit cannot resolve fails at
once offline (one `error:` line, exit 2, well under 2 s) instead of waiting on the network."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.errors import ModelSourceError
from memfit.sources import catalog_config, resolve_model
from memfit.sources import hf_config as hub
from memfit.sources.catalog import find_entry

ROOT = Path(__file__).resolve().parents[2]

# One row per catalog family: the hub ids people paste (training-framework examples, model cards) -> the entry
# whose config.json numbers they share. Chat / instruct / -hf / -it / -deduped repositories are fine-tunes of the
# same tensors; the entries' notes say where a config differs in something else (Llama 3 vs 3.1: the context).
HUB_IDS = [
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ("meta-llama/Llama-2-13b-hf", "llama-2-13b"),
    ("Llama-2-70b-chat-hf", "llama-2-70b"),
    ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),  # LLaMA-Factory's own example id
    ("META-LLAMA/meta-llama-3-70b-instruct", "llama-3-70b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"),
    ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("meta-llama/Llama-3.2-3B-Instruct", "llama-3.2-3b"),
    ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ("mistralai/Mixtral-8x22B-v0.1", "mixtral-8x22b"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("Qwen2.5-72B-Instruct", "qwen2.5-72b"),
    ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
    ("Qwen/Qwen1.5-MoE-A2.7B-Chat", "qwen1.5-moe-a2.7b"),
    ("Qwen/Qwen3-30B-A3B-Base", "qwen3-30b-a3b"),
    ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("google/gemma-3-1b-it", "gemma-3-1b"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini"),
    ("microsoft/phi-4", "phi-4"),
    ("EleutherAI/pythia-1b-deduped", "pythia-1b"),
    ("tiiuae/falcon-7b-instruct", "falcon-7b"),
    ("facebook/opt-1.3b", "opt-1.3b"),
    ("EleutherAI/gpt-j-6b", "gpt-j-6b"),
    ("stabilityai/stablelm-2-1_6b", "stablelm-2-1.6b"),
    ("allenai/OLMoE-1B-7B-0924-Instruct", "olmoe-1b-7b"),
    ("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite"),
    ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
    ("openai/gpt-oss-20b", "gpt-oss-20b"),
    ("openai-community/gpt2-xl", "gpt2-xl"),
    ("google-bert/bert-base-uncased", "bert-base-uncased"),
    ("google/flan-t5-base", "flan-t5-base"),
    ("facebook/bart-large", "bart-large"),
    ("google/vit-base-patch16-224", "vit-base-patch16-224"),
    ("facebook/dinov2-small", "dinov2-small"),
]


@pytest.fixture
def no_hub(monkeypatch):
    """Any call to the Hub fails the test: a catalog alias must never reach it."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("went to the Hub")

    monkeypatch.setattr(hub, "hub_config", refuse)
    monkeypatch.setattr(hub, "_hub_reachable", refuse)


@pytest.mark.parametrize("hub_id,name", HUB_IDS, ids=[h for h, _ in HUB_IDS])
def test_hub_id_resolves_offline_to_the_catalog_entry(no_hub, hub_id, name):
    spec, entry = resolve_model(hub_id), resolve_model(name)
    assert spec.name == name
    assert (spec.num_params, spec.num_layers, spec.hidden_size, spec.vocab_size, spec.max_position_embeddings) == (
        entry.num_params, entry.num_layers, entry.hidden_size, entry.vocab_size, entry.max_position_embeddings)


def test_every_catalog_family_has_a_hub_id_row():
    families = {find_entry(name)["family"] for _, name in HUB_IDS}
    raw = json.loads((ROOT / "src" / "memfit" / "data" / "models.json").read_text())
    assert families == {e["family"] for e in raw["models"]}


def test_llama_3_has_the_tensors_of_3_1_and_its_own_context():
    """Llama 3 and 3.1 have the same tensors (Meta's cards: 8.03B and 70.6B) but not the same config: 3.1 adds
    llama3 rope scaling and a 131072-token context, which memfit's context cap (`fit --max seq`) reads."""
    for size, published, last_digit in (("8b", 8.03e9, 0.01e9), ("70b", 70.6e9, 0.1e9)):
        three, three_one = resolve_model(f"llama-3-{size}"), resolve_model(f"llama-3.1-{size}")
        assert three.num_params == three_one.num_params and abs(three.num_params - published) <= last_digit / 2
        assert (three.max_position_embeddings, three_one.max_position_embeddings) == (8192, 131072)
        assert catalog_config(f"llama-3-{size}")["rope_scaling"] is None


def test_mistral_v0_3_is_its_own_entry():
    """v0.3 has a 32768 vocabulary (v0.1: 32000): 768 more rows in the embedding and in the head."""
    v1, v3 = resolve_model("mistral-7b"), resolve_model("mistral-7b-v0.3")
    assert v3.num_params - v1.num_params == 2 * 768 * 4096 and v3.num_params == 7_248_023_552


@pytest.mark.parametrize("ref", [
    "mistralai/Mistral-7B-Instruct-v0.2",  # v0.2: rope_theta 1e6 and no sliding window, unlike v0.1
    "mistralai/Mixtral-8x22B-Instruct-v0.1",  # a 32768 vocabulary, unlike the base
    "unsloth/Meta-Llama-3.1-8B-Instruct",  # another org's repository may change the tensors: not assumed
    "google-bert/bert-base-cased",  # another vocabulary
])
def test_a_hub_id_with_another_config_is_not_an_alias(ref):
    assert find_entry(ref) is None


def test_only_hub_ids_of_the_entrys_own_org_answer_by_repository_name():
    assert resolve_model("vit-b/16").name == "vit-base-patch16-224"
    assert find_entry("16") is None and find_entry("14") is None


# --- offline: fail at once -------------------------------------------------------------------------------------


def _run_cli(tmp_path: Path, model: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    base.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
                MEMFIT_CACHE_DIR=str(tmp_path / "memfit"), PYTHONPATH=str(ROOT / "src"), **env)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", "from memfit.cli import main; main()", "plan", model, "--gpu", "H100"],
                            capture_output=True, text=True, env=base, timeout=60)
    return result, time.monotonic() - started


@pytest.mark.parametrize("env", [
    {"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens there: the network is unavailable
    {"HF_HUB_OFFLINE": "1"},
], ids=["unreachable", "HF_HUB_OFFLINE"])
@pytest.mark.processes
def test_unknown_hub_id_offline_fails_in_one_line_at_once(tmp_path, env):
    """A real process: exit 2, one `error:` line, no wait on the network (huggingface_hub's retries alone take
    35-55 s; the bound leaves room for interpreter start-up on a loaded machine, the next test times the call)."""
    result, seconds = _run_cli(tmp_path, "someone-else/Llama-3.1-8B-finetuned", **env)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "'llama-3.1-8b'" in lines[0] and "local config.json path" in lines[0] and "offline" in lines[0]
    assert seconds < 15, seconds


@pytest.mark.parametrize("offline", [False, True], ids=["unreachable", "HF_HUB_OFFLINE"])
def test_the_cli_answers_an_unknown_hub_id_offline_in_under_two_seconds(tmp_path, monkeypatch, offline):
    from huggingface_hub import constants
    from typer.testing import CliRunner

    from memfit.cli.app import app

    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    started = time.monotonic()
    result = CliRunner().invoke(app, ["plan", "acme/widget-xyz", "--gpu", "H100"])
    seconds = time.monotonic() - started
    assert result.exit_code == 2 and "offline" in result.output and "local config.json path" in result.output
    assert seconds < 2, seconds


def test_hub_probe_is_bounded_even_when_the_name_lookup_hangs(monkeypatch):
    """socket.create_connection's timeout does not cover DNS; the probe's deadline does."""
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: time.sleep(30))
    started = time.monotonic()
    assert hub._hub_reachable(timeout_s=0.3) is False
    assert time.monotonic() - started < 1


@pytest.mark.processes
def test_offline_hub_id_fails_before_importing_transformers():
    code = ("import sys\nfrom memfit.sources import resolve_model\n"
            "try:\n    resolve_model('acme/widget-xyz')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "assert 'transformers' not in sys.modules")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ModelSourceError cannot get the config of 'acme/widget-xyz': offline")


@pytest.mark.processes
def test_a_cached_hub_config_still_resolves_offline(tmp_path):
    """Offline with the repository's config.json in the Hugging Face cache (its documented layout: refs/main names
    the snapshot): read from the cache through transformers, as before."""
    pytest.importorskip("transformers")
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    (snapshot / "config.json").write_text(json.dumps(config))
    code = ("from memfit.sources import resolve_model, hf_config_dict\n"
            "s = resolve_model('acme/tiny-llama'); c = hf_config_dict('acme/tiny-llama')\n"
            "print(s.num_layers, s.hidden_size, s.vocab_size, c['intermediate_size'])")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "64", "512", "128"]


def test_torchtune_builders_of_llama_3_and_3_3_name_their_catalog_entries():
    """torchtune's llama3 builders are Llama 3 (8192 context, no rope scaling); llama3_3's 70B is 3.1's config."""
    from memfit.readers.formats import torchtune_model

    assert torchtune_model("torchtune.models.llama3.lora_llama3_8b") == "llama-3-8b"
    assert torchtune_model("torchtune.models.llama3_1.lora_llama3_1_8b") == "llama-3.1-8b"
    assert torchtune_model("torchtune.models.llama3_3.qlora_llama3_3_70b") == "llama-3.1-70b"


def test_hub_probe_goes_through_the_https_proxy_unless_no_proxy_names_the_hub(monkeypatch):
    """Behind a proxy the Hub is reached through it (huggingface_hub uses requests, which honours HTTPS_PROXY and
    NO_PROXY): the probe connects where the request would go."""
    from huggingface_hub import constants

    tried = []

    def connect(address, timeout):
        tried.append(address)
        raise OSError("refused")

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.delenv("https_proxy", raising=False)  # the lower-case spelling wins where both are set
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert hub._hub_reachable(timeout_s=0.5) is False
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert hub._hub_reachable(timeout_s=0.5) is False
    assert tried == [("proxy.example", 3128), ("huggingface.co", 443)]
