"""Read the config you already have: HF TrainingArguments (JSON / YAML), DeepSpeed JSON, accelerate YAML, axolotl,
LLaMA-Factory and torchtune recipe files, peft adapter_config.json (and memfit's peft.json) -> the TrainingSetup
fields they set (their LoRA / QLoRA settings as `finetune`), the model they name, and what was read
and what was left out (and why). Torch-free; PyYAML is imported only for YAML files.

    reading = memfit.readers.read_config("axolotl.yaml")
    reading.overrides, reading.model, [e.text for e in reading.read], [e.text for e in reading.ignored]
    setup = reading.setup(spec, hardware)

The mapping of HF TrainingArguments, DeepSpeed and FSDP settings (memfit.readers.hf) is the one memfit.check uses
for the live objects of a training script."""

from ._reader import NOT_RELEVANT, NOT_SIZED, IgnoredEntry, ReadEntry
from .files import FORMATS, detect_format
from .formats import ConfigFile
from .reading import ConfigReading, InMemory, read_config

__all__ = ["FORMATS", "NOT_RELEVANT", "NOT_SIZED", "ConfigFile", "ConfigReading", "IgnoredEntry", "InMemory", "ReadEntry",
           "detect_format", "read_config"]
