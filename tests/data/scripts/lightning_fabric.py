"""A Lightning Fabric loop on a tiny Llama: fabric.setup, fabric.backward, AdamW."""
import argparse

import torch
from lightning.fabric import Fabric
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--strategy", default="auto")
args = parser.parse_args()

fabric = Fabric(accelerator="auto", devices=args.devices, strategy=args.strategy)
fabric.launch()
fabric.seed_everything(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
with fabric.init_module():
    model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.randint(0, 512, (16, args.seq_len)),
                                                              batch_size=args.batch_size))
model.train()
for step, batch in enumerate(loader):
    loss = model(input_ids=batch, labels=batch).loss
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.print(f"step {step} loss {loss.item():.4f}")
