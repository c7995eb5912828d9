"""The estimate's shape: every term is named by a TermKey (so no new string name creeps in), its category is the
one its key names, and techniques change the step's moments through typed changes."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from memfit.estimate.analytic import estimate
from memfit.estimate.moments import AddBeside, Moment, MomentKey, ShrinkBeside, StepMoments
from memfit.estimate.result import Category, Phase, Term
from memfit.estimate.terms import DYNAMIC_NAME, TermKey, category_of, is_term_name, stack_blocks
from memfit.finetune import Finetune
from memfit.hardware import cpu_device, make_hardware
from memfit.setup import TrainingSetup
import memfit.techniques  # noqa: F401  (registers the technique sections: activation_offload)
from memfit.sources import resolve_model

ROOT = Path(__file__).resolve().parents[2]
H100x8 = make_hardware("H100", gpus_per_node=8)
CPU = make_hardware(cpu_device(64 * 1024**3))
LORA = Finetune(method="lora", rank=8, targets=("all-linear",))

# (model, setup fields, hardware): the plain step and each path that builds or changes moments
SETUPS = [
    ("llama-3.1-8b", {}, H100x8),
    ("llama-3.1-8b", dict(precision="amp-bf16", checkpointing="full", grad_accum_steps=2), CPU),
    ("llama-3.1-8b", dict(precision="bf16", checkpointing="selective-op", loss="chunked"), H100x8),
    ("llama-3.1-8b", dict(precision="bf16", loss="fused", optimizer_in_backward=True), H100x8),
    ("llama-3.1-8b", dict(precision="amp-bf16", engine="torch", sharding="zero3", num_gpus=8), H100x8),
    ("llama-3.1-8b", dict(precision="bf16", engine="torch", sharding="zero3", num_gpus=8, cp=4, seq_len=32768,
                          checkpointing="full"), H100x8),
    ("llama-3.1-8b", dict(precision="bf16", engine="torch", num_gpus=8, pp=2, grad_accum_steps=4), H100x8),
    ("llama-3.1-8b", dict(precision="bf16-master", float8="tensorwise", engine="torch", sharding="zero3",
                          num_gpus=8), H100x8),
    ("llama-3.1-8b", dict(precision="bf16", optimizer="adamw-8bit", activation_offload=True), H100x8),
    ("llama-3.1-8b", dict(precision="bf16", checkpointing="full", finetune=Finetune(method="qlora", rank=8)), CPU),
    ("llama-3.1-8b", dict(precision="bf16", checkpointing="full", engine="deepspeed", sharding="zero3", num_gpus=8,
                          finetune=LORA), H100x8),
    ("gpt2", dict(precision="amp-bf16", checkpointing="full", finetune=LORA), CPU),
    ("gpt2", dict(engine="torch", tp=2, num_gpus=2, sequence_parallel=True), H100x8),
    ("bert-base-uncased", dict(precision="amp-bf16", engine="deepspeed", sharding="zero2", num_gpus=8), H100x8),
    ("mixtral-8x7b", dict(precision="bf16", engine="torch", num_gpus=8, expert_parallel=8), H100x8),
]


@pytest.mark.parametrize("model,fields,hardware", SETUPS, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(SETUPS)])
def test_every_term_has_a_term_key_and_its_category(model, fields, hardware):
    result = estimate(resolve_model(model), TrainingSetup(**fields), hardware)
    assert result.terms
    for term in result.terms:
        assert isinstance(term.name, TermKey), term.name
        assert term.category is term.name.category, term.name
    # the JSON output carries the plain text of each name
    names = [t["name"] for t in json.loads(json.dumps(result.to_dict()))["terms"]]
    assert names == [t.name.value for t in result.terms]


def test_a_stacked_model_names_its_stacks_through_the_one_escape():
    result = estimate(resolve_model("t5-base"), TrainingSetup(micro_batch_size=8, seq_len=512, target_len=512), H100x8)
    dynamic = [t.name for t in result.terms if not isinstance(t.name, TermKey)]
    assert dynamic and all(DYNAMIC_NAME.fullmatch(n) and is_term_name(n) for n in dynamic)
    assert all(t.category is category_of(t.name) for t in result.terms)
    assert stack_blocks("encoder") == "activations/encoder_blocks"
    with pytest.raises(ValueError):
        stack_blocks("Encoder Blocks")


def test_a_key_is_its_text():
    """A StrEnum: the JSON, a dict lookup and a format give the text the names had as strings."""
    assert json.dumps(TermKey.LAYER_BACKWARD) == '"temporaries/layer_backward"'
    assert {TermKey.HEAD: 1}["activations/head"] == 1 and f"{TermKey.NORMS}" == "activations/norms/residual"
    assert {k.category for k in TermKey} == set(Category)
    assert all(k.value.split("/")[0] == k.category.value for k in TermKey)


def _term(key: TermKey, num_bytes: int) -> Term:
    return Term(key, key.category, num_bytes)


def test_typed_changes_reach_only_the_moments_that_hold_their_anchor():
    moments = StepMoments()
    moments.set(MomentKey.FORWARD_END, [_term(TermKey.HEAD, 10), _term(TermKey.GATHERED, 5)])
    moments.set(MomentKey.FIRST_BLOCK_BACKWARD, [_term(TermKey.LAYER_BACKWARD, 7), _term(TermKey.GATHERED, 5),
                                                 _term(TermKey.RECOMPUTED_BLOCK, 3)])
    ring = _term(TermKey.RING_ATTENTION, 100)
    out = moments.apply([AddBeside(ring, TermKey.LAYER_BACKWARD),
                         ShrinkBeside(TermKey.GATHERED, TermKey.RECOMPUTED_BLOCK, 8, "; released")])
    assert out[MomentKey.FORWARD_END] == moments[MomentKey.FORWARD_END]  # no block backward, no recompute
    block = out["first block backward"]
    assert block.phase is Phase.BACKWARD and [t.name for t in block.terms][-1] is TermKey.RING_ATTENTION
    assert next(t for t in block.terms if t.name is TermKey.GATHERED).num_bytes == 0  # never below zero
    assert out.peak() == block and out.phase_peaks() == {Phase.FORWARD: 15, Phase.BACKWARD: 110}


def test_legacy_pairs_keep_their_place_and_become_moment_keys():
    moments = StepMoments()
    moments.set(MomentKey.LOSS_BACKWARD, [_term(TermKey.LOSS_BACKWARD, 1)])
    moments.set(MomentKey.OPTIMIZER_STEP, [_term(TermKey.STATES, 1)])
    moments.update({"loss backward": (Phase.BACKWARD, [_term(TermKey.LOSS_BACKWARD, 2)]),
                    "first block MLP backward": (Phase.BACKWARD, [])})
    assert list(moments) == [MomentKey.LOSS_BACKWARD, MomentKey.OPTIMIZER_STEP, MomentKey.FIRST_BLOCK_MLP_BACKWARD]
    assert all(isinstance(k, MomentKey) for k in moments) and moments["loss backward"] == Moment(
        Phase.BACKWARD, [_term(TermKey.LOSS_BACKWARD, 2)])


# files other changes rewrite at the same time (LoRA's checkpointed moments; the technique modules): their string
# names are left for those changes (Term turns a known text into its member, so their terms are TermKeys already)
STRING_NAMES_LEFT = {"memfit/estimate/lora_checkpoint.py", "memfit/techniques/optimizer8bit.py"}


def test_no_term_name_is_written_as_a_string():
    """bench/structure.py's "term lookups by string": none outside the enum (and the files listed above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_structure", ROOT / "bench" / "structure.py")
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    src = ROOT / "src"
    found = {}
    for path in sorted((src / "memfit").rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        count = structure.term_name_strings(ast.parse(path.read_text()))
        if count and rel != "memfit/estimate/terms.py" and rel not in STRING_NAMES_LEFT:
            found[rel] = count
    assert found == {}
