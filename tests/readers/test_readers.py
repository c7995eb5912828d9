"""memfit.readers: the config files users already have (HF TrainingArguments, DeepSpeed, accelerate, axolotl,
LLaMA-Factory, torchtune) read into a TrainingSetup, field by field; what memfit emits reads back as the setup it
was written for; the engines' own parsers accept the example files; `--config` on the command line."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit import emit
from memfit.api import as_spec
from memfit.callbacks import setup_from_training_args
from memfit.cli.app import app
from memfit.emit.emitted import uses_deepspeed
from memfit.errors import ConfigError, MissingDependencyError
from memfit.estimate.analytic import estimate
from memfit.finetune import ALL_LINEAR, Finetune
from memfit.hardware import make_hardware
from memfit.zero_knobs import ZeroKnobs
from memfit.readers import NOT_RELEVANT, NOT_SIZED, detect_format, read_config
from memfit.setup import Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
SETUP_FIELDS = ("micro_batch_size", "grad_accum_steps", "precision", "optimizer", "checkpointing", "attention",
                "sharding", "offload", "num_gpus", "engine")
ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Example:
    """What one example file reads as. Fields of another file are 'file:field' (file without its suffix)."""

    format: str
    model: str | None
    overrides: dict
    read: str
    not_sized: str
    other: str
    quiet: str


OFFLOAD_KNOBS = ZeroKnobs(reduce_bucket_size=50_000_000, param_persistence_threshold=100_000,
                          prefetch_bucket_size=50_000_000, overlap_comm=True, gather_16bit_weights_on_model_save=True)
ZERO2_FILE_KNOBS = ZeroKnobs(allgather_bucket_size=200_000_000, overlap_comm=True)
"""deepspeed_zero2.json: overlap_comm doubles ZeRO-2's reduce bucket; allgather_bucket_size is carried (no GPU
bytes)."""
LF_ZERO3_KNOBS = ZeroKnobs(overlap_comm=False, gather_16bit_weights_on_model_save=True)
"""deepspeed_zero3_offload.json's buffer sizes (its stage3_max_reuse_distance left out: DeepSpeed's 1e9)."""


EXAMPLES = {
    "axolotl_lora_deepspeed.yaml": Example(
        "axolotl", 'meta-llama/Llama-3.1-8B',
        dict(padding='max-length', micro_batch_size=2, grad_accum_steps=4, seq_len=4096, precision='bf16-master',
             optimizer='adamw-fused', checkpointing='full', attention='sdpa',
             finetune=Finetune("lora", rank=32, alpha=16, dropout=0.05, targets=(ALL_LINEAR,)), sharding='zero2',
             engine='deepspeed', zero_knobs=ZERO2_FILE_KNOBS),
        read=("pad_to_sequence_len deepspeed_zero2:zero_optimization.stage deepspeed_zero2:zero_optimization "
              "deepspeed_zero2:zero_optimization.overlap_comm deepspeed_zero2:zero_optimization.contiguous_gradients "
              "base_model micro_batch_size gradient_accumulation_steps sequence_len sample_packing deepspeed "
              "deepspeed_zero2:bf16.enabled bf16 fp16 deepspeed_zero2:train_micro_batch_size_per_gpu "
              "deepspeed_zero2:gradient_accumulation_steps deepspeed_zero2:train_batch_size optimizer "
              "gradient_checkpointing flash_attention deepspeed_zero2:zero_optimization.reduce_bucket_size "
              "load_in_4bit load_in_8bit adapter lora_r lora_alpha lora_dropout lora_target_linear"),
        not_sized="",
        other="deepspeed_zero2:zero_optimization.allgather_bucket_size",
        quiet=("model_type tokenizer_type datasets dataset_prepared_path val_set_size "
               "output_dir num_epochs lr_scheduler learning_rate logging_steps warmup_steps "
               "evals_per_epoch saves_per_epoch weight_decay special_tokens.pad_token "
               "deepspeed_zero2:gradient_clipping deepspeed_zero2:wall_clock_breakdown")),
    "axolotl_full.yaml": Example(
        "axolotl", 'meta-llama/Llama-3.2-1B',
        dict(padding='max-length',
             micro_batch_size=4, grad_accum_steps=8, seq_len=2048, precision='bf16', optimizer='paged-adamw-8bit',
             checkpointing='full', attention='sdpa', compile=True),
        read=("pad_to_sequence_len base_model micro_batch_size batch_size sequence_len sample_packing bf16 optimizer "
              "gradient_checkpointing flash_attention adapter torch_compile"),
        not_sized="",
        other="",
        quiet=("datasets val_set_size output_dir num_epochs lr_scheduler learning_rate tf32 "
               "gradient_checkpointing_kwargs.use_reentrant warmup_ratio weight_decay")),
    "llamafactory_full.yaml": Example(
        "llamafactory", 'Qwen/Qwen2.5-7B-Instruct',
        dict(seq_len=2048, micro_batch_size=1, grad_accum_steps=2, precision='bf16-master',
             checkpointing='full', sharding='zero3', engine='deepspeed', zero_knobs=LF_ZERO3_KNOBS),
        read=("model_name_or_path stage finetuning_type cutoff_len deepspeed per_device_train_batch_size "
              "gradient_accumulation_steps deepspeed_zero3:bf16.enabled bf16 "
              "deepspeed_zero3:train_micro_batch_size_per_gpu deepspeed_zero3:gradient_accumulation_steps "
              "deepspeed_zero3:train_batch_size disable_gradient_checkpointing "
              "deepspeed_zero3:zero_optimization.reduce_bucket_size "
              "deepspeed_zero3:zero_optimization.stage3_prefetch_bucket_size "
              "deepspeed_zero3:zero_optimization.stage3_param_persistence_threshold "
              "deepspeed_zero3:zero_optimization.stage3_max_reuse_distance deepspeed_zero3:zero_optimization.stage "
              "deepspeed_zero3:zero_optimization deepspeed_zero3:zero_optimization.contiguous_gradients "
              "deepspeed_zero3:zero_optimization.sub_group_size "
              "deepspeed_zero3:zero_optimization.stage3_max_live_parameters"),
        not_sized="",
        other=("deepspeed_zero3:zero_optimization.overlap_comm "
               "deepspeed_zero3:zero_optimization.stage3_gather_16bit_weights_on_model_save"),
        quiet=("trust_remote_code do_train dataset template max_samples overwrite_cache preprocessing_num_workers "
               "output_dir logging_steps save_steps plot_loss overwrite_output_dir report_to learning_rate "
               "num_train_epochs lr_scheduler_type warmup_ratio ddp_timeout deepspeed_zero3:gradient_clipping "
               "deepspeed_zero3:zero_allow_untested_optimizer deepspeed_zero3:fp16.loss_scale "
               "deepspeed_zero3:fp16.loss_scale_window deepspeed_zero3:fp16.initial_scale_power "
               "deepspeed_zero3:fp16.hysteresis deepspeed_zero3:fp16.min_loss_scale")),
    "llamafactory_lora.yaml": Example(
        "llamafactory", 'meta-llama/Llama-3.1-8B-Instruct',
        dict(padding='longest', seq_len=4096, micro_batch_size=2, grad_accum_steps=8, precision='amp-bf16',
             optimizer='adamw-foreach', checkpointing='full', attention='sdpa',
             # quantization_bit 4: QLoRA; LLaMA-Factory never calls prepare_model_for_kbit_training
             finetune=Finetune("qlora", rank=8, alpha=16, targets=(ALL_LINEAR,), kbit_prep=False)),
        read=("model_name_or_path stage cutoff_len packing per_device_train_batch_size gradient_accumulation_steps "
              "bf16 optim disable_gradient_checkpointing flash_attn finetuning_type lora_rank lora_target "
              "quantization_bit"),
        not_sized="",
        other="",
        quiet=("do_train dataset template output_dir logging_steps save_steps learning_rate num_train_epochs "
               "lr_scheduler_type warmup_ratio")),
    "torchtune_full.yaml": Example(
        "torchtune", 'llama-3.1-8b',
        dict(padding='longest',
             micro_batch_size=2, grad_accum_steps=1, seq_len=2048, precision='bf16', optimizer='paged-adamw-8bit',
             checkpointing='full', loss='chunked', optimizer_in_backward=True, compile=False),
        read=("model._component_ batch_size gradient_accumulation_steps tokenizer.max_seq_len dataset.packed dtype "
              "optimizer._component_ enable_activation_checkpointing optimizer_in_bwd loss._component_ compile"),
        not_sized="",
        other="",
        quiet=("enable_activation_offloading output_dir tokenizer._component_ tokenizer.path "
               "dataset._component_ seed shuffle checkpointer._component_ checkpointer.checkpoint_dir "
               "checkpointer.checkpoint_files.filename_format checkpointer.checkpoint_files.max_filename "
               "checkpointer.recipe_checkpoint checkpointer.output_dir checkpointer.model_type "
               "resume_from_checkpoint epochs optimizer.lr max_steps_per_epoch clip_grad_norm device "
               "metric_logger._component_ metric_logger.log_dir log_every_n_steps log_peak_memory_stats")),
    "torchtune_lora.yaml": Example(
        "torchtune", 'llama-3.2-1b',
        dict(padding='max-length',
             micro_batch_size=4, grad_accum_steps=8, seq_len=4096, precision='bf16', optimizer='adamw-fused',
             checkpointing='none', loss='chunked', compile=True, finetune=Finetune("lora", rank=64, alpha=128, targets=(
                 "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), recipe="torchtune")),
        read=("model._component_ batch_size gradient_accumulation_steps tokenizer.max_seq_len dataset.packed dtype "
              "optimizer.fused enable_activation_checkpointing model.lora_attn_modules model.apply_lora_to_mlp "
              "model.lora_rank model.lora_alpha model.lora_dropout loss._component_ compile"),
        not_sized="enable_activation_offloading",
        other="",
        quiet=("output_dir tokenizer._component_ tokenizer.path dataset._component_ seed shuffle epochs "
               "max_steps_per_epoch optimizer.weight_decay optimizer.lr lr_scheduler._component_ "
               "lr_scheduler.num_warmup_steps device")),
    "axolotl_qlora.yaml": Example(
        "axolotl", 'meta-llama/Llama-3.1-8B',
        dict(padding='max-length',
             micro_batch_size=1, grad_accum_steps=4, seq_len=2048, precision='bf16', optimizer='adamw-8bit',
             checkpointing='full', attention='sdpa',
             finetune=Finetune("qlora", rank=16, alpha=32, dropout=0.05, targets=("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"),
                               kbit_prep=False)),  # axolotl casts the norms, embeddings and head back to bf16
        read=("pad_to_sequence_len "
              "base_model micro_batch_size gradient_accumulation_steps sequence_len sample_packing bf16 optimizer "
              "gradient_checkpointing flash_attention load_in_4bit load_in_8bit adapter "
              "bnb_config_kwargs.bnb_4bit_quant_type bnb_config_kwargs.bnb_4bit_use_double_quant lora_r lora_alpha "
              "lora_dropout lora_target_modules peft_use_dora"),
        not_sized="",
        other="",
        quiet=("model_type tokenizer_type datasets dataset_prepared_path val_set_size output_dir lora_model_dir "
               "lora_modules_to_save num_epochs lr_scheduler learning_rate tf32 logging_steps "
               "warmup_steps evals_per_epoch saves_per_epoch weight_decay special_tokens.pad_token")),
    "llamafactory_lora_sft.yaml": Example(
        "llamafactory", 'Qwen/Qwen2.5-7B-Instruct',
        dict(seq_len=2048, micro_batch_size=1, grad_accum_steps=8, precision='amp-bf16', checkpointing='full',
             finetune=Finetune("lora", rank=16, alpha=32, dropout=0.05, targets=("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"),
                               modules_to_save=("embed_tokens",))),
        read=("model_name_or_path stage finetuning_type lora_rank lora_alpha lora_dropout lora_target "
              "additional_target use_dora cutoff_len per_device_train_batch_size gradient_accumulation_steps bf16 "
              "disable_gradient_checkpointing"),
        not_sized="",
        other="",
        quiet=("trust_remote_code do_train dataset template max_samples overwrite_cache preprocessing_num_workers "
               "output_dir logging_steps save_steps plot_loss overwrite_output_dir report_to learning_rate "
               "num_train_epochs lr_scheduler_type warmup_ratio ddp_timeout")),
    "torchtune_qlora.yaml": Example(
        "torchtune", 'llama-3.1-8b',
        dict(padding='longest',
             micro_batch_size=2, grad_accum_steps=8, seq_len=2048, precision='bf16', optimizer='adamw-fused',
             checkpointing='full', loss='chunked', compile=False,
             finetune=Finetune("qlora", rank=8, alpha=16, targets=ATTENTION_AND_MLP, recipe="torchtune")),
        read=("model._component_ model.apply_lora_to_mlp model.apply_lora_to_output model.lora_attn_modules "
              "model.lora_rank model.lora_alpha model.lora_dropout batch_size gradient_accumulation_steps "
              "tokenizer.max_seq_len dataset.packed dtype optimizer.fused enable_activation_checkpointing "
              "loss._component_ compile"),
        not_sized="",
        other="",
        quiet=("enable_activation_offloading output_dir tokenizer._component_ tokenizer.path "
               "checkpointer._component_ checkpointer.checkpoint_dir checkpointer.checkpoint_files.filename_format "
               "checkpointer.checkpoint_files.max_filename checkpointer.recipe_checkpoint checkpointer.output_dir "
               "checkpointer.model_type resume_from_checkpoint save_adapter_weights_only dataset._component_ seed "
               "shuffle optimizer.weight_decay optimizer.lr lr_scheduler._component_ lr_scheduler.num_warmup_steps "
               "epochs max_steps_per_epoch device")),
    "adapter_config.json": Example(
        "peft", 'meta-llama/Llama-3.2-1B',
        dict(finetune=Finetune("lora", rank=16, alpha=32, dropout=0.05, targets=tuple(sorted(ATTENTION_AND_MLP)))),
        read="base_model_name_or_path bias peft_type r lora_alpha lora_dropout target_modules use_dora use_rslora",
        not_sized="",
        other="",
        quiet=("alpha_pattern auto_mapping exclude_modules fan_in_fan_out inference_mode init_lora_weights "
               "layer_replication layers_pattern layers_to_transform loftq_config lora_bias megatron_config "
               "megatron_core revision task_type trainable_token_indices")),
    "training_args.json": Example(
        "training_args", None,
        dict(micro_batch_size=2, grad_accum_steps=8, precision='bf16-master', num_gpus=8, sharding='zero3',
             engine='deepspeed', offload='optimizer+params', checkpointing='full', zero_knobs=OFFLOAD_KNOBS),
        read=("deepspeed per_device_train_batch_size gradient_accumulation_steps "
              "deepspeed_zero3_offload:bf16.enabled bf16 deepspeed_zero3_offload:train_micro_batch_size_per_gpu "
              "deepspeed_zero3_offload:gradient_accumulation_steps deepspeed_zero3_offload:train_batch_size "
              "deepspeed_zero3_offload:zero_optimization.stage "
              "deepspeed_zero3_offload:zero_optimization.offload_param.device "
              "deepspeed_zero3_offload:optimizer.type activation_checkpointing "
              "deepspeed_zero3_offload:zero_optimization deepspeed_zero3_offload:zero_optimization.reduce_bucket_size "
              "deepspeed_zero3_offload:zero_optimization.stage3_param_persistence_threshold "
              "deepspeed_zero3_offload:zero_optimization.stage3_prefetch_bucket_size "
              "deepspeed_zero3_offload:zero_optimization.contiguous_gradients"),
        not_sized="",
        other=("deepspeed_zero3_offload:zero_optimization.overlap_comm "
               "deepspeed_zero3_offload:zero_optimization.offload_optimizer.pin_memory "
               "deepspeed_zero3_offload:zero_optimization.offload_param.pin_memory "
               "deepspeed_zero3_offload:zero_optimization.stage3_gather_16bit_weights_on_model_save"),
        quiet=("output_dir learning_rate adam_beta2 weight_decay num_train_epochs lr_scheduler_type warmup_steps "
               "logging_steps save_strategy save_steps report_to deepspeed_zero3_offload:gradient_clipping "
               "deepspeed_zero3_offload:steps_per_print deepspeed_zero3_offload:optimizer.params.lr "
               "deepspeed_zero3_offload:optimizer.params.betas deepspeed_zero3_offload:optimizer.params.eps "
               "deepspeed_zero3_offload:optimizer.params.weight_decay")),
    "training_args.yaml": Example(
        "training_args", None,
        dict(micro_batch_size=4, grad_accum_steps=4, precision='bf16-master', optimizer='adamw-fused',
             checkpointing='full', sharding='zero2', engine='deepspeed', zero_knobs=ZERO2_FILE_KNOBS),
        read=("deepspeed per_device_train_batch_size gradient_accumulation_steps deepspeed_zero2:bf16.enabled bf16 "
              "deepspeed_zero2:train_micro_batch_size_per_gpu deepspeed_zero2:gradient_accumulation_steps "
              "deepspeed_zero2:train_batch_size optim gradient_checkpointing "
              "deepspeed_zero2:zero_optimization.reduce_bucket_size deepspeed_zero2:zero_optimization.stage "
              "deepspeed_zero2:zero_optimization deepspeed_zero2:zero_optimization.overlap_comm "
              "deepspeed_zero2:zero_optimization.contiguous_gradients"),
        not_sized="",
        other="deepspeed_zero2:zero_optimization.allgather_bucket_size",
        quiet=("output_dir per_device_eval_batch_size learning_rate max_steps "
               "gradient_checkpointing_kwargs.use_reentrant logging_steps report_to "
               "deepspeed_zero2:gradient_clipping deepspeed_zero2:wall_clock_breakdown")),
    "deepspeed_zero3_offload.json": Example(
        "deepspeed", None,
        dict(precision='bf16-master', micro_batch_size=2, grad_accum_steps=8, num_gpus=8, sharding='zero3',
             engine='deepspeed', offload='optimizer+params', zero_knobs=OFFLOAD_KNOBS),
        read=("bf16.enabled train_micro_batch_size_per_gpu gradient_accumulation_steps train_batch_size "
              "zero_optimization.stage zero_optimization.offload_param.device optimizer.type zero_optimization "
              "zero_optimization.reduce_bucket_size zero_optimization.stage3_param_persistence_threshold "
              "zero_optimization.stage3_prefetch_bucket_size zero_optimization.contiguous_gradients"),
        not_sized="",
        other=("zero_optimization.overlap_comm zero_optimization.offload_optimizer.pin_memory "
               "zero_optimization.offload_param.pin_memory "
               "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
        quiet=("gradient_clipping steps_per_print optimizer.params.lr optimizer.params.betas optimizer.params.eps "
               "optimizer.params.weight_decay")),
    "accelerate_deepspeed.yaml": Example(
        "accelerate", None,
        dict(num_gpus=8, sharding='zero3', engine='deepspeed', offload='optimizer', grad_accum_steps=4,
             precision='bf16-master'),
        read=("num_processes distributed_type deepspeed_config.zero_stage deepspeed_config.offload_optimizer_device "
              "deepspeed_config.gradient_accumulation_steps mixed_precision"),
        not_sized="",
        other="",
        quiet=("compute_environment debug deepspeed_config.gradient_clipping deepspeed_config.zero3_init_flag "
               "deepspeed_config.zero3_save_16bit_model downcast_bf16 machine_rank main_training_function "
               "rdzv_backend same_network tpu_env tpu_use_cluster tpu_use_sudo")),
    "accelerate_fsdp2.yaml": Example(
        "accelerate", None,
        dict(num_gpus=4, precision='amp-bf16', sharding='zero3', engine='torch', checkpointing='full'),
        read=("num_processes mixed_precision distributed_type fsdp_config.fsdp_reshard_after_forward "
              "fsdp_config.fsdp_activation_checkpointing"),
        not_sized="fsdp_config.fsdp_auto_wrap_policy",
        other="",
        quiet=("compute_environment debug downcast_bf16 enable_cpu_affinity "
               "fsdp_config.fsdp_cpu_ram_efficient_loading fsdp_config.fsdp_state_dict_type machine_rank "
               "main_training_function rdzv_backend same_network tpu_env tpu_use_cluster tpu_use_sudo")),
}


def _short(entry, name: str) -> str:
    return entry.field if entry.file == name else f"{Path(entry.file).stem}:{entry.field}"


@pytest.fixture
def in_configs(monkeypatch):
    monkeypatch.chdir(CONFIGS)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_reads_as_documented(name, in_configs):
    """The exact setup fields, model, fields read and fields ignored (by reason) of every example file."""
    expected = EXAMPLES[name]
    reading = read_config(name)
    assert reading.files[0].path == name and reading.files[0].format == expected.format
    assert detect_format(json.loads(Path(name).read_text()) if name.endswith(".json") else
                         __import__("yaml").safe_load(Path(name).read_text())) == expected.format
    assert reading.model == expected.model
    assert {k: getattr(v, "value", v) for k, v in reading.overrides.items()} == expected.overrides
    assert sorted(_short(e, name) for e in reading.read) == sorted(expected.read.split())
    groups = {"not_sized": [], "other": [], "quiet": []}
    for entry in reading.ignored:
        group = ("not_sized" if entry.why.startswith(NOT_SIZED) else
                 "quiet" if entry.why.startswith((NOT_RELEVANT, "off")) else "other")
        groups[group].append(_short(entry, name))
    for group, names in groups.items():
        assert sorted(names) == sorted(getattr(expected, group).split()), group


def test_what_memfit_cannot_size_yet_says_so(in_configs):
    lora = read_config("axolotl_lora_deepspeed.yaml")
    # one GPU: DeepSpeed runs the stage at world size 1 (no longer sized unsharded), and says so
    notes = {e.field: e.note for e in lora.read}
    assert "world size 1" in notes["zero_optimization.stage"] and lora.overrides["sharding"].value == "zero2"
    tune = {e.field: e.why for e in read_config("torchtune_full.yaml").ignored}
    assert read_config("torchtune_full.yaml").overrides["optimizer"].is_paged  # PagedAdamW8bit: sized as paged
    assert tune["enable_activation_offloading"].startswith("off")
    lora_tune = {e.field: e.why for e in read_config("torchtune_lora.yaml").ignored}
    assert read_config("torchtune_lora.yaml").overrides["compile"] is True
    assert lora_tune["enable_activation_offloading"].startswith(NOT_SIZED)
    notes = {e.field: e.note for e in read_config("deepspeed_zero2.json").read}
    assert notes["train_micro_batch_size_per_gpu"].startswith("'auto'") and "command line" in notes["bf16.enabled"]


def test_examples_build_a_valid_setup(in_configs):
    """Every reading is a setup memfit can estimate, on the GPU count the files (or the caller) give."""
    for name, expected in EXAMPLES.items():
        # torchtune's single-device recipes stay on one GPU (their bitsandbytes optimizer cannot step FSDP2)
        given = None if "num_gpus" in expected.overrides else 1 if expected.format == "torchtune" else 8
        reading = read_config(name, num_gpus=given)
        world = reading.overrides.get("num_gpus", given)
        hardware = make_hardware("H100", gpus_per_node=min(world, 8), num_nodes=max(1, world // 8))
        spec = as_spec(reading.model or "llama-3.1-8b")
        setup = reading.setup(spec, hardware)
        assert estimate(spec, setup, hardware).total_bytes > 0, name


def test_the_gpu_count_decides_what_zero_shards(in_configs, tmp_path):
    full = read_config("llamafactory_full.yaml", num_gpus=8)
    assert (full.overrides["sharding"], full.overrides["engine"]) == (Sharding.ZERO3, Engine.DEEPSPEED)
    assert "num_gpus" not in full.overrides  # the caller's, not the file's
    assert read_config("training_args.yaml", num_gpus=4).overrides["sharding"] is Sharding.ZERO2
    one = read_config("training_args.yaml")
    # one GPU: DeepSpeed runs the stage at world size 1 (whole partitions, fp32 copy, buckets), sized as such
    assert one.overrides["sharding"] is Sharding.ZERO2 and one.overrides["engine"] is Engine.DEEPSPEED
    tune = read_config("torchtune_full.yaml", num_gpus=2).overrides  # distributed recipes shard with FSDP2
    assert (tune["sharding"], tune["engine"]) == (Sharding.ZERO3, Engine.TORCH)
    assert read_config("deepspeed_zero3_offload.json", num_gpus=4).overrides["sharding"] is Sharding.ZERO3
    launcher = tmp_path / "four.yaml"
    launcher.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n"
                        f"  deepspeed_config_file: {CONFIGS / 'deepspeed_zero3_offload.json'}\n")
    with pytest.raises(ConfigError, match=r"(micro-batch 2 x accumulation 8 x 4 GPUs|sets gpus)"):
        read_config(launcher)


def test_files_combine_and_conflicts_name_both(in_configs, tmp_path):
    both = read_config("training_args.yaml", "deepspeed_zero2.json")
    assert [(f.path, f.format, f.via) for f in both.files] == [
        ("training_args.yaml", "training_args", ""),
        ("deepspeed_zero2.json", "deepspeed", "training_args.yaml: deepspeed")]
    assert both.overrides == read_config("training_args.yaml").overrides  # read once, through the reference
    with pytest.raises(ConfigError) as error:
        read_config("axolotl_full.yaml", "accelerate_fsdp2.yaml")
    assert "axolotl_full.yaml: bf16 sets precision bf16 but accelerate_fsdp2.yaml: mixed_precision sets amp-bf16" \
        in str(error.value) and "--precision" in str(error.value)
    (tmp_path / "model_kwargs.json").write_text(json.dumps({"dtype": "bfloat16", "attn_implementation": "eager"}))
    (tmp_path / "args.json").write_text(json.dumps({"per_device_train_batch_size": 4, "bf16": False}))
    pure = read_config(tmp_path / "args.json", tmp_path / "model_kwargs.json")
    assert (pure.overrides["precision"], pure.overrides["attention"]) == (Precision.BF16, "eager")
    assert read_config(tmp_path / "args.json").overrides["precision"] is Precision.FP32  # fp32 weights assumed
    assert "fp32 assumed" in {e.field: e.note for e in read_config(tmp_path / "args.json").read}["bf16"]


def test_fields_given_elsewhere_are_overridden_and_never_raise(in_configs, tmp_path, monkeypatch):
    reading = read_config("axolotl_full.yaml", overridden={"optimizer": "--optimizer"})
    assert "optimizer" not in reading.overrides
    assert {e.field: e.note for e in reading.read}["optimizer"] == "optimizer overridden by --optimizer"
    monkeypatch.chdir(tmp_path)
    Path("odd.yaml").write_text("base_model: gpt2\nmicro_batch_size: 2\noptimizer: galore_adamw\n")
    with pytest.raises(ConfigError, match=r"^odd.yaml: optimizer=.galore_adamw.: memfit sizes adamw_torch"):
        read_config("odd.yaml")
    assert "optimizer" not in read_config("odd.yaml", overridden={"optimizer": "--optimizer"}).overrides


def test_the_shared_mapping_reads_live_arguments_the_same(in_configs):
    """memfit.check's TrainingArguments mapping is the one the files go through."""
    kwargs = json.loads(Path("training_args.json").read_text())
    kwargs["deepspeed"] = str(CONFIGS / kwargs["deepspeed"])
    live = setup_from_training_args(kwargs, num_gpus=8).fields
    from_file = read_config("training_args.json", num_gpus=8).overrides
    assert {k: v for k, v in live.items() if k != "num_gpus"} == from_file


BAD = {
    "unknown.yaml": ("learning_rate_warmup: 3\nvocab: big\n", r"unknown.yaml: unknown config format \(keys: "),
    "optimizer.yaml": ("base_model: gpt2\noptimizer: adamw_frobnicate\n",
                       r"optimizer.yaml: optimizer='adamw_frobnicate': memfit sizes"),
    "stage5.json": ('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 5}}',
                    r"stage5.json: zero_optimization.stage=5: DeepSpeed has ZeRO stages 0-3"),
    "missing_ds.json": ('{"per_device_train_batch_size": 2, "deepspeed": "nowhere/ds.json"}',
                        r"missing_ds.json: deepspeed='nowhere/ds.json': no such file"),
    "garbage.bin": (bytes(range(256)) * 4, r"garbage.bin is not a text config file"),
    "broken.json": ('{"per_device_train_batch_size": ', r"broken.json is not valid JSON"),
    "list.yaml": ("- a\n- b\n", r"list.yaml holds list at the top, not a mapping"),
    "empty.yaml": ("  \n", r"empty.yaml is empty"),
    "fp16.yaml": ("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\ndtype: fp16\n",
                  r"fp16.yaml: dtype='fp16': torchtune's recipes refuse fp16"),
    "fp8.yaml": ("distributed_type: 'NO'\nmixed_precision: fp8\n", r"fp8.yaml: mixed_precision='fp8'"),
    "mismatch.json": ('{"per_device_train_batch_size": 4, "deepspeed": {"train_micro_batch_size_per_gpu": 2}}',
                      r"mismatch.json: deepspeed.train_micro_batch_size_per_gpu=2: does not match"),
    "total.json": ('{"train_micro_batch_size_per_gpu": 3, "train_batch_size": 10}',
                   r"total.json: train_batch_size=10: not micro-batch 3 x accumulation 1 x a whole number"),
    "fsdp.json": ('{"fsdp": "auto_wrap"}', r"fsdp.json: fsdp='auto_wrap': no sharding strategy"),
    "not_ds.json": ('{"per_device_train_batch_size": 2, "deepspeed": "unknown.yaml"}',
                    r"not_ds.json: deepspeed='unknown.yaml': unknown.yaml is not a DeepSpeed config"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line_config_error(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for other, (content, _) in BAD.items():
        (tmp_path / other).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as error:
        read_config(name)
    message = str(error.value)
    assert "\n" not in message and __import__("re").match(BAD[name][1], message), message


def test_a_directory_and_no_file_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is a directory: give the config file itself"):
        read_config(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        read_config(tmp_path / "nothing.yaml")
    with pytest.raises(ConfigError, match="at least one"):
        read_config()


def test_yaml_needs_pyyaml_said_in_one_line(monkeypatch, in_configs):
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(MissingDependencyError, match=r"^reading YAML configs needs PyYAML: pip install pyyaml$"):
        read_config("axolotl_full.yaml")
    assert read_config("deepspeed_zero3_offload.json").overrides["sharding"] is Sharding.ZERO3  # JSON needs none


@pytest.mark.processes
def test_reading_imports_neither_torch_nor_transformers():
    code = ("import sys; from memfit.readers import read_config; "
            f"read_config({str(CONFIGS / 'axolotl_lora_deepspeed.yaml')!r}); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'deepspeed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------- what memfit emits reads back the same

def _readback_expected(setup: TrainingSetup) -> TrainingSetup:
    """The setup the emitted files describe, where they cannot say it as memfit planned it (each case is what the
    emitter writes, and says in its README)."""
    deepspeed = uses_deepspeed(setup)
    out = setup
    if setup.precision is Precision.AMP_BF16 and deepspeed:
        out = out.replace(precision="bf16-master")  # DeepSpeed bf16 keeps bf16 weights + an fp32 master copy
    if setup.precision is Precision.BF16_MASTER and not deepspeed:
        out = out.replace(precision="amp-bf16")  # the Trainer has no bf16-weights + fp32 master mode
    if setup.optimizer is Optimizer.ADAMW and (not deepspeed or setup.offload is not Offload.NONE):
        out = out.replace(optimizer="adamw-foreach")  # no optim name for single-tensor AdamW; CPU Adam offloaded
    if deepspeed and setup.sharding is Sharding.NONE and setup.offload is not Offload.NONE:
        out = out.replace(sharding="zero1")  # DeepSpeed offloads only under ZeRO: stage 1 is written (one GPU too)
    if not deepspeed and setup.sharding is Sharding.NONE and setup.num_gpus > 1:
        out = out.replace(engine="torch")  # no DeepSpeed file: the Trainer / accelerate run DDP
    return out


def _matrix():
    cases = []
    for precision, optimizer, (checkpointing, accum), (sharding, gpus), offload, engine in itertools.product(
            list(Precision), ["adamw", "adamw-fused", "adamw-8bit"], [("none", 1), ("full", 4)],
            [("none", 1), ("none", 4), ("zero1", 4), ("zero2", 4), ("zero3", 8)], list(Offload), list(Engine)):
        try:
            setup = TrainingSetup(micro_batch_size=2, grad_accum_steps=accum, precision=precision,
                                  optimizer=optimizer, checkpointing=checkpointing,
                                  attention="eager" if accum == 1 else "sdpa", sharding=sharding, offload=offload,
                                  num_gpus=gpus, engine=engine)
        except ConfigError:
            continue
        if setup.engine is Engine.TORCH and setup.sharding is Sharding.ZERO1:
            continue  # torch's ZeRO-1 (ZeroRedundancyOptimizer) is code: memfit emits no config for it
        cases.append(setup)
    return cases


MATRIX = _matrix()

def _emitted(setup: TrainingSetup, directory: Path) -> Path:
    emit.write_all(setup, make_hardware("H100", gpus_per_node=setup.num_gpus), directory)
    return directory


def _differences(setup: TrainingSetup, overrides: dict) -> dict:
    got = TrainingSetup(**{**overrides, "seq_len": setup.seq_len})
    expected = _readback_expected(setup)
    idle_engine = setup.num_gpus == 1 and setup.offload is Offload.NONE  # one GPU, nothing offloaded: no engine
    relevant = [f for f in SETUP_FIELDS if not (f == "engine" and idle_engine)]
    return {f: (getattr(expected, f), getattr(got, f)) for f in relevant if getattr(expected, f) != getattr(got, f)}


def test_emitted_files_read_back_as_the_setup(tmp_path):
    """training_args.json (+ the deepspeed.json it names) + model_kwargs.json + accelerate.yaml, for a matrix of
    precisions, optimizers, checkpointing, accumulation, ZeRO 0-3 on both engines, offload and GPU counts."""
    checked = 0
    for i, setup in enumerate(MATRIX):
        directory = _emitted(setup, tmp_path / str(i))
        reading = read_config(directory / "training_args.json", directory / "model_kwargs.json",
                              directory / "accelerate.yaml")
        differences = _differences(setup, reading.overrides)
        assert differences == {}, (setup, differences)
        if uses_deepspeed(setup):  # accelerate.yaml alone: its DeepSpeed file holds the rest of the step
            alone = read_config(directory / "accelerate.yaml", directory / "model_kwargs.json").overrides
            for name in ("micro_batch_size", "grad_accum_steps", "sharding", "offload", "num_gpus", "precision"):
                assert alone.get(name, getattr(TrainingSetup(), name)) == getattr(_readback_expected(setup), name)
        checked += 1
    assert checked > 300
    assert sum(s.engine is Engine.TORCH and s.offload is Offload.OPTIMIZER_AND_PARAMS for s in MATRIX) > 10


def test_files_that_describe_it_differently_size_the_same(tmp_path):
    """Where the files say it another way (adamw as adamw_torch, offload-only as ZeRO-1, bf16-master as autocast
    under FSDP2), memfit's estimate of what was read equals the plan's, byte for byte."""
    spec, compared = as_spec("llama-3.2-1b"), 0
    for setup in MATRIX:
        expected = _readback_expected(setup)
        changed = {f for f in SETUP_FIELDS if getattr(expected, f) != getattr(setup, f)}
        same_bytes = changed <= {"optimizer", "sharding"} or (
            changed == {"precision"} and setup.engine is Engine.TORCH and setup.sharding.stage >= 2)
        if not changed or not same_bytes or (setup.engine is Engine.TORCH and setup.offload is not Offload.NONE):
            continue
        hardware = make_hardware("H100", gpus_per_node=setup.num_gpus)
        assert estimate(spec, expected, hardware).total_bytes == estimate(spec, setup, hardware).total_bytes, setup
        compared += 1
    assert compared > 20


def test_emitted_fsdp2_files_carry_the_torch_plan(tmp_path):
    setup = TrainingSetup(precision="bf16-master", sharding="zero3", offload="optimizer+params", num_gpus=8,
                          engine="torch", checkpointing="full")
    directory = _emitted(setup, tmp_path)
    reading = read_config(directory / "accelerate_fsdp2.yaml")
    assert (reading.overrides.get("sharding"), reading.overrides.get("offload")) == (
        Sharding.ZERO3, Offload.OPTIMIZER_AND_PARAMS)


# ------------------------------------------------------------------------------- the projects' own parsers agree

def _engines(*names: str) -> None:
    for name in names:
        pytest.importorskip(name)


@pytest.mark.parametrize("name", ["training_args.json", "training_args.yaml"])
def test_hf_argument_parser_reads_the_training_arguments_examples(name, in_configs, isolated_accelerate,
                                                                 monkeypatch):
    _engines("torch", "transformers", "accelerate", "deepspeed", "yaml")
    import transformers.training_args
    from transformers import HfArgumentParser, TrainingArguments

    # No GPU here: only TrainingArguments' "bf16 needs a GPU" check is skipped; the file is parsed as written.
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_json_file(name) if name.endswith(".json") else parser.parse_yaml_file(name)
    reading = read_config(name, num_gpus=8)
    assert args.per_device_train_batch_size == reading.overrides["micro_batch_size"]
    assert args.gradient_accumulation_steps == reading.overrides["grad_accum_steps"]
    assert args.bf16 and args.hf_deepspeed_config.is_zero3() == (reading.overrides["sharding"] is Sharding.ZERO3)
    # The DeepSpeed bridge agrees with every value but the total batch, which it computes for its world of one.
    assert all("train_batch_size" in m for m in args.hf_deepspeed_config.mismatches)


@pytest.mark.parametrize("name", ["deepspeed_zero2.json", "deepspeed_zero3.json", "deepspeed_zero3_offload.json"])
def test_deepspeed_parses_the_deepspeed_examples(name, monkeypatch):
    _engines("torch", "deepspeed")
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(ds_comm, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *args, **kwargs: 8)
    data = json.loads((CONFIGS / name).read_text())

    def without_auto(node):  # "auto" is the HF Trainer's / accelerate's to fill, as in tests/emit/test_emit.py
        return {k: without_auto(v) if isinstance(v, dict) else v for k, v in node.items() if v != "auto"}

    config = without_auto(data)
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    parsed = DeepSpeedConfig(config, mpu=None)
    reading = read_config(CONFIGS / name, num_gpus=8)
    assert parsed.zero_optimization_stage == reading.overrides["sharding"].stage
    if name == "deepspeed_zero3_offload.json":
        assert parsed.train_batch_size == 128 and read_config(CONFIGS / name).overrides["num_gpus"] == 8
        assert reading.overrides["offload"] is Offload.OPTIMIZER_AND_PARAMS and parsed.bfloat16_config.enabled


@pytest.mark.parametrize("name", ["accelerate_deepspeed.yaml", "accelerate_fsdp2.yaml"])
def test_accelerate_loads_the_accelerate_examples(name):
    _engines("torch", "accelerate", "yaml")
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / name))
    reading = read_config(CONFIGS / name)
    assert config.num_processes == reading.overrides["num_gpus"]
    assert config.distributed_type.value == {Engine.DEEPSPEED: "DEEPSPEED", Engine.TORCH: "FSDP"}[
        reading.overrides["engine"]]


# ---------------------------------------------------------------------------------------------- memfit --config

def invoke(*args: str):
    return CliRunner(env=NARROW).invoke(app, list(args))


def test_cli_config_names_the_model_and_the_setup(in_configs):
    result = invoke("estimate", "--config", "axolotl_full.yaml", "--gpu", "A100-80GB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == "llama-3.2-1b"
    setup = data["setup"]
    assert (setup["micro_batch_size"], setup["grad_accum_steps"], setup["seq_len"], setup["precision"],
            setup["optimizer"], setup["checkpointing"]) == (4, 8, 2048, "bf16", "paged-adamw-8bit", "full")
    assert [f["path"] for f in data["config"]["files"]] == ["axolotl_full.yaml"]
    read = {e["field"]: e for e in data["config"]["read"]}
    assert read["micro_batch_size"]["sets"] == {"micro_batch_size": 4}
    assert read["torch_compile"]["sets"] == {"compile": True} and setup["compile"] is True
    assert {e["field"] for e in data["config"]["ignored"]} >= {"datasets"}


def test_cli_options_override_the_config_and_count_as_given(in_configs):
    data = json.loads(invoke("plan", "--config", "training_args.json", "llama-3.1-8b", "--gpu", "H100", "-b", "1",
                             "--json").stdout)
    assert data["initial_setup"]["micro_batch_size"] == 1  # -b wins over per_device_train_batch_size
    assert data["initial_setup"]["num_gpus"] == 8 and data["world_size"] == 8  # from train_batch_size
    assert data["initial_setup"]["sharding"] == "zero3" and data["initial_setup"]["offload"] == "optimizer+params"
    assert set(data["explicit"]) >= {"micro_batch_size", "grad_accum_steps", "precision", "checkpointing",
                                     "sharding", "offload", "engine", "num_gpus"}
    notes = {(e["file"], e["field"]): e["note"] for e in data["config"]["read"]}
    assert notes[("training_args.json", "per_device_train_batch_size")] == "micro-batch overridden by --batch"
    four = json.loads(invoke("estimate", "--config", "training_args.json", "llama-3.1-8b", "--gpus", "4",
                             "--json").stdout)
    assert four["world_size"] == 4 and any(e["field"] == "train_batch_size" and "--gpus" in e["note"]
                                           for e in four["config"]["read"])


def test_cli_config_section_and_combined_files(in_configs):
    result = invoke("fit", "--config", "training_args.yaml,deepspeed_zero2.json", "mistral-7b", "--max", "batch",
                    "--gpus", "4")
    assert result.exit_code in (0, 1), result.output
    out = result.stdout
    section = out[out.index("Read from --config:"):]
    assert "deepspeed_zero2.json (deepspeed, named by training_args.yaml: deepspeed)" in " ".join(section.split())
    assert "per_device_train_batch_size=4 -> micro-batch 4" in section
    assert "zero_optimization.stage=2 -> sharding zero2" in section
    assert "not memory-relevant or off:" in section
    assert max(len(line) for line in section.splitlines()) <= 80
    repeated = invoke("estimate", "--config", "training_args.yaml", "--config", "deepspeed_zero2.json", "mistral-7b",
                      "--gpus", "4", "--json")
    assert json.loads(repeated.stdout)["setup"]["sharding"] == "zero2"


@pytest.mark.parametrize("args,says", [
    (("estimate", "--config", "nowhere.yaml"), "nowhere.yaml: no such file"),
    (("estimate", "--config", "."), "is a directory"),
    (("plan", "--config", "training_args.json"), "Missing argument 'MODEL'"),
    (("plan",), "Missing argument"),
])
def test_cli_bad_config_is_one_error_line(args, says, in_configs):
    result = invoke(*args)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr


def test_cli_unmappable_value_is_one_error_line(tmp_path):
    bad = tmp_path / "recipe.yaml"
    bad.write_text("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\n"
                   "optimizer:\n  _component_: torch.optim.Lion\n")
    result = invoke("estimate", "--config", str(bad), "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert "optimizer._component_='torch.optim.Lion'" in result.stderr and result.stderr.count("\n") == 1
    fine = invoke("estimate", "--config", str(bad), "--optimizer", "adamw", "--json")  # the option overrides it
    assert fine.exit_code == 0 and json.loads(fine.stdout)["model"] == "llama-3.2-1b"


def test_every_setup_command_takes_config():
    for command in ("plan", "estimate", "fit", "trace", "measure"):
        assert "--config" in invoke(command, "--help").stdout, command


# --------------------------------------------------------------------------------------------- LoRA / QLoRA

LORA_EXAMPLES = {"axolotl_qlora.yaml": "qlora", "axolotl_lora_deepspeed.yaml": "lora",
                 "llamafactory_lora_sft.yaml": "lora", "llamafactory_lora.yaml": "qlora",
                 "torchtune_qlora.yaml": "qlora", "torchtune_lora.yaml": "lora", "adapter_config.json": "lora"}


@pytest.mark.parametrize("name", sorted(LORA_EXAMPLES))
def test_cli_plan_takes_the_lora_method_from_the_config(name, in_configs):
    result = invoke("plan", "--config", name, "--gpu", "H100", "--json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["initial_setup"]["finetune"]["method"] == LORA_EXAMPLES[name]
    assert data["initial_setup"]["finetune"] == EXAMPLES[name].overrides["finetune"].to_dict()
    read = {e["field"]: e for e in data["config"]["read"] if e["file"] == name}
    assert any("finetune" in e["sets"] for e in read.values())


def test_lora_reads_say_where_each_part_and_default_came_from(in_configs):
    tune = {e.field: e for e in read_config("torchtune_qlora.yaml").read}
    assert "torchao's NF4Tensor (block 64, scaler block 256)" in tune["model._component_"].note
    assert "--lora-recipe torchtune" in tune["model._component_"].note
    assert tune["model.lora_attn_modules"].text.endswith("(output_proj is o_proj)")
    factory = {e.field: e for e in read_config("llamafactory_lora.yaml").read}
    assert "alpha 16.0 (LLaMA-Factory's default: lora_rank * 2)" in factory["finetuning_type"].note
    assert "double_quant True (LLaMA-Factory's default double_quantization true)" in factory["finetuning_type"].note
    assert factory["quantization_bit"].sets == (("finetune.base", "nf4"),)
    axolotl = {e.field: e.text for e in read_config("axolotl_qlora.yaml").read}
    assert axolotl["lora_r"] == "lora_r=16 -> LoRA rank 16"
    assert axolotl["adapter"].startswith("adapter='qlora' -> method qlora r=16 no k-bit prep")


def test_adapter_config_combines_with_training_arguments_and_a_quantized_base(in_configs, tmp_path):
    both = read_config("training_args.yaml", "adapter_config.json", num_gpus=4)
    assert both.overrides["finetune"] == EXAMPLES["adapter_config.json"].overrides["finetune"]
    assert both.overrides["precision"] is Precision.BF16_MASTER and both.model == "meta-llama/Llama-3.2-1B"
    kwargs = tmp_path / "model_kwargs.json"
    kwargs.write_text(json.dumps({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                                          "bnb_4bit_use_double_quant": True}}))
    quantized = read_config("adapter_config.json", kwargs).overrides["finetune"]
    assert quantized == EXAMPLES["adapter_config.json"].overrides["finetune"].replace(method="qlora")
    eight = tmp_path / "eight.json"
    eight.write_text(json.dumps({"dtype": "bfloat16", "quantization_config": {"load_in_8bit": True}}))
    assert read_config("adapter_config.json", eight).overrides["finetune"].base.value == "int8"
    with pytest.raises(ConfigError, match="a quantized base trains only through LoRA adapters"):
        read_config(kwargs)
    with pytest.raises(ConfigError, match=r"sets method lora r=32 but .*adapter_config.json: peft_type sets"):
        read_config("axolotl_lora_deepspeed.yaml", "adapter_config.json")


LORA_BAD = {
    "freeze.yaml": ("model_name_or_path: gpt2\nfinetuning_type: freeze\n",
                    "finetuning_type='freeze': freeze (partial-parameter) fine-tuning is not sized"),
    "hqq.yaml": ("model_name_or_path: gpt2\nfinetuning_type: lora\nquantization_bit: 4\nquantization_method: hqq\n",
                 "quantization_method='hqq': memfit sizes bitsandbytes"),
    "bits.yaml": ("model_name_or_path: gpt2\nfinetuning_type: lora\nquantization_bit: 2\n", "quantization_bit=2"),
    "full_quant.yaml": ("model_name_or_path: gpt2\nfinetuning_type: full\nquantization_bit: 4\n",
                        "quantization_bit=4: LLaMA-Factory quantizes the base only for finetuning_type lora"),
    "ax_head.yaml": ("base_model: gpt2\nadapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_target_modules: [c_attn, "
                     "lm_head]\n", "lora_target_modules=['c_attn', 'lm_head']: LoRA on the output head"),
    "ax_qlora.yaml": ("base_model: gpt2\nadapter: qlora\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n",
                      "adapter='qlora': adapter qlora needs load_in_4bit: true"),
    "ax_rank.yaml": ("base_model: gpt2\nadapter: lora\nlora_r: 0\nlora_alpha: 16\nlora_target_linear: true\n",
                     "lora_r=0: LoRA rank must be a positive whole number"),
    "ax_targets.yaml": ("base_model: gpt2\nadapter: lora\nlora_r: 8\nlora_alpha: 16\n",
                        "adapter='lora': neither lora_target_modules nor lora_target_linear is set"),
    "ax_full4bit.yaml": ("base_model: gpt2\nload_in_4bit: true\n", "load_in_4bit=True: a quantized base trains only"),
    "ax_gptq.yaml": ("base_model: gpt2\nadapter: lora\ngptq: true\nlora_r: 8\nlora_alpha: 8\n"
                     "lora_target_linear: true\n", "gptq=True: a GPTQ-quantized base is not sized"),
    "tt_head.yaml": ("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  lora_attn_modules: "
                     "[q_proj]\n  apply_lora_to_output: true\n", "model.apply_lora_to_output=True: LoRA on the "
                                                                 "output head (lm_head) is not sized"),
    "tt_attn.yaml": ("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  lora_attn_modules: "
                     "[qkv]\n", "model.lora_attn_modules=['qkv']: qkv: torchtune's attention modules are"),
    "peft_rank.json": ('{"peft_type": "LORA", "r": 8, "rank_pattern": {"q_proj": 64}}',
                       "rank_pattern={'q_proj': 64}: per-module ranks are not sized"),
    "peft_ia3.json": ('{"peft_type": "IA3", "target_modules": ["k_proj"]}', "peft_type='IA3': memfit sizes peft's "
                                                                            "LORA adapters"),
    "peft_regex.json": ('{"peft_type": "LORA", "target_modules": ".*q_proj"}',
                        "target_modules='.*q_proj': a string target is a regular expression"),
}


@pytest.mark.parametrize("name", sorted(LORA_BAD))
def test_unmappable_lora_values_are_one_line(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    content, says = LORA_BAD[name]
    Path(name).write_text(content)
    with pytest.raises(ConfigError) as error:
        read_config(name)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{name}: ") and says in message, message
    result = invoke("plan", "--config", name, "gpt2", "--gpu", "H100", "--json")
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.count("\n") == 1 and says in result.stderr
    if name.startswith(("freeze", "ax_head", "tt_head")):  # --method takes the field over: no error
        assert invoke("plan", "--config", name, "gpt2", "--gpu", "H100", "--method", "full",
                      "--json").exit_code in (0, 1)


def _lora_matrix():
    cases = []
    finetunes = [Finetune("lora", rank=16, alpha=32, dropout=0.05, targets=("q_proj", "v_proj")),
                 Finetune("lora", targets=(ALL_LINEAR,), modules_to_save=("lm_head",)),
                 Finetune("lora", rank=4, base="fp32"), Finetune("lora", rank=8, base="int8"),
                 Finetune("qlora", rank=64, alpha=16, targets=(ALL_LINEAR,)),
                 Finetune("qlora", base="fp4", double_quant=False, targets=("q_proj", "k_proj", "v_proj")),
                 Finetune("qlora", rank=16, targets=(ALL_LINEAR,), kbit_prep=False)]
    for ft, precision, (sharding, gpus) in itertools.product(
            finetunes, ["amp-bf16", "bf16", "fp32", "amp-fp16"], [("none", 1), ("none", 2), ("zero2", 4)]):
        try:
            cases.append(TrainingSetup(micro_batch_size=2, precision=precision, sharding=sharding, num_gpus=gpus,
                                       engine="deepspeed" if sharding != "none" else "torch", finetune=ft))
        except ConfigError:
            continue
    return cases


def test_emitted_peft_settings_read_back_as_the_finetune(tmp_path):
    """peft.json (lora_config + model_kwargs) beside the Trainer files reads back as the Finetune planned; a LoRA
    base stored in the compute dtype reads as 'auto', which is what it means."""
    checked = 0
    for i, setup in enumerate(_lora_matrix()):
        directory = _emitted(setup, tmp_path / str(i))
        reading = read_config(directory / "training_args.json", directory / "model_kwargs.json",
                              directory / "accelerate.yaml", directory / "peft.json")
        expected = setup.finetune
        if expected.base.value == setup.precision.compute_dtype or (
                expected.method.value == "qlora" and expected.base.value == "nf4"):
            expected = expected.replace(base="auto")
        assert reading.overrides["finetune"] == expected, setup
        assert read_config(directory / "peft.json").overrides["finetune"].replace(base="auto") == \
            expected.replace(base="auto")
        if not (uses_deepspeed(setup) and setup.finetune.base_storage(setup.precision.compute_dtype).quantized):
            # (DeepSpeed bf16 reads back as bf16-master, which a quantized base refuses: the emitter's to settle)
            assert _differences(setup, {k: v for k, v in reading.overrides.items() if k != "finetune"}) == {}, setup
        checked += 1
    assert checked > 30


def test_peft_dora_is_read_and_sized(tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                "use_dora": True, "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    assert read_config(str(path)).overrides["finetune"].dora is True
    result = invoke("plan", "--config", str(path), "--gpu", "H100")
    assert result.exit_code == 0 and "DoRA" in result.output, result.output


@pytest.mark.parametrize("key,loss", [("chunked_cross_entropy", "chunked"),
                                      ("liger_fused_linear_cross_entropy", "fused"), ("cut_cross_entropy", "fused")])
def test_axolotl_loss_switches_set_the_loss(tmp_path, key, loss):
    """axolotl's chunked cross-entropy and its fused-loss integrations map to the loss memfit sizes."""
    path = tmp_path / "axolotl.yaml"
    path.write_text(f"base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 2\nsequence_len: 1024\n{key}: true\n")
    read = read_config(path)
    assert str(read.overrides["loss"]) == loss
    assert key in {e.field for e in read.read}


# ---- DeepSpeed's ZeRO buffer sizes as the user's JSON sets them (memfit.zero_knobs) --------------------------------


def test_deepspeed_bucket_sizes_are_read_as_given_and_defaulted_as_deepspeed_does(tmp_path):
    from memfit.zero_knobs import DEEPSPEED_DEFAULTS, ZeroKnobs

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7,
                                                      "stage3_param_persistence_threshold": "auto"}}))
    knobs = read_config(str(path), num_gpus=2).overrides["zero_knobs"]
    # a number as given, "auto" as the HF Trainer fills it, a key left out as DeepSpeed's own default
    assert knobs == ZeroKnobs(reduce_bucket_size=50_000_000, param_persistence_threshold=None,
                              max_reuse_distance=DEEPSPEED_DEFAULTS.max_reuse_distance,
                              prefetch_bucket_size=DEEPSPEED_DEFAULTS.prefetch_bucket_size)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    # below stage 3 only the reduce bucket means anything: DeepSpeed's 5e8 elements
    assert read_config(str(path), num_gpus=2).overrides["zero_knobs"] == ZeroKnobs(
        reduce_bucket_size=DEEPSPEED_DEFAULTS.reduce_bucket_size)
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                      "stage3_prefetch_bucket_size": "auto",
                                                      "stage3_param_persistence_threshold": "auto"}}))
    assert "zero_knobs" not in read_config(str(path), num_gpus=2).overrides  # memfit's own emitted file


def test_a_read_bucket_size_is_what_the_estimate_and_the_emitted_config_use(tmp_path):
    from memfit.emit import deepspeed_config
    from memfit.estimate.analytic import estimate
    from memfit.hardware import make_hardware
    from memfit.setup import TrainingSetup
    from memfit.sources import resolve_model
    from memfit.zero_knobs import ZeroKnobs

    spec, hw = resolve_model("llama-3.2-1b"), make_hardware("H100", gpus_per_node=2)
    setup = TrainingSetup(num_gpus=2, sharding="zero2", zero_knobs=ZeroKnobs(reduce_bucket_size=500_000_000))
    # ZeRO-2 allocates its bucket when the first gradient is ready: it is in the moments that make gradients
    from memfit.estimate.static import full_static, shard

    sized = setup.replace(precision="bf16-master") if setup.precision.is_autocast else setup
    bucket = shard(spec, sized, full_static(spec, sized)).comm_buffers_bytes
    assert estimate(spec, setup, hw).tensor_bytes > 0
    assert bucket == 500_000_000 * 2  # bf16 under DeepSpeed's bf16 engine: 1 GB, not hidden^2's 8 MiB
    assert deepspeed_config(setup)["zero_optimization"]["reduce_bucket_size"] == 500_000_000
