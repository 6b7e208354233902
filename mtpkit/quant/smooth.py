"""SmoothQuant for W8A8/W4A8 checkpoints: move activation outliers into the weights.

Per-token int8 activations lose the small channels of a row whose few outlier channels set
its scale. For a Linear group sharing an input X, scaling input channel j by 1/s_j and the
weights' column j by s_j leaves the product unchanged, and with
s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) both sides become easier to quantize
(Xiao et al., 2023). The 1/s_j is folded into whatever writes X, so nothing runs at decode
time: the RMSNorm weight before q/k/v and before gate/up, the rows of up_proj before
down_proj (its input is silu(gate) * up), and the rows of v_proj before o_proj (attention
output is linear in the values; with grouped KV heads s is shared by the query heads of a
group). The final norm is left alone: an MTP head reads the states after it.

Written here because the library that has it (llm-compressor) is a GPU-oriented stack far
heavier than this transform, which is a few lines once the maxima are known.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.attention import Attention
from ..models.layers import MLP, PreNormDecoderLayer, RMSNorm


def _fits(layer) -> bool:
    # Layers whose writers of each input can absorb 1/s exactly.
    if not isinstance(layer, PreNormDecoderLayer):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (type(attn) is Attention and type(mlp) is MLP and not attn.output_gate
            and all(isinstance(n, RMSNorm) and not n.zero_centered for n in norms))


SAMPLE_ROWS = 1024  # input rows kept per group to choose its strength (ALPHAS)
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@torch.no_grad()
def input_maxima(model, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-channel max |input| of every smoothable Linear group of the trunk, over batches:
    keys "<layer path>.qkv", ".o", ".gate_up", ".down"; and the first SAMPLE_ROWS input
    rows of each under "<key>:rows"."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []

    def watch(mod: nn.Module, key: str) -> None:
        def hook(_, inp):
            rows = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
            x = rows.abs().amax(0)
            stats[key] = torch.maximum(stats[key], x) if key in stats else x
            kept = stats.get(key + ":rows")
            if kept is None or len(kept) < SAMPLE_ROWS:
                rows = rows if kept is None else torch.cat([kept, rows])
                stats[key + ":rows"] = rows[:SAMPLE_ROWS]
        hooks.append(mod.register_forward_pre_hook(hook))

    for i, layer in enumerate(model.model.layers):
        if _fits(layer):
            p = f"model.layers.{i}"
            watch(layer.self_attn.q_proj, f"{p}.qkv")
            watch(layer.self_attn.o_proj, f"{p}.o")
            watch(layer.mlp.gate_proj, f"{p}.gate_up")
            watch(layer.mlp.down_proj, f"{p}.down")
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factor(x: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w = torch.stack([t.abs().amax(0).float() for t in weights]).amax(0)
    return (x.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


def _fake_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # x @ w.T with both sides rounded as W8A8 rounds them (per token, per channel).
    def q(t):
        s = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        return (t / s).round().clamp(-127, 127) * s
    return q(x) @ q(w).T


def _best(rows: torch.Tensor | None, x: torch.Tensor, weights: list[torch.Tensor],
          alpha: float | None, factor=None) -> torch.Tensor:
    """The factor of the given strength, or (alpha None) of the strength in ALPHAS whose
    W8A8 output on the sampled rows is nearest the float output. ``factor(a)``: how a
    strength gives a factor over the rows' channels (default _factor)."""
    factor = factor or (lambda a: _factor(x, weights, a))
    if alpha is not None or rows is None:
        return factor(0.5 if alpha is None else alpha)
    w = torch.cat([t.float() for t in weights])
    want = rows @ w.T
    errs = {}
    for a in ALPHAS:
        s = factor(a)
        errs[a] = float((_fake_w8a8(rows / s, w * s) - want).square().sum())
    return factor(min(errs, key=errs.get))


@torch.no_grad()
def smoothing(model, maxima: dict[str, torch.Tensor], alpha: float | None) -> dict[str, tuple]:
    """Model tensor name -> (factor, dim): multiply the tensor by factor along dim (a vector
    broadcast over that axis) to smooth the model with strength ``alpha``; None: each
    group's own strength from ALPHAS, the one whose W8A8 output is nearest the float's."""
    if alpha is not None and not 0.0 < alpha < 1.0:
        raise ValueError(f"--smooth must be in (0, 1) or 'auto', got {alpha}")
    out: dict[str, tuple] = {}

    def scale(name: str, factor: torch.Tensor, dim: int) -> None:
        if name in out:  # a tensor smoothed on both axes (up_proj, v_proj)
            prev = out[name]
            out[name] = prev + ((factor, dim),)
        else:
            out[name] = ((factor, dim),)

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        if f"{p}.qkv" not in maxima:
            continue
        attn, mlp = layer.self_attn, layer.mlp

        def best(key, weights, factor=None, p=p):
            return _best(maxima.get(f"{p}.{key}:rows"), maxima[f"{p}.{key}"], weights, alpha,
                         factor)

        s = best("qkv", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        scale(f"{p}.input_layernorm.weight", 1 / s, 0)
        for n in ("q_proj", "k_proj", "v_proj"):
            scale(f"{p}.self_attn.{n}.weight", s, 1)
        s = best("gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight])
        scale(f"{p}.post_attention_layernorm.weight", 1 / s, 0)
        for n in ("gate_proj", "up_proj"):
            scale(f"{p}.mlp.{n}.weight", s, 1)
        s = best("down", [mlp.down_proj.weight])
        scale(f"{p}.mlp.up_proj.weight", 1 / s, 0)
        if mlp.up_proj.bias is not None:
            scale(f"{p}.mlp.up_proj.bias", 1 / s, 0)
        scale(f"{p}.mlp.down_proj.weight", s, 1)
        # o_proj's input channel (head h, dim d) comes from v's (KV head h // g, dim d).
        hd, g = attn.head_dim, attn.num_heads // attn.num_kv_heads
        x = maxima[f"{p}.o"].view(-1, g, hd).amax(1)
        w = attn.o_proj.weight.abs().amax(0).float().view(-1, g, hd).amax(1)

        def shared(a, x=x, w=w, g=g, hd=hd):
            # One factor per KV channel, repeated over the query heads that read it.
            sv = (x.clamp(min=1e-5) ** a / w.clamp(min=1e-5) ** (1 - a)).clamp(min=1e-5)
            return sv[:, None, :].expand(-1, g, hd).reshape(-1)

        so = best("o", [attn.o_proj.weight], shared)
        sv = so.view(-1, g, hd)[:, 0].reshape(-1)
        scale(f"{p}.self_attn.v_proj.weight", 1 / sv, 0)
        if attn.v_proj.bias is not None:
            scale(f"{p}.self_attn.v_proj.bias", 1 / sv, 0)
        scale(f"{p}.self_attn.o_proj.weight", so, 1)
    return out


def apply(tensor: torch.Tensor, factors: tuple) -> torch.Tensor:
    """A tensor times its smoothing factors (in fp32, returned in its own dtype)."""
    t = tensor.float()
    for factor, dim in factors:
        shape = [1] * t.dim()
        shape[dim] = -1
        t = t * factor.view(shape)
    return t.to(tensor.dtype)


class Smoothed:
    """A checkpoint read through smoothing factors (keyed by on-disk tensor name)."""

    def __init__(self, ckpt, factors: dict[str, tuple]) -> None:
        self.ckpt, self.factors = ckpt, factors

    def get_tensor(self, name: str, *args, **kw) -> torch.Tensor:
        """The stored tensor, smoothed where it has factors."""
        t = self.ckpt.get_tensor(name, *args, **kw)
        f = self.factors.get(name)
        return t if f is None else apply(t, f)

    def __getattr__(self, name):
        return getattr(self.ckpt, name)
