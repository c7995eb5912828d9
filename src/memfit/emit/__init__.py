"""Engine configs from a TrainingSetup: HF Trainer, DeepSpeed, accelerate and FSDP2. Pure functions; the engines
themselves are imported only by the tests that check the output against their own parsers."""

from .accelerate import accelerate_config, accelerate_file
from .deepspeed import deepspeed_config, deepspeed_file, zero_stage
from .emitted import WARNING_KEY, EmittedConfig, uses_deepspeed
from .fsdp import fsdp2_code, fsdp2_file, fsdp2_unsupported
from .hf_trainer import hf_model_file, hf_model_kwargs, hf_trainer_file, hf_trainer_kwargs, legacy_checkpointing_names
from .write import config_path, emitted_files, unmarked_files, write_all

__all__ = [
    "WARNING_KEY", "EmittedConfig", "accelerate_config", "accelerate_file", "config_path", "deepspeed_config",
    "deepspeed_file", "emitted_files", "fsdp2_code", "fsdp2_file", "fsdp2_unsupported", "hf_model_file",
    "hf_model_kwargs", "hf_trainer_file", "hf_trainer_kwargs", "legacy_checkpointing_names", "unmarked_files",
    "uses_deepspeed", "write_all", "zero_stage",
]
