"""RL post-training phases (memfit.rl) against real TRL steps on CPU, and vLLM's KV-cache arithmetic against vLLM's
formulas and published logs.

    OMP_NUM_THREADS=1 python bench/rl.py            # every case (a few minutes on one core), writes bench/results/rl.md
    OMP_NUM_THREADS=1 python bench/rl.py --quick    # two cases, printed only

Each measured case runs TRL's GRPOTrainer / RLOOTrainer (use_vllm=False: HF generate), DPOTrainer, KTOTrainer, or
trl.experimental's ORPOTrainer / CPOTrainer (CPO, and SimPO: loss_type simpo, cpo_alpha 0) on a tiny model (tests/
tiny_configs.py) in fp32 on CPU and profiles its second step with the profiler's memory events; every phase's peak
(generation, reference / old-policy log-probs, training) is compared with memfit's figure for that phase
(memfit.rl.measure, memfit.rl.phases). vLLM cannot run here: its page sizes and budget are checked against the
formulas in vllm/v1/kv_cache_interface.py and vllm/v1/worker/gpu_worker.py and against published H100 logs."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from tiny_configs import TINY_LLAMA, TINY_MISTRAL, TINY_QWEN2  # noqa: E402

RESULTS = HERE / "results"
GRPO_CASES = (
    ("llama", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
    ("llama long completion", TINY_LLAMA, dict(batch=4, num_generations=4, prompt_len=16, completion_len=128)),
    ("llama long prompt, beta 0", TINY_LLAMA, dict(batch=8, num_generations=4, prompt_len=64, completion_len=32,
                                                   beta=0.0)),
    ("llama LoRA", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64, lora=True)),
    ("llama checkpointing", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64,
                                             checkpointing=True)),
    ("qwen2 (GQA, tied)", TINY_QWEN2, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
    ("mistral sliding 48", dict(TINY_MISTRAL, sliding_window=48),
     dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
)
DPO_CASES = (
    ("llama online ref", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48)),
    ("llama precomputed ref", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, precompute=True)),
    ("llama precompute pass", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, precompute="phase")),
    ("llama LoRA precompute pass", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, precompute="phase",
                                                    lora=True)),
    ("llama LoRA", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, lora=True)),
    ("llama short", TINY_LLAMA, dict(batch=2, prompt_len=64, completion_len=16)),
)
RLOO_CASES = (
    ("llama", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
    ("llama beta 0 (old policy only)", TINY_LLAMA, dict(batch=8, num_generations=4, prompt_len=64,
                                                         completion_len=32, beta=0.0)),
    ("llama LoRA", TINY_LLAMA, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64, lora=True)),
    ("qwen2 (GQA, tied)", TINY_QWEN2, dict(batch=8, num_generations=8, prompt_len=32, completion_len=64)),
)
KTO_CASES = (
    ("llama", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48)),
    ("llama LoRA", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, lora=True)),
    ("qwen2 (GQA, tied)", TINY_QWEN2, dict(batch=8, prompt_len=16, completion_len=32)),
)
PREFERENCE_CASES = (
    ("orpo", "llama", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48)),
    ("orpo", "llama LoRA", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, lora=True)),
    ("orpo", "llama checkpointing", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, checkpointing=True)),
    ("orpo", "qwen2 (GQA, tied)", TINY_QWEN2, dict(batch=8, prompt_len=16, completion_len=32)),
    ("cpo", "llama", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48)),
    ("cpo", "qwen2 (GQA, tied)", TINY_QWEN2, dict(batch=2, prompt_len=64, completion_len=16)),
    ("simpo", "llama", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48)),
    ("simpo", "llama LoRA", TINY_LLAMA, dict(batch=4, prompt_len=32, completion_len=48, lora=True)),
)
"""ORPO, CPO and SimPO (trl.experimental): (trainer, case, config, fields)."""
PREFERENCE = ("orpo", "cpo", "simpo")
BETA = {"grpo": 0.04, "rloo": 0.05, "dpo": 0.1, "kto": 0.1, "orpo": 0.1, "cpo": 0.1, "simpo": 0.1}
NAMES = {"log-probs": "reference"}
HEAD_CASES = ((8, 16, 64), (4, 64, 32), (16, 8, 128))
"""(batch, prompt, completion) for TRL 0.x's heads over materialised logits, measured without a trainer."""


def head_rows() -> list[tuple[str, str, str, int, int]]:
    """TRL 0.x's `selective_log_softmax` and the naive log-softmax: the no-grad pass (the log-probs phase's forward)
    and forward + backward (the core's activations + the head's backward terms), on the tiny Llama."""
    from memfit.api import as_spec
    from memfit.estimate.analytic import estimate
    from memfit.estimate.result import Category
    from memfit.hardware import cpu_device, make_hardware
    from memfit.rl import RLSetup, measure
    from memfit.rl.phases import _head_backward, _no_grad_forward, _pick, training_setup

    spec, hardware = as_spec(dict(TINY_LLAMA)), make_hardware(cpu_device(1 << 40))
    rows = []
    for (batch, prompt, completion), kind in itertools.product(HEAD_CASES, ("selective", "full")):
        rl = RLSetup(per_device_train_batch_size=batch, max_prompt_length=prompt, max_completion_length=completion,
                     bf16=False, gradient_checkpointing=False, logprob_head=kind)
        core = estimate(spec, training_setup(rl, hardware, batch).replace(loss="standard"), hardware)
        for train in (False, True):
            measured = measure.measure_logits_head(TINY_LLAMA, batch=batch, prompt_len=prompt,
                                                   completion_len=completion, kind=kind, train=train)
            terms = (_pick(core, Category.ACTIVATIONS) + _head_backward(spec, rl, batch) if train
                     else _no_grad_forward(spec, rl, batch))
            rows.append(("trl 0.x head", f"{kind} B{batch} P{prompt} C{completion}",
                         "forward+backward" if train else "no-grad log-probs", measured,
                         spec.num_params * 4 + sum(t.num_bytes for t in terms)))
    return rows


CRITIC_CASES = (("llama", TINY_LLAMA, (4, 32, 64)), ("llama short", TINY_LLAMA, (8, 16, 32)),
                ("qwen2 (GQA, tied)", TINY_QWEN2, (4, 32, 64)))
"""PPO's critic update (batch, prompt, completion): trl 1.16 has no PPOTrainer, so the value model's step is
measured alone as verl's dp_critic runs it (memfit.rl.measure.measure_critic)."""


def critic_rows() -> list[tuple[str, str, str, int, int]]:
    """memfit's critic phase with the policy and the reference offloaded (verl param / optimizer offload), less the
    rollout's buffers, plus the measured step's input ids: the value model's own update."""
    from memfit.api import as_spec
    from memfit.estimate.terms import TermKey
    from memfit.hardware import cpu_device, make_hardware
    from memfit.rl import RLSetup, estimate_rl, measure

    rows = []
    for label, config, (batch, prompt, completion) in CRITIC_CASES:
        measured = measure.measure_critic(config, batch=batch, prompt_len=prompt, completion_len=completion)
        rl = RLSetup(trainer="ppo", per_device_train_batch_size=batch, num_generations=1, max_prompt_length=prompt,
                     max_completion_length=completion, beta=0.0, param_offload=True, optimizer_offload=True,
                     bf16=False, gradient_checkpointing=False, triton=False)
        phase = next(p for p in estimate_rl(as_spec(dict(config)), rl, make_hardware(cpu_device(1 << 40))).phases
                     if p.name == "critic")
        rollout = sum(t.num_bytes for t in phase.terms if t.name == TermKey.ROLLOUT_INPUTS)
        rows.append(("ppo", f"critic {label} B{batch} P{prompt} C{completion}", "critic", measured,
                     phase.tensor_bytes - rollout + batch * (prompt + completion) * 8 + 2 * batch * completion * 4))
    return rows


def _rl_setup(trainer: str, fields: dict):
    from memfit.rl import RLSetup

    # KTOTrainer appends the EOS token to every (non-conversational) completion (kto_trainer.py `add_eos`), ORPO and
    # CPO to chosen and rejected (`add_eos_token_if_needed`)
    completion = fields["completion_len"] + (1 if trainer in ("kto",) + PREFERENCE else 0)
    return RLSetup(trainer=trainer, per_device_train_batch_size=fields["batch"],
                   num_generations=fields.get("num_generations", 8), max_prompt_length=fields["prompt_len"],
                   max_completion_length=completion, beta=fields.get("beta", BETA[trainer]),
                   lora=fields.get("lora", False), lora_rank=8,
                   precompute_ref_log_probs=bool(fields.get("precompute", False)),
                   gradient_checkpointing=fields.get("checkpointing", False), bf16=False, triton=False)


def run_case(trainer: str, label: str, config: dict, fields: dict) -> list[tuple[str, str, str, int, int]]:
    """[(trainer, case, phase, measured, memfit)] for the phases measured in the profiled step."""
    from memfit.api import as_spec
    from memfit.hardware import cpu_device, make_hardware
    from memfit.rl import estimate_rl, measure

    measured_fields = dict(fields)
    with tempfile.TemporaryDirectory() as out:
        if trainer in ("grpo", "rloo"):
            measured = measure.measure_grpo(config, beta=measured_fields.pop("beta", BETA[trainer]), output_dir=out,
                                            trainer=trainer, **measured_fields)
        elif trainer == "kto":
            measured = measure.measure_kto(config, output_dir=out, **measured_fields)
        elif trainer in PREFERENCE:
            measured = measure.measure_preference(config, trainer=trainer, output_dir=out, **measured_fields)
        else:
            measured = measure.measure_dpo(config, output_dir=out, **measured_fields)
    result = estimate_rl(as_spec(dict(config)), _rl_setup(trainer, fields), make_hardware(cpu_device(1 << 40)))
    rows = []
    for phase in result.phases:
        name = NAMES.get(phase.name, phase.name)
        if name in measured:
            rows.append((trainer, label, phase.name, measured[name], phase.tensor_bytes))
    return rows


def vllm_rows() -> list[tuple[str, str, str]]:
    """(what, memfit, vLLM's formula / the published figure)."""
    from memfit.api import as_spec
    from memfit.rl.generation import (GiB, SAMPLER_BYTES_PER_SEQ_VOCAB, KVLayer, VllmBudget, kv_layers,
                                      vllm_bytes_per_token, vllm_page_size_bytes)

    llama = as_spec("llama-3.1-8b")
    rows = [("Llama-3.1-8B page, bf16 (FullAttentionSpec)", f"{vllm_page_size_bytes(kv_layers(llama)[0], 2):,}",
             "16 x 8 x (128 + 128) x 2 = 65,536"),
            ("Llama-3.1-8B page, fp8", f"{vllm_page_size_bytes(kv_layers(llama)[0], 1):,}", "32,768"),
            ("Llama-3.1-8B KV per token", f"{vllm_bytes_per_token(llama, 2):,}", "32 layers x 4,096 = 131,072"),
            ("DeepSeek-V3 MLA page (MLAAttentionSpec)",
             f"{vllm_page_size_bytes(KVLayer(128, 192, 128, None, 576, 61), 2):,}", "16 x 1 x 576 x 2 = 18,432"),
            ("Gemma-2-9B sliding page (SlidingWindowSpec)",
             f"{vllm_page_size_bytes(kv_layers(as_spec('gemma-2-9b'))[0], 2):,}", "16 x 8 x (256 + 256) x 2 = 131,072")]
    budget = VllmBudget(total=int(79.18 * GiB), utilization=0.9, weights=int(14.99 * GiB),
                        activation_peak=int(4.76 * GiB), non_torch=int(0.13 * GiB), cuda_graphs=0,
                        bytes_per_token=131072)
    rows.append(("Llama-3.1-8B KV cache, util 0.9, H100", f"{budget.kv_cache / GiB:.2f} GiB", "51.38 GiB [llm-d]"))
    rows.append(("Llama-3.1-8B weights bf16", f"{2 * llama.num_params / GiB:.2f} GiB", "14.99 GiB [llm-d]"))
    for name, vocab, figure in (("Llama-3.1-8B", 128256, 4.76), ("Qwen3-0.6B", 151936, 5.56),
                                ("gpt-oss-20b", 201088, 7.38)):
        rows.append((f"{name} profile-run peak, 1024 seqs",
                     f"{SAMPLER_BYTES_PER_SEQ_VOCAB * 1024 * vocab / GiB:.2f} GiB", f"{figure} GiB [llm-d]"))
    return rows


def table(rows) -> list[str]:
    lines = ["| trainer | case | phase | measured | memfit | error |", "|---|---|---|---:|---:|---:|"]
    for trainer, label, phase, measured, predicted in rows:
        lines.append(f"| {trainer} | {label} | {phase} | {measured:,} | {predicted:,} | "
                     f"{100 * (predicted / measured - 1):+.2f}% |")
    return lines


def summary(rows) -> str:
    errors = [abs(predicted / measured - 1) for *_, measured, predicted in rows]
    return (f"{len(rows)} phases: median |error| {100 * statistics.median(errors):.2f}%, "
            f"worst {100 * max(errors):.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cases, printed only")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    cases = [("grpo", *GRPO_CASES[0]), ("dpo", *DPO_CASES[0])] if args.quick else \
        [("grpo", *case) for case in GRPO_CASES] + [("dpo", *case) for case in DPO_CASES] + \
        [("rloo", *case) for case in RLOO_CASES] + [("kto", *case) for case in KTO_CASES] + list(PREFERENCE_CASES)
    rows = []
    for trainer, label, config, fields in cases:
        rows += run_case(trainer, label, config, fields)
        print(f"measured {trainer} {label}", file=sys.stderr)
    heads = [] if args.quick else head_rows()
    critic = [] if args.quick else critic_rows()
    lines = table(rows) + ["", summary(rows)] + [
        f"- {trainer}: {summary([r for r in rows if r[0] == trainer])}" for trainer in ("grpo", "rloo", "dpo", "kto") + PREFERENCE
        if any(r[0] == trainer for r in rows)]
    if heads:
        lines += ["", "### TRL 0.x heads over materialised logits (no trainer: the model and the head)", "",
                  *table(heads), "", summary(heads)]
    if critic:
        lines += ["", "### PPO's critic update (value model alone: trl 1.16 has no PPOTrainer)", "",
                  *table(critic), "", summary(critic)]
    vllm = ["| what | memfit | vLLM's formula / published |", "|---|---:|---:|"] + [
        f"| {a} | {b} | {c} |" for a, b, c in vllm_rows()]
    print("\n".join(lines + [""] + vllm))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "rl.md").write_text("\n".join([
            "# RL post-training phases: memfit vs measured TRL steps", "",
            "Written by `OMP_NUM_THREADS=1 python bench/rl.py`. trl 1.16, transformers 5.24, torch 2.13 CPU, fp32, "
            "gradient checkpointing off unless the case says so; each phase's peak of live bytes (profiler memory "
            "events, the second step) "
            "against memfit's tensor bytes for that phase. TRL's fused log-prob head runs its torch fallback on "
            "CPU (every position scored, fp32 tile temporaries); on a GPU it runs Triton (memfit's default).", "",
            *lines, "",
            "## vLLM's KV cache and budget (vLLM cannot run here)", "",
            "Page sizes: vllm/v1/kv_cache_interface.py (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec "
            "`real_page_size_bytes`), block_size 16. Budget: vllm/v1/worker/gpu_worker.py "
            "`determine_available_memory` (requested = util x total; KV = requested - weights - profile peak - "
            "non-torch). [llm-d]: github.com/llm-d/llm-d-benchmark config_explorer/"
            "empirical-vllm-memory-results.md (H100, 79.18 GiB, util 0.9, max_num_seqs 1024).", "",
            *vllm, ""]))
        print(f"wrote {RESULTS / 'rl.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
