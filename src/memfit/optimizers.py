"""The optimizers memfit sizes, one record each: who implements it, the class and arguments memfit builds for a
measured step and writes into emitted code, how many states it keeps and in how many bits, and how engines and
config files spell it. `TrainingSetup.optimizer` (memfit.setup.Optimizer) names a record; the byte formulas that
read the records live in memfit.estimate.static, the engines' own rules (which optimizer FSDP2 or torch's ZeRO-1
can step) here.

Adding an optimizer: a member of memfit.setup.Optimizer, a record below, its state formula in
memfit.estimate.static (a test checks that every member has a record)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    """memfit's --optimizer value (memfit.setup.Optimizer)."""
    cls: str
    """The class memfit builds, as an import path ('torch.optim.AdamW')."""
    summary: str
    """One line: what it keeps (emitted comments, `memfit.apply`)."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """What memfit passes besides the parameters and the learning rate (foreach=False, momentum=0.9...)."""
    states: int = 2
    """Large per-parameter states (Adam's two moments; Lion's and SGD's one)."""
    state_bits: int = 32
    """Bits per element of the large states (32: full precision, in the parameter's or fp32 dtype)."""
    paged: bool = False
    """bitsandbytes paged: large states in CUDA unified memory (cudaMallocManaged), outside torch's allocator."""
    hf_optim: str | None = None
    """transformers TrainingArguments `optim` that builds it (None: it has no name there)."""
    hf_names: tuple[str, ...] = ()
    """The `optim` names a reader maps to this record (adamw_torch is foreach on CUDA, torch's default there)."""
    class_names: tuple[str, ...] = ()
    """Other class paths configs name for it (torchtune `_component_`), lower case."""
    aliases: tuple[str, ...] = ()
    """Other spellings --optimizer accepts."""
    fsdp2: str = ""
    """Why it cannot step FSDP2's sharded (DTensor) parameters; empty where it can."""
    zero1: bool = False
    """torch's ZeroRedundancyOptimizer (ZeRO-1) can wrap it."""
    lr: bool = True
    """Takes a learning rate (HF Adafactor's relative step does not)."""
    rest: str = ""
    """Who steps the parameters this class does not take (Muon: AdamW on all but the blocks' 2-D weights)."""

    @property
    def library(self) -> str:
        """Who implements it: 'torch', 'bitsandbytes', 'torchao' or 'transformers'."""
        return self.cls.split(".")[0]

    @property
    def torch_adam(self) -> bool:
        """torch.optim.AdamW in one of its three kernels (what DeepSpeed and FSDP2 build themselves)."""
        return self.cls == "torch.optim.AdamW"

    @property
    def config_classes(self) -> tuple[str, ...]:
        """The lower-case class paths a config names it by (torch's AdamW is read with its own kernel flags)."""
        return () if self.torch_adam else (self.cls.lower(), *self.class_names)

    def call(self, params: str = "model.parameters()") -> str:
        """Python that builds it, as emitted code writes it."""
        args = [params] + (["lr=lr"] if self.lr else []) + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.cls}({', '.join(args)})"

    def describe(self) -> str:
        """The class and memfit's arguments in one line ('torch.optim.AdamW(foreach=False)')."""
        own = f"{self.cls}({', '.join(f'{k}={v!r}' for k, v in self.kwargs)})"
        return f"{own} on the blocks' 2-D weights, {self.rest} on the rest" if self.rest else own

    @property
    def hf_note(self) -> str:
        """What to pass the HF Trainer where TrainingArguments has no `optim` name for it."""
        if self.rest:
            return (f"TrainingArguments has no optim name for {self.name}: build it with memfit.apply's "
                    f"make_optimizer(model) ({self.describe()}) and pass Trainer(..., optimizers=(optimizer, None)).")
        return (f"TrainingArguments has no optim name for {self.name}: pass Trainer(..., optimizer_cls_and_kwargs="
                f"({self.cls}, {{'lr': lr}})); it overrides `optim`.")

    def load(self) -> type:
        """The class itself (imports its library)."""
        module, _, name = self.cls.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def build(self, params, lr: float):
        """The optimizer over `params`, with memfit's arguments."""
        return self.load()(params, **({"lr": lr} if self.lr else {}), **dict(self.kwargs))


_BNB_DTENSOR = ("bitsandbytes' {name} kernels have no DTensor sharding rule, so they cannot step FSDP2 parameters; "
                "use deepspeed.json (ZeRO hands it plain tensors)")
_PAGED = ("{moments} in CUDA unified memory, evicted to host RAM under memory pressure (needs bitsandbytes)")


def _bnb(name: str, cls: str, summary: str, **fields) -> OptimizerKind:
    return OptimizerKind(name, f"bitsandbytes.optim.{cls}", summary, fsdp2=_BNB_DTENSOR.format(name=name), **fields)


def _torchao(name: str, cls: str, summary: str, **fields) -> OptimizerKind:
    return OptimizerKind(name, f"torchao.optim.{cls}", summary,
                         class_names=(f"torchao.prototype.low_bit_optim.{cls.lower()}",) if "Fp8" not in cls else (),
                         **fields)


KINDS: tuple[OptimizerKind, ...] = (
    OptimizerKind("adamw", "torch.optim.AdamW", "single-tensor AdamW: one parameter at a time, no parameter-sized "
                  "temporaries", kwargs=(("foreach", False),), hf_optim="adamw_torch",
                  aliases=("adam", "adamw-torch", "adamw-single"), zero1=True),
    OptimizerKind("adamw-foreach", "torch.optim.AdamW", "torch AdamW, multi-tensor (foreach), torch's default on "
                  "CUDA: parameter-sized temporaries", kwargs=(("foreach", True),), hf_optim="adamw_torch",
                  hf_names=("adamw_torch",), zero1=True),
    OptimizerKind("adamw-fused", "torch.optim.AdamW", "torch AdamW(fused=True): one kernel, no parameter-sized "
                  "temporaries", kwargs=(("fused", True),), hf_optim="adamw_torch_fused",
                  hf_names=("adamw_torch_fused",), zero1=True),
    _bnb("adamw-8bit", "AdamW8bit", "bitsandbytes AdamW8bit: block-wise uint8 moments (needs bitsandbytes)",
         state_bits=8, hf_optim="adamw_bnb_8bit", hf_names=("adamw_bnb_8bit", "adamw_8bit"),
         class_names=("bitsandbytes.optim.adam8bit",),
         aliases=("adam8bit", "adamw8bit", "8bit", "bnb", "adamw-bnb-8bit")),
    _bnb("paged-adamw-8bit", "PagedAdamW8bit", "bitsandbytes PagedAdamW8bit: uint8 " + _PAGED.format(moments="moments"),
         state_bits=8, paged=True, hf_optim="paged_adamw_8bit", hf_names=("paged_adamw_8bit",),
         class_names=("bitsandbytes.optim.pagedadam8bit",),
         aliases=("paged-adamw8bit", "pagedadamw8bit", "paged-8bit")),
    _bnb("paged-adamw", "PagedAdamW32bit", "bitsandbytes PagedAdamW (32-bit): fp32 "
         + _PAGED.format(moments="moments"), paged=True, hf_optim="paged_adamw_32bit", hf_names=("paged_adamw_32bit",),
         class_names=("bitsandbytes.optim.pagedadamw",),
         aliases=("paged-adamw-32bit", "pagedadamw", "pagedadamw32bit", "paged")),
    _torchao("adamw-ao-8bit", "AdamW8bit", "torchao AdamW8bit: block-wise uint8 moments (needs torchao)",
             state_bits=8, hf_optim="adamw_torch_8bit", hf_names=("adamw_torch_8bit",),
             aliases=("adamw-torch-8bit", "torchao-8bit", "ao-8bit")),
    _torchao("adamw-4bit", "AdamW4bit", "torchao AdamW4bit: block-wise 4-bit moments (needs torchao)",
             state_bits=4, hf_optim="adamw_torch_4bit", hf_names=("adamw_torch_4bit",),
             aliases=("adamw-torch-4bit", "torchao-4bit", "4bit", "adamw4bit")),
    _torchao("adamw-fp8", "AdamWFp8", "torchao AdamWFp8: block-wise float8_e4m3 moments (needs torchao)",
             state_bits=8, aliases=("torchao-fp8", "adamwfp8", "fp8")),
    _bnb("lion-8bit", "Lion8bit", "bitsandbytes Lion8bit: one block-wise uint8 momentum (needs bitsandbytes)",
         states=1, state_bits=8, hf_optim="lion_8bit", hf_names=("lion_8bit",), aliases=("lion8bit", "lion-bnb-8bit")),
    _bnb("lion", "Lion32bit", "bitsandbytes Lion (32-bit): one fp32 momentum (needs bitsandbytes)", states=1,
         hf_optim="lion_32bit", hf_names=("lion_32bit",), class_names=("bitsandbytes.optim.lion",),
         aliases=("lion-32bit", "lion32bit")),
    OptimizerKind("sgd", "torch.optim.SGD", "SGD with momentum: one state per parameter", kwargs=(("momentum", 0.9),),
                  states=1, hf_optim="sgd", hf_names=("sgd",), aliases=("sgd-momentum",), zero1=True),
    OptimizerKind("adafactor", "transformers.optimization.Adafactor", "transformers Adafactor (HF defaults: relative "
                  "step, no lr): factored second moment and no first moment",
                  kwargs=(("scale_parameter", True), ("relative_step", True), ("warmup_init", False), ("lr", None)),
                  states=1, hf_optim="adafactor", hf_names=("adafactor",), class_names=("torch.optim.adafactor",),
                  fsdp2=("Adafactor's factored moments reduce over whole rows and columns, which FSDP2's sharded "
                         "DTensor parameters do not support (torch and transformers Adafactor both fail); "
                         "use deepspeed.json"), lr=False),
    OptimizerKind("muon", "torch.optim.Muon", "torch Muon on the blocks' 2-D weights (one momentum, Newton-Schulz "
                  "orthogonalised update in bf16), AdamW (foreach) on embeddings, head, norms and biases", states=1,
                  fsdp2="torch.optim.Muon orthogonalises whole matrices; memfit sizes it unsharded",
                  rest="torch.optim.AdamW(foreach=True)"),
)

BY_NAME: dict[str, OptimizerKind] = {k.name: k for k in KINDS}


def kind_of(optimizer: Any) -> OptimizerKind:
    """The record of a memfit.setup.Optimizer (or its value)."""
    return BY_NAME[getattr(optimizer, "value", optimizer)]


def hf_optim_names() -> dict[str, str]:
    """TrainingArguments `optim` name -> memfit optimizer name, for the readers."""
    return {hf: k.name for k in KINDS for hf in k.hf_names}


def config_class_names() -> dict[str, str]:
    """Lower-case class path a config names -> memfit optimizer name, for the readers (torch AdamW excluded)."""
    return {path: k.name for k in KINDS for path in k.config_classes}
