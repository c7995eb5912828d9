"""A plain PyTorch training loop on a tiny Llama (transformers), AdamW, the way a tutorial writes it."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=1e-4)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
model = LlamaForCausalLM(config).to(device)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = torch.randint(0, config.vocab_size, (args.steps, args.batch_size, args.seq_len))

for step in range(args.steps):
    batch = data[step].to(device)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.4f}")
