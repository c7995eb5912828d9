"""LitGPT's finetune recipes, read by memfit's LitGPT reader (memfit.readers.litgpt) and sized, against
(1) LitGPT's own model stepped on this CPU and (2) the peak memory LitGPT publishes for its config_hub recipes.

(1) Measured: litgpt 0.5.13's GPT (litgpt.lora.GPT with its LoRA, or litgpt.model.GPT for a full fine-tune) on a tiny
Llama-shaped config, under Lightning Fabric with the recipe's precision, stepped as finetune/lora.py `fit` steps it
(`model(input_ids, lm_head_chunk_size=128)`, `chunked_cross_entropy`, fabric.backward, AdamW): the profiler's peak over
building the model and two optimizer steps (every CPU allocation, oneDNN's matmul scratch left out, as
memfit._torch.measure_cpu.profiled_peak). memfit's side: the same recipe written as a LitGPT YAML, read by
memfit.readers.read_config (which sets model_code litgpt: memfit.estimate.litgpt), sized on the Hugging Face model of
the same shape; and, to split the error, that Hugging Face model stepped for real under the same setup
(memfit.measure). --quantize is not measured here: Lightning refuses its bitsandbytes plugin off CUDA.

(2) Out of sample: config_hub/finetune/README.md (Lightning-AI/litgpt, README last changed 2024-09-27, read at commit
26857050) lists "Peak memory" per recipe on an A10G: LitGPT prints torch.cuda.max_memory_allocated() / 1e9
(litgpt/utils.py), so the memfit figure beside it is the predicted max_memory_allocated in GB (1e9 B) for the recipe's
own settings (model, precision, LoRA flags, quantize, micro-batch, max_seq_length 512). Those runs train on Alpaca2k,
padded per batch to the longest sample (at most 512 tokens), and their peak covers the whole run; nothing here is
fitted to them. Recipes with lora_head true (LoRA on the output head, not sized), on more than one device, or of
models outside memfit's catalog are left out.

    python bench/litgpt_recipes.py      # prints the tables and writes bench/results/litgpt.md

(Not bench/litgpt.py: run as a script, its folder comes first on sys.path and the name would shadow the litgpt
package.)
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RESULTS = ROOT / "bench" / "results" / "litgpt.md"
H, I, LAYERS, HEADS, VOCAB, BATCH, SEQ = 64, 128, 2, 4, 512, 2, 256
TINY_HF = dict(model_type="llama", hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=512,
               tie_word_embeddings=False, rms_norm_eps=1e-5)
QV = dict(lora_query=True, lora_key=False, lora_value=True, lora_projection=False, lora_mlp=False)
ALL = dict(lora_query=True, lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True)
GROUPS = 2  # the grouped-query rows: 4 query heads over 2 key/value heads
MEASURED = (("LoRA q,v r8", "bf16-true", QV, HEADS), ("LoRA all r8", "bf16-true", ALL, HEADS),
            ("LoRA q,v r8", "32-true", QV, HEADS), ("LoRA q,v r8", "bf16-mixed", QV, HEADS),
            ("full", "bf16-true", None, HEADS), ("LoRA q,v r8, GQA", "bf16-true", QV, GROUPS),
            ("LoRA all r8, GQA", "bf16-true", ALL, GROUPS), ("full, GQA", "bf16-true", None, GROUPS))

PUBLISHED = (
    # config_hub/finetune/<dir>/<recipe>.yaml settings (model, micro-batch; every row: bf16-true, lora_r 32, alpha 16,
    # LoRA on query and value, max_seq_length 512) and the README's peak memory on 1 x A10G (GB)
    ("llama-2-7b/lora.yaml", "meta-llama/Llama-2-7b-hf", "lora", 2, 19.77),
    ("llama-2-7b/qlora.yaml", "meta-llama/Llama-2-7b-hf", "bnb.nf4", 2, 13.68),
    ("llama-3-8b/lora.yaml", "meta-llama/Meta-Llama-3-8B", "lora", 1, 19.73),
    ("llama-3-8b/qlora.yaml", "meta-llama/Meta-Llama-3-8B", "bnb.nf4", 2, 17.41),
    ("llama-3.1-8b/lora.yaml", "meta-llama/Meta-Llama-3.1-8B", "lora", 1, 19.73),
    ("llama-3.1-8b/qlora.yaml", "meta-llama/Meta-Llama-3.1-8B", "bnb.nf4", 2, 17.41),
    ("llama-3.2-1B/full.yaml", "meta-llama/Llama-3.2-1B", "full", 4, 8.70),
    ("llama-3.2-1B/lora.yaml", "meta-llama/Llama-3.2-1B", "lora", 1, 4.49),
    ("llama-3.2-1B/qlora.yaml", "meta-llama/Llama-3.2-1B", "bnb.nf4", 2, 5.53),
    ("llama-3.2-3B/full.yaml", "meta-llama/Llama-3.2-3B", "full", 4, 16.51),
    ("llama-3.2-3B/lora.yaml", "meta-llama/Llama-3.2-3B", "lora", 1, 9.67),
    ("llama-3.2-3B/qlora.yaml", "meta-llama/Llama-3.2-3B", "bnb.nf4", 2, 10.30),
    ("mistral-7b/lora.yaml", "mistralai/Mistral-7B-v0.1", "lora", 2, 20.66),
    ("mistral-7b/qlora.yaml", "mistralai/Mistral-7B-v0.1", "bnb.nf4", 2, 14.29),
)


def recipe_yaml(checkpoint: str, precision: str, flags: dict | None, *, quantize: str | None = None, rank: int = 8,
                micro: int = BATCH, seq: int = SEQ) -> dict:
    """A LitGPT finetune config as its YAML holds it (the keys of finetune_lora / finetune_full's setup)."""
    data = {"checkpoint_dir": f"checkpoints/{checkpoint}", "out_dir": "out/finetune", "precision": precision,
            "devices": 1, "num_nodes": 1,
            "train": {"global_batch_size": micro, "micro_batch_size": micro, "max_seq_length": seq},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.0002}}}
    if flags is not None:
        data.update(quantize=quantize, lora_r=rank, lora_alpha=16, lora_dropout=0.0, lora_head=False, **flags)
    return data


def read_setup(data: dict, model=None):
    """The TrainingSetup memfit's reader makes of a LitGPT config (through a YAML file, as `--config` reads it)."""
    import yaml

    from memfit.readers import read_config
    from memfit.setup import TrainingSetup

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "litgpt.yaml"
        path.write_text(yaml.safe_dump(data))
        reading = read_config(str(path))
    fields = {k: v for k, v in reading.overrides.items() if k != "num_gpus"}
    return TrainingSetup(**fields), reading


def litgpt_step(precision: str, flags: dict | None, groups: int = HEADS) -> int:
    """Peak bytes of LitGPT's own tiny GPT stepped as its finetune scripts step it (module build + 2 steps)."""
    import lightning as L
    import torch

    from litgpt.lora import GPT as LoraGPT, Config, mark_only_lora_as_trainable
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy
    from memfit._torch.measure_cpu import profiled_peak
    from memfit._torch.threads import step_threads

    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    shape = dict(name="tiny", block_size=512, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS,
                 n_head=HEADS, n_embd=H, n_query_groups=groups, rotary_percentage=1.0, parallel_residual=False,
                 bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=I)
    lora = dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, **flags) if flags is not None else {}
    config = Config(**shape, **lora)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ))
    # measure()'s thread count: some CPU kernels' scratch is per thread (memfit._torch.threads)
    with step_threads(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True) as prof:
        with fabric.init_module():
            model = LoraGPT(config) if flags is not None else GPT(config)
        if flags is not None:
            mark_only_lora_as_trainable(model)
        model = fabric.setup_module(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, foreach=False)
        optimizer = fabric.setup_optimizers(optimizer)
        for _ in range(2):
            logits = model(batch, lm_head_chunk_size=128)
            logits[-1] = logits[-1][..., :-1, :]
            fabric.backward(chunked_cross_entropy(logits, batch[..., 1:]))
            optimizer.step()
            optimizer.zero_grad()
    return profiled_peak(prof)


def measured_rows() -> list[dict]:
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.measure import measure
    from memfit.sources import resolve_model

    cpu = make_hardware(cpu_device(64 * 1024**3))
    rows = []
    for label, precision, flags, groups in MEASURED:
        setup, _ = read_setup(recipe_yaml("tiny/llama", precision, flags))
        setup = setup.replace(optimizer="adamw")  # torch's AdamW runs its for-loop kernel on CPU tensors
        shape = dict(TINY_HF, num_key_value_heads=groups)
        real = litgpt_step(precision, flags, groups)
        formula = estimate(resolve_model(dict(shape)), setup, cpu).tensor_bytes
        hf_formula = estimate(resolve_model(dict(shape)), setup.replace(model_code="hf"), cpu).tensor_bytes
        hf_real = measure(dict(shape), setup.replace(model_code="hf"), steps=2, device="cpu").tensor_bytes  # oneDNN scratch apart, as above
        rows.append(dict(label=label, precision=precision, setup=setup, real=real, formula=formula, hf=hf_real,
                         hf_formula=hf_formula))
        print(f"{label:14s} {precision:10s} LitGPT {real:>10,}  formula {formula:>10,}  HF real {hf_real:>10,}  "
              f"{(formula - real) / real:+.2%}", flush=True)
    return rows


def published_rows() -> list[dict]:
    from memfit.estimate.analytic import estimate
    from memfit.hardware import get_gpu, make_hardware
    from memfit.sources import resolve_model

    a10g = make_hardware(get_gpu("A10G"))
    rows = []
    for recipe, hub, kind, micro, published in PUBLISHED:
        flags = None if kind == "full" else QV
        data = recipe_yaml(hub, "bf16-true", flags, quantize=None if kind in ("full", "lora") else kind, rank=32,
                           micro=micro, seq=512)
        setup, reading = read_setup(data)
        result = estimate(resolve_model(reading.model), setup, a10g)
        predicted = result.allocated_bytes / 1e9
        spec = resolve_model(reading.model)
        floor = 8 * spec.num_params / 1e9 if kind == "full" else 0.0  # bf16 weights + gradients + 2 AdamW states
        rows.append(dict(recipe=recipe, model=reading.model, setup=setup, published=published, predicted=predicted,
                         floor=floor))
        print(f"{recipe:26s} published {published:6.2f} GB  memfit {predicted:6.2f} GB  "
              f"{(predicted - published) / published:+.1%}", flush=True)
    return rows


def _optimizer_of(setup) -> str:
    return str(setup.optimizer.value)


def write(measured: list[dict], published: list[dict]) -> str:
    lines = ["# LitGPT recipes: memfit's reader and formulas vs LitGPT's own model", "",
             "`python bench/litgpt_recipes.py` (litgpt 0.5.13, lightning 2.6.6, torch "
             f"{_torch_version()}). Each recipe is a LitGPT finetune YAML read by `memfit.readers` (the LitGPT "
             "reader, which sets model_code litgpt), sized by the formulas.", "",
             f"## Measured: LitGPT's GPT on this CPU (tiny Llama shape: h {H}, {LAYERS} layers, {HEADS} heads "
             f"(GQA rows: {GROUPS} key/value heads), vocab {VOCAB}; "
             f"micro-batch {BATCH} x {SEQ} tokens, 2 AdamW steps)", "",
             "| recipe | precision | memfit setup | LitGPT real peak (B) | memfit formula (B) | error | "
             "HF-code formula (B) | its error | HF model, same setup, real (B) | LitGPT vs HF |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in measured:
        s = r["setup"]
        lines.append(f"| {r['label']} | {r['precision']} | {s.precision.value}, {s.finetune} | {r['real']:,} | "
                     f"{r['formula']:,} | {(r['formula'] - r['real']) / r['real']:+.2%} | {r['hf_formula']:,} | "
                     f"{(r['hf_formula'] - r['real']) / r['real']:+.2%} | {r['hf']:,} | "
                     f"{(r['real'] - r['hf']) / r['hf']:+.2%} |")
    lines += ["", "## Out of sample: LitGPT's published peak memory (config_hub/finetune/README.md, 1 x A10G)", "",
              "| recipe | memfit model | memfit setup | published peak (GB) | memfit max_memory_allocated (GB) | "
              "error % |", "|---|---|---|---:|---:|---:|"]
    for r in published:
        s = r["setup"]
        impossible = r["published"] < r["floor"]
        error = ("— (below 8 B x params = {:.2f} GB)".format(r["floor"]) if impossible else
                 f"{100 * (r['predicted'] - r['published']) / r['published']:+.1f}%")
        lines.append(f"| {r['recipe']} | {r['model']} | {s.finetune}, micro {s.micro_batch_size} x {s.seq_len}, "
                     f"{_optimizer_of(s)} | {r['published']:.2f} | {r['predicted']:.2f} | {error} |")
    lines += ["", NOTES.strip(), ""]
    return "\n".join(lines)


NOTES = """
Notes:
- "LitGPT vs HF" is how far LitGPT's own module is from the Hugging Face model of the same shape under the same setup
  (both real steps); "HF-code formula" is memfit with model_code hf (what it sized before it knew LitGPT's module);
  "error" is memfit's formulas with model_code litgpt (set by the LitGPT reader; memfit.estimate.litgpt) against
  LitGPT. Read off the profiler's live tensors at the peak (litgpt 0.5.13 model.py, lora.py, utils.py; lightning
  fabric; memfit.estimate.litgpt has each term and how it was measured): the fused qkv output stays alive through
  v's view (GQA: k and v repeated to every query head are saved instead); with LoRA on some of q / k / v, zero_pad's
  index_copy_ keeps a B x T tensor; a trainable output projection keeps a copy of the attention output; with
  trainable norms, RMSNorm saves x_normed in fp32; Fabric casts the 128-token head chunks to fp32 and the loop holds
  them through backward, where every chunk's cross-entropy backward runs before any head backward.
- The two full fine-tunes' published peaks (Llama 3.2 1B and 3B, one A10G, bf16-true AdamW) are below what their
  weights, gradients and two AdamW states alone hold in bf16 (8 B per parameter; the 3B one above the A10G's 24 GB):
  no step of the recipe as configured fits under them, so they are not counted as errors. What those runs did
  differently is not known here.
- The published runs' batches are padded to their longest sample (Alpaca2k; at most 512 tokens) and the peak is the
  whole run's (validation and a generated sample included). QLoRA rows: LitGPT's bitsandbytes plugin also packs the
  output head (memfit keeps it 16-bit), LitGPT's adapters are 16-bit (memfit's peft recipe sizes them fp32), and
  PagedAdamW's states live in unified memory, outside max_memory_allocated, in both.
"""


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def main() -> None:
    warnings.simplefilter("ignore")
    measured = measured_rows()
    published = published_rows()
    text = write(measured, published)
    RESULTS.write_text(text)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
