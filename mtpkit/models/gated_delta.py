"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, with a rollback cache.

The gated delta rule keeps, per value head, a matrix state S of shape [Dk, Dv] that maps keys to
values. For token t, with alpha_t = exp(g_t) (g_t <= 0, a learned decay) and beta_t in (0, 1):

    S'  = alpha_t * S_{t-1}                        decay the whole memory
    S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T     delta rule: move the value stored under k_t
                                                    a fraction beta_t towards v_t
        = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t / sqrt(Dk)

(one step of online least-squares regression of v on k, with learning rate beta_t, after
forgetting by alpha_t). ``recurrent_gated_delta_rule`` applies this token by token;
``chunk_gated_delta_rule`` computes the same thing a chunk at a time with matmuls (see there).

A recurrent layer cannot un-apply an update, so speculative decoding (which runs k+1 tokens and
keeps only the accepted prefix) needs ``GatedDeltaNetCache`` to record the state after every
position of a short forward; ``trim`` then restores one of those snapshots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import PackedCaches

LAYOUTS = ("qwen3_next", "qwen3_5")


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """Scale ``x`` to unit L2 norm along ``dim`` (eps inside the root, as the FLA kernels do)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _match_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    # Grouped value heads: value head h reads key head h // (Hv // Hk), i.e. each key head serves
    # a run of consecutive value heads (the order of Qwen3-Next's grouped projection).
    hk, hv = q.shape[2], v.shape[2]
    if hk == hv:
        return q, k
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    return q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a sequence, a chunk at a time; returns (out, final fp32 state)."""
    # Shapes: q, k [B, T, H(k), Dk] (already l2-normalised), v [B, T, H, Dv], g, beta [B, T, H],
    # state [B, H, Dk, Dv]. Output [B, T, H, Dv] in q's dtype; all arithmetic in fp32.
    #
    # Within a chunk starting from state S0, let G_t = g_1 + ... + g_t (cumulative log decay).
    # Unrolling the recurrence gives S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T, where
    # u_s = beta_s (v_s - (alpha_s S_{s-1})^T k_s) is the correction actually written at s:
    #     u_s + beta_s sum_{r<s} e^{G_s-G_r} (k_s . k_r) u_r = beta_s v_s - beta_s e^{G_s} S0^T k_s
    # i.e. (I + A) U = V_beta - K_beta_decayed S0 with A strictly lower triangular. One
    # triangular solve per chunk gives W = (I+A)^-1 V_beta and Kc = (I+A)^-1 K_beta_decayed,
    # independently of S0, so U = W - Kc S0 and only a cheap matmul scan over chunks remains:
    #     o_t  = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s
    #     S_C  = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T
    out_dtype = q.dtype
    q, k = _match_heads(q, k, v)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).to(torch.float32)

    q, k, v, g, beta = (heads_first(x) for x in (q, k, v, g, beta))
    q = q * dk**-0.5

    # Pad to whole chunks with k = v = 0, beta = 0, g = 0: such a token writes nothing and
    # decays nothing, so the final state is unaffected, and its outputs are cut off below.
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))

    cum = g.cumsum(-1)  # G_t, per chunk
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # e^{G_i - G_j} for j <= i; masked to -inf before the exp so that the (positive) exponents
    # above the diagonal cannot overflow.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()

    a_mat = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(c, dtype=a_mat.dtype, device=a_mat.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * cum.exp()).unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(a_mat + eye, rhs, upper=False, unitriangular=True)
    w, kc = sol.split([dv, dk], dim=-1)

    qk = (q @ k.transpose(-1, -2)) * decay  # includes the diagonal: o_t sees its own write
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    if initial_state is None:
        state = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)  # never written in place below
    out = torch.empty(b, h, n, c, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = w[:, :, i] - kc[:, :, i] @ state
        out[:, :, i] = q_dec[:, :, i] @ state + qk[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ u

    out = out.reshape(b, h, n * c, dv)[:, :, :t]
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    keep_states: bool = False,
    out_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule token by token; returns (out, final state or all states [B,T,H,Dk,Dv])."""
    # Same shapes and semantics as chunk_gated_delta_rule. With keep_states the state after each
    # token is returned (fp32); ``out_states`` (shape [B, T, H, Dk, Dv], any strides) lets the
    # caller supply a preallocated buffer for them, which is then returned.
    out_dtype = q.dtype
    q, k = _match_heads(q, k, v)
    b, t, h, dk = q.shape
    dv = v.shape[-1]

    # Time-major fp32 copies so that each step reads contiguous [B, H, ...] slices.
    def time_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).to(torch.float32).contiguous()

    q, k, v, g, beta = (time_first(x) for x in (q, k, v, g, beta))
    q = q * dk**-0.5
    alpha = g.exp()

    if initial_state is None:
        prev = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
    else:
        prev = initial_state.to(torch.float32)  # only read: each step writes a new slot
    if keep_states and out_states is None:
        out_states = torch.empty(b, t, h, dk, dv, dtype=torch.float32, device=q.device)
    # Without keep_states one work buffer is updated in place (never the caller's state).
    work = None if keep_states else torch.empty(b, h, dk, dv, dtype=torch.float32, device=q.device)
    out = torch.empty(t, b, h, dv, dtype=torch.float32, device=q.device)

    for i in range(t):
        k_i = k[i]
        state = out_states[:, i] if keep_states else work
        torch.mul(prev, alpha[i][..., None, None], out=state)  # S' = alpha S
        predicted = (k_i.unsqueeze(-2) @ state).squeeze(-2)  # S'^T k
        delta = (v[i] - predicted) * beta[i].unsqueeze(-1)
        state.addcmul_(k_i.unsqueeze(-1), delta.unsqueeze(-2))
        out[i] = (q[i].unsqueeze(-2) @ state).squeeze(-2)
        prev = state

    out = out.transpose(0, 1).contiguous().to(out_dtype)
    return out, (out_states if keep_states else prev)


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over x [B,C,T]; returns (y [B,C,T], new window [B,C,K-1])."""
    # ``window`` holds the last K-1 inputs of earlier calls (zeros at the start of a sequence,
    # which is exactly the zero left-padding of a full-sequence causal conv), so chunked calls
    # reproduce the full-sequence result. Computed in the weight's dtype, as transformers does.
    bsz, channels, t = x.shape
    kernel = weight.shape[-1]
    w = weight.reshape(channels, 1, kernel)
    if window is None:
        window = torch.zeros(bsz, channels, kernel - 1, dtype=w.dtype, device=x.device)
    xp = torch.cat([window.to(w.dtype), x.to(w.dtype)], dim=-1)
    y = F.silu(F.conv1d(xp, w, groups=channels))
    return y.to(x.dtype), xp[:, :, t:]


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


class GatedDeltaNetCache:
    """Conv window and recurrent state of one Gated DeltaNet layer, with per-position rollback."""

    # Forwards of at most this many tokens record a snapshot after every position. Memory per
    # cache: (MAX_RECORDED + 1) * B * H * Dk * Dv * 4 bytes; lower it (constructor argument) to
    # the verification width k+1 for large models.
    MAX_RECORDED = 16

    def __init__(
        self,
        batch: int,
        conv_dim: int,
        conv_kernel_size: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        device: torch.device | str | None = None,
        conv_dtype: torch.dtype = torch.float32,
        max_recorded: int | None = None,
    ) -> None:
        self.max_recorded = self.MAX_RECORDED if max_recorded is None else max_recorded
        self.window = conv_kernel_size - 1
        self.conv_state = torch.zeros(batch, conv_dim, self.window, dtype=conv_dtype, device=device)
        self.state = torch.zeros(
            batch, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
        )
        r = self.max_recorded
        # Snapshots of a recorded forward: _states[j] is the state after its first j tokens
        # (j = 0: before it). The conv window after j tokens is _conv_inputs[..., j : j + K - 1],
        # since the conv inputs of the forward are stored right after the window it started from.
        self._states = torch.zeros(
            r + 1, batch, num_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
        )
        self._conv_inputs = torch.zeros(
            batch, conv_dim, self.window + r, dtype=conv_dtype, device=device
        )
        self.length = 0
        self._start = 0  # position where the last forward began
        self._recorded = False  # whether that forward recorded snapshots

    def begin_forward(self, conv_input: torch.Tensor) -> torch.Tensor | None:
        """Start a forward over conv_input [B,C,T]; return the state buffer to fill if recorded."""
        t = conv_input.shape[-1]
        self._start = self.length
        self._recorded = t <= self.max_recorded
        if not self._recorded:
            return None
        self._conv_inputs[:, :, : self.window].copy_(self.conv_state)
        self._conv_inputs[:, :, self.window : self.window + t].copy_(conv_input)
        self._states[0].copy_(self.state)
        return self._states[1 : t + 1].transpose(0, 1)

    def end_forward(self, n_tokens: int, window: torch.Tensor, state: torch.Tensor) -> None:
        """Finish a forward of n_tokens: store the new conv window and recurrent state."""
        self.conv_state.copy_(window)
        self.state.copy_(state)
        self.length += n_tokens

    def trim(self, n: int) -> None:
        """Return to the state after the first ``n`` tokens (n within the last forward's span)."""
        if n == self.length:
            return
        lo = self._start if self._recorded else self.length
        if not lo <= n <= self.length:
            raise ValueError(
                f"cannot trim a Gated DeltaNet cache of length {self.length} to {n}: a recurrent "
                f"state can only return to positions {lo}..{self.length} (the span of its last "
                f"forward, recorded only when it has at most {self.max_recorded} tokens)"
            )
        j = n - self._start
        self.state.copy_(self._states[j])
        self.conv_state.copy_(self._conv_inputs[:, :, j : j + self.window])
        self.length = n

    def reset(self) -> None:
        """Return to the empty state (zero window and state) for a new request."""
        self.conv_state.zero_()
        self.state.zero_()
        self.length = 0
        self._start = 0
        self._recorded = False


# --------------------------------------------------------------------------------------------
# Layer
# --------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight, not zero-centred) followed by a SiLU gate, per value head."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Normalise x over its last dim, scale by weight, multiply by silu(gate)."""
        # Dtype steps follow the reference so that bf16 runs round at the same places.
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Qwen3.5 linear-attention layer; parameter names match the HF checkpoints."""

    packs = True  # forward takes PackedCaches (CausalLM.packable)

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        layout: str,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of {num_k_heads}")
        self.layout = layout
        self.hidden_size = hidden_size
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        if layout == "qwen3_next":
            # Rows grouped per key head: [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)],
            # r = num_v_heads // num_k_heads.
            self.in_proj_qkvz = nn.Linear(
                hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
            )
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)

        # Depthwise conv over [q | k | v] channels; the checkpoints have no conv bias.
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=conv_kernel_size,
            groups=self.conv_dim,
            padding=conv_kernel_size - 1,
            bias=False,
        )
        # Decay g = -exp(A_log) * softplus(a + dt_bias) (a Mamba-style discretised step).
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps=rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _project(self, x: torch.Tensor):
        # Returns conv input [B, T, conv_dim] ordered [q heads | k heads | v heads], the gate z
        # [B, T, Hv, Dv] and the per-value-head b, a [B, T, Hv].
        bsz, t, _ = x.shape
        if self.layout == "qwen3_5":
            z = self.in_proj_z(x).reshape(bsz, t, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.num_v_heads // self.num_k_heads
        dk, vr = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(bsz, t, self.num_k_heads, 2 * dk + 2 * vr)
        q, k, v, z = qkvz.split([dk, dk, vr, vr], dim=-1)
        ba = self.in_proj_ba(x).reshape(bsz, t, self.num_k_heads, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        qkv = torch.cat(
            [q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], dim=-1
        )
        z = z.reshape(bsz, t, self.num_v_heads, self.head_v_dim)
        return qkv, z, b.reshape(bsz, t, -1), a.reshape(bsz, t, -1)

    def forward(self, x: torch.Tensor,
                cache: GatedDeltaNetCache | PackedCaches | None = None) -> torch.Tensor:
        """Map hidden states [B,T,D] to [B,T,D], continuing from (and advancing) ``cache``.

        With ``PackedCaches``, x [1, sum T_i, D] holds several sequences one after another
        (a server's batched step, CausalLM.forward_packed): the projections run once over
        all their rows and each sequence's conv and recurrence continue its own state, as
        its forward alone would.
        """
        bsz, t, _ = x.shape
        qkv, z, b, a = self._project(x)
        if isinstance(cache, PackedCaches):
            out = cache.each(self._mix, qkv, b, a, dim=1)
        else:
            out = self._mix(qkv, b, a, cache)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(bsz, t, self.value_dim))

    def _mix(self, qkv, b, a, cache: GatedDeltaNetCache | None) -> torch.Tensor:
        # One sequence's conv and gated delta rule over its projections qkv [B, T, conv_dim],
        # b, a [B, T, Hv] -> the heads' output [B, T, Hv, Dv].
        bsz, t, _ = qkv.shape
        conv_in = qkv.transpose(1, 2)
        states_buf = cache.begin_forward(conv_in) if cache is not None else None
        window = cache.conv_state if cache is not None else None
        mixed, new_window = causal_conv1d_silu(conv_in, self.conv1d.weight, window)
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], -1)
        # q, k are normalised in fp32 (as the reference does inside its kernel).
        q = l2norm(q.reshape(bsz, t, self.num_k_heads, self.head_k_dim).float())
        k = l2norm(k.reshape(bsz, t, self.num_k_heads, self.head_k_dim).float())
        v = v.reshape(bsz, t, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        if cache is None:
            out, _ = chunk_gated_delta_rule(q, k, v, g, beta)
        elif states_buf is not None:
            # Short forward (verification / decoding): keep every per-position state for trim.
            out, states = recurrent_gated_delta_rule(
                q, k, v, g, beta, cache.state, keep_states=True, out_states=states_buf
            )
            cache.end_forward(t, new_window, states[:, -1])
        else:
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, cache.state)
            cache.end_forward(t, new_window, state)
        return out

    def new_cache(
        self,
        batch: int,
        device: torch.device | str | None = None,
        max_recorded: int | None = None,
    ) -> GatedDeltaNetCache:
        """An empty cache for this layer (conv window in the conv weight's dtype)."""
        return GatedDeltaNetCache(
            batch,
            self.conv_dim,
            self.conv_kernel_size,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            device=device if device is not None else self.conv1d.weight.device,
            conv_dtype=self.conv1d.weight.dtype,
            max_recorded=max_recorded,
        )
