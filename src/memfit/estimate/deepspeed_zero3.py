"""DeepSpeed ZeRO-3 (stage3.py + parameter_offload.py + partitioned_param_coordinator.py, DeepSpeed 0.19): what a rank
holds beyond its partitions, for full fine-tunes and for a frozen base with LoRA adapters.

- Every parameter of the module is partitioned, frozen ones included (parameter_offload.py
  DeepSpeedZeRoOffload._convert_to_zero_parameters runs zero.Init(module=...) over module.parameters()): a frozen
  tensor keeps ceil(numel / N) elements of its dtype as `ds_tensor`. Only the trainable ones (the optimizer's groups)
  get fp32 master partitions and a slot in grad_partitions_flat_buffer (stage3.py _setup_for_real_optimizer).
- A parameter of at most stage3_param_persistence_threshold elements (memfit and HF "auto": 10 x hidden) is marked
  ds_persist (mark_persistent_parameters, `ds_numel <= threshold`) and stays whole on every rank for the whole run,
  beside its partition.
- After its module's forward a parameter is released only if the module is not used again within
  stage3_max_reuse_distance elements (1e9 by default) of the recorded trace
  (PartitionedParameterCoordinator.__params_to_release, from the second step on, once the trace is complete):
  the trace is forward + backward (+ each checkpointed block's recompute), so every module that is fetched again in
  backward and whose reuse lies within 1e9 elements stays gathered from its forward into its backward. A module is
  fetched in backward when its forward output requires grad (parameter_offload.py _post_forward_module_hook
  registers the pre-backward hook on such outputs): under LoRA without checkpointing the frozen embedding and the
  frozen input projections of block 0 (their input needs no gradient) are released after forward; with
  checkpointing peft's enable_input_require_grads and the recompute bring them back. Checked: the parameters whose
  ds_status is AVAILABLE at the LM head's backward on a 2-rank run equal this set exactly.
- ZeRO-3 keeps one reduce (ipg) bucket of reduce_bucket_size elements in the model dtype from initialisation
  (stage3.py, `bucket.buffer = torch.empty(self.reduce_bucket_size)` under contiguous_gradients).
- zero.Init replaces torch.nn.functional.linear with LinearFunctionForZeroStage3 (runtime/zero/linear.py,
  memory_efficient_linear=True by default), which saves its input for every Linear whose output needs a gradient,
  frozen weight or not: a frozen LM head keeps its B x T x h input, which autograd's own linear would not.
"""

from __future__ import annotations

from dataclasses import replace

from ..model_spec import ModelSpec, ParamTensor
from ..setup import Checkpointing, Offload, Optimizer, TrainingSetup
from .result import Category, Term
from .moments import AddBeside, ShrinkBeside, StepChange
from .terms import TermKey


def persistence_threshold(spec: ModelSpec, setup: TrainingSetup) -> int:
    """stage3_param_persistence_threshold in elements as the run sets it (memfit.zero_knobs)."""
    return setup.zero_knobs.persistence_threshold(spec.hidden_size)


def persistent(threshold: int, t: ParamTensor) -> bool:
    return t.numel <= threshold  # mark_persistent_parameters: ds_numel <= param_persistence_threshold


def _elems(threshold: int, tensors, *, whole_persistent: bool = True) -> int:
    """Elements of `tensors` (each counted `count` times), the persistent ones left out unless asked."""
    return sum(t.numel * t.count for t in tensors if whole_persistent or not persistent(threshold, t))


def _names(node) -> set[str]:
    from ..graph import tensors_of

    return {t.name for t in tensors_of(node, getattr(node, "name", ""))} if node is not None else set()


def _first_block_inputs_frozen(spec: ModelSpec) -> set[str]:
    """Block 0's frozen attention input projections (q/k/v or fused qkv) when LoRA adapts one of them: their input
    (the normed embedding output) needs no gradient, so DeepSpeed never fetches them in backward."""
    from ..graph import tensors_of, walk
    from ..graph.kinds.linear import LoraLinear

    if spec.graph is None or not spec.graph.stacks:
        return set()
    stack = spec.graph.stacks[0]
    names, adapted = set(), False
    for path, node, parents in walk(stack.block):
        if parents and type(parents[-1][0]).__name__ == "Attention" and parents[-1][1] == "qkv":
            adapted |= isinstance(node, LoraLinear)
            names |= {t.name for t in tensors_of(node, f"{stack.name}.*.{path}") if not t.trainable}
    return names if adapted else set()


def _units(spec: ModelSpec) -> tuple[list[ParamTensor], list[ParamTensor], list[ParamTensor], list[ParamTensor]]:
    """(the token embedding, the other tensors used before the blocks (position tables), one block's tensors every
    layer, what runs after the blocks: final norm and head, a tied head's embedding matrix), trainable and frozen."""
    graph = spec.graph
    tensors = [*spec.params, *spec.frozen]
    embed = _names(getattr(graph, "embed", None))
    after = _names(getattr(graph, "final_norm", None)) | _names(getattr(graph, "head", None))
    if spec.tie_word_embeddings:
        after |= embed  # the head multiplies by the embedding matrix right before the loss
    root = [t for t in tensors if ".*." not in t.name]
    return ([t for t in root if t.name in embed and t.name not in after], [t for t in root if t.name not in embed
            and t.name not in after], [t for t in tensors if ".*." in t.name], [t for t in root if t.name in after])


def gathered_elems(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Non-persistent elements gathered at the start of backward (the LM head's backward, the loss's peak):
    the final norm and head (used now), every block whose forward-to-backward reuse distance is under
    stage3_max_reuse_distance, and a tensor used before the blocks only if it is fetched again in backward (it is
    trained, or it is the token embedding under checkpointing with adapters: peft's enable_input_require_grads)."""
    embed, before, block, tail = _units(spec)
    layers, th = spec.num_layers, persistence_threshold(spec, setup)
    ckpt = setup.checkpointing is not Checkpointing.NONE
    block_numel = _elems(th, block) // max(layers, 1)
    tail_numel = _elems(th, tail)
    gathered = _elems(th, tail, whole_persistent=False)
    block_kept = _elems(th, block, whole_persistent=False) // max(layers, 1)
    uses = 3 if ckpt else 2  # forward + backward (+ the recompute) of each later block lie in between
    reuse = setup.zero_knobs.max_reuse_distance
    kept_blocks = sum(uses * (layers - 1 - i) * block_numel + 2 * tail_numel < reuse for i in range(layers))
    gathered += block_kept * max(kept_blocks, min(layers, 1))  # at least the block backward is computing
    unfetched = set() if ckpt or not spec.frozen else _first_block_inputs_frozen(spec)
    whole = uses * layers * block_numel + 2 * tail_numel  # from before the blocks to the end of backward
    if layers and whole < reuse:
        gathered -= sum(t.numel for t in block if t.name in unfetched and not persistent(th, t))
    trained = {p.name for p in spec.params}
    if whole < reuse:
        gathered += sum(t.numel * t.count for t in (*embed, *before) if not persistent(th, t)
                        and (t.name in trained or (t in embed and ckpt and spec.frozen)))
    return gathered


def persistent_elems(threshold: int, tensors) -> int:
    return sum(t.numel * t.count for t in tensors if persistent(threshold, t))


def frozen_partition_bytes(spec: ModelSpec, setup: TrainingSetup, n: int, elem_bytes: int) -> int:
    """A frozen base under ZeRO-3: each tensor's ceil(numel / N) partition in its dtype, a persistent one whole
    besides."""
    th = persistence_threshold(spec, setup)
    return sum(t.count * (-(-t.numel // n) + (t.numel if persistent(th, t) else 0))
               * (t.nbytes // t.numel if t.nbytes else elem_bytes) for t in spec.frozen)


def gathers_views(setup: TrainingSetup) -> bool:
    """One rank whose partitions are on the device: ZeRO-3 "gathers" nothing. With a partition world size of 1,
    fetching a parameter points its data at its own partition (partition_parameters.py all_gather_coalesced ->
    _no_gather_coalesced -> NoGatherHandle: `param.data = param.ds_tensor.data.to(device).view(ds_shape)`, no copy
    when the partition is already there), persistent ones included. offload_param keeps the partitions on the host,
    so there the fetch copies them to the device."""
    return setup.shard_size == 1 and setup.offload is not Offload.OPTIMIZER_AND_PARAMS


def layout(spec: ModelSpec, setup: TrainingSetup, static, elem_bytes: int, bucket_elems: int):
    """`static` (memfit.estimate.static's ZeRO-3 split of the trainable tensors) with DeepSpeed's ZeRO-3 buffers:
    the frozen partitions, the persistent parameters whole, what stays gathered into backward, the ipg bucket
    (`bucket_elems`: reduce_bucket_size, 0 without contiguous_gradients). On one rank (`gathers_views`) the
    partitions are the whole parameters and nothing more is gathered."""
    n = setup.shard_size
    if gathers_views(setup):
        return replace(static, frozen_bytes=sum(t.count * t.numel * (t.nbytes // t.numel if t.nbytes else elem_bytes)
                                                for t in spec.frozen),
                       param_working_set_bytes=0, comm_buffers_bytes=elem_bytes * bucket_elems)
    params = static.params_bytes + elem_bytes * persistent_elems(persistence_threshold(spec, setup), spec.params)
    return replace(static, params_bytes=params, frozen_bytes=frozen_partition_bytes(spec, setup, n, elem_bytes),
                   param_working_set_bytes=elem_bytes * gathered_elems(spec, setup),
                   comm_buffers_bytes=elem_bytes * bucket_elems)


def step_changes(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> list[StepChange]:
    """DeepSpeed ZeRO-3's moment-specific terms (unchanged elsewhere): every moment where the head's input is alive
    (it holds TermKey.HEAD) gets the frozen head's input ZeRO-3's linear saves; a recomputed block's moment
    holds one frozen tensor of the block, not all of them (`recompute_released_bytes`)."""
    if not _zero3(setup) or not spec.frozen:
        return []
    changes: list[StepChange] = []
    head = _head_input_term(spec, setup, compute_bytes)
    if head is not None:
        changes.append(AddBeside(head, TermKey.HEAD))
    released = 0 if gathers_views(setup) else recompute_released_bytes(spec, setup)
    if released:
        changes.append(ShrinkBeside(TermKey.GATHERED, TermKey.RECOMPUTED_BLOCK, released,
                                    "; the recomputed block's frozen tensors released but the one its backward uses "
                                    "(DeepSpeed recompute attribution)"))
    return changes


def recompute_released_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Under checkpointing the recompute fetches a block's frozen parameters again and attributes them to the module
    whose backward triggered it (partitioned_param_coordinator.py _fetch_sub_module_impl update_recompute_parameters);
    they are released when that module's backward ends (release_sub_module, ds_recompute_parameters), and each is
    fetched alone again by its own module's backward: the block's frozen non-persistent bytes but the largest."""
    if setup.checkpointing is Checkpointing.NONE:
        return 0
    sizes = [t.numel * (t.nbytes // t.numel if t.nbytes else 2) for t in spec.frozen
             if ".*." in t.name and not persistent(persistence_threshold(spec, setup), t)]
    return sum(sizes) - max(sizes, default=0)


def _zero3(setup: TrainingSetup) -> bool:
    from ..setup import Engine

    return setup.engine is Engine.DEEPSPEED and setup.sharding.stage >= 3


def _head_input_term(spec: ModelSpec, setup: TrainingSetup, compute_bytes: int) -> Term | None:
    """The frozen LM head's input, saved by LinearFunctionForZeroStage3 (a trainable head saves it anyway)."""
    if not spec.is_decoder:
        return None
    if any(p.name.endswith(("lm_head.weight", "lm_head.modules_to_save.weight")) for p in spec.params):
        return None
    return Term(TermKey.ZERO3_HEAD_INPUT, Category.ACTIVATIONS,
                setup.tokens_per_micro_step * spec.hidden_size * compute_bytes,
                "B x T x h: the frozen LM head's input, saved by DeepSpeed's ZeRO-3 linear",
                "DeepSpeed runtime/zero/linear.py LinearFunctionForZeroStage3 (memory_efficient_linear)")


def _partition_order(spec: ModelSpec, n: int) -> list[int]:
    """Each trainable tensor's partition elements (ceil(numel / N)) in the module's order, a repeated block's rows
    once per layer."""
    rows = [(p.numel, ".*." in p.name) for p in spec.params]
    first = next((i for i, (_, block) in enumerate(rows) if block), len(rows))
    last = max((i for i, (_, block) in enumerate(rows) if block), default=-1)
    block = [numel for numel, is_block in rows if is_block]
    ordered = [numel for numel, _ in rows[:first]] + block * max(spec.num_layers, 1 if block else 0) + \
        [numel for numel, _ in rows[last + 1:]]
    return [-(-numel // n) for numel in ordered]


def largest_sub_group(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Elements of the largest optimizer sub-group on a rank: stage3.py _create_fp16_sub_groups closes a sub-group
    once its partitions reach sub_group_size (so one may overshoot by its last tensor), the whole partition when it
    is under sub_group_size."""
    parts = _partition_order(spec, setup.shard_size)
    limit = setup.zero_knobs.sub_group_size
    if limit >= sum(parts):
        return sum(parts)
    largest = current = 0
    for numel in parts:
        current += numel
        if current >= limit:
            largest, current = max(largest, current), 0
    return max(largest, current)


def step_temp_bytes(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, str]:
    """A rank's optimizer-step temporaries under ZeRO-3 without optimizer offload: the step runs one sub-group at a
    time (stage3.py step -> _prepare_sub_group -> _prepare_fp32_grad_for_sub_group: `self.flatten(averaged_gradients)
    .to(fp32)`, a new fp32 flat gradient of the sub-group, dropped by _release_sub_group), and the optimizer steps
    that one flat fp32 tensor: torch's single-tensor AdamW (memfit's config: torch_adam, foreach false) makes two
    sub-group-sized fp32 temporaries for its denominator, the foreach one one. So 4 + 8 (4) B per element of the
    largest sub-group (memfit.zero_knobs sub_group_size; 1e9 by default, the whole partition below that). Measured on
    1 CPU rank (bench/deepspeed_knobs.py): within 0.1% but the fp32 whole-partition step (-2.7%)."""
    sub = largest_sub_group(spec, setup)
    optimizer = {Optimizer.ADAMW: 8, Optimizer.ADAMW_FOREACH: 4}.get(setup.optimizer, 0)
    return (4 + optimizer) * sub, (f"the largest optimizer sub-group ({sub:,} elements): its fp32 flat gradient"
                                   + (f" + {optimizer // 4} fp32 AdamW temporaries" if optimizer else ""))
