"""The FSDP-QLoRA recipe with CPU offload, as users write it: axolotl's qlora-fsdp example (fsdp_offload_params),
accelerate's FSDP config (FSDP1 by default) and the Trainer's fsdp_config (FSDP2 by default) read as FSDP2's
CPUOffloadPolicy; the sizes against memfit.estimate.lora_sharded's own tensor list; 70B QLoRA on 2 x RTX-3090.
The measured side (2 real gloo ranks) is tests/lora/test_lora_fsdp_offload.py."""

from __future__ import annotations

from memfit.diagnose import diagnose
from memfit.estimate.analytic import estimate
from memfit.estimate.lora import adapted_spec
from memfit.estimate.lora_sharded import frozen_kept_on_device_bytes, frozen_shard_bytes
from memfit.hardware import make_hardware
from memfit.readers import read_config
from memfit.setup import TrainingSetup
from memfit.sources import resolve_model

# axolotl examples/llama-2/qlora-fsdp.yml, the keys that matter here (datasets, logging and schedule left out)
AXOLOTL = """base_model: NousResearch/Llama-2-7b-hf
load_in_8bit: false
load_in_4bit: true
adapter: qlora
sequence_len: 512
sample_packing: false
pad_to_sequence_len: true
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
gradient_accumulation_steps: 4
micro_batch_size: 4
optimizer: adamw_torch_fused
bf16: auto
gradient_checkpointing: true
fsdp:
  - full_shard
  - auto_wrap
fsdp_config:
  fsdp_limit_all_gathers: true
  fsdp_sync_module_states: true
  fsdp_offload_params: true
  fsdp_use_orig_params: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
"""

ACCELERATE = """distributed_type: FSDP
num_processes: 2
mixed_precision: bf16
fsdp_config:
  fsdp_offload_params: true
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
"""


def _offload_entry(reading):
    return next(entry for entry in reading.read if ("offload", "optimizer+params") in
                [(name, str(value)) for name, value in entry.sets])


def test_axolotl_fsdp_qlora_with_offload_reads_and_sizes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qlora-fsdp.yml").write_text(AXOLOTL)
    reading = read_config("qlora-fsdp.yml", num_gpus=2)
    fields = {k: str(v) for k, v in reading.overrides.items()}
    assert (fields["offload"], fields["sharding"], fields["engine"]) == ("optimizer+params", "zero3", "torch")
    assert "FSDP1" in _offload_entry(reading).note  # axolotl without fsdp_version runs accelerate's FSDP1
    setup = TrainingSetup(**{**reading.overrides, "num_gpus": 2})
    assert setup.finetune.method.value == "qlora" and setup.checkpointing.value == "full"
    spec = resolve_model("llama-2-7b")
    adapted = adapted_spec(spec, setup)
    result = estimate(spec, setup, make_hardware("RTX-3090", gpus_per_node=2))
    kept = frozen_kept_on_device_bytes(adapted, setup)
    quant_states = sum(t.count * (t.nbytes - -(-t.numel // 2)) for t in adapted.frozen if t.nbytes < 2 * t.numel)
    assert result.term("parameters/frozen").num_bytes == kept == quant_states > 0
    host = frozen_shard_bytes(adapted, setup, 2) - kept + (3 * 4 + 4) * adapted.num_params // 2  # + AdamW, grads
    assert result.cpu_bytes == host


def test_accelerate_and_trainer_fsdp_offload_map_to_the_same_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fsdp1.yaml").write_text(ACCELERATE)
    (tmp_path / "fsdp2.yaml").write_text(ACCELERATE + "  fsdp_version: 2\n")
    (tmp_path / "args.json").write_text('{"fsdp": "full_shard auto_wrap", "fsdp_config": {"cpu_offload": true}, '
                                        '"bf16": true, "per_device_train_batch_size": 1}')
    notes = {}
    for name in ("fsdp1.yaml", "fsdp2.yaml", "args.json"):
        reading = read_config(name, num_gpus=2)
        assert str(reading.overrides["offload"]) == "optimizer+params" and str(reading.overrides["sharding"]) == "zero3"
        notes[name] = _offload_entry(reading).note
    assert "FSDP1" in notes["fsdp1.yaml"] and "FSDP1" not in notes["fsdp2.yaml"] + notes["args.json"]


def test_70b_qlora_fits_two_rtx_3090_with_fsdp_checkpointing_and_offload():
    """The recipe of issue 19: without offload each rank keeps half the packed base (over 24 GB); with it the
    device holds the gathered root and units, the QuantStates and the activations."""
    spec = resolve_model("llama-3.1-70b")
    hardware = make_hardware("RTX-3090", gpus_per_node=2)
    recipe = TrainingSetup(micro_batch_size=1, seq_len=2048, num_gpus=2, engine="torch", sharding="zero3",
                           checkpointing="full", finetune="qlora", offload="optimizer+params")
    offloaded, kept = estimate(spec, recipe, hardware), estimate(spec, recipe.replace(offload="none"), hardware)
    assert diagnose(offloaded, hardware).fits and not diagnose(kept, hardware).fits
    print(f"70B QLoRA, 2 x RTX-3090, FSDP2 + full checkpointing: {offloaded.device_used_bytes / 2**30:.2f} GiB per "
          f"GPU with CPU offload ({offloaded.cpu_bytes / 2**30:.2f} GiB host), {kept.device_used_bytes / 2**30:.2f} "
          "without")
    adapted = adapted_spec(spec, recipe)
    moved = frozen_shard_bytes(adapted, recipe, 2) - frozen_kept_on_device_bytes(adapted, recipe)
    assert moved > 16 * 1024**3  # half of the packed 4-bit base, on the host
    assert kept.tensor_bytes - offloaded.tensor_bytes >= moved


def test_the_trace_of_fsdp2_offload_agrees_on_the_device():
    """memfit's trace runs FSDP2 with CPUOffloadPolicy on fake tensors over a fake process group: its device peak
    (shards, gradients and states kept as host kinds) is the estimate's, and the QuantStates stay on its device."""
    import pytest

    pytest.importorskip("bitsandbytes")
    from tiny_configs import TINY_LLAMA

    from memfit.trace.run import trace

    setup = TrainingSetup(micro_batch_size=2, seq_len=128, optimizer="adamw", engine="torch", num_gpus=2,
                          sharding="zero3", offload="optimizer+params", precision="amp-bf16",
                          finetune={"method": "qlora", "rank": 8, "alpha": 16, "targets": ["all-linear"]})
    traced = trace(TINY_LLAMA, setup)
    spec = resolve_model(TINY_LLAMA)
    predicted = estimate(spec, setup, make_hardware("H100", gpus_per_node=2))
    assert abs(traced.tensor_bytes / predicted.tensor_bytes - 1) < 0.005
    kept = frozen_kept_on_device_bytes(adapted_spec(spec, setup), setup)
    head_dim = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    rotary = 2 * 4 * head_dim // 2  # the rotary inv_freq and original_inv_freq buffers, which the spec leaves out
    assert traced.term("parameters/buffers").num_bytes == kept + rotary
    assert "parameters" not in {t.name for t in traced.terms}  # every shard on the host
