"""Mixture-of-experts layers.

- ``SparseMoE``: softmax top-k routing and a gated shared expert (Qwen3-Next / 3.5).
- ``GroupedMoE``: DeepSeek-V3 / GLM-4.5 routing (sigmoid scores, a bias that steers only the
  choice, group-limited top-k, routed scaling) plus always-on shared experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .layers import MLP


class Router(nn.Module):
    """``mlp.gate``: one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def run_experts(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                experts: nn.ModuleList) -> torch.Tensor:
    """sum_j top_w[:, j] * experts[top_i[:, j]](x) for rows x [N, D], top_w / top_i [N, k]."""
    out = torch.zeros_like(x)
    # Loop over the experts actually hit: a decode step touches top_k of them, so the rest
    # of the expert weights are never read.
    for e in top_i.unique().tolist():
        rows, slot = torch.where(top_i == e)
        out.index_add_(0, rows, (experts[e](x[rows]) * top_w[rows, slot, None]).to(x.dtype))
    return out


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
        out = run_experts(x, top_w.to(x.dtype), top_i, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class GroupedTopKRouter(nn.Module):
    """``mlp.gate``: sigmoid expert scores; choice among the best ``topk_group`` groups.

    The ``e_score_correction_bias`` (load balancing) shifts which experts are chosen, but the
    weights are the unbiased scores of the chosen ones. It stays fp32 when the model is cast,
    as in the reference implementations: bf16 rounding of it can flip close choices.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias.data
        out = super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        if new.dtype != torch.float32 and bias.dtype == torch.float32 and new.device.type != "meta":
            new.data = bias.to(new.device)
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, top_k] fp32, expert ids [N, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n, e = choice.shape
        if self.n_group > 1:
            # A group's merit is the sum of its two best (biased) scores; experts outside the
            # topk_group best groups cannot be chosen.
            grouped = choice.view(n, self.n_group, e // self.n_group)
            merit = grouped.topk(min(2, e // self.n_group), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(merit, dtype=torch.bool)
            keep.scatter_(1, merit.topk(self.topk_group, dim=-1)[1], True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
        top_i = choice.topk(self.top_k, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if self.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * self.scale, top_i


class GroupedMoE(nn.Module):
    """DeepSeek-V3 / GLM-4.5 MoE: ``gate``, ``experts.E.*``, ``shared_experts`` (always on)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_size: int,
        n_shared_experts: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(hidden_size, num_experts, top_k, n_group, topk_group,
                                      norm_topk_prob, routed_scaling_factor)
        self.experts = nn.ModuleList(MLP(hidden_size, expert_size) for _ in range(num_experts))
        # The shared experts are stored as one MLP n_shared_experts times as wide.
        shared = expert_size * n_shared_experts
        self.shared_experts = MLP(hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_i = self.gate(x)
        out = run_experts(x, top_w, top_i, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)


def moe_fields(d: dict) -> dict:
    """The DeepSeek-style MoE and MTP keys of an HF config dict (GLM-4.5, DeepSeek-V3)."""
    mt = d.get("model_type")
    # Older DeepSeek configs spell out the routing; only V3's sigmoid + bias routing is built.
    routing = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    for key, want in routing.items():
        if d.get(key, want) != want:
            raise ConfigError(f"config.json ({mt}): {key}={d[key]!r} is not supported (only "
                              f"{want!r}, the DeepSeek-V3 / GLM-4.5 routing)")
    return dict(
        n_routed_experts=d.get("n_routed_experts") or 0,
        num_experts_per_tok=d.get("num_experts_per_tok") or 1,
        moe_intermediate_size=d.get("moe_intermediate_size") or 0,
        n_shared_experts=d.get("n_shared_experts") or 0,
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        first_k_dense_replace=d.get("first_k_dense_replace") or 0,
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
    )


def validate_moe(cfg) -> None:
    """Checks shared by the DeepSeek-style MoE configs."""
    if cfg.hidden_act != "silu":
        cfg.fail(f"hidden_act={cfg.hidden_act!r} is not supported (only silu)")
    if cfg.first_k_dense_replace > 0 or cfg.n_routed_experts == 0:
        if cfg.intermediate_size <= 0:
            cfg.fail("dense layers need intermediate_size")
    if cfg.n_routed_experts:
        if cfg.n_routed_experts % cfg.n_group:
            cfg.fail(f"n_routed_experts={cfg.n_routed_experts} is not a multiple of "
                     f"n_group={cfg.n_group}")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            cfg.fail(f"topk_group={cfg.topk_group} must lie in 1..n_group={cfg.n_group}")
        allowed = cfg.n_routed_experts // cfg.n_group * cfg.topk_group
        if cfg.num_experts_per_tok > allowed:
            cfg.fail(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the {allowed} "
                     "experts that the topk_group groups hold")
        if cfg.moe_intermediate_size <= 0:
            cfg.fail("an MoE model needs moe_intermediate_size")


def make_grouped_mlp(cfg, moe: bool) -> nn.Module:
    """Dense SwiGLU MLP or DeepSeek-style MoE, as the config says for one layer."""
    if not moe:
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    return GroupedMoE(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                      cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.n_group,
                      cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)


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
