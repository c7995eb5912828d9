"""Shared fixtures. Nothing here imports torch at import time: core tests must run without it."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest

# tests/ mirrors src/memfit (tests/estimate, tests/lora, ...); a few test modules share fixtures by importing another
# test module by name (`from test_lora import CPU`), whichever folder it sits in, and the worker scripts of the
# multi-process tests live in tests/ itself.
_TESTS = Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and p.name not in ("data", "__pycache__")):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

from tiny_configs import TINY_CONFIGS


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_config(request) -> dict:
    """Each tiny HF config in turn (a fresh copy), e.g. for 'builds and steps for every family' tests."""
    return copy.deepcopy(TINY_CONFIGS[request.param])


@pytest.fixture
def tiny_llama_config() -> dict:
    return copy.deepcopy(TINY_CONFIGS["llama"])


@pytest.fixture
def tiny_gpt2_config() -> dict:
    return copy.deepcopy(TINY_CONFIGS["gpt2"])


@pytest.fixture
def tiny_bert_config() -> dict:
    return copy.deepcopy(TINY_CONFIGS["bert"])


@pytest.fixture
def tiny_qwen2_config() -> dict:
    return copy.deepcopy(TINY_CONFIGS["qwen2"])


@pytest.fixture
def tiny_mistral_config() -> dict:
    return copy.deepcopy(TINY_CONFIGS["mistral"])


@pytest.fixture
def torch_cpu():
    """torch, with one intra-op thread so memory and timings do not depend on the runner's core count."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


@pytest.fixture
def make_plain_lm():
    """A factory for a small decoder written in plain PyTorch (no transformers): embedding, an nn.ModuleList of
    pre-norm blocks (SDPA causal attention + MLP), LM head. `model(input_ids=..., labels=...)` returns the loss."""
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, hidden: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            b, t, h = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
            x = x + self.out(attn.transpose(1, 2).reshape(b, t, h))
            return x + self.mlp(self.norm2(x))

    class PlainLM(nn.Module):
        def __init__(self, vocab_size: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab_size, hidden)
            self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False)

        def forward(self, input_ids, labels=None):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            if labels is None:
                return logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    def make(**sizes) -> "torch.nn.Module":
        torch.manual_seed(0)
        return PlainLM(**sizes)

    return make


@pytest.fixture
def isolated_accelerate():
    """TrainingArguments sets process-wide accelerate state and env vars; undo both so other tests see none."""
    saved = dict(os.environ)
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(saved)


PROCESS_MARKERS = ("processes", "browser")


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    """A test that starts another process (the CLI as a user runs it, a torchrun / gloo job, a browser) carries the
    `processes` (or `browser`) marker, so `-m "not processes"` is a quick in-process run and the marker says the
    truth: starting one unmarked fails the test. MEMFIT_MARK_AUDIT=FILE lists such tests in FILE instead."""
    import subprocess

    started: list[str] = []
    real_init = subprocess.Popen.__init__

    def recording_init(self, args, *a, **kw):
        if not _a_compiler_at_work():
            started.append(str(args)[:80])
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    yield
    marked = any(request.node.get_closest_marker(m) for m in PROCESS_MARKERS)
    if not started or marked:
        return
    audit = os.environ.get("MEMFIT_MARK_AUDIT")
    if audit:
        with open(audit, "a") as out:
            out.write(request.node.nodeid + "\n")
        return
    pytest.fail(f"started a process ({started[0]}) without @pytest.mark.processes", pytrace=False)


_TOOLCHAINS = (f"{os.sep}torch{os.sep}_inductor{os.sep}", f"{os.sep}torch{os.sep}utils{os.sep}cpp_extension",
               f"{os.sep}op_builder{os.sep}", f"{os.sep}triton{os.sep}")


def _a_compiler_at_work() -> bool:
    """torch.compile's inductor (g++, its compile workers) and JIT op builders start processes of their own: that is
    compiling, not the multi-process run the marker is about."""
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _TOOLCHAINS):
            return True
        frame = frame.f_back
    return False


def pytest_collection_modifyitems(config, items):
    """The browser tests are the ones that take the `browser` fixture (tests/browser_check.py starts chromium)."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(autouse=True)
def _no_state_leaks_between_tests():
    """What one test leaves in the process does not reach the next one on the same xdist worker: os.environ (the
    Trainer's TrainingArguments and accelerate's launcher write FSDP_* / ACCELERATE_* variables into it), accelerate's
    process-wide AcceleratorState / PartialState (a Trainer built in a later test would take their FSDP or mixed
    precision) and torch's intra-op thread count (Lightning sets it; CPU kernels' scratch is per thread)."""
    environ = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
