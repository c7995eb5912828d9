"""Static memory: parameters, gradients and optimizer states, per rank, with the engines' real dtypes.

Sources: ZeRO (Rajbhandari et al., 2020, arXiv:1910.02054) section 3.1 counts mixed-precision Adam at 2 + 2 + 12 bytes
per parameter and gives the per-rank split of each stage; torch.optim.adamw (_single_tensor_adamw /
_multi_tensor_adamw) for the step temporaries; bitsandbytes Optimizer8bit (block-wise quantisation, 256-element
blocks, fp32 state below min_8bit_size=4096 elements) for 8-bit AdamW and Lion, Optimizer8bit.get_state_buffer for
the paged variants (states of tensors >= 1e5 elements in CUDA unified memory); torchao.optim (_AdamBase._new_buffer,
OptimState8bit / OptimState4bit / OptimStateFp8.zeros) for its low-bit AdamW; transformers.optimization.Adafactor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..model_spec import ModelSpec
from ..setup import Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup
from . import deepspeed_zero3, float8, fsdp1, muon
from .fsdp2 import Fsdp2Units

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes: tensors smaller than this keep 32-bit state
BNB_BLOCK = 256  # bitsandbytes blockwise quantisation: one fp32 absmax per 256 elements
BNB_PAGED_MIN_NUMEL = 100_000  # bitsandbytes get_state_buffer: smaller states stay ordinary (allocator) tensors
AO_MIN_QUANT_SIZE = 4096  # torchao _new_buffer: smaller tensors (or numel % block != 0) keep a plain state
AO_BLOCKS = {Optimizer.ADAMW_AO_8BIT: 256, Optimizer.ADAMW_4BIT: 128, Optimizer.ADAMW_FP8: 256}
"""torchao 0.18 AdamW8bit / AdamW4bit / AdamWFp8 default block_size: one fp32 scale per block."""
AO_QMAP_ENTRIES = {Optimizer.ADAMW_AO_8BIT: 256, Optimizer.ADAMW_4BIT: 16, Optimizer.ADAMW_FP8: 0}
"""torchao keeps one fp32 lookup table per quantised state tensor (8-bit: 256 codes, 4-bit: 16; fp8 has none)."""


@dataclass(frozen=True)
class StaticBytes:
    """Full-model (unsharded) sizes; sharding is applied by the caller."""

    params_bytes: int
    grads_bytes: int
    states_bytes: int
    master_bytes: int
    step_temp_bytes: int
    param_bytes_per_elem: int
    state_formula: str
    frozen_bytes: int = 0
    """Frozen parameters (a LoRA base, in its storage dtype or quantized): no gradients, no states."""


def param_elem_bytes(precision: Precision) -> int:
    return precision.param_bytes


def trainable_bytes(spec: ModelSpec, elem_bytes: int) -> int:
    """Bytes of the trainable tensors, `elem_bytes` each unless a tensor has its own storage (LoRA adapters are
    fp32 whatever the training precision); gradients and AdamW's states have the parameter's dtype."""
    return sum(p.total_bytes(elem_bytes) for p in spec.params)


def _largest_bytes(spec: ModelSpec, elem_bytes: int) -> int:
    return max((p.nbytes or p.numel * elem_bytes for p in spec.params), default=0)


def _single_tensor_adamw_bytes(spec: ModelSpec, elem_bytes: int) -> int:
    """torch.optim.adam._single_tensor_adam (foreach=False): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
    .add_(eps)` makes two tensor-sized temporaries, and `denom` is a loop variable, so the previous parameter's
    denominator stays alive until it is rebound: the peak is max over consecutive parameters of prev + 2 x current,
    in parameter order (spec.params keeps the module's order; a repeated block's rows follow each other, and its
    last row precedes its first one in the next block)."""
    sizes = [(p.nbytes or p.numel * elem_bytes, p.count) for p in spec.params]
    if not sizes:
        return 0
    peak, previous = 2 * sizes[0][0], sizes[0][0]
    block = [size for size, count in sizes if count > 1]
    for size, count in sizes[1:]:
        peak, previous = max(peak, previous + 2 * size), size
    if block:  # the wrap from one block's last tensor to the next block's first
        peak = max(peak, block[-1] + 2 * block[0])
    return peak


def optimizer_state_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    p_bytes = param_elem_bytes(setup.precision)
    # With fp32 master weights (bf16-master) or CPU offload the states are fp32 whatever the param dtype.
    s_bytes = 4 if setup.precision.master_weights or setup.offload is not Offload.NONE else p_bytes
    n_tensors = sum(p.count for p in spec.params)
    opt = setup.optimizer
    if opt.torch_adam:
        step = 4 * n_tensors if setup.offload is Offload.NONE else 0  # one fp32 'step' scalar tensor per param
        return 2 * trainable_bytes(spec, s_bytes) + step, f"2 states x {s_bytes} B x P (exp_avg, exp_avg_sq)"
    if opt.library == "bitsandbytes":
        return _bnb_state_bytes(spec, opt), _BNB_FORMULAS[opt]
    if opt.library == "torchao":
        return _torchao_state_bytes(spec, opt, s_bytes), _torchao_formula(opt)
    if opt is Optimizer.SGD:
        return trainable_bytes(spec, s_bytes), f"momentum buffer {s_bytes} B x P"
    if opt is Optimizer.MUON:
        return muon.state_bytes(spec, s_bytes)
    if setup.sharding.stage >= 1 and setup.engine is Engine.DEEPSPEED:
        # DeepSpeed hands the optimizer flat 1-D partitions: nothing left to factor, the 2nd moment is full size
        # (measured: exp_avg_sq of 8836 elements for an 8836-parameter model)
        return s_bytes * spec.num_params + 4 * n_tensors, "full 2nd moment: ZeRO's flat partitions cannot be factored"
    return _adafactor_bytes(spec, s_bytes), "factored 2nd moment: rows + cols per matrix, full for vectors"


_BNB_FORMULAS = {
    Optimizer.ADAMW_8BIT: "2 x uint8 x P + fp32 absmax per 256 elements (fp32 states for tensors < 4096 elements)",
    Optimizer.PAGED_ADAMW_8BIT: "2 x uint8 x P + fp32 absmax per 256 elements (fp32 states for tensors < 4096 "
                                "elements); the uint8 states of tensors >= 1e5 elements in CUDA unified memory",
    Optimizer.PAGED_ADAMW: "2 x fp32 x P (bitsandbytes 32-bit states are fp32 whatever the parameter dtype); "
                           "those of tensors >= 1e5 elements in CUDA unified memory",
    Optimizer.LION_8BIT: "1 x uint8 x P + fp32 absmax per 256 elements (fp32 state for tensors < 4096 elements)",
    Optimizer.LION: "1 x fp32 x P (momentum; bitsandbytes 32-bit states are fp32 whatever the parameter dtype)",
}


def _bnb_layout(opt: Optimizer) -> tuple[int, bool]:
    """(states per parameter, 8-bit) of a bitsandbytes optimizer (Optimizer2State / Optimizer1State.init_state)."""
    return opt.kind.states, opt.state_bits == 8


def _bnb_state_bytes(spec: ModelSpec, opt: Optimizer, *, paged_only: bool = False) -> int:
    """bitsandbytes' state tensors (init_state): fp32 state1 (/state2) when 32-bit or below min_8bit_size, else
    uint8 states + one fp32 absmax per 256-element block each, and the fp32[256] quantisation maps the 8-bit states
    share (qmap1, qmap2; Lion only qmap1). `paged_only`: just the states get_state_buffer pages (>= 1e5 elements)."""
    states, eight = _bnb_layout(opt)
    total = 0
    for p in spec.params:
        small = p.numel < BNB_MIN_8BIT_SIZE or not eight
        buffer = p.numel * (4 if small else 1)
        if paged_only:
            total += states * buffer * p.count if opt.is_paged and p.numel >= BNB_PAGED_MIN_NUMEL else 0
            continue
        absmax = 0 if small else 4 * math.ceil(p.numel / BNB_BLOCK)
        total += states * (buffer + absmax) * p.count
    if eight and not paged_only and any(p.numel >= BNB_MIN_8BIT_SIZE for p in spec.params):
        total += states * 4 * 256
    return total


def paged_state_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """The part of the optimizer states a paged optimizer keeps in CUDA unified memory (cudaMallocManaged through
    bitsandbytes' get_paged): invisible to torch's allocator statistics; 0 for every other optimizer."""
    if not setup.optimizer.is_paged:
        return 0
    return _bnb_state_bytes(spec, setup.optimizer, paged_only=True)


def _torchao_state_bytes(spec: ModelSpec, opt: Optimizer, s_bytes: int) -> int:
    """torchao _AdamBase._new_buffer: a tensor of >= 4096 elements whose size divides by the block gets a quantised
    state (codes + an fp32 scale per block + its own fp32 qmap); any other keeps zeros_like(p). Plus the fp32 'step'
    scalar per parameter."""
    block, qmap = AO_BLOCKS[opt], 4 * AO_QMAP_ENTRIES[opt]
    total = 0
    for p in spec.params:
        if p.numel >= AO_MIN_QUANT_SIZE and p.numel % block == 0:
            codes = p.numel // 2 if opt is Optimizer.ADAMW_4BIT else p.numel
            per_state = codes + 4 * (p.numel // block) + qmap
        else:
            per_state = p.nbytes if p.nbytes else p.numel * s_bytes
        total += (2 * per_state + 4) * p.count
    return total


def _torchao_formula(opt: Optimizer) -> str:
    codes = {Optimizer.ADAMW_4BIT: "4-bit codes (P / 2 B)", Optimizer.ADAMW_FP8: "float8_e4m3 x P"}.get(
        opt, "uint8 x P")
    return (f"2 states x ({codes} + fp32 scale per {AO_BLOCKS[opt]} elements"
            f"{f' + fp32[{AO_QMAP_ENTRIES[opt]}] qmap' if AO_QMAP_ENTRIES[opt] else ''}); tensors < 4096 elements "
            "or not a multiple of the block keep full states (torchao)")


def _adafactor_bytes(spec: ModelSpec, s_bytes: int) -> int:
    total = 0
    for p in spec.params:
        shape = getattr(p, "shape", ()) or ()
        if len(shape) >= 2:
            per = shape[-1] + math.prod(shape[:-1])
        elif "weight" in p.name and "norm" not in p.name and "ln" not in p.name and p.numel > 4096:
            side = math.isqrt(p.numel)  # shape unknown: a square matrix is the conservative guess
            per = 2 * side
        else:
            per = p.numel
        elem = p.nbytes // p.numel if p.nbytes else s_bytes  # a LoRA adapter's state is fp32 like the adapter
        total += (per * elem + 4) * p.count  # + the fp32 'RMS' scalar
    return total


def optimizer_step_temp_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    """Transient memory of the optimizer step on the device (0 when the step runs on the CPU). A technique section
    that decides it (memfit.fields.TechniqueSection.step_temp_bytes) answers first."""
    for section in setup.techniques:
        decided = section.step_temp_bytes(spec, setup)
        if decided is not None:
            return decided
    if setup.offload is not Offload.NONE:
        return 0, ("step runs on the CPU (FSDP2 CPUOffloadPolicy: the optimizer steps the host shards)"
                   if setup.engine is Engine.TORCH else "step runs on the CPU (DeepSpeed CPU Adam)")
    if (setup.engine is Engine.DEEPSPEED and setup.sharding.stage >= 3 and setup.optimizer.torch_adam
            and setup.optimizer in (Optimizer.ADAMW, Optimizer.ADAMW_FOREACH)):
        per_rank, why = deepspeed_zero3.step_temp_bytes(spec, setup)
        return per_rank * setup.shard_size, why  # the caller divides by the shards
    p_bytes = 4 if setup.precision.master_weights else param_elem_bytes(setup.precision)
    largest = _largest_bytes(spec, p_bytes)
    opt = setup.optimizer
    if opt is Optimizer.ADAMW:
        return _single_tensor_adamw_bytes(spec, p_bytes), ("exp_avg_sq.sqrt() / bias_correction: 2 x a tensor, "
                                                           "beside the previous tensor's denominator")
    if opt is Optimizer.ADAMW_FOREACH:
        return trainable_bytes(spec, p_bytes), "_foreach_sqrt(exp_avg_sq): one parameter-sized temporary"
    if opt is Optimizer.MUON:
        return muon.step_temp_bytes(spec, p_bytes)
    if opt.library == "torchao":
        numel = max((p.numel for p in spec.params), default=0)
        return 2 * numel * 4, ("single_param_adam (torch.compile): the two moments of the largest tensor dequantised "
                               "to fp32 before re-quantising")
    if opt is Optimizer.ADAFACTOR:
        numel = max((p.numel for p in spec.params), default=0)
        extra = 2 if largest == 2 * numel else 0  # bf16 params are upcast: p.float() and grad.float()
        return (3 + extra) * numel * 4, "grad**2, factored update and scale: ~3 fp32 copies of the largest tensor"
    return 0, "in-place update"


def full_static(spec: ModelSpec, setup: TrainingSetup) -> StaticBytes:
    p_bytes = param_elem_bytes(setup.precision)
    states, formula = optimizer_state_bytes(spec, setup)
    temp, _ = optimizer_step_temp_bytes(spec, setup)
    master = 4 * spec.num_params if setup.precision.master_weights else 0
    trained = trainable_bytes(spec, p_bytes)
    return StaticBytes(params_bytes=trained, grads_bytes=trained, states_bytes=states, master_bytes=master,
                       step_temp_bytes=temp, param_bytes_per_elem=p_bytes, state_formula=formula,
                       frozen_bytes=spec.frozen_bytes)


@dataclass(frozen=True)
class ShardedStatic:
    """Per-rank resident bytes on the device and on the host."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    cpu_bytes: int
    param_working_set_bytes: int
    """Unsharded parameters gathered for compute beyond the rank's shard (ZeRO-3 / FSDP2), at the activation peak."""
    comm_buffers_bytes: int = 0
    """Gradient communication buffers the engine keeps for the whole step (DDP buckets, DeepSpeed's reduce bucket)."""
    grads_preallocated: bool = False
    """The gradient partition exists before backward (DeepSpeed ZeRO-3 allocates it at start-up)."""
    frozen_bytes: int = 0
    """Frozen parameters on this rank: whole (DDP, DeepSpeed ZeRO-1/2) or FSDP2's shards (lora_sharded)."""
    fsdp: Fsdp2Units | None = None
    """FSDP2's units (torch layout, ZeRO-2/3): what its backward keeps unsharded (memfit.estimate.fsdp2)."""
    comm_buffers_with_grads: bool = False
    """The buckets exist only while backward makes gradients: DeepSpeed ZeRO-1/2 allocates its reduce bucket(s)
    when the first gradient is ready (stage_1_and_2.py process_gradients -> setup_buckets) and drops them at the
    backward epilogue (_release_ipg_buffers), so neither the loss's backward nor the optimizer step sees them."""
    master_grad_upcast: bool = False
    """The optimizer step upcasts each bf16 gradient to fp32 for the master copy, releasing the bf16 one as it goes."""
    notes: tuple[str, ...] = ()


def shard(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, *, layout: Engine | None = None) -> ShardedStatic:
    """Per-rank static memory as the engine (`layout`, default the setup's) lays it out (ZeRO paper sec. 5 for the
    stages; the engine-specific buffers were measured on 2-rank gloo runs of DeepSpeed 0.19, FSDP2 and DDP in torch
    2.13, tests/engines/test_launch.py)."""
    n, stage = setup.shard_size, setup.sharding.stage
    params = full.params_bytes // n if stage >= 3 else full.params_bytes
    grads = full.grads_bytes // n if stage >= 2 else full.grads_bytes
    optimizer = (full.states_bytes + full.master_bytes) // n if stage >= 1 else full.states_bytes + full.master_bytes
    # DeepSpeed lays the step out only where it runs it: sharding or offload (the route memfit.emit writes, and the
    # one analytic._as_run sizes the precision for). Plain data parallelism is the Trainer's / accelerate's DDP.
    deepspeed_runs = setup.sharding is not Sharding.NONE or setup.offload is not Offload.NONE
    engine = _deepspeed_layout if (layout or setup.engine) is Engine.DEEPSPEED and deepspeed_runs else _torch_layout
    out = engine(spec, setup, full, ShardedStatic(params, grads, optimizer, 0, 0, frozen_bytes=full.frozen_bytes))
    if engine is _torch_layout and fsdp1.applies(setup):
        return fsdp1.layout(spec, setup, full, out)  # FSDP1's flat parameters, its CPU offload included
    for section in setup.techniques:  # a technique that lays the step out itself (TechniqueSection.static_layout)
        laid = section.static_layout(spec, setup, full, out)
        if laid is not None:
            return laid
    return _offloaded(spec, setup, full, out, grads_follow=(layout or setup.engine) is Engine.TORCH)


def _deepspeed_layout(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, s: ShardedStatic) -> ShardedStatic:
    n, stage = setup.shard_size, setup.sharding.stage
    if stage == 0 and setup.offload is Offload.NONE:
        # BF16_Optimizer (bf16 without ZeRO) keeps fp32 gradients for the fp32 master step beside the bf16 ones
        s = replace(s, master_grad_upcast=setup.precision.master_weights)
    # One rank without offload (world size 1) is laid out as any other world size: every partition is whole, the
    # fp32 partition copy and the buckets are there all the same (measured, bench/deepspeed_knobs.py)
    optimizer, comm, notes = s.optimizer_bytes, 0, []
    if stage >= 1 and setup.precision in (Precision.FP32, Precision.AMP_BF16, Precision.AMP_FP16):
        # DeepSpeed's ZeRO optimizer keeps an fp32 copy of each rank's partition even when the weights are fp32
        optimizer += 4 * spec.num_params // n
        notes.append("DeepSpeed keeps an fp32 copy of each rank's parameter partition (+4 B/param / N)")
    if stage in (0, 1, 2):
        # reduce_bucket_size = hidden^2 elements, the value HF's "auto" fills in (memfit emits "auto"); none without
        # contiguous_gradients, two under overlap_comm (memfit.zero_knobs.ZeroKnobs.reduce_buckets)
        comm = deepspeed_reduce_bucket_elems(spec, setup) * full.param_bytes_per_elem * setup.zero_knobs.reduce_buckets(
            stage)
    s = replace(s, optimizer_bytes=optimizer, comm_buffers_bytes=comm, grads_preallocated=stage == 3,
                comm_buffers_with_grads=stage in (1, 2) and setup.offload is Offload.NONE, notes=tuple(notes))
    if stage == 3:  # frozen partitions, persistent parameters, what stays gathered, the ipg bucket
        s = deepspeed_zero3.layout(spec, setup, s, full.param_bytes_per_elem,
                                   deepspeed_reduce_bucket_elems(spec, setup) * setup.zero_knobs.reduce_buckets(3))
    return s


def _torch_layout(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, s: ShardedStatic) -> ShardedStatic:
    n, stage = setup.shard_size, setup.sharding.stage
    # memfit's MasterWeightsOptimizer (bf16-master without FSDP2's fp32 shards) upcasts gradients in its step
    s = replace(s, master_grad_upcast=setup.precision.master_weights and setup.offload is Offload.NONE)
    if n > 1 and stage == 0:
        # DDP copies gradients into its buckets (gradient_as_bucket_view=False, the default HF and accelerate use)
        return replace(s, comm_buffers_bytes=full.grads_bytes, notes=("DDP gradient buckets: one more gradient-sized buffer",))
    if stage < 2:
        return s
    s = replace(s, master_grad_upcast=False)  # FSDP2's master shards are fp32 already, and so are their gradients
    params, grads, optimizer = s.params_bytes, s.grads_bytes, s.optimizer_bytes
    compute_bytes = full.param_bytes_per_elem
    if setup.precision.master_weights:
        # FSDP2 MixedPrecisionPolicy(param_dtype=bf16): the fp32 shard is the master copy; gradients reduce to fp32
        params, grads, optimizer = 4 * spec.num_params // n, 4 * spec.num_params // n, full.states_bytes // n
        compute_bytes = 2
    if not setup.precision.master_weights:
        params = full.params_bytes // n  # FSDP2 shards the parameters at rest at both stages
    if stage == 2:
        # reshard_after_forward=False: every block stays gathered from its forward to its backward
        working = compute_bytes * spec.num_params
    else:
        working = compute_bytes * _root_plus_block(spec)
    per_layer = sum(p.numel for p in spec.params if ".*." in p.name)
    reduce_bytes = 4 if setup.precision.master_weights else compute_bytes
    fp8_saving = float8.gathered_saving_per_block(spec, setup, compute_bytes)  # float8 all-gather: 1 B weights
    working -= fp8_saving * (spec.num_layers if stage == 2 else 1)
    units = Fsdp2Units(block_params=per_layer, root_params=spec.num_params - per_layer * spec.num_layers,
                       head_params=spec.vocab_size * spec.hidden_size, num_blocks=spec.num_layers,
                       compute_bytes=compute_bytes, reduce_bytes=reduce_bytes,
                       reshard_after_forward=stage == 3, tied=spec.tie_word_embeddings,
                       gathered_block_bytes=per_layer * compute_bytes - fp8_saving if fp8_saving else None)
    s = replace(s, params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, param_working_set_bytes=working, fsdp=units)
    if spec.frozen:  # a frozen base: sharded and gathered with its block, never reduced
        from .lora_sharded import fsdp2_layout

        s = fsdp2_layout(spec, setup, s, compute_bytes, reduce_bytes)
    return s


def _root_plus_block(spec: ModelSpec) -> int:
    """Unsharded copies at the activation peak: the root module (embeddings, final norm, LM head), gathered for the
    whole forward and backward, and the block being computed (FSDP2 traces show exactly this at backward's start)."""
    per_layer = sum(p.numel for p in spec.params if ".*." in p.name)
    outer = spec.num_params - sum(p.total for p in spec.params if ".*." in p.name)
    return per_layer + outer


def _offloaded(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, s: ShardedStatic, *,
               grads_follow: bool = False) -> ShardedStatic:
    """`grads_follow`: FSDP2's CPUOffloadPolicy moves each reduced gradient shard to the host too (torch layout);
    without it the DeepSpeed layout (`_deepspeed_offloaded`)."""
    if setup.offload is Offload.NONE:
        return s
    if not grads_follow:
        return _deepspeed_offloaded(spec, setup, full, s)
    n = setup.shard_size if setup.sharding.stage >= 1 else 1
    # FSDP2 CPUOffloadPolicy: fp32 master shards, fp32 gradient shards and the states in host RAM
    fp32_master = 4 * spec.num_params if full.params_bytes != 4 * spec.num_params else 0
    cpu = (full.states_bytes + fp32_master + 4 * spec.num_params) // n
    params = s.params_bytes
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        cpu += params
        params = 0
    grads = s.grads_bytes
    frozen = s.frozen_bytes
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        grads = 0
        if spec.frozen and s.fsdp is not None:  # a frozen base's shards go to the host too (FSDP-QLoRA + offload)
            from .lora_sharded import frozen_kept_on_device_bytes

            frozen = frozen_kept_on_device_bytes(spec, setup)
            cpu += s.frozen_bytes - frozen
    return replace(s, optimizer_bytes=0, cpu_bytes=cpu, params_bytes=params, grads_bytes=grads, frozen_bytes=frozen)


def deepspeed_reduce_bucket_elems(spec: ModelSpec, setup: TrainingSetup) -> int:
    """reduce_bucket_size in elements as the run sets it (memfit.zero_knobs): the HF Trainer's "auto" value hidden^2,
    which memfit emits (and its engine sets from the model's hidden size), unless the user's JSON says otherwise."""
    return setup.zero_knobs.reduce_bucket_elems(spec.hidden_size)


def deepspeed_persistent_params(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Parameters ZeRO-3 keeps whole on every device: those under stage3_param_persistence_threshold (norms)."""
    threshold = setup.zero_knobs.persistence_threshold(spec.hidden_size)
    return sum(p.numel * p.count for p in spec.params if p.numel <= threshold)  # mark_persistent_parameters


def _deepspeed_offloaded(spec: ModelSpec, setup: TrainingSetup, full: StaticBytes, s: ShardedStatic) -> ShardedStatic:
    """DeepSpeed 0.19's ZeRO-Offload (offload_optimizer) and ZeRO-Infinity-on-CPU (+ offload_param), per rank, from
    the buffers its optimizers allocate (measured on 1-rank CPU runs, tests/engines/test_offload_one_gpu.py):

    ZeRO-1/2 (runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__ and initialize_optimizer_states):
    device: the flat 16-bit parameters, whole (bit16_groups_flat); the contiguous gradient bucket of
    reduce_bucket_size elements (setup_buckets; cpu_offload forces contiguous_gradients); temp_grad_buffer_for_gpu_
    offload (largest parameter x 16-bit); a gradient larger than the bucket bypasses it and lives whole until
    reduced (reduce_independent_p_g_buckets_and_remove_grads); ZeRO-1 keeps every gradient until the boundary.
    host (pinned): the fp32 master partition (single_partition_of_fp32_groups, even for fp32 weights), its fp32
    gradient, the optimizer states (DeepSpeedCPUAdam), the 16-bit copy the step writes before the upload
    (param_buffer_of_bit16_for_cpu_offload_groups), temp_grad_buffer_for_cpu_offload (largest parameter) and, with
    accumulation, at ZeRO-2, accumulated_grads_in_cpu (16-bit, async_accumulate_grad_in_cpu_via_gpu; ZeRO-1 keeps
    accumulating on the device and reduces at the boundary).

    ZeRO-3 (runtime/zero/stage3.py, DeepSpeedZeroOptimizer_Stage3): device: the ipg bucket (_setup_for_real_optimizer),
    the parameters under the persistence threshold (whole), the gathered working set, and the gradient being reduced;
    with offload_param the 16-bit partitions live on the host (_create_param_groups_fp16_flat_cpu_memory), else on
    the device. host: fp32 master partitions (_create_fp32_partitions), their fp32 gradients (initialize_optimizer_
    states), grad_partitions_flat_buffer in the accumulation dtype (= the model's) and the states."""
    n = setup.shard_size if setup.sharding.stage >= 1 else 1
    stage = max(setup.sharding.stage, 1)  # offload alone runs as ZeRO-1 (memfit.emit.deepspeed.zero_stage)
    pb = full.param_bytes_per_elem
    part = spec.num_params // n
    largest = max((p.numel for p in spec.params), default=0)
    bucket = deepspeed_reduce_bucket_elems(spec, setup)
    master = 2 if setup.precision is Precision.BF16 else 4  # bf16_master_weights_and_grads keeps them 16-bit
    host = full.states_bytes // n + 2 * master * part  # states + master partition + its gradient
    notes = [f"host: optimizer states + {master} B master + {master} B gradient per parameter of the rank's "
             "partition, stepped by DeepSpeedCPUAdam"]
    if stage <= 2:
        host += pb * part + pb * largest
        if setup.grad_accum_steps > 1 and stage == 2:  # ZeRO-1 accumulates on the device (measured)
            host += pb * part
        grads = s.grads_bytes if stage == 1 else (pb * largest if largest > bucket else 0)
        comm = pb * bucket + pb * largest
        notes.append(f"device: {pb} B parameters whole, the reduce bucket (hidden^2) and a largest-parameter staging "
                     "buffer; gradients leave for the host bucket by bucket" if stage == 2 else
                     "ZeRO-1 offload keeps every 16-bit gradient on the device until the step: ZeRO-2 does not")
        return replace(s, optimizer_bytes=0, cpu_bytes=host, grads_bytes=grads, comm_buffers_bytes=comm,
                       notes=tuple(notes))  # the device-side fp32 partition note no longer applies
    host += pb * part  # grad_partitions_flat_buffer, on the host with offload_optimizer
    params = s.params_bytes
    persistent = pb * deepspeed_persistent_params(spec, setup)
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        host += pb * part
        params = persistent
        notes.append("device: no parameter partitions (offload_param): each module's parameters are fetched from "
                     "the host when it runs, and those under the persistence threshold stay")
    notes.append("start-up also holds one fp32 buffer of the largest optimizer sub-group (sub_group_size, 1e9 "
                 "elements by default) on the host for a moment (stage3.py initialize_optimizer_states)")
    grads = pb * min(max(largest, bucket), spec.num_params)
    return replace(s, optimizer_bytes=0, cpu_bytes=host, params_bytes=params, grads_bytes=grads,
                   comm_buffers_bytes=pb * bucket, grads_preallocated=False, notes=tuple(notes))
