"""memfit's analytic estimate against published, measured GPU figures (the calibration set in shared/gpu-published).

    python bench/gpu_published.py                      # prints the report, writes bench/results/gpu_published.md
    python bench/gpu_published.py --points PATH --out FILE [--json FILE]

Every in-scope point (`normalized.in_scope`) is mapped from its normalized setup to a memfit TrainingSetup and
Hardware, or reported as "not expressible: <feature>" (the roadmap), and each expressible one is predicted on the
metric its source measured:

- allocated / active (max_memory_allocated, torchtune's "peak memory active", PEFT's tracemalloc): memfit's
  allocated figure (`MemoryEstimate.allocated_bytes`: tensors + the caching allocator's rounding + cuBLAS
  workspaces);
- reserved (max_memory_reserved): memfit's reserved figure (`MemoryEstimate.reserved_bytes`: + the segments the
  allocator replay holds unused at the peak);
- nvml (nvidia-smi "used", the whole device): memfit's device-used figure (`MemoryEstimate.device_used_bytes`:
  + CUDA context and NCCL buffers, outside the allocator).

Nothing is fitted to the points: the device constants are memfit's (data/cuda_runtime.json). The settings taken
from a point's software era: a source dated before PyTorch 1.13 (Nov 2022, which made CUDA lazy module loading the
default) runs with `cuda_runtime="legacy"` (every kernel loaded into the context); one dated before PyTorch 2.0
(Mar 2023, which made zero_grad(set_to_none=True) the default) keeps its gradients zeroed between steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POINTS = "../shared/gpu-published/points.jsonl"
"""Relative to the repository root."""
DEFAULT_OUT = "bench/results/gpu_published.md"

from memfit.diagnose import cache_freed_at_limit, diagnose  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.finetune import BaseWeights, Finetune, Method  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import GPU, Hardware, get_gpu, make_hardware  # noqa: E402
import memfit.techniques  # noqa: E402,F401  (registers the technique sections: activation_offload)
from memfit.choices import Float8  # noqa: E402
from memfit.setup import (Attention, Checkpointing, Engine, Loss, Offload, Optimizer, Padding,  # noqa: E402
                          Precision, Sharding, TrainingSetup)
from memfit.sources import resolve_model  # noqa: E402
from memfit.sources.task import SEQUENCE_CLASSIFICATION, with_task  # noqa: E402
from memfit.units import GiB  # noqa: E402

# Which memfit figure each measured metric is compared with (metric_group -> (figure key, description)).
FIGURES = {
    "allocated": ("allocated", "allocated (MemoryEstimate.allocated_bytes: tensors + allocator rounding + cuBLAS "
                               "workspaces)"),
    "reserved": ("reserved", "reserved (MemoryEstimate.reserved_bytes: allocated + the segments the caching-allocator "
                             "replay holds unused at the peak)"),
    "nvml": ("device_used", "device used (MemoryEstimate.device_used_bytes: reserved + CUDA context + NCCL, outside "
                            "the allocator)"),
}
OUTSIDE_ALLOCATOR = ("overhead/cuda_context", "overhead/nccl")
_DEFAULT_HW = make_hardware("A100-80GB")
_CONTEXT = _DEFAULT_HW.device.cuda_context_bytes
_LEGACY = make_hardware("A100-80GB", cuda_runtime="legacy").device.cuda_context_bytes
LAZY_LOADING_SINCE = "2022-11"
"""PyTorch 1.13 (released 2022-10-28) sets CUDA_MODULE_LOADING=LAZY by default (pytorch/pytorch#86509)."""

PRECISIONS = {"fp32": Precision.FP32, "amp_fp16": Precision.AMP_FP16, "amp_bf16": Precision.AMP_BF16,
              "pure_bf16": Precision.BF16, "bf16_master": Precision.BF16_MASTER}

# Roadmap features, in the order the report lists them.
LORA, QLORA = "LoRA", "QLoRA (quantised base weights)"
TP, CP, PP, HSDP = "tensor parallelism", "context parallelism", "pipeline parallelism", "HSDP (replicated shards)"
CHUNKED = "chunked cross-entropy"
OPT_IN_BWD = "optimizer in backward"
ACT_OFFLOAD = "activation offload"
COMPILE = "torch.compile"
FP8 = "float8 linears"
SELECTIVE = "selective activation checkpointing"
PAGED = "paged optimizer state (CUDA unified memory, outside the allocator)"
ZERO_ONE_PROCESS = "ZeRO / offload on a single process"
NOT_IN_CATALOG = "model not in the catalog"
MODEL_DIFFERS = "model numbers differ from the catalog entry"
SEQ_UNKNOWN = "sequence length unknown"
CLASSIFIER = "classification head of a model memfit builds no classifier for"
OTHER = "other"


@dataclass
class Mapped:
    """One point as memfit sees it: the setup and hardware it maps to, what it cannot express, what it approximates."""

    point: dict
    setup: TrainingSetup | None = None
    hardware: Hardware | None = None
    spec: object = None
    missing: list[tuple[str, str]] = field(default_factory=list)
    """(feature, detail): what memfit cannot express; empty = expressible."""
    approx: list[str] = field(default_factory=list)
    """Where the mapping approximates the source (included in the statistics, flagged)."""
    assumed: list[str] = field(default_factory=list)
    """Defaults filled in where the source says nothing."""

    @property
    def norm(self) -> dict:
        return self.point["normalized"]

    @property
    def pid(self) -> str:
        return self.norm["id"]

    @property
    def expressible(self) -> bool:
        return not self.missing and self.setup is not None

    @property
    def features(self) -> list[str]:
        return list(dict.fromkeys(f for f, _ in self.missing))

    def reason(self) -> str:
        return "; ".join(f"{f} ({d})" if d else f for f, d in self.missing)


# ------------------------------------------------------------------------------------------------------ loading


def points_path(text: str | None) -> Path:
    path = Path(text or DEFAULT_POINTS)
    return path if path.is_absolute() else (REPO / path).resolve()


def load_points(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def in_scope(points: list[dict]) -> list[dict]:
    return [p for p in points if p.get("normalized", {}).get("in_scope")]


# ------------------------------------------------------------------------------------------------------ mapping


def map_point(point: dict) -> Mapped:
    """The normalized setup of one point -> TrainingSetup + Hardware (the nearest one even when something is
    missing, so a roadmap feature can be sized), with every feature memfit cannot express named."""
    m = Mapped(point)
    n = m.norm
    _map_model(m, n.get("model") or {})
    fields = {}
    fields.update(_map_batch(m, n.get("batch") or {}))
    fields.update(_map_precision(m, n.get("precision") or {}, n.get("parallel") or {}))
    fields.update(_map_optimizer(m, n.get("optimizer") or {}))
    fields.update(_map_checkpointing(m, n.get("checkpointing")))
    fields.update(_map_attention(m, n.get("attention")))
    fields.update(_map_loss(m, n.get("loss")))
    fields.update(_map_flags(m, n))
    fields.update(_map_zero_grad(m, point))
    parallel = _map_parallel(m, n.get("parallel") or {}, n.get("offload") or {})
    fields.update(parallel)
    if m.spec is None or "seq_len" not in fields:
        return m
    try:
        m.setup = TrainingSetup(**fields)
    except MemfitError as error:
        m.missing.append((OTHER, str(error)))
        return m
    m.hardware = _hardware(m, n.get("gpu") or {}, m.setup.num_gpus, cuda_runtime(point))
    return m


SET_TO_NONE_SINCE = "2023-03"
"""PyTorch 2.0 (2023-03-15) made zero_grad(set_to_none=True) the default of Module and Optimizer
(pytorch/pytorch#92731); before it the gradients were zeroed and kept between steps."""


def _map_zero_grad(m: Mapped, point: dict) -> dict:
    """A source dated before PyTorch 2.0 zeroes its gradients and keeps them (the HF Trainer's model.zero_grad(),
    an Optimizer.zero_grad() with torch 1.x's default set_to_none=False): they live through each forward."""
    date = str(point.get("source_date") or "")[:7]
    if not date or date >= SET_TO_NONE_SINCE:
        return {}
    m.assumed.append("gradients kept zeroed between steps (zero_grad's set_to_none=False default before PyTorch 2.0)")
    return {"keep_zeroed_grads": True}


def cuda_runtime(point: dict) -> str:
    """'legacy' (every kernel loaded into the context) for a source dated before lazy loading became PyTorch's
    default, else 'lazy'."""
    date = str(point.get("source_date") or "")[:7]
    return "legacy" if date and date < LAZY_LOADING_SINCE else "lazy"


def _map_model(m: Mapped, model: dict) -> None:
    key = model.get("key")
    if not key:
        m.missing.append((NOT_IN_CATALOG, "no model"))
        return
    try:
        spec = resolve_model(key)
    except MemfitError:
        m.missing.append((NOT_IN_CATALOG, key))
        return
    if spec.source != "catalog":
        m.missing.append((NOT_IN_CATALOG, key))
        return
    checks = (("layers", spec.num_layers), ("hidden", spec.hidden_size), ("heads", spec.num_attention_heads),
              ("kv_heads", spec.num_kv_heads), ("intermediate", spec.intermediate_size), ("vocab", spec.vocab_size))
    differ = [f"{name} {model[name]} vs {ours}" for name, ours in checks
              if model.get(name) is not None and model[name] != ours]
    if differ:
        m.missing.append((MODEL_DIFFERS, f"{spec.name}: " + ", ".join(differ)))
        return
    m.spec = spec


def _map_batch(m: Mapped, batch: dict) -> dict:
    out = {}
    micro = batch.get("micro_batch")
    # memfit's seq_len is the whole sequence: context parallelism divides it by cp itself
    # (memfit.estimate.context_parallel.rank_setup), so seq_len_per_gpu (seq / cp) would divide it twice
    seq = batch.get("seq_len") or batch.get("seq_len_per_gpu")
    if micro is None:
        m.missing.append((OTHER, "micro-batch unknown"))
    else:
        out["micro_batch_size"] = int(micro)
    if seq is None:
        m.missing.append((SEQ_UNKNOWN, batch.get("seq_note") or ""))
    else:
        out["seq_len"] = int(seq)
        kind = batch.get("seq_len_kind") or ""
        if kind.startswith("variable"):
            out.update(_variable_length(m, int(seq)))
    accum = batch.get("grad_accum")
    if accum is None:
        m.assumed.append("no gradient accumulation (not stated)")
    out["grad_accum_steps"] = int(accum or 1)
    return out


TORCHTUNE_TYPICAL_STEP = 512
"""Tokens a typical alpaca batch of torchtune's padded to (its longer sample): alpaca's examples are short (a split's
dataset card, disham993/alpaca-train-validation-test-split: 33.4 MB for 36,401 examples over all four text fields,
under 1 KB an example), the longest about 1.3K tokens (the point's note). memfit's Llama-3.2-3B figure is the same
for every batch up to ~750 tokens (the step then peaks at the end of backward, not in its activations)."""


def _variable_length(m: Mapped, longest: int) -> dict:
    """Batches padded to their longest sample: memfit sizes a run's peak at the batch holding the longest sample
    (padding longest, memfit.estimate.padding). torchtune, though, logs each step's own peak: its get_memory_stats
    resets the peak statistics at every log (torchtune/training/memory.py, reset_stats=True), so its figure is one
    logged step's, a typical batch's, not the run's longest."""
    if m.norm["id"] in TORCHTUNE_TABLE:  # the Nov 2024 recipe, whose get_memory_stats resets (checked there)
        m.approx.append(f"torchtune logs each step's own peak (get_memory_stats resets the peak statistics at every "
                        f"log): one typical alpaca step, sized at 2 x {TORCHTUNE_TYPICAL_STEP} (the same figure for "
                        f"any batch up to ~750 tokens); the run's longest batch ({longest} tokens, --padding longest "
                        f"--longest-sample {longest}) would peak higher")
        return {"seq_len": TORCHTUNE_TYPICAL_STEP}
    m.approx.append(f"padded to each batch's longest sample: the run peaks at the batch with the longest, {longest}")
    return {"padding": Padding.LONGEST, "longest_sample_len": longest}


def _map_precision(m: Mapped, precision: dict, parallel: dict) -> dict:
    kind = precision.get("kind")
    if kind == "fsdp2_mp_bf16":
        # FSDP2 MixedPrecisionPolicy(param=bf16, reduce=fp32) over fp32 shards: memfit's bf16-master on engine torch
        # (the fp32 shard is the master copy; memfit.estimate.static._torch_layout)
        return {"precision": Precision.BF16_MASTER}
    if kind in PRECISIONS:
        return {"precision": PRECISIONS[kind]}
    m.missing.append((OTHER, f"precision {kind}"))
    return {}


def _map_optimizer(m: Mapped, opt: dict) -> dict:
    name, impl = (opt.get("name") or ""), str(opt.get("impl") or "")
    in_backward = {"optimizer_in_backward": True} if opt.get("in_backward") else {}
    if not in_backward and "optimizer_in_backward" in (m.norm.get("techniques") or ()):
        m.assumed.append("optimizer in backward, as the point's techniques say (the README's table is cumulative: "
                         "only the LoRA rows drop it)")
        in_backward = {"optimizer_in_backward": True}
    return {**_map_optimizer_kind(m, name, impl, opt), **in_backward}


def _map_optimizer_kind(m: Mapped, name: str, impl: str, opt: dict) -> dict:
    if name in ("adamw_8bit", "adam_8bit"):
        if m.norm["id"] == "P019":
            m.assumed.append("a non-paged 8-bit AdamW (the source names no implementation): its states are in the "
                             "measured active bytes, P019 being 4.2 GiB below P018 where a paged one (states outside "
                             "the allocator) would be 12 GiB below it, the bf16 states P018 holds")
            return {"optimizer": Optimizer.ADAMW_8BIT}
        if opt.get("paged") or "paged" in impl.lower():
            # bitsandbytes PagedAdamW8bit: memfit puts its large states outside the allocator (unified memory)
            return {"optimizer": Optimizer.PAGED_ADAMW_8BIT}
        return {"optimizer": Optimizer.ADAMW_8BIT}
    if name == "adafactor":
        return {"optimizer": Optimizer.ADAFACTOR}
    if name in ("adamw", "adam"):
        if "bnb" in impl:
            if "paged" in impl.lower() or opt.get("paged"):
                return {"optimizer": Optimizer.PAGED_ADAMW}
            m.missing.append((OTHER, f"optimizer impl {impl}"))
        if opt.get("fused"):
            return {"optimizer": Optimizer.ADAMW_FUSED}
        if "transformers" in impl or "for-loop" in impl:
            # transformers' own AdamW (adamw_hf) steps one parameter at a time, like foreach=False
            return {"optimizer": Optimizer.ADAMW}
        if m.norm["source"] == "pytorch/torchtune" and m.norm["id"] in TORCHTUNE_TABLE:
            m.assumed.append("torch AdamW without foreach's parameter-sized temporaries (fused)" + (
                ": this table's P012 and P016 measured 25.5 and 24.9 GiB, below the 29.9 GiB any foreach step of "
                "this model needs (parameters, gradients, states and the P x 2 B _foreach_sqrt list alive at once)"
                if m.norm["id"] == "P016" else ", see P016"))
            return {"optimizer": Optimizer.ADAMW_FUSED}
        m.assumed.append("torch AdamW with its CUDA default (foreach)")
        return {"optimizer": Optimizer.ADAMW_FOREACH}
    if name == "sgd":
        return {"optimizer": Optimizer.SGD}
    m.missing.append((OTHER, f"optimizer {name or 'unknown'}"))
    return {}


TORCHTUNE_TABLE = tuple(f"P{i:03d}" for i in range(12, 22))
"""torchtune's README 'Optimization flags' table (Llama 3.2 3B, one recipe config, techniques added row by row)."""


def _map_checkpointing(m: Mapped, ckpt) -> dict:
    if ckpt in (None, "none"):
        if ckpt is None:
            m.assumed.append("no checkpointing (not stated)")
        return {"checkpointing": Checkpointing.NONE}
    if ckpt == "full":
        return {"checkpointing": Checkpointing.FULL}
    if str(ckpt) in ("selective_op", "selective-op"):  # torchtitan's op-level SAC policy
        return {"checkpointing": Checkpointing.SELECTIVE_OP}
    if str(ckpt).startswith("selective"):
        m.missing.append((SELECTIVE, f"{ckpt}; nearest: full"))
        return {"checkpointing": Checkpointing.FULL}
    m.missing.append((OTHER, f"checkpointing {ckpt}"))
    return {}


def _map_attention(m: Mapped, attention) -> dict:
    if attention == "eager":
        return {"attention": Attention.EAGER}
    if attention is None:
        m.assumed.append("sdpa attention (not stated)")
        return {"attention": Attention.SDPA}
    if attention in ("sdpa", "flash_attn2", "flash_attention_2", "flash"):
        return {"attention": Attention.SDPA}
    m.missing.append((OTHER, f"attention {attention}"))
    return {}


def _map_loss(m: Mapped, loss) -> dict:
    if loss in (None, "full_logits_ce"):
        return {}
    if loss == "chunked_ce":  # torchtune CEWithChunkedOutputLoss
        return {"loss": Loss.CHUNKED}
    if loss == "classification_head":  # AutoModelForSequenceClassification: memfit.sources.task
        if m.spec is not None:
            try:
                m.spec = with_task(m.spec, SEQUENCE_CLASSIFICATION, int(m.norm["model"].get("num_labels") or 2))
            except MemfitError as error:  # e.g. a vision classifier: memfit builds text classifiers only
                m.missing.append((CLASSIFIER, str(error)))
                m.spec = None
    else:
        m.missing.append((OTHER, f"loss {loss}"))
    return {}


_LORA_TARGETS = {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",),
                 "mlp": ("gate_proj", "up_proj", "down_proj"), "lm_head": ("lm_head",), "qkv": ("query_key_value",)}
"""The points' target shorthands -> the HF module names memfit's LoRA graph uses (torchtune's q_proj / v_proj /
output_proj and apply_lora_to_mlp / apply_lora_to_output, peft's target_modules)."""
_T5_TARGETS = {"q": ("q",), "v": ("v",), "k": ("k",), "o": ("o",)}
_BASES = {"torchao_nf4": BaseWeights.NF4, "bnb_nf4": BaseWeights.NF4}


def _map_lora(m: Mapped, lora: dict) -> dict:
    """The point's LoRA / QLoRA setup as a memfit Finetune: method, rank, alpha, dropout, targets and base as the
    source states them (unstated: peft's defaults, said in `assumed`)."""
    if lora.get("r") is None:
        m.missing.append((LORA, "rank and targets not stated"))
        return {}
    quant = lora.get("base_quant")
    if quant and quant not in _BASES:
        m.missing.append((QLORA, f"base {quant}"))
        return {}
    # torchtune's LoRALinear (adapters in the model dtype, nothing upcast, a torchao NF4 base), not peft's
    recipe = "torchtune" if m.norm.get("source") == "pytorch/torchtune" else "peft"
    if quant == "torchao_nf4" and recipe != "torchtune":
        m.missing.append((QLORA, "a torchao NF4 base outside torchtune's recipe"))
        return {}
    table = _T5_TARGETS if m.spec is not None and m.spec.model_type == "t5" else _LORA_TARGETS
    targets: list[str] = []
    for short in lora.get("targets") or ():
        if short not in table:
            m.missing.append((LORA, f"target {short}"))
            return {}
        targets += table[short]
    if not targets:
        m.assumed.append("peft's default LoRA targets (not stated)")
    if lora.get("dropout") is None:
        m.assumed.append("no LoRA dropout (not stated)")
    try:
        ft = Finetune(method=Method.QLORA if quant else Method.LORA, rank=int(lora["r"]),
                      alpha=float(lora.get("alpha") or lora["r"]), dropout=float(lora.get("dropout") or 0.0),
                      targets=tuple(targets), base=_BASES.get(quant, BaseWeights.AUTO), recipe=recipe)
    except MemfitError as error:
        m.missing.append((LORA, str(error)))
        return {}
    return {"finetune": ft}


def _map_flags(m: Mapped, n: dict) -> dict:
    out = {}
    lora = n.get("lora")
    if lora:
        out.update(_map_lora(m, lora))
    if n.get("compile"):  # torchtune / torchtitan compile each block (memfit.estimate.compiled)
        out["compile"] = True
        if _torchtitan_compiles_its_loss(m.point) and n.get("loss") in (None, "full_logits_ce"):
            out["loss"] = Loss.COMPILED
            m.assumed.append("torchtitan of 2025 compiles its cross-entropy with the model (components/loss.py "
                             "build_cross_entropy_loss); its December 2024 train.py left that commented out")
    if n.get("float8"):  # torchtitan --model.converters float8: tensorwise, its default recipe
        out["float8"] = Float8.TENSORWISE
        out["float8_all_gather"] = "float8_fsdp_allgather" in (n.get("techniques") or ())
    return out


def _torchtitan_compiles_its_loss(point: dict) -> bool:
    """torchtitan's train.py of late 2024 kept `loss_fn = torch.compile(loss_fn)` commented out ("compiling loss
    function causes CUDA errors"); from its 2025 components/loss.py on, training.compile compiles the loss too."""
    return point.get("source_repo") == "pytorch/torchtitan" and str(point.get("source_date") or "") >= "2025"


def _map_parallel(m: Mapped, par: dict, off: dict) -> dict:
    engine = (par.get("engine") or "none").lower().split()[0]  # "fsdp (torchtune)" is FSDP
    tp, pp, cp = (int(par.get(k) or 1) for k in ("tp", "pp", "cp"))
    replicate = int(par.get("dp_replicate") or 1)
    world = int(par.get("world_size") or 1)
    stage = int(par.get("zero_stage") or 0)
    # the world: pp x cp x tp x the data-parallel ranks (torchtitan shards FSDP over dp x cp, as memfit does)
    shard = int(par.get("param_shard_degree") or world)
    out = {"num_gpus": max(1, world if world > 1 else shard * tp * pp)}
    if pp > 1:
        out["pp"] = pp
    if cp > 1:
        out["cp"] = cp
    if replicate > 1 and stage:  # HSDP: FSDP2 over a (replicate, shard) mesh
        out["dp_shard"] = int(par.get("dp_shard") or 0) or max(1, out["num_gpus"] // (tp * pp * cp * replicate))
    if tp > 1:  # torch DTensor TP as torchtitan applies it; sequence parallel is torchtitan's default with TP
        out.update(tp=tp, sequence_parallel=bool(par.get("sequence_parallel", True)))
    if engine == "deepspeed":
        out["engine"] = Engine.DEEPSPEED
    elif engine in ("fsdp2", "fsdp", "ddp", "torch"):
        out["engine"] = Engine.TORCH
    out["sharding"] = {0: Sharding.NONE, 1: Sharding.ZERO1, 2: Sharding.ZERO2, 3: Sharding.ZERO3}.get(stage)
    if out["sharding"] is None:
        m.missing.append((OTHER, f"zero stage {stage}"))
        out["sharding"] = Sharding.NONE
    offload = Offload.NONE
    if off.get("params"):
        offload = Offload.OPTIMIZER_AND_PARAMS
    elif off.get("optimizer"):
        offload = Offload.OPTIMIZER
    out["offload"] = offload
    if off.get("activations"):  # torchtune OffloadActivations
        out["activation_offload"] = True
    if out["num_gpus"] < 2 and stage and engine != "deepspeed":
        # one-process ZeRO is DeepSpeed's (ZeRO-Offload / -Infinity); FSDP on one rank shards nothing
        m.missing.append((ZERO_ONE_PROCESS, f"{engine} zero{stage} on {world} process"))
        out["sharding"] = Sharding.NONE
    return out


def _hardware(m: Mapped, gpu: dict, num_gpus: int, runtime: str = "lazy") -> Hardware:
    key, mem = gpu.get("key") or "", gpu.get("mem_GiB")
    device: GPU | None = None
    try:
        device = get_gpu(key)
    except MemfitError:
        device = None
    if device is None or device.name.startswith("custom"):
        device = GPU(name=key or "unknown", memory_bytes=int((mem or 80) * GiB),
                     source="the point's stated memory")
        m.assumed.append(f"{key}: not in memfit's GPU catalog, {mem} GiB as stated")
    per_node = min(num_gpus, 8)
    nodes = max(1, math.ceil(num_gpus / per_node))
    if runtime != "lazy":
        m.assumed.append(f"CUDA runtime '{runtime}' (source dated before PyTorch 1.13's lazy module loading)")
    return make_hardware(device, gpus_per_node=per_node, num_nodes=nodes, cuda_runtime=runtime)


# --------------------------------------------------------------------------------------------------- predicting


@dataclass
class Row:
    mapped: Mapped
    metric: str
    group: str
    measured_gib: float | None
    is_oom: bool
    predicted_gib: float | None = None
    figure: str = ""
    nearest_gib: float | None = None
    head_gib: float = 0.0
    capacity_gib: float | None = None
    error: str = ""
    fits: bool | None = None
    """memfit's verdict (memfit.diagnose): the least reserve the step runs with at the limit + outside <= budget."""
    fits_with_room: bool | None = None
    """The verdict on what the step reserves with room to spare (before the retry rule was modelled)."""
    at_limit_gib: float | None = None
    with_room_gib: float | None = None
    budget_gib: float | None = None

    @property
    def err_pct(self) -> float | None:
        if self.predicted_gib is None or not self.measured_gib:
            return None
        return 100.0 * (self.predicted_gib - self.measured_gib) / self.measured_gib

    @property
    def predicted_oom(self) -> bool | None:
        if self.predicted_gib is None or self.capacity_gib is None:
            return None
        return self.predicted_gib > self.capacity_gib


def figure_bytes(est, group: str) -> tuple[int, str]:
    """The memfit figure comparable with one measured metric group."""
    key, _ = FIGURES.get(group, FIGURES["allocated"])
    if key == "allocated":
        return est.allocated_bytes, key
    if key == "reserved":
        return est.reserved_bytes, key
    return est.device_used_bytes, key


def predict(mapped: Mapped) -> Row:
    meas = mapped.norm.get("measured") or {}
    group = meas.get("metric_group") or meas.get("metric") or "allocated"
    row = Row(mapped, meas.get("metric") or group, group, meas.get("value_GiB"), bool(meas.get("is_oom")))
    if mapped.setup is None or mapped.hardware is None:
        return row
    try:
        est = estimate(mapped.spec, mapped.setup, mapped.hardware)
    except MemfitError as error:
        if mapped.expressible:
            mapped.missing.append((OTHER, f"memfit refused: {error}"))
        row.error = str(error)
        return row
    num_bytes, row.figure = figure_bytes(est, group)
    verdict = diagnose(est, mapped.hardware)
    row.fits = verdict.fits
    row.with_room_gib = (verdict.with_room_bytes or verdict.required_bytes) / GiB
    # the verdict searches the least reserve only near the limit; the table shows it for every point
    row.at_limit_gib = ((verdict.with_room_bytes or verdict.required_bytes) - cache_freed_at_limit(est)) / GiB
    row.budget_gib = verdict.budget_bytes / GiB
    row.fits_with_room = row.with_room_gib <= row.budget_gib
    row.capacity_gib = mapped.hardware.gpu.memory_bytes / GiB
    row.head_gib = sum(t.num_bytes for t in est.terms if "logits" in t.name or t.name == "activations/loss") / GiB
    if mapped.expressible:
        row.predicted_gib = num_bytes / GiB
    else:
        row.nearest_gib = num_bytes / GiB
    return row


def evaluate(points: list[dict]) -> list[Row]:
    return [predict(map_point(p)) for p in points]


# ---------------------------------------------------------------------------------------------------- reporting


def setup_summary(setup: TrainingSetup | None) -> str:
    if setup is None:
        return "-"
    parts = [f"{setup.micro_batch_size}x{setup.seq_len}"]
    if setup.grad_accum_steps > 1:
        parts.append(f"accum {setup.grad_accum_steps}")
    parts += [str(setup.precision), str(setup.optimizer)]
    if setup.checkpointing is Checkpointing.FULL:
        parts.append("ckpt")
    elif setup.checkpointing is not Checkpointing.NONE:
        parts.append(f"ckpt {setup.checkpointing}")
    parts.append(str(setup.attention))
    if setup.num_gpus > 1:
        parts.append(f"{setup.sharding} x{setup.num_gpus} {setup.engine}")
    if setup.offload is not Offload.NONE:
        parts.append(f"offload {setup.offload}")
    parts += [f"{name} {value}" for name, value in (("tp", setup.tp), ("cp", setup.cp)) if value > 1]
    parts += ["compile"] if setup.compile else []
    parts += [f"loss {setup.loss}"] if setup.loss is not Loss.STANDARD else []
    parts += [f"float8 {setup.float8}" + (" + fp8 all-gather" if setup.float8_all_gather else "")
              ] if setup.float8.is_on else []
    return ", ".join(parts)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(rows: list[Row]) -> dict:
    done = [r for r in rows if r.mapped.expressible and r.err_pct is not None]
    errors = [abs(r.err_pct) for r in done]
    by_source: dict[str, list[float]] = {}
    for r in done:
        by_source.setdefault(r.mapped.norm["source"], []).append(r.err_pct)
    features: Counter = Counter()
    only: Counter = Counter()
    for r in rows:
        if not r.mapped.expressible:
            feats = r.mapped.features
            features.update(feats)
            if len(feats) == 1:
                only.update(feats)
    oom_rows = [r for r in rows if r.is_oom]
    oom_known = [r for r in oom_rows if r.predicted_oom is not None]
    ran = [r for r in done if not r.is_oom]
    return {
        "points": len(rows),
        "expressible": len(done),
        "not_expressible": len(rows) - len(done),
        "median_abs_error_pct": statistics.median(errors) if errors else None,
        "p90_abs_error_pct": percentile(errors, 90) if errors else None,
        "median_signed_error_pct": statistics.median([r.err_pct for r in done]) if done else None,
        "by_source": {s: {"n": len(v), "median_error_pct": statistics.median(v),
                          "median_abs_error_pct": statistics.median([abs(x) for x in v])}
                      for s, v in sorted(by_source.items())},
        "features": dict(features.most_common()),
        "only_blocker": dict(only.most_common()),
        "oom_rows": len(oom_rows),
        "oom_rows_expressible": len(oom_known),
        "oom_rows_agree": sum(1 for r in oom_known if r.predicted_oom),
        "ran_rows_predicted_fit": sum(1 for r in ran if r.predicted_oom is False),
        "ran_rows": len(ran),
    }


def _fmt(value, spec: str = ".2f", empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def context_anchors(points: list[dict]) -> list[dict]:
    """The sources' own CUDA-context measurements (out-of-scope 'anchor:cuda_context' points): shown next to
    memfit's constant, never used to change it."""
    found = []
    for p in points:
        n = p.get("normalized") or {}
        if "anchor:cuda_context" in (n.get("techniques") or []) and (n.get("measured") or {}).get("value_GiB"):
            found.append({"id": n["id"], "source": n.get("source"), "gpu": (n.get("gpu") or {}).get("key"),
                          "GiB": n["measured"]["value_GiB"], "runtime": cuda_runtime(p)})
    return found


def lora_points(points: list[dict]) -> list[dict]:
    """Every point that trains LoRA / QLoRA adapters and measured a step's peak (in scope or not)."""
    return [p for p in points if (p.get("normalized") or {}).get("lora")
            and ((p["normalized"].get("measured") or {}).get("metric_group") in FIGURES)]


def _lora_section(rows: list[Row]) -> list[str]:
    done = [r for r in rows if r.mapped.expressible and r.err_pct is not None]
    errors = [abs(r.err_pct) for r in done]
    lines = ["", "## LoRA / QLoRA points (in scope or not)", "",
             f"{len(rows)} points train adapters on a measured step; {len(done)} are expressible with memfit's "
             "Finetune (method, rank, alpha, dropout, targets, base as the source states them)"
             + (f": median |error| {statistics.median(errors):.1f}%, 90th percentile {percentile(errors, 90):.1f}%"
                if errors else "") + ". Out-of-scope rows are of lower confidence (see points.jsonl); they are not in "
             "the summary above.", "",
             "| id | in scope | model | setup | LoRA | metric | measured GiB | memfit GiB | error % | not expressible: |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ft = r.mapped.setup.finetune if r.mapped.setup else None
        lora = (f"{ft} {'+'.join(ft.targets) or 'default'}" if ft and ft.adapters else "-")
        model = r.mapped.spec.name if r.mapped.spec else (r.mapped.norm.get("model") or {}).get("key") or "-"
        memfit = _fmt(r.predicted_gib) if r.mapped.expressible else f"({_fmt(r.nearest_gib)})"
        lines.append(f"| {r.mapped.pid}{'~' if r.mapped.approx else ''} | "
                     f"{'yes' if r.mapped.norm.get('in_scope') else 'no'} | {model} | "
                     f"{setup_summary(r.mapped.setup)} | {lora} | {r.metric} | {_fmt(r.measured_gib)} | {memfit} | "
                     f"{_fmt(r.err_pct, '+.1f')} | {r.mapped.reason() or '-'} |")
    lines += ["", "memfit GiB in parentheses: the nearest expressible setup, the blockers ignored."]
    return lines


def render(rows: list[Row], stats: dict, *, points_label: str, extra_oom: list[Row] = (),
           anchors: list[dict] = (), lora_rows: list[Row] = ()) -> str:
    lines = ["# memfit vs published GPU measurements", "",
             f"Points: `{points_label}` (in scope: {stats['points']}; expressible in memfit: "
             f"{stats['expressible']}; not expressible: {stats['not_expressible']}). Generated by "
             "`python bench/gpu_published.py`; nothing is fitted to the points (memfit's device model: CUDA context "
             f"{_CONTEXT / GiB:.2f} GiB with lazy loading, {_LEGACY / GiB:.2f} GiB before it; allocator rounding "
             "and reserve from a replay of the step through the caching allocator's rules; cuBLAS workspaces; NCCL "
             f"{_DEFAULT_HW.device.nccl_bytes_per_communicator / GiB:.2f} GiB per communicator over NVLink when more "
             "than one GPU).", "",
             "Which memfit figure is compared with which measured metric:", ""]
    for group, (_, text) in FIGURES.items():
        metrics = sorted({r.metric for r in rows if r.group == group})
        lines.append(f"- `{group}` ({', '.join(metrics) or 'no point'}): {text}")
    lines += ["", "Error % = (memfit - measured) / measured. `~` marks a row whose mapping approximates the "
              "source (listed under the table); they are in the statistics.", "",
              "## Summary", ""]
    lines.append(f"- expressible points: {stats['expressible']} of {stats['points']}")
    lines.append(f"- median |error|: {_fmt(stats['median_abs_error_pct'], '.1f')}%; 90th percentile |error|: "
                 f"{_fmt(stats['p90_abs_error_pct'], '.1f')}%; median signed error: "
                 f"{_fmt(stats['median_signed_error_pct'], '+.1f')}%")
    for source, s in stats["by_source"].items():
        lines.append(f"- {source}: {s['n']} points, median error {s['median_error_pct']:+.1f}%, "
                     f"median |error| {s['median_abs_error_pct']:.1f}%")
    lines.append(f"- OOM rows in scope: {stats['oom_rows']} ({stats['oom_rows_expressible']} expressible, memfit "
                 f"predicts OOM for {stats['oom_rows_agree']} of them); rows that ran: memfit predicts they fit for "
                 f"{stats['ran_rows_predicted_fit']} of {stats['ran_rows']}")
    for a in anchors:
        nvml = [r for r in rows if r.mapped.expressible and r.group == "nvml"
                and r.mapped.norm["source"] == a["source"]]
        assumed = (_LEGACY if a.get("runtime") == "legacy" else _CONTEXT) / GiB
        lines.append(f"- {a['id']} ({a['source']}, {a['gpu']}, out of scope) measured the bare CUDA context at "
                     f"{a['GiB']:.2f} GiB where memfit assumes {assumed:.2f} GiB ({a.get('runtime', 'lazy')} module "
                     f"loading): {a['GiB'] - assumed:+.2f} GiB of the gap of each of this source's {len(nvml)} nvml "
                     "rows (shown, not applied)")
    lines += ["", "## Expressible points", "",
              "| id | source | model | setup | metric | memfit figure | measured GiB | memfit GiB | error % |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.mapped.expressible:
            continue
        mark = "~" if r.mapped.approx else ""
        lines.append(f"| {r.mapped.pid}{mark} | {r.mapped.norm['source']} | {r.mapped.spec.name} | "
                     f"{setup_summary(r.mapped.setup)} | {r.metric} | {r.figure} | "
                     f"{_fmt(r.measured_gib, '.2f', 'OOM')} "
                     f"| {_fmt(r.predicted_gib)} | {_fmt(r.err_pct, '+.1f')} |")
    lines += ["", "Approximations and assumptions:", ""]
    for r in rows:
        if r.mapped.expressible and (r.mapped.approx or r.mapped.assumed):
            notes = list(r.mapped.approx)
            if any("classification" in a for a in r.mapped.approx):
                notes.append(f"memfit's logits/loss terms at its peak: {r.head_gib:.2f} GiB")
            notes += [f"assumed {a}" for a in r.mapped.assumed]
            lines.append(f"- {r.mapped.pid}: " + "; ".join(notes))
    worst = sorted((r for r in rows if r.mapped.expressible and r.err_pct is not None),
                   key=lambda r: -abs(r.err_pct))[:5]
    lines += ["", "Worst expressible points: " + ", ".join(f"{r.mapped.pid} ({r.err_pct:+.1f}%)" for r in worst)]
    lines += ["", "## Not expressible (the roadmap)", "",
              "| feature | points needing it | points it alone blocks |", "|---|---|---|"]
    for feature, count in stats["features"].items():
        lines.append(f"| {feature} | {count} | {stats['only_blocker'].get(feature, 0)} |")
    lines += ["", "memfit GiB on the nearest setup it can express (the missing features ignored, named in the "
              "reason; not in the statistics, a size for the roadmap only):", "",
              "| id | source | model | metric | measured GiB | nearest memfit GiB | not expressible: |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.mapped.expressible:
            continue
        model = (r.mapped.norm.get("model") or {}).get("key") or "-"
        lines.append(f"| {r.mapped.pid} | {r.mapped.norm['source']} | {model} | {r.metric} | "
                     f"{_fmt(r.measured_gib, '.2f', 'OOM')} | {_fmt(r.nearest_gib)} | {r.mapped.reason()} |")
    lines += ["", "Paged optimizers (bitsandbytes Paged*) keep their state in CUDA unified memory: the torch "
              "allocator does not count it, so memfit puts those states in its own term outside the allocator "
              "(optimizer/paged_states): in device used, not in allocated / reserved."]
    if lora_rows:
        lines += _lora_section(list(lora_rows))
    if extra_oom:
        lines += ["", "## OOM rows outside the in-scope set (information only)", "",
                  "| id | source | model | predicted OOM | not expressible: |", "|---|---|---|---|---|"]
        for r in extra_oom:
            predicted = {None: "-", True: "yes", False: "no"}[r.predicted_oom]
            model = (r.mapped.norm.get("model") or {}).get("key") or "-"
            lines.append(f"| {r.mapped.pid} | {r.mapped.norm['source']} | {model} | {predicted} | "
                         f"{r.mapped.reason() or '-'} |")
    lines += _verdict_section(rows)
    return "\n".join(lines) + "\n"


def _verdict_section(rows: list[Row]) -> list[str]:
    """memfit's fits verdict (memfit.diagnose, 5% margin) on each expressible point that says whether the step ran
    or ran out of memory, on the reserve with room to spare and on the least reserve at the limit (the caching
    allocator frees its cached segments and retries before an OOM): every flip listed."""
    judged = [r for r in rows if r.mapped.expressible and r.fits is not None]
    right = lambda r, fits: fits != r.is_oom  # noqa: E731
    flips = [r for r in judged if r.fits != r.fits_with_room]
    lines = ["", "## Fits verdicts near the limit", "",
             f"{len(judged)} expressible points (OOM rows: the step did not run; the others ran). Right with the "
             f"reserve held with room: {sum(right(r, r.fits_with_room) for r in judged)}; right with the least "
             f"reserve at the limit (memfit's verdict): {sum(right(r, r.fits) for r in judged)}; flips: "
             f"{len(flips)} ({sum(right(r, r.fits) for r in flips)} to right, "
             f"{sum(not right(r, r.fits) for r in flips)} to wrong).", "",
             "| id | model | measured | budget GiB | with room GiB | at the limit GiB | verdict with room | "
             "memfit's verdict | flip |", "|---|---|---|---|---|---|---|---|---|"]
    for r in judged:
        word = {True: "fits", False: "OOM"}
        flip = "" if r.fits == r.fits_with_room else ("to right" if right(r, r.fits) else "TO WRONG")
        lines.append(f"| {r.mapped.pid} | {r.mapped.spec.name} | {'OOM' if r.is_oom else 'ran'} | "
                     f"{r.budget_gib:.2f} | {r.with_room_gib:.2f} | {r.at_limit_gib:.2f} | {word[r.fits_with_room]} "
                     f"| {word[r.fits]} | {flip} |")
    return lines


def row_json(r: Row) -> dict:
    return {"id": r.mapped.pid, "source": r.mapped.norm["source"], "expressible": r.mapped.expressible,
            "features": r.mapped.features, "reason": r.mapped.reason(), "approx": r.mapped.approx,
            "assumed": r.mapped.assumed, "setup": r.mapped.setup.to_dict() if r.mapped.setup else None,
            "metric": r.metric, "metric_group": r.group, "figure": r.figure, "measured_gib": r.measured_gib,
            "memfit_gib": r.predicted_gib, "nearest_gib": r.nearest_gib, "error_pct": r.err_pct,
            "is_oom": r.is_oom, "predicted_oom": r.predicted_oom, "fits": r.fits,
            "fits_with_room": r.fits_with_room}


def run(points_file: Path) -> tuple[list[Row], dict, list[Row], list[dict], list[Row]]:
    points = load_points(points_file)
    rows = evaluate(in_scope(points))
    extra = evaluate([p for p in points if not p["normalized"].get("in_scope")
                      and (p["normalized"].get("measured") or {}).get("is_oom")])
    return rows, summary(rows), extra, context_anchors(points), evaluate(lora_points(points))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=DEFAULT_POINTS,
                        help=f"points.jsonl (relative paths from the repository root; default {DEFAULT_POINTS})")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"markdown report (default {DEFAULT_OUT})")
    parser.add_argument("--json", default=None, help="also write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    path = points_path(args.points)
    if not path.is_file():
        print(f"error: no points file at {args.points} (resolved against the repository root)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, stats, extra, anchors, lora_rows = run(path)
    label = args.points if not Path(args.points).is_absolute() else path.name
    text = render(rows, stats, points_label=label, extra_oom=extra, anchors=anchors, lora_rows=lora_rows)
    out = Path(args.out)
    out = out if out.is_absolute() else REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    if args.json:
        target = Path(args.json)
        target = target if target.is_absolute() else REPO / target
        target.write_text(json.dumps({"summary": stats, "rows": [row_json(r) for r in rows], "anchors": anchors,
                                      "oom_outside_scope": [row_json(r) for r in extra],
                                      "lora": [row_json(r) for r in lora_rows]}, indent=1),
                          encoding="utf-8")
    print(text)
    shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    print(f"({time.perf_counter() - start:.1f} s; written to {shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
