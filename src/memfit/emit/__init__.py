"""Engine configs from a TrainingSetup: HF Trainer, DeepSpeed, accelerate and FSDP2. Pure functions; the engines
themselves are imported only by the tests that check the output against their own parsers."""

from .accelerate import accelerate_config, accelerate_file
from .deepspeed import deepspeed_config, deepspeed_file, zero_stage
from .emitted import EmittedConfig, uses_deepspeed
from .fsdp import fsdp2_code, fsdp2_file, fsdp2_unsupported
from .hf_trainer import hf_model_file, hf_model_kwargs, hf_trainer_file, hf_trainer_kwargs
from .write import emitted_files, write_all

__all__ = [
    "EmittedConfig", "accelerate_config", "accelerate_file", "deepspeed_config", "deepspeed_file", "emitted_files",
    "fsdp2_code", "fsdp2_file", "fsdp2_unsupported", "hf_model_file", "hf_model_kwargs", "hf_trainer_file",
    "hf_trainer_kwargs", "uses_deepspeed", "write_all", "zero_stage",
]
