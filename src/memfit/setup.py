"""TrainingSetup: what one training step does, as a frozen value. Techniques transform it; they never edit numbers."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Iterator

from . import fields as _fields
from .choice import Choice as _Choice
# the choices a setup is made of live in memfit.choices; callers find them here too
from .choices import (LOSS_CHUNKS, Attention, Checkpointing, CpRotate, Engine, FsdpVersion,  # noqa: F401
                      Loss, ModelCode, Offload, Optimizer, Padding, PipelineSchedule, Precision, Sharding)
from .errors import ConfigError
from .fields import MAX_ACCUM, MAX_DEGREE, MAX_GPUS_PER_NODE, MAX_MICRO_BATCH, MAX_SEQ_LEN, Option, setting
from .zero_knobs import ZeroKnobs
from .finetune import Finetune
from .setup_checks import (positive_int, combination_problems, deepspeed_casts_module,  # noqa: F401
                           fsdp1_problems, fsdp2_mixed_precision, moe_problems)


_TURNED_BACK = (("optimizer_in_backward", False), ("loss", Loss.STANDARD))
"""What TrainingSetup.replace turns back, in this order, when a change cannot combine with it (then each registered
technique section's `turned_back`)."""


def _turned_back() -> tuple[tuple[str, Any], ...]:
    sections = _fields.TECHNIQUE_SECTIONS.values()
    return _TURNED_BACK + tuple((name, _fields.field_default(cls, name)) for cls in sections for name in cls.turned_back)


@dataclass(frozen=True)
class TrainingSetup:
    """One training step on one data-parallel rank. Validated at construction; every problem reported at once."""

    micro_batch_size: int = setting(8, section="batch", label="micro-batch", keep=("micro_batch", "batch"), option=Option(
        ("--batch", "-b"), "Micro-batch: sequences per GPU per forward/backward. Default: {default}.",
        maximum=MAX_MICRO_BATCH))
    """Sequences per GPU per forward/backward (HF: per_device_train_batch_size)."""
    seq_len: int = setting(2048, section="batch", label="seq", keep=("seq",), option=Option(
        ("--seq", "-s"), "Sequence length in tokens. Default: {default}, or the model's maximum if shorter.",
        maximum=MAX_SEQ_LEN))
    """Tokens per sequence."""
    grad_accum_steps: int = setting(1, section="batch", label="accum", keep=("accum",), option=Option(
        ("--accum",), "Gradient accumulation steps. Default: {default}.", maximum=MAX_ACCUM))
    """Micro-steps per optimizer step; gradients stay allocated between them."""
    precision: Precision = setting(Precision.AMP_BF16, section="precision", label="precision", keep=("precision",),
                                   option=Option(("--precision",), "{choices}. Default: {default}.", "choice"))
    optimizer: Optimizer = setting(Optimizer.ADAMW_FOREACH, section="optimizer", label="optimizer",
                                   keep=("optimizer",),
                                   option=Option(("--optimizer",), "{choices}. Default: {default}.", "choice"))
    checkpointing: Checkpointing = setting(Checkpointing.NONE, section="memory", label="checkpointing",
                                           keep=("checkpointing",), option=Option(
        ("--checkpointing",), "Gradient checkpointing: {choices}. Default: {default}.", "choice"))
    attention: Attention = setting(Attention.SDPA, section="memory", label="attention", keep=("attention",),
                                   option=Option(("--attention",), "{choices} (sdpa = FlashAttention / "
                                                 "memory-efficient kernel). Default: {default}.", "choice"))
    sharding: Sharding = setting(Sharding.NONE, section="parallel", label="sharding", keep=("sharding", "zero"),
                                 option=Option(("--zero",), "ZeRO sharding: {choices}. Default: none (the plan shards "
                                               "when needed); needs 2+ GPUs.", "choice"))
    offload: Offload = setting(Offload.NONE, section="parallel", label="offload", keep=("offload",), option=Option(
        ("--offload",), "CPU offload: {choices}. Default: none.", "choice"))
    num_gpus: int = setting(1, section="parallel", label="gpus", keep=("gpus",))
    """GPUs in the job, the world size (GPUs per node x nodes): `tp` GPUs form one tensor-parallel group, and the
    num_gpus / tp groups are the data-parallel ranks that sharding spreads over (`dp_size`; = num_gpus without TP).
    The command line sets it with --gpus and --nodes (the hardware's options)."""
    engine: Engine = setting(Engine.DEEPSPEED, section="parallel", label="engine", keep=("engine",), option=Option(
        ("--engine",), "Who shards and offloads: {choices} (DDP / ZeroRedundancyOptimizer / FSDP2). Their memory "
        "layouts differ. Default: deepspeed.", "choice"))
    """The engine that runs data parallelism, sharding and offload when num_gpus > 1 or offload is on."""
    tp: int = setting(1, section="parallel", label="tp", keep=("tp",), option=Option(
        ("--tp",), "Tensor-parallel degree (torch DTensor, as torchtitan applies it): each group of N GPUs splits "
        "every projection, the embedding and the LM head; the data-parallel ranks are GPUs / N. Needs --engine torch "
        "(the default with --tp > 1). Default: 1.", maximum=MAX_DEGREE))
    """Tensor-parallel degree (torch DTensor, as torchtitan applies it; Megatron-style column/row splits): each
    group of `tp` GPUs holds 1/tp of every projection, the token embedding and the LM head (memfit.tensor_parallel)."""
    sequence_parallel: bool = setting(False, section="parallel", label="sequence parallel", keep=("tp",),
                                      option=Option(("--sequence-parallel",), "With --tp: split norms and the "
                                                    "residual stream along the sequence (Megatron SP; torchtitan's "
                                                    "SequenceParallel). Default: off.", "flag"))
    """With tp > 1: norms and the residual stream split along the sequence between the tensor-parallel ranks
    (Megatron SP, Korthikanti et al. 2022; torchtitan's SequenceParallel), all-gather / reduce-scatter instead of
    all-reduce."""
    finetune: Finetune = setting(Finetune(), section="finetune", label="method", keep=("method", "finetune", "lora"),
                                 nested=Finetune)
    """What is trained: every weight, or LoRA / QLoRA adapters on a frozen base (memfit.finetune)."""
    expert_parallel: int = setting(1, section="moe", label="ep", keep=("ep", "expert_parallel"), option=Option(
        ("--ep",), "MoE models: expert-parallel degree, ranks the experts are split over (divides the GPUs and the "
        "experts). Default: 1.", maximum=MAX_GPUS_PER_NODE * 64))
    """MoE models: ranks the routed experts are split over (an EP group inside the num_gpus data-parallel ranks);
    each rank holds num_experts / expert_parallel experts and exchanges tokens by all-to-all (memfit.estimate.moe)."""
    capacity_factor: float = setting(0.0, section="moe", label="capacity factor", keep=("capacity",), option=Option(
        ("--capacity-factor",), "MoE models: 0 = dropless routing (transformers' experts); C >= 1 caps an expert at "
        "C x tokens x top_k / experts rows, which bounds the worst-case routing range shown. Default: 0.",
        "capacity", metavar="C"))
    """MoE models: 0 = dropless routing (transformers' experts); c >= 1 caps each expert at c x tokens x top_k /
    num_experts rows (an implementation that drops tokens), which bounds the worst-case load memfit shows."""
    loss: Loss = setting(Loss.STANDARD, section="memory", label="loss", keep=("loss",), option=Option(
        ("--loss",), "{choices}: the whole B x T x V logits (transformers), per sequence chunk (torchtune "
        "CEWithChunkedOutputLoss), fused with the LM head (Liger; needs liger-kernel) or the cross-entropy under "
        "torch.compile (torchtitan's build_cross_entropy_loss). Default: standard.", "choice"))
    """How the logits become the loss: all at once (transformers), per chunk (torchtune) or fused (Liger)."""
    model_code: ModelCode = setting(ModelCode.HF, section="memory", label="model code", keep=("model_code",),
                                    quiet_default=True,
                                    option=Option(("--model-code",), "{choices}: whose module runs the model: the "
                                                  "Hugging Face class, or LitGPT's own GPT stepped as litgpt finetune "
                                                  "steps it (set by a LitGPT config). Default: hf.", "choice"))
    """Whose code runs the model: transformers' (hf) or LitGPT's GPT (memfit.estimate.litgpt)."""
    optimizer_in_backward: bool = setting(False, section="optimizer", label="optimizer in backward",
                                          keep=("optimizer_in_backward", "in_backward"), option=Option(
        ("--optimizer-in-backward",), "Step each parameter in backward and free its gradient (torchtune "
        "optimizer_in_bwd): no gradient accumulation or clipping, one GPU. Default: off.", "flag"))
    """Step each parameter as soon as its gradient is accumulated, then free it (torchtune optimizer_in_bwd)."""
    keep_zeroed_grads: bool = setting(False, section="optimizer", label="gradients kept zeroed", option=Option(
        ("--keep-zeroed-grads",), "zero_grad(set_to_none=False): gradients zeroed, not freed, between steps, so they "
        "live through forward (torch < 2.0's default; the HF Trainer's model.zero_grad() then). Default: off "
        "(freed).", "flag"))
    """zero_grad(set_to_none=False): gradients zeroed, not freed, after each step, so they live through the next
    forward (torch < 2.0's default for Module / Optimizer.zero_grad, which the HF Trainer's model.zero_grad() used;
    torch 2.0 made set_to_none=True the default, pytorch/pytorch#92731)."""
    # --- pipeline / context parallelism and HSDP (memfit.estimate.pipeline, .context_parallel, .static) ---
    pp: int = setting(1, section="parallel", label="pp", keep=("pp",), option=Option(
        ("--pp",), "Pipeline-parallel degree (torch.distributed.pipelining, torchtitan's pipeline_parallel_degree): "
        "the layers are cut into stages over N GPUs, the embedding on the first, the LM head on the last; --accum is "
        "the number of micro-batches. Needs --engine torch (the default with --pp > 1). Default: 1.",
        maximum=MAX_DEGREE))
    """Pipeline-parallel degree (torch.distributed.pipelining, torchtitan's pipeline_parallel_degree): the layers are
    cut into pp x pp_virtual_stages stages, one group of `pp` GPUs runs them one after another, and each optimizer
    step's grad_accum_steps micro-batches flow through them (torchtitan: local batch / micro-batch size)."""
    pp_schedule: PipelineSchedule = setting(PipelineSchedule.ONE_F_ONE_B, section="parallel", label="pp schedule",
                                            keep=("pp",), option=Option(
        ("--pp-schedule",), "With --pp: {choices} (torchtitan's pipeline_parallel_schedule). Default: {default}.",
        "choice"))
    """With pp > 1: gpipe, 1f1b or interleaved-1f1b (torchtitan's pipeline_parallel_schedule)."""
    pp_virtual_stages: int = setting(1, section="parallel", label="pp stages per rank", keep=("pp",), option=Option(
        ("--pp-virtual-stages",), "With --pp-schedule interleaved-1f1b: stages per pipeline rank (2 or more). "
        "Default: 1.", maximum=1024, metavar="V"))
    """Stages each pipeline rank holds (interleaved-1f1b: 2 or more, torchtitan's stages per rank)."""
    cp: int = setting(1, section="parallel", label="cp", keep=("cp",), option=Option(
        ("--cp",), "Context-parallel degree (torch context_parallel ring attention, torchtitan's "
        "context_parallel_degree): N GPUs split every sequence, each holding seq / N tokens of every activation. "
        "Needs --attention sdpa and --engine torch (the default with --cp > 1). Default: 1.", maximum=MAX_DEGREE))
    """Context-parallel degree (torch context_parallel ring attention, torchtitan's context_parallel_degree): each
    group of cp GPUs splits every sequence, each rank holding seq_len / cp tokens of every activation; FSDP shards
    over dp x cp (memfit.estimate.context_parallel)."""
    cp_rotate: CpRotate = setting(CpRotate.ALLGATHER, section="parallel", label="cp rotate", keep=("cp",),
                                  option=Option(("--cp-rotate",), "With --cp: {choices}, how ring attention moves K/V "
                                                "(torchtitan's context_parallel_rotate_method). Default: {default}.",
                                                "choice"))
    """With cp > 1: allgather (torch's default) or alltoall, how the K/V chunks travel."""
    dp_shard: int = setting(0, section="parallel", label="shard group", keep=("dp_shard", "hsdp"), option=Option(
        ("--dp-shard",), "HSDP: shard ZeRO-2/3 over groups of N data-parallel ranks and replicate across the groups "
        "(FSDP2 on a 2D (replicate, shard) mesh; torchtitan's data_parallel_shard_degree). Needs --engine torch. "
        "Default: all data-parallel ranks.", maximum=MAX_DEGREE))
    """HSDP: ZeRO-2/3 shards over groups of dp_shard data-parallel ranks and replicates across the
    dp_size / dp_shard groups (FSDP2 fully_shard(mesh=2D (replicate, shard)); torchtitan's
    data_parallel_shard_degree, with data_parallel_replicate_degree the rest). 0: shard over all of them."""

    # ---- inputs of encoder-decoder and vision models (memfit.derive.stacks checks them against the model) ----
    target_len: int | None = setting(None, section="batch", label="target", option=Option(
        ("--target-len", "--target"), "Encoder-decoders (T5, BART): decoder (target) length in tokens; --seq is the "
        "encoder's (source). Required for them, refused for other models.", maximum=MAX_SEQ_LEN))
    """Encoder-decoders (T5, BART): tokens per decoder (target) sequence; `seq_len` is the encoder's (source)
    length. None for other models."""
    image_size: int | None = setting(None, section="batch", label="image", option=Option(
        ("--image-size",), "Vision models (ViT, DINOv2): image side in pixels, a multiple of the patch size; the "
        "tokens per image follow from it (--seq does not apply). Default: the config's image_size.",
        maximum=MAX_SEQ_LEN, metavar="PIXELS"))
    """Vision transformers (ViT, DINOv2): image side in pixels, a multiple of the patch size; the tokens per image
    are (image_size / patch)^2 + CLS (+ registers), so `seq_len` does not apply. None: the config's image_size."""

    # -- sequence lengths of real data (TrainingSetup.peak_seq_len) --
    padding: Padding = setting(Padding.MAX_LENGTH, section="batch", label="padding", keep=("padding",),
                               option=Option(("--padding",), "{choices}: every sequence --seq tokens (packed, or "
                                             "padded to --seq), or each batch padded to its longest sample (HF "
                                             "DataCollatorWithPadding, torchtune unpacked): the run peaks at the "
                                             "batch holding the longest sample, min(--seq, --longest-sample) tokens. "
                                             "Default: max-length.", "choice"))
    """max-length: every sequence holds seq_len tokens (packed, or padded to seq_len); longest: each batch padded to
    its longest sample, seq_len the truncation (torchtune tokenizer.max_seq_len, HF max_length)."""
    longest_sample_len: int | None = setting(None, section="batch", label="longest sample", keep=("padding",),
                                             option=Option(("--longest-sample",), "With --padding longest: tokens of "
                                                           "the data's longest sample; it sets the peak (--seq still "
                                                           "truncates). Default: --seq.", maximum=MAX_SEQ_LEN))
    """With padding longest: tokens of the data set's longest sample (before truncation at seq_len); it sets the
    peak. None: seq_len, the bound truncation gives."""

    # -- torch.compile (memfit.estimate.compiled) --
    compile: bool = setting(False, section="memory", label="torch.compile", keep=("compile",), option=Option(
        ("--compile",), "torch.compile each transformer block (torchtune compile: True, torchtitan [compile] "
        "enable): a block keeps what AOTAutograd's min-cut partitioner saves (traced on fake tensors). Default: off.",
        "flag"))
    """torch.compile each transformer block (torchtune `compile: True`, torchtitan `[compile] enable`, HF
    `torch_compile=True`): AOTAutograd's min-cut partitioner decides what a block saves (memfit.estimate.compiled)."""
    fsdp_version: FsdpVersion = setting(FsdpVersion.V2, section="parallel", label="FSDP version", quiet_default=True,
                                        option=Option(("--fsdp-version",), "engine torch, zero2 / zero3: {choices} "
                                                      "(1 = FullyShardedDataParallel's flat parameters as accelerate "
                                                      "/ the HF Trainer run it; 1-blocks = Lightning / LitGPT's, "
                                                      "adapters in their block's flat parameter). Default: {default}.",
                                                      "choice"))
    """torch's FSDP2 (`fully_shard`) or FSDP1 (FullyShardedDataParallel, flat parameters: memfit.estimate.fsdp1)."""
    # -- DeepSpeed's ZeRO buffers as the user's config sets them (memfit.zero_knobs) --
    zero_knobs: ZeroKnobs = setting(ZeroKnobs(), section="parallel", label="DeepSpeed buckets")
    """engine deepspeed: reduce_bucket_size, stage3_param_persistence_threshold and stage3_max_reuse_distance as the
    JSON sets them (a key left out takes DeepSpeed's default); all None / default: the HF "auto" values memfit emits.
    No option sets them: only a --config file."""
    # -- techniques that declare their own fields in their module (memfit.fields.TechniqueSection) --
    techniques: _fields.Techniques = dataclasses.field(default=_fields.Techniques())
    """The registered technique sections that differ from their defaults. Their fields are the setup's too, flat:
    `TrainingSetup(name=...)`, `setup.replace(name=...)`, `setup.name`, to_dict, --keep, setup_changes."""
    notes: tuple[str, ...] = setting((), section="notes", compare=False)
    """Why the setup looks as it does (defaults assumed, values clamped); shown to the user."""

    TECHNIQUES_FIELD: ClassVar[str] = "techniques"
    """The field holding the technique sections (memfit.fields.declared lists their fields with the setup's)."""

    def __getattr__(self, name: str) -> Any:
        """A registered technique section's field, read flat (`setup.<field>`)."""
        owner = _fields.technique_field_owner(name) if not name.startswith("__") else None
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.techniques.get(owner), name)

    def technique(self, section: type) -> Any:
        """The value of one technique section (memfit.fields.TechniqueSection), its default when not used."""
        return self.techniques.get(section)

    def __post_init__(self) -> None:
        for name, kind in _CHOICE_FIELDS:  # the enum fields take their values' text and aliases
            object.__setattr__(self, name, kind.parse(getattr(self, name)))
        if isinstance(self.finetune, str):
            object.__setattr__(self, "finetune", Finetune(method=self.finetune))
        elif isinstance(self.finetune, dict):
            object.__setattr__(self, "finetune", Finetune(**self.finetune))
        if isinstance(self.zero_knobs, dict):
            object.__setattr__(self, "zero_knobs", ZeroKnobs(**self.zero_knobs))
        problems = [f"{name} must be a positive whole number, got {getattr(self, name)!r}"
                    for name in ("micro_batch_size", "seq_len", "grad_accum_steps", "num_gpus", "tp", "pp",
                                 "pp_virtual_stages", "cp")
                    if not positive_int(getattr(self, name))]
        problems += [f"{name} must be a positive whole number or None, got {getattr(self, name)!r}"
                     for name in ("target_len", "image_size", "longest_sample_len")
                     if getattr(self, name) is not None and not positive_int(getattr(self, name))]
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if not problems:
            problems += moe_problems(self)
        if not isinstance(self.optimizer_in_backward, bool):
            problems.append(f"optimizer_in_backward must be true or false, got {self.optimizer_in_backward!r}")
        if not isinstance(self.keep_zeroed_grads, bool):
            problems.append(f"keep_zeroed_grads must be true or false, got {self.keep_zeroed_grads!r}")
        if not isinstance(self.techniques, _fields.Techniques):
            problems.append(f"techniques must be a memfit.fields.Techniques, got {self.techniques!r}")
        else:
            problems += [problem for section in self.techniques if not section.checked_late
                         for problem in section.problems(self)]
        if not isinstance(self.compile, bool):
            problems.append(f"compile must be true or false, got {self.compile!r}")
        if self.model_code is ModelCode.LITGPT and (self.loss is not Loss.STANDARD or self.compile is True or any(
                isinstance(n, int) and n > 1 for n in (self.tp, self.pp, self.cp))):
            problems.append("model code litgpt is sized for LitGPT's own loss (128-token head chunks), eager, without "
                            "tensor, context or pipeline parallelism: use loss standard and none of those")
        if self.longest_sample_len is not None and self.padding is not Padding.LONGEST:
            problems.append("a longest sample length needs padding longest (with max-length every sequence holds "
                            "seq_len tokens)")
        if not problems:
            problems += combination_problems(self)
            problems += [problem for section in self.techniques if section.checked_late
                         for problem in section.problems(self)]
            problems += fsdp1_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    def replace(self, **changes) -> "TrainingSetup":
        """A copy with `changes`. Where they cannot combine with the optimizer step in backward, a non-standard
        loss or a technique section's `turned_back` fields that they do not name (accumulation, ZeRO, LoRA,
        fp16...), those are turned back as well, so the change a technique asks for still happens; setup_changes
        then names the turned-back fields too."""
        try:
            return dataclasses.replace(self, **changes)
        except ConfigError:
            fallbacks = [(name, off) for name, off in _turned_back()
                         if name not in changes and getattr(self, name) != off]
            if not fallbacks:
                raise
        undone: dict = {}
        for name, off in fallbacks:
            undone[name] = off
            try:
                return dataclasses.replace(self, **changes, **undone)
            except ConfigError:
                continue
        return dataclasses.replace(self, **changes)

    def section(self, name: str) -> "_fields.Section":
        """The fields of one section (memfit.fields.SECTIONS: batch, precision, optimizer, memory, parallel,
        finetune, moe, notes) and their values, as a read-only view: `setup.section("precision").precision`."""
        return _fields.Section(name, {f: getattr(self, f) for f in _fields.section_fields(TrainingSetup, name)})

    def with_section(self, name: str, **changes) -> "TrainingSetup":
        """A copy with `changes` to fields of section `name` (replace's rules: validated, conflicting extras turned
        back). A field of another section is a ConfigError naming its section, so a reader or emitter that owns
        one section cannot set another's by mistake."""
        own = _fields.section_fields(TrainingSetup, name)
        strays = [f"{f} (section {_fields.meta(TrainingSetup, f).section})" if f in FIELD_LABELS else f
                  for f in changes if f not in own]
        if strays:
            raise ConfigError(f"section {name} holds {', '.join(own)}; not {', '.join(strays)}")
        return self.replace(**changes)

    @property
    def peak_seq_len(self) -> int:
        """The sequence length of the run's highest step. Padded to the longest sample of each batch, a step's length
        is its batch's longest sample, so the run peaks at the batch holding the data set's longest sample:
        min(seq_len, longest_sample_len), every row of that batch padded to it (max_memory_allocated is a running
        maximum, and the caching allocator keeps that step's segments reserved for the rest of the run). Packed or
        padded to max length: seq_len."""
        if self.padding is Padding.LONGEST and self.longest_sample_len is not None:
            return min(self.seq_len, self.longest_sample_len)
        return self.seq_len

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: num_gpus / (tp x pp x cp) (num_gpus without them). Every rank of a tensor- or
        context-parallel group sees the same micro-batch, a pipeline passes it from stage to stage; ZeRO and FSDP
        shard over these (and over the context-parallel ranks: `shard_size`)."""
        if not (positive_int(self.tp) and positive_int(self.pp) and positive_int(self.cp)):
            return self.num_gpus
        return max(1, self.num_gpus // (self.tp * self.pp * self.cp))

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO / FSDP shard static memory over: the HSDP shard group, else every data-parallel rank; times
        cp (torchtitan shards FSDP over the dp_shard x cp mesh)."""
        group = self.dp_shard if self.dp_shard and positive_int(self.dp_shard) else self.dp_size
        return group * (self.cp if positive_int(self.cp) else 1)

    @property
    def replicas(self) -> int:
        """HSDP replica groups (1 without HSDP): each holds a full sharded copy, gradients all-reduced across."""
        return max(1, self.dp_size * (self.cp if positive_int(self.cp) else 1) // self.shard_size)

    @property
    def effective_batch_size(self) -> int:
        """Sequences per optimizer step across all ranks (the data-parallel ones: a tensor-parallel group shares
        its micro-batch)."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    def to_dict(self) -> dict:
        """Every field as JSON holds it, the technique sections' flat among the setup's own (field_names); a field
        declared `quiet_default` only when it differs from its default."""
        return {name: _fields.plain(getattr(self, name)) for name in field_names()
                if getattr(self, name) != _QUIET_DEFAULTS.get(name, _fields.MISSING)}


def _taking_technique_fields(init):
    """TrainingSetup's generated __init__, taking a registered technique section's fields by name like its own (so
    dataclasses.replace, JSON read back and every caller's keywords work unchanged)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        moved = {name: kwargs.pop(name) for name in [n for n in kwargs if n not in _OWN_FIELDS
                                                      and _fields.technique_field_owner(n)]}
        if moved:
            held = kwargs.get("techniques", _fields.Techniques())
            kwargs["techniques"] = held.with_fields(moved) if isinstance(held, _fields.Techniques) else held
        init(self, *args, **kwargs)

    return __init__


TrainingSetup.__init__ = _taking_technique_fields(TrainingSetup.__init__)
_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingSetup))


def field_names() -> tuple[str, ...]:
    """Every field a setup shows, in order: the dataclass's own (the sections' holder aside) with each registered
    technique section's fields after its section's own (memfit.fields.declared), notes last."""
    shown = tuple(name for name, _ in _fields.declared(TrainingSetup))
    return tuple(n for n in shown if n != "notes") + ("notes",)


_QUIET_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingSetup)
                   if _fields.KEY in f.metadata and f.metadata[_fields.KEY].quiet_default}
"""The fields left out of to_dict at their default (FieldMeta.quiet_default), with that default."""

_CHOICE_FIELDS = tuple((f.name, type(f.default)) for f in dataclasses.fields(TrainingSetup)
                       if isinstance(f.default, _Choice))
"""(field, its Choice enum) of every enum field, which __post_init__ parses."""

class _FieldTable(Mapping):
    """A read-only table derived from TrainingSetup's declared fields, the technique sections' included: built on
    first read (which loads the sections, memfit.fields.load_sections) and again after a section registers or is
    taken out, so whoever imported it sees every field whatever was imported first."""

    def __init__(self, build: Callable[[], dict]):
        self._build, self._table = build, None
        _fields.on_sections_changed(self._forget)

    def _forget(self) -> None:
        self._table = None

    def _fresh(self) -> dict:
        if self._table is None:
            _fields.load_sections()
            self._table = self._build()
        return self._table

    def __getitem__(self, key: str) -> Any:
        return self._fresh()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fresh())

    def __len__(self) -> int:
        return len(self._fresh())

    def __repr__(self) -> str:
        return repr(self._fresh())


FIELD_LABELS: Mapping[str, str] = _FieldTable(lambda: _fields.labels(TrainingSetup))
"""How each TrainingSetup field (notes aside) is named in what memfit prints (declared on the fields)."""


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
    def section(self) -> str:
        """The setup section the field belongs to (memfit.fields.SECTIONS)."""
        return _fields.meta(TrainingSetup, self.field).section

    @property
    def text(self) -> str:
        return f"{self.label} {self.old} -> {self.new}"


def setup_changes(before: TrainingSetup, after: TrainingSetup) -> tuple[FieldChange, ...]:
    """Every field (notes aside) that `after` changes, in TrainingSetup's order: the one diff that plan steps,
    pins and the GPU-count suggestion all state, so no change goes unsaid."""
    return tuple(FieldChange(name, getattr(before, name), getattr(after, name)) for name in FIELD_LABELS
                 if getattr(before, name) != getattr(after, name))


KEEP_NAMES: Mapping[str, tuple[str, ...]] = _FieldTable(lambda: _fields.keep_names(TrainingSetup))
"""What `--keep` accepts, and the TrainingSetup fields each name pins (declared on the fields)."""

_KEEP_NAME = _FieldTable(lambda: {n: _fields.keep_name_of(TrainingSetup, n) for n in _fields.labels(TrainingSetup)})


def keep_name(field: str) -> str:
    """The --keep name a message gives for `field` (micro_batch_size -> micro_batch)."""
    return _KEEP_NAME.get(field, field)


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
