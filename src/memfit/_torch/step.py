"""One training step, written once: `measure` runs it on real tensors and the tracer on fake ones, so a prediction and
a measurement always describe the same step; the sharded engines (`_torch.engine.Prepared.train_step`, through
`EngineHooks`) and the OOM-safe loop (`fit.FitLoop`, through `forward_backward` / `optimizer_step`) run it too, so
amp-fp16's GradScaler, accumulation and clipping live here only. The signatures here are a contract other modules
call.

What HF does with attention masks (transformers 5.24, checked on CPU for llama, mistral, qwen2, gpt2 and bert):
- SDPA, no padding mask, no cache: `create_causal_mask` returns None and SDPA runs with `is_causal=True`; no T x T
  tensor exists at all (bert's bidirectional mask is skipped the same way, under eager attention too).
- Eager (decoders): one float B x 1 x T x T additive mask per forward, built once in the model's forward and shared
  by every layer. Eager attention genuinely needs it; it dies when the forward returns (with checkpointing it is
  among the saved layer inputs and lives until the backward ends).
- Under FakeTensorMode, `masking_utils.find_packed_sequence_indices` cannot read the position ids, so it reports
  "packed" and a full bool B x 1 x T x T mask is built and handed to SDPA. `training_step` therefore runs the forward
  inside `unpacked_sequences()` when the batch carries no position_ids: it tells transformers what the real step
  finds out by itself, so the fake step matches the real one and the real one is unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, MissingDependencyError
from ..setup import LOSS_CHUNKS, Loss, Optimizer, Precision, TrainingSetup
from ..techniques.convert import MEMFIT_LOOP, Target, convert_model, loop_contexts

PhaseCallback = Callable[[str], None]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

# Encoder-only families: built as masked LMs (logits at every position, bidirectional attention).
MASKED_LM_TYPES = frozenset({"bert", "roberta", "distilbert", "electra", "xlm-roberta", "albert", "modernbert"})

DEFAULT_LR = {Optimizer.SGD: 1e-2}
"""Learning rates when the caller gives none (1e-3 otherwise; Adafactor uses its own relative step)."""


def param_dtype(setup: TrainingSetup) -> torch.dtype:
    return torch.bfloat16 if setup.precision.param_dtype == "bf16" else torch.float32


def cast_floating(model: torch.nn.Module, dtype: torch.dtype, *, skip: frozenset[str] = frozenset(),
                  buffers: bool = True) -> None:
    """`model.to(dtype)` for its floating parameters (but those named in `skip`) and, with `buffers`, buffers. On
    fake tensors (a trace) by replacing the tensors: `Module.to` swaps tensors in place, which FakeTensors refuse
    (they carry weakrefs). Tied parameters stay tied."""
    from torch._subclasses.fake_tensor import is_fake

    fake = any(is_fake(t) for t in (*model.parameters(), *model.buffers()))
    if not fake and not skip and buffers:
        model.to(dtype=dtype)
        return
    converted: dict[int, torch.Tensor] = {}

    def convert(tensor: torch.Tensor, make) -> torch.Tensor:
        if id(tensor) not in converted:
            converted[id(tensor)] = make(tensor.detach().to(dtype)) if tensor.dtype != dtype else tensor
        return converted[id(tensor)]

    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.is_floating_point() or (f"{prefix}.{name}" if prefix else name) in skip:
                    continue
                if fake:
                    module._parameters[name] = convert(param, lambda t, p=param: torch.nn.Parameter(t, p.requires_grad))
                else:
                    param.data = param.data.to(dtype)
            for name, buffer in module.named_buffers(recurse=False) if buffers else ():
                if buffer.is_floating_point():
                    module._buffers[name] = convert(buffer, lambda t: t)


def autocast_factory(setup: TrainingSetup, device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    """`with factory(): ...` runs torch.autocast for amp-* precisions and does nothing otherwise."""
    if not setup.precision.is_autocast:
        return contextlib.nullcontext
    dtype = torch.bfloat16 if setup.precision is Precision.AMP_BF16 else torch.float16
    return functools.partial(torch.autocast, device_type=device_type, dtype=dtype)


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- the model


def hf_config_from_dict(config: Mapping):
    transformers = _import("transformers")
    values = copy.deepcopy(dict(config))  # transformers edits nested values (rope_scaling) in place
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ConfigError("the config dict has no 'model_type': add e.g. \"model_type\": \"llama\"")
    values.pop("architectures", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ConfigError(f"transformers cannot build a '{model_type}' config: {error}") from None


def build_hf_model(config: dict, setup: TrainingSetup, *, device="cpu", compile_backend="inductor"):
    """A transformers model with random weights from an HF config dict, set up the way `setup` trains it.

    Causal LM (masked LM for encoder-only types such as bert; a sequence classifier when the config's
    architectures name one, memfit.sources.task), attention implementation from `setup.attention`,
    `use_cache=False` (a cache keeps every layer's K/V alive), pure bf16 parameters for bf16 / bf16-master (the fp32
    master copy belongs to the optimizer; an adapted model's base in its planned storage dtype), then every
    technique's conversion (memfit.techniques.convert, apply_'s path); blocks compiled with `compile_backend` when
    the setup compiles ("partitioned": AOTAutograd's min-cut partition run without codegen,
    memfit._torch.compiled); train mode.
    """
    transformers = _import("transformers")
    if setup.image_size and is_image_classifier(config):  # the model at that resolution (its position table too)
        config = {**config, "image_size": setup.image_size}
    hf_config = hf_config_from_dict(config)
    hf_config.use_cache = False
    auto = (transformers.AutoModelForSequenceClassification if sequence_labels(config)
            else transformers.AutoModelForMaskedLM if hf_config.model_type in MASKED_LM_TYPES
            else transformers.AutoModelForImageClassification if is_image_classifier(config)
            else transformers.AutoModelForSeq2SeqLM if getattr(hf_config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM)
    dtype = param_dtype(setup)
    if setup.finetune.adapters:
        from .lora import base_dtype

        dtype = base_dtype(setup)
    try:
        model = auto.from_config(hf_config, attn_implementation=str(setup.attention), dtype=dtype)
    except ValueError as error:  # e.g. "Gemma2ForCausalLM does not support an attention implementation through ..."
        if "attention" not in str(error).lower():
            raise
        raise ConfigError(f"transformers cannot build {hf_config.model_type} with attention "
                          f"'{setup.attention}': use --attention eager") from None
    if auto is transformers.AutoModelForSequenceClassification:  # as save_pretrained writes it: batches read it
        model.config.architectures = [type(model).__name__]
    if model_device(model) != torch.device(device):  # no-op `.to` skipped: on fake tensors it swaps every tensor
        model.to(device)
    # Built in the setup's dtype and attention already (one allocation); the rest is the techniques' conversions,
    # apply_'s path (memfit.techniques.convert.ORDER).

    convert_model(model, setup, Target(is_hf=True, loop=MEMFIT_LOOP, compile_backend=compile_backend))
    model.train()
    return model


def enable_hf_checkpointing(model) -> None:
    """HF's switch, non-reentrant. transformers 5.x renamed it (`gradient_checkpointing_enable` is deprecated)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_hf_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def hf_checkpointing_is_on(model: torch.nn.Module) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def is_hf_model(model: object) -> bool:
    if "transformers" not in sys.modules:
        return False
    return isinstance(model, sys.modules["transformers"].PreTrainedModel)


# ------------------------------------------------------------------------------------------------ the optimizer


def make_optimizer(model: torch.nn.Module, setup: TrainingSetup, *, lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer `setup.optimizer` names, over the trainable parameters.

    For bf16-master the optimizer works on an fp32 copy of the bf16 parameters (see master.py). Where the requested
    variant cannot run (fused AdamW on a device or dtype without a fused kernel), it falls back and says so in the
    optimizer's `memfit_notes` attribute, which `measure` copies into its result.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (requires_grad=False everywhere): nothing to train")
    notes: list[str] = []
    build = functools.partial(_base_optimizer, setup=setup, lr=lr, notes=notes)
    if setup.optimizer_in_backward:
        optimizer = InBackwardOptimizer(params, build)
    elif setup.precision.master_weights:
        from .master import MasterWeightsOptimizer

        optimizer = MasterWeightsOptimizer(params, build)
    elif setup.optimizer is Optimizer.MUON:
        from .muon import MuonWithAdamW

        optimizer = MuonWithAdamW(model, DEFAULT_LR.get(setup.optimizer, 1e-3) if lr is None else lr)
    else:
        optimizer = build(params)
    optimizer.memfit_notes = tuple(notes)
    return optimizer


def _base_optimizer(params, *, setup: TrainingSetup, lr: float | None, notes: list[str]) -> torch.optim.Optimizer:
    lr = DEFAULT_LR.get(setup.optimizer, 1e-3) if lr is None else lr
    kind = setup.optimizer.kind
    if kind.library in ("bitsandbytes", "torchao", "transformers"):
        _import(kind.library, extra={"bitsandbytes": "engines", "torchao": "lowbit", "transformers": "hf"}[kind.library])
    if kind.paged and not _on_cuda(params):
        # bitsandbytes 0.50 get_state_buffer: paged buffers need CUDA; on CPU it warns and uses zeros_like
        notes.append(f"{kind.name}: bitsandbytes pages states only on CUDA; measured its unpaged equivalent "
                     "(same state tensors, in ordinary memory)")
    if dict(kind.kwargs).get("fused"):
        try:
            return kind.build(params, lr)
        except (RuntimeError, ValueError) as error:
            notes.append(f"fused AdamW is not available here ({error}); measured the single-tensor AdamW instead")
            return torch.optim.AdamW(params, lr=lr, foreach=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        return kind.build(params, lr)


def _on_cuda(params) -> bool:
    return any(p.device.type == "cuda" for p in params)


class InBackwardOptimizer(torch.optim.Optimizer):
    """The optimizer step inside backward, as torchtune's optimizer_in_bwd does it: one optimizer per parameter,
    stepped by that parameter's `register_post_accumulate_grad_hook` as soon as its gradient is complete, after which
    the gradient is released (`zero_grad(set_to_none=True)`). So at most one parameter's gradient exists at a time
    and `step()` has nothing left to do. `param_groups` are the inner optimizers' groups and `state` their states
    (filled as each first steps), so measure and trace find them; `remove()` takes the hooks off."""

    def __init__(self, params, make_one: Callable[[list], torch.optim.Optimizer]) -> None:
        params = list(params)
        self.inner = {param: make_one([param]) for param in params}
        first = next(iter(self.inner.values()))
        super().__init__(params, dict(first.defaults))
        self.param_groups = [group for inner in self.inner.values() for group in inner.param_groups]
        self.state = {}
        self._handles = [param.register_post_accumulate_grad_hook(self._step_one) for param in params]

    def _step_one(self, param: torch.nn.Parameter) -> None:
        inner = self.inner[param]
        inner.step()
        inner.zero_grad(set_to_none=True)
        if param in inner.state:
            self.state[param] = inner.state[param]

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: every parameter stepped in backward."""
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.inner:
            param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# --------------------------------------------------------------------------------------------------- the batch


def make_batch(config_or_spec, setup: TrainingSetup, *, device="cpu", generator: torch.Generator | None = None) -> dict:
    """Random token ids of shape (micro_batch_size, seq_len) and their labels; no attention_mask (no padding).

    Causal LMs: labels are a copy of the ids (HF shifts them inside the loss). Masked LMs (bert): every position is
    labelled; a real MLM collator labels ~15%, but the logits and the loss are computed at every position either way,
    so the memory is the same. Sequence classifiers: one label per sequence.
    """
    if is_image_classifier(config_or_spec):
        return pixel_batch(config_or_spec, setup, device=device, generator=generator)
    vocab_size = _field(config_or_spec, "vocab_size")
    if not vocab_size:
        raise ConfigError("make_batch needs a vocab_size (an HF config dict, a transformers config or a ModelSpec)")
    shape = (setup.micro_batch_size, setup.seq_len)
    on_device = generator is None or generator.device == torch.device(device)
    input_ids = torch.randint(0, int(vocab_size), shape, generator=generator,
                              device=device if on_device else generator.device)
    input_ids = input_ids.to(device)
    labels = sequence_labels(config_or_spec)
    if labels:  # one class per sequence (transformers' classifiers take B labels)
        targets = torch.randint(0, labels, (setup.micro_batch_size,), generator=generator,
                                device=device if on_device else generator.device)
        return {"input_ids": input_ids, "labels": targets.to(device)}
    if is_encoder_decoder(config_or_spec):
        if not setup.target_len:
            raise ConfigError("an encoder-decoder batch needs the decoder length: set target_len (--target-len)")
        # labels only: T5 / BART build decoder_input_ids by shifting them right (transformers shift_right /
        # shift_tokens_right), so the decoder runs over target_len positions
        labels = torch.randint(0, int(vocab_size), (setup.micro_batch_size, setup.target_len), generator=generator,
                               device=device if on_device else generator.device)
        return {"input_ids": input_ids, "labels": labels.to(device)}
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def pixel_batch(config_or_spec, setup: TrainingSetup, *, device="cpu", generator: torch.Generator | None = None) -> dict:
    """Images of setup.image_size (else the config's), one class label each: micro_batch_size images; seq_len does
    not apply (the tokens per image are fixed by the image and patch sizes)."""
    size = setup.image_size or _field(config_or_spec, "image_size")
    size = size if isinstance(size, int) else size[0]
    channels = _field(config_or_spec, "num_channels") or 3
    labels = _field(config_or_spec, "num_labels") or len(_field(config_or_spec, "id2label") or ()) or 2
    where = generator.device if generator is not None else device
    pixels = torch.randn(setup.micro_batch_size, channels, size, size, generator=generator, device=where,
                         dtype=param_dtype(setup))
    targets = torch.randint(0, int(labels), (setup.micro_batch_size,), generator=generator, device=where)
    return {"pixel_values": pixels.to(device), "labels": targets.to(device)}


def is_image_classifier(config_or_spec) -> bool:
    """An HF config whose model builds as an image classifier (ViT, DINOv2) and not as a causal or masked LM."""
    model_type = _field(config_or_spec, "model_type")
    try:
        from transformers.models.auto import modeling_auto as auto
    except ImportError:
        return False
    return (model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
            and model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def sequence_labels(config_or_spec) -> int:
    """num_labels of a sequence classifier (a config whose architectures name a ...ForSequenceClassification, a
    ModelSpec with such a head, a built classifier), else 0."""
    if isinstance(config_or_spec, torch.nn.Module):
        name = type(config_or_spec).__name__
        return int(config_or_spec.config.num_labels) if name.endswith("ForSequenceClassification") else 0
    if hasattr(config_or_spec, "num_labels") and hasattr(config_or_spec, "graph"):  # a ModelSpec
        return int(config_or_spec.num_labels)
    archs = _field(config_or_spec, "architectures") or ()
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return 0
    return int(_field(config_or_spec, "num_labels") or len(_field(config_or_spec, "id2label") or ()) or 2)


def is_encoder_decoder(config_or_spec) -> bool:
    """An encoder-decoder LM (T5, BART): its config says so, or transformers maps its model_type to a seq2seq LM."""
    flag = _field(config_or_spec, "is_encoder_decoder")
    if flag is not None:
        return bool(flag)
    model_type = _field(config_or_spec, "model_type")
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as seq2seq
    except ImportError:
        return False
    return model_type in seq2seq


def _field(source, name: str):
    if isinstance(source, Mapping):
        return source.get(name)
    config = getattr(source, "config", None)  # a model passed in place of its config
    if config is not None and not hasattr(source, name):
        source = config
    return getattr(source, name, None)


# ---------------------------------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class EngineHooks:
    """What an engine does differently around the one loop (`training_step`); the defaults are plain torch in one
    process: autocast for amp-*, `(loss * weight).backward()` through a GradScaler for amp-fp16, optimizer.step()."""

    autocast: bool = True
    """False where the engine casts to the compute dtype itself (FSDP2's MixedPrecisionPolicy, DeepSpeed)."""
    engine_backward: Callable[[torch.Tensor], None] | None = None
    """Takes each micro-step's unweighted loss instead of backward + GradScaler + optimizer step: DeepSpeed's
    `engine.backward(loss); engine.step()`, which scales, accumulates and steps at the boundary itself."""
    reduce_gradients: Callable[[], None] | None = None
    """Runs after the last backward, before unscaling and clipping (memfit's DDP / ZeroRedundancyOptimizer
    all-reduce)."""
    max_grad_norm: float | None = None
    """Clip the gradient norm to this before the step (None: no clipping)."""
    step: Callable[[], None] | None = None
    """Runs instead of optimizer.step() (FitLoop: the transactional step); a GradScaler still decides whether."""


PLAIN_TORCH = EngineHooks()


def training_step(model: torch.nn.Module, optimizer, batches, setup: TrainingSetup, *,
                  loss_fn: LossFn | None = None, phase_callback: PhaseCallback | None = None,
                  hooks: EngineHooks = PLAIN_TORCH, weights: Sequence[float] | None = None) -> float:
    """One optimizer step, the one training loop of memfit: `forward_backward`, then `optimizer_step`. measure and
    the tracer run it with the default hooks; memfit._torch.engine.Prepared with its engine's; fit.FitLoop calls
    the two halves with its own step.

    `batches`: one batch (a dict of tensors, reused for every micro-step) or a sequence of grad_accum_steps batches.
    `loss_fn(model, batch)` returns the scalar loss; by default the model's output `.loss`.
    `phase_callback` is called with "forward", "backward" and "optimizer" as each phase begins (once per micro-step
    for the first two); each phase also runs inside a `record_function("memfit::<phase>")` range.
    `weights`: each micro-batch's loss weight (default 1 / grad_accum_steps, i.e. the mean).
    Returns the weighted loss over the micro-steps (nan on fake tensors, which have no values).
    """
    loss = forward_backward(model, optimizer, batches, setup, loss_fn=loss_fn, phase_callback=phase_callback,
                            hooks=hooks, weights=weights)
    optimizer_step(model, optimizer, setup, phase_callback=phase_callback, hooks=hooks)
    return loss


def forward_backward(model: torch.nn.Module, optimizer, batches, setup: TrainingSetup, *,
                     loss_fn: LossFn | None = None, phase_callback: PhaseCallback | None = None,
                     hooks: EngineHooks = PLAIN_TORCH, weights: Sequence[float] | None = None) -> float:
    """The micro-steps of one optimizer step: forward and loss (under autocast for amp-*), then backward of the
    loss times its weight (through the GradScaler for amp-fp16, or the engine's own backward)."""
    micro_batches = _micro_batches(batches, setup.grad_accum_steps if weights is None else len(weights))
    notify = phase_callback or _no_phase
    device_type = model_device(model).type
    autocast = autocast_factory(setup, device_type) if hooks.autocast else contextlib.nullcontext
    scaler = None if hooks.engine_backward else _grad_scaler(optimizer, setup, device_type)
    compute_loss = loss_fn or setup_loss(setup)
    total = 0.0
    for index, batch in enumerate(micro_batches):
        notify("forward")
        with torch.profiler.record_function("memfit::forward"), autocast(), _mask_hint(model, batch), \
                loop_contexts(model, setup):
            loss = compute_loss(model, batch)
        notify("backward")
        weight = 1 / setup.grad_accum_steps if weights is None else weights[index]
        with torch.profiler.record_function("memfit::backward"):
            if hooks.engine_backward is not None:
                hooks.engine_backward(loss)
            else:
                scaled = loss / setup.grad_accum_steps if weights is None else loss * weight
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                del scaled
        total += _value(loss) * weight
        del loss
    return total


def optimizer_step(model: torch.nn.Module, optimizer, setup: TrainingSetup, *,
                   phase_callback: PhaseCallback | None = None, hooks: EngineHooks = PLAIN_TORCH,
                   resume: bool = False) -> None:
    """The optimizer phase: reduce the gradients (hooks), unscale (amp-fp16), clip, step, update the loss scale,
    `zero_grad(set_to_none=True)`. `resume=True` continues a step whose `hooks.step` failed part-way (FitLoop after
    an out-of-memory error): the gradients left are already reduced, unscaled and clipped."""
    (phase_callback or _no_phase)("optimizer")
    with torch.profiler.record_function("memfit::optimizer"):
        if hooks.engine_backward is not None:
            return  # the engine stepped at the accumulation boundary
        if setup.optimizer_in_backward:
            if hooks.max_grad_norm:
                raise ConfigError("gradient clipping needs every gradient before any step: it does not combine "
                                  "with optimizer in backward (torchtune refuses it too)")
            return  # every parameter stepped, and its gradient was freed, inside backward
        scaler = _grad_scaler(optimizer, setup, model_device(model).type)
        target = _scaled_step(optimizer, hooks.step) if scaler is not None else None
        if not resume:
            if hooks.reduce_gradients is not None:
                hooks.reduce_gradients()
            if scaler is not None:
                scaler.unscale_(target)
            if hooks.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), hooks.max_grad_norm)
        if scaler is not None:
            scaler.step(target)
            scaler.update()
        else:
            (hooks.step or optimizer.step)()
        optimizer.zero_grad(set_to_none=not setup.keep_zeroed_grads)  # torch < 2.0's default kept them, zeroed


def setup_loss(setup: TrainingSetup) -> LossFn:
    """The loss the setup names: the model's own (`.loss`), torchtune's chunked one or the fused one."""
    if setup.loss is Loss.CHUNKED:
        if setup.compile:  # torchtune's training.compile_loss compiles each chunk's cross-entropy with the model
            from .compiled import compiled_cross_entropy

            return functools.partial(chunked_loss, cross_entropy=compiled_cross_entropy())
        return chunked_loss
    if setup.loss is Loss.FUSED:
        return fused_loss
    if setup.loss is Loss.COMPILED:
        return compiled_loss
    return default_loss


def compiled_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """torchtitan's loss under training.compile (components/loss.py build_cross_entropy_loss: torch.compile of
    cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))) on an HF causal LM: the model's logits, then
    the compiled cross-entropy, labels shifted as transformers' ForCausalLMLoss does."""
    hidden, head, labels = _decoder_output(model, batch, "compiled")
    return _compiled_cross_entropy()(head(hidden), _shifted_labels(labels))


@functools.lru_cache(maxsize=1)
def _compiled_cross_entropy():
    def cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1),
                                                 ignore_index=IGNORE_INDEX)

    return torch.compile(cross_entropy)


IGNORE_INDEX = -100


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One chunk's loss as torchtune's CEWithChunkedOutputLoss.compute_cross_entropy computes it: the chunk upcast
    to fp32, cross-entropy summed over its labelled tokens."""
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_loss(model: torch.nn.Module, batch, num_chunks: int = LOSS_CHUNKS,
                 cross_entropy: Callable = chunk_cross_entropy) -> torch.Tensor:
    """torchtune's CEWithChunkedOutputLoss on an HF causal LM: the decoder's hidden states cut into `num_chunks`
    pieces along the sequence, the LM head applied to each (all chunks' logits exist until the loss returns, as
    torchtune's model returns them as a list), each chunk upcast to fp32 and cross-entropy'd (reduction sum) on its
    own, the sum divided by the number of labelled tokens. Labels shifted as transformers' ForCausalLMLoss does.
    `cross_entropy`: each chunk's loss (under compile, torchtune's compiled one: memfit._torch.compiled)."""
    hidden, head, labels = _decoder_output(model, batch, "chunked")
    logits = [head(part) for part in hidden.tensor_split(num_chunks, dim=1)]
    del hidden
    shifted = _shifted_labels(labels)
    total = None
    for part, part_labels in zip(logits, shifted.tensor_split(num_chunks, dim=1)):
        chunk_loss = cross_entropy(part.flatten(0, 1), part_labels.reshape(-1))
        total = chunk_loss if total is None else total + chunk_loss
    return total / (shifted != IGNORE_INDEX).sum()


def fused_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """A pure-torch reference of the memory behaviour of Liger's fused linear cross-entropy
    (LigerFusedLinearCrossEntropyFunction), which needs Triton and so never runs on a CPU: the LM head, the loss and
    both their gradients computed chunk by chunk in forward, so the B x T x V logits never exist; only the gradient
    of the hidden states and of the head weight are kept for backward."""
    hidden, head, labels = _decoder_output(model, batch, "fused")
    if getattr(head, "bias", None) is not None:
        raise ConfigError("the fused loss reference covers an LM head without bias")
    shifted = _shifted_labels(labels).reshape(-1)
    return FusedLinearCrossEntropy.apply(hidden.flatten(0, 1), head.weight, shifted)


def fused_chunk_rows(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Liger's chunk rule (ops/fused_linear_cross_entropy.py): inc_factor = ceil(V / H), chunk_size =
    next_power_of_2(ceil(BT / inc_factor)), at most BT: a chunk's logits hold about BT x H elements."""
    inc = -(-vocab_size // hidden_size)
    rows = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(rows, tokens)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean cross-entropy of (hidden @ weight.T) against labels, with the gradients made in forward chunk by
    chunk in place in each chunk's logits (Liger's scheme); backward only hands them out (scaled when the incoming
    gradient is not 1)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        rows, hidden_size = hidden.shape
        chunk = fused_chunk_rows(rows, hidden_size, weight.shape[0])
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part = hidden[start:end]
            logits = torch.nn.functional.linear(part, weight)  # chunk x V, compute dtype (autocast's cached cast)
            target = labels[start:end].clamp(min=0).unsqueeze(1)
            keep = valid[start:end].unsqueeze(1)
            picked = logits.gather(1, target).float()
            top = logits.amax(dim=1, keepdim=True)
            logits.sub_(top).exp_()  # in place, as Liger's kernel overwrites the logits with their gradient
            norm = logits.sum(dim=1, keepdim=True, dtype=torch.float32)
            loss += ((norm.log() + top.float() - picked) * keep).sum()
            logits.div_(norm)
            logits.scatter_add_(1, target, -keep.to(logits.dtype))
            logits.mul_(keep / count)
            if logits.dtype == grad_hidden.dtype == weight.dtype:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            else:  # autocast: a chunk x h product in the compute dtype, copied into the fp32 gradient
                grad_hidden[start:end] = torch.matmul(logits, weight)
            if grad_weight is not None:
                if logits.dtype == grad_weight.dtype == part.dtype:
                    grad_weight.addmm_(logits.t(), part)
                else:  # autocast: a chunk-sized fp32 copy of the gradient, not a weight-sized product
                    grad_weight.addmm_(logits.t().to(grad_weight.dtype), part.to(grad_weight.dtype))
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden.mul_(grad_output)  # in place, as Liger's element_mul_kernel (a no-op scale when it is 1)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_hidden, grad_weight, None


def _decoder_output(model, batch, what: str):
    """The decoder's last hidden states (after the final norm), the LM head and the labels of an HF causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    prefix = getattr(model, "base_model_prefix", "")
    decoder = getattr(model, prefix, None) if prefix else None
    config = getattr(model, "config", None)
    if (head is None or decoder is None or not isinstance(batch, Mapping) or batch.get("labels") is None
            or getattr(config, "model_type", "") in MASKED_LM_TYPES):
        raise ConfigError(f"the {what} loss runs on a Hugging Face causal LM with labels in the batch")
    if getattr(config, "final_logit_softcapping", None):
        raise ConfigError(f"the {what} loss does not apply final_logit_softcapping: use loss standard")
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    hidden = decoder(**inputs).last_hidden_state
    return hidden, head, batch["labels"]


def _shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss: pad with the ignore index on the right, drop the first position."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def default_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.ndim == 0:
        loss = output
    if loss is None:
        raise ConfigError("the model's output has no loss: pass loss_fn=lambda model, batch: <scalar loss tensor>")
    return loss


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell transformers' masking code the batch holds one sequence per row (see the module docstring).

    On real tensors `find_packed_sequence_indices` already returns None for such a batch, so this changes nothing;
    on fake tensors it cannot read the values and would build a full B x 1 x T x T mask per forward.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _no_packed_sequences(position_ids):
    return None


def _mask_hint(model, batch) -> contextlib.AbstractContextManager:
    packed = isinstance(batch, Mapping) and batch.get("position_ids") is not None
    return unpacked_sequences() if is_hf_model(model) and not packed else contextlib.nullcontext()


def _micro_batches(batches, num_micro_steps: int) -> list:
    if isinstance(batches, (Mapping, torch.Tensor)):
        return [batches] * num_micro_steps
    batches = list(batches) if isinstance(batches, Sequence) else batches
    if not isinstance(batches, list) or len(batches) != num_micro_steps:
        count = len(batches) if isinstance(batches, list) else "an unsized iterable of"
        raise ConfigError(f"got {count} micro-batches for {num_micro_steps} micro-steps (grad_accum_steps, or one "
                          f"weight each): pass one batch (reused) or a list of exactly {num_micro_steps}")
    return batches


def _grad_scaler(optimizer, setup: TrainingSetup, device_type: str):
    """amp-fp16 needs loss scaling; one GradScaler per optimizer, kept on it so its scale carries across steps."""
    if setup.precision is not Precision.AMP_FP16:
        return None
    scaler = getattr(optimizer, "_memfit_grad_scaler", None)
    if scaler is None:
        scaler = torch.amp.GradScaler(device_type)
        optimizer._memfit_grad_scaler = scaler
    return scaler


class _ScaledStep:
    """What the GradScaler unscales and steps: the optimizer's parameter groups, and the step the loop was given
    (optimizer.step or a transactional one). One per optimizer, so a resumed step finds the scaler's record of it
    (the scaler keys its per-optimizer state by the object it was handed)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.run: Callable[[], None] = optimizer.step

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, *args, **kwargs):
        return self.run()


def _scaled_step(optimizer, step: Callable[[], None] | None) -> _ScaledStep:
    target = getattr(optimizer, "_memfit_scaled_step", None)
    if target is None:
        target = optimizer._memfit_scaled_step = _ScaledStep(optimizer)
    target.run = step or optimizer.step
    return target


def _value(loss: torch.Tensor) -> float:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(loss, FakeTensor) or loss.device.type == "meta":
        return float("nan")
    return float(loss.detach().item())


def _no_phase(phase: str) -> None:
    return None


def _import(name: str, *, extra: str = "torch"):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingDependencyError(f"{name} is needed here: pip install 'memfit[{extra}]' (or pip install {name})"
                                     ) from None
