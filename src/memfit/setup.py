"""TrainingSetup: what one training step does, as a frozen value. Techniques transform it; they never edit numbers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from .choice import Choice as _Choice
from .errors import ConfigError
from .finetune import Finetune


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


class Optimizer(_Choice):
    ADAMW = "adamw"  # torch.optim.AdamW(foreach=False): one parameter at a time
    ADAMW_FOREACH = "adamw-foreach"  # torch default on CUDA: multi-tensor, parameter-sized temporaries
    ADAMW_FUSED = "adamw-fused"  # fused=True: one kernel, no parameter-sized temporaries
    ADAMW_8BIT = "adamw-8bit"  # bitsandbytes AdamW8bit: block-wise uint8 states
    SGD = "sgd"  # SGD with momentum: one state
    ADAFACTOR = "adafactor"  # factored second moment, no first moment (HF/transformers defaults)

    def aliases(self) -> tuple[str, ...]:
        return {
            "adamw": ("adam", "adamw-torch", "adamw-single"),
            "adamw-8bit": ("adam8bit", "adamw8bit", "8bit", "bnb", "adamw-bnb-8bit", "paged-adamw-8bit"),
            "sgd": ("sgd-momentum",),
        }.get(self.value, ())

    @property
    def is_adam(self) -> bool:
        return self.value.startswith("adamw")


class Checkpointing(_Choice):
    NONE = "none"
    FULL = "full"  # recompute every transformer block in backward (HF gradient_checkpointing)

    def aliases(self) -> tuple[str, ...]:
        return {"none": ("off", "no", "false"), "full": ("on", "yes", "true")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "gradient checkpointing mode"


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

    def aliases(self) -> tuple[str, ...]:
        return {"standard": ("hf", "default", "full", "none"),
                "chunked": ("chunk", "chunked-output", "ce-chunked", "torchtune"),
                "fused": ("liger", "fused-linear", "flce", "fused-linear-cross-entropy", "cce",
                          "cut-cross-entropy")}[self.value]

    @classmethod
    def label(cls) -> str:
        return "loss"


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


_ZERO1_TORCH_OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "sgd")


@dataclass(frozen=True)
class TrainingSetup:
    """One training step on one data-parallel rank. Validated at construction; every problem reported at once."""

    micro_batch_size: int = 8
    """Sequences per GPU per forward/backward (HF: per_device_train_batch_size)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; gradients stay allocated between them."""
    precision: Precision = Precision.AMP_BF16
    optimizer: Optimizer = Optimizer.ADAMW_FOREACH
    checkpointing: Checkpointing = Checkpointing.NONE
    attention: Attention = Attention.SDPA
    sharding: Sharding = Sharding.NONE
    offload: Offload = Offload.NONE
    num_gpus: int = 1
    """Data-parallel ranks that sharding spreads over (GPUs per node x nodes)."""
    engine: Engine = Engine.DEEPSPEED
    """The engine that runs data parallelism, sharding and offload when num_gpus > 1 or offload is on."""
    finetune: Finetune = Finetune()
    """What is trained: every weight, or LoRA / QLoRA adapters on a frozen base (memfit.finetune)."""
    loss: Loss = Loss.STANDARD
    """How the logits become the loss: all at once (transformers), per chunk (torchtune) or fused (Liger)."""
    optimizer_in_backward: bool = False
    """Step each parameter as soon as its gradient is accumulated, then free it (torchtune optimizer_in_bwd)."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Why the setup looks as it does (defaults assumed, values clamped); shown to the user."""

    def __post_init__(self) -> None:
        for name, kind in (("precision", Precision), ("optimizer", Optimizer), ("checkpointing", Checkpointing),
                           ("attention", Attention), ("sharding", Sharding), ("offload", Offload),
                           ("engine", Engine), ("loss", Loss)):
            object.__setattr__(self, name, kind.parse(getattr(self, name)))
        if isinstance(self.finetune, str):
            object.__setattr__(self, "finetune", Finetune(method=self.finetune))
        elif isinstance(self.finetune, dict):
            object.__setattr__(self, "finetune", Finetune(**self.finetune))
        problems = [f"{name} must be a positive whole number, got {getattr(self, name)!r}"
                    for name in ("micro_batch_size", "seq_len", "grad_accum_steps", "num_gpus")
                    if not _positive_int(getattr(self, name))]
        if not isinstance(self.optimizer_in_backward, bool):
            problems.append(f"optimizer_in_backward must be true or false, got {self.optimizer_in_backward!r}")
        if not problems:
            problems += self._combination_problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def _combination_problems(self) -> list[str]:
        problems = []
        if self.sharding is not Sharding.NONE and self.num_gpus < 2:
            problems += self._one_gpu_sharding_problems()
        if self.offload is Offload.OPTIMIZER_AND_PARAMS and self.sharding is not Sharding.ZERO3:
            problems.append("offloading parameters needs zero3 sharding (DeepSpeed offload_param / FSDP CPUOffload)")
        if self.offload is not Offload.NONE and self.optimizer is Optimizer.ADAMW_8BIT:
            problems.append("CPU offload runs DeepSpeed's CPU Adam; it does not combine with bitsandbytes 8-bit AdamW")
        if self.engine is Engine.TORCH:
            problems += self._torch_engine_problems()
        if self.finetune.adapters:
            problems += self._adapter_problems()
        if self.optimizer_in_backward:
            problems += self._in_backward_problems()
        return problems

    def _in_backward_problems(self) -> list[str]:
        """Where stepping each parameter inside backward (torchtune optimizer_in_bwd) cannot run, or is not sized."""
        problems = []
        if self.grad_accum_steps > 1:
            problems.append("optimizer in backward steps each parameter as its gradient arrives, so nothing can "
                            "accumulate over micro-steps (torchtune refuses it too): use accum 1")
        if self.num_gpus > 1 or self.sharding is not Sharding.NONE or self.offload is not Offload.NONE:
            problems.append("optimizer in backward is sized on one GPU without sharding or offload (torchtune's "
                            "single-device recipe); DeepSpeed owns its own step")
        if self.precision is Precision.AMP_FP16:
            problems.append("optimizer in backward cannot run amp-fp16: the GradScaler must see every gradient "
                            "before any step; use amp-bf16")
        if self.precision.master_weights:
            problems.append("optimizer in backward with an fp32 master copy (bf16-master) is not sized yet: use "
                            "amp-bf16 or bf16")
        if self.finetune.adapters:
            problems.append(f"optimizer in backward with {self.finetune.method} is not sized yet (the adapters' "
                            "gradients are small anyway)")
        return problems

    def _adapter_problems(self) -> list[str]:
        """What memfit does not size for LoRA / QLoRA (yet), said rather than guessed."""
        problems = []
        if self.sharding is Sharding.ZERO3:
            problems.append(f"{self.finetune.method} under zero3 / FSDP full sharding (frozen base shards, "
                            "adapters gathered) is not sized yet: use zero2 or DDP, whose frozen base is "
                            "replicated")
        if self.offload is not Offload.NONE:
            problems.append(f"{self.finetune.method} trains only the adapters: CPU offload of their optimizer "
                            "is not sized yet")
        if self.loss is not Loss.STANDARD:
            problems.append(f"a {self.loss} loss with {self.finetune.method} is not sized yet: use loss standard")
        if self.finetune.base_storage(self.precision.compute_dtype).quantized and self.precision.master_weights:
            problems.append("a quantized base has no master weights: use amp-bf16 (HF Trainer bf16=True) for QLoRA")
        return problems

    def _one_gpu_sharding_problems(self) -> list[str]:
        """ZeRO on one GPU: with nothing to shard over, a stage saves memory only by moving its partitions to the
        host, which DeepSpeed's ZeRO-Offload / ZeRO-Infinity do on one rank (offload_optimizer, offload_param)."""
        if self.offload is Offload.NONE:
            return [f"{self.sharding} shards over GPUs and needs at least 2 (got num_gpus={self.num_gpus}): on one "
                    "GPU it saves nothing unless it offloads to the CPU (--offload optimizer, or optimizer+params "
                    "with zero3)"]
        if self.engine is not Engine.DEEPSPEED:
            return [f"{self.sharding} with CPU offload on one GPU runs on DeepSpeed (ZeRO-Offload): use engine "
                    "deepspeed, or 2+ GPUs for torch's FSDP2"]
        return []

    def _torch_engine_problems(self) -> list[str]:
        """What torch's own engines cannot express (checked against torch 2.13 FSDP2 / ZeroRedundancyOptimizer)."""
        problems = []
        if self.offload is Offload.OPTIMIZER:
            problems.append("FSDP2 offloads parameters with the optimizer step, never the optimizer alone: use "
                            "offload optimizer+params with zero3, or engine deepspeed (ZeRO-Offload)")
        if self.sharding.stage >= 2 and self.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.ADAFACTOR):
            problems.append(f"{self.optimizer} cannot step FSDP2's sharded (DTensor) parameters: use engine deepspeed")
        if self.sharding is Sharding.ZERO1 and (self.optimizer.value not in _ZERO1_TORCH_OPTIMIZERS
                                                 or self.precision.master_weights):
            problems.append("torch's ZeRO-1 (ZeroRedundancyOptimizer) covers AdamW and SGD without an fp32 master "
                            "copy: use engine deepspeed")
        return problems

    def replace(self, **changes) -> "TrainingSetup":
        """A copy with `changes`. Where they cannot combine with the optimizer step in backward or a non-standard
        loss that they do not name (accumulation, ZeRO, LoRA...), those are turned back as well, so the change a
        technique asks for still happens; setup_changes then names the turned-back fields too."""
        try:
            return dataclasses.replace(self, **changes)
        except ConfigError:
            fallbacks = [name for name, off in (("optimizer_in_backward", False), ("loss", Loss.STANDARD))
                         if name not in changes and getattr(self, name) != off]
            if not fallbacks:
                raise
        undone: dict = {}
        for name in fallbacks:
            undone[name] = False if name == "optimizer_in_backward" else Loss.STANDARD
            try:
                return dataclasses.replace(self, **changes, **undone)
            except ConfigError:
                continue
        return dataclasses.replace(self, **changes)

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def effective_batch_size(self) -> int:
        """Sequences per optimizer step across all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.num_gpus

    def to_dict(self) -> dict:
        return {f.name: (getattr(self, f.name).value if isinstance(getattr(self, f.name), Enum)
                         else list(getattr(self, f.name)) if f.name == "notes"
                         else getattr(self, f.name).to_dict() if f.name == "finetune" else getattr(self, f.name))
                for f in dataclasses.fields(self)}


FIELD_LABELS: dict[str, str] = {
    "micro_batch_size": "micro-batch", "seq_len": "seq", "grad_accum_steps": "accum", "precision": "precision",
    "optimizer": "optimizer", "checkpointing": "checkpointing", "attention": "attention", "sharding": "sharding",
    "offload": "offload", "num_gpus": "gpus", "engine": "engine", "finetune": "method", "loss": "loss",
    "optimizer_in_backward": "optimizer in backward"}
"""How each TrainingSetup field (notes aside) is named in what memfit prints."""


@dataclass(frozen=True)
class FieldChange:
    """One field that differs between two setups."""

    field: str
    old: object
    new: object

    @property
    def label(self) -> str:
        return FIELD_LABELS[self.field]

    @property
    def text(self) -> str:
        return f"{self.label} {self.old} -> {self.new}"


def setup_changes(before: TrainingSetup, after: TrainingSetup) -> tuple[FieldChange, ...]:
    """Every field (notes aside) that `after` changes, in TrainingSetup's order: the one diff that plan steps,
    pins and the GPU-count suggestion all state, so no change goes unsaid."""
    return tuple(FieldChange(name, getattr(before, name), getattr(after, name)) for name in FIELD_LABELS
                 if getattr(before, name) != getattr(after, name))


KEEP_NAMES: dict[str, tuple[str, ...]] = {
    "precision": ("precision",), "optimizer": ("optimizer",), "engine": ("engine",), "sharding": ("sharding",),
    "zero": ("sharding",), "checkpointing": ("checkpointing",), "attention": ("attention",),
    "micro_batch": ("micro_batch_size",), "batch": ("micro_batch_size",), "accum": ("grad_accum_steps",),
    "seq": ("seq_len",), "offload": ("offload",), "gpus": ("num_gpus",), "method": ("finetune",),
    "finetune": ("finetune",), "lora": ("finetune",), "loss": ("loss",),
    "optimizer_in_backward": ("optimizer_in_backward",), "in_backward": ("optimizer_in_backward",)}
"""What `--keep` accepts, and the TrainingSetup fields each name pins."""


def parse_keep(text: "str | None | frozenset[str] | set[str] | tuple[str, ...]") -> frozenset[str]:
    """'precision,optimizer' -> the TrainingSetup fields they pin. Unknown names: one ConfigError listing the valid."""
    if text is None:
        return frozenset()
    names = text.split(",") if isinstance(text, str) else list(text)
    fields: set[str] = set()
    for raw in names:
        name = raw.strip().lower().replace("-", "_")
        if not name:
            continue
        if name in FIELD_LABELS:
            fields.add(name)
        elif name in KEEP_NAMES:
            fields.update(KEEP_NAMES[name])
        else:
            raise ConfigError(f"cannot keep '{raw.strip()}': choose from {', '.join(KEEP_NAMES)}")
    return frozenset(fields)


def needs_bf16(precision: Precision) -> bool:
    """Whether the precision computes or stores in bf16 (a GPU without bf16 cannot run it)."""
    return precision in (Precision.AMP_BF16, Precision.BF16, Precision.BF16_MASTER)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def fsdp2_mixed_precision(setup: TrainingSetup, engine: Engine | None = None) -> bool:
    """Whether FSDP2 runs the setup's precision as MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32):
    fp32 shards (the master copy), low-precision compute with no autocast, fp32 gradient reduction. That is what
    memfit's torch engine (`memfit._torch.engine.shard`) and its emitted FSDP2 code do for amp-* and bf16-master at
    ZeRO-2/3, so an amp setup there is sized like bf16-master (same bytes: fp16 and bf16 are both 2 B). `engine`
    overrides the setup's (a trace always runs FSDP2)."""
    return ((engine or setup.engine) is Engine.TORCH and setup.sharding.stage >= 2
            and (setup.precision.is_autocast or setup.precision.master_weights))
