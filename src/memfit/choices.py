"""The choices a training setup is made of (precision, optimizer, checkpointing, attention, loss, padding, sharding,
offload, engine, pipeline schedule, CP rotation, float8, torchao CPU offload): each a `Choice` enum with its aliases
and what it implies. memfit.setup composes them into a TrainingSetup and re-exports them."""

from __future__ import annotations

import re

from .choice import Choice as _Choice
from .errors import ConfigError
from .units import DTYPE_BYTES


class Precision(_Choice):
    """How parameters, gradients and activations are stored."""

    FP32 = "fp32"  # everything fp32
    AMP_BF16 = "amp-bf16"  # torch.autocast(bf16): fp32 weights/grads/states; bf16 weight copies cached for backward
    AMP_FP16 = "amp-fp16"  # same, fp16 + GradScaler
    BF16 = "bf16"  # pure bf16: params, grads and optimizer states all bf16
    BF16_MASTER = "bf16-master"  # bf16 params+grads, fp32 master copy + states (DeepSpeed bf16, Megatron)

    def aliases(self) -> tuple[str, ...]:
        return {
            "amp-bf16": ("amp", "bf16-amp", "bf16-mixed", "mixed"),
            "amp-fp16": ("fp16-amp", "fp16", "fp16-mixed", "16-mixed"),
            "bf16": ("pure-bf16", "bf16-true", "bfloat16"),
            "bf16-master": ("bf16-fp32-master", "master"),
            "fp32": ("float32", "32"),
        }.get(self.value, ())

    @property
    def is_autocast(self) -> bool:
        return self in (Precision.AMP_BF16, Precision.AMP_FP16)

    @property
    def param_dtype(self) -> str:
        return "bf16" if self in (Precision.BF16, Precision.BF16_MASTER) else "fp32"

    @property
    def compute_dtype(self) -> str:
        return {Precision.FP32: "fp32", Precision.AMP_FP16: "fp16"}.get(self, "bf16")

    @property
    def master_weights(self) -> bool:
        """An fp32 copy of the weights lives in the optimizer (4 B/param)."""
        return self is Precision.BF16_MASTER

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters and their gradients (units.DTYPE_BYTES of param_dtype)."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of what the step computes in (units.DTYPE_BYTES of compute_dtype)."""
        return DTYPE_BYTES[self.compute_dtype]


class Optimizer(_Choice):
    ADAMW = "adamw"  # torch.optim.AdamW(foreach=False): one parameter at a time
    ADAMW_FOREACH = "adamw-foreach"  # torch default on CUDA: multi-tensor, parameter-sized temporaries
    ADAMW_FUSED = "adamw-fused"  # fused=True: one kernel, no parameter-sized temporaries
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes AdamW8bit: block-wise uint8 states
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"  # bitsandbytes PagedAdamW8bit: the uint8 states in CUDA unified memory
    PAGED_ADAMW = "paged-adamw"  # bitsandbytes PagedAdamW (32-bit): fp32 states in CUDA unified memory
    ADAMW_AO_8BIT = "adamw-ao-8bit"  # torchao AdamW8bit: block-wise uint8 states (256-element blocks)
    ADAMW_4BIT = "adamw-4bit"  # torchao AdamW4bit: block-wise 4-bit states (128-element blocks)
    ADAMW_FP8 = "adamw-fp8"  # torchao AdamWFp8: float8_e4m3 states (256-element blocks)
    LION_8BIT = "lion-8bit"  # bitsandbytes Lion8bit: one block-wise uint8 state (momentum)
    LION = "lion"  # bitsandbytes Lion (32-bit): one fp32 state
    SGD = "sgd"  # SGD with momentum: one state
    ADAFACTOR = "adafactor"  # factored second moment, no first moment (HF/transformers defaults)
    MUON = "muon"  # torch.optim.Muon on the blocks' 2-D weights, AdamW (foreach) on the rest (memfit.estimate.muon)

    def aliases(self) -> tuple[str, ...]:
        return self.kind.aliases

    @property
    def kind(self):
        """Its record in memfit.optimizers: class, arguments, states, how engines and configs spell it."""
        from .optimizers import kind_of

        return kind_of(self)

    @property
    def is_adam(self) -> bool:
        """Adam-family (two moments per parameter), whoever implements it."""
        return "adamw" in self.value

    @property
    def library(self) -> str:
        """Who implements it: 'torch', 'bitsandbytes', 'torchao' or 'transformers'."""
        return self.kind.library

    @property
    def torch_adam(self) -> bool:
        """torch.optim.AdamW in one of its three kernels (what DeepSpeed and FSDP2 build themselves)."""
        return self.kind.torch_adam

    @property
    def is_paged(self) -> bool:
        """bitsandbytes paged: large states in CUDA unified memory (cudaMallocManaged), outside torch's allocator."""
        return self.kind.paged

    @property
    def state_bits(self) -> int:
        """Bits per element of the large states (32: full precision, in the parameter's or fp32 dtype)."""
        return self.kind.state_bits


class Checkpointing(_Choice):
    """Which activations a step recomputes in backward instead of keeping (memfit._torch.blocks runs each)."""

    NONE = "none"
    FULL = "full"  # recompute every transformer block in backward (HF gradient_checkpointing)
    SELECTIVE_OP = "selective-op"  # torchtitan's op-level SAC: keep matmul and SDPA outputs, recompute the rest
    EVERY_2 = "every-2"  # torchtitan's selective_ac_option "2": every 2nd block fully checkpointed (any every-N)
    ATTENTION = "attention"  # Megatron's selective recompute: only the (eager) attention core is recomputed

    def aliases(self) -> tuple[str, ...]:
        return {"none": ("off", "no", "false"), "full": ("on", "yes", "true", "every-1"),
                "selective-op": ("op", "sac", "selective", "selective-ac"),
                "attention": ("core-attention", "attention-core", "megatron-selective")}.get(self.value, ())

    @classmethod
    def label(cls) -> str:
        return "gradient checkpointing mode"

    @classmethod
    def parse(cls, text: "str | Checkpointing") -> "Checkpointing":
        if isinstance(text, cls):
            return text
        key = str(text).strip().lower().replace("_", "-")
        every = re.fullmatch(r"every-?(\d+)", key)
        if every is None:
            try:
                return super().parse(text)
            except ConfigError:
                raise ConfigError(f"unknown {cls.label()} '{text}': choose one of none, full, selective-op, "
                                  "every-N (every-2, every-3, ...), attention") from None
        n = int(every.group(1))
        if n < 1:
            raise ConfigError(f"checkpointing every-{n}: N must be a positive whole number (every-2 checkpoints "
                              "every 2nd block)")
        return cls.FULL if n == 1 else cls(f"every-{n}")

    @classmethod
    def _missing_(cls, value):
        """every-N for any N >= 2 (every-2 is the named member): made once per N, then found like a member."""
        match = re.fullmatch(r"every-(\d+)", str(value))
        if match is None or int(match.group(1)) < 2:
            return None
        member = str.__new__(cls, value)
        member._name_, member._value_ = f"EVERY_{int(match.group(1))}", value
        return cls._value2member_map_.setdefault(value, member)

    @property
    def every(self) -> int | None:
        """N of every-N (the checkpointed blocks are the N-th, 2N-th, ...: torchtitan's layer count), else None."""
        return int(self.value.split("-")[1]) if self.value.startswith("every-") else None

    @property
    def is_on(self) -> bool:
        return self is not Checkpointing.NONE

    def checkpointed(self, index: int) -> bool:
        """Whether block `index` (0-based) runs under torch.utils.checkpoint: every block for full and
        selective-op, the ((index + 1) % N == 0) ones for every-N, none for none and attention (which wraps only
        the attention core inside each block)."""
        if self in (Checkpointing.FULL, Checkpointing.SELECTIVE_OP):
            return True
        n = self.every
        return n is not None and (index + 1) % n == 0

    def checkpointed_blocks(self, num_layers: int) -> int:
        return sum(self.checkpointed(i) for i in range(num_layers))


class Attention(_Choice):
    EAGER = "eager"  # materialises the B x H x T x T scores and softmax per layer
    SDPA = "sdpa"  # flash / memory-efficient kernel: O(T) extra memory

    def aliases(self) -> tuple[str, ...]:
        return {"sdpa": ("flash", "flash-attention", "flash-attention-2", "flash_attention_2", "fa2"),
                "eager": ("math", "naive")}[self.value]


class Loss(_Choice):
    """How the LM head's output becomes the loss: the largest activation of a large-vocabulary model."""

    STANDARD = "standard"  # transformers ForCausalLMLoss: the whole B x T x V logits, upcast to fp32
    CHUNKED = "chunked"  # torchtune CEWithChunkedOutputLoss: head output per sequence chunk, each upcast on its own
    FUSED = "fused"  # Liger fused linear cross-entropy: head + loss + their gradients chunk by chunk in forward
    COMPILED = "compiled"  # torch.compile'd cross-entropy (torchtitan build_cross_entropy_loss): one fused kernel

    def aliases(self) -> tuple[str, ...]:
        return {"compiled": ("compiled-ce", "compile", "torch-compile"),
                "standard": ("hf", "default", "full", "none"),
                "chunked": ("chunk", "chunked-output", "ce-chunked", "torchtune"),
                "fused": ("liger", "fused-linear", "flce", "fused-linear-cross-entropy", "cce",
                          "cut-cross-entropy")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "loss"


class ModelCode(_Choice):
    """Whose module code runs the model: the Hugging Face class of the checkpoint, or LitGPT's own GPT (its fused qkv,
    fp32 RMSNorm, LoRA zero-padding and 128-token head chunks: memfit.estimate.litgpt)."""

    HF = "hf"  # transformers' modeling code (and what peft / torchtune / the rest wrap)
    LITGPT = "litgpt"  # litgpt.model.GPT / litgpt.lora.GPT stepped as litgpt finetune_* steps it

    def aliases(self) -> tuple[str, ...]:
        return {"hf": ("transformers", "huggingface"), "litgpt": ("lit-gpt", "lightning")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "model code"


class Padding(_Choice):
    """How the batches' sequences get their length: what sets the run's peak (TrainingSetup.peak_seq_len)."""

    MAX_LENGTH = "max-length"  # every sequence seq_len tokens: packed (torchtune packed, axolotl sample_packing) or
    # padded to seq_len (HF padding="max_length", axolotl pad_to_sequence_len)
    LONGEST = "longest"  # each batch padded to its longest sample (HF DataCollatorWithPadding, torchtune unpacked)

    def aliases(self) -> tuple[str, ...]:
        return {"max-length": ("packed", "max", "full", "seq"), "longest": ("dynamic", "padded", "batch")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "padding"


LOSS_CHUNKS = 8
"""torchtune CEWithChunkedOutputLoss(num_output_chunks=8): the sequence is cut into 8 chunks."""


class Sharding(_Choice):
    NONE = "none"
    ZERO1 = "zero1"  # optimizer states sharded
    ZERO2 = "zero2"  # + gradients
    ZERO3 = "zero3"  # + parameters (== FSDP full shard)

    def aliases(self) -> tuple[str, ...]:
        return {"none": ("ddp", "zero0", "0"), "zero1": ("1",), "zero2": ("2", "shard-grad-op"),
                "zero3": ("3", "fsdp", "full-shard")}[self.value]

    @property
    def stage(self) -> int:
        return 0 if self is Sharding.NONE else int(self.value[-1])


class Offload(_Choice):
    NONE = "none"
    OPTIMIZER = "optimizer"  # ZeRO-Offload: optimizer states (and master weights) in CPU RAM, step on CPU
    OPTIMIZER_AND_PARAMS = "optimizer+params"  # ZeRO-Infinity style: parameters too (needs ZeRO-3)

    def aliases(self) -> tuple[str, ...]:
        return {"none": ("off", "no"), "optimizer": ("opt", "cpu"), "optimizer+params": ("all", "params")}[self.value]


class Engine(_Choice):
    """Who shards and offloads: their memory layouts differ (memfit.estimate.static says how)."""

    DEEPSPEED = "deepspeed"  # ZeRO 0-3, ZeRO-Offload; what `memfit plan --emit` configures for sharding
    TORCH = "torch"  # DDP, ZeroRedundancyOptimizer (ZeRO-1), FSDP2 fully_shard (ZeRO-2/3)

    def aliases(self) -> tuple[str, ...]:
        return {"deepspeed": ("ds",), "torch": ("fsdp", "fsdp2", "pytorch", "ddp")}[self.value]


class PipelineSchedule(_Choice):
    """torch.distributed.pipelining's schedules, as torchtitan's pipeline_parallel_schedule names them."""

    GPIPE = "gpipe"  # ScheduleGPipe: every micro-batch's forward, then every backward (Huang et al. 2019)
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: pp - stage warm-up forwards, then one backward per forward (PipeDream-Flush)
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B: v stages per rank (Narayanan et al. 2021)

    def aliases(self) -> tuple[str, ...]:
        return {"gpipe": ("schedulegpipe",), "1f1b": ("schedule1f1b", "one-f-one-b", "pipedream-flush"),
                "interleaved-1f1b": ("interleaved1f1b", "interleaved", "scheduleinterleaved1f1b")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "pipeline schedule"

    @property
    def interleaved(self) -> bool:
        return self is PipelineSchedule.INTERLEAVED_1F1B


class CpRotate(_Choice):
    """How ring attention moves K/V between the context-parallel ranks (torch _context_parallel _RotateMethod;
    torchtitan's context_parallel_rotate_method)."""

    ALLGATHER = "allgather"  # one all-gather of every rank's K/V chunk per layer (torch's default)
    ALLTOALL = "alltoall"  # cp - 1 ring steps, each passing one K/V chunk on (permute_tensor)

    def aliases(self) -> tuple[str, ...]:
        return {"allgather": ("all-gather", "all_gather"), "alltoall": ("all-to-all", "all_to_all", "ring")}[
            self.value]

    @classmethod
    def label(cls) -> str:
        return "context-parallel rotate method"


class Float8(_Choice):
    """torchao float8 training (torchao.float8.convert_to_float8_training, torchtitan `--model.converters float8`):
    every Linear but the LM head computes its three matmuls in float8 with dynamic scales (memfit.estimate.float8)."""

    OFF = "off"
    TENSORWISE = "tensorwise"  # Float8LinearRecipeName.TENSORWISE: one fp32 scale per tensor (torchao's default)
    ROWWISE = "rowwise"  # Float8LinearRecipeName.ROWWISE: one fp32 scale per row, power-of-2 scales

    def aliases(self) -> tuple[str, ...]:
        return {"off": ("none", "no", "false"), "tensorwise": ("on", "yes", "true", "float8", "fp8", "dynamic"),
                "rowwise": ("axiswise", "row")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "float8 recipe"

    @property
    def is_on(self) -> bool:
        return self is not Float8.OFF


class FsdpVersion(_Choice):
    """Which torch FSDP shards a torch-engine ZeRO-2 / ZeRO-3 setup: their per-rank memory differs
    (memfit.estimate.fsdp1 for FSDP1's flat parameters)."""

    V2 = "2"  # fully_shard: per-parameter DTensor shards (torchtitan, accelerate fsdp_version 2)
    V1 = "1"  # FullyShardedDataParallel, one flat parameter per transformer block (accelerate fsdp_version 1, HF
    # Trainer `fsdp`); with peft, peft's fsdp_auto_wrap_policy gives each trainable LoRA Linear a unit of its own
    V1_BLOCKS = "1-blocks"  # FSDP1 with the blocks as the only units and use_orig_params=True (Lightning Fabric /
    # LitGPT FSDPStrategy): a block's frozen base and its adapters share one flat parameter

    def aliases(self) -> tuple[str, ...]:
        return {"2": ("fsdp2", "v2"), "1": ("fsdp1", "v1", "accelerate", "hf"),
                "1-blocks": ("lightning", "litgpt", "fabric", "1-orig")}[self.value]

    @property
    def is_fsdp1(self) -> bool:
        return self is not FsdpVersion.V2
