"""The plan does what the user asked: explicit choices are kept (or their change is stated), --keep pins fields, no
step changes a field without naming it, no bf16 on GPUs without it, one answer to "how many GPUs", suggestions that
fit the bottleneck, and --optimize sized with the plan's estimator."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from memfit.api import typical_setup
from memfit.cli.app import app
from memfit.diagnose import Bottleneck, diagnose
from memfit.errors import ConfigError
from memfit.estimate.analytic import estimate
from memfit.hardware import get_gpu, make_hardware
from memfit.techniques import REGISTRY
from memfit.techniques.base import static_over_budget
from memfit.plan import optimize, plan
from memfit.search import candidate_setups
from memfit.setup import FIELD_LABELS, KEEP_NAMES, Checkpointing, Sharding, TrainingSetup
from memfit.sources import resolve_model

NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
BF16_PRECISIONS = {"amp-bf16", "bf16", "bf16-master"}


def invoke(*args: str):
    return CliRunner(env=NARROW).invoke(app, list(args))


def cli_json(*args: str) -> dict:
    """The plan's JSON; the exit code may say that it does not fit (1), never a usage error."""
    result = invoke(*args, "--json")
    assert result.exit_code in (0, 1), (result.output, result.exception)
    return json.loads(result.stdout)


def changed_fields(before: TrainingSetup, after: TrainingSetup) -> list[tuple[str, object, object]]:
    """Computed here, not with memfit's helper, so a rung that changes a field behind the helper's back fails."""
    return [(name, getattr(before, name), getattr(after, name)) for name in before.to_dict()  # technique fields too
            if name != "notes" and getattr(before, name) != getattr(after, name)]


# --- 1. explicit choices and --keep --------------------------------------------------------------------------------

EXPLICIT_8B = dict(precision="bf16-master", optimizer="adamw-fused", engine="torch", num_gpus=4)


def test_explicit_choices_are_kept_when_other_rungs_fit():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("H100", gpus_per_node=4)
    setup = TrainingSetup(**EXPLICIT_8B)
    asked = plan(spec, setup, hw, explicit=frozenset(EXPLICIT_8B))
    assert asked.fits
    final = asked.final_setup
    assert (final.precision.value, final.optimizer.value, final.engine.value) == ("bf16-master", "adamw-fused", "torch")
    # Without knowing what was asked, the cheapest rungs do change them (what the issue saw):
    blind = plan(spec, setup, hw)
    assert blind.final_setup.precision.value == "bf16" and blind.final_setup.optimizer.value == "adamw-8bit"


def test_cli_keeps_the_options_given():
    data = cli_json("plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "4", "--engine", "torch",
                    "--precision", "bf16-master", "--optimizer", "adamw-fused")
    assert data["fits"] and set(data["explicit"]) >= {"precision", "optimizer", "engine", "num_gpus"}
    final = data["final_setup"]
    assert (final["precision"], final["optimizer"], final["engine"]) == ("bf16-master", "adamw-fused", "torch")


def test_an_explicit_field_is_changed_only_with_its_reason():
    # 8 GiB of host RAM: too little for any CPU offload of a 3B model; pure bf16 brings static memory under the
    # budget, so the activation rungs are open and micro-batch is the last rung left. 23 GiB, not 24: on 24 GiB the
    # compiled micro-batch-4 step fits once the allocator's free-and-retry at the limit is counted (diagnose)
    spec, hw = resolve_model("llama-3.2-3b"), make_hardware("23GiB", cpu_ram="8GiB")
    setup = TrainingSetup(micro_batch_size=4, seq_len=8192)
    result = plan(spec, setup, hw, explicit=frozenset({"micro_batch_size", "seq_len"}))
    (step,) = [s for s in result.steps if s.technique == "micro_batch"]
    assert step.why.startswith("you asked for micro-batch 4; this rung changes it to 1 because ")
    index = result.steps.index(step)
    for s in result.steps[:index]:  # kept back until no seed rung that leaves it alone was left
        assert "you asked for" not in s.why and s.setup.micro_batch_size == 4
        assert not REGISTRY[s.technique].beyond_seed
    # after it: the method (LoRA / QLoRA), or a rung that saved nothing before and saves now (asked again after
    # every step), none of them changing the fields asked for
    for s in result.steps[index + 1:]:
        assert "you asked for" not in s.why and s.setup.micro_batch_size == 1


def test_keep_pins_fields_and_the_skip_names_the_pin():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("A100-80GB")
    result = plan(spec, TrainingSetup(), hw, keep=frozenset({"precision", "optimizer"}))
    for step in result.steps:
        assert step.setup.precision.value == "amp-bf16" and step.setup.optimizer.value == "adamw-foreach"
    skipped = dict(result.skipped)
    assert skipped["mixed precision"] == "it would change precision amp-bf16 -> bf16, which --keep precision pins"
    assert "--keep optimizer pins" in skipped["8-bit AdamW"]


def test_keep_on_the_command_line():
    data = cli_json("plan", "llama-3.1-8b", "--gpu", "RTX-4090", "--gpus", "2", "--zero", "zero3",
                    "--keep", "precision,optimizer,batch")
    assert data["keep"] == ["micro_batch_size", "optimizer", "precision"]
    for step in data["steps"]:
        assert (step["setup"]["precision"], step["setup"]["optimizer"], step["setup"]["micro_batch_size"]) == \
            ("amp-bf16", "adamw-foreach", 8)
    reasons = {s["technique"]: s["reason"] for s in data["skipped"]}
    assert "--keep micro_batch pins" in reasons["smaller micro-batch + gradient accumulation"]
    bad = invoke("plan", "gpt2", "--keep", "precision,colour")
    assert bad.exit_code == 2 and len(bad.stderr.splitlines()) == 1
    named = bad.stderr.split("choose from ", 1)[1].strip().split(", ")
    assert "colour" in bad.stderr and set(named) == set(KEEP_NAMES)


# --- 2. no silent change: every field that differs is named in the step -------------------------------------------

MATRIX = [
    ("llama-3.1-8b", "RTX-4090", 2, dict(sharding="zero3", num_gpus=2), frozenset({"sharding", "num_gpus"})),
    ("llama-3.1-8b", "H100", 4, EXPLICIT_8B, frozenset(EXPLICIT_8B)),
    ("llama-3.1-8b", "H100", 4, EXPLICIT_8B, frozenset()),
    ("llama-3.1-8b", "H100", 1, dict(micro_batch_size=1, seq_len=131072), frozenset({"micro_batch_size", "seq_len"})),
    ("mistral-7b", "24GiB", 1, dict(micro_batch_size=4, seq_len=4096), frozenset({"micro_batch_size", "seq_len"})),
    ("llama-2-70b", "H100", 8, dict(num_gpus=8), frozenset()),
    ("llama-2-70b", "A100-40GB", 1, dict(precision="fp32", optimizer="adamw"), frozenset({"precision"})),
    ("llama-3.2-3b", "V100-32GB", 1, dict(precision="amp-fp16"), frozenset()),
    ("gpt2", "T4", 1, dict(micro_batch_size=16, seq_len=1024, precision="fp32", attention="eager"),
     frozenset({"attention"})),
    ("qwen2.5-7b", "L4", 2, dict(num_gpus=2, engine="torch", optimizer="adamw-8bit"), frozenset({"engine"})),
]


@pytest.mark.parametrize("model,gpu,gpus,fields,explicit", MATRIX)
def test_every_changed_field_is_named_in_its_step(model, gpu, gpus, fields, explicit):
    result = plan(resolve_model(model), TrainingSetup(**fields), make_hardware(gpu, gpus_per_node=gpus),
                  explicit=explicit)
    assert result.steps
    before = result.initial_setup
    for step in result.steps:
        changes = changed_fields(before, step.setup)
        assert changes, step.technique
        for name, old, new in changes:
            assert f"{FIELD_LABELS[name]} {old} -> {new}" in step.why, (step.technique, name, step.why)
            if name in explicit:
                assert f"you asked for {FIELD_LABELS[name]} {old}" in step.why, (step.technique, step.why)
        before = step.setup


def test_offload_states_what_it_turns_back():
    result = plan(resolve_model("llama-3.1-8b"), TrainingSetup(sharding="zero3", num_gpus=2),
                  make_hardware("RTX-4090", gpus_per_node=2))
    (offload,) = [s for s in result.steps if s.technique == "cpu_offload"]
    assert "precision bf16 -> bf16-master" in offload.why and "optimizer adamw-8bit -> adamw" in offload.why
    assert "CPU Adam" in offload.why


# --- 3. GPUs without bf16 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["T4", "V100-32GB", "V100-16GB"])
def test_gpus_without_bf16_default_to_fp16_and_refuse_bf16(gpu):
    spec, hw = resolve_model("llama-3.2-3b"), make_hardware(gpu)
    setup = typical_setup(spec, hw)
    assert setup.precision.value == "amp-fp16"
    assert any("has no bf16" in note for note in setup.notes)
    assert any("precision amp-fp16" in note for note in setup.notes if note.startswith("assumed:"))
    for precision in sorted(BF16_PRECISIONS):
        with pytest.raises(ConfigError, match="has no bf16"):
            typical_setup(spec, hw, precision=precision)
        with pytest.raises(ConfigError, match="has no bf16"):
            plan(spec, TrainingSetup(precision=precision), hw)
    assert typical_setup(spec, make_hardware("A100-80GB")).precision.value == "amp-bf16"


@pytest.mark.parametrize("model,start", [("llama-3.2-3b", "amp-fp16"), ("gpt2", "fp32"), ("llama-3.1-8b", "fp32"),
                                         ("mistral-7b", "amp-fp16")])
@pytest.mark.parametrize("gpu,gpus", [("T4", 1), ("V100-32GB", 1), ("V100-16GB", 4)])
def test_no_rung_proposes_bf16_on_a_gpu_without_it(model, start, gpu, gpus):
    spec, hw = resolve_model(model), make_hardware(gpu, gpus_per_node=gpus)
    setup = TrainingSetup(precision=start, num_gpus=gpus, seq_len=1024)
    result = plan(spec, setup, hw)
    assert all(s.setup.precision.value not in BF16_PRECISIONS for s in result.steps)
    assert all(c.precision.value not in BF16_PRECISIONS for c in candidate_setups(setup, hw))
    choice = optimize(spec, setup, hw)
    assert choice is None or choice.setup.precision.value not in BF16_PRECISIONS


def test_cli_on_a_t4_pastes_fp16_and_refuses_bf16():
    out = invoke("plan", "gpt2", "--gpu", "T4", "-b", "16", "-s", "1024")
    assert out.exit_code == 0 and "fp16=True" in out.stdout and "bf16=True" not in out.stdout
    bad = invoke("plan", "llama-3.2-3b", "--gpu", "V100-32GB", "--precision", "bf16-master")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "V100-32GB has no bf16" in bad.stderr


# --- 4. one answer to "how many GPUs" ------------------------------------------------------------------------------

def test_the_zero_rung_and_the_suggestion_give_one_gpu_count():
    # 64 GiB of host RAM: one GPU cannot offload (see the CPU offload rung), so only more GPUs fit
    spec, hw = resolve_model("mistral-7b"), make_hardware("24GiB", cpu_ram="64GiB")
    asked = frozenset({"micro_batch_size", "seq_len"})
    result = plan(spec, TrainingSetup(micro_batch_size=4, seq_len=4096), hw, explicit=asked,
                  keep=frozenset({"finetune"}))
    assert not result.fits  # a full fine-tune (LoRA would fit: the method is pinned)
    (more,) = [s for s in result.suggestions if s.startswith("more GPUs:")]
    assert dict(result.skipped)["ZeRO sharding"].endswith("; " + more)
    # static memory alone is still over one GPU, so the count is the ladder walked again on more GPUs: ZeRO-3 and
    # the activation rungs it then needs, the micro-batch asked for left alone
    found = result.more_gpus  # what the suggestion says, as the plan holds it
    num_gpus = found.num_gpus
    assert f"fits on {num_gpus} x custom-24GiB (--gpus {num_gpus})" in more
    assert (found.setup.sharding, found.setup.checkpointing, found.setup.micro_batch_size, found.setup.num_gpus) == (
        Sharding.ZERO3, Checkpointing.FULL, 4, num_gpus)
    assert dict(result.skipped)["CPU offload of optimizer states"].startswith("host RAM is the limit: offload needs")
    # It is the fewest: the ladder does not fit on half as many; taking that many GPUs, it fits.
    def walked(n: int) -> bool:
        hw_n = make_hardware("24GiB", gpus_per_node=n, cpu_ram="64GiB")
        return plan(spec, result.final_setup.replace(num_gpus=n), hw_n, explicit=asked,
                    keep=frozenset({"finetune"})).fits
    assert walked(num_gpus) and (num_gpus // 2 < 2 or not walked(num_gpus // 2))


def test_keep_gpus_turns_the_gpu_count_off():
    result = plan(resolve_model("llama-2-70b"), TrainingSetup(), make_hardware("H100"),
                  keep=frozenset({"num_gpus", "finetune"}))
    assert not result.fits
    assert "more GPUs: not considered, --keep gpus pins 1" in result.suggestions


# --- 5. suggestions that fit the bottleneck ------------------------------------------------------------------------

def test_activation_bound_plan_suggests_what_cuts_activations():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("H100")
    result = plan(spec, TrainingSetup(micro_batch_size=1, seq_len=131072), hw, keep=frozenset({"loss"}))
    assert result.final_diagnosis.bottleneck is Bottleneck.ACTIVATIONS
    assert not any("LoRA" in s for s in result.suggestions)
    (seq_line,) = [s for s in result.suggestions if s.startswith("a shorter sequence:")]
    seq = int(seq_line.split("seq ")[1].split()[0])
    final = result.final_setup

    def fits(n: int) -> bool:
        return diagnose(estimate(spec, final.replace(seq_len=n), hw), hw).fits

    assert seq % 64 == 0 and fits(seq) and not fits(seq + 64)
    assert any(s.startswith("not sized by memfit yet:") and "sequence / context parallelism" in s
               for s in result.suggestions)
    assert any(s.startswith("a fused cross-entropy") for s in result.suggestions)
    # with the loss free to change, the fused loss rung makes the same step fit
    assert plan(spec, TrainingSetup(micro_batch_size=1, seq_len=131072), hw).final_setup.loss.value != "standard"


def test_pinned_activation_rungs_are_suggested_with_their_size():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("H100")
    result = plan(spec, TrainingSetup(micro_batch_size=4, seq_len=8192, precision="bf16"), hw,
                  keep=frozenset({"checkpointing", "micro_batch_size", "seq_len"}))
    assert result.final_diagnosis.bottleneck in (Bottleneck.ACTIVATIONS, Bottleneck.BOTH)
    text = "\n".join(result.suggestions)
    ckpt = estimate(spec, result.final_setup.replace(checkpointing="full"), hw)
    assert f"gradient checkpointing: {ckpt.total_bytes / 2**30:.2f} GiB" in text and "--keep checkpointing" in text
    assert "micro-batch 1 x accum 4:" in text and "--keep micro_batch pins it" in text
    assert "a shorter sequence: not considered, --keep seq pins seq 8192" in text


def test_static_bound_plan_suggests_lora_and_gpus():
    result = plan(resolve_model("llama-2-70b"), TrainingSetup(), make_hardware("H100"), keep=frozenset({"finetune"}))
    assert static_over_budget(result.final_estimate, result.final_diagnosis)  # so no activation suggestion either
    assert dict(result.skipped)["LoRA (beyond the seed)"].endswith("--keep finetune pins")
    (lora,) = [s for s in result.suggestions if s.startswith("LoRA / QLoRA:")]
    assert "--keep finetune" in lora
    assert any(s.startswith("more GPUs: it fits on 8 x H100-80GB") for s in result.suggestions)
    assert not any(s.startswith("a shorter sequence") for s in result.suggestions)


# --- 6. --optimize sizes with the plan's estimator -----------------------------------------------------------------

def test_optimize_uses_its_estimator_and_keeps_pins():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("24GiB")
    setup = TrainingSetup(micro_batch_size=2)
    assert optimize(spec, setup, hw) is None  # the analytic model: nothing fits on 24 GiB
    calls = []

    def small(spec_, setup_, hw_):
        calls.append(setup_)
        est = estimate(spec_, setup_, hw_)
        return dataclasses.replace(est, terms=tuple(dataclasses.replace(t, num_bytes=t.num_bytes // 100)
                                                    for t in est.terms))

    choice = optimize(spec, setup, hw, estimator=small, keep=frozenset({"precision"}))
    assert calls and choice is not None
    assert choice.estimate.total_bytes < diagnose(choice.estimate, hw).budget_bytes
    assert choice.setup.precision.value == "amp-bf16"
    assert all(c.precision.value == "amp-bf16" for c in calls)


def test_optimize_marks_a_change_to_what_was_asked():
    spec, hw = resolve_model("llama-3.1-8b"), make_hardware("A100-80GB")
    setup = TrainingSetup(precision="bf16-master")
    choice = optimize(spec, setup, hw, explicit=frozenset({"precision"}))
    assert choice is not None
    if choice.setup.precision.value != "bf16-master":
        assert any(d.startswith("precision:") and "(you asked for bf16-master)" in d for d in choice.differences)


def test_gpu_catalog_names_bandwidth_in_gb_per_s():
    gpu = get_gpu("H100")
    assert gpu.host_link_gb_per_s == 50.0 and not hasattr(gpu, "host_link_gbps")
