"""Real training steps on this machine's GPU, measured next to memfit's analytic prediction.

    python bench/gpu_check.py                     # CUDA when available: the full matrix (sized for ~10 min on an H200)
    python bench/gpu_check.py --quick             # a few cases
    python bench/gpu_check.py --device cpu --quick --out OUTDIR   # the same script on the CPU (what the tests run)

Each case builds a small HF model from a config with random weights and runs `memfit.measure` (memfit's one
training step, `memfit._torch.step.training_step`, on the model `build_hf_model` makes and batches `make_batch`
makes): families llama / gpt2 / qwen2 x precision {fp32, amp-bf16, bf16} x checkpointing {none, full} x attention
{sdpa, eager} x optimizer {adamw, adamw-foreach, adamw-8bit, paged-adamw-8bit}, then batch and sequence sweeps,
then the techniques (TECHNIQUES: LoRA / QLoRA, chunked loss, optimizer in backward, activation offload, compile;
Muon) with and without checkpointing.

Measured, per case:
- allocated: on CUDA the peak of `torch.cuda.max_memory_allocated`, which memfit.measure reads and resets at every
  phase of the step (its `tensor_bytes`); on CPU the profiler's peak of live bytes (memfit.measure's CPU path);
- reserved: the peak of `torch.cuda.max_memory_reserved` over the same phases (memfit.measure's total); null on CPU;
- nvml: device memory used (pynvml, else `nvidia-smi --query-gpu=memory.used`, else null), read right after the
  steps, while the caching allocator still holds its peak; `nvml_process` subtracts the reading taken before this
  process created its CUDA context (other processes, the driver). Null on CPU.
Predicted, per case: memfit's three device figures (memfit.estimate.device): allocated (tensor bytes with the
caching allocator's rounding and the kernels' workspaces; vs allocated), reserved (the allocator simulator's segments;
vs reserved) and device used (reserved + CUDA context + NCCL; vs nvml_process).

Results: DIR/gpu_check.md and DIR/gpu_check.json (DIR/gpu_check_cpu.* on the CPU, so a CPU run never overwrites
GPU results). A case that fails is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "bench/results"

from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.hardware import GPU, cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
import memfit.techniques  # noqa: E402,F401  (registers the technique sections: activation_offload)
from memfit.sources import resolve_model  # noqa: E402
from memfit.units import GiB, MiB  # noqa: E402


# Model configs (plain HF config dicts, random weights). "tiny": CPU-sized, the same shape as tests/tiny_configs.py;
# "small": ~100-125M parameters, big enough that a step's peak sits well above the allocator's block granularity.
CONFIGS = {
    "tiny": {
        "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
                  "max_position_embeddings": 512, "tie_word_embeddings": False},
        "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 256, "vocab_size": 512,
                 "n_positions": 512, "bos_token_id": 0, "eos_token_id": 0},
        "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                  "max_position_embeddings": 512, "tie_word_embeddings": True},
    },
    "small": {
        "llama": {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "tie_word_embeddings": False},
        "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                 "n_positions": 4096},
        "qwen2": {"model_type": "qwen2", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "tie_word_embeddings": True},
    },
}

FAMILIES = ("llama", "gpt2", "qwen2")
PRECISIONS = ("fp32", "amp-bf16", "bf16")
CHECKPOINTING = ("none", "full")
ATTENTION = ("sdpa", "eager")
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-8bit", "paged-adamw-8bit")
SHAPE = {"tiny": (2, 128), "small": (4, 512)}
"""(micro-batch, sequence) of the main matrix, per model size."""


@dataclass(frozen=True)
class Case:
    family: str
    precision: str = "fp32"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    attention: str = "sdpa"
    micro_batch_size: int = 2
    seq_len: int = 64
    grad_accum_steps: int = 1
    config: dict | None = field(default=None, compare=False, hash=False)
    """The HF config dict to build; None: CONFIGS[size][family]."""
    technique: str = ""
    """A key of TECHNIQUES: more TrainingSetup fields (LoRA, QLoRA, compile, chunked loss...); "" for none."""

    @property
    def name(self) -> str:
        accum = f"-a{self.grad_accum_steps}" if self.grad_accum_steps > 1 else ""
        extra = f"-{self.technique}" if self.technique else ""
        return (f"{self.family}-{self.precision}-{self.optimizer}-ckpt_{self.checkpointing}-{self.attention}"
                f"-b{self.micro_batch_size}-s{self.seq_len}{accum}{extra}")

    def setup(self) -> TrainingSetup:
        return TrainingSetup(micro_batch_size=self.micro_batch_size, seq_len=self.seq_len,
                             grad_accum_steps=self.grad_accum_steps, precision=self.precision,
                             optimizer=self.optimizer, checkpointing=self.checkpointing, attention=self.attention,
                             **TECHNIQUES.get(self.technique, {}))


TECHNIQUES = {
    "lora-r16-attn": {"finetune": {"method": "lora", "rank": 16, "targets": ["q_proj", "v_proj"]}},
    "lora-r64-all": {"finetune": {"method": "lora", "rank": 64, "targets": "all-linear", "dropout": 0.1}},
    "qlora-r16-all": {"finetune": {"method": "qlora", "rank": 16, "targets": "all-linear"}},
    "chunked-loss": {"loss": "chunked"},
    "opt-in-bwd": {"optimizer_in_backward": True},
    "act-offload": {"activation_offload": True},
    "compile": {"compile": True},
}
"""The techniques a GPU run checks on top of the main matrix (each a set of TrainingSetup fields)."""
TECHNIQUE_BASE = {"lora-r16-attn": "amp-bf16", "lora-r64-all": "amp-bf16", "qlora-r16-all": "amp-bf16"}
"""The precision each technique runs at where it is not bf16 (peft keeps fp32 adapters under autocast)."""


def full_matrix(size: str) -> list[Case]:
    b, t = SHAPE[size]
    cases = [Case(fam, prec, opt, ckpt, attn, b, t) for fam, prec, ckpt, attn, opt in
             itertools.product(FAMILIES, PRECISIONS, CHECKPOINTING, ATTENTION, OPTIMIZERS)]
    batches = (1, 2, 8, 16) if size == "small" else (1, 4)
    seqs = (128, 256, 1024, 2048) if size == "small" else (64, 256)
    for fam in FAMILIES:  # batch and sequence sweeps on the common fine-tune setup, plus fp32 eager (T^2 scores)
        cases += [Case(fam, "bf16", "adamw", "none", "sdpa", batch, t) for batch in batches]
        cases += [Case(fam, "bf16", "adamw", "none", "sdpa", b, seq) for seq in seqs]
    cases += [Case("llama", "fp32", "adamw", "none", "eager", b, seq) for seq in seqs]
    cases += [Case("llama", "amp-bf16", "adamw-foreach", "full", "sdpa", b, t, grad_accum_steps=2)]
    for technique in TECHNIQUES:  # LoRA / QLoRA, loss, offload, compile: with and without checkpointing
        for ckpt in CHECKPOINTING:
            cases.append(Case("llama", TECHNIQUE_BASE.get(technique, "bf16"), "adamw-fused" if technique ==
                              "opt-in-bwd" else "adamw-foreach", ckpt, "sdpa", b, t, technique=technique))
    cases += [Case(fam, "bf16", "muon", ckpt, "sdpa", b, t) for fam in ("llama", "gpt2") for ckpt in CHECKPOINTING]
    return cases


def quick_cases(size: str) -> list[Case]:
    b, t = SHAPE[size]
    return [Case("llama", "fp32", "adamw", "none", "sdpa", b, t),
            Case("gpt2", "bf16", "adamw-foreach", "full", "sdpa", b, t),
            Case("qwen2", "amp-bf16", "adamw", "none", "eager", b, t)]


# ---------------------------------------------------------------------------------------------- device readings


class Nvml:
    """Device memory used, from pynvml when importable, else nvidia-smi, else nothing (every reading None). Picks
    the device without touching CUDA (so the first reading is free of this process's context): the physical index
    or UUID that CUDA_VISIBLE_DEVICES names for torch's `device_index`."""

    def __init__(self, device_index: int) -> None:
        self.how = "none"
        self._handle = None
        self._id = self._physical_id(device_index)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            self._handle = (pynvml.nvmlDeviceGetHandleByUUID(self._id) if not self._id.isdigit()
                            else pynvml.nvmlDeviceGetHandleByIndex(int(self._id)))
            self.how = "pynvml"
            return
        except Exception:  # noqa: BLE001 - not installed, no driver, unknown device: try nvidia-smi
            self._handle = None
        if shutil.which("nvidia-smi") and self._smi() is not None:
            self.how = "nvidia-smi"

    @staticmethod
    def _physical_id(index: int) -> str:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return visible[index] if index < len(visible) else str(index)

    def _smi(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", self._id], capture_output=True, text=True, timeout=20, check=True)
            return int(float(out.stdout.strip().splitlines()[0])) * MiB
        except Exception:  # noqa: BLE001
            return None

    def used(self) -> int | None:
        if self.how == "pynvml":
            try:
                return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            except Exception:  # noqa: BLE001
                return None
        if self.how == "nvidia-smi":
            return self._smi()
        return None


def free_device(device: str) -> None:
    """Drop every tensor the previous case left, hand cached blocks back, and reset the peak statistics."""
    gc.collect()
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -------------------------------------------------------------------------------------------------- one case


COLUMNS = ("case", "family", "params", "precision", "optimizer", "checkpointing", "attention", "technique",
           "micro_batch_size",
           "seq_len", "grad_accum_steps", "status", "error", "seconds",
           "measured_allocated_bytes", "measured_reserved_bytes", "nvml_used_bytes", "nvml_process_bytes",
           "memfit_tensor_bytes", "memfit_reserved_bytes", "memfit_total_bytes",
           "err_allocated_pct", "err_reserved_pct", "err_nvml_pct", "measured_peak_phase", "memfit_peak_phase")
"""Every row has every column (None where a reading does not exist on this device or the case failed)."""


def _pct(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def run_case(case: Case, *, device: str, size: str, hardware, nvml: Nvml | None, nvml_idle: int | None,
             steps: int = 2) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(case=case.name, family=case.family, precision=case.precision, optimizer=case.optimizer,
               checkpointing=case.checkpointing, attention=case.attention, technique=case.technique or None,
               micro_batch_size=case.micro_batch_size,
               seq_len=case.seq_len, grad_accum_steps=case.grad_accum_steps, status="failed")
    start = time.perf_counter()
    try:
        from memfit.measure import check_host_ram, measure

        config = dict(case.config if case.config is not None else CONFIGS[size][case.family])
        setup = case.setup()
        spec = resolve_model(config)
        row["params"] = spec.num_params
        predicted = estimate(spec, setup, hardware)
        row["memfit_tensor_bytes"] = predicted.allocated_bytes  # tensors + the allocator's rounding, workspaces
        row["memfit_total_bytes"] = predicted.device_used_bytes
        row["memfit_reserved_bytes"] = predicted.reserved_bytes
        row["memfit_peak_phase"] = predicted.peak_phase.value
        if device == "cpu":
            check_host_ram(spec, setup)
        free_device(device)
        measured = measure(config, setup, steps=steps, device=device)
        row["measured_allocated_bytes"] = measured.tensor_bytes
        row["measured_peak_phase"] = measured.peak_phase.value
        if device.startswith("cuda"):
            row["measured_reserved_bytes"] = measured.total_bytes  # tensor peak + (max reserved - max allocated)
            used = nvml.used() if nvml is not None else None
            row["nvml_used_bytes"] = used
            if used is not None and nvml_idle is not None:
                row["nvml_process_bytes"] = used - nvml_idle
        row["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - one failing case is recorded, the matrix goes on
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    finally:
        measured = predicted = None  # noqa: F841 - drop references before freeing
        try:
            free_device(device)
        except Exception as error:  # noqa: BLE001
            row["error"] = (row["error"] or "") + f" (freeing failed: {error})"
    row["seconds"] = round(time.perf_counter() - start, 2)
    row["err_allocated_pct"] = _pct(row["memfit_tensor_bytes"], row["measured_allocated_bytes"])
    row["err_reserved_pct"] = _pct(row["memfit_reserved_bytes"], row["measured_reserved_bytes"])
    row["err_nvml_pct"] = _pct(row["memfit_total_bytes"], row["nvml_process_bytes"])
    if row["status"] != "ok":
        for key in ("err_allocated_pct", "err_reserved_pct", "err_nvml_pct"):
            row[key] = None
    return row


# ---------------------------------------------------------------------------------------------------- the run


def resolve_device(text: str) -> str:
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device (use --device cpu)")
    if text not in ("cpu",) and not text.startswith("cuda"):
        raise SystemExit(f"error: --device {text}: choose auto, cuda[:N] or cpu")
    return text


def device_context(device: str) -> dict:
    """What the run is on, the hardware memfit predicts for, and NVML's idle and context readings."""
    import torch

    info = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cpu":
        from memfit.measure import host_ram

        info.update(name="cpu", nvml="none (cpu)")
        return {"info": info, "hardware": make_hardware(cpu_device(max(host_ram(), 1))), "nvml": None,
                "nvml_idle": None}
    index = torch.device(device).index or 0
    nvml = Nvml(index)
    idle = nvml.used()  # before this process creates its CUDA context
    torch.cuda.set_device(index)
    torch.ones(1, device=device)
    torch.cuda.synchronize()
    with_context = nvml.used()
    props = torch.cuda.get_device_properties(index)
    gpu = GPU(name=props.name, memory_bytes=int(props.total_memory), source="torch.cuda.get_device_properties")
    info.update(name=props.name, memory_bytes=int(props.total_memory), cuda=torch.version.cuda, nvml=nvml.how,
                nvml_idle_bytes=idle,
                cuda_context_bytes=(with_context - idle) if idle is not None and with_context is not None else None)
    try:
        import bitsandbytes

        info["bitsandbytes"] = bitsandbytes.__version__
    except Exception:  # noqa: BLE001
        info["bitsandbytes"] = None
    return {"info": info, "hardware": make_hardware(gpu), "nvml": nvml, "nvml_idle": idle}


def run_cases(cases: list[Case], *, device: str, size: str, steps: int = 2, progress=None,
              max_seconds: float | None = None) -> tuple[list[dict], dict]:
    """`max_seconds`: start no case after that long (a lent GPU's time is short); the cases not run are counted in
    the info (`not_run`) and the results are still written."""
    ctx = device_context(device)
    rows = []
    start = time.perf_counter()
    for index, case in enumerate(cases, 1):
        if max_seconds is not None and rows and time.perf_counter() - start > max_seconds:
            ctx["info"]["not_run"] = [c.name for c in cases[index - 1:]]
            break
        row = run_case(case, device=device, size=size, hardware=ctx["hardware"], nvml=ctx["nvml"],
                       nvml_idle=ctx["nvml_idle"], steps=steps)
        rows.append(row)
        if progress:
            progress(index, len(cases), row)
    info = dict(ctx["info"], size=size, steps=steps, memfit_cuda_context_bytes=ctx["hardware"].cuda_context_bytes,
                memfit_cuda_runtime=str(getattr(ctx["hardware"], "cuda_runtime", "")),
                memfit_expandable_segments=bool(getattr(ctx["hardware"], "expandable_segments", False)))
    return rows, info


# --------------------------------------------------------------------------------------------------- reporting


def _mib(value) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def _p(value) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _stats(values: list[float]) -> str:
    if not values:
        return "no cases"
    absolute = sorted(abs(v) for v in values)
    p90 = absolute[min(len(absolute) - 1, math.ceil(0.9 * len(absolute)) - 1)]
    return (f"{len(values)} cases, median {statistics.median(values):+.1f}%, median |error| "
            f"{statistics.median(absolute):.1f}%, 90th percentile |error| {p90:.1f}%, worst {absolute[-1]:.1f}%")


def render(rows: list[dict], info: dict) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    on_cuda = info["device"].startswith("cuda")
    lines = ["# memfit vs real training steps on this device", "",
             f"Device: {info.get('name')} ({info['device']}); torch {info['torch']}, transformers "
             f"{info.get('transformers', '-')}; models: '{info['size']}' configs with random weights; "
             f"{info['steps']} optimizer steps per case (the peak over them). Generated by "
             "`python bench/gpu_check.py`.",
             "", f"{len(rows)} cases: {len(ok)} ran, {len(failed)} failed"
             + (f"; {len(info['not_run'])} not started (--max-seconds)" if info.get("not_run") else "") + ".", ""]
    if on_cuda:
        context = info.get("cuda_context_bytes")
        lines += [f"- CUDA context of this process (NVML after the first tensor - before): {_mib(context)} MiB; "
                  f"memfit assumes {info['memfit_cuda_context_bytes'] / MiB:.0f} MiB. NVML via {info.get('nvml')}.",
                  "- allocated (max_memory_allocated, peak over the step's phases) vs memfit tensor bytes: "
                  + _stats([r["err_allocated_pct"] for r in ok if r["err_allocated_pct"] is not None]),
                  "- reserved (max_memory_reserved) vs memfit tensor + allocator reserve: "
                  + _stats([r["err_reserved_pct"] for r in ok if r["err_reserved_pct"] is not None]),
                  "- NVML used by this process (used - idle before the context) vs memfit total: "
                  + _stats([r["err_nvml_pct"] for r in ok if r["err_nvml_pct"] is not None]), ""]
    else:
        lines += ["- CPU: allocated is memfit.measure's profiler peak of live bytes, reserved and NVML do not exist "
                  "(null); memfit predicts on a CPU device (no runtime overhead terms).",
                  "- allocated vs memfit tensor bytes: "
                  + _stats([r["err_allocated_pct"] for r in ok if r["err_allocated_pct"] is not None]), ""]
    lines += ["| case | params M | allocated MiB | reserved MiB | NVML process MiB | memfit tensor MiB | "
              "memfit reserved MiB | memfit total MiB | alloc err % | reserved err % | NVML err % | peak (meas / "
              "memfit) | s |", "|" + "---|" * 13]
    for r in rows:
        if r["status"] != "ok":
            continue
        lines.append(f"| {r['case']} | {(r['params'] or 0) / 1e6:.1f} | {_mib(r['measured_allocated_bytes'])} | "
                     f"{_mib(r['measured_reserved_bytes'])} | {_mib(r['nvml_process_bytes'])} | "
                     f"{_mib(r['memfit_tensor_bytes'])} | {_mib(r['memfit_reserved_bytes'])} | "
                     f"{_mib(r['memfit_total_bytes'])} | {_p(r['err_allocated_pct'])} | {_p(r['err_reserved_pct'])} | "
                     f"{_p(r['err_nvml_pct'])} | {r['measured_peak_phase']} / {r['memfit_peak_phase']} | "
                     f"{r['seconds']} |")
    if failed:
        lines += ["", "## Failed cases", "", "| case | error |", "|---|---|"]
        lines += [f"| {r['case']} | {str(r['error']).replace('|', '/')} |" for r in failed]
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], info: dict, out_dir: Path) -> tuple[Path, Path]:
    stem = "gpu_check" if info["device"].startswith("cuda") else "gpu_check_cpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(render(rows, info), encoding="utf-8")
    js.write_text(json.dumps({"info": info, "columns": list(COLUMNS), "rows": rows}, indent=1), encoding="utf-8")
    return md, js


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="a few cases instead of the full matrix")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the results (default {DEFAULT_OUT})")
    parser.add_argument("--size", choices=sorted(CONFIGS), default=None,
                        help="model configs: tiny (default on cpu) or small (default on cuda)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per case (default 2)")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds (the results so far are written)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    size = args.size or ("tiny" if device == "cpu" else "small")
    cases = quick_cases(size) if args.quick else full_matrix(size)
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    out = Path(args.out)
    out = out if out.is_absolute() else REPO / out

    def progress(index: int, total: int, row: dict) -> None:
        status = (f"alloc {_p(row['err_allocated_pct'])}%" if row["status"] == "ok" else f"FAILED {row['error']}")
        print(f"[{index}/{total}] {row['case']}: {status} ({row['seconds']} s)", file=sys.stderr, flush=True)

    start = time.perf_counter()
    rows, info = run_cases(cases, device=device, size=size, steps=args.steps, progress=progress,
                           max_seconds=args.max_seconds)
    info["wall_seconds"] = round(time.perf_counter() - start, 1)
    md, js = write_results(rows, info, out)
    print(md.read_text(encoding="utf-8"))
    print(f"written: {md} and {js} ({info['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
