"""TRL's GRPOConfig / DPOConfig as its CLI reads them (`trl grpo --config grpo.yaml`: one YAML or JSON mapping
holding the trainer's config, TrainingArguments and TRL's ModelConfig / ScriptArguments side by side), and
trl.experimental's ORPOConfig / CPOConfig in the same mapping as TrlParser's `--config` reads it (trl 1.16 has no
`trl orpo` command: TRL's example scripts parse them with TrlParser). Like
memfit.readers: memory-relevant keys map to RLSetup fields, known keys that size nothing are skipped, and any other
key is one ConfigError line naming it (exit 2)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..readers.files import load_mapping
from ..readers._reader import show
from .workload import REFERENCE_FREE, RLSetup

INT_FIELDS = ("per_device_train_batch_size", "num_generations", "max_prompt_length", "max_completion_length",
              "gradient_accumulation_steps", "steps_per_generation", "num_iterations", "vllm_tensor_parallel_size",
              "precompute_ref_batch_size", "vllm_max_num_seqs")
BOOL_FIELDS = ("use_vllm", "vllm_enable_sleep_mode", "precompute_ref_log_probs", "gradient_checkpointing", "bf16",
               "vllm_enforce_eager")
FLOAT_FIELDS = ("beta", "vllm_gpu_memory_utilization")
STR_FIELDS = ("vllm_mode", "vllm_kv_cache_dtype")
RENAMED = {"vllm_max_model_length": None, "cpo_alpha": "cpo_alpha", "loss_type": "loss_type",
           "is_encoder_decoder": None, "max_length": "max_length", "use_peft": "lora", "lora_r": "lora_rank",
           "fp16": "fp16", "generation_batch_size": "generation_batch_size"}
"""Keys read with a conversion (see `_special`)."""
IGNORED = frozenset((
    # TrainingArguments / TRL keys that size no memory of the step
    "output_dir", "overwrite_output_dir", "run_name", "learning_rate", "lr_scheduler_type", "warmup_ratio",
    "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "num_train_epochs",
    "max_steps", "logging_steps", "logging_first_step", "logging_strategy", "save_steps", "save_strategy",
    "save_total_limit", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "report_to", "seed",
    "data_seed", "push_to_hub", "hub_model_id", "log_level", "dataloader_num_workers", "remove_unused_columns",
    "gradient_checkpointing_kwargs", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "scale_rewards", "reward_weights", "epsilon", "epsilon_high", "delta", "mask_truncated_completions",
    "log_completions", "num_completions_to_print", "disable_dropout", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "label_smoothing", "rpo_alpha", "ld_alpha", "use_weighting", "f_divergence_type",
    "truncation_mode", "padding_free", "pad_to_multiple_of", "dataset_num_proc", "model_init_kwargs",
    "generation_kwargs", "vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout",
    "vllm_guided_decoding_regex", "vllm_model_impl", "shuffle_dataset", "ds3_gather_for_generation",
    "cast_lm_head_to_fp32", "chat_template_kwargs", "top_entropy_quantile", "importance_sampling_level",
    "use_liger_kernel", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
    "model_name_or_path", "model_revision", "trust_remote_code", "attn_implementation", "dtype", "torch_dtype",
    "lora_alpha", "lora_dropout", "lora_target_modules", "lora_task_type", "load_in_4bit", "load_in_8bit",
    "bnb_4bit_quant_type", "use_bnb_nested_quant", "reward_funcs", "reward_model_name_or_path", "tf32",
    "ddp_find_unused_parameters", "bf16_full_eval", "optim", "lr_scheduler_kwargs", "logging_dir", "hub_strategy",
    "beta_schedule", "discopop_tau", "loss_weights", "precompute_ref_log_probs_batch_size",
    # ORPOConfig / CPOConfig (trl.experimental): loss shape and evaluation, no memory of the step
    "simpo_gamma", "alpha", "generate_during_eval", "padding_value",
))


def read_trl_config(path: str | Path) -> tuple[dict[str, Any], str | None]:
    """(RLSetup keyword arguments, the model named in the file or None)."""
    data = load_mapping(Path(path))
    return trl_settings(data, str(path))


def trl_settings(data: Mapping[str, Any], shown: str) -> tuple[dict[str, Any], str | None]:
    unknown = sorted(k for k in data if k not in IGNORED and k not in RENAMED and k not in
                     INT_FIELDS + BOOL_FIELDS + FLOAT_FIELDS + STR_FIELDS)
    if unknown:
        raise ConfigError(f"{shown}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (not a "
                          "GRPOConfig / DPOConfig / TrainingArguments / ModelConfig field memfit knows)")
    settings: dict[str, Any] = {}
    for key, value in data.items():
        if value is None or key in IGNORED:
            continue
        settings.update(_convert(key, value, shown))
    model = data.get("model_name_or_path")
    return settings, model if isinstance(model, str) and model else None


def _convert(key: str, value: Any, shown: str) -> dict[str, Any]:
    def bad(kind: str) -> ConfigError:
        return ConfigError(f"{shown}: {key} must be {kind}, got {show(value)}")

    if key in INT_FIELDS or key in ("lora_r", "generation_batch_size", "max_length"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("a non-negative integer")
    if key in BOOL_FIELDS or key in ("use_peft", "fp16"):
        if not isinstance(value, bool):
            raise bad("true or false")
    if key in FLOAT_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise bad("a number")
    if key in STR_FIELDS + ("loss_type",) and not isinstance(value, str):
        raise bad("a string")
    if key == "cpo_alpha":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return {"cpo_alpha": float(value)}
    if key == "loss_type":
        return {"loss_type": value}
    if key == "is_encoder_decoder":
        if value is True:
            raise ConfigError(f"{shown}: is_encoder_decoder: memfit rl sizes decoder-only policies")
        return {}
    if key == "use_peft":
        return {"lora": value}
    if key == "lora_r":
        return {"lora_rank": value}
    if key == "fp16":
        return {"bf16": False} if value else {}
    if key == "max_length":
        return {"max_length": value}
    if key == "generation_batch_size":
        return {"generation_batch_size": value}
    if key == "vllm_max_model_length":
        return {}
    return {key: float(value) if key in FLOAT_FIELDS else value}


def build_setup(trainer: str, settings: Mapping[str, Any], **overrides: Any) -> RLSetup:
    """An RLSetup from a TRL config's settings, then the command line's `overrides` (None: not given). DPO's
    `max_length` (prompt + completion) sets the completion length left after the prompt; GRPO's
    `generation_batch_size` sets steps_per_generation (one device)."""
    merged = {**settings, **{k: v for k, v in overrides.items() if v is not None}}
    merged["trainer"] = trainer
    # CPOConfig: loss_type 'alphapo' sets loss_type 'simpo' and cpo_alpha 0 (cpo_config.py __post_init__); without
    # the NLL term on the chosen half CPO is memfit's 'simpo'
    cpo_alpha = 0.0 if merged.pop("loss_type", None) == "alphapo" else merged.pop("cpo_alpha", None)
    merged.pop("cpo_alpha", None)
    if trainer == "cpo" and cpo_alpha == 0.0:
        merged["trainer"] = "simpo"
    if trainer in REFERENCE_FREE:
        # ORPO / CPO read max_completion_length only for encoder-decoder models; max_length (default 1024) bounds
        # prompt + completion, the answer truncated first
        merged.pop("max_completion_length", None) if "max_length" in merged else None
    max_length = merged.pop("max_length", None)
    generation = merged.pop("generation_batch_size", None)
    if max_length is not None and "max_completion_length" not in merged:
        prompt = merged.get("max_prompt_length", RLSetup.max_prompt_length)
        if max_length <= prompt:
            raise ConfigError(f"max_length {max_length} leaves no completion after max_prompt_length {prompt}")
        merged["max_completion_length"] = max_length - prompt
    if generation is not None and "steps_per_generation" not in merged:
        batch = merged.get("per_device_train_batch_size", RLSetup.per_device_train_batch_size)
        if generation % batch:
            raise ConfigError(f"generation_batch_size {generation} is not a multiple of per_device_train_batch_size "
                              f"{batch}")
        merged["steps_per_generation"] = generation // batch
    try:
        return RLSetup(**merged)
    except ValueError as error:
        raise ConfigError(str(error)) from None
