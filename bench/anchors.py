"""memfit next to the memory estimators people already use, on the same measured ground-truth cases.

    python bench/anchors.py               # ~2-4 minutes on 2 CPU cores; prints the tables, writes
                                          # bench/results/anchors.md
    python bench/anchors.py --quick       # the tiny cases only

Ground truth: real CPU training steps (`memfit.measure`, 2 steps, torch.profiler memory events: the peak of live tensor
bytes). Every tool predicts the same step, and each row gives its predicted peak, its error against the measurement
and the time one estimate takes (median of repeats after a warm-up; what the time covers is in `TOOLS`).

Tools (an adapter each; an adapter returns a prediction or None with the reason, never raises):

- memfit analytic: `memfit.estimate.analytic.estimate(resolve_model(config), setup, cpu hardware)`.
- memfit traced: `memfit.trace.trace(config, setup)`, the step on fake tensors.
- accelerate: `accelerate estimate-memory`'s own functions: the model built on the meta device
  (`init_empty_weights`, fp32, as its CLI does), `calculate_maximum_sizes`, `estimate_training_usage`; the number is its
  "Training using Adam" column (the largest of model / gradients / optimizer / step, as the CLI prints it). The CLI
  itself only takes hub ids (and builds the headless `AutoModel`); for configs that are not on the hub the same
  functions are called on the task model (`AutoModelFor{CausalLM,MaskedLM}`) that the measurement trains.
- DeepSpeed: `estimate_zero2_model_states_mem_needs_all_cold` / `estimate_zero3_..._all_cold` (1 GPU, no offload, the
  default buffer factor). They print a table rounded to 0.01 GB; the value is taken at full precision from the
  functions they print (`estimate_zero{2,3}_model_states_mem_needs`, same arguments). The counts they need are taken
  the way DeepSpeed's `*_all_live` does (`model_to_params`), from a meta-device model, but de-duplicated by identity:
  `*_all_live` de-duplicates by `data_ptr`, which is 0 for every meta tensor (FACTS.md).
- llm-analysis (PyPI, 0.2.2): `LLMAnalysis(...).training(...)`, total "(weight+op_state+grad+act)_memory_per_gpu".
  Its release declares transformers<5 and huggingface-hub<0.15, so pip cannot install it next to this project's
  transformers 5.x; it imports transformers only to fetch hub configs, and runs offline when installed with
  `pip install --no-deps llm-analysis==0.2.2 fire==0.5.0 six termcolor`. Without it the rows say why.
- torch MemTracker: `torch.distributed._tools.mem_tracker.MemTracker` around the same step (memfit's step loop), on
  fake tensors, entered inside the FakeTensorMode (FACTS.md); its peak over two steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.setup import Checkpointing, Precision, TrainingSetup  # noqa: E402

MIB = 2**20
RESULTS = HERE / "results" / "anchors.md"

# A mid-size Llama: 58M parameters, a 32k vocabulary; one fp32 step at B=2, T=512 peaks at 1.39 GiB of tensors on CPU
# (2.7 GiB process RSS for the whole bench), ~40 s for two profiled steps on 2 cores.
MID_LLAMA = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: dict
    setup: TrainingSetup


def _setup(**overrides) -> TrainingSetup:
    base = {"micro_batch_size": 2, "seq_len": 128, "precision": "fp32", "optimizer": "adamw"}
    return TrainingSetup(**{**base, **overrides})


TINY_CASES = [
    Case("tiny Llama, fp32 AdamW, B=2 T=128", TINY_CONFIGS["llama"], _setup()),
    Case("tiny Llama, pure bf16, B=2 T=128", TINY_CONFIGS["llama"], _setup(precision="bf16")),
    Case("tiny Llama, gradient checkpointing, B=2 T=128", TINY_CONFIGS["llama"], _setup(checkpointing="full")),
    Case("tiny Llama, fp32, B=1 T=64", TINY_CONFIGS["llama"], _setup(micro_batch_size=1, seq_len=64)),
    Case("tiny Llama, fp32, B=4 T=256", TINY_CONFIGS["llama"], _setup(micro_batch_size=4, seq_len=256)),
    Case("tiny Llama, fp32, B=8 T=512", TINY_CONFIGS["llama"], _setup(micro_batch_size=8, seq_len=512)),
    Case("tiny GPT-2, fp32 AdamW, B=2 T=128", TINY_CONFIGS["gpt2"], _setup()),
    Case("tiny GPT-2, pure bf16, B=2 T=128", TINY_CONFIGS["gpt2"], _setup(precision="bf16")),
    Case("tiny BERT, fp32 AdamW, B=2 T=128", TINY_CONFIGS["bert"], _setup()),
    Case("tiny Qwen2, fp32 AdamW, B=2 T=128", TINY_CONFIGS["qwen2"], _setup()),
]
MID_CASES = [
    Case("mid Llama (58M, vocab 32k), fp32 AdamW, B=2 T=512", MID_LLAMA, _setup(seq_len=512)),
    Case("mid Llama (58M, vocab 32k), pure bf16 + checkpointing, B=2 T=512", MID_LLAMA,
         _setup(seq_len=512, precision="bf16", checkpointing="full")),
]
SMOKE_CASE = Case("tiny Llama, fp32 AdamW, B=1 T=32", TINY_CONFIGS["llama"], _setup(micro_batch_size=1, seq_len=32))


@dataclasses.dataclass
class Prediction:
    """A tool's answer: peak bytes (None when it cannot answer) and what it counts, or why there is no number."""

    peak_bytes: int | None
    note: str


@dataclasses.dataclass
class Row:
    tool: str
    peak_bytes: int | None
    seconds: float | None
    note: str

    def error_pct(self, measured: int) -> float | None:
        return None if self.peak_bytes is None else 100.0 * (self.peak_bytes - measured) / measured


# ---- adapters --------------------------------------------------------------------------------------------------

def memfit_analytic(case: Case) -> Prediction:
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.sources import resolve_model

    est = estimate(resolve_model(case.config), case.setup, make_hardware(cpu_device(64 * 1024**3)))
    return Prediction(est.tensor_bytes, f"whole step: static + activations + temporaries at the peak "
                                        f"({est.peak_phase.value}), formulas")


def memfit_traced(case: Case) -> Prediction:
    from memfit.trace import trace

    est = trace(case.config, case.setup)
    return Prediction(est.tensor_bytes, f"whole step on fake tensors, every allocation ({est.peak_phase.value})")


def _meta_model(config: dict, dtype=None):
    """The task model measure() trains (causal / masked LM), on the meta device, the way accelerate builds one."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    from memfit._torch.step import MASKED_LM_TYPES, hf_config_from_dict

    hf_config = hf_config_from_dict(dict(config))
    auto = (transformers.AutoModelForMaskedLM if hf_config.model_type in MASKED_LM_TYPES
            else transformers.AutoModelForCausalLM)
    with init_empty_weights():
        return auto.from_config(hf_config, dtype=dtype or torch.float32)


def accelerate_estimate(case: Case) -> Prediction:
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total_size, _largest = calculate_maximum_sizes(_meta_model(case.config))  # fp32 sizes, as the CLI measures
    if case.setup.precision is Precision.FP32:
        dtype, what = "float32", "4 x fp32 model size (weights + grads + 2 Adam states)"
    elif case.setup.precision in (Precision.BF16, Precision.BF16_MASTER, Precision.AMP_BF16):
        dtype, what = "bfloat16", "2 x fp32 model size (its mixed-precision row; no pure-bf16 row)"
    else:
        return Prediction(None, f"no row for {case.setup.precision}")
    usage = estimate_training_usage(total_size, dtype)
    return Prediction(int(max(usage.values())), f"'Training using Adam': {what}; no activations")


def _param_counts(config: dict) -> tuple[int, int]:
    """(total, largest layer) as DeepSpeed's model_to_params counts them, shared tensors once (by identity)."""
    model = _meta_model(config)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def deepspeed_zero2(case: Case) -> Prediction:
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)

    total, _ = _param_counts(case.config)
    with contextlib.redirect_stdout(io.StringIO()):
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=1, num_nodes=1)
    _cpu, gpu = estimate_zero2_model_states_mem_needs(total, 1, 1, cpu_offload=False)
    return Prediction(gpu, "model states only: 2 + 18 B/param (fp16 weights, fp32 master + grads + Adam), 1 GPU")


def deepspeed_zero3(case: Case) -> Prediction:
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)

    total, largest = _param_counts(case.config)
    with contextlib.redirect_stdout(io.StringIO()):
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=1, num_nodes=1)
    _cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 1, 1, cpu_offload=False,
                                                         cpu_offload_params=False, zero_init=True)
    return Prediction(gpu, "model states only: 18 B/param + 4 B x largest layer, 1 GPU")


def llm_analysis(case: Case) -> Prediction:
    try:
        from llm_analysis.analysis import ActivationRecomputation, LLMAnalysis
        from llm_analysis.config import DtypeConfig, GPUConfig, ModelConfig
        from llm_analysis.logger import logger
    except ImportError:
        return Prediction(None, "not installed: its PyPI release (0.2.2) declares transformers<5; "
                                "`pip install --no-deps llm-analysis==0.2.2 fire==0.5.0 six termcolor`")
    from memfit._torch.step import hf_config_from_dict
    from memfit.sources import resolve_model

    logger.setLevel(logging.ERROR)
    spec = resolve_model(case.config)
    c = case.config
    model = ModelConfig(
        name=c["model_type"], num_layers=spec.num_layers, n_head=spec.num_attention_heads, hidden_dim=spec.hidden_size,
        vocab_size=spec.vocab_size, max_seq_len=max(case.setup.seq_len, spec.max_position_embeddings or 0),
        num_key_value_heads=spec.num_kv_heads, ffn_embed_dim=spec.intermediate_size, model_type=c["model_type"])
    # Memory does not depend on the GPU; it needs one for its latency model (A100-SXM-80GB's numbers).
    gpu = GPUConfig(name="a100-sxm-80gb", mem_per_GPU_in_GB=80, hbm_bandwidth_in_GB_per_sec=2039,
                    intra_node_bandwidth_in_GB_per_sec=300, intra_node_min_message_latency=8e-06,
                    peak_fp16_TFLOPS=312)
    hf_config = hf_config_from_dict(dict(c))
    dropout = max(float(getattr(hf_config, key, 0.0) or 0.0)
                  for key in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"))
    summary = LLMAnalysis(model, gpu, DtypeConfig()).training(  # w16a16e16: it rejects 32-bit weights
        batch_size_per_gpu=case.setup.micro_batch_size, gradient_accumulation_steps=case.setup.grad_accum_steps,
        seq_len=case.setup.seq_len,
        activation_recomputation=(ActivationRecomputation.FULL if case.setup.checkpointing is Checkpointing.FULL
                                  else ActivationRecomputation.NONE),
        flash_attn=str(case.setup.attention) == "sdpa" and dropout == 0.0, softmax_dropout=dropout > 0.0,
        mlp_gated_linear_units=spec.gated_mlp)
    what = "16-bit weights + fp32 master, grads, Adam + activations (Megatron formulas)"
    if case.setup.precision is Precision.FP32:
        what += "; it rejects 32-bit weights, so its mixed-precision mode"
    return Prediction(int(summary["(weight+op_state+grad+act)_memory_per_gpu"]), what)


def memtracker(case: Case) -> Prediction:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as exc:
        return Prediction(None, f"torch without MemTracker ({exc})")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.trace.session import build_hf_session

    fake_mode = FakeTensorMode()
    with fake_mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")  # its backward hooks on freed modules
        session = build_hf_session(dict(case.config), case.setup)
        tracker = MemTracker()  # entered inside the FakeTensorMode (FACTS.md)
        tracker.track_external(session.model, session.optimizer, session.batch)
        with tracker:
            for _ in range(2):
                session.run(lambda phase: None)
                tracker.reset_mod_stats()
        peak = max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    return Prediction(int(peak), "whole step on fake tensors (memfit's step loop), per-module bookkeeping")


TOOLS: list[tuple[str, Callable[[Case], Prediction], str]] = [
    ("memfit analytic", memfit_analytic, "resolve the config + estimate"),
    ("memfit traced", memfit_traced, "build on fake tensors + 2 steps"),
    ("accelerate estimate-memory", accelerate_estimate, "meta model build + sizes"),
    ("DeepSpeed ZeRO-2 cold", deepspeed_zero2, "meta model counts + the estimate"),
    ("DeepSpeed ZeRO-3 cold", deepspeed_zero3, "meta model counts + the estimate"),
    ("llm-analysis", llm_analysis, "configs + training()"),
    ("torch MemTracker", memtracker, "build on fake tensors + 2 steps"),
]


# ---- harness ---------------------------------------------------------------------------------------------------

def timed(fn: Callable[[Case], Prediction], case: Case, budget_s: float = 0.5,
          max_repeats: int = 20) -> tuple[Prediction, float]:
    """The prediction and the median seconds per call: fast tools are repeated within `budget_s`."""
    times = []
    while True:
        start = time.perf_counter()
        prediction = fn(case)
        times.append(time.perf_counter() - start)
        if prediction.peak_bytes is None or len(times) >= max_repeats or sum(times) >= budget_s:
            return prediction, statistics.median(times)


def run_tool(fn: Callable[[Case], Prediction], case: Case, **kwargs) -> Row:
    name = next((n for n, f, _ in TOOLS if f is fn), fn.__name__)
    try:
        prediction, seconds = timed(fn, case, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is a result, recorded in the table
        message = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        return Row(name, None, None, f"failed: {type(exc).__name__}: {message}")
    return Row(name, prediction.peak_bytes, seconds if prediction.peak_bytes is not None else None,
               prediction.note)


def warm_up(case: Case = SMOKE_CASE) -> None:
    """Imports and first-call caches, so that the timed calls are what a user's second call costs."""
    for _, fn, _ in TOOLS:
        with contextlib.suppress(Exception):
            fn(case)


def measure_case(case: Case) -> tuple[int, float]:
    from memfit.measure import measure

    start = time.perf_counter()
    measured = measure(dict(case.config), case.setup, steps=2, device="cpu")
    return measured.tensor_bytes, time.perf_counter() - start


def run_case(case: Case) -> tuple[int, float, list[Row]]:
    measured, seconds = measure_case(case)
    return measured, seconds, [run_tool(fn, case) for _, fn, _ in TOOLS]


def render_case(case: Case, measured: int, measured_s: float, rows: list[Row]) -> str:
    lines = [f"### {case.name}", "",
             f"Measured peak: **{measured / MIB:.2f} MiB** (real CPU step, profiler; {measured_s:.1f} s for 2 steps).",
             "", "| tool | predicted MiB | error % | ms / estimate | what it counts |", "|---|---:|---:|---:|---|"]
    for row in rows:
        err = row.error_pct(measured)
        lines.append(f"| {row.tool} | {'—' if row.peak_bytes is None else f'{row.peak_bytes / MIB:.2f}'} | "
                     f"{_pct(err)} | "
                     f"{'—' if row.seconds is None else _ms(row.seconds)} | {row.note} |")
    return "\n".join(lines) + "\n"


COUNTS = {
    "memfit analytic": "whole step (formulas)",
    "memfit traced": "whole step (fake tensors)",
    "accelerate estimate-memory": "params + grads + Adam (4x / 2x model size)",
    "DeepSpeed ZeRO-2 cold": "model states (20 B/param)",
    "DeepSpeed ZeRO-3 cold": "model states (18 B/param + largest layer)",
    "llm-analysis": "model states + activations (mixed precision)",
    "torch MemTracker": "whole step (fake tensors)",
}


def render_summary(results: list[tuple[Case, int, float, list[Row]]]) -> str:
    """Per tool: median |error| and worst error over the tiny cases, each mid-size case's error, and times."""
    tiny = [r for r in results if r[0] not in MID_CASES]
    mid = [r for r in results if r[0] in MID_CASES]
    lines = ["| tool | counts | median abs error, tiny | worst, tiny | mid Llama fp32 / bf16+ckpt | "
             "ms / estimate, tiny (median) / mid fp32 |", "|---|---|---:|---:|---:|---:|"]
    for tool, _, _ in TOOLS:
        errs = [row.error_pct(meas) for _, meas, _, rows in tiny for row in rows
                if row.tool == tool and row.peak_bytes is not None]
        mid_errs = [row.error_pct(meas) for _, meas, _, rows in mid for row in rows if row.tool == tool]
        tiny_times = [row.seconds for _, _, _, rows in tiny for row in rows if row.tool == tool and row.seconds]
        mid_times = [row.seconds for _, _, _, rows in mid[:1] for row in rows if row.tool == tool]
        cells = [COUNTS.get(tool, ""),
                 f"{statistics.median(abs(e) for e in errs):.1f}%" if errs else "—",
                 f"{_pct(max(errs, key=abs))}%" if errs else "—",
                 " / ".join("—" if e is None else f"{_pct(e)}%" for e in mid_errs) if mid_errs else "—",
                 " / ".join([_ms(statistics.median(tiny_times)) if tiny_times else "—"]
                            + ["—" if t is None else _ms(t) for t in mid_times])]
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(err: float | None) -> str:
    if err is None:
        return "—"
    return f"{err:+.2f}" if abs(err) < 1 else f"{err:+.1f}"


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}" if ms < 100 else f"{ms:,.0f}"


def _versions() -> str:
    import importlib.metadata as md
    import platform

    parts = []
    for dist in ("torch", "transformers", "accelerate", "deepspeed", "llm-analysis"):
        try:
            parts.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"Python {platform.python_version()}, " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cases = TINY_CASES + ([] if "--quick" in argv else MID_CASES)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warm_up()
    results = []
    for case in cases:
        measured, seconds, rows = run_case(case)
        results.append((case, measured, seconds, rows))
        print(render_case(case, measured, seconds, rows), flush=True)
    summary = render_summary(results)
    print(summary)
    text = "\n".join([
        "# memfit next to the anchors",
        "",
        "Generated by `python bench/anchors.py` (tools and how each is called: the module docstring). Ground truth: "
        "real CPU training steps measured by `memfit.measure` (2 steps, profiler memory events, peak of live tensor "
        "bytes). Error % = (predicted - measured) / measured. Time: median wall time of one estimate after a "
        "warm-up, on this machine's CPU; the analytic and fake-tensor tools never allocate the model.",
        "",
        _versions() + ".",
        "",
        "## Summary",
        "",
        summary,
        "## Cases",
        "",
        *[render_case(*r) for r in results],
    ])
    if "--quick" not in argv:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
