"""The configuration snippets a plan shows for its final setup (`memfit plan`'s "Configuration for the final
setup" and the page's): the HF TrainingArguments and model-loading calls, the LoRA / QLoRA loading code and the
DeepSpeed JSON, as text. The command line and `memfit serve` both print these; they are built here once."""

from __future__ import annotations

import textwrap
from pathlib import Path

from . import render
from .emit import config_path, deepspeed_config, hf_model_kwargs, hf_trainer_kwargs, uses_deepspeed
from .emit.apply_file import APPLY_FILE, apply_call, apply_summary
from .emit.hf_trainer import trainer_cannot_express
from .emit.peft import base_dtype, bnb_config_kwargs, lora_config_kwargs, prepare_line
from .emit.litgpt import litgpt_file
from .errors import MemfitError
from .setup import ModelCode


def config_snippets(setup, *, emitted: Path | None = None, auto_class: str = "AutoModelForCausalLM",
                    hub_id: str | None = None, model_type: str = "") -> dict[str, str]:
    """HF kwargs always; the DeepSpeed JSON when the setup shards or offloads. With
    --emit DIR, the kwargs name DIR's deepspeed.json as training_args.json does. `auto_class`: the transformers
    class that loads the model (ModelSpec.auto_class). A setup sized with LitGPT's own model that LitGPT's scripts
    can run: LitGPT's config instead (`hub_id` / `model_type`: its checkpoint and family)."""
    if setup.model_code is ModelCode.LITGPT:
        try:
            litgpt = litgpt_file(setup, hub_id=hub_id, model_type=model_type or "llama")
        except MemfitError:
            pass
        else:
            return {f"LitGPT config ({litgpt.notes[0].removeprefix('run: ')}):": litgpt.render().rstrip()}
    deepspeed_path = config_path(emitted, "deepspeed.json") if emitted is not None else "deepspeed.json"
    items = {"transformers.TrainingArguments (add output_dir, schedule):":
             render.python_call("TrainingArguments", hf_trainer_kwargs(setup, deepspeed_path=deepspeed_path)),
             "model loading:": render.python_call(f"{auto_class}.from_pretrained", hf_model_kwargs(setup))}
    if setup.finetune.adapters:
        items.update(_adapter_snippets(setup, render, auto_class))
    items.update(_apply_snippet(setup, emitted))
    if uses_deepspeed(setup):
        try:
            items["deepspeed.json:"] = render.compact_json(deepspeed_config(setup, hf_auto=True))
        except MemfitError as error:
            items["deepspeed.json: not expressible"] = str(error)
    if emitted is None:
        items["all engine files (accelerate, FSDP2, README):"] = "memfit plan ... --emit DIR"
    return items


def _apply_snippet(setup, emitted: Path | None) -> dict[str, str]:
    """What TrainingArguments cannot carry but the plan sized (selective checkpointing, activation offloading):
    the line that puts it on the loaded model (memfit.emit.apply_file); without it the step is another one."""
    items = {}
    line = apply_call(setup, config_path(emitted, APPLY_FILE) if emitted is not None else None)
    if line is not None:
        title = (f"{apply_summary(setup)}: sized, but TrainingArguments cannot express it; on the loaded model, "
                 "before Trainer(...):")
        items[title] = f"import memfit\n{line}"
    notes = trainer_cannot_express(setup)
    if notes:  # the chunked loss, the step in backward: torchtune's, said where they are
        items["sized, but the HF Trainer cannot run it (the figure assumes it):"] = "\n".join(
            "# " + line for note in notes for line in textwrap.wrap(note, width=72))
    return items


def _adapter_snippets(setup, render, auto_class: str) -> dict[str, str]:
    """LoRA / QLoRA: how to load the base (dtype, or BitsAndBytesConfig) and the LoraConfig, as memfit sized them."""
    bnb = bnb_config_kwargs(setup)
    model = dict(hf_model_kwargs(setup))
    loading = []
    if bnb:
        loading.append(render.python_call("bnb = BitsAndBytesConfig", bnb))
        model["quantization_config"] = _Code("bnb")
    else:
        model["dtype"] = base_dtype(setup)
    loading.append(render.python_call(f"model = {auto_class}.from_pretrained", model))
    if bnb:
        loading.append(prepare_line(setup))
    loading.append("model = get_peft_model(model, " + render.python_call("LoraConfig", lora_config_kwargs(setup))
                   .replace("\n", "\n    ") + ")")
    return {"model loading:": "\n".join(loading)}


class _Code(str):
    """A name printed as code, not as a string literal, inside python_call."""

    def __repr__(self) -> str:
        return str(self)
