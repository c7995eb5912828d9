"""Fine-tune whatever `--model` names (a hub id or a local folder), as a tutorial does: from_pretrained, AdamW."""
import argparse

import torch
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to("cuda")
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for step in range(100):
    batch = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), device="cuda")
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
