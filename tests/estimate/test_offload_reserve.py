"""The allocator reserve of an activation-offloaded step (memfit.estimate.device's replay): the saved tensors that
leave are device buffers created in forward and freed once copied to pinned host RAM, then brought back into new
device buffers for their block's backward; the host copies take no device segment.

Checked against the replay of a real sequence of allocations: a real training step of a small Llama under the
offload hooks (memfit._torch.offload_activations, torchtune's rule), recorded by memfit's StepTracker, with the
host copies made in numpy memory (no torch storage, so no device event: the pinned host buffer) and the unpack
making a new tensor (the buffer brought back to the device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from tiny_configs import TINY_LLAMA  # noqa: E402

from memfit.estimate import allocator as alloc  # noqa: E402
from memfit.estimate.analytic import estimate  # noqa: E402
from memfit.finetune import ALL_LINEAR, Finetune, Method  # noqa: E402
from memfit.hardware import make_hardware  # noqa: E402
from memfit.setup import TrainingSetup  # noqa: E402
import memfit.techniques  # noqa: E402,F401  (registers the technique sections: activation_offload)
from memfit.sources import resolve_model  # noqa: E402

MiB, GiB = 2**20, 2**30
CONFIG = dict(TINY_LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
"""Four blocks: the formula stream replays them all (device.SAMPLE_BLOCKS), so no extrapolation is involved; MiB
tensors, so both allocator pools are exercised."""
STEP = dict(micro_batch_size=2, seq_len=256, precision="fp32", optimizer="adamw", checkpointing="full",
            attention="sdpa")


def _recorded_reserve(offload: bool) -> int:
    """max_memory_reserved - max_memory_allocated of two real steps' allocations, replayed through the allocator."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memfit._torch.offload_activations import ActivationOffload, offloading
    from memfit.trace.tracker import StepTracker

    class HostOffload(ActivationOffload):
        """The hooks' rule, with this CPU model standing in for the device and numpy memory for pinned host RAM."""

        def _pack(self, tensor):
            packed = super()._pack(tensor)  # the rule: counted, and on a CPU model left in place
            moves = (packed is tensor and not self.paused and not isinstance(tensor, torch.nn.Parameter)
                     and tensor.numel() * tensor.element_size() >= self.min_offload_bytes)
            return ("host", tensor.detach().numpy().copy()) if moves else packed

        @staticmethod
        def _unpack(packed):
            if isinstance(packed, tuple) and packed[0] == "host":
                return torch.from_numpy(packed[1]).clone()  # a new device buffer for the backward
            return packed

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    ids = torch.randint(0, config.vocab_size, (STEP["micro_batch_size"], STEP["seq_len"]))
    tracker = StepTracker()
    with tracker:
        tracker.watch_module(model)
        for _ in range(2):  # the second step runs on the first one's cache, as the formula stream does
            if offload:
                with offloading(model, HostOffload(parameters=model.parameters())):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
    result = alloc.replay(tracker.allocation_events)
    return result.peak_reserved - result.peak_allocated


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
def test_the_reserve_matches_the_replay_of_a_real_step(offload):
    """Within two small-pool segments (2 x 2 MiB) of the real step's replay, with and without offloading: the
    formula stream is representative (its tensors are the terms', not every op's), not the step's own events."""
    spec = resolve_model(CONFIG)
    setup = TrainingSetup(**STEP, activation_offload=offload)
    predicted = estimate(spec, setup, make_hardware("A100-80GB")).term("overhead/allocator_reserve").num_bytes
    assert abs(predicted - _recorded_reserve(offload)) <= 2 * alloc.SMALL_BUFFER


def test_offloading_does_not_inflate_the_reserve_of_a_sharded_qlora_step():
    """issue 19: 70B QLoRA r=16 all-linear on 2 x 48 GB under FSDP2 went from 32.40 to 38.96 GiB with activation
    offloading, a 9.13 GiB reserve: with no saved tensors in the stream the optimizer states carved the freed
    all-gather segment, and the sample's 4.3 GiB hole was scaled to the model. The offloaded tensors' device buffers
    are now in the stream: the reserve stays that of the step without offloading, and the peak falls."""
    spec = resolve_model("llama-3.1-70b")
    hardware = make_hardware("48GB", gpus_per_node=2)
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048, checkpointing="full", num_gpus=2, engine="torch",
                          sharding="zero3", finetune=Finetune(method=Method.QLORA, rank=16, alpha=16.0,
                                                              targets=ALL_LINEAR))
    kept, offloaded = estimate(spec, setup, hardware), estimate(spec, setup.replace(activation_offload=True), hardware)
    for step in (kept, offloaded):
        assert step.term("overhead/allocator_reserve").num_bytes < 0.1 * GiB
    assert offloaded.tensor_bytes < kept.tensor_bytes and offloaded.total_bytes < kept.total_bytes
