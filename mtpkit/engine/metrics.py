"""Speculative-decoding counters with vLLM's names and definitions, plus speed figures.

Beyond vLLM's counters, drafts and acceptances are also counted per MTP layer: draft
position p runs layer ``layer_for(p, mtp_layers)`` (models/mtp.py), so with k above the
head's layer count the positions cycle back to layer 0 and each layer's own record shows
how it drafts wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.mtp import layer_for


@dataclass
class SpecMetrics:
    """Counters of one request (or a sum of requests)."""

    num_drafts: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k] accepted at position i
    drafts_per_pos: list[int] = field(default_factory=list)  # [k] drafts reaching position i
    # The head's MTP layer count (the engine sets it; 1: an EAGLE-3 or one-layer head), and
    # per layer the drafts it made and those accepted (positions folded by layer_for).
    mtp_layers: int = 1
    accepted_per_layer: list[int] = field(default_factory=list)
    drafts_per_layer: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # trunk forwards after prefill
    ttft_s: float = 0.0  # prefill and first token
    elapsed_s: float = 0.0  # from request start to last token

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verification step with ``drafted`` draft tokens, ``accepted`` taken."""
        self.steps += 1
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
            self.drafts_per_pos.append(0)
        for i in range(drafted):
            self.drafts_per_pos[i] += 1
            self.accepted_per_pos[i] += int(i < accepted)
            layer = layer_for(i, max(self.mtp_layers, 1))
            while len(self.drafts_per_layer) <= layer:
                self.accepted_per_layer.append(0)
                self.drafts_per_layer.append(0)
            self.drafts_per_layer[layer] += 1
            self.accepted_per_layer[layer] += int(i < accepted)

    def add(self, other: SpecMetrics) -> None:
        """Accumulate another request's counters."""
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "prompt_tokens",
                     "generated_tokens", "steps", "ttft_s", "elapsed_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.mtp_layers = max(self.mtp_layers, other.mtp_layers)
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos),
                             (self.drafts_per_pos, other.drafts_per_pos),
                             (self.accepted_per_layer, other.accepted_per_layer),
                             (self.drafts_per_layer, other.drafts_per_layer)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens gained per verification, the bonus included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rate(self) -> list[float]:
        """Acceptance rate at each draft position (of drafts that reached it)."""
        pairs = zip(self.accepted_per_pos, self.drafts_per_pos, strict=True)
        return [a / d if d else 0.0 for a, d in pairs]

    @property
    def per_layer_rate(self) -> list[float]:
        """Acceptance rate of each MTP layer's drafts (every position it ran at)."""
        pairs = zip(self.accepted_per_layer, self.drafts_per_layer, strict=True)
        return [a / d if d else 0.0 for a, d in pairs]

    @property
    def decode_s(self) -> float:
        """Time after the first token."""
        return max(self.elapsed_s - self.ttft_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens after the first, per second of decoding."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain-data view for --json and the server."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_rate,
            "mtp_layers": self.mtp_layers,
            "num_draft_tokens_per_layer": list(self.drafts_per_layer),
            "num_accepted_tokens_per_layer": list(self.accepted_per_layer),
            "per_layer_acceptance_rate": self.per_layer_rate,
            "drafted_throughput": self._per_s(self.num_draft_tokens),
            "accepted_throughput": self._per_s(self.num_accepted_tokens),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "ttft_s": self.ttft_s,
            "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens_per_s,
        }

    def _per_s(self, n: int) -> float:
        return n / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def vllm_line(self) -> str:
        """The line vLLM logs, so that tools that parse it read ours; a head of several MTP
        layers adds its per-layer rates at the end (vLLM has no such figure)."""
        per_pos = ", ".join(f"{r:.3f}" for r in self.per_position_rate)
        per_layer = ""
        if self.mtp_layers > 1 and self.drafts_per_layer:
            rates = ", ".join(f"{r:.3f}" for r in self.per_layer_rate)
            per_layer = f", Per-MTP-layer acceptance rate: {rates}"
        return (
            "SpecDecoding metrics: "
            f"Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {self._per_s(self.num_accepted_tokens):.2f} tokens/s, "
            f"Drafted throughput: {self._per_s(self.num_draft_tokens):.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
            f"{per_layer}"
        )
