"""What a traced step runs: model, optimizer, micro-batch and the loop, built the same way on fake or real tensors.

Built inside a FakeTensorMode for `trace`; built outside one, the same session is a real CPU step (the tests profile
it to check the trace). The step itself is memfit's one training step (`memfit._torch.step`), so a trace, a
measurement and a user's loop describe the same thing. Techniques are applied for real: parameter dtype, autocast,
gradient checkpointing (HF's switch, or torch.utils.checkpoint around repeated blocks), attention implementation,
the optimizer; ZeRO sharding comes from `distributed.py` through `shard`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode

from .._torch import step as runner
from ..errors import ConfigError
from ..setup import Precision, TrainingSetup
from ..techniques.convert import MEMFIT_LOOP, Target, convert_model

PhaseCallback = Callable[[str], None]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
Sharder = Callable[[nn.Module], list[str]]


@dataclass
class StepSession:
    """One optimizer step, ready to run: `run(phase_callback)` does forward/backward per micro-batch, then step."""

    model: nn.Module
    optimizer: Any
    batch: Any
    run: Callable[[PhaseCallback], None]
    name: str
    notes: list[str] = field(default_factory=list)

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())


def build_hf_session(config: dict, setup: TrainingSetup, *, loss_fn: LossFn | None = None,
                     shard: Sharder | None = None) -> StepSession:
    """A transformers model from its config dict, with token batches of the setup's shape (pixel batches of the
    config's image size for image classifiers such as ViT)."""
    notes: list[str] = []
    model = build_hf_model(config, setup, notes)
    batch = make_hf_batch(config, model, setup)
    return _finish(model, batch, setup, loss_fn=loss_fn, shard=shard, notes=notes)


def build_hf_model(config: dict, setup: TrainingSetup, notes: list[str] | None = None) -> nn.Module:
    """The transformers model the step trains, built so that it also builds on fake tensors: weight initialisers
    that read values (`trunc_normal_`'s `.any()` in ViT) get a stand-in value, and MoE experts run a path whose
    shapes do not depend on the routing. `notes` gets a line for each of these that applied."""
    notes = notes if notes is not None else []
    # peft deep-copies each of `modules_to_save` (ModulesToSaveWrapper, peft utils/other.py): on fake tensors the
    # copies must stay in the active fake mode (_FakeDeepcopy), else their first op fails with 'Mixing fake modes'
    fake = active_fake_mode() is not None
    with _values_free_init(notes), _FakeDeepcopy() if fake else contextlib.nullcontext():
        model = runner.build_hf_model(config, _model_setup(setup), device="cpu")
    if _has_experts(model):
        notes.append(MOE_NOTE)
    return model


def make_hf_batch(config: dict, model: nn.Module, setup: TrainingSetup):
    return runner.make_batch(config, _model_setup(setup), device="cpu")


# ---- what fake tensors cannot do on their own ------------------------------------------------------------------

MOE_NOTE = ("MoE: token routing has no values on fake tensors, so every token is sent to exactly top_k experts "
            "(deterministic and balanced: tokens x top_k rows through the experts); the experts run transformers' "
            "grouped_mm implementation (its default), and where torch's grouped_mm kernel takes bf16 only (CPU, "
            "fp32 weights) through transformers' own grouped_mm fallback op, which keeps the same tensors")
INIT_NOTE = ("weight initialisation read {n} tensor values (.item(), e.g. trunc_normal_), which fake tensors do not "
             "have; 0 was used (values do not change memory)")


class _ValuesFreeInit(TorchDispatchMode):
    """While a model is built: a `.item()` on a fake tensor (an initialiser's rejection loop) returns 0 / False."""

    def __init__(self) -> None:
        super().__init__()
        self.assumed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            from torch._subclasses.fake_tensor import DataDependentOutputException

            try:
                return func(*args, **(kwargs or {}))
            except DataDependentOutputException:
                self.assumed += 1
                tensor = args[0]
                return False if tensor.dtype is torch.bool else (0.0 if tensor.is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _values_free_init(notes: list[str]):
    if active_fake_mode() is None:
        yield
        return
    mode = _ValuesFreeInit()
    with mode:
        yield
    if mode.assumed:
        notes.append(INIT_NOTE.format(n=mode.assumed))


def _has_experts(model: nn.Module) -> bool:
    return any(hasattr(m, "gate_up_proj") and hasattr(m, "num_experts") for m in model.modules())


@contextlib.contextmanager
def routed_experts() -> Any:
    """MoE experts on fake tensors: transformers' grouped_mm path has routing-independent shapes (tokens are
    sorted by expert, `histc` counts them), but torch's `grouped_mm` meta kernel accepts bf16 only; for other
    dtypes the experts go through transformers' registered fallback op (same inputs saved, same outputs)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def can_use(input, weight, offs):  # noqa: A002 - transformers' own argument names
        return weight.dtype is torch.bfloat16 and input.dtype is torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


is_image_classifier = runner.is_image_classifier  # ViT and kin: built and batched by memfit._torch.step


def build_module_session(factory: Callable[[], nn.Module], setup: TrainingSetup, *,
                         input_builder: Callable[[TrainingSetup], Any], loss_fn: LossFn | None = None,
                         shard: Sharder | None = None) -> StepSession:
    """A model that `factory()` builds; `input_builder(setup)` returns one micro-batch, reused for each micro-step."""
    model = _construct(factory)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    model_setup = _model_setup(setup)
    dtype = runner.param_dtype(model_setup)
    model.train()
    notes = convert_module(model, model_setup)
    batch = _cast_floats(input_builder(setup), dtype)
    return _finish(model, batch, setup, loss_fn=loss_fn or module_loss, shard=shard, notes=notes)


@dataclass
class BuiltDtypes:
    """A factory's model kept in the dtypes it was built in (peft's fp32 adapters on a bf16 base, fp32 rotary
    tables) across build_module_session's cast of its floats to the setup's dtype: trace `kept.factory(f)`, and
    call `kept.restore()` from the input builder (after the cast, before the optimizer is made). `model`: the
    (fake) model once built. Tensors are replaced as the cast does: Module.to cannot swap fake tensors."""

    model: nn.Module | None = None
    dtypes: dict = field(default_factory=dict)

    def factory(self, build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def built() -> nn.Module:
            self.model = build()
            self.dtypes = {(id(module), name, kind): tensor.dtype for module in self.model.modules()
                           for kind, tensors in (("p", module.named_parameters(recurse=False)),
                                                 ("b", module.named_buffers(recurse=False)))
                           for name, tensor in tensors}
            return self.model
        return built

    def restore(self) -> None:
        with torch.no_grad():
            for module in self.model.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    original = self.dtypes.get((id(module), name, "p"), param.dtype)
                    if param.dtype != original:
                        module._parameters[name] = nn.Parameter(param.detach().to(original), param.requires_grad)
                for name, buffer in list(module.named_buffers(recurse=False)):
                    original = self.dtypes.get((id(module), name, "b"), buffer.dtype)
                    if buffer is not None and buffer.dtype != original:
                        module._buffers[name] = buffer.to(original)


def _construct(factory: Callable[[], nn.Module]) -> nn.Module:
    """`factory()`; on fake tensors, deep copies made while building (nn.TransformerEncoder clones its layer) are
    new fake tensors of the active fake mode (torch's default deep-copies the fake mode itself along with them)."""
    with _FakeDeepcopy() if active_fake_mode() is not None else contextlib.nullcontext():
        return factory()


class _FakeDeepcopy(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.Tensor.__deepcopy__:
            return func(*args, **(kwargs or {}))
        tensor, memo = args
        if id(tensor) not in memo:
            with torch.no_grad():
                copied = tensor.clone()
            memo[id(tensor)] = (nn.Parameter(copied, tensor.requires_grad) if isinstance(tensor, nn.Parameter)
                                else copied.requires_grad_(tensor.requires_grad))
        return memo[id(tensor)]


def _finish(model: nn.Module, batch, setup: TrainingSetup, *, loss_fn, shard: Sharder | None,
            notes: list[str]) -> StepSession:
    if shard is not None:
        notes += shard(model)
    with _real_constructor(setup):
        optimizer = _make_optimizer(model, _model_setup(setup))
    notes += getattr(optimizer, "memfit_notes", ())

    micro_batches = [batch] * setup.grad_accum_steps  # one batch object reused: one alive at a time, as from a loader

    loop_setup = _model_setup(setup) if setup.precision.is_autocast else setup  # FSDP2 casts, not autocast

    def run(phase_callback: PhaseCallback) -> None:
        runner.training_step(model, optimizer, micro_batches, loop_setup, loss_fn=loss_fn,
                             phase_callback=phase_callback)

    name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    return StepSession(model=model, optimizer=optimizer, batch=batch, run=run, name=name, notes=notes)


def _make_optimizer(model: nn.Module, setup: TrainingSetup):
    """The setup's optimizer; on FSDP2 shards it cannot step (8-bit AdamW, Adafactor), over the local shards."""
    from . import distributed

    if not distributed.needs_local_step(setup):
        return runner.make_optimizer(model, setup)
    notes: list[str] = []
    build = functools.partial(runner._base_optimizer, setup=setup, lr=None, notes=notes)
    return distributed.ShardLocalOptimizer([p for p in model.parameters() if p.requires_grad], build)


def _model_setup(setup: TrainingSetup) -> TrainingSetup:
    """bf16-master and amp-* under ZeRO are FSDP2 mixed precision, as memfit's torch engine shards them
    (memfit.setup.fsdp2_mixed_precision): fp32 (master) shards, bf16 / fp16 all-gathers, no autocast, a plain
    optimizer. A trace runs FSDP2 for every ZeRO stage."""
    if setup.sharding.stage > 0 and (setup.precision.master_weights or setup.precision.is_autocast):
        return setup.replace(precision=Precision.FP32)
    return setup


def _real_constructor(setup: TrainingSetup):
    """bitsandbytes' constructor reads tensor values (.tolist()), which fake tensors lack (FACTS.md)."""
    if setup.optimizer.library != "bitsandbytes":
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def module_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call the model on the batch (dict -> kwargs, tuple -> args); its `.loss`, else the mean of its output."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ConfigError(f"cannot make a loss from a {type(output).__name__}: pass loss_fn=(model, batch) -> loss")
    return output.float().mean()


def convert_module(model: nn.Module, setup: TrainingSetup) -> list[str]:
    """A plain module as the setup trains it in memfit's loop: the techniques' conversions (memfit.techniques.convert,
    apply_'s path), each one that applies said in a note."""

    changes = convert_model(model, setup, Target(is_hf=False, loop=MEMFIT_LOOP, compile_backend="partitioned"),
                            _MODULE_ITEMS)
    return [f"{change.name}: {change.detail}" for change in changes
            if change.name == "checkpointing" and setup.checkpointing.is_on
            or change.name == "attention" and setup.attention is not TrainingSetup().attention]


_MODULE_ITEMS = ("precision", "attention", "checkpointing")
"""What a traced plain module gets converted: the other conversions are sized for transformers models only, or are
the loop's."""

cast_floating = runner.cast_floating  # memfit._torch.step's, the precision conversion's


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if dtype is torch.float32:
        return batch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


# ---- checkpointing of plain modules ----------------------------------------------------------------------------------

def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: memfit._torch.blocks.find_blocks, the one finder (apply_, the engines, FSDP2 units)."""
    from .._torch.blocks import find_blocks

    return find_blocks(model)


def checkpoint_repeated_blocks(model: nn.Module) -> int:
    """Checkpoint each repeated block: memfit._torch.blocks.checkpoint_blocks, the wrapper apply_ uses."""
    from .._torch.blocks import checkpoint_blocks

    return checkpoint_blocks(model)
