"""Mixture of experts with softmax top-k routing and a gated shared expert (Qwen3-Next/3.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import MLP


class Router(nn.Module):
    """``mlp.gate``: one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """Top-k experts per token plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_size: int,
        shared_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(MLP(hidden_size, expert_size) for _ in range(num_experts))
        self.shared_expert = MLP(hidden_size, shared_size) if shared_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights = torch.softmax(self.gate(x).float(), dim=-1)
        top_w, top_i = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        # Loop over the experts actually hit: a decode step touches top_k of them, so the
        # rest of the expert weights are never read.
        for e in top_i.unique().tolist():
            rows, slot = torch.where(top_i == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * top_w[rows, slot, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def split_fused_experts(name: str, tensor_fn):
    """Per-expert tensors from stacked ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj``."""
    if name.endswith("mlp.experts.gate_up_proj"):
        fused = tensor_fn()
        half = fused.shape[1] // 2
        prefix = name[: -len("gate_up_proj")]
        for e in range(fused.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", fused[e, :half]
            yield f"{prefix}{e}.up_proj.weight", fused[e, half:]
    elif name.endswith("mlp.experts.down_proj"):
        fused = tensor_fn()
        prefix = name[: -len("down_proj")]
        for e in range(fused.shape[0]):
            yield f"{prefix}{e}.down_proj.weight", fused[e]
