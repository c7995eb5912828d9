"""Tensor (and sequence) parallelism on a transformers Llama with torch DTensor, laid out as torchtitan's
parallelize_llama lays out its own Llama: q/k/v and gate/up projections ColwiseParallel, o and down projections
RowwiseParallel, the token embedding RowwiseParallel (split by vocabulary), the LM head ColwiseParallel with
vocabulary-sharded logits for loss_parallel; with sequence parallelism the norms run SequenceParallel on
sequence-sharded activations and each attention / MLP gathers its input (PrepareModuleInput).

`forward_loss` drives the HF modules itself (embedding, layers, final norm, head) rather than calling the HF model:
the HF model builds positions and the causal mask from the embedding output's length, which sequence parallelism
splits. The attention mask is left to SDPA's `is_causal`, so no B x T x T mask exists."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def parallelize_llama(model: torch.nn.Module, tp_mesh, *, sequence_parallel: bool = False) -> torch.nn.Module:
    """Shard a transformers LlamaForCausalLM (or a same-shaped Mistral / Qwen2) over `tp_mesh` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)
    return model


def forward_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss of a parallelized model, computed on the vocabulary-sharded logits (call it, and backward,
    inside torch.distributed.tensor.parallel.loss_parallel()). Labels are the ids shifted by one, as HF's
    ForCausalLMLoss does (the last position ignored)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    rotary = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    logits = model.lm_head(inner.norm(hidden))
    labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def local_numel(model: torch.nn.Module) -> dict[str, int]:
    """Elements of each parameter this rank holds (a DTensor's local shard)."""
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out[name] = local.numel()
    return out
