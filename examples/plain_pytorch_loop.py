"""memfit end to end on a model written in plain PyTorch: measure a step, apply a setup that trades compute for
memory (gradient checkpointing + a smaller micro-batch with accumulation), measure again, then train with an
ordinary hand-written loop.

    python examples/plain_pytorch_loop.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit import TrainingSetup
from memfit.apply import apply_
from memfit.measure import measure
from memfit.units import format_bytes

VOCAB_SIZE = 512


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB_SIZE, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def token_batches(num_sequences: int, micro_batch_size: int, seq_len: int) -> list[dict]:
    ids = torch.randint(0, VOCAB_SIZE, (num_sequences, seq_len), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": chunk, "labels": chunk.clone()} for chunk in ids.split(micro_batch_size)]


def main() -> None:
    torch.manual_seed(0)
    model = TinyDecoder()
    original = TrainingSetup(micro_batch_size=8, seq_len=128, precision="fp32", optimizer="adamw")
    before = measure(model, original, batches=token_batches(8, 8, original.seq_len))

    # The same 8 sequences per optimizer step, 2 at a time, each block recomputed in backward.
    lean = original.replace(checkpointing="full", micro_batch_size=2, grad_accum_steps=4)
    applied = apply_(model, lean)
    print(applied.summary())
    batches = token_batches(8, lean.micro_batch_size, lean.seq_len)
    optimizer = applied.make_optimizer(model)
    after = measure(model, lean, batches=batches, optimizer=optimizer)
    for name, result in (("before", before), ("after", after)):
        parts = ", ".join(f"{t.name} {format_bytes(t.num_bytes)}" for t in result.terms if t.num_bytes)
        print(f"{name}: peak {format_bytes(result.total_bytes)} in {result.peak_phase} ({parts})")

    losses = []
    for _ in range(5):  # an ordinary loop: autocast (a no-op for fp32), accumulation, step
        for batch in batches:
            with applied.autocast():
                loss = model(**batch)
            (loss / applied.grad_accum_steps).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"memfit example: peak {format_bytes(before.total_bytes)} -> {format_bytes(after.total_bytes)}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
