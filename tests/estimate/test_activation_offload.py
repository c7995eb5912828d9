"""Activation offloading to the CPU (torchtune OffloadActivations): the formulas' offloaded, host and kept bytes
against what the very hooks pack on real tiny models, apply_, the one loop, the ladder rung, the emitted notes, the
readers and the CLI.

On a CPU model the hooks cannot move anything (the host is the device), so they count: every pack torchtune would copy
to pinned host RAM (host bytes, one copy per pack), the device storages that would leave (each once; views of
parameters aside: a Linear saves `weight.t()`, which torchtune copies but whose parameter stays), and the saved
tensors the LM head and the loss keep on the device.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_configs import TINY_CONFIGS  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.estimate import offload_activations as formulas  # noqa: E402
from memfit.estimate.analytic import estimate, forward_activation_terms  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
import memfit.techniques  # noqa: E402,F401  (registers the technique sections: activation_offload)
from memfit.sources import resolve_model  # noqa: E402

torch = pytest.importorskip("torch")

CPU = make_hardware(cpu_device(64 * 1024**3))


def setup_of(**changes) -> TrainingSetup:
    base = dict(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw", activation_offload=True)
    return TrainingSetup(**{**base, **changes})


def packed_on_a_real_step(family: str, setup: TrainingSetup):
    """One forward and loss of the real tiny model under the offload hooks (memfit's loop wraps the same)."""
    from memfit._torch.offload_activations import offloading
    from memfit._torch.step import autocast_factory, build_hf_model, make_batch, setup_loss
    from memfit.apply import apply_

    model = build_hf_model(TINY_CONFIGS[family], setup)
    apply_(model, setup.replace(activation_offload=False))  # checkpointing as the setup says
    model.train()
    batch = make_batch(TINY_CONFIGS[family], setup)
    with autocast_factory(setup, "cpu")(), offloading(model) as offload:
        loss = setup_loss(setup)(model, batch)
    loss.backward()
    return offload.counts


def predicted(family: str, setup: TrainingSetup) -> formulas.OffloadSizes:
    spec = resolve_model(TINY_CONFIGS[family])
    return formulas.sizes(spec, setup, forward_activation_terms(spec, setup, on_cpu=True))


CASES = [("llama", {}), ("llama", dict(precision="amp-bf16")), ("llama", dict(precision="bf16")),
         ("llama", dict(checkpointing="full")), ("llama", dict(precision="amp-bf16", checkpointing="full")),
         ("qwen2", {}), ("qwen2", dict(precision="amp-bf16")), ("mistral", dict(precision="bf16")),
         ("gpt2", {}), ("gpt2", dict(checkpointing="full")), ("llama", dict(loss="chunked", precision="bf16"))]


@pytest.mark.parametrize("family,changes", CASES,
                         ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'fp32'}" for f, c in CASES])
def test_formulas_count_what_the_hooks_pack(family, changes):
    setup = setup_of(**changes)
    counts = packed_on_a_real_step(family, setup)
    sizes = predicted(family, setup)
    assert sizes.offloaded_bytes == counts.offloaded_bytes
    assert sizes.host_bytes == counts.packed_bytes
    assert sizes.weight_bytes == counts.weight_packed_bytes
    # the loss's 0-d output (4 B) and the chunked loss's per-chunk scalars are the only saved tensors not sized
    assert 0 <= counts.kept_bytes - sizes.kept_bytes <= 64, (counts.kept_bytes, sizes.kept_bytes)
    assert sizes.host_bytes >= sizes.offloaded_bytes > sizes.kept_bytes // 100


def test_every_n_packs_the_plain_blocks_only():
    """every-2: block 1 is checkpointed (its input is packed), block 0 packs everything. The rotary tables are
    packed by block 0 but stay on the device (block 1's recompute holds them): the hooks count their storage, the
    formulas do not."""
    setup = setup_of(checkpointing="every-2", precision="amp-bf16")
    counts, sizes = packed_on_a_real_step("llama", setup), predicted("llama", setup)
    assert sizes.host_bytes == counts.packed_bytes
    tables = 2 * setup.seq_len * resolve_model(TINY_CONFIGS["llama"]).head_dim * 4
    assert counts.offloaded_bytes - sizes.offloaded_bytes == tables


def test_apply_installs_the_hooks_around_the_models_forward():
    """apply_ for a loop that calls model(**batch) (the HF Trainer): the loss, computed inside the forward after
    the head, stays on the device; what is packed is what the formulas say."""
    from memfit._torch.step import build_hf_model, make_batch
    from memfit.apply import apply_

    setup = setup_of()
    model = build_hf_model(TINY_CONFIGS["llama"], setup)
    applied = apply_(model, setup)
    assert applied["activation offload"].changed
    model(**make_batch(TINY_CONFIGS["llama"], setup)).loss.backward()
    counts = model._memfit_activation_offload.counts
    assert counts.packed_bytes == predicted("llama", setup).host_bytes
    assert not apply_(model, setup)["activation offload"].changed  # installed once


def test_the_one_loop_runs_with_offload_and_changes_no_numbers():
    from memfit._torch.step import build_hf_model, make_batch, make_optimizer, training_step

    losses = []
    for flag in (False, True):
        setup = setup_of(activation_offload=flag)
        torch.manual_seed(0)
        model = build_hf_model(TINY_CONFIGS["gpt2"], setup)
        batch = make_batch(TINY_CONFIGS["gpt2"], setup, generator=torch.Generator().manual_seed(0))
        losses.append(training_step(model, make_optimizer(model, setup), batch, setup))
    assert losses[0] == losses[1]


MEASURED_PAIR = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tiny_configs import TINY_CONFIGS
import memfit.techniques
from memfit.measure import measure
from memfit.setup import TrainingSetup
setup = TrainingSetup(micro_batch_size=2, seq_len=128, precision="fp32", optimizer="adamw", activation_offload=True,
                      checkpointing="full")
hooks = measure(TINY_CONFIGS["llama"], setup, steps=2).tensor_bytes
plain = measure(TINY_CONFIGS["llama"], setup.replace(activation_offload=False), steps=2).tensor_bytes
print(json.dumps([hooks, plain]))
"""


@pytest.mark.processes
def test_on_a_cpu_device_nothing_moves_and_the_measured_step_agrees():
    """torchtune refuses a CPU device; memfit's loop runs the hooks there but nothing can move: the estimate for a CPU
    device is the no-offload one, and the measured step (the one loop, with the hooks) has the same peak.

    The two real steps run in a process of their own: inside a full -n 2 run the hooked step sometimes measured
    32,768 or 131,328 B more than the plain one (the size of a B x 1 x T x T bool / fp32 attention mask here), never
    when the file runs alone; what an earlier test on the same worker leaves behind is not found yet."""
    import subprocess

    setup = setup_of(checkpointing="full")
    spec = resolve_model(TINY_CONFIGS["llama"])
    with_hooks = estimate(spec, setup, CPU)
    assert with_hooks.total_bytes == estimate(spec, setup.replace(activation_offload=False), CPU).total_bytes
    assert with_hooks.cpu_bytes == 0
    done = subprocess.run([sys.executable, "-c", MEASURED_PAIR, str(Path(__file__).resolve().parents[1])],
                          capture_output=True, text=True, timeout=600, check=True)
    measured, plain = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured == plain
    assert abs(with_hooks.tensor_bytes - measured) / measured < 0.01


def test_the_estimate_moves_the_stack_to_the_host():
    spec = resolve_model("llama-3.1-8b")
    hw = make_hardware("h100")
    base = TrainingSetup(micro_batch_size=4, seq_len=4096, precision="bf16", optimizer="adamw-8bit")
    host = {}
    for mode in ("none", "full"):
        plain = estimate(spec, base.replace(checkpointing=mode), hw)
        offloaded = estimate(spec, base.replace(checkpointing=mode, activation_offload=True), hw)
        host[mode] = formulas.sizes(spec, offloaded.setup, forward_activation_terms(spec, offloaded.setup)).host_bytes
        assert offloaded.cpu_bytes == host[mode] > 0
        assert offloaded.total_bytes < plain.total_bytes
        names = {t.name for t in offloaded.terms}
        assert not names & set(formulas.STACK_TERMS)
    # without checkpointing every saved tensor of 32 blocks moves, with it one input per block
    assert host["none"] > 10 * host["full"]


def test_setups_it_does_not_size_say_so():
    for bad in (dict(checkpointing="selective-op"), dict(loss="fused"),
                dict(activation_offload="yes")):
        with pytest.raises(ConfigError):
            setup_of(**bad)
    with pytest.raises(ConfigError, match="tensor by tensor; .bert. is not one"):
        estimate(resolve_model(TINY_CONFIGS["bert"]), setup_of(), CPU)
    qwen3 = {**TINY_CONFIGS["qwen2"], "model_type": "qwen3", "head_dim": 16}  # q/k norms: the derived model
    with pytest.raises(ConfigError, match="tensor by tensor; .* is not one"):
        estimate(resolve_model(qwen3), setup_of(), CPU)


def test_the_ladder_offloads_with_checkpointing_when_the_rest_is_pinned():
    from memfit.cli.options import gpu
    from memfit.plan import plan

    spec = resolve_model("llama-3.1-8b")
    setup = TrainingSetup(micro_batch_size=4, seq_len=4096, precision="bf16", optimizer="adamw-8bit",
                          checkpointing="full")
    keep = frozenset({"micro_batch_size", "seq_len", "precision", "optimizer", "loss", "sharding", "num_gpus"})
    result = plan(spec, setup, make_hardware(gpu("64GiB")), keep=keep)
    steps = {s.technique: s for s in result.steps}
    assert "activation_offload" in steps, [s.technique for s in result.steps]
    assert result.final_setup.activation_offload and result.final_setup.checkpointing.value == "full"
    cost = steps["activation_offload"].typed_cost  # pinned host RAM, and every pack down and back up
    assert cost.host_bytes > 0 and cost.host_link_bytes == 2 * cost.host_bytes * result.final_setup.grad_accum_steps
    small_host = plan(spec, setup, make_hardware(gpu("64GiB"), cpu_ram="1GiB"), keep=keep)
    assert not small_host.final_setup.activation_offload


def test_emitted_notes_and_readers():
    from memfit.emit.hf_trainer import hf_trainer_file
    from memfit.readers import read_config

    notes = " ".join(hf_trainer_file(setup_of()).notes)
    assert "activation_offloading=True" in notes and "enable_activation_offloading" in notes
    assert read_config_text(read_config, "axolotl", "base_model: meta-llama/Llama-3.1-8B\nmicro_batch_size: 1\n"
                            "sequence_len: 2048\nactivation_offloading: true\n")["activation_offload"] is True


def read_config_text(read_config, kind: str, text: str) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{kind}.yaml"
        path.write_text(text)
        return read_config(str(path)).overrides


def test_cli_option_and_json():
    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["plan", "llama-3.2-1b", "--activation-offload", "--checkpointing", "full", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["initial_setup"]["activation_offload"] is True
    bad = runner.invoke(app, ["plan", "llama-3.2-1b", "--activation-offload", "--checkpointing", "selective-op"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1, bad.output
