"""What is trained: every weight (a full fine-tune), low-rank adapters on a frozen base (LoRA, peft) or adapters on a
quantized frozen base (QLoRA: peft + bitsandbytes 4-bit). A frozen value inside TrainingSetup; the numbers it
changes live in memfit.estimate.lora, the rung that proposes it in memfit.techniques.lora.

Defaults are the libraries' own: peft LoraConfig (r=8, lora_alpha=8, lora_dropout=0.0, target_modules chosen per
architecture by peft), bitsandbytes BitsAndBytesConfig as the QLoRA paper runs it (NF4, double quantization, bf16
compute). The base weights are stored in the training's compute dtype (transformers 5 loads `dtype="auto"`, the
checkpoint's bf16) unless told otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .choice import Choice
from .fields import Option, setting
from .units import DTYPE_BYTES


class Method(Choice):
    FULL = "full"  # every weight trained
    LORA = "lora"  # peft LoRA: frozen base in bf16/fp16/fp32, trainable A, B
    QLORA = "qlora"  # peft LoRA on a bitsandbytes 4-bit (NF4) base

    def aliases(self) -> tuple[str, ...]:
        return {"full": ("full-finetune", "fft", "none"), "lora": ("peft",), "qlora": ("q-lora",)}[self.value]

    @classmethod
    def label(cls) -> str:
        return "fine-tuning method"


class BaseWeights(Choice):
    """How the frozen base weights of a LoRA model are stored."""

    AUTO = "auto"  # LoRA: the compute dtype (bf16 / fp16, fp32 under fp32); QLoRA: nf4
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"  # bitsandbytes LLM.int8 (load_in_8bit)
    NF4 = "nf4"  # bitsandbytes 4-bit NormalFloat (load_in_4bit, bnb_4bit_quant_type="nf4")
    FP4 = "fp4"  # bitsandbytes 4-bit float

    def aliases(self) -> tuple[str, ...]:
        return {"bf16": ("bfloat16",), "fp16": ("float16", "half"), "fp32": ("float32",),
                "int8": ("8bit", "llm-int8"), "nf4": ("4bit",), "auto": ()}.get(self.value, ())

    @classmethod
    def label(cls) -> str:
        return "base weight storage"

    @property
    def quantized(self) -> bool:
        return self in (BaseWeights.INT8, BaseWeights.NF4, BaseWeights.FP4)

    @property
    def four_bit(self) -> bool:
        return self in (BaseWeights.NF4, BaseWeights.FP4)


class LoraRecipe(Choice):
    """Which library builds and trains the adapters: what it keeps in which dtype.

    - peft (the HF Trainer, TRL, axolotl, LLaMA-Factory): `get_peft_model(autocast_adapter_dtype=True)` upcasts the
      adapters to fp32 (peft/tuners/tuners_utils.py `cast_adapter_dtype`); on a quantized base
      `prepare_model_for_kbit_training` upcasts the other parameters (embeddings, norms, head) to fp32 and, with
      checkpointing, `enable_input_require_grads` makes the embedding output a tensor that needs a gradient; a 4-bit
      base is bitsandbytes' Linear4bit.
    - torchtune (`lora_finetune_single_device` / `_distributed`, torchtune 0.6 modules/peft/lora.py LoRALinear):
      adapters in the model's dtype, nothing upcast, no input gradient asked for (its checkpoint wrapper is
      non-reentrant); `quantize_base` stores every block Linear as torchao's NF4Tensor (FrozenNF4Linear /
      `linear_nf4`).
    """

    PEFT = "peft"
    TORCHTUNE = "torchtune"

    def aliases(self) -> tuple[str, ...]:
        return {"peft": ("hf", "transformers", "trl", "axolotl", "llamafactory"), "torchtune": ("tune",)}[self.value]

    @classmethod
    def label(cls) -> str:
        return "LoRA recipe"


TORCHTUNE_ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
"""torchtune's lora_attn_modules -> the module names of memfit's (Hugging Face) architectures (the reader reads it,
the emitter writes it back)."""
TORCHTUNE_MLP = ("gate_proj", "up_proj", "down_proj")
"""apply_lora_to_mlp: torchtune's w1 / w3 / w2 are these projections, adapted together."""

ALL_LINEAR = "all-linear"
"""peft's target_modules shortcut: every Linear except the output head."""


@dataclass(frozen=True)
class Finetune:
    """What the optimizer trains. `targets` () means peft's default for the architecture; ('all-linear',) every
    projection but the head. `modules_to_save`: modules trained in full beside the adapters (peft keeps a trainable
    copy and the frozen original). `dora`: weight-decomposed LoRA (a magnitude vector per adapted output and the
    weight norm it recomputes each forward: memfit.estimate.dora). `rslora`: rank-stabilized LoRA
    (Kalajdzievski 2023, arXiv:2312.03732; peft `use_rslora`) scales the update by alpha / sqrt(r) instead of
    alpha / r: a different float, the same tensors, so the same memory. `kbit_prep`: whether peft's
    `prepare_model_for_kbit_training` runs on a quantized base (None: the peft recipe's default, it does; False:
    Answer.AI's fsdp_qlora, LitGPT, axolotl, LLaMA-Factory and TRL's SFTTrainer from v0.27 (before: except under
    FSDP / ZeRO-3) keep the embeddings, norms and head in the compute dtype, so the residual stream is 16-bit)."""

    # The options' help is what `--help` shows; the fields are pinned together with --keep method (the setup's
    # `finetune` field), so none has a --keep name of its own.
    method: Method = setting(Method.FULL, section="finetune", label="method", option=Option(
        ("--method",), "What is trained: {choices} (LoRA: peft adapters on a frozen base; QLoRA: on a 4-bit "
        "bitsandbytes base). Default: full.", "choice", metavar="METHOD"))
    rank: int = setting(8, section="finetune", label="LoRA rank", option=Option(
        ("--lora-rank", "-r"), "LoRA rank (peft r). Default: {default}.", maximum=65_536, metavar="R"))
    alpha: float = setting(8.0, section="finetune", label="LoRA alpha", option=Option(
        ("--lora-alpha",), "LoRA alpha. Default: {default:g}.", "number", metavar="ALPHA"))
    dropout: float = setting(0.0, section="finetune", label="LoRA dropout", option=Option(
        ("--lora-dropout",), "LoRA dropout (a new copy of each adapter input and its mask when > 0). Default: "
        "{default:g}.", "fraction", metavar="P"))
    targets: tuple[str, ...] = setting((), section="finetune", label="LoRA targets", option=Option(
        ("--lora-targets",), "peft target_modules: a comma list of Linear names (q_proj,v_proj), or all-linear. "
        "Default: peft's per-architecture default.", "text", metavar="NAMES"))
    modules_to_save: tuple[str, ...] = setting((), section="finetune", label="modules to save", option=Option(
        ("--modules-to-save",), "peft modules_to_save: modules trained in full beside the adapters (e.g. "
        "lm_head,embed_tokens).", "text", metavar="NAMES"))
    base: BaseWeights = setting(BaseWeights.AUTO, section="finetune", label="base weights", option=Option(
        ("--base",), "How the frozen base weights are stored: {choices}. Default: the compute dtype for LoRA, nf4 "
        "for QLoRA.", "choice", metavar="STORAGE"))
    double_quant: bool = setting(True, section="finetune", label="double quantization", option=Option(
        ("--double-quant",), "QLoRA: quantize the 4-bit blocks' absmax too (bnb_4bit_use_double_quant). Default: "
        "on.", "flag"))
    rslora: bool = setting(False, section="finetune", label="rsLoRA", option=Option(
        ("--rslora",), "peft use_rslora: scale the update by alpha / sqrt(r). Changes no memory. Default: off.",
        "flag"))
    dora: bool = setting(False, section="finetune", label="DoRA", option=Option(
        ("--dora",), "peft use_dora: weight-decomposed LoRA (a magnitude vector per adapted Linear, the weight norm "
        "recomputed each forward). Default: off.", "flag"))
    recipe: LoraRecipe = setting(LoraRecipe.PEFT, section="finetune", label="LoRA recipe", option=Option(
        ("--lora-recipe",), "Which library trains the adapters: {choices} (peft: fp32 adapters, fp32 embeddings / "
        "norms / head on a quantized base; torchtune: everything in the model's dtype, torchao NF4 base). Default: "
        "peft.", "choice", metavar="RECIPE"))
    kbit_prep: bool | None = setting(None, section="finetune", label="k-bit preparation", option=Option(
        ("--kbit-prep",), "QLoRA under peft: whether prepare_model_for_kbit_training upcasts the embeddings, norms "
        "and head to fp32 (an fp32 residual stream). --no-kbit-prep: they stay in the compute dtype, as Answer.AI's "
        "fsdp_qlora, LitGPT, axolotl, LLaMA-Factory and TRL >= 0.27 run it. Default: on (peft's recipe).", "flag"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method.parse(self.method))
        object.__setattr__(self, "base", BaseWeights.parse(self.base))
        object.__setattr__(self, "recipe", LoraRecipe.parse(self.recipe))
        for name in ("targets", "modules_to_save"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(t.strip() for t in value.split(",") if t.strip())
            object.__setattr__(self, name, tuple(value))
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if not self.adapters:
            if self.rslora or self.dora:
                out.append(f"{'DoRA' if self.dora else 'rsLoRA'} shapes LoRA adapters: add --method lora (or qlora)")
            if self.recipe is not LoraRecipe.PEFT:
                out.append(f"the LoRA recipe '{self.recipe}' shapes LoRA adapters: add --method lora (or qlora)")
            if self.kbit_prep is not None:
                out.append("the k-bit preparation (--kbit-prep) applies to a quantized LoRA base: add --method "
                           "qlora")
            if self.base is not BaseWeights.AUTO:
                out.append(f"base weights '{self.base}' apply to LoRA/QLoRA; a full fine-tune trains (and stores) "
                           "every weight in the training precision")
            return out
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            out.append(f"LoRA rank must be a positive whole number, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            out.append(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            out.append(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.dora and self.base is BaseWeights.INT8:
            out.append("DoRA on an int8 base is not sized (peft's DoRA fails on a bitsandbytes int8 weight on CPU, "
                       "so it was not measured): use an nf4 / fp4 base, or plain LoRA on int8")
        if self.torchtune and self.base in (BaseWeights.INT8, BaseWeights.FP4):
            out.append(f"torchtune quantizes a LoRA base to torchao NF4 only (quantize_base): base {self.base} is "
                       "bitsandbytes', use --lora-recipe peft or base nf4")
        if self.torchtune and self.dora:
            out.append("torchtune's DoRALinear is not sized (its weight norm and saved tensors are its own): use "
                       "--lora-recipe peft for DoRA, or plain LoRA")
        if self.kbit_prep is not None and self.method is Method.LORA and not self.base.quantized:
            out.append("the k-bit preparation (--kbit-prep) applies to a quantized base: use --method qlora or "
                       "--base nf4 / fp4 / int8")
        if self.torchtune and self.kbit_prep:
            out.append("torchtune does not call peft's prepare_model_for_kbit_training (its norms, embeddings and "
                       "head stay in the recipe dtype): drop --kbit-prep or use --lora-recipe peft")
        if self.method is Method.QLORA and self.base in (BaseWeights.FP32, BaseWeights.BF16, BaseWeights.FP16):
            out.append(f"QLoRA quantizes the base: base weights {self.base} is plain LoRA (use --method lora), "
                       "or choose nf4 / fp4 / int8")
        return out

    @property
    def adapters(self) -> bool:
        """Whether LoRA adapters are trained on a frozen base."""
        return self.method is not Method.FULL

    @property
    def torchtune(self) -> bool:
        return self.recipe is LoraRecipe.TORCHTUNE

    def adapter_bytes(self, compute_dtype: str) -> int:
        """Bytes per adapter element: fp32 under peft (autocast_adapter_dtype), the model's dtype under torchtune."""
        return DTYPE_BYTES[compute_dtype if self.torchtune else "fp32"]

    def upcasts_unquantized(self) -> bool:
        """Whether the parameters a quantized base leaves unquantized (embeddings, norms, head) are held in fp32:
        peft's prepare_model_for_kbit_training does it (peft/utils/other.py: every fp16 / bf16 parameter but
        Params4bit -> fp32) unless the user's framework skips it (kbit_prep False); torchtune keeps the model's
        dtype."""
        return not self.torchtune and self.kbit_prep is not False

    def asks_input_gradient(self) -> bool:
        """Whether checkpointing makes the frozen embedding's output need a gradient (peft
        `enable_input_require_grads`, which the HF Trainer and prepare_model_for_kbit_training call); torchtune's
        non-reentrant checkpoint wrapper needs none."""
        return not self.torchtune

    def base_storage(self, compute_dtype: str) -> BaseWeights:
        """The storage of the frozen base weights, `auto` resolved (`compute_dtype`: the training's)."""
        if self.base is not BaseWeights.AUTO:
            return self.base
        if self.method is Method.QLORA:
            return BaseWeights.NF4
        return BaseWeights.parse(compute_dtype)

    def replace(self, **changes) -> "Finetune":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        if not self.adapters:
            return "full"
        text = f"{self.method} r={self.rank}"
        if self.base.quantized:
            text += f" {self.base}"
        return (text + (" DoRA" if self.dora else "") + (" (torchtune)" if self.torchtune else "")
                + (" no k-bit prep" if self.kbit_prep is False else ""))

    def to_dict(self) -> dict:
        return {"method": self.method.value, "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "modules_to_save": list(self.modules_to_save),
                "base": self.base.value, "double_quant": self.double_quant, "dora": self.dora,
                "rslora": self.rslora, "recipe": self.recipe.value,
                **({} if self.kbit_prep is None else {"kbit_prep": self.kbit_prep})}
