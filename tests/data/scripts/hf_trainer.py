"""An HF Trainer fine-tune of a tiny Llama on a synthetic token dataset (TrainingArguments, Trainer.train())."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="hf-trainer-out")
parser.add_argument("--fsdp", default="", help='e.g. "full_shard auto_wrap"')
parser.add_argument("--deepspeed", default=None, help="a DeepSpeed config JSON")
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
args = parser.parse_args()


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
training_args = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
                                  max_steps=8, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                                  report_to=[], dataloader_num_workers=0, disable_tqdm=True, seed=0,
                                  fsdp=args.fsdp, deepspeed=args.deepspeed,
                                  fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]} if args.fsdp
                                  else None)
trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(32, args.seq_len, config.vocab_size))
trainer.train()
