"""memfit.derive for models with several stacks of blocks, each on its own axis (T5 / BART: an encoder over the
source, a decoder over the target), or with a token count fixed by the input (ViT / DINOv2: patches of an image).

For one setup kind (dtype, attention, kernels, checkpointing on or off), a copy with one block per stack and copies
with one more block in one stack are traced (forward and backward, memfit's own step, on fake tensors) at a dozen
small shapes, varying the axes independently: (micro-batch, source, target) for encoder-decoders, (micro-batch, image
side) for vision models. Fitted linearly in the products of those axes (terms listed in BASIS):

- per stack, what one more block keeps from forward to backward (`saved`) and the gradients it adds (`grads`);
- the base copy's live bytes (non-static, gradients apart) at every moment from the end of its last block's forward
  to the end of backward, in segments between the blocks' backward passes (`segments`).

At full depth every moment of the base copy is shifted by the blocks it lacks: those whose backward has not run yet
still hold their saved tensors, those done hold their gradients (memfit.derive.stacks_estimate). The fit is checked
on held-out shapes; a model whose memory is not linear in these terms is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ModelSourceError

STACK_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "t5": (("encoder", "num_layers"), ("decoder", "num_decoder_layers")),
    "bart": (("encoder", "encoder_layers"), ("decoder", "decoder_layers")),
    "vit": (("encoder", "num_hidden_layers"),),
    "dinov2": (("encoder", "num_hidden_layers"),),
}
"""The families sized here: (stack, config key of its depth), in forward order."""
VISION = ("vit", "dinov2")

# shapes: (micro-batch, source, target) or (micro-batch, image side in patches); micro-batches of 2 or more (at 1
# some reshapes are views where they are copies otherwise)
SEQ2SEQ_SHAPES = ((2, 8, 8), (3, 8, 8), (2, 16, 8), (2, 8, 16), (3, 16, 24), (2, 24, 16), (4, 16, 16), (3, 24, 8),
                  (2, 32, 24), (4, 8, 24), (3, 32, 16), (2, 16, 32), (4, 24, 32), (5, 16, 8))
SEQ2SEQ_CHECK = ((5, 40, 20), (3, 20, 40))
VISION_SHAPES = ((2, 2), (3, 2), (2, 3), (4, 3), (3, 4), (2, 5), (4, 5), (3, 6))
VISION_CHECK = ((5, 7), (2, 8))
TOLERANCE = 2e-3
"""Relative error allowed on a held-out shape (plus a few hundred bytes for scalars)."""


def applies(config: dict[str, Any] | None) -> bool:
    return bool(config) and config.get("model_type") in STACK_KEYS


def basis(model_type: str, shape: tuple[int, ...]) -> list[int]:
    """The products a quantity is linear in. Encoder-decoders: B x S and B x T (tokens), B x S x S and B x T x T
    (self-attention scores), B x T x S (cross-attention scores), S x S, T x T, T x S (T5's relative position bias,
    one per stack, not per sequence), S, T, B (the loss's per-sequence scalars) and 1. Vision: B x N, B x N x N, N,
    N x N, B, 1 with N the tokens per image."""
    if model_type in VISION:
        b, n = shape
        return [b * n, b * n * n, n, n * n, b, 1]
    b, s, t = shape
    return [b * s, b * t, b * s * s, b * t * t, b * t * s, s * s, t * t, t * s, s, t, b, 1]


def patch_size(config: dict[str, Any]) -> int:
    patch = config.get("patch_size", 16)
    return int(patch if isinstance(patch, int) else patch[0])


def tokens_per_image(config: dict[str, Any], image_size: int) -> int:
    """(image / patch)^2 patches + CLS (+ DINOv2's register tokens): transformers ViTEmbeddings / Dinov2Embeddings."""
    side = image_size // patch_size(config)
    return side * side + 1 + int(config.get("num_register_tokens", 0) or 0)


def shape_of(config: dict[str, Any], setup) -> tuple[int, ...]:
    """The setup's point on the fit's axes."""
    if config.get("model_type") in VISION:
        size = setup.image_size or _config_image_size(config)
        return setup.micro_batch_size, tokens_per_image(config, size)
    return setup.micro_batch_size, setup.seq_len, setup.target_len


def _config_image_size(config: dict[str, Any]) -> int:
    size = config.get("image_size", 224)
    return int(size if isinstance(size, int) else size[0])


def depths(config: dict[str, Any]) -> dict[str, int]:
    """Blocks per stack at full depth (a T5 without num_decoder_layers has as many as its encoder)."""
    keys = STACK_KEYS[config["model_type"]]
    out = {}
    for stack, key in keys:
        value = config.get(key)
        out[stack] = int(value) if value else out.get("encoder", 0)
    return out


def copy_config(config: dict[str, Any], layers: dict[str, int], shape: tuple[int, ...] | None = None) -> dict:
    """The config with `layers` blocks per stack (a vision model also at the shape's image side)."""
    out = copy.deepcopy(dict(config))
    for stack, key in STACK_KEYS[config["model_type"]]:
        out[key] = layers[stack]
    if config["model_type"] in VISION and shape is not None:
        out["image_size"] = shape[1] * patch_size(config)
    return out


def kind_of(setup, on_cpu: bool) -> str:
    """memfit.derive's kind (dtypes, attention, kernels) and whether blocks are checkpointed: with checkpointing a
    block keeps only its inputs and rebuilds the rest in its backward, another timeline."""
    from ..setup import Checkpointing
    from .model import setup_kind

    mode = setup.checkpointing
    if mode not in (Checkpointing.NONE, Checkpointing.FULL):
        raise ConfigError(f"checkpointing {mode} is not sized for encoder-decoder / vision models yet: use "
                          "--checkpointing full or none (or `memfit trace`)")
    return f"{setup_kind(setup, on_cpu)}/{'ckpt' if mode is Checkpointing.FULL else 'nockpt'}"


@dataclass(frozen=True)
class StackFit:
    """One kind's coefficients (each a list over `basis`)."""

    kind: str
    model_type: str
    saved: dict[str, list[float]]
    grads: dict[str, list[float]]
    segments: list[dict[str, Any]]
    """In time order: {"stack": name or None (between blocks), "acts": [[coef]...], "grads": [[coef]...]}, one line
    per moment (or one for the segment's peak when the shapes changed its number of moments)."""
    second: dict[str, dict[str, list]] = field(default_factory=dict)
    """Checkpointed kinds: per stack, the lines of the backward of a stack's second block (one sibling done),
    from a copy with two blocks in that stack. A checkpointed block's input is the block before's output, so a
    finished block leaves more behind than its gradients until the next one is done."""
    fit_error: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model_type": self.model_type, "saved": self.saved, "grads": self.grads,
                "segments": self.segments, "second": self.second, "fit_error": self.fit_error,
                "versions": self.versions}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StackFit":
        return cls(kind=str(data["kind"]), model_type=str(data["model_type"]), saved=dict(data["saved"]),
                   grads=dict(data["grads"]), segments=list(data["segments"]), second=dict(data.get("second", {})),
                   fit_error=float(data.get("fit_error", 0.0)), versions=dict(data.get("versions", {})))

    def value(self, coef: list[float], shape: tuple[int, ...]) -> int:
        return int(round(sum(c * x for c, x in zip(coef, basis(self.model_type, shape)))))


def derive_stacks(config: dict[str, Any], kind: str, *, progress=None) -> StackFit:
    """Trace the copies at every fit and check shape under `kind`, fit, check on the held-out shapes."""
    import numpy

    from .fit import versions
    from .stacks_trace import trace_copies

    model_type = config["model_type"]
    vision = model_type in VISION
    fit_shapes = VISION_SHAPES if vision else SEQ2SEQ_SHAPES
    shapes = list(fit_shapes) + list(VISION_CHECK if vision else SEQ2SEQ_CHECK)
    runs, models = [], {}
    for i, shape in enumerate(shapes):
        if progress is not None:
            progress(f"shape {shape}", i / len(shapes))
        runs.append(trace_copies(config, kind, shape, models))
    # the fit's axes: a vision shape (micro-batch, image side in patches) is (micro-batch, tokens per image)
    points = [(s[0], tokens_per_image(config, s[1] * patch_size(config))) if vision else s for s in shapes]
    rows = numpy.array([basis(model_type, s) for s in points[:len(fit_shapes)]], dtype=float)

    def fit(values: list[int]) -> list[float]:
        coef, *_ = numpy.linalg.lstsq(rows, numpy.array(values[:len(fit_shapes)], dtype=float), rcond=None)
        return [float(c) for c in coef]

    def consistent(values: list[int], coef: list[float]) -> bool:
        """The line goes through every fit shape (there are more shapes than terms)."""
        residual = rows @ numpy.array(coef) - numpy.array(values[:len(fit_shapes)], dtype=float)
        return float(numpy.abs(residual).max()) <= 1e-5 * max(1, max(abs(v) for v in values)) + 64

    stacks = [s for s, _ in STACK_KEYS[model_type]]
    saved = {s: fit([r["saved"][s] for r in runs]) for s in stacks}
    grads = {s: fit([r["grads"][s] for r in runs]) for s in stacks}
    segments = []
    for j, first in enumerate(runs[0]["segments"]):
        acts, grad = _fit_moments([r["segments"][j] for r in runs], fit, consistent, f"backward segment {j}",
                                  model_type, points)
        segments.append({"stack": first["stack"], "phase": first["phase"], "done": first["done"], "acts": acts,
                         "grads": grad})
    second = {stack: dict(zip(("acts", "grads"), _fit_moments(
        [r["second"][stack] for r in runs], fit, consistent, f"the second {stack} block's backward", model_type,
        points))) for stack in runs[0].get("second", {})}
    result = StackFit(kind=kind, model_type=model_type, saved=saved, grads=grads, segments=segments,
                      second=second, versions=versions())
    worst = max(_check(result, point, run) for point, run in zip(points[len(fit_shapes):], runs[len(fit_shapes):]))
    return StackFit(**{**result.__dict__, "fit_error": worst})


def _fit_moments(windows: list[dict[str, list[int]]], fit, consistent, what: str, model_type: str,
                 points: list) -> tuple[list, list]:
    """Lines for one window's moments (one window per traced shape): the window's peak moment, and (where every
    shape has as many moments) each moment on its own; a line is kept only where it goes through every fit shape
    (frees can come in another order at another shape), then only those that are ever the window's largest."""
    peaks = [max(range(len(w["acts"])), key=lambda k, w=w: w["acts"][k] + w["grads"][k]) for w in windows]
    candidates = [([w["acts"][k] for w, k in zip(windows, peaks)], [w["grads"][k] for w, k in zip(windows, peaks)])]
    counts = {len(w["acts"]) for w in windows}
    if len(counts) == 1:
        candidates += [([w["acts"][k] for w in windows], [w["grads"][k] for w in windows])
                       for k in range(counts.pop())]
    acts, grads = [], []
    for act_values, grad_values in candidates:
        a, g = fit(act_values), fit(grad_values)
        if consistent(act_values, a) and consistent(grad_values, g):
            acts.append(a)
            grads.append(g)
    if not acts:
        raise ModelSourceError(f"model_type '{model_type}': the live bytes of {what} are not linear in the shape; "
                               "use `memfit trace` for this model")
    return _envelope(model_type, acts, grads, points)


def _total(run: dict[str, Any], j: int, k: int) -> int:
    return run["segments"][j]["acts"][k] + run["segments"][j]["grads"][k]


def _envelope(model_type: str, acts: list, grads: list, shapes: list) -> tuple[list, list]:
    """Only the moments that are the largest of their segment somewhere on a grid of real shapes (and the fit's)."""
    if len(acts) <= 1:
        return acts, grads
    if model_type in VISION:
        grid = [(b, n) for b in (1, 2, 8, 32, 256) for n in (5, 50, 197, 257, 577, 1370, 4097)]
    else:
        grid = [(b, s, t) for b in (1, 4, 32) for s in (16, 128, 512, 2048, 8192) for t in (16, 128, 512, 2048)]
    keep = set()
    for shape in grid + list(shapes):
        x = basis(model_type, shape)
        keep.add(max(range(len(acts)), key=lambda k: sum(c * v for c, v in zip(acts[k], x))
                     + sum(c * v for c, v in zip(grads[k], x))))
    order = sorted(keep)
    return [acts[k] for k in order], [grads[k] for k in order]


def _check(result: StackFit, shape: tuple[int, ...], run: dict[str, Any]) -> float:
    scale = max(1, sum(run["saved"].values()) + max(max(s["acts"]) for s in run["segments"]))
    checks = [(f"{s} block saved", result.saved[s], run["saved"][s]) for s in result.saved]
    checks += [(f"{s} block gradients", result.grads[s], run["grads"][s]) for s in result.grads]
    worst = 0.0
    for what, coef, measured in checks:
        error = abs(result.value(coef, shape) - measured)
        if error > TOLERANCE * scale + 512:
            raise ModelSourceError(f"model_type '{result.model_type}': {what} is not linear in the shape (fit "
                                   f"{result.value(coef, shape):,} B vs traced {measured:,} B at {shape}); use "
                                   "`memfit trace` for this model")
        worst = max(worst, error / scale)
    for j, segment in enumerate(result.segments):
        predicted = max(result.value(a, shape) + result.value(g, shape)
                        for a, g in zip(segment["acts"], segment["grads"]))
        measured = max(_total(run, j, k) for k in range(len(run["segments"][j]["acts"])))
        if abs(predicted - measured) > TOLERANCE * scale + 512:
            raise ModelSourceError(f"model_type '{result.model_type}': the peak of backward segment {j} is not "
                                   f"linear in the shape (fit {predicted:,} B vs traced {measured:,} B at {shape}); "
                                   "use `memfit trace` for this model")
        worst = max(worst, abs(predicted - measured) / scale)
    return worst
