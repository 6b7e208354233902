"""Gated DeltaNet against transformers' Qwen3-Next / Qwen3.5 layers, and its rollback cache."""

from __future__ import annotations

import pytest
import torch

from mtpkit.models.gated_delta import (
    GatedDeltaNet,
    GatedDeltaNetCache,
    causal_conv1d_silu,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

TOL = 1e-4
DIMS = dict(
    hidden_size=64,
    num_k_heads=2,
    num_v_heads=4,
    head_k_dim=16,
    head_v_dim=16,
    conv_kernel_size=4,
    rms_norm_eps=1e-6,
)
LAYOUTS = ["qwen3_next", "qwen3_5"]


def _reference(layout: str) -> torch.nn.Module:
    """transformers' layer for ``layout``, built from a tiny config with random weights."""
    kwargs = dict(
        hidden_size=DIMS["hidden_size"],
        linear_num_key_heads=DIMS["num_k_heads"],
        linear_num_value_heads=DIMS["num_v_heads"],
        linear_key_head_dim=DIMS["head_k_dim"],
        linear_value_head_dim=DIMS["head_v_dim"],
        linear_conv_kernel_dim=DIMS["conv_kernel_size"],
        rms_norm_eps=DIMS["rms_norm_eps"],
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    if layout == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        ref = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**kwargs), 0)
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        ref = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**kwargs), 0)
    with torch.no_grad():
        # Linear / conv weights keep torch's default fan-in scaling; the defaults of the decay
        # and norm parameters are replaced so that they matter: decays e^g spread over about
        # (0.5, 0.99), so that state carried across calls visibly changes the output.
        ref.dt_bias.copy_(torch.randn(DIMS["num_v_heads"]) * 0.5 - 1.0)
        ref.A_log.copy_(torch.empty(DIMS["num_v_heads"]).uniform_(0.05, 1.5).log())
        ref.norm.weight.copy_(1.0 + 0.2 * torch.randn(DIMS["head_v_dim"]))
    return ref.eval()


@pytest.fixture(scope="module", params=LAYOUTS)
def pair(request):
    """(ours, reference) with identical weights, for each layout."""
    torch.manual_seed(0)
    ref = _reference(request.param)
    ours = GatedDeltaNet(**DIMS, layout=request.param)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours.eval(), ref


@pytest.fixture(scope="module")
def layer(pair):
    return pair[0]


def _x(t: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, t, DIMS["hidden_size"], generator=torch.Generator().manual_seed(seed))


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


@torch.no_grad()
def test_full_sequence_matches_transformers(pair):
    ours, ref = pair
    x = _x(100)  # 64 + a partial chunk of 36
    expected = ref(x)
    got = ours(x)
    assert expected.abs().mean() > 1e-2  # not trivially small
    assert _maxdiff(got, expected) < TOL


def _kernel_inputs(t: int, h: int = 3, dk: int = 8, dv: int = 6, b: int = 2):
    gen = torch.Generator().manual_seed(t)
    q = l2norm(torch.randn(b, t, h, dk, generator=gen))
    k = l2norm(torch.randn(b, t, h, dk, generator=gen))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.5
    beta = torch.rand(b, t, h, generator=gen) * 0.98 + 0.01
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


@torch.no_grad()
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t,chunk", [(100, 64), (37, 16), (5, 64)])
def test_chunk_matches_recurrent(with_state, t, chunk):
    q, k, v, g, beta, s0 = _kernel_inputs(t)
    init = s0.clone() if with_state else None
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=chunk)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    assert init is None or torch.equal(init, s0)  # the caller's state is never written
    assert _maxdiff(out_c, out_r) < TOL
    assert _maxdiff(s_c, s_r) < TOL
    _, states = recurrent_gated_delta_rule(q, k, v, g, beta, init, keep_states=True)
    assert states.shape == (2, t, 3, 8, 6)
    assert torch.equal(states[:, -1], s_r)
    if with_state:  # the initial state must be read, not ignored
        assert _maxdiff(out_c, chunk_gated_delta_rule(q, k, v, g, beta)[0]) > 1e-2


@torch.no_grad()
def test_kernels_match_transformers_kernels():
    """Pins the semantics (1/sqrt(Dk) on q, decay before the update, grouped value heads)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, _ = _kernel_inputs(70, h=2)
    v = torch.randn(2, 70, 4, 6)  # 4 value heads over 2 key heads
    g, beta = g.repeat_interleave(2, dim=2), beta.repeat_interleave(2, dim=2)
    s0 = torch.randn(2, 4, 8, 6)
    for ours, theirs in [
        (chunk_gated_delta_rule, hf.torch_chunk_gated_delta_rule),
        (recurrent_gated_delta_rule, hf.torch_recurrent_gated_delta_rule),
    ]:
        out, state = ours(q, k, v, g, beta, s0)
        out_hf, state_hf = theirs(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert _maxdiff(out, out_hf) < TOL
        assert _maxdiff(state, state_hf) < TOL


def test_kernels_compute_in_fp32():
    q, k, v, g, beta, s0 = _kernel_inputs(20)
    low = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        out, state = fn(*low, s0)
        assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
        exact, _ = fn(*[x.float() for x in low], s0)
        assert _maxdiff(out.float(), exact) < 2e-2  # only the final rounding to bf16


def test_conv_window_carries_across_calls():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 12, generator=gen)
    w = torch.randn(5, 1, 4, generator=gen)
    full = torch.nn.functional.silu(torch.nn.functional.conv1d(x, w, padding=3, groups=5))[..., :12]
    window, parts = None, []
    for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 12)]:  # includes calls shorter than K-1
        y, window = causal_conv1d_silu(x[..., lo:hi], w, window)
        parts.append(y)
        assert torch.equal(window, x[..., hi - 3 : hi])
    assert _maxdiff(torch.cat(parts, -1), full) < 1e-6


@torch.no_grad()
@pytest.mark.parametrize("prefix", [40, 9])  # chunked (long) and recorded (short) prefill
def test_prefill_then_decode_matches_full_sequence(layer, prefix):
    x = _x(60)
    expected = layer(x)
    cache = layer.new_cache(2)
    outs = [layer(x[:, :prefix], cache)]
    assert cache.length == prefix
    pos = prefix
    for step in [1, 1, 3, 1, 1, 5]:
        outs.append(layer(x[:, pos : pos + step], cache))
        pos += step
    outs.append(layer(x[:, pos:], cache))
    assert cache.length == 60
    assert _maxdiff(torch.cat(outs, 1), expected) < TOL


def _clone_state(cache: GatedDeltaNetCache):
    return cache.conv_state.clone(), cache.state.clone()


@torch.no_grad()
def test_speculative_trim_matches_plain_run(layer):
    prefix, k, total = 20, 5, 32
    x = _x(total)
    drafts = _x(k, seed=7)  # wrong guesses after the accepted prefix
    expected = layer(x)

    # The plain run: prefix, then every later token one at a time; states after each position.
    plain = layer.new_cache(2)
    layer(x[:, :prefix], plain)
    plain_states = {prefix: _clone_state(plain)}
    for pos in range(prefix, total):
        layer(x[:, pos : pos + 1], plain)
        plain_states[pos + 1] = _clone_state(plain)

    for n in range(prefix, prefix + k + 1):
        cache = layer.new_cache(2)
        layer(x[:, :prefix], cache)
        accepted = n - prefix
        spec_in = torch.cat([x[:, prefix:n], drafts[:, accepted:]], dim=1)
        spec_out = layer(spec_in, cache)
        assert cache.length == prefix + k
        assert _maxdiff(spec_out[:, :accepted], expected[:, prefix:n]) < TOL
        cache.trim(n)
        assert cache.length == n
        conv, state = plain_states[n]
        assert _maxdiff(cache.conv_state, conv) < TOL and _maxdiff(cache.state, state) < TOL
        rest = [layer(x[:, n : n + 3], cache)]  # a verification-sized step, then decoding
        for pos in range(n + 3, total):
            rest.append(layer(x[:, pos : pos + 1], cache))
        assert _maxdiff(torch.cat(rest, 1), expected[:, n:]) < TOL
        conv, state = plain_states[total]
        assert _maxdiff(cache.conv_state, conv) < TOL and _maxdiff(cache.state, state) < TOL


@torch.no_grad()
def test_trim_bounds(layer):
    x = _x(30)
    cache = layer.new_cache(2)
    layer(x[:, :20], cache)  # long: chunked, nothing recorded
    cache.trim(20)  # trimming to the current length is always a no-op
    with pytest.raises(ValueError, match="only return to positions 20..20"):
        cache.trim(19)
    layer(x[:, 20:25], cache)
    for bad in (19, 26, -1):
        with pytest.raises(ValueError, match="cannot trim"):
            cache.trim(bad)
    cache.trim(23)
    cache.trim(21)  # still inside the recorded span
    with pytest.raises(ValueError):
        cache.trim(22)  # beyond the new length
    cache.trim(20)
    assert cache.length == 20
    layer(x[:, 20:21], cache)
    with pytest.raises(ValueError):
        cache.trim(19)  # the span is now the last forward only


@torch.no_grad()
def test_reset_leaks_no_state(layer):
    first, second = _x(25, seed=11), _x(12, seed=12)
    fresh = layer.new_cache(2)
    expected = torch.cat([layer(second[:, :8], fresh), layer(second[:, 8:], fresh)], 1)
    cache = layer.new_cache(2)
    layer(first[:, :20], cache)
    layer(first[:, 20:], cache)
    cache.trim(22)
    cache.reset()
    assert cache.length == 0
    got = torch.cat([layer(second[:, :8], cache), layer(second[:, 8:], cache)], 1)
    assert _maxdiff(got, expected) < 1e-6
    assert torch.equal(cache.state, fresh.state) and torch.equal(cache.conv_state, fresh.conv_state)
    cache.reset()
    with pytest.raises(ValueError):
        cache.trim(1)
