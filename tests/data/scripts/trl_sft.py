"""TRL's SFTTrainer with a LoRA adapter (peft) on a tiny Llama and a pre-tokenized synthetic dataset."""
import argparse

import torch

from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--output-dir", default="sft-out")
args = parser.parse_args()

vocab = {f"t{i}": i for i in range(512)}
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                    pad_token="t0", eos_token="t1")
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
rows = [[(7 * i + j) % 510 + 2 for j in range(args.seq_len)] for i in range(16)]
dataset = Dataset.from_dict({"input_ids": rows})
training_args = SFTConfig(output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, max_steps=8,
                          learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                          max_length=args.seq_len, packing=False, disable_tqdm=True, seed=0,
                          dataloader_num_workers=0, bf16=torch.cuda.is_available())
trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
trainer.train()
