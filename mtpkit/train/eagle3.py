"""Training an EAGLE-3 head (models/eagle3.py) against a frozen Llama-family trunk.

The loss is calibrate's self-distillation, over the head's own draft vocabulary: at chained
depth d the head reads token i+d (and, past the first depth, its own pre-norm state) and is
scored against the trunk's distribution for the token after it, renormalised on the draft
vocabulary, the only tokens the head can draft.
"""

from __future__ import annotations

import torch

from ..models.eagle3 import HEAD_TYPE, Eagle3Head, default_aux_layers
from .heads import HEAD_FORMAT_VERSION


def new_head(model, vocab: list[int], aux_layers=None) -> Eagle3Head:
    """A new EAGLE-3 head on ``model`` (replacing any head), drafting from ``vocab``.

    It starts as "the trunk's layer after the high state, then its final norm and lm_head":
    fc passes the highest aux state on (so the residual has the size that layer met), q/k/v
    read only the state half of their input, and the layer, norm and lm_head rows are copied
    from the trunk.
    """
    from ..models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or model.config.model_type == "mimo":
        raise ValueError(f"EAGLE-3 heads are built for Llama-family trunks (llama, qwen2, "
                         f"qwen3); this trunk is {model.config.model_type!r}: use "
                         "--head-type mtp")
    cfg = model.config
    n = cfg.num_hidden_layers
    ids = list(aux_layers) if aux_layers else default_aux_layers(n)
    dev = model.model.embed_tokens.weight.device
    head = Eagle3Head(cfg, ids, len(vocab)).to(dev)
    head.set_vocab(vocab)
    model.mtp = head
    d = cfg.hidden_size
    # The trunk layer whose input the high state is (the last one past the end).
    src = model.model.layers[min(head.aux_layers[-1], n - 1)]
    layer = head.layers[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        fc = torch.zeros(d, 3 * d)
        fc[:, 2 * d:] = torch.eye(d)
        head.fc.weight.copy_(fc + torch.randn(d, 3 * d, generator=g) * (0.02 / d**0.5))
        for name in ("q_proj", "k_proj", "v_proj"):
            w = _dense(getattr(src.self_attn, name))
            getattr(layer.self_attn, name).weight.copy_(torch.cat([torch.zeros_like(w), w], 1))
        layer.self_attn.o_proj.weight.copy_(_dense(src.self_attn.o_proj))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(_dense(getattr(src.mlp, name)))
        layer.input_layernorm.weight.fill_(1.0)
        # The state half of q/k/v's input plays the copied layer's input_layernorm.
        layer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        head.norm.weight.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(_dense_rows(model.lm_head, head.target_ids()))
    return head


def _dense(lin) -> torch.Tensor:
    w = lin.dequantize() if hasattr(lin, "dequantize") else lin.weight
    return w.detach().float()


def _dense_rows(lin, rows: torch.Tensor) -> torch.Tensor:
    from ..quant.linear import linear_rows

    return _dense(linear_rows(lin, rows))


def loss(model, ids: torch.Tensor, depth: int, head=None) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy over the draft vocabulary, summed over chained depths; top-1
    agreement at depth 1 (the draft mapped to its token id against the trunk's greedy token
    over the whole vocabulary)."""
    from .calibrate import chained_head_logits

    own = model.mtp
    head = head if head is not None else own
    vocab = own.target_ids()
    with torch.no_grad():
        out = model(ids)
        full = model.logits(out.hidden)
        greedy = full.argmax(-1)
        teacher = torch.log_softmax(full[..., vocab], dim=-1)
        del full
    total = torch.zeros((), device=ids.device)
    agree = count = 0
    for d, n, logits in chained_head_logits(model, head, ids, out.aux, depth,
                                            lambda post, step: own.logits(post)):
        target = teacher[:, d : d + n]
        total = total - (target.exp() * torch.log_softmax(logits, -1)).sum(-1).mean()
        if d == 1:
            agree = int((vocab[logits.argmax(-1)] == greedy[:, d : d + n]).sum())
            count = logits.shape[0] * n
    return total, agree, count


def head_config(model) -> dict:
    """The head_config.json keys that say an EAGLE-3 head and how to build it."""
    head = model.mtp
    return {"format": "mtpkit-head", "version": HEAD_FORMAT_VERSION, "head_type": HEAD_TYPE,
            "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
            "draft_vocab_size": int(head.d2t.numel())}
