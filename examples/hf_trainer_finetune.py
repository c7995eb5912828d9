"""Fine-tune a (tiny, random) Llama with HF's Trainer on CPU, set up by memfit.

memfit's `apply_` switches on gradient checkpointing and builds the optimizer the setup names; the Trainer gets that
optimizer and the setup's micro-batch / accumulation numbers. `measure` runs two real steps of the same setup first
and says where the memory of a step goes. Swap the config dict for `AutoConfig.from_pretrained(...)` and the model
for `from_pretrained` to do the same with a real checkpoint.

    python examples/hf_trainer_finetune.py
"""

from __future__ import annotations

import importlib.util
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from memfit import TrainingSetup
from memfit.apply import apply_
from memfit.measure import measure
from memfit.units import format_bytes

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512,
}


class RandomTokens(torch.utils.data.Dataset):
    """Stands in for a tokenised corpus: fixed random token ids, labels = ids (the model shifts them)."""

    def __init__(self, num_sequences: int, seq_len: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, vocab_size, (num_sequences, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index].clone()}


def main() -> None:
    optimizer = "adamw-8bit" if importlib.util.find_spec("bitsandbytes") else "adamw"
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, grad_accum_steps=2, precision="fp32",
                          optimizer=optimizer, checkpointing="full", attention="sdpa")

    measured = measure(TINY_LLAMA, setup, device="cpu")  # a twin built from the same config
    parts = ", ".join(f"{c}: {format_bytes(b)}" for c, b in measured.by_category().items() if b)
    print(f"measured peak of one step: {format_bytes(measured.total_bytes)} in {measured.peak_phase} ({parts})")

    config = AutoConfig.for_model(**TINY_LLAMA)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config)
    applied = apply_(model, setup)
    print(applied.summary())

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, use_cpu=True, max_steps=3, report_to=[], save_strategy="no",
            per_device_train_batch_size=applied.micro_batch_size,
            gradient_accumulation_steps=applied.grad_accum_steps,
            logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(64, setup.seq_len, 512),
                          optimizers=(applied.make_optimizer(model), None))
        result = trainer.train()
    checkpointing = "on" if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) else "off"
    print(f"memfit example: Trainer ran {result.global_step} steps with {type(trainer.optimizer.optimizer).__name__}"
          f", checkpointing {checkpointing}, final loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
