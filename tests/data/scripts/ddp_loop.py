"""A torchrun DDP loop (torch.nn.parallel.DistributedDataParallel), tiny Llama, AdamW."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--bucket-cap-mb", type=float, default=None)
parser.add_argument("--gradient-as-bucket-view", action="store_true")
parser.add_argument("--find-unused-parameters", action="store_true")
parser.add_argument("--model", default=None, help="a hub id or local folder (default: a tiny Llama)")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
if torch.cuda.is_available():
    torch.cuda.set_device(device)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
base = AutoModelForCausalLM.from_pretrained(args.model) if args.model else LlamaForCausalLM(config)
model = DDP(base.to(device), device_ids=[rank] if torch.cuda.is_available() else None,
            bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view,
            find_unused_parameters=args.find_unused_parameters)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(10):
    batch = torch.randint(0, base.config.vocab_size, (args.batch_size, args.seq_len), device=device)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
