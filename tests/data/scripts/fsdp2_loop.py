"""A torchrun FSDP2 loop (torch.distributed.fsdp.fully_shard per decoder layer, then the root), tiny Llama, AdamW."""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
if torch.cuda.is_available():
    torch.cuda.set_device(device)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
model = LlamaForCausalLM(config).to(device)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(10):
    batch = torch.randint(0, config.vocab_size, (2, 64), device=device)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
