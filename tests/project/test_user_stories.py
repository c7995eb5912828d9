"""docs/user-stories.md is generated from the CLI (scripts/user_stories.py): it must say what memfit says today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("user_stories", ROOT / "scripts" / "user_stories.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_user_stories_page_is_what_memfit_prints_today():
    stories = _generator()
    assert (ROOT / "docs" / "user-stories.md").read_text() == stories.page(), \
        "docs/user-stories.md is stale: run python scripts/user_stories.py"


def test_every_flagship_story_is_there():
    titles = [s.title for s in _generator().STORIES]
    for needle in ("8B, full fine-tune on one 80 GB", "8B LoRA on a 24 GB", "8B QLoRA on a 24 GB",
                   "70B QLoRA on one 48 GB", "70B QLoRA on 2 x 24 GB", "Mixtral-8x7B on 8 x H100"):
        assert any(needle in t for t in titles), needle


def test_the_frameworks_page_is_what_memfit_prints_today():
    stories = _generator()
    assert (ROOT / "docs" / "frameworks.md").read_text() == stories.frameworks_page(), \
        "docs/frameworks.md is stale: run python scripts/user_stories.py"


def test_every_framework_has_a_one_gpu_and_a_multi_gpu_story():
    titles = [s.title for s in _generator().FRAMEWORK_STORIES]
    for framework in ("HF Trainer", "DeepSpeed", "LitGPT", "Lightning"):
        mine = [t for t in titles if framework in t]
        assert any("one " in t for t in mine) and any(" x " in t for t in mine), (framework, mine)
    assert any("CPUOffloadOptimizer" in t for t in titles)
