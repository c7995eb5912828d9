"""Measured ground truth for LoRA / QLoRA training steps on CPU (helper module, no tests in it).

Builds real peft models the way HF Trainer + peft users do (tiny configs from tiny_configs.py, random weights),
measures their training steps with memfit's own CPU measurement (`memfit.measure.measure`, torch.profiler
allocation events) and offers probes of what autograd really saves inside a peft `lora.Linear`, a decoder layer
and a bitsandbytes quantized Linear. bench/lora_measure.py runs the case matrix; the numbers are the truth the
LoRA/QLoRA formulas are written against.

What the recipe does, step by step (transformers 5.24, peft 0.21.2, bitsandbytes 0.50.2):
- fp32 / bf16 base: `AutoModelFor*.from_config(config, dtype=...)` (the same model from_pretrained gives).
- nf4 / fp4 / int8 base: the random fp32 model is saved and reloaded with `from_pretrained(quantization_config=
  BitsAndBytesConfig(...), dtype=bfloat16, device_map="cpu")`, then `peft.prepare_model_for_kbit_training`
  (freezes everything, casts every fp16/bf16 parameter that is not a Params4bit to fp32: embeddings, norms, lm_head
  and biases end up fp32; int8 weights stay int8).
- `get_peft_model(model, LoraConfig(...))` with its default `autocast_adapter_dtype=True` (bf16 adapters upcast to
  fp32).
- checkpointing: what Trainer(gradient_checkpointing=True) does, `model.activation_checkpointing_enable(
  activation_checkpointing_kwargs=None)` -> torch.utils.checkpoint with use_reentrant=False, and (because the main
  input is input_ids) `enable_input_require_grads()`. `reentrant=True` instead reproduces what
  `prepare_model_for_kbit_training(use_gradient_checkpointing=True)` leaves when Trainer does not re-enable it: it
  passes `gradient_checkpointing_kwargs={}`, transformers keeps that empty dict, and torch.utils.checkpoint then
  falls back to use_reentrant=True (with a warning).

memfit's step loop does not touch a model passed in as an nn.Module (no cast, no checkpointing switch), so the
prepared peft model is measured as it is; only the TrainingSetup's precision (autocast), optimizer, batch and
sequence length matter to the loop. One thing memfit's measurement does not see: bitsandbytes' QuantState tensors
(absmax, nested absmax, offset, code maps; int8's SCB) are neither parameters nor buffers, so they are not in its
baseline; they live for the whole run, so `measure_lora_case` reports them separately (`quant_state_bytes`) and adds
them in `peak_bytes_with_quant_state`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from tiny_configs import TINY_CONFIGS  # noqa: E402
from tiny_derived_configs import DERIVED_CONFIGS  # noqa: E402

CONFIGS = {**TINY_CONFIGS, **DERIVED_CONFIGS}
"""Every family a case can build: the hand-built ones and those memfit sizes by derived formulas."""

ATTENTION_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt2": ["attn.c_attn", "attn.c_proj"],  # plain "c_proj" would also match mlp.c_proj
    "bert": ["query", "key", "value", "attention.output.dense"],
}
MASKED_LM = frozenset({"bert"})
BASE_DTYPES = ("fp32", "bf16", "nf4", "fp4", "int8")
PRECISIONS = ("fp32", "amp-bf16", "bf16")


@dataclass(frozen=True)
class LoraCase:
    """One LoRA/QLoRA training step to build and measure."""

    family: str = "llama"
    """a key of CONFIGS (tiny_configs.TINY_CONFIGS or tiny_derived_configs.DERIVED_CONFIGS)"""
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    targets: str | tuple[str, ...] = "attention"
    """'attention' (the family's attention projections), 'all-linear' (peft's: every Linear but the output head)
    or an explicit tuple of module-name suffixes"""
    base_dtype: str = "fp32"
    """'fp32' | 'bf16' | 'nf4' | 'fp4' | 'int8'"""
    double_quant: bool = False
    """bnb_4bit_use_double_quant (4-bit bases only)"""
    compute_dtype: str = "bf16"
    """bnb_4bit_compute_dtype (4-bit bases only): 'bf16' | 'fp32'"""
    precision: str = "fp32"
    """'fp32' | 'amp-bf16' (torch.autocast bf16, HF Trainer bf16=True) | 'bf16' (pure bf16, no autocast)"""
    checkpointing: bool = False
    reentrant: bool = False
    """with checkpointing: use_reentrant=True (what prepare_model_for_kbit_training alone leaves) instead of
    Trainer's non-reentrant default"""
    input_require_grads: bool | None = None
    """None: what the recipe does (on exactly when checkpointing is on); True/False forces
    enable_input_require_grads()"""
    modules_to_save: tuple[str, ...] = ()
    batch: int = 2
    seq: int = 64
    optimizer: str = "adamw"
    """memfit optimizer name: 'adamw' (single-tensor), 'adamw-foreach', 'adamw-8bit', 'sgd', ..."""
    attention: str = "sdpa"
    seed: int = 0
    dora: bool = False
    """peft use_dora: a magnitude vector per adapted Linear and the weight norm recomputed each forward"""
    kbit_prep: bool = True
    """quantized base: call peft.prepare_model_for_kbit_training (False: the embeddings, norms and head stay in the
    bf16 from_pretrained loaded them in, as Answer.AI's fsdp_qlora, LitGPT, axolotl and LLaMA-Factory leave them)"""

    def __post_init__(self) -> None:
        if self.family not in CONFIGS:
            raise ValueError(f"unknown family {self.family!r}: one of {sorted(CONFIGS)}")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {self.base_dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16" and self.base_dtype != "bf16":
            raise ValueError("pure bf16 training needs base_dtype='bf16'")
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def quantized(self) -> bool:
        return self.base_dtype in ("nf4", "fp4", "int8")

    @property
    def label(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else "+".join(self.targets)
        base = self.base_dtype + ("-dq" if self.double_quant and self.base_dtype in ("nf4", "fp4") else "")
        parts = [self.family, f"r{self.rank}", targets, f"do{self.dropout:g}", base, self.precision,
                 ("ckpt-reentrant" if self.reentrant else "ckpt") if self.checkpointing else "no-ckpt",
                 self.optimizer, f"b{self.batch}x{self.seq}"]
        if self.input_require_grads is not None:
            parts.append(f"irg={int(self.input_require_grads)}")
        if self.modules_to_save:
            parts.append("save=" + "+".join(self.modules_to_save))
        if self.dora:
            parts.append("dora")
        if not self.kbit_prep:
            parts.append("no-kbit-prep")
        if self.attention != "sdpa":
            parts.append(self.attention)
        return "/".join(parts)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["targets"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        values["modules_to_save"] = list(self.modules_to_save)
        return values

    def replace(self, **changes) -> "LoraCase":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------------- building


@contextlib.contextmanager
def quiet() -> Iterable[None]:
    """Silence transformers / peft / bitsandbytes warnings and progress bars (they go to stderr)."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    loggers = [logging.getLogger(n) for n in ("bitsandbytes", "peft", "torch.utils.checkpoint")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        transformers.logging.set_verbosity(level)
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def hf_config(case: LoraCase):
    import transformers

    values = copy.deepcopy(CONFIGS[case.family])
    model_type = values.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **values)
    config.use_cache = False
    return config


def _auto_class(case: LoraCase):
    import transformers

    return transformers.AutoModelForMaskedLM if case.family in MASKED_LM else transformers.AutoModelForCausalLM


def quantization_config(case: LoraCase):
    import transformers

    if case.base_dtype == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=case.base_dtype,
                                           bnb_4bit_use_double_quant=case.double_quant,
                                           bnb_4bit_compute_dtype=_torch_dtype(case.compute_dtype))


def build_base_model(case: LoraCase):
    """The transformers model before peft: fp32/bf16 from the config, or quantized through from_pretrained."""
    import torch

    config = hf_config(case)
    auto = _auto_class(case)
    torch.manual_seed(case.seed)
    if not case.quantized:
        model = auto.from_config(config, attn_implementation=case.attention, dtype=_torch_dtype(case.base_dtype))
        return model
    random = auto.from_config(config, attn_implementation=case.attention, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        random.save_pretrained(folder)
        del random
        model = auto.from_pretrained(folder, quantization_config=quantization_config(case), dtype=torch.bfloat16,
                                     device_map="cpu", attn_implementation=case.attention)
    return model


def lora_config(case: LoraCase):
    import peft

    targets = ATTENTION_TARGETS[case.family] if case.targets == "attention" else (
        "all-linear" if case.targets == "all-linear" else list(case.targets))
    task = None if case.family in MASKED_LM else "CAUSAL_LM"
    return peft.LoraConfig(r=case.rank, lora_alpha=case.alpha, lora_dropout=case.dropout, target_modules=targets,
                           modules_to_save=list(case.modules_to_save) or None, task_type=task, bias="none",
                           use_dora=case.dora)


def build_lora_model(case: LoraCase):
    """The real peft model for `case`, in train mode, prepared the way HF Trainer + peft (QLoRA recipes) do."""
    import peft

    with quiet():
        model = build_base_model(case)
        if case.quantized and case.kbit_prep:
            kwargs = {} if case.reentrant else {"use_reentrant": False}
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.checkpointing,
                                                         gradient_checkpointing_kwargs=kwargs)
        model = peft.get_peft_model(model, lora_config(case))
        if case.checkpointing:
            # Trainer(gradient_checkpointing=True): activation_checkpointing_enable(activation_checkpointing_kwargs=
            # None) -> {"use_reentrant": False}; it also calls enable_input_require_grads (main input is input_ids)
            kwargs = {"use_reentrant": True} if case.reentrant else None
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        base = model.get_base_model()
        if case.input_require_grads is True and not input_require_grads_on(model):
            base.enable_input_require_grads()
        elif case.input_require_grads is False and input_require_grads_on(model):
            base.disable_input_require_grads()
        base.config.use_cache = False
    model.train()
    return model


def input_require_grads_on(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "_require_grads_hooks", None) or getattr(base, "_require_grads_hook", None))


def checkpointing_mode(model) -> str:
    """'off', 'non-reentrant' or 'reentrant', read from the partial transformers installed on the layers."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            func = getattr(module, "_gradient_checkpointing_func", None)
            keywords = getattr(func, "keywords", {}) or {}
            reentrant = keywords.get("use_reentrant", None)
            return "non-reentrant" if reentrant is False else "reentrant"
    return "off"


# ------------------------------------------------------------------------------------------------ storages


def _storage_key(tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared tensors once)."""
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        ptr, nbytes = _storage_key(tensor)
        seen[ptr] = max(nbytes, seen.get(ptr, 0))
    return sum(seen.values())


def quant_state_tensors(quant_state) -> list:
    """Every tensor a bitsandbytes QuantState holds (absmax, code, offset and the nested state2's)."""
    import torch

    if quant_state is None:
        return []
    tensors = []
    for name in ("absmax", "code", "offset"):
        value = getattr(quant_state, name, None)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
    state2 = getattr(quant_state, "state2", None)
    if state2 is not None:
        tensors += quant_state_tensors(state2)
    return tensors


def quant_side_tensors(model) -> list:
    """The bitsandbytes tensors outside model.parameters()/buffers(): 4-bit QuantStates, int8 SCB/CB."""
    import torch

    tensors = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        tensors += quant_state_tensors(getattr(weight, "quant_state", None))
        for holder in (weight, getattr(module, "state", None)):
            for name in ("SCB", "CB"):
                value = getattr(holder, name, None)
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
    known = {_storage_key(t)[0] for t in (*model.parameters(), *model.buffers())}
    return [t for t in tensors if _storage_key(t)[0] not in known]


def param_summary(model) -> dict:
    """Counts and bytes of trainable / frozen parameters by dtype, adapter dtypes, quantized storages."""
    import torch

    seen: set[int] = set()
    trainable = frozen = trainable_elems = quantized_bytes = 0
    by_dtype: dict[str, int] = {}
    adapter_dtypes: set[str] = set()
    for name, param in model.named_parameters():
        ptr, nbytes = _storage_key(param)
        if ptr in seen:
            continue
        seen.add(ptr)
        key = f"{'trainable' if param.requires_grad else 'frozen'}:{str(param.dtype).replace('torch.', '')}"
        by_dtype[key] = by_dtype.get(key, 0) + nbytes
        if param.requires_grad:
            trainable += nbytes
            trainable_elems += param.numel()
        else:
            frozen += nbytes
        if param.dtype in (torch.uint8, torch.int8):
            quantized_bytes += nbytes
        if "lora_" in name:
            adapter_dtypes.add(str(param.dtype).replace("torch.", ""))
    from peft.tuners.lora import LoraLayer

    lora_modules = sum(isinstance(m, LoraLayer) for m in model.modules())
    side = quant_side_tensors(model)
    return {"trainable_params": trainable_elems, "trainable_bytes": trainable, "frozen_bytes": frozen,
            "param_bytes_by_dtype": by_dtype, "adapter_dtypes": sorted(adapter_dtypes),
            "quantized_weight_bytes": quantized_bytes, "quant_state_bytes": storage_bytes(side),
            "lora_modules": lora_modules}


# --------------------------------------------------------------------------------------------- measuring


def training_setup(case: LoraCase):
    from memfit.setup import TrainingSetup

    return TrainingSetup(micro_batch_size=case.batch, seq_len=case.seq, precision=case.precision,
                         optimizer=case.optimizer, checkpointing="full" if case.checkpointing else "none",
                         attention=case.attention, num_gpus=1)


def make_batches(model, case: LoraCase) -> list[dict]:
    """memfit's own batch (random ids, labels = ids) for the model's vocabulary."""
    import torch

    from memfit._torch.step import make_batch

    generator = torch.Generator().manual_seed(case.seed)
    return [make_batch(model.get_base_model().config, training_setup(case), generator=generator)]


def measure_lora_case(case: LoraCase, *, steps: int = 2) -> dict:
    """Build `case` and measure `steps` real CPU training steps with memfit.measure.measure.

    Returns the case's fields plus: peak_bytes (memfit's total, the profiler's peak of live tensor bytes),
    peak_phase, phase_peaks, terms (each memfit term's bytes at the peak), categories, the static parameter summary
    (param_summary), quant_state_bytes and peak_bytes_with_quant_state, the checkpointing mode found on the model,
    whether the embedding output is made to require grad, the per-step peaks and losses from memfit's notes.
    """
    import torch

    from memfit.estimate.result import Phase
    from memfit.measure import measure

    torch.manual_seed(case.seed)
    model = build_lora_model(case)
    setup = training_setup(case)
    batches = make_batches(model, case)
    info = param_summary(model)
    with quiet():
        result = measure(model, setup, steps=steps, batches=batches)
    terms = {term.name: term.num_bytes for term in result.terms}
    categories = {str(category): num_bytes for category, num_bytes in result.by_category().items() if num_bytes}
    notes = [n for n in result.notes if n.startswith(("peak per step", "losses"))]
    row = {"label": case.label, **case.to_dict(), "peak_bytes": result.total_bytes,
           "peak_phase": str(result.peak_phase),
           "phase_peaks": {str(p): b for p, b in result.phase_peaks.items()}, "terms": terms,
           "categories": categories, **info,
           "peak_bytes_with_quant_state": result.total_bytes + info["quant_state_bytes"],
           "checkpointing_mode": checkpointing_mode(model), "input_require_grads_on": input_require_grads_on(model),
           "tokens": case.batch * case.seq, "notes": notes}
    # live at the optimizer phase before its temporaries: parameters, buffers, batch, every gradient, the states
    static = terms.get("parameters", 0) + terms.get("buffers", 0) + terms.get("inputs", 0)
    row["optimizer_step_temporaries"] = (result.phase_peaks.get(Phase.OPTIMIZER, 0) - static
                                         - info["trainable_bytes"] - terms.get("optimizer", 0))
    return row


# --------------------------------------------------------------------------------- real bitsandbytes bytes


def real_4bit_bytes(out_features: int, in_features: int, quant_type: str = "nf4", double_quant: bool = True,
                    blocksize: int = 64, compute_dtype=None, quant_storage=None) -> dict:
    """Bytes bitsandbytes really allocates for one 4-bit Linear weight (out_features x in_features), quantized on
    CPU by bnb.nn.Linear4bit: the packed weight and every QuantState tensor, by distinct storage."""
    import torch

    with quiet():
        import bitsandbytes as bnb

        compute_dtype = compute_dtype or torch.bfloat16
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=compute_dtype,
                                  compress_statistics=double_quant, quant_type=quant_type,
                                  quant_storage=quant_storage or torch.uint8)
        weight = layer.weight
        weight = bnb.nn.Params4bit(torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02,
                                   requires_grad=False, blocksize=blocksize, compress_statistics=double_quant,
                                   quant_type=quant_type, quant_storage=quant_storage or torch.uint8)
        layer.weight = weight
        layer = layer.to("cpu")
    state = layer.weight.quant_state
    parts = {"packed_weight": storage_bytes([layer.weight.data]), "absmax": storage_bytes([state.absmax])}
    parts["absmax_dtype"] = str(state.absmax.dtype).replace("torch.", "")
    parts["code"] = storage_bytes([state.code]) if state.code is not None else 0
    if state.nested:
        parts["offset"] = storage_bytes([state.offset])
        parts["nested_absmax"] = storage_bytes([state.state2.absmax])
        parts["nested_code"] = storage_bytes([state.state2.code])
        parts["nested_blocksize"] = state.state2.blocksize
    parts["weight_shape"] = list(layer.weight.shape)
    parts["weight_dtype"] = str(layer.weight.dtype).replace("torch.", "")
    parts["total"] = storage_bytes([layer.weight.data, *quant_state_tensors(state)])
    parts["total_without_code"] = parts["total"] - parts["code"] - parts.get("nested_code", 0)
    return parts


def real_int8_bytes(out_features: int, in_features: int) -> dict:
    """Bytes of one LLM.int8 Linear weight on CPU (bnb.nn.Linear8bitLt, has_fp16_weights=False): the int8 weight
    and its per-row fp32 scale SCB."""
    import torch

    with quiet():
        import bitsandbytes as bnb

        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(torch.randn(out_features, in_features, dtype=torch.float16) * 0.02,
                                         requires_grad=False, has_fp16_weights=False)
        layer = layer.to("cpu")
    scb = getattr(layer.weight, "SCB", None)
    parts = {"weight": storage_bytes([layer.weight.data]), "weight_dtype": str(layer.weight.dtype).replace("torch.", ""),
             "SCB": storage_bytes([scb]) if scb is not None else 0,
             "SCB_dtype": str(scb.dtype).replace("torch.", "") if scb is not None else None}
    parts["total"] = parts["weight"] + parts["SCB"]
    return parts


# ------------------------------------------------------------------------------------------ mechanism probes


@dataclass
class Saved:
    """One tensor autograd packed for backward."""

    module: str
    shape: tuple[int, ...]
    dtype: str
    ptr: int
    nbytes: int
    is_param: bool
    first: bool = True
    """False when the same storage was already packed earlier (shared, counted once)"""
    node: str = ""


class SavedTensorRecorder:
    """saved_tensors_hooks over a forward, each packed tensor attributed to the innermost module running (forward
    pre/post hooks keep the stack) and to the autograd node that saved it (found afterwards by walking the graph)."""

    def __init__(self, model, params: Iterable = ()) -> None:
        import torch

        self.model = model
        self.stack: list[str] = []
        self.records: list[Saved] = []
        self.params = {_storage_key(p)[0] for p in (*model.parameters(), *params)}
        self.params |= {_storage_key(t)[0] for t in quant_side_tensors(model)} if hasattr(model, "modules") else set()
        self._handles = []
        self._torch = torch

    def __enter__(self):
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        self._hooks = self._torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        return False

    def _push(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _pop(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def _pack(self, tensor):
        ptr, nbytes = _storage_key(tensor)
        first = all(r.ptr != ptr for r in self.records)
        self.records.append(Saved(self.stack[-1] if self.stack else "", tuple(tensor.shape),
                                  str(tensor.dtype).replace("torch.", ""), ptr, nbytes, ptr in self.params, first))
        return tensor

    def name_nodes(self, output) -> None:
        """Label each record with the autograd node(s) holding a tensor of its storage (walks the graph)."""
        names: dict[int, list[str]] = {}
        for node, attr, tensor in walk_saved(output):
            names.setdefault(_storage_key(tensor)[0], []).append(f"{node}.{attr}")
        for record in self.records:
            record.node = ",".join(sorted(set(names.get(record.ptr, []))))

    def activation_bytes(self, prefix: str = "") -> int:
        """Distinct non-parameter storages packed while a module under `prefix` ran."""
        return sum(r.nbytes for r in self.records if r.first and not r.is_param and r.module.startswith(prefix))

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if r.first and not r.is_param:
                out[r.module] = out.get(r.module, 0) + r.nbytes
        return out

    def table(self, prefix: str = "") -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records if r.module.startswith(prefix)]


def walk_saved(output) -> list[tuple[str, str, object]]:
    """(node name, attribute, tensor) of every tensor saved on the autograd graph behind `output`: the `_saved_*`
    attributes of built-in nodes, and saved_tensors / tensor attributes of custom Functions' ctx."""
    import torch

    found = []
    start = output.grad_fn if isinstance(output, torch.Tensor) else output
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - freed or not a tensor
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    found.append((name, attr[len("_saved_"):], tensor))
        if not name.endswith("Backward0"):
            try:
                for tensor in getattr(node, "saved_tensors", ()):
                    if isinstance(tensor, torch.Tensor):
                        found.append((name, "saved_tensors", tensor))
            except Exception:  # noqa: BLE001
                pass
            for attr, value in list(getattr(node, "__dict__", {}).items()):
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        found.append((name, f"ctx.{attr}", tensor))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def alloc_trace(fn: Callable[[], object]) -> dict:
    """Run fn under torch.profiler(profile_memory=True); return the peak of live bytes above the start, the bytes
    still live at the end (allocated and not freed), and the allocation sizes in order."""
    import torch
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
    events.sort()
    live = peak = 0
    sizes = []
    for _, size, _ in events:
        live += size
        peak = max(peak, live)
        if size > 0:
            sizes.append(size)
    return {"peak": peak, "end": live, "sizes": sizes, "result": result}


def lora_linear(in_features: int, out_features: int, *, rank: int = 8, dropout: float = 0.0, dtype="fp32",
                bias: bool = False, seed: int = 0):
    """One peft lora.Linear around a plain nn.Linear (base weights in `dtype`, adapters as peft makes them)."""
    import peft
    import torch

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(in_features, out_features, bias=bias, dtype=_torch_dtype(dtype))

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(seed)
    with quiet():
        model = peft.get_peft_model(One(), peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                                                            target_modules=["proj"]))
    model.train()
    return model


def probe_linear(model, x, *, autocast: bool = False) -> dict:
    """Forward `model(x)` under the recorder (and autocast bf16 if asked): what is saved, by node, and the bytes."""
    import torch

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with SavedTensorRecorder(model) as recorder, ctx:
        out = model(x)
    recorder.name_nodes(out)
    return {"out_dtype": str(out.dtype).replace("torch.", ""), "saved_bytes": recorder.activation_bytes(),
            "records": recorder.table(), "output": out}


def quantized_lora_linear(in_features: int, out_features: int, *, base: str = "nf4", double_quant: bool = True,
                          rank: int = 8, dropout: float = 0.0, compute_dtype="bf16", seed: int = 0):
    """One peft lora Linear4bit / Linear8bitLt around a bitsandbytes layer quantized on CPU."""
    import peft
    import torch

    with quiet():
        import bitsandbytes as bnb

        class One(torch.nn.Module):
            def __init__(self):
                super().__init__()
                if base == "int8":
                    self.proj = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
                    self.proj.weight = bnb.nn.Int8Params(torch.randn(out_features, in_features,
                                                                     dtype=torch.float16) * 0.02,
                                                         requires_grad=False, has_fp16_weights=False)
                else:
                    self.proj = bnb.nn.Linear4bit(in_features, out_features, bias=False,
                                                  compute_dtype=_torch_dtype(compute_dtype),
                                                  compress_statistics=double_quant, quant_type=base)
                    self.proj.weight = bnb.nn.Params4bit(torch.randn(out_features, in_features) * 0.02,
                                                         requires_grad=False, compress_statistics=double_quant,
                                                         quant_type=base)
                self.proj = self.proj.to("cpu")

            def forward(self, x):
                return self.proj(x)

        torch.manual_seed(seed)
        model = peft.get_peft_model(One(), peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                                                            target_modules=["proj"]))
    model.train()
    return model


def decoder_layer_saved(case: LoraCase, *, full_finetune: bool = False) -> dict:
    """Saved-for-backward bytes per module in one forward of the whole model (`case`'s recipe, or a full fine-tune
    of the same base when `full_finetune`), and the total per decoder layer (distinct non-parameter storages)."""
    import torch

    if full_finetune:
        with quiet():
            model = build_base_model(case)
        model.train()
        if case.checkpointing:
            model.activation_checkpointing_enable()
    else:
        model = build_lora_model(case)
    batch = make_batches(model if not full_finetune else _Wrap(model), case)[0]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if case.precision == "amp-bf16" else contextlib.nullcontext()
    with quiet(), SavedTensorRecorder(model) as recorder, ctx:
        out = model(**batch)
    recorder.name_nodes(out.loss)
    per_module = recorder.by_module()
    layers: dict[str, int] = {}
    for name, nbytes in per_module.items():
        key = _layer_key(name)
        layers[key] = layers.get(key, 0) + nbytes
    return {"by_module": per_module, "by_layer": layers, "total": recorder.activation_bytes(),
            "records": recorder.records, "model": model}


class _Wrap:
    def __init__(self, model):
        self.model = model

    def get_base_model(self):
        return self.model


def _layer_key(name: str) -> str:
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part in ("layers", "h", "layer") and index + 1 < len(parts) and parts[index + 1].isdigit():
            return ".".join(parts[index - 0:index + 2])
    return name.replace("base_model.model.", "") or "(top)"


def per_token(nbytes: int, case: LoraCase) -> float:
    return nbytes / (case.batch * case.seq)


__all__ = ["LoraCase", "build_lora_model", "measure_lora_case", "real_4bit_bytes", "real_int8_bytes",
           "param_summary", "quant_side_tensors", "SavedTensorRecorder", "walk_saved", "alloc_trace",
           "lora_linear", "quantized_lora_linear", "probe_linear", "decoder_layer_saved", "checkpointing_mode",
           "input_require_grads_on", "ATTENTION_TARGETS", "TINY_CONFIGS"]

