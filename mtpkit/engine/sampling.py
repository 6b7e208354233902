"""Sampling settings and the distribution they define, applied alike to target and draft."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """A sampling setting is out of range."""


# Temperatures this small are greedy decoding (as vLLM treats them): logits divided by them
# overflow to inf and the probabilities to NaN, and the distribution is the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding settings (temperature 0 means greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature below GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise SamplingError naming the first bad setting."""
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SamplingError(f"seed must be between -2**63 and 2**64-1 (a 64-bit integer), "
                                f"got {self.seed}")


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (fp32, rows sum to 1)."""
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(prob: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probabilities [..., V] (any non-negative weights)."""
    # By the inverse of the cumulative distribution: token i when c[i-1] <= u < c[i], for u
    # uniform on [0, total). torch.multinomial draws the same distribution far slower on a
    # CPU over a large vocabulary. Summed in float64, so that every token's share of
    # [0, total) is its probability to within 1e-16, however small.
    flat = prob.reshape(-1, prob.shape[-1]).double()
    c = flat.cumsum(-1)
    total = c[:, -1:].contiguous()
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=prob.device) * total
    # u < total exactly; where rounding made u * total reach it, the last token with mass.
    idx = torch.minimum(torch.searchsorted(c, u, right=True),
                        torch.searchsorted(c, total, right=False))
    return idx.reshape(prob.shape[:-1])
