"""Where the seed's rules of thumb differ from what the engines do, said next to the numbers they affect."""

from __future__ import annotations

from ..model_spec import ModelSpec
from ..setup import Attention, Checkpointing, Optimizer, Precision, TrainingSetup
from .activations import attention_softcapped

AMP_KEEPS_FP32 = ("mixed precision (torch.autocast) does not halve parameter memory: weights, gradients and Adam "
                  "states stay fp32, and bf16 copies of every Linear weight are cached for backward (+2 B/param). "
                  "It shrinks activations. Only pure bf16 halves parameters and gradients.")
MASTER_16B = ("bf16 with fp32 master weights costs 2 + 2 + 12 = 16 B/param, the same as fp32 Adam "
              "(ZeRO paper sec. 3.1): no static saving without sharding.")
EIGHT_BIT = ("8-bit AdamW keeps ~2.03 B/param of state (uint8 x 2 + fp32 absmax per 256), a quarter of fp32 "
             "Adam's 8 B/param, not a half; tensors under 4096 elements keep fp32 state.")
PAGED = ("paged optimizer (bitsandbytes Paged*): the states of tensors >= 1e5 elements live in CUDA unified memory "
         "(cudaMallocManaged), outside torch's allocator: not in max_memory_allocated / reserved, but on the device "
         "(nvidia-smi) while resident; under memory pressure the driver evicts them to host RAM instead of an OOM, "
         "and each step pages them back (slower). On a CPU device bitsandbytes falls back to ordinary tensors.")
TORCHAO = ("torchao low-bit AdamW: block-wise quantised moments (8-bit and fp8: 256-element blocks, 4-bit: 128), each "
           "with an fp32 scale per block; tensors under 4096 elements or not a multiple of the block keep full "
           "states. Its step is torch.compile'd (a first-step compile).")
FOREACH = ("foreach AdamW (torch's CUDA default) allocates one parameter-sized temporary in the step "
           "(_foreach_sqrt); fused=True or foreach=False avoid it.")
CKPT = ("full checkpointing keeps each block's input (B x T x h) instead of its saved tensors; the saving is the "
        "per-block ratio, not exactly L, and one block is rebuilt at a time during backward.")
LOGITS = ("HF upcasts logits to fp32 for the loss; with a large vocabulary log-softmax and its two gradients "
          "(3 x B x T x V x 4 B at the start of backward) can dominate activations, and checkpointing does not "
          "touch them.")


LORA_ACTIVATIONS = ("LoRA freezes weights, not activations: a frozen layer still keeps everything its input gradient "
                    "needs; only what a weight gradient alone needs goes, and each adapted projection keeps its own "
                    "copy of its input (peft casts it to the fp32 adapters' dtype, autocast back to bf16), its rank-r "
                    "intermediate and, with LoRA dropout, a mask.")
LORA_ACTIVATIONS_16 = ("LoRA freezes weights, not activations: a frozen layer still keeps everything its input "
                       "gradient needs; only what a weight gradient alone needs goes; each adapter keeps its rank-r "
                       "intermediate and, with LoRA dropout, its own input and a mask (16-bit adapters read the "
                       "very input their base Linear reads).")
QLORA_TORCHAO = ("QLoRA is not 4 bits per weight: the embeddings, LM head and norms stay in bf16, each 64-weight "
                 "block adds an int8 scaler (0.125 bits/weight), and eager torchao dequantizes a whole weight "
                 "through int64 codes (~14 B per element of the largest weight, alive at once, in forward and again "
                 "in backward; a compiled layer fuses it into the bf16 weight alone).")
QLORA_BITS = ("QLoRA is not 4 bits per weight: the embeddings, LM head and norms stay unquantized and "
              "prepare_model_for_kbit_training upcasts them to fp32; each 64-weight block adds its constants "
              "(~0.13 bits/weight with double quantization); and the fp32 norms make the residual stream fp32, so "
              "checkpoints and MLP activations are twice LoRA's on a bf16 base.")

QLORA_BITS_16 = ("QLoRA is not 4 bits per weight: the embeddings, LM head and norms stay unquantized (in the compute "
                 "dtype: no prepare_model_for_kbit_training) and each 64-weight block adds its constants (~0.13 "
                 "bits/weight with double quantization).")


def rule_of_thumb_notes(spec: ModelSpec, setup: TrainingSetup) -> list[str]:
    notes = []
    ft = setup.finetune
    if ft.adapters:
        from .lora import adapter_bytes

        sixteen = adapter_bytes(setup) == 2
        notes.append(LORA_ACTIVATIONS_16 if sixteen else LORA_ACTIVATIONS)
        if ft.base_storage(setup.precision.compute_dtype).four_bit:
            notes.append(QLORA_TORCHAO if ft.torchtune else QLORA_BITS if ft.upcasts_unquantized() else
                         QLORA_BITS_16)
    elif setup.precision.is_autocast:
        notes.append(AMP_KEEPS_FP32)
    if setup.precision is Precision.BF16_MASTER:
        notes.append(MASTER_16B)
    if setup.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT):
        notes.append(EIGHT_BIT)
    if setup.optimizer.is_paged:
        notes.append(PAGED)
    if setup.optimizer.library == "torchao":
        notes.append(TORCHAO)
    if setup.optimizer is Optimizer.ADAMW_FOREACH:
        notes.append(FOREACH)
    if setup.checkpointing is Checkpointing.FULL:
        notes.append(CKPT)
    elif setup.checkpointing is Checkpointing.ATTENTION and setup.attention is not Attention.EAGER:
        notes.append("checkpointing attention recomputes the eager attention core only (Megatron selective "
                     "recompute, the 5·a·s/h term of Korthikanti et al. 2022); SDPA / flash kernels keep no T x T, "
                     "so under sdpa it saves nothing and is sized as none.")
    elif setup.checkpointing is Checkpointing.SELECTIVE_OP:
        notes.append("selective-op keeps each block's input, its 1st, 3rd, ... matmul outputs and the SDPA output "
                     "(torchtitan's op-level SAC policy); the rest of the block is recomputed in backward.")
    if spec.vocab_size >= 8 * spec.hidden_size:
        notes.append(LOGITS)
    if setup.attention is Attention.SDPA and attention_softcapped(spec):
        notes.append("transformers runs Gemma 2 with eager or flash_attention_2 (logit soft-capping), not torch "
                     "SDPA: 'sdpa' is sized as FlashAttention-2, which keeps no T x T matrix.")
    if setup.precision is Precision.BF16_MASTER and setup.sharding.stage >= 1:
        notes.append("sharded bf16-master is sized as DeepSpeed lays it out (bf16 parameter partition + fp32 "
                     "master + states); FSDP2's MixedPrecisionPolicy keeps only the fp32 shard (2 B/param less "
                     "until gradients exist).")
    if setup.attention is Attention.EAGER:
        notes.append("eager attention keeps the fp32 B x H x T x T softmax of every layer for backward; "
                     "SDPA/FlashAttention keeps O(T) statistics instead.")
    return notes
