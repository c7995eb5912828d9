"""Pipeline parallelism on a real model, as torchtitan splits a Llama (torchtitan/distributed/pipeline_parallel.py,
pipeline_module_split: each stage keeps its own decoder layers; the first also the token embedding, the last the
final norm and the LM head): `stage_module` cuts a transformers Llama-style causal LM into one stage's module,
`schedule` builds torch.distributed.pipelining's schedule over it, `P2PCounter` counts the bytes each rank sends.

The layer split is memfit.estimate.pipeline.stage_layers, the formulas' own, so the run and the estimate hold the
same layers on each stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..estimate.pipeline import stage_layers


class LlamaStage(nn.Module):
    """Layers [first_layer, first_layer + num_layers) of a transformers Llama-style model; the embedding on the first
    stage, the final norm and LM head on the last. Input: token ids (first stage) or hidden states; output: hidden
    states, or on the last stage the logits (the schedule's loss_fn makes the loss)."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))


def stage_module(model: nn.Module, stage: int, num_stages: int) -> LlamaStage:
    """Stage `stage` (0-based) of `num_stages`, one stage per rank; the model's other parts are dropped (freed)."""
    counts = stage_layers(len(model.model.layers), num_stages)
    start = sum(counts[:stage])
    return LlamaStage(model, range(start, start + counts[stage]), first=stage == 0, last=stage == num_stages - 1)


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """HF ForCausalLMLoss's labels: the ids shifted by one, the last position ignored."""
    return F.pad(input_ids, (0, 1), value=-100)[:, 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def schedule(module: nn.Module, stage: int, num_stages: int, name: str, num_micro_batches: int):
    """torch.distributed.pipelining's PipelineStage over `module` and the schedule `name` ('gpipe' or '1f1b', the
    single-stage-per-rank schedules; torchtitan's pipeline_parallel_schedule), with the causal-LM loss."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    pipe_stage = PipelineStage(module, stage, num_stages, torch.device("cpu"))
    return kind(pipe_stage, n_microbatches=num_micro_batches, loss_fn=causal_lm_loss)


class P2PCounter:
    """Bytes this rank sends point to point: every isend the pipelining schedules issue goes through
    schedules._batch_p2p (torch 2.13), which this wraps while active."""

    def __init__(self) -> None:
        self.sent_bytes = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator["P2PCounter"]:
        import torch.distributed as dist
        from torch.distributed.pipelining import schedules

        original = schedules._batch_p2p

        def counted(ops, desc=None):
            self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return original(ops, desc)

        schedules._batch_p2p = counted
        try:
            yield self
        finally:
            schedules._batch_p2p = original
