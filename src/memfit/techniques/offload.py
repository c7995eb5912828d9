from __future__ import annotations

from typing import Protocol

from ..errors import ConfigError
from ..hardware import Hardware
from ..model_spec import ModelSpec
from ..setup import Engine, Offload, Optimizer, Precision, Sharding, TrainingSetup
from ..units import format_bytes
from .base import Context, Proposal, Skip, Technique, register, static_over_budget, with_engine_that_can
from .costs import Cost, offload_cost, offload_step_cost


class HostStep(Protocol):
    """Another way to put the optimizer states and step on the host of one GPU than DeepSpeed's, which this rung
    weighs after DeepSpeed's candidates. Its module registers it (`one_gpu_alternative`)."""

    name: str
    """What it is, as a skipped rung names it ("offloaded already (NAME)")."""

    def applies(self, setup: TrainingSetup) -> bool:
        """Whether `setup` offloads this way already."""

    def candidate(self, setup: TrainingSetup) -> TrainingSetup:
        """`setup` offloaded this way (a ConfigError where it cannot be)."""

    def change(self, setup: TrainingSetup) -> str:
        """The plan step's one-line change."""

    def why(self, ram: str) -> str:
        """The plan step's reason; `ram` says how much CPU RAM per node."""

    def cost(self, spec: ModelSpec, setup: TrainingSetup, hardware: Hardware) -> Cost:
        """Its host copies and CPU step (the rung prints the Cost's text)."""


ONE_GPU_ALTERNATIVES: list[HostStep] = []


def one_gpu_alternative(host_step: HostStep) -> HostStep:
    """Register a HostStep with the CPU offload rung."""
    ONE_GPU_ALTERNATIVES.append(host_step)
    return host_step


def _alternative_of(setup: TrainingSetup) -> HostStep | None:
    return next((alt for alt in ONE_GPU_ALTERNATIVES if alt.applies(setup)), None)


@register
class CpuOffload(Technique):
    """ZeRO-Offload: optimizer states (and fp32 master weights) in CPU RAM, the step on the CPU; with ZeRO-3 the
    parameters may follow. On one GPU the rung is DeepSpeed's: ZeRO-2 + offload_optimizer (16-bit parameters stay,
    gradients leave bucket by bucket), then ZeRO-3 + offload_param + offload_optimizer (the parameters leave too)."""

    key = "cpu_offload"
    title = "CPU offload of optimizer states"

    def step_cost(self, spec, setup: TrainingSetup, hardware) -> Cost:
        return offload_step_cost(spec, setup, hardware)

    def search_values(self, setup: TrainingSetup, hardware) -> dict[str, list]:
        """Every offload, on every engine with more than one GPU (which engine can offload what differs)."""
        return {"offload": list(Offload), "engine": list(Engine) if hardware.world_size > 1 else [setup.engine]}

    def propose(self, ctx: Context) -> Proposal | Skip:
        try:
            return self._propose(ctx)
        except ConfigError as error:  # a combination no engine runs: the rung is passed over, saying why
            return Skip(str(error))

    def _propose(self, ctx: Context) -> Proposal | Skip:
        setup = ctx.setup
        if setup.offload is Offload.OPTIMIZER_AND_PARAMS:
            return Skip("optimizer states and parameters are offloaded already")
        if (alt := _alternative_of(setup)) is not None:
            return Skip(f"optimizer states are offloaded already ({alt.name})")
        one_gpu = ctx.hardware.world_size == 1
        if setup.offload is Offload.OPTIMIZER:
            if setup.sharding is not Sharding.ZERO3 and not one_gpu:
                return Skip("offloading parameters too needs ZeRO-3 (zero3 sharding)")
            candidates = [_on_deepspeed(setup, sharding=Sharding.ZERO3, offload=Offload.OPTIMIZER_AND_PARAMS)
                          if one_gpu else with_engine_that_can(setup, offload=Offload.OPTIMIZER_AND_PARAMS)]
        else:
            # DeepSpeed's CPU Adam steps the offloaded states: bitsandbytes / torchao optimizers become AdamW
            optimizer = setup.optimizer if setup.optimizer.library in ("torch", "transformers") else Optimizer.ADAMW
            precision = Precision.BF16_MASTER if setup.precision is Precision.BF16 else setup.precision
            if one_gpu:
                # least change first: offload alone (DeepSpeed runs it as ZeRO-1: every gradient stays on the GPU
                # until the step), then ZeRO-2 (gradients leave bucket by bucket), then ZeRO-3 (parameters too)
                candidates = [_on_deepspeed(setup, offload=Offload.OPTIMIZER, optimizer=optimizer, precision=precision),
                              _on_deepspeed(setup, sharding=Sharding.ZERO2, offload=Offload.OPTIMIZER,
                                            optimizer=optimizer, precision=precision),
                              _on_deepspeed(setup, sharding=Sharding.ZERO3, offload=Offload.OPTIMIZER_AND_PARAMS,
                                            optimizer=optimizer, precision=precision)]
            else:
                candidates = [_fsdp2_adapters(setup) or with_engine_that_can(setup, offload=Offload.OPTIMIZER,
                                                                             optimizer=optimizer, precision=precision)]
        ram = ctx.hardware.cpu_ram_bytes
        host = {id(c): ctx.size(c).cpu_bytes * ctx.hardware.gpus_per_node for c in candidates}
        within = [c for c in candidates if host[id(c)] <= ram]
        if not within:
            least = min(host.values())
            return Skip(f"host RAM is the limit: offload needs {format_bytes(least)} of CPU RAM per node, more than "
                        f"the {format_bytes(ram)} given (--cpu-ram)")
        chosen = ctx.pick(within)
        host_need = host.get(id(chosen), 0)
        if one_gpu:
            chosen, host_need = _host_step_where_deepspeed_cannot(ctx, chosen, host_need)
        if isinstance(chosen, Skip):
            return chosen
        alt = _alternative_of(chosen)
        cost = alt.cost(ctx.spec, chosen, ctx.hardware) if alt else offload_cost(ctx.spec, chosen, ctx.hardware)
        return Proposal(chosen, _change(chosen), cost, _why(setup, chosen, host_need, one_gpu))


def _fsdp2_adapters(setup: TrainingSetup) -> TrainingSetup | None:
    """LoRA / QLoRA at ZeRO-3 on FSDP2: its CPUOffloadPolicy (shards, gradients and step on the host) is the offload
    memfit sizes there; DeepSpeed's ZeRO-3 with offload is not sized for adapters, and FSDP2 never offloads the
    optimizer alone. None for any other setup (the DeepSpeed ZeRO-Offload candidate, as before)."""
    if setup.engine is not Engine.TORCH or setup.sharding is not Sharding.ZERO3 or not setup.finetune.adapters:
        return None
    try:
        return setup.replace(offload=Offload.OPTIMIZER_AND_PARAMS)
    except ConfigError:
        return None


def _host_step_where_deepspeed_cannot(ctx: Context, chosen: TrainingSetup | Skip,
                                    host_need: int) -> tuple[TrainingSetup | Skip, int]:
    """One GPU, after DeepSpeed's candidates: each registered HostStep (ONE_GPU_ALTERNATIVES) on the user's own setup,
    taken only where DeepSpeed's cannot be (--keep pins what they change: the engine, pure bf16, an 8-bit optimizer)
    or none of them fits and it does. Wherever a DeepSpeed candidate was chosen and fits, the rung's choice stands."""
    for host_step in ONE_GPU_ALTERNATIVES:
        try:
            alt = host_step.candidate(ctx.setup)
        except ConfigError:
            continue
        judge = ctx.least_activations if static_over_budget(ctx.estimate, ctx.diagnosis) else (lambda s: s)
        if ctx.pinned_changes(alt) or (not isinstance(chosen, Skip) and ctx.fits(judge(chosen))):
            return chosen, host_need
        alt_host = ctx.size(alt).cpu_bytes * ctx.hardware.gpus_per_node
        if alt_host > ctx.hardware.cpu_ram_bytes or not ctx.fits(judge(alt)):
            continue
        return alt, alt_host
    return chosen, host_need


def _on_deepspeed(setup: TrainingSetup, **changes) -> TrainingSetup:
    """One GPU: only DeepSpeed runs ZeRO with offload on a single rank (memfit.setup)."""
    return setup.replace(engine=Engine.DEEPSPEED, **changes)


def _change(setup: TrainingSetup) -> str:
    if (alt := _alternative_of(setup)) is not None:
        return alt.change(setup)
    if setup.engine is Engine.TORCH:
        return "FSDP2 fully_shard(offload_policy=CPUOffloadPolicy())"
    stage = f"deepspeed zero_optimization.stage={setup.sharding.stage}, " if setup.sharding.stage else "deepspeed "
    if setup.offload is Offload.OPTIMIZER:
        return stage + "offload_optimizer.device=cpu"
    return stage + "offload_optimizer.device=cpu, offload_param.device=cpu"


def _why(before: TrainingSetup, after: TrainingSetup, host_need: int, one_gpu: bool) -> str:
    ram = f"CPU RAM ({format_bytes(host_need)} per node)"
    if (alt := _alternative_of(after)) is not None:
        return alt.why(ram)
    if after.offload is Offload.OPTIMIZER_AND_PARAMS and after.engine is Engine.TORCH and after.finetune.adapters:
        why = (f"FSDP2's CPUOffloadPolicy keeps every shard, the frozen base's included, in {ram}: each unit's are "
               "copied up for its all-gather; the adapters' gradients and optimizer step stay on the host")
    elif after.offload is Offload.OPTIMIZER_AND_PARAMS:
        why = (f"the 16-bit parameters leave the GPU too: each module's are fetched from {ram} when it runs "
               "(ZeRO-Infinity on CPU), beside the fp32 master weights, gradients and optimizer states")
    else:
        why = (f"optimizer states are used once per step: keep them (and the fp32 master weights) in {ram} and "
               "step there")
        if one_gpu and after.sharding is Sharding.ZERO2:
            why += "; ZeRO-2 on one GPU shards nothing but sends gradients to the host bucket by bucket"
    if after.optimizer is not before.optimizer or after.precision is not before.precision:
        why += ("; DeepSpeed's CPU Adam steps fp32 states against an fp32 master copy, so it takes neither "
                "8-bit states nor pure bf16 weights")
    return why
