"""torch.compile: the saved bytes read off the min-cut partition of one block on fake tensors, against the tensors
a really compiled block saves at run time, and the estimate against a measured compiled CPU training step.
(The full matrix, inductor included: bench/compile.py.)"""

import json

import pytest

from memfit.errors import ConfigError
from memfit.setup import TrainingSetup
from tiny_configs import TINY_GPT2, TINY_LLAMA

torch = pytest.importorskip("torch")


def test_compile_is_a_checked_setup_field():
    assert TrainingSetup(compile=True).compile
    with pytest.raises(ConfigError, match="compile must be true or false"):
        TrainingSetup(compile="yes")


def _runtime_saved_bytes(block, args, kwargs) -> int:
    """Distinct non-parameter storages the compiled block's autograd node packs, on real tensors."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(*args, **kwargs)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("config", [TINY_GPT2], ids=["gpt2"])
def test_traced_partition_matches_a_really_compiled_block(config):
    """GPT-2's fused c_attn: its addmm output is not saved (addmm's backward needs the input, not the output); the
    attention keeps its own copies of q, k, v. Views of one storage count once, weight transposes not at all."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit._torch.blocks import named_blocks
    from memfit._torch.compiled import block_inputs, partition_block, partitioned_backend, saved_bytes
    from memfit._torch.step import build_hf_model, make_batch, unpacked_sequences

    setup = TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=24)
    short = dict(config, n_layer=1)
    with FakeTensorMode():
        fake_model = build_hf_model(short, setup)
        fake_block = named_blocks(fake_model)[0][1]
        traced = saved_bytes(partition_block(fake_block, *block_inputs(fake_model, fake_block,
                                                                       make_batch(short, setup))))
    model = build_hf_model(short, setup)
    block = named_blocks(model)[0][1]
    args, kwargs = block_inputs(model, block, make_batch(short, setup))
    block.compile(backend=partitioned_backend())
    with unpacked_sequences():
        runtime = _runtime_saved_bytes(block, args, kwargs)
    assert traced["shared"] == 0
    assert traced["attention"] + traced["mlp"] + traced["norms"] == runtime


def test_estimate_matches_a_measured_compiled_step(tmp_path, monkeypatch):
    """Tiny Llama fp32: compiled blocks keep 22% less than eager ones (the norms' internals, silu and the rotary
    products recomputed in backward), and the estimate is the measured compiled step's peak within 0.5%."""
    from memfit._torch.step import build_hf_model
    from memfit.estimate import activations as act
    from memfit.estimate import compiled
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.measure import measure
    from memfit.sources import resolve_model

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    spec = resolve_model(str(path))
    setup = TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=64, optimizer="adamw", compile=True)
    tokens = setup.tokens_per_micro_step
    eager = sum(act.layer_saved_bytes(spec, setup.replace(compile=False), tokens, 64, True).values())
    saved = sum(compiled.layer_saved_bytes(spec, setup, tokens, 64, True).values())
    assert eager == 592_896 and saved == 461_824  # -22.1%
    predicted = estimate(spec, setup, make_hardware(cpu_device(64 * 1024**3)))
    model = build_hf_model(TINY_LLAMA, setup, compile_backend="partitioned")
    measured = measure(model, setup, steps=2)
    assert abs(predicted.tensor_bytes - measured.tensor_bytes) <= 0.005 * measured.tensor_bytes
    assert any("torch.compile per block" in note for note in predicted.notes)
    assert list((tmp_path / "cache").glob("*.json"))  # the fit is cached on disk


def test_emitted_trainer_arguments_compile_and_read_back(tmp_path, monkeypatch):
    """The HF emitter's torch_compile=True is a real TrainingArguments field, and memfit's reader maps it back."""
    transformers = pytest.importorskip("transformers")
    from memfit.emit.hf_trainer import hf_trainer_kwargs
    from memfit.readers import read_config

    setup = TrainingSetup(precision="bf16", micro_batch_size=2, compile=True)
    kwargs = hf_trainer_kwargs(setup)
    assert kwargs["torch_compile"] is True
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                          **{k: v for k, v in kwargs.items() if k != "bf16"})
    assert args.torch_compile is True
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(dict(kwargs, output_dir="out")))
    monkeypatch.chdir(tmp_path)
    assert read_config("training_args.json").overrides["compile"] is True
    assert "torch_compile" not in hf_trainer_kwargs(setup.replace(compile=False))


def test_plan_reaches_the_compile_rung_on_shipped_fits(tmp_path, monkeypatch):
    """llama-3.2-1b ships its compiled fits: with checkpointing and the batch pinned the plan takes torch.compile
    (no trace: nothing is written to the cache), and compiled blocks keep less than eager ones."""
    from memfit.api import plan_memory

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    setup = TrainingSetup(precision="bf16", optimizer="adamw-8bit", micro_batch_size=16, seq_len=4096)
    result = plan_memory("llama-3.2-1b", setup, "H100", keep="checkpointing,micro_batch")
    keys = [step.technique for step in result.steps]
    assert "compile" in keys, keys
    step = result.steps[keys.index("compile")]
    assert step.estimate.activation_bytes < result.steps[keys.index("compile") - 1].estimate.activation_bytes
    assert not (tmp_path / "cache").exists()


def test_a_trace_refuses_compile_rather_than_show_eager_bytes():
    from memfit.trace.run import trace

    with pytest.raises(ConfigError, match="cannot size --compile"):
        trace(TINY_LLAMA, TrainingSetup(precision="fp32", micro_batch_size=2, seq_len=16, compile=True))


def test_compiled_chunk_cross_entropy_keeps_its_chunk_not_an_fp32_log_softmax():
    """torchtune compiles its chunked loss: after inductor's log-softmax decomposition the min-cut partition keeps
    the bf16 chunk, its labels and two fp32 numbers per row (amax, log-sum-exp), not the fp32 log-softmax eager
    autograd keeps (4 B x V a token)."""
    from memfit._torch.compiled import cross_entropy_saved
    from memfit.estimate.compiled_loss import STATS_BYTES_PER_TOKEN

    saved = cross_entropy_saved(16, 2048)
    assert saved == [((16, 2048), "bfloat16"), ((16,), "int64"), ((16, 1), "float32"), ((16, 1), "float32")]
    assert STATS_BYTES_PER_TOKEN == 2 * 4


def test_estimate_matches_a_measured_step_with_the_compiled_chunked_loss(tmp_path, monkeypatch):
    """Tiny Llama bf16, compiled blocks, torchtune's chunked loss compiled by inductor (on CPU: gcc): the estimate is
    the measured step's peak within 0.5%, and 12% below the step with the eager loss (its fp32 log-softmax)."""
    from memfit._torch.step import build_hf_model
    from memfit.estimate.analytic import estimate
    from memfit.hardware import cpu_device, make_hardware
    from memfit.measure import measure
    from memfit.sources import resolve_model

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    config = dict(TINY_LLAMA, vocab_size=2048)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = resolve_model(str(path))
    setup = TrainingSetup(precision="bf16", micro_batch_size=2, seq_len=64, optimizer="adamw", loss="chunked",
                          compile=True, checkpointing="full")
    hardware = make_hardware(cpu_device(64 * 1024**3))
    predicted = estimate(spec, setup, hardware)
    torch._dynamo.reset()
    measured = measure(build_hf_model(config, setup, compile_backend="partitioned"), setup, steps=2)
    assert abs(predicted.tensor_bytes - measured.tensor_bytes) <= 0.005 * measured.tensor_bytes
    assert predicted.peak_phase.value == "backward"  # the head's backward: only the labels remain of the loss
    assert predicted.term("activations/loss").num_bytes == 2 * 64 * 8
    eager_loss = estimate(spec, setup.replace(compile=False), hardware)  # blocks eager too: they are checkpointed
    assert predicted.tensor_bytes < 0.9 * eager_loss.tensor_bytes  # -11.7%


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "olmoe-1b-7b"])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_moe_models_are_not_sized_compiled_whichever_path_sizes_them(name, precision):
    """A derived MoE model (a bf16 Mixtral, DeepSeek's latent attention, a graph-less Qwen3-MoE) is still MoE to the
    compile path: its experts are not traced compiled, so the ladder skips compile rather than trace one."""
    from memfit.estimate import compiled, moe
    from memfit.sources import resolve_model

    spec = resolve_model(name)
    setup = TrainingSetup(precision=precision, compile=True)
    assert moe.has_experts(spec)
    assert compiled.unsized(spec, setup) == "routed experts are not traced compiled"
    assert compiled.unsized(resolve_model("qwen3-8b"), setup) == ""  # a dense derived model is traced compiled
