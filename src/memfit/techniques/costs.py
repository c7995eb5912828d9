"""Costs a technique adds, in the units users weigh: compute, bytes over the wire per step, seconds, packages, what
it rules out.

Each is a typed `Cost`: the ladder prints its `text` (rendered from its fields), memfit.throughput and
`plan --optimize` read the numbers (`step_cost`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..estimate.comm import comm_volume, data_parallel_bytes, describe_runtime
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..estimate.static import param_elem_bytes
from ..setup import LOSS_CHUNKS, Attention, Engine, Offload, Precision, TrainingSetup
from ..units import format_bytes


def zero_traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Bytes each rank sends per optimizer step on the setup's engine and ZeRO stage: memfit.estimate.comm, the one
    communication model (the ZeRO paper's 2 Psi / 3 Psi where the engine does what the paper does)."""
    return comm_volume(spec, setup).per_rank_bytes


@dataclass(frozen=True)
class Cost:
    """What a technique costs per optimizer step per rank. `template` renders `text` from the numbers
    (str.format over `fields()`); caveats are what no number says."""

    recompute_fraction: float = 0.0
    """Extra compute, as a share of a step without the technique (checkpointing)."""
    wire_bytes: int = 0
    """Bytes each rank sends over the interconnect per optimizer step (ZeRO, data parallelism)."""
    host_link_bytes: int = 0
    """Bytes between host and device per optimizer step (offload), over `host_link_gb_per_s`."""
    host_link_seconds: float = 0.0
    cpu_step_seconds: float = 0.0
    """The optimizer step on the CPU (offload)."""
    host_bytes: int = 0
    """Pinned host RAM per GPU (activation offload)."""
    step_time_factor: float = 1.0
    """What the technique multiplies compute time by, where modelled (low-bit optimizer states: 1.01)."""
    mfu_factor: float = 1.0
    """What the setup multiplies the model FLOP utilisation by, where modelled (memfit.throughput): fp32 runs on
    TF32 tensor cores at half the bf16 rate (FP32_MFU_FACTOR), eager attention at EAGER_MFU_FACTOR."""
    loss_chunks: int = 0
    """Head matmuls and cross-entropies per sequence instead of one (the chunked loss: LOSS_CHUNKS)."""
    requires: tuple[str, ...] = ()
    """Packages the technique needs installed beyond torch and transformers (the fused loss: liger-kernel)."""
    gives_up: tuple[str, ...] = ()
    """Training features the technique rules out (the optimizer step in backward: clipping, accumulation)."""
    new_method: bool = False
    """The technique trains something else (LoRA, QLoRA: adapters on a frozen base), not the same model."""
    caveats: tuple[str, ...] = ()
    template: str = "{caveats}"

    def fields(self) -> dict:
        return {"recompute_percent": 100 * self.recompute_fraction, "wire": format_bytes(self.wire_bytes),
                "host_link": format_bytes(self.host_link_bytes), "host_link_seconds": self.host_link_seconds,
                "cpu_step_seconds": self.cpu_step_seconds, "host": format_bytes(self.host_bytes),
                "loss_chunks": self.loss_chunks, "requires": ", ".join(self.requires),
                "gives_up": " and ".join(f"no {what}" for what in self.gives_up),
                "caveat": self.caveats, "caveats": "; ".join(self.caveats)}

    @property
    def text(self) -> str:
        return self.template.format(**self.fields())


def zero_cost(spec: ModelSpec, setup: TrainingSetup) -> Cost:
    """The ZeRO rung's cost: the engine's bytes per rank per step (memfit.estimate.comm)."""
    volume = comm_volume(spec, setup)
    baseline = data_parallel_bytes(spec, setup)
    ratio = f", {volume.per_rank_bytes / baseline:.3g}x its data-parallel all-reduce" if baseline else ""
    return Cost(wire_bytes=volume.per_rank_bytes,
                caveats=(f"{volume.psi_multiple:.3g} x Psi, {describe_runtime(setup)}{ratio}",),
                template="{wire} per rank per step over the interconnect ({caveat[0]})")


def zero_traffic(spec: ModelSpec, setup: TrainingSetup) -> str:
    return zero_cost(spec, setup).text


CPU_ADAM_PARAMS_PER_S = 1e9
"""DeepSpeedCPUAdam (AVX2/AVX512, all cores of a node's share) steps about 1e9 fp32 parameters per second."""


def offload_traffic_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Host<->device bytes per optimizer step per rank over PCIe, from what the engine copies:

    DeepSpeed ZeRO-1 + offload_optimizer: the engine reduces only at the accumulation boundary
    (engine.allreduce_gradients), so each gradient crosses once, cast to the master dtype, and the 16-bit partition
    comes back after the step.
    DeepSpeed ZeRO-2 + offload_optimizer (runtime/zero/stage_1_and_2.py): each gradient of the rank's partition
    goes down once, cast to the master dtype on the device first (async_inplace_copy_grad_to_fp32_buffer_from_gpu:
    4 B/param); with accumulation every micro-step also moves the 16-bit running sum down and, after the first, back
    up (async_accumulate_grad_in_cpu_via_gpu); after the CPU step the 16-bit partition goes up once (step:
    param_buffer_of_bit16_for_cpu_offload_groups -> bit16_partitions).
    DeepSpeed ZeRO-3 (stage3.py partition_grads): each micro-step's 16-bit gradient partition goes down and comes
    back up (micro-step 0: `.to(grad_partition.device)`; later ones: up, add, down), at the boundary the master-dtype
    copy goes down (_offload_grad_partition_at_boundary); the 16-bit parameters go up after the step, or, with
    offload_param, twice per micro-step (fetched for forward and again for backward) and never after the step.
    torch FSDP2 CPUOffloadPolicy: 16-bit gradients down and 16-bit parameters up (ZeRO-Offload, Ren et al. 2021),
    and with parameter offload the parameters twice more."""
    if setup.offload is Offload.NONE:
        return 0
    n = setup.dp_size if setup.sharding.stage >= 1 else 1
    if setup.engine is Engine.TORCH and setup.finetune.adapters:
        return _fsdp2_adapter_offload_traffic(spec, setup)
    if setup.engine is Engine.TORCH:
        shard = setup.dp_size if setup.sharding.stage >= 2 else 1
        traffic = 2 * 2 * spec.num_params // shard
        if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
            traffic += 2 * 2 * spec.num_params // setup.dp_size
        return traffic
    part = spec.num_params // n
    pb = param_elem_bytes(setup.precision)
    master = 2 if setup.precision is Precision.BF16 else 4
    accum = setup.grad_accum_steps
    if setup.sharding.stage <= 1:
        # ZeRO-1 (and offload alone): gradients accumulate on the device and cross once, at the boundary
        return master * part + pb * part
    if setup.sharding.stage == 2:
        down = master * part + (pb * part * accum if accum > 1 else 0)
        up = pb * part + pb * part * (accum - 1)
        return down + up
    down = pb * part * accum + master * part
    up = pb * part * accum
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        up += 2 * pb * part * accum
    else:
        up += pb * part
    return down + up


def _fsdp2_adapter_offload_traffic(spec: ModelSpec, setup: TrainingSetup) -> int:
    """FSDP2 CPUOffloadPolicy over a LoRA / QLoRA model (torch _fsdp_param.py all_gather_inputs, _fsdp_collectives
    foreach_reduce): every all-gather copies the rank's shards up (the frozen base as stored, a 4-bit one packed;
    twice per micro-step at ZeRO-3: forward and backward), each reduced fp32 adapter gradient shard comes down."""
    from ..estimate.lora import adapted_spec
    from ..estimate.lora_sharded import frozen_kept_on_device_bytes, frozen_shard_bytes

    adapted, n = adapted_spec(spec, setup), setup.dp_size
    shards = frozen_shard_bytes(adapted, setup, n) - frozen_kept_on_device_bytes(adapted, setup)
    adapters = 4 * adapted.num_params // n
    return setup.grad_accum_steps * (2 * (shards + adapters) + adapters)


def cpu_step_seconds(spec: ModelSpec, setup: TrainingSetup) -> float:
    """Seconds of the optimizer step on the CPU per rank (0 without offload)."""
    if setup.offload is Offload.NONE:
        return 0.0
    n = setup.dp_size if setup.sharding.stage >= 1 else 1
    if setup.finetune.adapters and setup.engine is Engine.TORCH:  # FSDP2 steps the adapters' shards only
        from ..estimate.lora import adapted_spec

        spec = adapted_spec(spec, setup)
    return spec.num_params / n / CPU_ADAM_PARAMS_PER_S


def host_link_seconds(num_bytes: int, hardware: Hardware) -> float:
    """Seconds to move `num_bytes` between host and device at the GPU's effective host link rate (data/gpus.json
    host_link_gb_per_s): the one transfer model of every offload."""
    return num_bytes / (hardware.gpu.host_link_gb_per_s * 1e9)


def offload_cost(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
    """The offload rung's cost: the engine's host<->device copies and the CPU optimizer step."""
    return host_step_cost(offload_traffic_bytes(spec, setup), cpu_step_seconds(spec, setup), setup, hardware)


def host_step_cost(traffic: int, cpu_seconds: float, setup: TrainingSetup, hardware: Hardware) -> Cost:
    """An optimizer step on the host, as the offload rung states it: `traffic` host<->device bytes per optimizer
    step and `cpu_seconds` of CPU step (DeepSpeed's, FSDP2's or a registered one-GPU HostStep's)."""
    per = f" ({setup.grad_accum_steps} micro-steps)" if setup.grad_accum_steps > 1 else ""
    return Cost(host_link_bytes=traffic, host_link_seconds=host_link_seconds(traffic, hardware),
                cpu_step_seconds=cpu_seconds,
                caveats=(per, f"{hardware.gpu.host_link_gb_per_s:g} GB/s", f"{CPU_ADAM_PARAMS_PER_S:.0e} params/s"),
                template="{host_link} over PCIe per step{caveat[0]} (~{host_link_seconds:.2f} s at {caveat[1]}) and a "
                         "CPU Adam step (~{cpu_step_seconds:.1f} s at {caveat[2]})")


def recompute_fraction(spec: ModelSpec, setup: TrainingSetup) -> float:
    """Extra compute of the setup's checkpointing, as a share of a step without it (forward + backward = 3 forwards
    of matmul FLOPs, 2 x P per token each). full: one more forward, 1/3; every-N: 1/(3N); selective-op: the
    recomputed (2nd, 4th, ...) matmuls of every block (memfit.estimate.activations' matmul list) plus 1% for the
    memory-bound elementwise ops it rebuilds; attention: the eager core's QK^T and x V, 4 x T x q FLOPs per token
    per layer."""
    from ..estimate.activations import _matmul_widths
    from ..setup import Checkpointing

    mode = setup.checkpointing
    if mode is Checkpointing.NONE:
        return 0.0
    if mode is Checkpointing.FULL:
        return 1 / 3
    if mode.every:
        return 1 / (3 * mode.every)
    layers = max(spec.num_layers, 1)
    q = spec.num_attention_heads * spec.head_dim or spec.hidden_size
    core = 4 * setup.seq_len * q * layers
    forward = 2 * spec.num_params + core
    if mode is Checkpointing.ATTENTION:
        return core / forward / 3
    widths = _matmul_widths(spec) if spec.is_transformer else []
    recomputed = sum(2 * spec.hidden_size * w for i, (_, w) in enumerate(widths) if i % 2 == 1) * layers
    return min(1 / 3, recomputed / max(forward, 1) / 3 + 0.01)


_RECOMPUTED = {"full": "one extra forward per step",
               "selective-op": "every 2nd matmul of a block and its elementwise ops recomputed",
               "attention": "the attention core's two T x T matmuls and softmax recomputed"}


def checkpointing_cost(spec: ModelSpec, setup: TrainingSetup) -> Cost:
    """The checkpointing rung's cost: the recomputed share of a step (recompute_fraction)."""
    what = _RECOMPUTED.get(str(setup.checkpointing), f"one extra forward of every {setup.checkpointing.every}th "
                                                    "block")
    return Cost(recompute_fraction=recompute_fraction(spec, setup), caveats=(what,),
                template="+{recompute_percent:.0f}% compute ({caveat[0]})")


LOW_BIT_STEP_FACTOR = 1.01
"""Low-bit optimizer states (8-bit / 4-bit AdamW): quantise and dequantise around each update, ~1% of a step."""


def offload_step_cost(spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
    """The engine's optimizer offload, as a step pays it: host copies and the CPU step (a one-GPU HostStep's own
    Technique states its own)."""
    if setup.offload is Offload.NONE:
        return Cost()
    traffic = offload_traffic_bytes(spec, setup)
    return Cost(host_link_bytes=traffic, host_link_seconds=host_link_seconds(traffic, hardware),
                cpu_step_seconds=cpu_step_seconds(spec, setup))


def combined(costs) -> Cost:
    """Several techniques' costs of one step: amounts add up, step-time factors multiply."""
    total = Cost()
    for cost in costs:
        total = Cost(recompute_fraction=total.recompute_fraction + cost.recompute_fraction,
                     wire_bytes=total.wire_bytes + cost.wire_bytes,
                     host_link_bytes=total.host_link_bytes + cost.host_link_bytes,
                     host_link_seconds=total.host_link_seconds + cost.host_link_seconds,
                     cpu_step_seconds=total.cpu_step_seconds + cost.cpu_step_seconds,
                     host_bytes=total.host_bytes + cost.host_bytes,
                     step_time_factor=total.step_time_factor * cost.step_time_factor,
                     mfu_factor=total.mfu_factor * cost.mfu_factor,
                     loss_chunks=max(total.loss_chunks, cost.loss_chunks),
                     requires=total.requires + cost.requires, gives_up=total.gives_up + cost.gives_up,
                     new_method=total.new_method or cost.new_method, caveats=total.caveats + cost.caveats)
    return total


# ------------------------------------------------------------------------ the rungs whose costs are not bytes

FP32_MFU_FACTOR = 0.5
"""fp32 matmuls run on TF32 tensor cores at half the bf16 rate (memfit.throughput)."""
EAGER_MFU_FACTOR = 0.85
"""Eager attention (the B x H x T x T softmax written out and read back) against a fused kernel (memfit.throughput)."""


def precision_step_cost(setup: TrainingSetup) -> Cost:
    """What the setup's precision does to a step's speed: fp32 runs at FP32_MFU_FACTOR of the bf16 rate."""
    return Cost(mfu_factor=FP32_MFU_FACTOR if setup.precision is Precision.FP32 else 1.0)


_PRECISION_CAVEATS = {
    Precision.AMP_FP16: "loss scaling needed for fp16",
    Precision.AMP_BF16: "weights stay fp32",
    Precision.BF16: "bf16 weight updates lose small steps: prefer stochastic rounding or Kahan summation for long runs",
}


def precision_cost(proposed: Precision) -> Cost:
    """The mixed-precision rung's cost: nothing in compute (autocast from fp32 runs on the faster 16-bit tensor
    cores), and what the proposed precision risks."""
    faster = " (faster tensor cores)" if proposed.is_autocast else ""
    return Cost(caveats=(_PRECISION_CAVEATS[proposed],), template=f"none in compute{faster}; {{caveats}}")


def attention_step_cost(setup: TrainingSetup) -> Cost:
    """What the setup's attention does to a step's speed: eager runs at EAGER_MFU_FACTOR of a fused kernel."""
    return Cost(mfu_factor=EAGER_MFU_FACTOR if setup.attention is Attention.EAGER else 1.0)


def attention_cost() -> Cost:
    """The FlashAttention / SDPA rung's cost: none (memfit.throughput: eager runs at EAGER_MFU_FACTOR)."""
    return Cost(template="none: usually faster than eager attention")


def low_bit_optimizer_cost(state_bits: int) -> Cost:
    """The low-bit optimizer rung's cost: LOW_BIT_STEP_FACTOR of step time, and how well the states train."""
    if state_bits == 8:
        return Cost(step_time_factor=LOW_BIT_STEP_FACTOR,
                    caveats=("matches 32-bit Adam on LM fine-tuning (Dettmers et al. 2022)",),
                    template="negligible step time; {caveats}")
    return Cost(step_time_factor=LOW_BIT_STEP_FACTOR,
                caveats=("4-bit states (torchao AdamW4bit, Li et al. 2023, arXiv:2309.01507) matched 32-bit AdamW on "
                         "the paper's fine-tuning and pre-training runs, but are newer and less tried than 8-bit",
                         "the step is torch.compile'd (first-step compile)", "watch the loss curve"))


def fused_loss_cost() -> Cost:
    """The fused loss's cost: Liger's kernel, a package of its own (Triton, CUDA)."""
    return Cost(requires=("liger-kernel",),
                template="none: Liger's fused linear cross-entropy is usually faster; needs {requires} (Triton, "
                         "CUDA) installed")


def chunked_loss_cost() -> Cost:
    """The chunked loss's cost: LOSS_CHUNKS smaller head matmuls and cross-entropies (torchtune
    CEWithChunkedOutputLoss)."""
    return Cost(loss_chunks=LOSS_CHUNKS,
                template="a little compute: {loss_chunks} smaller head matmuls and cross-entropies instead of one")


def optimizer_in_backward_cost() -> Cost:
    """The optimizer step in backward's cost: nothing in compute; it rules out clipping and accumulation (torchtune
    optimizer_in_bwd)."""
    return Cost(gives_up=("gradient clipping", "gradient accumulation"), template="none in compute; {gives_up}")


def compile_cost() -> Cost:
    """torch.compile's cost: compile time and what recompiles and graph breaks do."""
    return Cost(caveats=("compile time before the first step (tens of seconds to minutes per distinct block, again "
                         "after each recompile)",
                         "dynamic shapes (a new sequence length) recompile unless marked dynamic, and past "
                         "torch._dynamo.config.recompile_limit the block runs eager",
                         "a graph break splits the block and keeps what eager keeps at the break"),
                template="{caveats}. Usually faster per step once compiled")


def lora_cost(*, quantized: bool) -> Cost:
    """LoRA's and QLoRA's cost: a different method, and for QLoRA the 4-bit base's error and dequantization."""
    if quantized:
        return Cost(new_method=True,
                    caveats=("NF4 quantization error in the frozen base (on par with 16-bit LoRA in Dettmers et al. "
                             "2023, arXiv:2305.14314) and a dequantization of every Linear weight in forward and "
                             "again in backward (slower steps than LoRA)",),
                    template="LoRA's trade-off, plus {caveats}")
    return Cost(new_method=True,
                caveats=("trains a rank-r update of the targeted projections instead of every weight (close to full "
                         "fine-tuning on instruction tuning, behind it on large domain shifts: Biderman et al. 2024, "
                         "arXiv:2405.09673)", "backward skips the frozen weights' gradients"),
                template="a different method: {caveats}")


def micro_batch_cost(effective_batch: int, micro_steps: int, was: int) -> Cost:
    """The micro-batch rung's cost: the same effective batch in more micro-steps, each using the GPU less well."""
    return Cost(caveats=(f"same effective batch ({effective_batch}) in {micro_steps} micro-steps instead of {was}",
                         "smaller matmuls use the GPU less well"))
