"""The moments of a training step of an encoder-decoder or vision model at full depth, from memfit.derive.stacks'
fit; the estimator (memfit.estimate.analytic) takes them in place of its one-stack moments for these models.

Every moment of the traced base copy (one block per stack) is shifted by the blocks it lacks: while a stack's
backward has not reached them they hold what they saved in forward; once it has, their gradients. Inside a block's
backward both ends of the stack are moments (the first block of the stack to run backward, with its siblings'
tensors alive, and the last, with their gradients made); in between the bytes are linear in the block index.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ConfigError
from .stacks import STACK_KEYS, VISION, StackFit, applies, depths, kind_of, patch_size, shape_of

FORMAT = 1


class StackedModel:
    """Attached to a ModelSpec (`spec.derived`) of a T5 / BART / ViT / DINOv2 config: the fits of the kinds asked
    for so far, each derived on first use (then from memfit's shipped data or the disk cache)."""

    stacked = True

    def __init__(self, config: dict[str, Any], *, label: str = "") -> None:
        self.config = dict(config)
        self.label = label or str(config.get("model_type", "model"))
        self._fits: dict[str, StackFit] = {}
        self.where: dict[str, str] = {}

    def fit(self, setup, on_cpu: bool = False) -> StackFit:
        kind = kind_of(setup, on_cpu)
        if kind not in self._fits:
            self._fits[kind], self.where[kind] = load_or_derive(self.config, kind, label=self.label)
        return self._fits[kind]

    def note(self) -> str:
        where = ", ".join(sorted(set(self.where.values()))) or "the derivation cache"
        return ("activations derived from traces of copies with 1 and 2 blocks per stack, each stack on its own "
                f"axis (memfit.derive.stacks), cached at {where}")


def load_or_derive(config: dict[str, Any], kind: str, *, label: str = "") -> tuple[StackFit, str]:
    from .cache import (cache_path, config_hash, failures_cached, library_versions, one_line_failure, read_json,
                        shipped_data, write_json)

    data = shipped_data(config, kind)
    if data is not None and "fit" in data:
        return StackFit.from_dict(data["fit"]), "memfit/data/derived (shipped)"
    path = cache_path(config, kind)
    data = read_json(path, path.stem)
    if data is not None and "fit" in data:
        try:
            return StackFit.from_dict(data["fit"]), str(path)
        except (KeyError, TypeError, ValueError):
            pass  # a corrupt entry: derive it again
    from .progress import reporting
    from .stacks import derive_stacks

    started = time.perf_counter()
    with (failures_cached(path, path.stem, kind=kind, model_type=config.get("model_type")),
          reporting(f"deriving {label or config.get('model_type')} ({kind})") as progress,
          one_line_failure(config, label)):
        fit = derive_stacks(config, kind, progress=progress)
    payload = {"key": path.stem, "format": FORMAT, "kind": kind, "model_type": config.get("model_type"),
               "config_hash": config_hash(config), "versions": library_versions(),
               "derive_seconds": round(time.perf_counter() - started, 3), "fit": fit.to_dict()}
    return fit, str(path) if write_json(path, payload) else "memory only (cache folder not writable)"


# ---- what the model takes ---------------------------------------------------------------------------------------

def check_inputs(spec, setup, *, seq_given: bool = False) -> None:
    """A ConfigError naming the fix where the setup gives an input the model does not take or lacks one it needs."""
    config = getattr(getattr(spec, "derived", None), "config", None) or {}
    model_type = config.get("model_type") if applies(config) else None
    name = spec.name
    if model_type in VISION:
        if setup.target_len:
            raise ConfigError(f"'{name}' is a vision model: it has no decoder, drop --target-len")
        if seq_given:
            raise ConfigError(f"'{name}' is a vision model: its tokens come from the image, give --image-size "
                              "instead of --seq")
        patch = patch_size(config)
        if setup.image_size and setup.image_size % patch:
            raise ConfigError(f"--image-size {setup.image_size} is not a multiple of '{name}''s patch size "
                              f"{patch}: use e.g. {max(patch, setup.image_size // patch * patch)}")
        return
    if setup.image_size:
        raise ConfigError(f"'{name}' takes no image: drop --image-size (it is for ViT / DINOv2 models)")
    if model_type is not None and not setup.target_len:
        raise ConfigError(f"'{name}' is an encoder-decoder: give the decoder length with --target-len (--seq is the "
                          "encoder's)")
    if model_type is None and setup.target_len:
        raise ConfigError(f"'{name}' has no decoder over a separate target: drop --target-len (it is for "
                          "encoder-decoders such as T5 and BART)")


def check_given(spec, given: dict[str, Any]) -> dict[str, Any]:
    """The user's setup fields checked against the model (memfit.api.typical_setup); a vision model's seq_len is
    set to its tokens per image (from image_size, else the config's), which is what its blocks run over."""
    from ..setup import TrainingSetup

    probe = TrainingSetup(target_len=given.get("target_len"), image_size=given.get("image_size"))
    check_inputs(spec, probe, seq_given="seq_len" in given)
    config = getattr(getattr(spec, "derived", None), "config", None) or {}
    if config.get("model_type") in VISION and applies(config):
        from .stacks import shape_of

        return {**given, "seq_len": shape_of(config, probe)[1]}
    return given


def is_stacked(spec, setup) -> bool:
    """Whether the estimator takes this module's moments (after checking the setup's inputs against the model)."""
    check_inputs(spec, setup)
    stacked = getattr(getattr(spec, "derived", None), "stacked", False)
    if stacked and spec.frozen:
        raise ConfigError(f"LoRA / QLoRA on '{spec.name}' (an encoder-decoder or vision model) is not sized yet: "
                          "use --method full, or `memfit trace`")
    if stacked and setup.tp > 1:
        raise ConfigError(f"tensor parallelism on '{spec.name}' (an encoder-decoder or vision model) is not sized "
                          "yet: use --tp 1, or `memfit trace`")
    return stacked


# ---- the moments ------------------------------------------------------------------------------------------------

def moments(spec, setup, static, step_temp: int, on_cpu: bool) -> dict:
    """name -> (Phase, terms), as memfit.estimate.analytic's `_moments` returns them."""
    from ..estimate.result import Phase
    from ..estimate.step_model import StepModel, static_terms
    from ..estimate.terms import TermKey

    config = spec.derived.config
    fit = spec.derived.fit(setup, on_cpu)
    shape, full = shape_of(config, setup), depths(config)
    saved = {s: max(0, fit.value(c, shape)) for s, c in fit.saved.items()}
    grads = {s: max(0, fit.value(c, shape)) for s, c in fit.grads.items()}
    unsharded = spec.num_params * (2 if setup.precision.param_dtype == "bf16" else 4)  # a gradient per parameter
    scale = static.grads_bytes / max(unsharded, 1)  # a sharded gradient partition holds its share of each
    early = static.grads_bytes if setup.grad_accum_steps > 1 or static.grads_preallocated else 0
    out: dict = {}
    for j, segment in enumerate(fit.segments):
        variants = [None] if segment["stack"] is None else ["first", "last"]
        for variant in variants:
            pending, done = _others(segment, variant, full)
            lines = segment
            if variant == "last" and segment["stack"] in fit.second and full[segment["stack"]] >= 2:
                lines = fit.second[segment["stack"]]  # traced with one sibling done: its leftovers are in there
                done[segment["stack"]] -= 1
            extra_acts = sum(pending[s] * saved[s] for s in pending)
            extra_grads = sum(done[s] * grads[s] for s in done)
            best = max(range(len(lines["acts"])), key=lambda k: fit.value(lines["acts"][k], shape)
                       + fit.value(lines["grads"][k], shape))
            live = max(0, fit.value(lines["acts"][best], shape))
            grads_now = max(early, int((fit.value(lines["grads"][best], shape) + extra_grads) * scale))
            terms = static_terms(spec, setup, static, grads_now, on_cpu) + _block_terms(pending, saved, full)
            terms.append(_term(TermKey.STEP, live, "the live tensors of a copy with one block per stack at this "
                               "moment: inputs, embeddings, its blocks' own, head, logits, loss, backward "
                               "temporaries (fitted from traces)"))
            label = _label(segment, variant, j)
            out[label] = (Phase.FORWARD if segment["phase"] == "forward" else Phase.BACKWARD, terms)
    step = StepModel.for_static(spec, setup, static, on_cpu)
    out["optimizer step"] = (Phase.OPTIMIZER, step.optimizer_step(step_temp))
    return out


def _others(segment: dict[str, Any], variant: str | None, full: dict[str, int]) -> tuple[dict, dict]:
    """Blocks beyond the base copy's, per stack: (still holding their saved tensors, holding their gradients)."""
    pending, done = {}, {}
    for stack, depth in full.items():
        extra = depth - 1
        if stack == segment["stack"]:
            (pending if variant == "first" else done)[stack] = extra
        elif stack in segment["done"]:
            done[stack] = extra
        else:
            pending[stack] = extra
    return pending, done


def _block_terms(pending: dict[str, int], saved: dict[str, int], full: dict[str, int]) -> list:
    from ..estimate.terms import stack_blocks

    return [_term(stack_blocks(stack), count * saved[stack],
                  f"{count} of {full[stack]} {stack} blocks x {saved[stack]:,} B saved per block (fitted: one more "
                  "block in a traced copy)") for stack, count in pending.items() if count]


def _term(name: str, num_bytes: int, formula: str):
    from ..estimate.result import Category, Term

    return Term(name, Category.ACTIVATIONS, int(num_bytes), formula, "memfit.derive.stacks")


def _label(segment: dict[str, Any], variant: str | None, index: int) -> str:
    if segment["phase"] == "forward":
        return "forward end (loss)"
    if segment["stack"] is None:
        after = segment["done"][-1] if segment["done"] else None
        return f"backward after the {after} blocks" if after else "backward of the head and loss"
    which = "its first" if variant == "first" else "its last"
    return f"{segment['stack']} block backward ({which} block)"


__all__ = ["STACK_KEYS", "StackedModel", "check_given", "check_inputs", "is_stacked", "moments"]
