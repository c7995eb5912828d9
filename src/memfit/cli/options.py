"""The options every sizing command shares, parsed into library values at the command-line boundary.

Each option is an `Annotated` alias with its help panel; `with_setup_options` adds the whole set to a command in
place of its `opts: SetupOptions` parameter, so a new command (trace, measure, launch) takes the same options by
writing one parameter. Values are checked here, so a bad number is one line naming the option, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import math
import os
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from ..diagnose import DEFAULT_MARGIN
from ..errors import ConfigError, MemfitError
from ..finetune import BaseWeights, Finetune, LoraRecipe, Method
from ..hardware import GPU, Hardware, get_gpu, make_hardware
from ..model_spec import ModelSpec
from ..setup import (KEEP_NAMES, Attention, Checkpointing, CpRotate, CpuOffloadOptimizer, Engine, Float8, Loss, Offload, Optimizer,
                     Padding, PipelineSchedule, Precision, Sharding, TrainingSetup, _Choice, parse_keep)
from ..units import parse_size
from .progress import hidden

MODEL_PANEL, SETUP_PANEL, HARDWARE_PANEL, OUTPUT_PANEL = "Model", "Training setup", "Hardware", "Output"
DEFAULT_GPU = "A100-80GB"

# Upper bounds that no real step reaches; they keep the ladder's divisor search and --optimize's enumeration short.
MAX_MICRO_BATCH = 65_536
MAX_SEQ_LEN = 16 * 1024 * 1024
MAX_ACCUM = 65_536
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 65_536


def whole_number(maximum: int) -> Callable[[str], int]:
    """A parser for a whole number in [1, maximum]: '0', '-3', '1.5' and 'abc' are rejected with one line."""

    def parse(value: str | int) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                raise typer.BadParameter(f"'{value}' is not a whole number") from None
        if not 1 <= number <= maximum:
            raise typer.BadParameter(f"{number} must be a whole number from 1 to {maximum:,}")
        return number

    return parse


def fraction(value: str | float) -> float:
    """A finite number in [0, 1)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"'{value}' is not a number: give a fraction such as 0.05") from None
    if not (math.isfinite(number) and 0 <= number < 1):
        raise typer.BadParameter(f"{value} must be a fraction from 0 (keep nothing free) up to, not including, 1")
    return number


def size(value: str | int) -> int:
    """A memory size: 512GiB, 1.5TB, 64G (bare numbers are GiB)."""
    if isinstance(value, int):
        return value
    try:
        return parse_size(str(value))
    except MemfitError as error:
        raise typer.BadParameter(str(error)) from None


def gpu(value: str | GPU) -> GPU:
    """A catalog GPU name or alias, or a memory size for a GPU that is not in the catalog."""
    if isinstance(value, GPU):
        return value
    text = str(value).strip()
    try:
        return get_gpu(text)
    except MemfitError as error:
        message = str(error)
    if text[:1].isdigit() or text[:1] in "+-.":
        try:  # a size parse_size rejects: say why in its words rather than 'unknown gpu'
            parse_size(text)
        except MemfitError as size_error:
            message = str(size_error)
    raise typer.BadParameter(message)


def choice(kind: type[_Choice]) -> Callable[[str], _Choice]:
    """A parser for one of a setup enum's values, or an alias it accepts (e.g. 'flash' for sdpa)."""

    def parse(value: str | _Choice) -> _Choice:
        try:
            return kind.parse(value)
        except MemfitError as error:
            raise typer.BadParameter(str(error)) from None

    return parse


def keep_fields(value: str | frozenset[str]) -> frozenset[str]:
    """--keep: a comma list of setup fields to pin; an unknown name is one line listing the valid ones."""
    try:
        return parse_keep(value)
    except MemfitError as error:
        raise typer.BadParameter(str(error)) from None


def _choices(kind: type[_Choice]) -> str:
    return ", ".join(m.value for m in kind)


def _option(*decls: str, panel: str, help: str, parser: Callable | None = None, metavar: str | None = None,
            **extra) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=panel, parser=parser, metavar=metavar,
                        show_default=False, **extra)


def _choice_option(decl: str, kind: type[_Choice], help: str) -> Any:
    return _option(decl, panel=SETUP_PANEL, parser=choice(kind), metavar=decl.lstrip("-").upper(),
                   help=help)


ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, "
         "or a Hugging Face hub id (org/name).")]

OptionalModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, rich_help_panel=MODEL_PANEL,
    help="A catalog name (see `memfit models`), a path to a config.json or a folder holding one, "
         "or a Hugging Face hub id (org/name). Optional when --config names the model (axolotl base_model, "
         "LLaMA-Factory model_name_or_path, torchtune model).")]
"""What commands taking ModelArg get from with_setup_options: MODEL may come from --config."""

ConfigOpt = Annotated[Optional[list[str]], _option(
    "--config", panel=SETUP_PANEL, metavar="FILE",
    help="Read the setup from the config you already have: HF TrainingArguments (JSON/YAML), DeepSpeed JSON, "
         "accelerate YAML, axolotl, LLaMA-Factory or torchtune YAML (the format comes from the keys; the DeepSpeed "
         "file a config names is read too). Repeat it or give a comma list to combine files. The fields it sets "
         "count as given; options given here override them.")]

GpuOpt = Annotated[Optional[GPU], _option(
    "--gpu", panel=HARDWARE_PANEL, parser=gpu, metavar="NAME|SIZE",
    help=f"GPU: a catalog name (see `memfit gpus`) or a memory size such as 24GiB. Default: {DEFAULT_GPU}.")]
GpusOpt = Annotated[Optional[int], _option(
    "--gpus", panel=HARDWARE_PANEL, parser=whole_number(MAX_GPUS_PER_NODE), metavar="N",
    help="GPUs per node. Default: 1. With more than one, the plan may shard with ZeRO.")]
NodesOpt = Annotated[Optional[int], _option(
    "--nodes", panel=HARDWARE_PANEL, parser=whole_number(MAX_NODES), metavar="N", help="Nodes. Default: 1.")]
CpuRamOpt = Annotated[Optional[int], _option(
    "--cpu-ram", panel=HARDWARE_PANEL, parser=size, metavar="SIZE",
    help="Host RAM per node for CPU offload, e.g. 512GiB. Default: 256GiB.")]
MarginOpt = Annotated[Optional[float], _option(
    "--margin", panel=HARDWARE_PANEL, parser=fraction, metavar="FRACTION",
    help=f"Fraction of GPU memory kept free for kernels' workspaces and spikes. Default: {DEFAULT_MARGIN}.")]

BatchOpt = Annotated[Optional[int], _option(
    "--batch", "-b", panel=SETUP_PANEL, parser=whole_number(MAX_MICRO_BATCH), metavar="N",
    help=f"Micro-batch: sequences per GPU per forward/backward. Default: {TrainingSetup.micro_batch_size}.")]
SeqOpt = Annotated[Optional[int], _option(
    "--seq", "-s", panel=SETUP_PANEL, parser=whole_number(MAX_SEQ_LEN), metavar="N",
    help=f"Sequence length in tokens. Default: {TrainingSetup.seq_len}, or the model's maximum if shorter.")]
TargetOpt = Annotated[Optional[int], _option(
    "--target-len", "--target", panel=SETUP_PANEL, parser=whole_number(MAX_SEQ_LEN), metavar="N",
    help="Encoder-decoders (T5, BART): decoder (target) length in tokens; --seq is the encoder's (source). "
         "Required for them, refused for other models.")]
TaskOpt = Annotated[Optional[str], _option(
    "--task", panel=MODEL_PANEL, metavar="TASK",
    help="lm or sequence-classification: train the model's own head (causal LM; BERT: masked LM), or a sequence "
         "classifier over --num-labels classes (BertForSequenceClassification's pooler + classifier, "
         "LlamaForSequenceClassification's score on the last token; bert, llama, mistral, qwen2, qwen3). "
         "Default: lm, or what the config's architectures name.")]
NumLabelsOpt = Annotated[Optional[int], _option(
    "--num-labels", panel=MODEL_PANEL, parser=whole_number(1_000_000), metavar="N",
    help="Classes of --task sequence-classification (given alone, it implies that task). Default: 2.")]
ImageSizeOpt = Annotated[Optional[int], _option(
    "--image-size", panel=SETUP_PANEL, parser=whole_number(MAX_SEQ_LEN), metavar="PIXELS",
    help="Vision models (ViT, DINOv2): image side in pixels, a multiple of the patch size; the tokens per image "
         "follow from it (--seq does not apply). Default: the config's image_size.")]
PaddingOpt = Annotated[Optional[Padding], _choice_option(
    "--padding", Padding,
    help=f"{_choices(Padding)}: every sequence --seq tokens (packed, or padded to --seq), or each batch padded to "
         "its longest sample (HF DataCollatorWithPadding, torchtune unpacked): the run peaks at the batch holding "
         "the longest sample, min(--seq, --longest-sample) tokens. Default: max-length.")]
LongestSampleOpt = Annotated[Optional[int], _option(
    "--longest-sample", panel=SETUP_PANEL, parser=whole_number(MAX_SEQ_LEN), metavar="N",
    help="With --padding longest: tokens of the data's longest sample; it sets the peak (--seq still truncates). "
         "Default: --seq.")]
AccumOpt = Annotated[Optional[int], _option(
    "--accum", panel=SETUP_PANEL, parser=whole_number(MAX_ACCUM), metavar="N",
    help=f"Gradient accumulation steps. Default: {TrainingSetup.grad_accum_steps}.")]
def capacity(value: str | float) -> float:
    """0 (dropless) or a finite number >= 1."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise typer.BadParameter(f"'{value}' is not a number: give 0 (dropless) or a factor such as 1.25") from None
    if not math.isfinite(number) or number < 0 or 0 < number < 1:
        raise typer.BadParameter(f"{value} must be 0 (dropless routing) or a capacity factor >= 1")
    return number


EpOpt = Annotated[Optional[int], _option(
    "--ep", panel=SETUP_PANEL, parser=whole_number(MAX_GPUS_PER_NODE * 64), metavar="N",
    help="MoE models: expert-parallel degree, ranks the experts are split over (divides the GPUs and the experts). "
         "Default: 1.")]
CapacityOpt = Annotated[Optional[float], _option(
    "--capacity-factor", panel=SETUP_PANEL, parser=capacity, metavar="C",
    help="MoE models: 0 = dropless routing (transformers' experts); C >= 1 caps an expert at C x tokens x top_k / "
         "experts rows, which bounds the worst-case routing range shown. Default: 0.")]
PrecisionOpt = Annotated[Optional[Precision], _choice_option(
    "--precision", Precision, help=f"{_choices(Precision)}. Default: {TrainingSetup.precision}.")]
OptimizerOpt = Annotated[Optional[Optimizer], _choice_option(
    "--optimizer", Optimizer, help=f"{_choices(Optimizer)}. Default: {TrainingSetup.optimizer}.")]
CheckpointingOpt = Annotated[Optional[Checkpointing], _choice_option(
    "--checkpointing", Checkpointing,
    help=f"Gradient checkpointing: {_choices(Checkpointing)}. Default: {TrainingSetup.checkpointing}.")]
AttentionOpt = Annotated[Optional[Attention], _choice_option(
    "--attention", Attention,
    help=f"{_choices(Attention)} (sdpa = FlashAttention / memory-efficient kernel). "
         f"Default: {TrainingSetup.attention}.")]
ZeroOpt = Annotated[Optional[Sharding], _choice_option(
    "--zero", Sharding,
    help=f"ZeRO sharding: {_choices(Sharding)}. Default: none (the plan shards when needed); needs 2+ GPUs.")]
OffloadOpt = Annotated[Optional[Offload], _choice_option(
    "--offload", Offload, help=f"CPU offload: {_choices(Offload)}. Default: none.")]
EngineOpt = Annotated[Optional[Engine], _choice_option(
    "--engine", Engine,
    help=f"Who shards and offloads: {_choices(Engine)} (DDP / ZeroRedundancyOptimizer / FSDP2). Their memory "
         "layouts differ. Default: deepspeed.")]

TpOpt = Annotated[Optional[int], _option(
    "--tp", panel=SETUP_PANEL, parser=whole_number(MAX_GPUS_PER_NODE * MAX_NODES), metavar="N",
    help="Tensor-parallel degree (torch DTensor, as torchtitan applies it): each group of N GPUs splits every "
         "projection, the embedding and the LM head; the data-parallel ranks are GPUs / N. Needs --engine torch "
         "(the default with --tp > 1). Default: 1.")]
SequenceParallelOpt = Annotated[Optional[bool], _option(
    "--sequence-parallel/--no-sequence-parallel", panel=SETUP_PANEL,
    help="With --tp: split norms and the residual stream along the sequence (Megatron SP; torchtitan's "
         "SequenceParallel). Default: off.")]
PpOpt = Annotated[Optional[int], _option(
    "--pp", panel=SETUP_PANEL, parser=whole_number(MAX_GPUS_PER_NODE * MAX_NODES), metavar="N",
    help="Pipeline-parallel degree (torch.distributed.pipelining, torchtitan's pipeline_parallel_degree): the "
         "layers are cut into stages over N GPUs, the embedding on the first, the LM head on the last; --accum is "
         "the number of micro-batches. Needs --engine torch (the default with --pp > 1). Default: 1.")]
PpScheduleOpt = Annotated[Optional[PipelineSchedule], _choice_option(
    "--pp-schedule", PipelineSchedule,
    help=f"With --pp: {_choices(PipelineSchedule)} (torchtitan's pipeline_parallel_schedule). "
         f"Default: {TrainingSetup.pp_schedule}.")]
PpVirtualStagesOpt = Annotated[Optional[int], _option(
    "--pp-virtual-stages", panel=SETUP_PANEL, parser=whole_number(1024), metavar="V",
    help="With --pp-schedule interleaved-1f1b: stages per pipeline rank (2 or more). Default: 1.")]
CpOpt = Annotated[Optional[int], _option(
    "--cp", panel=SETUP_PANEL, parser=whole_number(MAX_GPUS_PER_NODE * MAX_NODES), metavar="N",
    help="Context-parallel degree (torch context_parallel ring attention, torchtitan's context_parallel_degree): "
         "N GPUs split every sequence, each holding seq / N tokens of every activation. Needs --attention sdpa "
         "and --engine torch (the default with --cp > 1). Default: 1.")]
CpRotateOpt = Annotated[Optional[CpRotate], _choice_option(
    "--cp-rotate", CpRotate,
    help=f"With --cp: {_choices(CpRotate)}, how ring attention moves K/V (torchtitan's "
         f"context_parallel_rotate_method). Default: {TrainingSetup.cp_rotate}.")]
DpShardOpt = Annotated[Optional[int], _option(
    "--dp-shard", panel=SETUP_PANEL, parser=whole_number(MAX_GPUS_PER_NODE * MAX_NODES), metavar="N",
    help="HSDP: shard ZeRO-2/3 over groups of N data-parallel ranks and replicate across the groups (FSDP2 on a "
         "2D (replicate, shard) mesh; torchtitan's data_parallel_shard_degree). Needs --engine torch. Default: all "
         "data-parallel ranks.")]
LossOpt = Annotated[Optional[Loss], _choice_option(
    "--loss", Loss,
    help=f"{_choices(Loss)}: the whole B x T x V logits (transformers), per sequence chunk (torchtune "
         "CEWithChunkedOutputLoss), fused with the LM head (Liger; needs liger-kernel) or the cross-entropy under "
         "torch.compile (torchtitan's build_cross_entropy_loss). Default: standard.")]
InBackwardOpt = Annotated[Optional[bool], _option(
    "--optimizer-in-backward/--no-optimizer-in-backward", panel=SETUP_PANEL,
    help="Step each parameter in backward and free its gradient (torchtune optimizer_in_bwd): no gradient "
         "accumulation or clipping, one GPU. Default: off.")]
ActivationOffloadOpt = Annotated[Optional[bool], _option(
    "--activation-offload/--no-activation-offload", panel=SETUP_PANEL,
    help="Offload the tensors saved for backward to pinned CPU RAM (torchtune enable_activation_offloading; TRL / "
         "axolotl activation_offloading): the LM head's and the loss's stay. Best with --checkpointing full. "
         "Default: off.")]
CpuOffloadOptimizerOpt = Annotated[Optional[CpuOffloadOptimizer], _choice_option(
    "--cpu-offload-optimizer", CpuOffloadOptimizer,
    help=f"{_choices(CpuOffloadOptimizer)}: torchao.optim.CPUOffloadOptimizer on one GPU, the states and step on the "
         "host (on: offload_gradients=False; grads: True, no accumulation). Default: off.")]
KeepZeroedGradsOpt = Annotated[Optional[bool], _option(
    "--keep-zeroed-grads/--no-keep-zeroed-grads", panel=SETUP_PANEL,
    help="zero_grad(set_to_none=False): gradients zeroed, not freed, between steps, so they live through forward "
         "(torch < 2.0's default; the HF Trainer's model.zero_grad() then). Default: off (freed).")]
CompileOpt = Annotated[Optional[bool], _option(
    "--compile/--no-compile", panel=SETUP_PANEL,
    help="torch.compile each transformer block (torchtune compile: True, torchtitan [compile] enable): a block "
         "keeps what AOTAutograd's min-cut partitioner saves (traced on fake tensors). Default: off.")]
Float8Opt = Annotated[Optional[Float8], _choice_option(
    "--float8", Float8,
    help=f"{_choices(Float8)}: torchao float8 training on every Linear but the LM head (torchtitan "
         "--model.converters float8, [float8] recipe_name); needs a bf16 compute dtype. Default: off.")]
Float8AllGatherOpt = Annotated[Optional[bool], _option(
    "--float8-all-gather/--no-float8-all-gather", panel=SETUP_PANEL,
    help="FSDP2 all-gathers the float8 Linears' weights in float8, 1 B per element (torchtitan [float8] "
         "enable_fsdp_float8_all_gather): --engine torch, zero2/zero3, tensorwise. Default: off.")]

MethodOpt = Annotated[Optional[Method], _option(
    "--method", panel=SETUP_PANEL, parser=choice(Method), metavar="METHOD",
    help=f"What is trained: {_choices(Method)} (LoRA: peft adapters on a frozen base; QLoRA: on a 4-bit "
         "bitsandbytes base). Default: full.")]
LoraRankOpt = Annotated[Optional[int], _option(
    "--lora-rank", "-r", panel=SETUP_PANEL, parser=whole_number(65_536), metavar="R",
    help=f"LoRA rank (peft r). Default: {Finetune.rank}.")]
LoraAlphaOpt = Annotated[Optional[float], _option(
    "--lora-alpha", panel=SETUP_PANEL, metavar="ALPHA", help=f"LoRA alpha. Default: {Finetune.alpha:g}.")]
LoraDropoutOpt = Annotated[Optional[float], _option(
    "--lora-dropout", panel=SETUP_PANEL, parser=fraction, metavar="P",
    help=f"LoRA dropout (a new copy of each adapter input and its mask when > 0). Default: {Finetune.dropout:g}.")]
LoraTargetsOpt = Annotated[Optional[str], _option(
    "--lora-targets", panel=SETUP_PANEL, metavar="NAMES",
    help="peft target_modules: a comma list of Linear names (q_proj,v_proj), or all-linear. Default: peft's "
         "per-architecture default.")]
ModulesToSaveOpt = Annotated[Optional[str], _option(
    "--modules-to-save", panel=SETUP_PANEL, metavar="NAMES",
    help="peft modules_to_save: modules trained in full beside the adapters (e.g. lm_head,embed_tokens).")]
BaseOpt = Annotated[Optional[BaseWeights], _option(
    "--base", panel=SETUP_PANEL, parser=choice(BaseWeights), metavar="STORAGE",
    help=f"How the frozen base weights are stored: {_choices(BaseWeights)}. Default: the compute dtype for "
         "LoRA, nf4 for QLoRA.")]
DoubleQuantOpt = Annotated[Optional[bool], _option(
    "--double-quant/--no-double-quant", panel=SETUP_PANEL,
    help="QLoRA: quantize the 4-bit blocks' absmax too (bnb_4bit_use_double_quant). Default: on.")]

RsloraOpt = Annotated[Optional[bool], _option(
    "--rslora/--no-rslora", panel=SETUP_PANEL,
    help="peft use_rslora: scale the update by alpha / sqrt(r). Changes no memory. Default: off.")]

LoraRecipeOpt = Annotated[Optional[LoraRecipe], _option(
    "--lora-recipe", panel=SETUP_PANEL, parser=choice(LoraRecipe), metavar="RECIPE",
    help=f"Which library trains the adapters: {_choices(LoraRecipe)} (peft: fp32 adapters, fp32 embeddings / norms "
         "/ head on a quantized base; torchtune: everything in the model's dtype, torchao NF4 base). Default: peft.")]

KbitPrepOpt = Annotated[Optional[bool], _option(
    "--kbit-prep/--no-kbit-prep", panel=SETUP_PANEL,
    help="QLoRA under peft: whether prepare_model_for_kbit_training upcasts the embeddings, norms and head to fp32 "
         "(an fp32 residual stream). --no-kbit-prep: they stay in the compute dtype, as Answer.AI's fsdp_qlora, "
         "LitGPT, axolotl, LLaMA-Factory and TRL >= 0.27 run it. Default: on (peft's recipe).")]

DoraOpt = Annotated[Optional[bool], _option(
    "--dora/--no-dora", panel=SETUP_PANEL,
    help="peft use_dora: weight-decomposed LoRA (a magnitude vector per adapted Linear, the weight norm "
         "recomputed each forward). Default: off.")]

KeepOpt = Annotated[Optional[frozenset], _option(
    "--keep", panel=SETUP_PANEL, parser=keep_fields, metavar="FIELDS",
    help="Pin these fields (comma list: " + ", ".join(n for n in KEEP_NAMES if n not in ("zero", "batch"))
         + "): the plan never changes them and says which rung it passed over for that. Without --keep, "
         "options you give are changed only when nothing else fits, and the step says why.")]

JsonOpt = Annotated[bool, _option("--json", panel=OUTPUT_PANEL,
                                  help="Print JSON only (sizes as integer bytes), for scripts.")]
VerboseOpt = Annotated[bool, _option("--verbose", "-v", panel=OUTPUT_PANEL,
                                     help="Show each term's formula and source.")]


@dataclass(frozen=True)
class SetupOptions:
    """What the user gave on the command line; None where an option was not given."""

    gpu: GPU | None = None
    gpus: int | None = None
    nodes: int | None = None
    cpu_ram: int | None = None
    margin: float | None = None
    batch: int | None = None
    seq: int | None = None
    target_len: int | None = None
    image_size: int | None = None
    padding: Padding | None = None
    longest_sample: int | None = None
    accum: int | None = None
    precision: Precision | None = None
    optimizer: Optimizer | None = None
    checkpointing: Checkpointing | None = None
    attention: Attention | None = None
    zero: Sharding | None = None
    offload: Offload | None = None
    engine: Engine | None = None
    tp: int | None = None
    sequence_parallel: bool | None = None
    pp: int | None = None
    pp_schedule: PipelineSchedule | None = None
    pp_virtual_stages: int | None = None
    dp_shard: int | None = None
    cp: int | None = None
    cp_rotate: CpRotate | None = None
    loss: Loss | None = None
    optimizer_in_backward: bool | None = None
    keep_zeroed_grads: bool | None = None
    activation_offload: bool | None = None
    cpu_offload_optimizer: CpuOffloadOptimizer | None = None
    compile: bool | None = None
    float8: Float8 | None = None
    float8_all_gather: bool | None = None
    method: Method | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: str | None = None
    modules_to_save: str | None = None
    base: BaseWeights | None = None
    double_quant: bool | None = None
    rslora: bool | None = None
    dora: bool | None = None
    lora_recipe: LoraRecipe | None = None
    kbit_prep: bool | None = None
    ep: int | None = None
    capacity_factor: float | None = None
    task: str | None = None
    num_labels: int | None = None
    keep: frozenset[str] | None = None
    """TrainingSetup fields pinned with --keep (planning commands only)."""
    config: tuple[str, ...] | None = None
    """--config files, as given."""
    reading: Any = field(default=None, compare=False)
    """The memfit.readers.ConfigReading of --config, once read (with_config)."""

    @property
    def margin_fraction(self) -> float:
        return DEFAULT_MARGIN if self.margin is None else self.margin

    def with_task(self, spec: ModelSpec) -> ModelSpec:
        """`spec` as --task / --num-labels ask (memfit.sources.task); unchanged when neither was given."""
        if self.task is None and self.num_labels is None:
            return spec
        from ..sources.task import SEQUENCE_CLASSIFICATION, with_task

        return with_task(spec, self.task or SEQUENCE_CLASSIFICATION, self.num_labels or 2)

    def resolve(self, model: str) -> tuple[ModelSpec, TrainingSetup, Hardware]:
        """(ModelSpec, TrainingSetup, Hardware) for MODEL (a catalog name, config.json or hub id) and these
        options: what every sizing command and the page compute from."""
        from ..sources import resolve_model

        spec = self.with_task(resolve_model(model))
        hardware = self.hardware()
        return spec, self.setup(spec, hardware), hardware

    def hardware(self) -> Hardware:
        return make_hardware(self.gpu or DEFAULT_GPU, gpus_per_node=self.gpus or 1, num_nodes=self.nodes or 1,
                             cpu_ram=self.cpu_ram)

    def setup(self, spec: ModelSpec, hardware: Hardware) -> TrainingSetup:
        """The TrainingSetup the options describe; defaults are a typical fine-tune, stated in `notes`."""
        from ..api import typical_setup

        try:
            return typical_setup(spec, hardware, **self._setup_fields())
        except ConfigError as error:
            if self.reading is None:
                raise
            files = ", ".join(f.path for f in self.reading.files)
            raise ConfigError(f"{error} (with the setup read from {files}; an option overrides a field)") from None

    def with_config(self) -> "SetupOptions":
        """These options with the --config files' fields filled in where no option was given (so they count as
        given), and `reading` set; unchanged without --config."""
        paths = [part.strip() for item in (self.config or ()) for part in str(item).split(",") if part.strip()]
        if not paths:
            return self
        from ..readers import read_config

        given = {name: value for name, value in self._setup_fields().items() if value is not None}
        overridden = {field: _OPTION_OF_FIELD[field] for field in given}
        world = None
        if self.gpus is not None or self.nodes is not None:
            overridden["num_gpus"] = "--gpus" if self.gpus is not None else "--nodes"
            world = (self.gpus or 1) * (self.nodes or 1)
        reading = read_config(*paths, num_gpus=world, overridden=overridden)
        fill: dict[str, Any] = {name: reading.overrides[field] for name, field in _FIELD_OF_OPTION.items()
                                if getattr(self, name) is None and field in reading.overrides}
        if "finetune" in reading.overrides and self.finetune() is None:
            fill.update(_finetune_options(reading.overrides["finetune"]))
        if world is None and "num_gpus" in reading.overrides:
            per_node, nodes = reading.layout()
            fill.update(gpus=per_node, nodes=nodes if nodes > 1 else None)
        return replace(self, reading=reading, **fill)

    def _setup_fields(self) -> dict[str, Any]:
        return dict(micro_batch_size=self.batch, seq_len=self.seq, grad_accum_steps=self.accum,
                    precision=self.precision, optimizer=self.optimizer, checkpointing=self.checkpointing,
                    attention=self.attention, sharding=self.zero, offload=self.offload, engine=self.engine,
                    tp=self.tp, sequence_parallel=self.sequence_parallel, finetune=self.finetune(),
                    expert_parallel=self.ep, capacity_factor=self.capacity_factor, loss=self.loss,
                    optimizer_in_backward=self.optimizer_in_backward, activation_offload=self.activation_offload,
                    cpu_offload_optimizer=self.cpu_offload_optimizer,
                    keep_zeroed_grads=self.keep_zeroed_grads,
                    pp=self.pp, pp_schedule=self.pp_schedule,
                    pp_virtual_stages=self.pp_virtual_stages, dp_shard=self.dp_shard,
                    cp=self.cp, cp_rotate=self.cp_rotate, target_len=self.target_len,
                    image_size=self.image_size, compile=self.compile, padding=self.padding,
                    longest_sample_len=self.longest_sample, float8=self.float8,
                    float8_all_gather=self.float8_all_gather, **self._read_only_fields())

    def _read_only_fields(self) -> dict[str, Any]:
        """Setup fields only a --config file sets (no option spells them): DeepSpeed's ZeRO buffer sizes."""
        if self.reading is None:
            return {}
        return {name: self.reading.overrides[name] for name in _READ_ONLY_FIELDS if name in self.reading.overrides}

    def finetune(self) -> Finetune | None:
        """The Finetune the --method / --lora-* / --base options describe (None when none was given). LoRA
        options without --method mean LoRA (QLoRA when --base is quantized)."""
        given = {name: value for name, value in (
            ("rank", self.lora_rank), ("alpha", self.lora_alpha), ("dropout", self.lora_dropout),
            ("targets", self.lora_targets), ("modules_to_save", self.modules_to_save), ("base", self.base),
            ("double_quant", self.double_quant), ("rslora", self.rslora), ("dora", self.dora),
            ("recipe", self.lora_recipe), ("kbit_prep", self.kbit_prep)) if value is not None}
        if self.method is None and not given:
            return None
        method = self.method
        if method is None:
            method = Method.QLORA if given.get("base") is not None and given["base"].four_bit else Method.LORA
        if method is Method.FULL and given:
            raise ConfigError(f"{', '.join('--' + n.replace('_', '-') for n in given)} set LoRA details: "
                              "add --method lora (or qlora)")
        return Finetune(method=method, **given)

    @property
    def explicit(self) -> frozenset[str]:
        """The TrainingSetup fields given on the command line (--gpus / --nodes set num_gpus)."""
        given = {name for name, value in self._setup_fields().items() if value is not None}
        if self.gpus is not None or self.nodes is not None:
            given.add("num_gpus")
        return frozenset(given)


_READ_ONLY_FIELDS = ("zero_knobs",)


def _finetune_options(ft: Finetune) -> dict[str, Any]:
    """The --method / --lora-* option values that give `ft` (a Finetune read from a config file)."""
    out: dict[str, Any] = {"method": ft.method}
    if ft.adapters:
        out.update(lora_rank=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout, base=ft.base,
                   double_quant=ft.double_quant, rslora=ft.rslora, dora=ft.dora, lora_recipe=ft.recipe,
                   kbit_prep=ft.kbit_prep,
                   lora_targets=",".join(ft.targets) or None,
                   modules_to_save=",".join(ft.modules_to_save) or None)
    return out


_FIELD_OF_OPTION = {"batch": "micro_batch_size", "seq": "seq_len", "accum": "grad_accum_steps",
                    "precision": "precision", "optimizer": "optimizer", "checkpointing": "checkpointing",
                    "attention": "attention", "zero": "sharding", "offload": "offload", "engine": "engine",
                    "tp": "tp", "sequence_parallel": "sequence_parallel", "ep": "expert_parallel",
                    "capacity_factor": "capacity_factor", "loss": "loss", "optimizer_in_backward": "optimizer_in_backward",
                    "activation_offload": "activation_offload",
                    "cpu_offload_optimizer": "cpu_offload_optimizer",
                    "pp": "pp", "pp_schedule": "pp_schedule", "pp_virtual_stages": "pp_virtual_stages",
                    "dp_shard": "dp_shard", "cp": "cp", "cp_rotate": "cp_rotate",
                    "target_len": "target_len", "image_size": "image_size", "compile": "compile",
                    "padding": "padding", "longest_sample": "longest_sample_len",
                    "keep_zeroed_grads": "keep_zeroed_grads", "float8": "float8",
                    "float8_all_gather": "float8_all_gather"}
_OPTION_OF_FIELD = {**{field: f"--{name}" for name, field in _FIELD_OF_OPTION.items()}, "finetune": "--method",
                    "target_len": "--target-len", "image_size": "--image-size",
                    "longest_sample_len": "--longest-sample", "float8_all_gather": "--float8-all-gather"}

_SHARED_OPTIONS: dict[str, object] = {  # in --help order: the training setup panel, then the hardware panel
    "config": ConfigOpt,
    "batch": BatchOpt, "seq": SeqOpt, "padding": PaddingOpt, "longest_sample": LongestSampleOpt,
    "target_len": TargetOpt, "image_size": ImageSizeOpt, "accum": AccumOpt, "precision": PrecisionOpt, "optimizer": OptimizerOpt,
    "checkpointing": CheckpointingOpt, "attention": AttentionOpt, "zero": ZeroOpt, "offload": OffloadOpt,
    "engine": EngineOpt, "tp": TpOpt, "sequence_parallel": SequenceParallelOpt, "pp": PpOpt,
    "pp_schedule": PpScheduleOpt, "pp_virtual_stages": PpVirtualStagesOpt, "dp_shard": DpShardOpt, "cp": CpOpt,
    "cp_rotate": CpRotateOpt, "loss": LossOpt,
    "optimizer_in_backward": InBackwardOpt, "keep_zeroed_grads": KeepZeroedGradsOpt,
    "activation_offload": ActivationOffloadOpt,
    "cpu_offload_optimizer": CpuOffloadOptimizerOpt,
    "compile": CompileOpt, "float8": Float8Opt, "float8_all_gather": Float8AllGatherOpt,
    "method": MethodOpt, "lora_rank": LoraRankOpt, "lora_alpha": LoraAlphaOpt, "lora_dropout": LoraDropoutOpt,
    "lora_targets": LoraTargetsOpt, "modules_to_save": ModulesToSaveOpt, "base": BaseOpt,
    "double_quant": DoubleQuantOpt, "rslora": RsloraOpt, "dora": DoraOpt, "lora_recipe": LoraRecipeOpt,
    "kbit_prep": KbitPrepOpt, "ep": EpOpt, "capacity_factor": CapacityOpt,
    "gpu": GpuOpt, "gpus": GpusOpt, "nodes": NodesOpt, "cpu_ram": CpuRamOpt, "margin": MarginOpt,
    "task": TaskOpt, "num_labels": NumLabelsOpt,
}
_PLANNING_OPTIONS: dict[str, object] = {"keep": KeepOpt}
"""Options only the commands that walk the ladder take."""
_PLANNING_COMMANDS = frozenset({"plan_command"})


def option_parameters(*, planning: bool = False) -> list[inspect.Parameter]:
    """The shared options (and, with `planning`, --keep) as keyword parameters, in --help order: what
    with_setup_options adds to a command, and the fields of `memfit serve`'s form."""
    options = {**_SHARED_OPTIONS, **(_PLANNING_OPTIONS if planning else {})}
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
            for name, annotation in options.items()]


def with_setup_options(command: Callable) -> Callable:
    """Replace the command's `opts: SetupOptions` parameter by the shared options, and call it with them collected
    into a SetupOptions. Typer reads the signature, so `--help` lists the options in their panels."""
    signature = inspect.signature(command)
    names = list(signature.parameters)
    if "opts" not in names:
        raise TypeError(f"{command.__name__} needs an `opts: SetupOptions` parameter")
    at = names.index("opts")
    before = [p.replace(annotation=OptionalModelArg, default=None) if _is_model_argument(p) else p
              for p in list(signature.parameters.values())[:at]]
    positional_model = any(_is_model_argument(p) for p in list(signature.parameters.values())[:at])
    after = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in list(signature.parameters.values())[at + 1:]]
    shared = option_parameters(planning=command.__name__ in _PLANNING_COMMANDS)
    options = [p.name for p in shared]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with hidden(bool(kwargs.get("json_output"))):  # --json: stdout is for scripts, keep stderr clean too
            return _run(*args, **kwargs)

    def _run(*args, **kwargs):
        collected = {name: kwargs.pop(name) for name in options}
        if collected.get("config") is not None:
            collected["config"] = tuple(collected["config"]) or None
        opts = SetupOptions(**collected).with_config()
        reading = opts.reading
        if "model" in kwargs and kwargs["model"] is None and reading is not None and reading.model:
            kwargs["model"] = reading.model
        if positional_model and kwargs.get("model") is None:
            raise ConfigError("Missing argument 'MODEL': give a model (a catalog name, a config.json or a hub id), "
                              "or a --config that names one")
        if reading is None:
            return command(*args, opts=opts, **kwargs)
        return _run_with_reading(command, args, kwargs, opts)

    wrapper.__signature__ = signature.replace(parameters=before + shared + after)
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}
    return wrapper


def _is_model_argument(parameter: inspect.Parameter) -> bool:
    return parameter.name == "model" and (parameter.annotation is ModelArg or parameter.annotation == "ModelArg")


def _run_with_reading(command: Callable, args: tuple, kwargs: dict, opts: SetupOptions):
    """Run the command, then say what --config read: in --json under "config" (the command's object, captured
    from stdout), else a short section after the output (on stderr when stdout carries CSV or Markdown). A command
    that fails prints nothing from the reading, so a mistake stays one error line."""
    if kwargs.get("json_output"):
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                result = command(*args, opts=opts, **kwargs)
        except typer.Exit:
            _emit_json(buffer.getvalue(), opts.reading)
            raise
        _emit_json(buffer.getvalue(), opts.reading)
        return result
    machine = str(getattr(kwargs.get("format_"), "value", kwargs.get("format_") or "")) in ("csv", "markdown")
    try:
        result = command(*args, opts=opts, **kwargs)
    except typer.Exit:
        typer.echo("\n".join(config_section(opts.reading)), err=machine)
        raise
    typer.echo("\n".join(config_section(opts.reading)), err=machine)
    return result


def _emit_json(text: str, reading) -> None:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        typer.echo(text, nl=False)
        return
    full = reading.to_dict()
    data["config"] = {key: full[key] for key in ("files", "model", "read", "ignored")}
    typer.echo(json.dumps(data, indent=2))


def config_section(reading, width: int | None = None) -> list[str]:
    """What --config read and what it left out, for the end of a command's output."""
    from ..readers import NOT_RELEVANT, NOT_SIZED

    width = width or max(60, min(100, int(os.environ.get("COLUMNS", "80") or 80)))

    def wrap(text: str, indent: str = "  ") -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + "    ",
                             break_on_hyphens=False)

    files = "; ".join(f"{f.path} ({f.format}{', named by ' + f.via if f.via else ''})" for f in reading.files)
    lines = ["", *textwrap.wrap(f"Read from --config: {files}", width=width)]
    for entry in reading.read:
        if entry.sets:
            lines += wrap(entry.text)
    deferred = [e.field for e in reading.read if not e.sets]
    if deferred:
        lines += wrap("read, set nothing themselves ('auto', or another field decides): " + ", ".join(deferred))
    quiet = [e for e in reading.ignored if e.why.startswith((NOT_RELEVANT, "off"))]
    loud: dict[str, list[str]] = {}
    for entry in reading.ignored:
        if entry not in quiet:
            loud.setdefault(entry.why, []).append(entry.field)
    if loud:
        lines.append(f"Ignored ({NOT_SIZED}, or nothing to shard):")
        for why, names in loud.items():
            lines += wrap(f"{', '.join(dict.fromkeys(names))}: {why}")
    if quiet:
        lines += wrap("not memory-relevant or off: " + ", ".join(dict.fromkeys(e.field for e in quiet)), indent="")
    return lines


ReportOpt = Annotated[Optional[Path], _option(
    "--report", panel=OUTPUT_PANEL, metavar="FILE.html",
    help="Also write a self-contained HTML report (charts work offline).")]
PngOpt = Annotated[Optional[Path], _option(
    "--png", panel=OUTPUT_PANEL, metavar="FILE.png", help="Also write the report's charts as a PNG image.")]
