"""torchtitan's [parallelism] and [training] TOML keys for a setup's tensor / pipeline / context parallelism and FSDP
(torchtitan/config/job_config.py, Parallelism and Training). Pure; the CLI prints them in the launch notes.

Pipeline: torchtitan cuts the layers with generate_llm_fqn_per_model_part, counting the embedding and the output
layer as pipeline_parallel_first_stage_less_layers / last_stage_less_layers (default 1 each) extra layers; memfit
sizes an even split of the decoder layers, so both are emitted as 0 and the layers per stage are given. The
micro-batches per step are local_batch_size / pipeline_parallel_microbatch_size.

float8 (memfit.estimate.float8): `[model] converters = ["quantize.linear.float8"]` and its `[quantize.linear.float8]`
table (torchtitan components/quantization/float8.py; releases before the quantize tables spelled them
`converters = ["float8"]` and `[float8]`), the LM head left out by filter_fqns = ["output"]."""

from __future__ import annotations

from ..setup import PipelineSchedule, Sharding, TrainingSetup
from ..techniques import float8

SCHEDULE_NAMES = {PipelineSchedule.GPIPE: "GPipe", PipelineSchedule.ONE_F_ONE_B: "1F1B",
                  PipelineSchedule.INTERLEAVED_1F1B: "Interleaved1F1B"}
"""torch.distributed.pipelining.schedules.get_schedule_class names, which torchtitan takes."""


def torchtitan_parallelism(setup: TrainingSetup, num_layers: int | None = None) -> dict[str, dict]:
    """{'parallelism': {...}, 'training': {...}} for the setup; `num_layers` (the model's) sets the layers per
    stage under pipeline parallelism."""
    shard = setup.shard_size if setup.sharding.stage >= 2 else 1  # HSDP: the shard group, replicated across
    parallelism: dict = {"data_parallel_replicate_degree": setup.dp_size // shard,
                         "data_parallel_shard_degree": shard, "tensor_parallel_degree": setup.tp}
    if setup.tp > 1:
        parallelism["disable_loss_parallel"] = False
    if setup.sharding.stage >= 2:
        parallelism["fsdp_reshard_after_forward"] = "always" if setup.sharding is Sharding.ZERO3 else "never"
    training = {"local_batch_size": setup.micro_batch_size * setup.grad_accum_steps, "seq_len": setup.seq_len}
    if setup.cp > 1:
        parallelism.update(context_parallel_degree=setup.cp, context_parallel_rotate_method=setup.cp_rotate.value)
    if setup.pp > 1:
        parallelism.update(pipeline_parallel_degree=setup.pp,
                           pipeline_parallel_schedule=SCHEDULE_NAMES[setup.pp_schedule],
                           pipeline_parallel_microbatch_size=setup.micro_batch_size,
                           pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0)
        num_stages = setup.pp * setup.pp_virtual_stages
        if num_layers is not None and num_layers % num_stages == 0:
            parallelism["pipeline_parallel_layers_per_stage"] = num_layers // num_stages
    return {"parallelism": parallelism, "training": training, **float8.torchtitan_fragment(setup)}


def torchtitan_toml(setup: TrainingSetup, num_layers: int | None = None) -> str:
    """The same keys as TOML text."""
    lines = []
    for table, keys in torchtitan_parallelism(setup, num_layers).items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml(value)}" for key, value in keys.items()]
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)
