"""The terminal view of an RLEstimate: one bar per phase (never summed), the peak phase, the vLLM advice and the
TRL settings to paste."""

from __future__ import annotations

from ..units import format_bytes
from .ladder import RLPlan
from .workload import REFERENCE_FREE, RLEstimate

BAR_WIDTH = 40
CATEGORY_ORDER = ("parameters", "optimizer", "gradients", "activations", "temporaries", "overhead")


def _bar(total: int, scale: int, fits: bool) -> str:
    filled = max(1, round(BAR_WIDTH * total / scale)) if scale else 0
    colour = "green" if fits else "red"
    return f"[{colour}]" + "█" * min(filled, BAR_WIDTH) + "[/]" + "·" * max(0, BAR_WIDTH - filled)


def rl_report(out, result: RLEstimate, *, verbose: bool = False, framework: str = "trl",
              read: tuple[str, ...] = ()) -> None:
    rl = result.setup
    out.print(f"[bold]memfit rl[/bold] {result.model} · {rl.trainer.upper()} · {result.gpu} "
              f"({format_bytes(result.gpu_memory_bytes)})")
    scale = max(result.gpu_memory_bytes, result.peak.total_bytes)
    width = max(len(phase.name) for phase in result.phases) + 7
    for phase in result.phases:
        fits = phase.total_bytes <= result.gpu_memory_bytes
        by_category = phase.by_category()
        label = phase.name + (" (peak)" if phase is result.peak else "")
        out.print(f"{label:<{width}} {_bar(phase.total_bytes, scale, fits)} {format_bytes(phase.total_bytes):>10}"
                  f"  [dim]{'+'.join(phase.models)}[/dim]")
        out.print("  [dim]" + ", ".join(f"{name} {format_bytes(by_category[name])}" for name in CATEGORY_ORDER
                                        if by_category.get(name)) + "[/dim]")
        if verbose:
            for t in phase.terms:
                out.print(f"    {format_bytes(t.num_bytes):>10}  {t.name}: [dim]{t.formula}[/dim]")
    peak_fits = result.peak.total_bytes <= result.gpu_memory_bytes
    verdict = ("fits" if result.fits else "fits, but the vLLM engine cannot start (below)" if peak_fits
               else "DOES NOT FIT")
    out.print(f"peak: {result.peak.name} {format_bytes(result.peak.total_bytes)} of "
              f"{format_bytes(result.gpu_memory_bytes)}: {verdict} (phases do not coexist, so they are not summed)")
    if result.vllm is not None:
        _vllm(out, result)
    if framework == "trl":
        out.print("\n[bold]TRL settings[/bold]")
        for line in settings_lines(result):
            out.print(f"  {line}")
    if read and verbose:
        out.print(f"\n[bold]read from the {framework} config[/bold]")
        for line in read:
            out.print(f"  [dim]{line}[/dim]")
    for note in result.to_dict()["notes"]:
        out.print(f"[dim]note: {note}[/dim]")


def _vllm(out, result: RLEstimate) -> None:
    advice = result.vllm
    out.print(f"vLLM KV cache at utilization {advice.utilization:g}: {format_bytes(advice.kv_cache_bytes)} = "
              f"{advice.kv_tokens:,} tokens ({advice.kv_bytes_per_token:,} B per token); the generation batch "
              f"needs {advice.needed_kv_tokens:,}")
    if advice.recommended is None:
        out.print(f"[red]no vllm_gpu_memory_utilization fits[/red]: the rollout needs at least "
                  f"{advice.minimum:.2f} and the trainer leaves less")
    else:
        why = ("the largest under the margin on the engine's own GPUs" if result.setup.vllm_mode == "server"
               else "the largest that leaves the trainer its peak")
        out.print(f"[bold]vllm_gpu_memory_utilization: {advice.recommended:.2f}[/bold] ({why}; the rollout needs "
                  f"at least {advice.minimum:.2f})")
    for note in advice.notes:
        out.print(f"[yellow]{note}[/yellow]")


def settings_lines(result: RLEstimate) -> list[str]:
    """The GRPOConfig / DPOConfig / ORPOConfig / CPOConfig fields this estimate assumed, as YAML lines to paste."""
    rl = result.setup
    lines = [f"per_device_train_batch_size: {rl.per_device_train_batch_size}",
             f"gradient_accumulation_steps: {rl.gradient_accumulation_steps}",
             f"max_prompt_length: {rl.max_prompt_length}",
             f"max_completion_length: {rl.max_completion_length}" if rl.online
             else f"max_length: {rl.seq_len}",
             f"gradient_checkpointing: {str(rl.gradient_checkpointing).lower()}",
             f"bf16: {str(rl.bf16).lower()}", f"beta: {rl.beta:g}"]
    if rl.online:
        lines.insert(1, f"num_generations: {rl.num_generations}")
        lines.append(f"use_vllm: {str(rl.use_vllm).lower()}")
        if rl.use_vllm:
            advice = result.vllm
            util = advice.recommended if advice and advice.recommended else rl.vllm_gpu_memory_utilization
            lines += [f"vllm_mode: {rl.vllm_mode}", f"vllm_gpu_memory_utilization: {util:.2f}",
                      f"vllm_enable_sleep_mode: {str(rl.vllm_enable_sleep_mode).lower()}"]
    elif rl.trainer in REFERENCE_FREE:
        # CPOConfig: SimPO is loss_type simpo without the NLL term (cpo_alpha 0)
        lines += ["loss_type: simpo", "cpo_alpha: 0.0"] if rl.trainer == "simpo" else []
    else:
        lines.append(f"precompute_ref_log_probs: {str(rl.precompute_ref_log_probs).lower()}")
    if rl.lora:
        lines += ["use_peft: true", f"lora_r: {rl.lora_rank}"]
    return lines


def settings_block(settings: dict, framework: str) -> list[str]:
    """The plan's settings as the framework takes them: YAML lines (TRL), Hydra overrides (verl), arguments
    (OpenRLHF)."""
    lines = []
    for key, value in settings.items():
        if key.startswith("#"):
            lines.append(f"# {value}" if key == "#" else f"# {key[2:]}: {value}")
            continue
        shown = str(value).lower() if isinstance(value, bool) else f"{value:.2f}" if isinstance(value, float) \
            else str(value)
        if framework == "verl":
            lines.append(f"{key}={shown}")
        elif framework == "openrlhf":
            lines.append(key if value is True else f"# drop {key}" if value is False else f"{key} {shown}")
        else:
            lines.append(f"{key}: {shown}")
    return lines


def rl_plan_report(out, plan: RLPlan, framework: str) -> None:
    """The ladder: each rung taken with the peak after it, then the settings to paste."""
    start = plan.start
    out.print(f"\n[bold]plan[/bold] (cheapest first, every phase re-estimated after each step): start "
              f"{start.peak.name} {format_bytes(start.peak.total_bytes)}")
    for number, rung in enumerate(plan.rungs, 1):
        est = rung.estimate
        mark = "[green]fits[/green]" if est.fits else "[red]over[/red]"
        out.print(f"  {number}. {rung.title}: {rung.why} -> peak {est.peak.name} "
                  f"{format_bytes(est.peak.total_bytes)} on {rung.gpus} GPU{'s' if rung.gpus > 1 else ''} {mark}")
    if not plan.fits:
        out.print("[red]no rung left: it does not fit[/red]")
    if plan.settings:
        out.print(f"\n[bold]{framework} settings that make it fit[/bold]")
        for line in settings_block(plan.settings, framework):
            out.print(f"  {line}")
