"""Block swap (kohya sd-scripts / musubi-tuner `--blocks_to_swap N`): N blocks' weights live in host RAM and trade
places with blocks on the GPU around each block's forward and backward.

What kohya's code does (sd-scripts library/custom_offloading_utils.py, ModelOffloader; flux_models.py and
sd3_models.py `enable_block_swap`):
- which blocks: Flux swaps N // 2 double-stream blocks and (N - N // 2) x 2 single-stream blocks (at most
  num_layers - 2 and num_single_layers - 2 of them: N <= 35 for FLUX.1); SD3 swaps N of its joint blocks (at most
  num_layers - 2). The swapped ones are the last blocks of each list (`prepare_block_devices_before_forward`).
- what moves: only each submodule's `.weight` (`weighs_to_device`, `swap_weight_devices_cuda`); biases, buffers and
  everything outside the blocks stay on the GPU, and so do kohya's LoRA modules (the network is its own module).
- no extra GPU buffer: a swap copies the outgoing block's weights to the host (`.to("cpu")`) and the incoming
  block's weights into the GPU storage just freed (`cuda_data_view.copy_(...)`), so the GPU always holds the
  weights of the blocks not swapped, and nothing else moves.
So the step loses, at every moment, the swapped blocks' weights (a constant: the peak's moment is unchanged) and
host RAM holds them. Counted here: the nn.Linear weights of those blocks in their stored dtype (bf16, or fp8 with
the fp8 base), built on the meta device from the denoiser's config (kohya's Flux norms keep their `scale`, not a
`weight`, on the GPU; the few norm weights of diffusers' blocks are left out likewise). SDXL's UNet and an NF4 base
have no block swap in kohya's scripts and are refused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from ..estimate.result import MemoryEstimate
from ..estimate.terms import TermKey
from ..setup import TrainingSetup
from .model import weight_dtype
from .presets import DiffusionModel

STORED_BYTES = {"bf16": None, "fp8": 1}
"""Bytes per stored weight element by base dtype (None: the precision's weight dtype)."""


@dataclass(frozen=True)
class BlockSwap:
    blocks: int
    """--blocks_to_swap as given."""
    swapped: tuple[tuple[str, int], ...]
    """(block list, how many of its blocks live on the host)."""
    host_bytes: int
    """The swapped blocks' weights: off the GPU, in host RAM."""

    def apply(self, memory: MemoryEstimate) -> MemoryEstimate:
        """The step with the swapped weights off the GPU (the parameters term less them) and on the host."""
        done = False
        terms = []
        for term in memory.terms:
            if term.name is TermKey.PARAMETERS and not done:
                if term.num_bytes < self.host_bytes:
                    raise ConfigError("block swap: the swapped weights exceed the step's parameters (a model memfit "
                                      "cannot split by block)")
                term = dataclasses.replace(term, num_bytes=term.num_bytes - self.host_bytes, source=(
                    f"{term.source}; less {self.host_bytes:,} B of weights swapped to the host "
                    f"({self.describe()})"))
                done = True
            terms.append(term)
        return dataclasses.replace(memory, terms=tuple(terms), cpu_bytes=memory.cpu_bytes + self.host_bytes)

    def describe(self) -> str:
        return ", ".join(f"{n} of the {name}" for name, n in self.swapped if n)


def _swapped(model: DiffusionModel, blocks: int) -> tuple[tuple[str, str, int], ...]:
    """(ModuleList attribute, label, count) per block list, as kohya's enable_block_swap splits N."""
    config = model.denoiser.config
    if model.family == "flux":
        double, single = blocks // 2, (blocks - blocks // 2) * 2
        most = (int(config.get("num_layers", 19)) - 2, int(config.get("num_single_layers", 38)) - 2)
        if double > most[0] or single > most[1]:
            top = next(n for n in range(blocks, -1, -1) if n // 2 <= most[0] and (n - n // 2) * 2 <= most[1])
            raise ConfigError(f"--blocks-to-swap {blocks}: kohya swaps N // 2 double and (N - N // 2) x 2 single "
                              f"blocks, at most {most[0]} and {most[1]}: N <= {top} for this model")
        return (("transformer_blocks", "double-stream blocks", double),
                ("single_transformer_blocks", "single-stream blocks", single))
    if model.family == "sd3":
        most = int(config.get("num_layers", 24)) - 2
        if blocks > most:
            raise ConfigError(f"--blocks-to-swap {blocks}: kohya swaps at most num_layers - 2 = {most} SD3 blocks")
        return (("transformer_blocks", "joint blocks", blocks),)
    raise ConfigError(f"--blocks-to-swap: kohya's block swap is for Flux and SD3 transformers, not {model.family}")


def most_blocks(model: DiffusionModel) -> int:
    """The largest --blocks_to_swap kohya accepts for this denoiser (0: no block swap)."""
    config = model.denoiser.config
    if model.family == "flux":
        double, single = int(config.get("num_layers", 19)) - 2, int(config.get("num_single_layers", 38)) - 2
        return max((n for n in range(0, 2 * (double + single) + 1) if n // 2 <= double and (n - n // 2) * 2 <= single),
                   default=0)
    if model.family == "sd3":
        return max(0, int(config.get("num_layers", 24)) - 2)
    return 0


def linear_weights(model: DiffusionModel, attribute: str, count: int) -> int:
    """Elements of the nn.Linear weights in the last `count` blocks of `attribute`, built on the meta device."""
    import diffusers  # optional dependencies: imported when a swap is sized
    import torch

    with torch.device("meta"):
        net = getattr(diffusers, model.denoiser.cls).from_config(model.denoiser.config)
    blocks = list(getattr(net, attribute))
    return sum(m.weight.numel() for block in blocks[len(blocks) - count:] for m in block.modules()
               if isinstance(m, torch.nn.Linear)) if count else 0


def block_swap(model: DiffusionModel, setup: TrainingSetup, blocks: int, base_dtype: str) -> BlockSwap:
    """The host / GPU split of kohya's --blocks_to_swap `blocks` (see the module docstring)."""
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        raise ConfigError(f"--blocks-to-swap is a whole number of blocks, got {blocks!r}")
    if base_dtype == "nf4":
        raise ConfigError("--blocks-to-swap with an nf4 base: kohya's block swap moves plain weights, not "
                          "bitsandbytes' packed ones (use bf16 or fp8)")
    if setup.finetune.method.value == "full":
        raise ConfigError("--blocks-to-swap is sized for LoRA (a full fine-tune's swapped blocks carry gradients "
                          "and optimizer states kohya handles apart)")
    split = _swapped(model, blocks)
    per = STORED_BYTES[base_dtype] or weight_dtype(setup).itemsize
    host = sum(linear_weights(model, attribute, n) for attribute, _, n in split) * per
    return BlockSwap(blocks, tuple((label, n) for _, label, n in split), host)
