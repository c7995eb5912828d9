"""torch.compile: what a compiled transformer block keeps for backward, as the real partitioner decides it.

The bytes come from AOTAutograd's `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py, inductor's
default) run on one block of the model on fake tensors (memfit._torch.compiled): the forward graph's saved outputs,
views resolved to their storage. They are traced at memfit.derive's shapes and fitted like its eager fits, linear in
(tokens, tokens x seq, seq, 1) per group, checked on its held-out shape, and cached with memfit.derive's cache under
the kind `compile-<dtype>/<attention>/<kernels>`.

What memfit assumes: each block compiled on its own (torchtune `training.compile_model`, torchtitan `apply_compile`).
What compile does not change here: parameters, gradients, optimizer state; the embedding, final norm, LM head and
the loss stay eager (but torchtune's chunked loss, which torchtune compiles with the model: memfit.estimate.
compiled_loss); the backward temporaries of a block are eager's (a compiled
backward recomputes the pointwise chains it did not save, into fused kernels: measured on CPU, no more than eager's).
Under autocast the compiled graph casts each weight itself: the casts it saves are in the block's bytes, so the
autocast cache term only holds the LM head's copy.
"""

from __future__ import annotations

from typing import Any

from ..derive.model import GROUPS, Linear, setup_kind
from ..errors import ConfigError
from ..setup import TrainingSetup
from . import fits

SOURCE = "torch/_functorch/partitioners.py min_cut_rematerialization_partition, traced on fake tensors"
KIND_PREFIX = "compile-"
NOTE = ("torch.compile per block: each block keeps what AOTAutograd's min-cut partitioner saves (traced on fake "
        "tensors); embedding, LM head and loss eager (torchtune's chunked loss compiled with the model: "
        "memfit.estimate.compiled_loss); backward temporaries sized as eager's")


def compiled_kind(setup: TrainingSetup, on_cpu: bool) -> str:
    return KIND_PREFIX + setup_kind(setup, on_cpu)


def layer_saved_bytes(spec, setup: TrainingSetup, tokens: int, seq_len: int, on_cpu: bool) -> dict[str, int]:
    """Bytes one compiled block keeps for backward, by group (attention / mlp / norms, see _torch.compiled); eager's
    where the block is not traced (`unsized`): the partitioner saves no more than eager autograd in every block
    bench/compile.py measures, so eager's bytes are an upper bound there."""
    from . import activations as act

    if unsized(spec, setup):
        return act.layer_saved_bytes(spec, setup, tokens, seq_len, on_cpu)
    fit = block_fit(model_config(spec), compiled_kind(setup, on_cpu))
    return {g: max(0, fit[g](tokens, seq_len)) for g in GROUPS}


def unsized(spec, setup: TrainingSetup) -> str:
    """Why a compiled block is sized as eager ('' when it is traced)."""
    from . import moe

    if setup.finetune.adapters:
        return "the traced block carries no LoRA adapters"
    if moe.has_experts(spec):  # the graph's, not the MoE formulas' applicability (a bf16 Mixtral is derived)
        return "routed experts are not traced compiled"
    if setup.tp > 1:
        return "the traced block is unsharded (tp 1)"
    try:
        model_config(spec)
    except ConfigError as error:
        return str(error)
    return ""


def model_config(spec) -> dict[str, Any]:
    """The HF config the block is built from: the derived model's, the catalog's, a config.json's or the hub's
    (memfit.derive.compiled, registered: the config is the model layer's to read)."""
    return fits.compiled().model_config(spec)


def fit_ready(spec, setup: TrainingSetup, on_cpu: bool) -> bool:
    """Whether sizing `setup` compiled needs no trace now (shipped, cached on disk or in this process): the ladder
    proposes compile only then, so `memfit plan` never starts a compile trace the user did not ask for."""
    if unsized(spec, setup):
        return True
    return fits.compiled().fit_ready(model_config(spec), compiled_kind(setup, on_cpu))


def block_fit(config: dict[str, Any], kind: str) -> dict[str, Linear]:
    """The fitted lines of `kind` for `config`: from this process, the shipped data, the disk cache or traced now
    (memfit.derive.compiled, registered)."""
    return fits.compiled().block_fit(config, kind)


def notes(spec, setup: TrainingSetup) -> tuple[str, ...]:
    if not setup.compile:
        return ()
    why = unsized(spec, setup)
    return (f"torch.compile sized as eager ({why}): an upper bound",) if why else (NOTE,)
