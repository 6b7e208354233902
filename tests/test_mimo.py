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
