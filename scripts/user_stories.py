"""Writes docs/user-stories.md (the flagship questions) and docs/frameworks.md (a one-GPU and a multi-GPU story per
framework people train with), each story as the command a user types and the part of memfit's answer that decides
it (ladder, verdict, what would fit, the config or launch), generated from the CLI so the pages never drift from what
memfit says. tests/project/test_user_stories.py regenerates them in memory and compares.

    python scripts/user_stories.py            # rewrite both pages
    python scripts/user_stories.py --check    # exit 1 when a page is stale
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "user-stories.md"
FRAMEWORKS_PAGE = ROOT / "docs" / "frameworks.md"
WIDTH = "100"


@dataclass(frozen=True)
class Story:
    title: str
    who: str
    args: tuple[str, ...]
    sections: tuple[str, ...] = ("Ladder", "Verdict", "What would fit")
    """The headings of the plan output to show (each up to the next heading)."""
    after: str = ""


STORIES = (
    Story("Llama-3.1-8B, full fine-tune on one 80 GB GPU",
          "You have one A100-80GB and want to fine-tune all 8B parameters at 2k tokens, micro-batch 8.",
          ("plan", "llama-3.1-8b", "--gpu", "A100-80GB"),
          after="The ladder stops at the first setup that fits; `--optimize` also searches every combination for "
                "the fastest fitting one, and `--emit DIR` writes the configs of the setup that was sized."),
    Story("Llama-3.1-8B LoRA on a 24 GB card",
          "An RTX 4090 (24 GB), LoRA on all linear layers, 2k tokens.",
          ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--method", "lora", "--lora-targets", "all-linear")),
    Story("Llama-3.1-8B QLoRA on a 24 GB card",
          "The same card with a 4-bit base (bitsandbytes NF4 + peft, as the QLoRA paper runs it).",
          ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--method", "qlora", "--lora-targets", "all-linear")),
    Story("Llama-3.1-70B QLoRA on one 48 GB GPU",
          "One 48 GB card (A6000 / L40S), QLoRA r=16 on all linear layers, micro-batch 1 at 2k tokens.",
          ("plan", "llama-3.1-70b", "--gpu", "48GB", "--method", "qlora", "-r", "16", "--lora-targets",
           "all-linear", "-b", "1", "-s", "2048"),
          after="Static memory is the question here: the 4-bit base is ~33 GiB, and peft's "
                "`prepare_model_for_kbit_training` keeps the 128k-vocabulary embedding and LM head in fp32 "
                "(~7.8 GiB). The 8-bit adapter states bring static memory under the budget and the activation "
                "rungs follow; what is left over is stated, with the GPU count and the larger GPU on which memfit "
                "plans the same recipe to a fit."),
    Story("Llama-3.1-70B QLoRA on 2 x 24 GB with FSDP",
          "Two RTX 3090s, the FSDP-QLoRA recipe: the packed 4-bit base sharded by FSDP2, checkpointing.",
          ("plan", "llama-3.1-70b", "--gpu", "RTX-3090", "--gpus", "2", "--method", "qlora", "-b", "1", "-s",
           "2048"),
          after="DeepSpeed's ZeRO-3 does not shard a packed 4-bit base, so the ZeRO rung runs on torch's FSDP2 and "
                "says so."),
    Story("Mixtral-8x7B on 8 x H100",
          "A full fine-tune of the 47B-parameter mixture of experts on one 8-GPU node.",
          ("plan", "mixtral-8x7b", "--gpu", "H100", "--gpus", "8")),
)

CONFIGS = "tests/data/configs"
FRAMEWORK_STORIES = (
    Story("HF Trainer with accelerate's FSDP1 on 8 x A100-40GB",
          "Llama-3.1-8B, full fine-tune, micro-batch 4 at 4k tokens, launched with `accelerate launch --config_file "
          "accelerate_fsdp1.yaml train.py`: accelerate's FSDP without `fsdp_version` is FSDP1 (flat parameters per "
          "decoder layer, `use_orig_params`).",
          ("plan", "llama-3.1-8b", "--gpu", "A100-40GB", "--config", f"{CONFIGS}/accelerate_fsdp1.yaml", "-b", "4",
           "-s", "4096"),
          sections=("Ladder", "Verdict", "Launch")),
    Story("HF Trainer with DeepSpeed ZeRO-2 on one 80 GB GPU",
          "Mistral-7B, full fine-tune: `training_args.yaml` names `deepspeed_zero2.json`. DeepSpeed on one GPU "
          "casts the module to bf16 and keeps an fp32 master copy in its optimizer; ZeRO-2 shards nothing there.",
          ("plan", "mistral-7b-v0.3", "--gpu", "A100-80GB", "--config", f"{CONFIGS}/training_args.yaml"),
          sections=("Ladder", "Verdict")),
    Story("HF Trainer with DeepSpeed ZeRO-3 and CPU offload on 8 x RTX 4090",
          "The Trainer's `training_args.json` names `deepspeed_zero3_offload.json`, whose `train_batch_size` (128 = "
          "2 x 8 x 8 ranks) sets the world size; memfit reads both, with the knobs as configured (buckets, "
          "prefetch, persistence threshold).",
          ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--config", f"{CONFIGS}/training_args.json"),
          sections=("Verdict", "Launch")),
    Story("DeepSpeed ZeRO-3 as configured, Llama-3.1-70B on 8 x H100",
          "A `deepspeed_zero3.json` with its own bucket and prefetch sizes, full fine-tune at the config's batch.",
          ("plan", "llama-3.1-70b", "--gpu", "H100", "--gpus", "8", "--config", f"{CONFIGS}/deepspeed_zero3.json"),
          sections=("Ladder", "Verdict")),
    Story("LitGPT LoRA on one 24 GB card",
          "`litgpt finetune_lora --config litgpt_lora.yaml` for Llama-3.1-8B at 1k tokens. memfit sizes LitGPT's own "
          "model (fused qkv, 128-token loss chunks) and speaks LitGPT: a rung its scripts cannot make (checkpointing "
          "on one device, activation offload) is passed over, and each step is a key of its config.",
          ("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--config", f"{CONFIGS}/litgpt_lora.yaml", "-s", "1024"),
          sections=("Ladder", "Rungs passed over", "Verdict", "Configuration for the final setup"),
          after="`--emit DIR` writes that `litgpt.yaml` (and a README), not Hugging Face files: they would run a "
                "different model."),
    Story("LitGPT full fine-tune on 4 x A100-80GB",
          "`litgpt finetune_full` with `devices: 4`: LitGPT shards the model with FSDP and checkpoints every block.",
          ("plan", "llama-3.1-8b", "--gpu", "A100-80GB", "--config", f"{CONFIGS}/litgpt_full.yaml"),
          sections=("Verdict", "Launch")),
    Story("Lightning Trainer with FSDPStrategy on 4 x L40S",
          "A LightningCLI config: `strategy: fsdp`, `precision: bf16-mixed`, Llama-3.2-3B at 4k tokens.",
          ("plan", "llama-3.2-3b", "--gpu", "L40S", "--config", f"{CONFIGS}/lightning_fsdp.yaml", "-b", "4", "-s",
           "4096"),
          sections=("Ladder", "Verdict"),
          after="The precision plugin and the strategy are read as Lightning runs them; the ladder's change lines "
                "are still written for the HF Trainer and torchtune (a Lightning user turns on checkpointing with "
                "FSDPStrategy's `activation_checkpointing_policy` and chooses the loss in their own module)."),
    Story("Lightning, bf16-true on one 24 GB card",
          "`precision: bf16-true` casts the module: bf16 weights, gradients and AdamW states (no fp32 master copy).",
          ("plan", "llama-3.2-3b", "--gpu", "RTX-4090", "--config", f"{CONFIGS}/lightning_one_gpu.yaml", "-b", "2",
           "-s", "2048"),
          sections=("Ladder", "Verdict")),
    Story("torchao's CPUOffloadOptimizer on one 24 GB card",
          "Llama-3.2-3B in bf16 with `CPUOffloadOptimizer(..., offload_gradients=True)`: AdamW's states and step on "
          "the host, each gradient freed once copied there. It is a one-GPU optimizer wrapper; on several GPUs the "
          "same saving is ZeRO-Offload (DeepSpeed) or FSDP's CPU offload.",
          ("plan", "llama-3.2-3b", "--gpu", "RTX-4090", "--precision", "bf16", "--cpu-offload-optimizer", "grads",
           "-b", "1", "-s", "2048"),
          sections=("Peak memory", "Verdict")),
)

_HEADINGS = ("Peak memory", "Where the rule of thumb differs", "Ladder", "Rungs passed over", "Verdict",
             "What would fit", "Configuration for the final setup", "Launch", "Communication per step", "Read from")


def run(story: Story) -> str:
    """The CLI's text answer, as a user on a 100-column terminal sees it."""
    from typer.testing import CliRunner

    from memfit.cli.app import app

    with contextlib.chdir(ROOT):  # the stories' config paths are relative to the repository
        result = CliRunner(env={"COLUMNS": WIDTH, "NO_COLOR": "1", "TERM": "dumb"}).invoke(app, list(story.args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.stdout


def sections(text: str, wanted: tuple[str, ...]) -> str:
    """The output's sections named in `wanted`, in their order, each from its heading to the next heading."""
    lines = [line.rstrip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(_HEADINGS)]
    out = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        if lines[start].startswith(wanted):
            block = lines[start:end]
            while block and not block[-1]:
                block.pop()
            out.append("\n".join(block))
    return "\n\n".join(out)


INTRO = ("The flagship questions, as a user asks them, with the part of memfit's answer that decides each one.",
         "Generated by `python scripts/user_stories.py` from the CLI itself (the test suite checks it is "
         "current), so every figure here is what memfit prints today. All figures are memfit's analytic "
         "estimate; how the estimate is proven is in [accuracy](accuracy.md).")
FRAMEWORKS_INTRO = ("A one-GPU and a multi-GPU story for each framework memfit reads: the command with the config "
                    "the user already has, memfit's answer, and what it emits.",
                    "Generated by `python scripts/user_stories.py` from the CLI itself (the test suite checks it is "
                    "current). The config files are in `tests/data/configs/`; how each framework's mechanisms were "
                    "measured is in [accuracy](accuracy.md) and [limits](limits.md).")


def page(stories: tuple[Story, ...] = STORIES, title: str = "User stories", intro: tuple[str, str] = INTRO) -> str:
    parts = [f"# {title}", "", intro[0], intro[1], ""]
    for story in stories:
        command = "memfit " + " ".join(story.args)
        parts += [f"## {story.title}", "", story.who, "", "```bash", command, "```", "", "```",
                  sections(run(story), story.sections), "```", ""]
        if story.after:
            parts += [story.after, ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(parts)).rstrip() + "\n"


def frameworks_page() -> str:
    return page(FRAMEWORK_STORIES, "Frameworks: one GPU and many", FRAMEWORKS_INTRO)


PAGES = ((PAGE, page), (FRAMEWORKS_PAGE, frameworks_page))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = parser.parse_args()
    stale = 0
    for path, make in PAGES:
        text = make()
        if args.check:
            if (path.read_text() if path.exists() else "") != text:
                print(f"{path.relative_to(ROOT)} is stale: run python scripts/user_stories.py", file=sys.stderr)
                stale = 1
            continue
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return stale


if __name__ == "__main__":
    raise SystemExit(main())
