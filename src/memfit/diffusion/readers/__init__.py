"""Read the config of the diffusion trainer you already use -> `memfit diffusion`'s settings (size_run's keyword
arguments), the model it names, and every field read, read with no effect, or left out and why:

- kohya sd-scripts: its --config_file TOML, or the command line of flux_train_network.py, sdxl_train_network.py,
  sd3_train_network.py, flux_train.py, sdxl_train.py, sd3_train.py (memfit.diffusion.readers.kohya);
- the diffusers DreamBooth scripts' command lines (train_dreambooth_lora_{flux,sd3,sdxl}.py,
  train_dreambooth_{flux,sd3}.py): memfit.diffusion.readers.diffusers_scripts;
- ostris ai-toolkit's job YAML (memfit.diffusion.readers.ai_toolkit).

musubi-tuner's image scripts train FLUX.1 Kontext, FLUX.2 and Qwen-Image, which memfit's catalog does not hold yet;
SimpleTuner's config.json is not read yet. Both are refused in one line.

    reading = read_diffusion_config("flux_lora.toml")
    reading.model, reading.kwargs, [e.text for e in reading.read], [e.text for e in reading.ignored]
"""

from .common import LEVERS
from .reading import FORMATS, DiffusionReading, read_diffusion_config, split_words, with_config

__all__ = ["FORMATS", "LEVERS", "DiffusionReading", "read_diffusion_config", "split_words", "with_config"]
