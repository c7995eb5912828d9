"""DeepSpeed JSON for a TrainingSetup. Keys and their meaning follow deepspeed/runtime/config.py,
runtime/precision_config.py and runtime/zero/offload_config.py (DeepSpeed 0.19)."""

from __future__ import annotations

from ..errors import ConfigError
from ..estimate.comm.runtime import deepspeed_stage as zero_stage  # the estimator's, one definition
from ..setup import Offload, Optimizer, Precision, Sharding, TrainingSetup
from .emitted import EmittedConfig

AUTO = "auto"  # filled in by the HF Trainer / accelerate from their own arguments


def deepspeed_config(setup: TrainingSetup, *, hf_auto: bool = False) -> dict:
    """DeepSpeed config for `deepspeed.initialize(config=...)`. With `hf_auto`, the values the HF Trainer and
    accelerate fill from their own arguments (total batch, clipping, learning rate...) are "auto"."""
    return _build(setup, hf_auto)[0]


def deepspeed_file(setup: TrainingSetup, *, hf_auto: bool = True, filename: str = "deepspeed.json") -> EmittedConfig:
    content, comments, notes = _build(setup, hf_auto)
    reader = ("the HF Trainer (`TrainingArguments.deepspeed`) and accelerate (`deepspeed_config_file`)" if hf_auto
              else "`deepspeed.initialize(config=...)`")
    return EmittedConfig(filename, content, comments, tuple(notes), summary=f"DeepSpeed config read by {reader}.")


def _build(setup: TrainingSetup, hf_auto: bool) -> tuple[dict, dict[str, str], list[str]]:
    _check_expressible(setup)
    content: dict = {}
    comments: dict[str, str] = {}
    notes: list[str] = []
    for part in (_batch_part, _zero_part, _precision_part, _optimizer_part):
        part_content, part_comments, part_notes = part(setup, hf_auto)
        content.update(part_content)
        comments.update(part_comments)
        notes += part_notes
    return content, comments, notes


def _check_expressible(setup: TrainingSetup) -> None:
    if setup.precision is not Precision.BF16:
        return
    if zero_stage(setup) == 0:
        raise ConfigError("DeepSpeed keeps fp32 master weights without ZeRO, so pure bf16 without sharding or "
                          "offload is trained without DeepSpeed: use training_args.json alone (model loaded in bf16)")
    if setup.offload is not Offload.NONE and not deepspeed_owns_optimizer(setup):
        raise ConfigError(f"DeepSpeed offloads bf16 optimizer states only with its CPU Adam, not {setup.optimizer}: "
                          "choose an AdamW optimizer or precision bf16-master")


def _batch_part(setup: TrainingSetup, hf_auto: bool):
    total = setup.micro_batch_size * setup.grad_accum_steps * setup.num_gpus
    content = {
        "train_micro_batch_size_per_gpu": setup.micro_batch_size,
        "gradient_accumulation_steps": setup.grad_accum_steps,
        "train_batch_size": AUTO if hf_auto else total,
        "gradient_clipping": AUTO if hf_auto else 1.0,
    }
    comments = {
        "train_micro_batch_size_per_gpu": "sequences per GPU per forward/backward: activations scale with it; "
                                          "the value memfit's estimate used",
        "gradient_accumulation_steps": "micro-steps per optimizer step; gradients stay allocated between them",
        "train_batch_size": (f"micro x accum x ranks = {total} with {setup.num_gpus} rank(s); 'auto' lets the "
                             "launcher compute it from the real world size" if hf_auto else
                             f"micro x accum x ranks = {setup.micro_batch_size} x {setup.grad_accum_steps} x "
                             f"{setup.num_gpus}; DeepSpeed asserts this product"),
        "gradient_clipping": ("filled from TrainingArguments.max_grad_norm (1.0 by default)" if hf_auto else
                              "clip the global grad norm at 1.0 (the HF default); costs no persistent memory"),
    }
    return content, comments, []


def _zero_part(setup: TrainingSetup, hf_auto: bool):
    stage = zero_stage(setup)
    zero: dict = {"stage": stage}
    comments = {"zero_optimization.stage": _stage_reason(setup, stage)}
    if setup.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        comments["zero_optimization.offload_optimizer"] = (
            "ZeRO-Offload: master weights, gradient partitions and optimizer states live in CPU RAM and the "
            "optimizer steps there; pinned host memory makes the per-step copies asynchronous")
    if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        comments["zero_optimization.offload_param"] = (
            "ZeRO-Infinity: the bf16/fp32 parameter shards also live in CPU RAM and are fetched layer by layer")
    if hf_auto:
        # DeepSpeed's own default reduce bucket is 5e8 elements, allocated whole on every rank (1-2 GB whatever the
        # model). "auto" lets the HF Trainer / accelerate size the buckets from the model: hidden^2 (the value
        # memfit's estimate assumes), 0.9 x hidden^2 prefetch, 10 x hidden persistence threshold.
        zero["reduce_bucket_size"] = "auto"
        comments["zero_optimization.reduce_bucket_size"] = (
            "auto = hidden_size^2 elements (HF); DeepSpeed's default 5e8 would hold 1-2 GB per rank")
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = "auto"
            zero["stage3_param_persistence_threshold"] = "auto"
            comments["zero_optimization.stage3_prefetch_bucket_size"] = "auto = 0.9 x hidden_size^2 (HF)"
            comments["zero_optimization.stage3_param_persistence_threshold"] = (
                "auto = 10 x hidden_size (HF): smaller tensors (norms, biases) stay whole on every rank")
    _user_buckets(setup, stage, zero, comments)
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        comments["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = (
            "save_model() writes one consolidated model instead of per-rank shards (a full gather at save time "
            "only, not during the step)")
    notes = []
    if setup.offload is not Offload.NONE:
        notes.append("CPU offload needs host RAM for the offloaded master weights, gradients and optimizer states "
                     "of every rank on the node; pinned memory cannot be swapped out.")
    return {"zero_optimization": zero}, comments, notes


def _stage_reason(setup: TrainingSetup, stage: int) -> str:
    if setup.num_gpus == 1 and stage >= 2 and setup.offload is not Offload.NONE:
        return {
            2: ("ZeRO-2 on one GPU shards nothing; with offload_optimizer it streams each gradient bucket to the "
                "host (fp32 master, gradients and Adam states in CPU RAM) instead of keeping every gradient"),
            3: ("ZeRO-3 on one GPU shards nothing; with offload_param the parameters live in CPU RAM and each "
                "module's are fetched to the GPU when it runs (ZeRO-Infinity on CPU)"),
        }[stage]
    if setup.num_gpus == 1 and stage >= 1 and setup.offload is Offload.NONE:
        return (f"ZeRO-{stage} on one GPU (world size 1) shards nothing: every partition is whole, and DeepSpeed "
                "still keeps its fp32 partition copy and reduce buckets (memfit sized them)")
    return {
        0: "no ZeRO: every rank holds whole parameters, gradients and optimizer states (data parallel only)",
        1: ("ZeRO-1: optimizer states sharded over the ranks" if setup.sharding is Sharding.ZERO1 else
            "ZeRO-1 only because DeepSpeed offloads the optimizer under ZeRO; gradients stay whole as planned"),
        2: "ZeRO-2: optimizer states and gradients sharded over the ranks",
        3: "ZeRO-3: parameters, gradients and optimizer states sharded; blocks gathered around their use",
    }[stage]


def _precision_part(setup: TrainingSetup, hf_auto: bool):
    precision = setup.precision
    bf16: dict = {"enabled": precision in (Precision.BF16, Precision.BF16_MASTER, Precision.AMP_BF16)}
    fp16: dict = {"enabled": precision is Precision.AMP_FP16}
    comments = {"bf16.enabled": _bf16_reason(precision), "fp16.enabled": _fp16_reason(precision)}
    if precision is Precision.BF16:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        comments["bf16.bf16_master_weights_and_grads"] = (
            "pure bf16: ZeRO's master copy and gradients stay bf16 instead of fp32 (2 + 2 bytes per parameter)")
        comments["bf16.bf16_optimizer_states"] = "pure bf16: optimizer moments stored in bf16 as planned"
    if precision is Precision.AMP_FP16:
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
        comments["fp16.loss_scale"] = "0 = dynamic loss scaling (fp16 gradients underflow without it)"
        comments["fp16.initial_scale_power"] = "start at 2**16 and halve on overflow, as torch's GradScaler does"
        comments["fp16.loss_scale_window"] = "grow the scale after 1000 steps without overflow"
        comments["fp16.hysteresis"] = "tolerate 2 overflows before lowering the scale"
        comments["fp16.min_loss_scale"] = "never scale below 1"
    return {"bf16": bf16, "fp16": fp16}, comments, []


def _bf16_reason(precision: Precision) -> str:
    if precision is Precision.AMP_BF16:
        return ("bf16 compute. DeepSpeed has no autocast-over-fp32-weights mode in ZeRO; its bf16 keeps bf16 "
                "weights/grads plus an fp32 master copy: 2 + 2 + 4 bytes per parameter, the same 16 bytes with "
                "AdamW as fp32 weights + fp32 grads under torch.autocast")
    if precision is Precision.BF16_MASTER:
        return "bf16 weights and gradients; DeepSpeed keeps the fp32 master copy inside the optimizer (4 B/param)"
    if precision is Precision.BF16:
        return "bf16 weights and compute"
    return "off: the plan does not compute in bf16"


def _fp16_reason(precision: Precision) -> str:
    if precision is Precision.AMP_FP16:
        return "fp16 compute with fp32 master weights in the optimizer and dynamic loss scaling"
    return "off"


def deepspeed_owns_optimizer(setup: TrainingSetup) -> bool:
    """DeepSpeed builds the optimizer itself for the torch AdamW variants (and must, for CPU Adam under offload)."""
    return setup.optimizer.torch_adam


_TORCH_ADAM_PARAMS = {
    Optimizer.ADAMW: ({"torch_adam": True, "foreach": False},
                      "torch.optim.AdamW(foreach=False): one parameter at a time, no parameter-sized temporaries"),
    Optimizer.ADAMW_FOREACH: ({"torch_adam": True, "foreach": True},
                              "torch.optim.AdamW(foreach=True), torch's CUDA default: multi-tensor kernels with "
                              "temporaries the size of a parameter group"),
    Optimizer.ADAMW_FUSED: ({"torch_adam": True, "fused": True},
                            "torch.optim.AdamW(fused=True): one fused kernel; no DeepSpeed op to compile"),
}


def _optimizer_part(setup: TrainingSetup, hf_auto: bool):
    offloaded = setup.offload is not Offload.NONE
    if not deepspeed_owns_optimizer(setup):
        return _client_optimizer_part(setup, offloaded)
    if offloaded:
        params: dict = {}
        reason = ("offloaded states are stepped by DeepSpeedCPUAdam (adamw_mode); foreach/fused have no meaning "
                  "there. Its C++ op is JIT-compiled on first use unless DeepSpeed was built with DS_BUILD_CPU_ADAM=1")
    else:
        params, reason = dict(_TORCH_ADAM_PARAMS[setup.optimizer][0]), _TORCH_ADAM_PARAMS[setup.optimizer][1]
    notes = []
    if not offloaded and zero_stage(setup) > 0 and setup.optimizer is not Optimizer.ADAMW_FUSED:
        notes.append("ZeRO steps one flat partition per parameter group, so AdamW's temporaries are the size of "
                     "that partition whether foreach is on or off.")
    if hf_auto:
        params.update(lr=AUTO, betas=AUTO, eps=AUTO, weight_decay=AUTO)
    else:
        notes.append("Add your learning rate as optimizer.params.lr (DeepSpeed's AdamW default is 1e-3).")
    comments = {"optimizer": f"DeepSpeed builds the optimizer: {reason}"}
    if hf_auto:
        comments["optimizer.params"] = ("'auto' values come from TrainingArguments (learning_rate, adam_beta1/2, "
                                        "adam_epsilon, weight_decay); with accelerate pass accelerate.utils.DummyOptim")
    return {"optimizer": {"type": "AdamW", "params": params}}, comments, notes


def _client_optimizer_part(setup: TrainingSetup, offloaded: bool):
    notes = [f"DeepSpeed has no built-in {setup.optimizer}: the HF Trainer builds it from `optim`; with "
             "deepspeed.initialize pass it as optimizer=..."]
    if setup.optimizer is Optimizer.ADAFACTOR and zero_stage(setup) > 0:
        notes.append("ZeRO hands the optimizer one flat 1-D partition per parameter group, so Adafactor cannot "
                     "factor its second moment there: it keeps a full fp32 one (4 bytes per parameter).")
    content: dict = {}
    comments: dict[str, str] = {}
    if zero_stage(setup) > 0:
        content["zero_allow_untested_optimizer"] = True
        comments["zero_allow_untested_optimizer"] = (
            f"ZeRO accepts only optimizers on its tested list without this; {setup.optimizer} is not on it "
            "(the HF Trainer and accelerate set it themselves)")
    if offloaded:
        content["zero_force_ds_cpu_optimizer"] = False
        comments["zero_force_ds_cpu_optimizer"] = (
            f"false lets {setup.optimizer} (not DeepSpeed's CPU Adam) step the offloaded states on the CPU; slower "
            "than CPU Adam, same memory")
    return content, comments, notes


def _user_buckets(setup: TrainingSetup, stage: int, zero: dict, comments: dict[str, str]) -> None:
    """The ZeRO knobs the user's config set (memfit.zero_knobs), written back as numbers / switches: the figure was
    sized with them, so the emitted file keeps them instead of "auto" or DeepSpeed's defaults."""
    knobs = setup.zero_knobs
    changed = knobs.changed()
    values = (("reduce_bucket_size", "reduce_bucket_size", 0),
              ("stage3_param_persistence_threshold", "param_persistence_threshold", 3),
              ("stage3_max_reuse_distance", "max_reuse_distance", 3),
              ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 3),
              ("stage3_max_live_parameters", "max_live_parameters", 3),
              ("allgather_bucket_size", "allgather_bucket_size", 1),
              ("sub_group_size", "sub_group_size", 3),
              ("overlap_comm", "overlap_comm", 1),
              ("contiguous_gradients", "contiguous_gradients", 1),
              ("round_robin_gradients", "round_robin_gradients", 1),
              ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", 3))
    for key, attr, min_stage in values:
        value = changed.get(attr)
        if value is None or stage < min_stage:
            continue
        zero[key] = value
        said = f"{value}" if isinstance(value, bool) else f"{value:,} elements"
        comments[f"zero_optimization.{key}"] = f"{said}, as your config set it (memfit sized this value)"
    if not knobs.offload_pin_memory:
        for block in ("offload_optimizer", "offload_param"):
            if block in zero:
                zero[block]["pin_memory"] = False
