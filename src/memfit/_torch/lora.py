"""LoRA / QLoRA on a live model, in place (memfit.apply): the base stored as planned (bf16 / fp16 / fp32, or
bitsandbytes 4-bit / 8-bit Linears), then peft adapters injected, kept in fp32. torch, peft and bitsandbytes are
imported here only.

torchtune's recipe (memfit.finetune.LoraRecipe) is built from the same libraries: peft's adapters kept in the model's
dtype (its autocast_adapter_dtype=False), nothing upcast, no input gradient asked for, and a 4-bit base of torchao's
own NF4Tensor on every block Linear (torchtune's FrozenNF4Linear / LoRALinear(quantize_base=True) store exactly that
and run F.linear through torchao's linear_nf4). torchtune's LoRALinear.forward (modules/peft/lora.py, 0.6) computes
linear(x) + (alpha / r) * lora_b(lora_a(dropout(x))): the ops and saved tensors of peft's lora.Linear when no cast is
needed. torchtune itself is not imported: 0.6 imports torchao.dtypes.nf4tensor, which torchao 0.18 moved."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..estimate.fsdp2 import fsdp2_shards
from ..estimate.lora import PEFT_DEFAULT_TARGETS
from ..finetune import ALL_LINEAR, BaseWeights
from ..setup import TrainingSetup
from .fake_quant import FakeLinear4bit

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def apply_adapters(model: nn.Module, setup: TrainingSetup) -> tuple[bool, str]:
    """(changed, detail) of turning `model` into the planned LoRA / QLoRA model in place. A real model is
    quantized first, so that peft wraps bitsandbytes' layers with its own bnb LoRA layers; a fake one (a trace)
    gets its adapters on the plain Linears, then the bases become FakeLinear4bit (bitsandbytes needs values)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        return False, "peft is not installed (pip install peft): the adapters were not added"
    if any("lora_A" in name for name, _ in model.named_modules()):
        return False, "the model already has LoRA adapters"
    ft = setup.finetune
    base = ft.base_storage(setup.precision.compute_dtype)
    fake = any(_is_fake(p) for p in model.parameters())
    targets = _targets(model, ft)
    done = []
    if base.quantized and not fake:
        done.append(_quantize(model, setup, base, fake))
    config = LoraConfig(r=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout, target_modules=targets,
                        modules_to_save=list(ft.modules_to_save) or None, use_dora=ft.dora, use_rslora=ft.rslora,
                        bias="none")
    try:
        with _adapters_stay_where_made(model):
            inject_adapter_in_model(config, model)
    except ValueError as error:
        raise ConfigError(f"peft could not add LoRA adapters: {str(error).splitlines()[0]}") from None
    adapter_dtype = torch.float32 if ft.adapter_bytes(setup.precision.compute_dtype) == 4 else \
        _DTYPES[setup.precision.compute_dtype]  # torchtune: the model's dtype
    for name, param in model.named_parameters():
        if "lora_" in name and param.dtype != adapter_dtype:
            param.data = param.data.to(adapter_dtype)  # get_peft_model(autocast_adapter_dtype=True) does this
    if base.quantized and fake:
        done.append(_quantize(model, setup, base, fake))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    done.append(f"LoRA r={ft.rank} on {targets if isinstance(targets, str) else ', '.join(targets)} "
                f"(peft.inject_adapter_in_model): {trainable:,} trainable of {total:,} parameters, adapters "
                f"{str(adapter_dtype).removeprefix('torch.')}")
    if setup.checkpointing.value == "full" and ft.asks_input_gradient() and hasattr(model,
                                                                                    "enable_input_require_grads"):
        model.enable_input_require_grads()
        done.append("enable_input_require_grads (checkpointing with a frozen embedding)")
    return True, "; ".join(done)


def _quantize(model: nn.Module, setup: TrainingSetup, base: BaseWeights, fake: bool) -> str:
    """The planned base quantization of `model`'s Linears (torchao NF4 for torchtune's recipe, else bitsandbytes or
    FakeLinear4bit on fake tensors) and the rest cast as peft's kbit preparation leaves it; what it did, in words."""
    ft = setup.finetune
    if ft.torchtune:
        count = quantize_torchao_nf4(model, _DTYPES[setup.precision.compute_dtype])
        return f"{count} Linears stored as torchao NF4Tensor (torchtune quantize_base)"
    storage = torch.bfloat16 if fsdp2_shards(setup) else torch.uint8  # what memfit emits for FSDP-QLoRA
    count = quantize_linears(model, base, ft.double_quant, _DTYPES[setup.precision.compute_dtype], storage)
    done = (f"{count} Linears quantized to {base}{' (double quantization)' if ft.double_quant else ''}"
            + (" (FakeLinear4bit: bitsandbytes' storage and transients on fake tensors)" if fake else ""))
    # peft prepare_model_for_kbit_training: the rest (embeddings, norms, head) in fp32; without it (kbit_prep
    # False) the rest stays in the compute dtype from_pretrained(dtype=...) loads it in
    upcast = ft.upcasts_unquantized()
    target = torch.float32 if upcast else _DTYPES[setup.precision.compute_dtype]
    cast = (torch.float16, torch.bfloat16) if upcast else (torch.float16, torch.bfloat16, torch.float32)
    for param in model.parameters():
        if type(param).__name__ == "Params4bit":
            continue  # a bf16 quant_storage holds packed bytes, which peft leaves alone too
        if param.dtype in cast and param.dtype != target and "lora_" not in _name_of(model, param):
            param.data = param.data.to(target)
    return done


def _name_of(model: nn.Module, param) -> str:
    return next((name for name, p in model.named_parameters() if p is param), "")


def _targets(model: nn.Module, ft) -> list[str] | str:
    if ft.targets == (ALL_LINEAR,):
        return _all_linear(model)
    if ft.targets:
        return list(ft.targets)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULT_TARGETS:
        return list(PEFT_DEFAULT_TARGETS[model_type])
    return _all_linear(model)


def _all_linear(model: nn.Module) -> list[str]:
    """peft's 'all-linear', resolved here (peft resolves it only on models it can inspect for quantization): every
    Linear (GPT-2's Conv1D too) but the output head, by module name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if module is not head and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")}
    return sorted(names)


def unpacked_linears(model: nn.Module) -> list[nn.Module]:
    """The nn.Linear modules (exactly that type) transformers' bitsandbytes loader leaves unpacked, and the adapters:
    Bnb4BitHfQuantizer / Bnb8BitHfQuantizer `_process_model_before_weight_loading` (transformers 5.x) skip every
    module `should_convert_module` matches against `get_keys_to_not_convert(model)` (tied weights, the output
    embeddings, the last parameter's module) and the model's `_keep_in_fp32_modules` (T5's wo). A module peft wrapped
    is matched by its own name (without `.base_layer`): the loader ran before the adapters. Not an HF model: only
    its output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip: list[str] | None = None
    if hasattr(model, "all_tied_weights_keys"):
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module

        skip = list(get_keys_to_not_convert(model))
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            skip += list(getattr(model, attr, None) or ())
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        adapter = ".lora_" in f".{name}"
        own = name.replace(".base_layer", "")
        if adapter or module is head or (skip is not None and not should_convert_module(own, skip)):
            out.append(module)
    return out


def quantize_linears(model: nn.Module, base: BaseWeights, double_quant: bool, compute_dtype: torch.dtype,
                     quant_storage: torch.dtype = torch.uint8) -> int:
    """Replace every nn.Linear but the output head by its bitsandbytes quantized form, in place (what
    from_pretrained(quantization_config=BitsAndBytesConfig(...)) does at load time). `quant_storage`: the packed
    4-bit weight's dtype (bf16 for FSDP-QLoRA, bnb_4bit_quant_storage)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("a quantized base needs bitsandbytes: pip install bitsandbytes") from None
    kept = set(map(id, unpacked_linears(model)))
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in kept:
                continue
            device = child.weight.device
            if _is_fake(child.weight):
                if not base.four_bit:
                    raise ConfigError("memfit trace emulates bitsandbytes 4-bit on fake tensors, not int8: size "
                                      "an int8 base with the formulas or `memfit measure`")
                setattr(parent, name, FakeLinear4bit(child.in_features, child.out_features,
                                                     bias=child.bias is not None, compute_dtype=compute_dtype,
                                                     double_quant=double_quant, device=device))
                count += 1
                continue
            weight = child.weight.data.to(compute_dtype)
            if base.four_bit:
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                        compute_dtype=compute_dtype, quant_type=base.value,
                                        compress_statistics=double_quant, quant_storage=quant_storage,
                                        device="meta")
                new.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type=base.value,
                                               compress_statistics=double_quant, blocksize=64,
                                               quant_storage=quant_storage, module=new)
                # module=: the layer keeps the QuantState too, which bitsandbytes restores from when FSDP2 swaps
                # in a plain all-gathered tensor (fix_4bit_weight_quant_state_from_module)
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                          has_fp16_weights=False, device="meta")
                new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                new.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(parent, name, new.to(device))
            count += 1
    return count


def quantize_torchao_nf4(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Store every nn.Linear weight but the output head's as torchao's NF4Tensor (to_nf4: block 64, scaler block
    256), frozen, in place: what torchtune's quantize_base builds. On fake tensors to_nf4 runs as is (the trace's
    bytes are NF4Tensor's own inner tensors)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4  # torchao < 0.15
        except ImportError:
            raise ConfigError("torchtune's 4-bit base needs torchao: pip install torchao") from None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    count = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module is head or "lora_" in name:
            continue
        weight = module.weight.data.to(compute_dtype)
        module.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        if module.bias is not None:
            module.bias = nn.Parameter(module.bias.data.to(compute_dtype), requires_grad=False)
        count += 1
    return count


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or isinstance(getattr(tensor, "data", None), FakeTensor)


def base_dtype(setup: TrainingSetup) -> torch.dtype:
    """The dtype a LoRA model's base is built in: its storage dtype, or the compute dtype it is quantized from."""
    base = setup.finetune.base_storage(setup.precision.compute_dtype)
    return _DTYPES[setup.precision.compute_dtype if base.quantized else base.value]


class _adapters_stay_where_made:
    """On fake tensors (memfit.trace): peft moves each new adapter to its base layer's device and float dtype with
    Module.to, which swaps parameter objects on fake tensors and fails; the adapters are made on the base's (fake)
    CPU device already and stay in fp32, as get_peft_model's autocast_adapter_dtype keeps them anyway."""

    def __init__(self, model: nn.Module) -> None:
        self.fake = any(_is_fake(p) for p in model.parameters())

    def __enter__(self):
        if self.fake:
            self.original = nn.Module.to
            original = self.original

            def to(module, *args, **kwargs):
                params = list(module.parameters())
                if params and all(_is_fake(p) for p in params):
                    return module
                return original(module, *args, **kwargs)

            nn.Module.to = to
        return self

    def __exit__(self, *exc):
        if self.fake:
            nn.Module.to = self.original
        return False
