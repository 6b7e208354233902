"""Step-3.5 / 3.7-Flash beyond the shared family table: the release's config spelling read as
transformers reads it, and each MTP layer against transformers' own MtpLayer."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from tiny import STEP_MTP_LAYERS, VOCAB

from mtpkit.checkpoint.hf import text_config
from mtpkit.engine.loader import load_model
from mtpkit.models.config import ConfigError
from mtpkit.models.step3p7 import SLIDING, Step3p7Config


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False)


def test_release_config_is_read_as_transformers_reads_it(checkpoint_factory):
    """Per-layer kinds, heads, rotary and clamps, trunk and MTP layers, from the release's
    spelling (padded lists, attention_other_setting, moe_layers_enum) agree with what
    transformers makes of the same config.json."""
    from transformers import Step3p7Config as HFConfig

    path = checkpoint_factory("step3p7")
    raw = json.loads((path / "config.json").read_text())
    assert "per_layer_config" not in raw["text_config"]  # the release's spelling
    tc = HFConfig(**raw).text_config
    tc.allow_global_per_layer_attribute_access = True
    cfg = Step3p7Config.from_hf_config(text_config(raw))
    n = tc.num_hidden_layers
    assert cfg.num_hidden_layers == n and cfg.num_nextn_predict_layers == STEP_MTP_LAYERS
    assert [s.kind for s in cfg.layers] == tc.layer_types
    assert [s.kind for s in cfg.mtp] == tc.mtp_layer_types
    assert [("sparse" if s.moe else "dense") for s in cfg.layers] == tc.mlp_layer_types
    assert [("sparse" if s.moe else "dense") for s in cfg.mtp] == tc.mtp_mlp_layer_types
    for i, s in enumerate(cfg.layers):
        assert s.heads == tc.per_layer_config[i].num_attention_heads, i
        rope = tc.rope_parameters[s.kind]
        assert s.rope_theta == rope["rope_theta"]
        assert s.rot_dim == int(tc.head_dim * rope.get("partial_rotary_factor", 1.0))
        assert (s.limit or 0) == (tc.swiglu_limits[i] or 0)
        assert (s.shared_limit or 0) == (tc.swiglu_limits_shared[i] or 0)
    assert cfg.sliding_window == tc.sliding_window
    assert cfg.query_pre_attn_scalar == tc.query_pre_attn_scalar
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.share_expert_dim) == (
        tc.n_routed_experts, tc.num_experts_per_tok, tc.share_expert_dim)
    assert cfg.routed_scaling_factor == tc.moe_router_scaling_factor
    # The MTP blocks are sliding layers with the sliding layers' heads (vLLM's, the release's).
    assert all(s.kind == SLIDING and s.heads == tc.num_sliding_attention_heads for s in cfg.mtp)


def test_checkpoint_loads_without_leftovers(checkpoint_factory):
    """Every tensor is used or deliberately skipped (vision tower); all three MTP layers are
    built, and their copies of the lm_head, equal to it, are dropped for the lm_head."""
    loaded = _load(checkpoint_factory("step3p7"))
    assert not loaded.report.unexpected
    assert len(loaded.model.mtp.layers) == STEP_MTP_LAYERS
    m = loaded.model
    assert m.map_checkpoint_name("vision_model.conv1.weight") is None
    assert m.map_checkpoint_name("model.language_model.layers.3.moe.router_bias") == (
        "model.layers.3.moe.gate.e_score_correction_bias")
    assert m.map_checkpoint_name("model.layers.4.transformer.shared_head.norm.weight") == (
        "mtp.norm.weight")
    assert m.map_checkpoint_name("model.layers.6.eh_proj.weight") == "mtp.per_layer.2.fc.weight"
    assert m.map_checkpoint_name("model.layers.5.transformer.self_attn.g_proj.weight") == (
        "mtp.layers.1.self_attn.g_proj.weight")
    assert m.map_checkpoint_name("model.layers.5.transformer.shared_head.output.weight") == (
        "mtp.heads.1.weight")
    assert len(m.mtp.heads) == 0


def test_swiglu_clamps_are_exercised(checkpoint_factory):
    """The tiny checkpoint's limits bite: without them the logits move (so the logit
    comparison with transformers covers the clamps)."""
    model = _load(checkpoint_factory("step3p7")).model
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.logits(model(ids).hidden)
        limited = [m for m in model.model.modules() if getattr(m, "limit", None) is not None]
        assert len(limited) >= 3
        for m in limited:
            m.limit = None
        got = model.logits(model(ids).hidden)
    assert (want - got).abs().max() > 1e-3


@pytest.mark.parametrize("wiring", ["vllm", "transformers"])
def test_mtp_layers_match_transformers_mtp_layer(wiring, checkpoint_factory):
    """Each MTP layer equals transformers' MtpLayer (enorm, hnorm, eh_proj, a Step3p7 decoder
    block, post_norm = shared_head.norm) built on a dense sliding layer's config, given the
    same inputs; chained as mtpkit runs it (vLLM: the trunk's and the blocks' states before
    the final norms) and as transformers' MtpModel chains it (after them)."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.step3p7.modeling_step3p7 import (
        Step3p7DecoderLayer,
        Step3p7ForConditionalGeneration,
        Step3p7RMSNorm,
    )

    path = checkpoint_factory("step3p7")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = Step3p7ForConditionalGeneration.from_pretrained(path).eval()
    model = _load(path).model
    tensors = load_file(path / "model_mtp.safetensors")
    text = ref.model.language_model
    tc = text.config
    n = tc.num_hidden_layers
    dense_sliding = next(i for i in range(n) if tc.layer_types[i] == SLIDING
                         and tc.mlp_layer_types[i] == "dense")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    t = ids.shape[1] - 1
    pos = torch.arange(t)[None]
    q_pos, k_pos = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (k_pos <= q_pos) & (q_pos - k_pos < tc.sliding_window)
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
    pre_norm = {}
    hook = text.norm.register_forward_hook(lambda mod, args, out: pre_norm.update(h=args[0]))
    captured = {}
    with torch.no_grad():
        post = text(ids).last_hidden_state[:, :-1]
        hook.remove()
        first = pre_norm["h"][:, :-1] if wiring == "vllm" else post
        cos_sin = text.rotary_emb(first, pos, SLIDING)
        want_state = got_state = first
        for i in range(STEP_MTP_LAYERS):
            layer = MtpLayer(tc, Step3p7DecoderLayer, Step3p7RMSNorm, dense_sliding).eval()
            p = f"model.layers.{n + i}."
            own = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                   "transformer.shared_head.norm": "post_norm"}
            state = {}
            for k, v in tensors.items():
                if not k.startswith(p) or "shared_head.output" in k:
                    continue
                rest = k[len(p):]
                head = rest.rsplit(".", 1)[0]
                state[f"{own[head]}.weight" if head in own else f"mtp_block.{rest}"] = v
            layer.load_state_dict(state, strict=True)
            hook = layer.mtp_block.register_forward_hook(
                lambda mod, args, out: captured.update(block=out))
            e = ref.model.language_model.embed_tokens(ids[:, 1:])
            y = layer(e, want_state, position_embeddings=cos_sin, attention_mask=mask,
                      position_ids=pos, past_key_values=None)
            hook.remove()
            out = model.mtp_forward(ids[:, 1:], got_state, i, 0, None)
            diff = (model.logits(out.hidden) - ref.lm_head(y)).abs().max()
            assert diff < 1e-4, (i, float(diff))
            if wiring == "vllm":
                want_state, got_state = captured["block"], out.for_mtp("pre_norm")
                assert model.mtp.spec.chain_hidden == "pre_norm"
            else:
                want_state, got_state = y, out.for_mtp("post_norm")


@pytest.mark.parametrize("change,message", [
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"use_rope_layers": [True, False, True, True, True, True, True]}, "use_rope_layers"),
    ({"moe_router_activation": "softmax"}, "moe_router_activation"),
    ({"layer_types": ["minimax_m3_sparse"] * 7}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_unsupported_configs_are_refused(change, message, checkpoint_factory):
    """What transformers does not compute (or mtpkit cannot run as it does) fails loudly."""
    raw = json.loads((checkpoint_factory("step3p7") / "config.json").read_text())
    d = {**text_config(raw), **change}
    with pytest.raises(ConfigError, match=message):
        Step3p7Config.from_hf_config(d)
