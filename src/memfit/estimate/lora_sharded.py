"""LoRA and QLoRA under FSDP2 (engine torch, zero2 / zero3): what each rank keeps of a frozen base and its adapters.

`fully_shard` treats a frozen parameter like any other (torch 2.13 torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py): it is stored as a dim-0 shard, all-gathered with its block for forward (and again for
backward under reshard_after_forward), and it never reaches the reduce-scatter, which carries only the gradients
of trainable tensors (foreach_reduce over the FSDPParams whose unsharded gradient exists). FSDP2 asks only the
trainable tensors of a group for one dtype (`_init_mp_dtypes`: "uniform original parameter dtype" over the
requires_grad ones); a group mixing a bf16 frozen base with fp32 adapters all-gathers through a uint8 buffer
(_fsdp_collectives._get_all_gather_input_metadatas) or, under MixedPrecisionPolicy(param_dtype=bf16), in bf16. So
per rank:

- the adapters' fp32 shards, their fp32 gradient shards and optimizer states (the master-weights layout of
  memfit.estimate.static, sized on the trainable tensors alone);
- the frozen base's shards in its storage dtype: accelerate 1.15 (utils/fsdp_utils.py fsdp2_prepare_model)
  upcasts only the trainable parameters to fp32 under mixed precision, and so does memfit's engine;
- FSDP-QLoRA (Answer.AI's recipe, HF "FSDP-QLoRA" docs: `bnb_4bit_quant_storage=torch.bfloat16`): the packed
  4-bit weight is a bf16-typed Params4bit of numel / 4 elements that FSDP2 shards like any flat bf16 parameter;
  its QuantState (absmax, the nested absmax and code, the offset) is an attribute, not a parameter, and stays
  whole on every rank. (With the default uint8 storage accelerate leaves the Params4bit out of FSDP:
  fsdp2_prepare_model `ignored_params`, replicated.) torchtune's torchao NF4Tensor shards and all-gathers all of
  its inner tensors (NF4Tensor.fsdp_pre_all_gather / fsdp_post_all_gather).
- the gathered block (and the root) at the compute dtype: trainable and unquantized frozen tensors cast to the
  MixedPrecisionPolicy's param_dtype, the packed 4-bit bytes as they are.
"""

from __future__ import annotations

from dataclasses import replace

from ..model_spec import ModelSpec, ParamTensor
from ..setup import TrainingSetup
from .fsdp2 import Fsdp2Units

SOURCE = ("torch FSDP2 fully_shard (frozen parameters sharded and all-gathered, reduce-scatter over trainable "
          "gradients only); accelerate fsdp2_prepare_model; bitsandbytes Params4bit(quant_storage=bf16)")


def _per_layer(t: ParamTensor) -> bool:
    return ".*." in t.name


def _packed_bytes(spec: ModelSpec, setup: TrainingSetup, t: ParamTensor) -> int | None:
    """The packed-weight bytes of one 4-bit base tensor (None when `t` is not one): bitsandbytes quantize_4bit
    stores ceil(numel / 2) bytes; the rest of `t.nbytes` is its QuantState."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    if not base.four_bit or not t.nbytes or t.nbytes >= 2 * t.numel:
        return None
    if setup.finetune.torchtune:  # torchao NF4Tensor (nf4_split, fsdp_pre_all_gather): its codes, scalers and
        # factors sharded on dim 0 and gathered; the 16-entry table and the scalers' mean stay whole on each rank
        return t.nbytes - _nf4_whole_bytes(setup)
    return -(-t.numel // 2)


def _nf4_whole_bytes(setup: TrainingSetup) -> int:
    from .lora import _DTYPE_BYTES, BNB_4BIT_CODE

    return (BNB_4BIT_CODE + 1) * _DTYPE_BYTES[setup.precision.compute_dtype]


def frozen_shard_bytes(spec: ModelSpec, setup: TrainingSetup, n: int) -> int:
    """Per-rank bytes of the frozen base at rest: each tensor's dim-0 shard (ceil(numel / n), FSDP2 pads dim 0 to a
    multiple of the ranks), and every 4-bit weight's QuantState whole."""
    total = 0
    for t in spec.frozen:
        packed = _packed_bytes(spec, setup, t)
        if packed is not None and setup.finetune.torchtune:
            _check_nf4_split(t, n)
        if packed is None:
            total += t.count * -(-t.nbytes // n)
        else:
            total += t.count * (-(-packed // n) + t.nbytes - packed)
    return total


def frozen_kept_on_device_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Per-rank bytes of the frozen base left on the device under FSDP2's CPUOffloadPolicy: FSDP2 moves each
    FSDPParam's shard to the host (_fsdp_param.py: `padded_sharded_param.cpu()`, pinned with pin_memory=True) and
    copies it back per all-gather (`all_gather_inputs`: `.to(self.device, non_blocking=True)`); a bitsandbytes
    QuantState is an attribute of the Params4bit, not a parameter, so FSDP never moves it, and Linear4bit.forward
    dequantizes the gathered weight with it on the compute device: it stays whole there. torchao's NF4Tensor is the
    parameter itself (its inner tensors are moved with it): nothing stays."""
    if setup.finetune.torchtune:
        return 0
    total = 0
    for t in spec.frozen:
        packed = _packed_bytes(spec, setup, t)
        if packed is not None:
            total += t.count * (t.nbytes - packed)
    return total


def _check_nf4_split(t: ParamTensor, n: int) -> None:
    """torchao's NF4Tensor splits each inner tensor into n equal chunks (nf4_tensor.py nf4_split): its one
    quantization factor per 16,384 weights must divide by the ranks."""
    from ..errors import ConfigError
    from .lora import TORCHAO_NF4_BLOCK, TORCHAO_NF4_SCALER_BLOCK

    factors = t.numel // (TORCHAO_NF4_BLOCK * TORCHAO_NF4_SCALER_BLOCK)
    if factors % n:
        raise ConfigError(f"FSDP2 cannot shard torchao's NF4 {t.name} over {n} ranks: its {factors} quantization "
                          f"factors (one per 16,384 weights) do not divide by {n} (torchao nf4_split); use fewer "
                          "ranks, or --lora-recipe peft")


def _gathered_bytes(spec: ModelSpec, setup: TrainingSetup, tensors, compute_bytes: int) -> int:
    """Unsharded bytes of `tensors` (one block's or the root's, each counted once) as FSDP2's all-gather makes
    them: trainable and unquantized frozen tensors at the compute dtype (fp32 ones stay fp32 without a
    MixedPrecisionPolicy), a packed 4-bit weight as its bytes (no QuantState: that is never gathered)."""
    total = 0
    for t in tensors:
        packed = _packed_bytes(spec, setup, t)
        if packed is not None:
            total += packed
        elif t.nbytes and compute_bytes == 4:
            total += t.nbytes  # no MixedPrecisionPolicy: gathered in the stored dtype
        else:
            total += t.numel * compute_bytes
    return total


def units(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int, reduce_bytes: int) -> Fsdp2Units:
    """FSDP2's units for an adapted model: gradients (and reduce-scatters) of the trainable tensors only, the
    gathered block and root of every tensor; no LM-head gradient unless the head is trained."""
    per_layer = sum(p.numel for p in spec.params if _per_layer(p))
    block = [t for t in (*spec.params, *spec.frozen) if _per_layer(t)]
    root = [t for t in (*spec.params, *spec.frozen) if not _per_layer(t)]
    head_trained = any(p.name.endswith(("lm_head.weight", "lm_head.modules_to_save.weight")) for p in spec.params)
    return Fsdp2Units(block_params=per_layer, root_params=spec.num_params - per_layer * spec.num_layers,
                      head_params=spec.vocab_size * spec.hidden_size if head_trained else 0,
                      num_blocks=spec.num_layers, compute_bytes=compute_bytes, reduce_bytes=reduce_bytes,
                      reshard_after_forward=setup.sharding.stage >= 3, tied=spec.tie_word_embeddings,
                      gathered_block_bytes=_gathered_bytes(spec, setup, block, compute_bytes),
                      gathered_root_bytes=_gathered_bytes(spec, setup, root, compute_bytes))


def fsdp2_layout(spec: ModelSpec, setup: TrainingSetup, static, compute_bytes: int, reduce_bytes: int):
    """`static` (memfit.estimate.static's FSDP2 layout of the trainable tensors) with the frozen base sharded and
    the gathered working set counting every tensor of the root and of one block (ZeRO-3) or of every block
    (ZeRO-2: reshard_after_forward=False keeps them gathered from forward to backward)."""
    n = setup.dp_size
    fsdp = units(spec, setup, compute_bytes, reduce_bytes)
    blocks = 1 if setup.sharding.stage >= 3 else spec.num_layers
    return replace(static, frozen_bytes=frozen_shard_bytes(spec, setup, n), fsdp=fsdp,
                   param_working_set_bytes=fsdp.gathered_bytes(blocks))
