"""The accept rule of speculative decoding: pure functions, no model in sight.

Greedy: draft j is accepted while it equals the target's argmax at the same position; the
first mismatch is replaced by the target's token, and when all k pass the target's (k+1)-th
argmax is a bonus token. The output is exactly the target's greedy sequence.

Sampling (Leviathan et al. 2023, arXiv 2211.17192): with draft distribution q_j and target
distribution p_j at draft position j, accept draft x_j with probability min(1, p_j(x)/q_j(x)).
On the first rejection emit a token from the residual r(y) = max(0, p_j(y) - q_j(y)) / Z and
stop; when all k pass, emit a bonus token from p_{k+1}. For every y the emitted token has
probability q(y) min(1, p(y)/q(y)) + (1 - sum_x min(q(x), p(x))) r(y) = min(q, p)(y) +
max(0, p - q)(y) = p(y): the output distribution is the target's, whatever q is.
"""

from __future__ import annotations

import torch

from .sampling import sample


def accept_greedy(draft: list[int], target: list[int]) -> tuple[int, int]:
    """(number of drafts accepted, next token) for k drafts and k+1 target argmaxes."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


def accept_sampled(
    draft: list[int],
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless rule: drafts [k] drawn from q [k, V]; target probabilities p [k+1, V]."""
    k = len(draft)
    if k:
        idx = torch.tensor(draft, device=p.device)
        rows = torch.arange(k, device=p.device)
        ratio = p[rows, idx] / q[rows, idx]
        u = torch.rand(k, generator=generator, device=p.device)
        ok = (u < ratio).tolist()  # u < min(1, r) is u < r for u in [0, 1)
        for j in range(k):
            if not ok[j]:
                residual = (p[j] - q[j]).clamp_min(0)
                total = residual.sum()
                # p == q on the support leaves nothing: any p-sample is then exact.
                dist = residual / total if total > 0 else p[j]
                return j, int(sample(dist, generator))
    return k, int(sample(p[k], generator))
