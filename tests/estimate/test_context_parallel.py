"""Context parallelism (memfit.estimate.context_parallel), on paper: torch's ring attention does not run on CPU (its
dispatch handles only the flash and memory-efficient SDPA kernels). Each rank's activations are the model's at
seq / cp, static memory sharded over dp x cp, the ring's buffers and traffic from torch's _context_parallel code,
whose defaults are read from the installed torch; bad input; the CLI."""

from __future__ import annotations

import json

import pytest

from memfit.errors import ConfigError
from memfit.estimate import context_parallel as cpm
from memfit.estimate.analytic import estimate
from memfit.estimate.comm import comm_volume
from memfit.hardware import make_hardware
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

SPEC = resolve_model("llama-3.1-8b")
HW = make_hardware("H100", gpus_per_node=8)


def _setup(cp: int = 4, **changes) -> TrainingSetup:
    return TrainingSetup(micro_batch_size=1, seq_len=32768, precision="bf16", optimizer="adamw", engine="torch",
                         num_gpus=8, sharding="zero3", checkpointing="full", cp=cp).replace(**changes)


def test_torch_ring_attention_defaults_are_the_ones_sized():
    """torch's _ContextParallelOptions: K/V all-gathered (the default method memfit sizes) and partial results
    merged in fp32; only flash / memory-efficient SDPA are dispatched to the ring (so no CPU run)."""
    pytest.importorskip("torch")
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    import inspect

    options = ring._ContextParallelOptions()
    assert options.rotate_method is ring._RotateMethod.ALL_GATHER and options.convert_to_f32
    assert TrainingSetup().cp_rotate.value == "allgather"
    dispatched = inspect.getsource(ring._sdpa_handler)
    assert "_scaled_dot_product_flash_attention.default" in dispatched
    assert "_for_cpu" not in dispatched  # torch's CPU SDPA kernel is not among the ring's ops


WIDE_SMALL_VOCAB = resolve_model({
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 4096, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 65536,
    "tie_word_embeddings": False})
"""A small vocabulary: a block's backward, where the ring's buffers live, is the step's peak (not the loss's)."""


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_are_the_models_at_seq_over_cp_and_static_over_dp_x_cp(cp):
    spec = WIDE_SMALL_VOCAB
    ring = estimate(spec, _setup(cp, checkpointing="none", seq_len=16384), HW)
    local = TrainingSetup(micro_batch_size=1, seq_len=16384 // cp, precision="bf16", optimizer="adamw",
                          engine="torch", num_gpus=8, sharding="zero3")
    plain = estimate(spec, local, HW)
    acts = {t.name: t.num_bytes for t in ring.terms if t.category.value == "activations"}
    assert acts == {t.name: t.num_bytes for t in plain.terms if t.category.value == "activations"}
    assert ring.term("parameters").num_bytes == 2 * spec.num_params // 8  # FSDP over dp x cp = 8 ranks
    assert ring.tensor_bytes - plain.tensor_bytes == ring.term("temporaries/ring_attention").num_bytes
    assert ring.setup.cp == cp and ring.setup.seq_len == 16384  # the estimate states the user's setup


def test_ring_backward_buffers_by_hand():
    """Llama-3.1-8B, b=1, s=32768, cp=4, bf16: s_local 8192, q = 8192 x 32 x 128, kv = 8192 x 8 x 128.
    allgather: local K+V cat + all 4 chunks (2 kv x 2 B x 5), fp32 dq/dk/dv (q + 2kv) x 4, bf16 step grads
    (q + 2kv) x 2, fp32 dK/dV sent and received 2 x 2kv x 4."""
    q, kv = 8192 * 32 * 128, 8192 * 8 * 128
    expected = 2 * kv * 2 * 5 + (q + 2 * kv) * 4 + (q + 2 * kv) * 2 + 2 * 2 * kv * 4
    assert cpm.ring_backward_bytes(SPEC, _setup(4), 2) == expected
    alltoall = cpm.ring_backward_bytes(SPEC, _setup(4, cp_rotate="alltoall"), 2)
    assert expected - alltoall == 2 * kv * 2 * 3  # three fewer chunks held


def test_ring_traffic_in_the_communication_model():
    """Per layer and micro-step: K/V all-gathered in forward and backward (payload cp x 2kv x 2 B each), and cp
    fp32 dK/dV permutes of 2kv x 4 B."""
    setup = _setup(4)
    volume = comm_volume(SPEC, setup, HW)
    kv, layers = 8192 * 8 * 128, 32
    ring = {c.name: c.payload_bytes for c in volume.collectives if c.group == "context"}
    assert ring == {"all-gather": layers * 2 * 4 * 2 * kv * 2, "all-to-all": layers * 4 * 2 * kv * 4}
    assert volume.dp_size == 8  # FSDP2's collectives span dp x cp
    assert volume.context_parallel_bytes > 0


@pytest.mark.parametrize("changes,message", [
    ({"attention": "eager"}, "eager attention"),
    ({"seq_len": 32766}, "multiple of 8"),
    ({"cp": 3}, "must divide the GPU count"),
    ({"engine": "deepspeed"}, "engine torch"),
])
def test_bad_context_parallel_setups_are_one_line(changes, message):
    with pytest.raises(ConfigError, match=message) as info:
        _setup(**changes)
    assert "\n" not in str(info.value)


def test_cli_cp_options_and_torchtitan_keys():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    args = ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "-b", "1", "-s", "32768", "--zero", "zero3",
            "--checkpointing", "full", "--cp", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    launch = json.loads(result.output)["launch"]
    assert launch["setup"]["cp"] == 4 and launch["setup"]["engine"] == "torch"
    assert any("context_parallel_degree = 4" in n and 'context_parallel_rotate_method = "allgather"' in n
               for n in launch["notes"])
    bad = CliRunner().invoke(app, ["estimate", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "-s", "4096",
                                   "--cp", "4", "--attention", "eager"])
    assert bad.exit_code == 2 and "eager attention" in bad.output


def test_context_and_pipeline_parallelism_together():
    """pp 2 x cp 4: each pipeline rank's stage holds seq / cp tokens per micro-batch, its block backward carries the
    ring's buffers, and the stage-to-stage sends shrink by cp."""
    from memfit.estimate import pipeline as ppm

    spec = WIDE_SMALL_VOCAB
    both = _setup(4, num_gpus=8, pp=2, grad_accum_steps=4, checkpointing="none", seq_len=16384)
    est = estimate(spec, both, HW)
    local = cpm.rank_setup(both)
    assert local.seq_len == 4096 and local.pp == 2 and local.shard_size == 4
    memories = ppm.stage_memories(spec, local, changes=cpm.step_changes(spec, both, 2))
    assert est.tensor_bytes == max(m.tensor_bytes for m in memories)
    assert any("temporaries/ring_attention" == t.name for m in memories for t in m.terms)
    plain_pp = both.replace(cp=1, num_gpus=2, sharding="none")
    sends = comm_volume(spec, both, HW).pipeline_parallel_bytes
    assert sends * 4 == comm_volume(spec, plain_pp).pipeline_parallel_bytes
