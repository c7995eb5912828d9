"""`memfit rl MODEL --trainer grpo|dpo`: an RL post-training step (TRL's GRPOTrainer / DPOTrainer) as phases, one
bar per phase, the peak phase, and for a colocated vLLM the gpu_memory_utilization to set (memfit.rl)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError
from .common import DOES_NOT_FIT, app, console, examples, print_json
from .options import DEFAULT_GPU, MODEL_PANEL, GpuOpt, JsonOpt, MarginOpt, VerboseOpt, whole_number

RL_PANEL = "RL recipe (TRL config fields; --config sets them, options override)"


def _opt(*decls: str, help: str, **kwargs):
    return typer.Option(*decls, rich_help_panel=RL_PANEL, show_default=False, help=help, **kwargs)


RlModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, or a Hugging Face "
         "hub id. Optional when --config has model_name_or_path.")]
TrainerOpt = Annotated[str, _opt("--trainer", metavar="grpo|dpo", help="TRL trainer: grpo or dpo. Default: grpo.")]
TrlConfigOpt = Annotated[Optional[Path], _opt(
    "--config", metavar="FILE", help="TRL's GRPOConfig / DPOConfig as YAML or JSON (what `trl grpo --config` reads).")]
BatchOpt = Annotated[Optional[int], _opt("--batch", "-b", metavar="N", parser=whole_number(1 << 16),
                                         help="per_device_train_batch_size. Default: 8.")]
GenerationsOpt = Annotated[Optional[int], _opt("--num-generations", metavar="N", parser=whole_number(1 << 12),
                                               help="GRPO: completions per prompt. Default: 8.")]
PromptOpt = Annotated[Optional[int], _opt("--prompt-len", metavar="N", parser=whole_number(1 << 21),
                                          help="max_prompt_length. Default: 512.")]
CompletionOpt = Annotated[Optional[int], _opt("--completion-len", metavar="N", parser=whole_number(1 << 21),
                                              help="max_completion_length. Default: 512.")]
AccumOpt = Annotated[Optional[int], _opt("--accum", metavar="N", parser=whole_number(1 << 16),
                                         help="gradient_accumulation_steps (GRPO generates that many micro-batches "
                                              "at once). Default: 1.")]
BetaOpt = Annotated[Optional[float], _opt("--beta", metavar="X", help="KL weight; GRPO loads a reference model "
                                          "when > 0. Default: GRPO 0.0, DPO 0.1.")]
VllmOpt = Annotated[Optional[bool], _opt("--vllm/--no-vllm", help="use_vllm for the rollout. Default: off.")]
VllmModeOpt = Annotated[Optional[str], _opt("--vllm-mode", metavar="colocate|server",
                                            help="vllm_mode. Default: colocate.")]
UtilOpt = Annotated[Optional[float], _opt("--vllm-util", metavar="FRACTION",
                                          help="vllm_gpu_memory_utilization. Default: 0.3.")]
SleepOpt = Annotated[Optional[bool], _opt("--sleep/--no-sleep", help="vllm_enable_sleep_mode. Default: off.")]
VllmTpOpt = Annotated[Optional[int], _opt("--vllm-tp", metavar="N", parser=whole_number(64),
                                          help="vllm_tensor_parallel_size. Default: 1.")]
KvDtypeOpt = Annotated[Optional[str], _opt("--kv-cache-dtype", metavar="DTYPE",
                                           help="vllm_kv_cache_dtype: auto, fp8, ... Default: auto.")]
LoraOpt = Annotated[Optional[bool], _opt("--lora/--full", help="A LoRA policy (its reference is the base with "
                                         "adapters off, no second model) or a full fine-tune. Default: full.")]
PrecomputeOpt = Annotated[Optional[bool], _opt("--precompute-ref/--online-ref",
                                               help="DPO precompute_ref_log_probs. Default: online.")]
CheckpointOpt = Annotated[Optional[bool], _opt("--checkpointing/--no-checkpointing",
                                               help="gradient_checkpointing. Default: on (TRL's default).")]
HeadOpt = Annotated[Optional[str], _opt("--logprob-head", metavar="fused|selective|full",
                                        help="How log-probs leave the LM head: fused (TRL 1.x), selective (TRL "
                                             "0.x selective_log_softmax), full. Default: fused.")]


@app.command("rl", epilog=examples(
    "memfit rl qwen2.5-7b --trainer grpo --gpu H100",
    "memfit rl llama-3.1-8b --trainer grpo --vllm --vllm-util 0.3 --gpu H100 --json",
    "memfit rl llama-3.1-8b --trainer dpo --lora --precompute-ref",
    "memfit rl --trainer grpo --config grpo.yaml"))
def rl_command(model: RlModelArg = None, trainer: TrainerOpt = "grpo", config: TrlConfigOpt = None, gpu: GpuOpt = None,
               margin: MarginOpt = None, batch: BatchOpt = None, num_generations: GenerationsOpt = None,
               prompt_len: PromptOpt = None, completion_len: CompletionOpt = None, accum: AccumOpt = None,
               beta: BetaOpt = None, vllm: VllmOpt = None, vllm_mode: VllmModeOpt = None, vllm_util: UtilOpt = None,
               sleep: SleepOpt = None, vllm_tp: VllmTpOpt = None, kv_cache_dtype: KvDtypeOpt = None,
               lora: LoraOpt = None, precompute_ref: PrecomputeOpt = None, checkpointing: CheckpointOpt = None,
               logprob_head: HeadOpt = None, json_output: JsonOpt = False, verbose: VerboseOpt = False) -> None:
    """Size an RL post-training step (TRL GRPO / DPO) phase by phase: rollout generation, reference log-probs,
    the policy's training step. The peak per GPU is the largest phase; with a colocated vLLM, the
    vllm_gpu_memory_utilization that leaves the trainer its room. Exit 0: fits; 1: does not; 2: a mistake."""
    from ..diagnose import DEFAULT_MARGIN
    from ..hardware import make_hardware
    from ..rl import estimate_rl
    from ..rl.reader import build_setup, read_trl_config
    from ..sources import resolve_model

    trainer = trainer.lower()
    if trainer not in ("grpo", "dpo"):
        raise ConfigError(f"--trainer must be grpo or dpo, got {trainer!r}")
    settings, named = read_trl_config(config) if config is not None else ({}, None)
    model = model or named
    if model is None:
        raise ConfigError("give MODEL, or a --config whose model_name_or_path names it")
    if trainer == "dpo" and beta is None and "beta" not in settings:
        beta = 0.1  # DPOConfig's default
    rl = build_setup(trainer, settings, per_device_train_batch_size=batch, num_generations=num_generations,
                     max_prompt_length=prompt_len, max_completion_length=completion_len,
                     gradient_accumulation_steps=accum, beta=beta, use_vllm=vllm, vllm_mode=vllm_mode,
                     vllm_gpu_memory_utilization=vllm_util, vllm_enable_sleep_mode=sleep,
                     vllm_tensor_parallel_size=vllm_tp, vllm_kv_cache_dtype=kv_cache_dtype, lora=lora,
                     precompute_ref_log_probs=precompute_ref, gradient_checkpointing=checkpointing,
                     logprob_head=logprob_head)
    if rl.use_vllm and trainer == "dpo":
        raise ConfigError("--vllm is a GRPO rollout option: DPO generates nothing")
    spec = resolve_model(model)
    hardware = make_hardware(gpu or DEFAULT_GPU)
    result = estimate_rl(spec, rl, hardware, margin=DEFAULT_MARGIN if margin is None else margin)
    if json_output:
        print_json(result.to_dict())
    else:
        from ..rl.render import rl_report

        rl_report(console(), result, verbose=verbose)
    if not result.fits:
        raise typer.Exit(DOES_NOT_FIT)

