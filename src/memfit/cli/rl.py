"""`memfit rl MODEL --trainer grpo|rloo|ppo|dpo|kto|orpo|cpo|simpo`: an RL post-training step (TRL's trainers, verl, OpenRLHF) as
phases, one bar per phase, the peak phase, for a colocated vLLM the gpu_memory_utilization to set, and with --plan
the RL ladder and the settings that make it fit (memfit.rl). The options it shares with the sizing commands (--batch,
--accum, --method, --lora-rank, --zero, --gpus, --nodes) are the generated ones (memfit.fields via
cli/options.setup_option); the RL recipe's own are declared here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ConfigError
from .common import DOES_NOT_FIT, app, console, examples, print_json
from .options import (MODEL_PANEL, GpuOpt, GpusOpt, JsonOpt, MarginOpt, NodesOpt, VerboseOpt,
                      setup_option, whole_number)

RL_PANEL = "RL recipe (TRL config fields; --config sets them, options override)"


def _opt(*decls: str, help: str, **kwargs):
    return typer.Option(*decls, rich_help_panel=RL_PANEL, show_default=False, help=help, **kwargs)


RlModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, or a Hugging Face "
         "hub id. Optional when --config has model_name_or_path.")]
TrainerOpt = Annotated[Optional[str], _opt(
    "--trainer", metavar="grpo|rloo|ppo|dpo|kto|orpo|cpo|simpo",
    help="The trainer: grpo, rloo (TRL RLOOTrainer), ppo (policy + critic: verl / OpenRLHF GAE), dpo, kto, orpo, "
         "cpo, simpo (trl.experimental: no reference model; simpo is CPOTrainer with loss_type simpo, cpo_alpha "
         "0). Default: grpo, or what --config says.")]
TrlConfigOpt = Annotated[Optional[Path], _opt(
    "--config", metavar="FILE",
    help="The recipe you have: TRL's GRPOConfig / DPOConfig / ... YAML or JSON (`trl grpo --config`), verl's "
         "trainer YAML or a launch script of `verl.trainer.main_ppo` overrides, or an OpenRLHF `train_ppo_ray` "
         "launch script (the format comes from the content). Options override it.")]
BatchOpt = setup_option("micro_batch_size")
AccumOpt = setup_option("grad_accum_steps")
MethodOpt = setup_option("finetune.method")
LoraRankOpt = setup_option("finetune.rank")
ZeroOpt = setup_option("sharding")
PlanOpt = Annotated[bool, _opt("--plan", help="Walk the RL ladder (cheapest first, every phase re-estimated) and "
                               "print the settings that make it fit, vllm_gpu_memory_utilization first.")]
MaxOpt = Annotated[Optional[str], _opt(
    "--max", metavar="FIELD", help="Solve for the largest value that fits: num_generations, max_completion_length, "
                                   "max_prompt_length or per_device_train_batch_size.")]
FewestOpt = Annotated[bool, _opt("--fewest-gpus", help="Solve for the fewest GPUs (trainer state sharded) on which "
                                 "the recipe fits as it is.")]
OffloadOpt = Annotated[Optional[bool], _opt(
    "--offload-trainer/--no-offload-trainer",
    help="The trainer's parameters and optimizer state off the GPU outside their phases (verl param_offload + "
         "optimizer_offload, OpenRLHF --deepspeed_enable_sleep). Default: off.")]
RefOffloadOpt = Annotated[Optional[bool], _opt(
    "--ref-offload/--no-ref-offload", help="The reference (and reward) weights off the GPU outside the log-probs "
                                           "phase (verl ref param_offload, OpenRLHF --ref_reward_offload).")]
RewardOpt = Annotated[Optional[bool], _opt("--reward-model/--no-reward-model",
                                           help="A reward model's weights on the GPU (verl reward_model.enable).")]
CriticBatchOpt = Annotated[Optional[int], _opt(
    "--critic-batch", metavar="N", parser=whole_number(1 << 16),
    help="PPO: the critic update's micro-batch (verl critic.ppo_micro_batch_size_per_gpu). Default: the actor's.")]
GenerationsOpt = Annotated[Optional[int], _opt("--num-generations", metavar="N", parser=whole_number(1 << 12),
                                               help="GRPO: completions per prompt. Default: 8.")]
PromptOpt = Annotated[Optional[int], _opt("--prompt-len", metavar="N", parser=whole_number(1 << 21),
                                          help="max_prompt_length. Default: 512.")]
CompletionOpt = Annotated[Optional[int], _opt("--completion-len", metavar="N", parser=whole_number(1 << 21),
                                              help="max_completion_length. Default: 512.")]
BetaOpt = Annotated[Optional[float], _opt("--beta", metavar="X", help="KL weight; the online trainers load a "
                                          "reference model when > 0. Default: the trainer's (GRPO 0.0, RLOO / PPO "
                                          "0.05, DPO / KTO 0.1).")]
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
    "memfit rl --config grpo.yaml --gpu H100 --plan",
    "memfit rl --config verl_ppo.yaml --gpu H100 --plan",
    "memfit rl qwen2.5-7b --trainer grpo --vllm --gpu H100 --max num_generations"))
def rl_command(model: RlModelArg = None, trainer: TrainerOpt = None, config: TrlConfigOpt = None, gpu: GpuOpt = None,
               gpus: GpusOpt = None, nodes: NodesOpt = None, margin: MarginOpt = None, batch: BatchOpt = None,
               num_generations: GenerationsOpt = None, prompt_len: PromptOpt = None,
               completion_len: CompletionOpt = None, accum: AccumOpt = None, beta: BetaOpt = None,
               vllm: VllmOpt = None, vllm_mode: VllmModeOpt = None, vllm_util: UtilOpt = None,
               sleep: SleepOpt = None, vllm_tp: VllmTpOpt = None, kv_cache_dtype: KvDtypeOpt = None,
               lora: LoraOpt = None, method: MethodOpt = None, lora_rank: LoraRankOpt = None,
               precompute_ref: PrecomputeOpt = None, checkpointing: CheckpointOpt = None,
               logprob_head: HeadOpt = None, zero: ZeroOpt = None, offload_trainer: OffloadOpt = None,
               ref_offload: RefOffloadOpt = None, reward_model: RewardOpt = None,
               critic_batch: CriticBatchOpt = None, plan: PlanOpt = False,
               max_field: MaxOpt = None, fewest_gpus: FewestOpt = False, json_output: JsonOpt = False,
               verbose: VerboseOpt = False) -> None:
    """Size an RL post-training step (TRL GRPO / RLOO / DPO / KTO / ORPO / CPO / SimPO, verl and OpenRLHF PPO /
    GRPO) phase by phase: rollout generation, reference / old-policy log-probs, the policy's training step, the
    critic's. The peak per
    GPU is the largest phase; with a colocated vLLM, the vllm_gpu_memory_utilization that leaves the trainer its
    room; --plan, --max and --fewest-gpus say what makes it fit. Exit 0: fits; 1: does not; 2: a mistake."""
    from .. import rl as rl_lib

    estimate_rl, ladder, render = rl_lib.estimate_rl, rl_lib.ladder, rl_lib.render
    inputs = rl_lib.rl_inputs(model=model, trainer=trainer, config=config, gpu=gpu, gpus=gpus, nodes=nodes, margin=margin,
                       batch=batch, num_generations=num_generations, prompt_len=prompt_len,
                       completion_len=completion_len, accum=accum, beta=beta, vllm=vllm, vllm_mode=vllm_mode,
                       vllm_util=vllm_util, sleep=sleep, vllm_tp=vllm_tp, kv_cache_dtype=kv_cache_dtype, lora=lora,
                       method=method, lora_rank=lora_rank, precompute_ref=precompute_ref,
                       checkpointing=checkpointing, logprob_head=logprob_head, zero=zero,
                       offload_trainer=offload_trainer, ref_offload=ref_offload, reward_model=reward_model,
                       critic_batch=critic_batch)
    spec, rl, hardware, margin = inputs.spec, inputs.rl, inputs.hardware, inputs.margin
    framework, read_lines = inputs.framework, inputs.read
    if sum(bool(x) for x in (plan, max_field, fewest_gpus)) > 1:
        raise ConfigError("give one of --plan, --max, --fewest-gpus")
    if max_field is not None:
        _solve(ladder, spec, rl, hardware, margin, max_field, json_output)
        return
    if fewest_gpus:
        count, result = ladder.fewest_gpus(spec, rl, hardware, margin=margin)
        _answer({"fewest_gpus": count, "estimate": result.to_dict() if result else None}, json_output,
                f"fewest GPUs: {count}" if count else f"it does not fit on {ladder.MAX_GPUS} GPUs")
        if count is None:
            raise typer.Exit(DOES_NOT_FIT)
        return
    result = estimate_rl(spec, rl, hardware, margin=margin)
    walked = ladder.plan_rl(spec, rl, hardware, margin=margin, framework=framework) if plan else None
    if json_output:
        out = result.to_dict()
        out["framework"] = framework
        if walked is not None:
            out["plan"] = walked.to_dict()
        print_json(out)
    else:
        render.rl_report(console(), result, verbose=verbose, framework=framework, read=read_lines)
        if walked is not None:
            render.rl_plan_report(console(), walked, framework)
    if not (walked.fits if walked is not None else result.fits):
        raise typer.Exit(DOES_NOT_FIT)


def _answer(data: dict, json_output: bool, text: str) -> None:
    if json_output:
        print_json(data)
    else:
        console().print(text)


def _solve(ladder, spec, rl, hardware, margin: float, name: str, json_output: bool) -> None:
    """--max: `ladder` is memfit.rl.ladder, loaded when the command runs."""
    aliases = {"generations": "num_generations", "completion": "max_completion_length",
               "max_response_length": "max_completion_length", "batch": "per_device_train_batch_size",
               "prompt": "max_prompt_length", "n": "num_generations"}
    name = aliases.get(name, name)
    if name not in ladder.SOLVABLE:
        raise ConfigError(f"--max takes one of {', '.join(ladder.SOLVABLE)}, got {name!r}")
    value, result = ladder.largest(spec, rl, hardware, name, margin=margin)
    _answer({"field": name, "largest": value, "estimate": result.to_dict() if result else None}, json_output,
            f"largest {name} that fits: {value}" if value is not None else f"even {name} = 1 does not fit")
    if value is None:
        raise typer.Exit(DOES_NOT_FIT)


