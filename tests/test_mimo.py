"""MiMo's MTP layer against a plain implementation (reversed concatenation, final norm)."""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny import VOCAB

from mtpkit.engine.loader import load_model


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mimo_mtp_layer_matches_plain_formula(checkpoint_factory):
    """logits = lm_head(final_ln(block(input_proj([hidden_ln(h_t), token_ln(emb(t+1))])))),
    the embedding at position 0 zeroed, the block being transformers' own Qwen2 layer."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    path = checkpoint_factory("mimo")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "mimo"
    tensors = {**load_file(path / "model.safetensors"), **load_file(path / "model_mtp.safetensors")}
    p = "model.mtp_layers.0."
    assert p + "input_proj.weight" in tensors and not any(k.startswith("mtp.") for k in tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(path, tokenizer=False).model
    hf_cfg = Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    block = Qwen2DecoderLayer(hf_cfg, layer_idx=0).eval()
    own = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    block.load_state_dict({k[len(p):]: v for k, v in tensors.items()
                           if k.startswith(p) and not k[len(p):].startswith(own)}, strict=True)
    eps = cfg["rms_norm_eps"]
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(ids)
        h = out.hidden[:, :-1]
        e = tensors["model.embed_tokens.weight"][ids[:, 1:]].clone()
        e[:, 0] = 0
        x = F.linear(torch.cat([_rms(h, tensors[p + "hidden_layernorm.weight"], eps),
                                _rms(e, tensors[p + "token_layernorm.weight"], eps)], -1),
                     tensors[p + "input_proj.weight"])
        pos = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        y = block(x, attention_mask=mask, position_ids=pos,
                  position_embeddings=Qwen2RotaryEmbedding(hf_cfg)(x, pos))
        want = F.linear(_rms(y, tensors[p + "final_layernorm.weight"], eps),
                        tensors["lm_head.weight"])
        got = model.mtp_forward(ids[:, 1:], h, 0, 0, model.new_mtp_cache(64))
    assert (model.logits(got.hidden) - want).abs().max() < 1e-4


def test_mimo_v2_flash_mtp_layers_match_plain_formula(checkpoint_factory):
    """MiMo-V2-Flash layer i (model.mtp.layers.{i}.*, vLLM's names): logits =
    lm_head(final_ln(block(eh_proj([enorm(emb(t+1)), hnorm(h_t)])))), the block being
    transformers' own sliding-window dense layer with sinks; draft step i runs layer i and
    chains final_layernorm's output."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
        MiMoV2FlashDecoderLayer,
    )

    path = checkpoint_factory("mimo_v2_flash")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 3
    tensors = {**load_file(path / "model.safetensors"), **load_file(path / "model_mtp.safetensors")}
    assert not any(k.startswith("mtp.") for k in tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        loaded = load_model(path, tokenizer=False)
    model = loaded.model
    assert not loaded.report.unexpected and len(model.mtp.layers) == 3
    eps = cfg["rms_norm_eps"]
    types = zip(ref.config.layer_types, ref.config.mlp_layer_types, strict=True)
    dense_sliding = next(i for i, kinds in enumerate(types)
                         if kinds == ("sliding_attention", "dense"))
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    t = ids.shape[1] - 1
    pos = torch.arange(t)[None]
    # transformers' sliding window: query q sees keys q-window+1..q.
    q_pos, k_pos = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (k_pos <= q_pos) & (q_pos - k_pos < ref.config.sliding_window)
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        h = ref.model(ids).last_hidden_state[:, :-1]
        cos_sin = ref.model.rotary_emb(h, pos, "sliding_attention")
        state, got_state = h, h
        for i in range(3):
            p = f"model.mtp.layers.{i}."
            block = MiMoV2FlashDecoderLayer(ref.config, layer_idx=dense_sliding).eval()
            own = ("enorm", "hnorm", "eh_proj", "final_layernorm")
            block.load_state_dict({
                k[len(p):].replace("pre_mlp_layernorm", "post_attention_layernorm")
                .replace("attention_sink_bias", "sinks"): v
                for k, v in tensors.items() if k.startswith(p) and not k[len(p):].startswith(own)
            }, strict=True)
            e = tensors["model.embed_tokens.weight"][ids[:, 1:]]
            x = F.linear(torch.cat([_rms(e, tensors[p + "enorm.weight"], eps),
                                    _rms(state, tensors[p + "hnorm.weight"], eps)], -1),
                         tensors[p + "eh_proj.weight"])
            y = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            state = _rms(y, tensors[p + "final_layernorm.weight"], eps)
            want = F.linear(state, tensors["lm_head.weight"])
            out = model.mtp_forward(ids[:, 1:], got_state, i, 0, None)
            assert (model.logits(out.hidden) - want).abs().max() < 1e-4, i
            got_state = out.for_mtp(model.mtp.spec.chain_hidden)
