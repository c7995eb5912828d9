"""torch.optim.Muon (torch 2.9+, torch/optim/_muon.py) on the blocks' matrices, AdamW (foreach) on the rest: the
split memfit._torch.muon builds, read here off the model graph (the Linear nodes of the stacks; embeddings, head,
norms, biases and stacked experts go to AdamW).

States: Muon keeps one momentum buffer per matrix (`zeros_like(p.grad)`: the parameter's dtype); AdamW its two
moments and the fp32 step scalar per tensor.

The step, per matrix in parameter order (`_single_tensor_muon`, `_zeropower_via_newtonschulz`): `update =
grad.lerp(buf)` is a new tensor in the gradient's dtype (the previous matrix's update is still bound while it is
made); the orthogonalisation works on a bf16 copy X (the update itself when it is bf16) laid out k x K with k = min(m,
n), and each of its 5 iterations makes the Gram matrix A = X X^T (k x k), B = bA + cA A (k x k) and the next X =
aX + B X (k x K), the previous X, A and B freed only when rebound. The largest moment is the next X being made:
update + 2 x (k K) + 2 x (k x k) bf16 elements, i.e. update + 4 B x (kK + k^2).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..graph.model import linears_of
from ..model_spec import ModelSpec

BF16 = 2


def matrices(spec: ModelSpec) -> list[tuple[int, int]]:
    """(rows, cols) of every matrix Muon steps, in parameter order (block after block)."""
    if spec.graph is None:
        raise ConfigError(f"muon needs the model graph to find the blocks' matrices, and '{spec.name}' has none (a "
                          "derived or live module): use an AdamW variant")
    out: list[tuple[int, int]] = []
    for stack in spec.graph.stacks:
        block = [(lin.out_features, lin.in_features) for _, lin in linears_of(stack.block)]
        out += block * stack.count
    if not out:
        raise ConfigError(f"'{spec.name}' has no Linear weights inside its blocks for muon: use an AdamW variant")
    return out


def state_bytes(spec: ModelSpec, s_bytes: int) -> tuple[int, str]:
    mats = matrices(spec)
    muon = sum(m * n for m, n in mats)
    rest = spec.num_params - muon
    rest_tensors = sum(p.count for p in spec.params) - len(mats)
    return (s_bytes * muon + 2 * s_bytes * rest + 4 * rest_tensors,
            f"Muon momentum {s_bytes} B x the blocks' matrices + AdamW 2 x {s_bytes} B x the rest (+ fp32 step)")


def step_temp_bytes(spec: ModelSpec, p_bytes: int) -> tuple[int, str]:
    mats = matrices(spec)
    peak, previous = 0, 0
    for m, n in mats:
        k, big = min(m, n), max(m, n)
        update = m * n * p_bytes
        peak = max(peak, update + 2 * BF16 * (k * big + k * k), previous + update)
        previous = m * n * BF16  # the orthogonalised update stays bound until the next matrix's is made
    rest = (spec.num_params - sum(m * n for m, n in mats)) * p_bytes
    return max(peak, rest), ("Muon: update + bf16 Newton-Schulz X, X' (k x K) and A, B (k x k) of the largest "
                             "matrix; AdamW foreach on the rest: one temporary the size of its group")
