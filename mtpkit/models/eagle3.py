"""EAGLE-3 draft head for Llama-family trunks, as vLLM's ``Eagle3LlamaForCausalLM`` runs it.

The trunk hands the head three of its residual-stream states (low, middle, high). Layer id L
is the state entering trunk layer L (L = num_hidden_layers: the last layer's output, before
the final norm); vLLM collects ``hidden + residual`` at those points and llama.cpp reads
layer L's input, the same vectors. A draft step at position i then runs

    g_i   = fc(concat[a_low, a_mid, a_high])                 (first step: the trunk's states)
    g_i   = the previous step's pre-norm output              (chained steps)
    r     = g_i + attn(concat[input_layernorm(emb(t_{i+1})), hidden_norm(g_i)])   (q/k/v: 2d)
    r     = r + mlp(post_attention_layernorm(r))             (the pre-norm output, chained)
    draft = d2t-mapped argmax of lm_head(norm(r))            (a reduced draft vocabulary)

``fc`` runs only on the trunk's states; chained steps feed the block's pre-norm state back,
as vLLM's proposer and llama.cpp's draft-eagle3 do. The head has its own ``lm_head`` over
``draft_vocab_size`` rows; draft row j is target token ``j + d2t[j]``. It shares the trunk's
embedding. Module names below ``mtp.*`` are ours; ``export-head --format eagle3`` writes
vLLM's (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .cache import KVCache
from .layers import MLP, RMSNorm
from .mtp import MTPSpec

HEAD_TYPE = "eagle3"


def is_eagle3(head) -> bool:
    """Whether a model's draft head (``model.mtp``, None without one) is an EAGLE-3 head."""
    return getattr(head, "head_type", None) == HEAD_TYPE


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """vLLM's and llama.cpp's default layer ids for a head that names none."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def check_aux_layers(ids, num_hidden_layers: int) -> list[int]:
    """Three strictly increasing ids in 0..num_hidden_layers, or a ValueError naming them."""
    ids = [int(i) for i in ids]
    # vLLM gathers the states in layer order, llama.cpp in the listed order: only an
    # increasing list means the same fc input to both.
    if (len(ids) != 3 or ids != sorted(set(ids)) or ids[0] < 0
            or ids[-1] > num_hidden_layers):
        raise ValueError(
            f"EAGLE-3 aux layer ids {ids}: need three increasing ids in 0..{num_hidden_layers} "
            f"(the trunk's layer count), e.g. {default_aux_layers(num_hidden_layers)}")
    return ids


class Eagle3Layer(nn.Module):
    """The head's one decoder layer: attention over [norm(embedding), norm(state)]."""

    def __init__(self, cfg) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        # vLLM builds Llama attention here (no bias, no q/k norm) whatever the trunk has.
        self.self_attn = Attention(d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * d, a.num_heads * a.head_dim, bias=False)
        a.k_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=False)
        a.v_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def forward(self, emb, g, cos, sin, cache) -> torch.Tensor:
        """emb, g [B, T, D] -> the pre-norm output [B, T, D]."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)
        r = g + self.self_attn(x, cos, sin, cache)
        return r + self.mlp(self.post_attention_layernorm(r))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """The layer's KV cache."""
        return self.self_attn.new_cache(batch, max_len)


class Eagle3Head(nn.Module):
    """fc over three trunk states, one Eagle3Layer, final norm, own lm_head and d2t."""

    head_type = HEAD_TYPE

    def __init__(self, cfg, aux_layers, draft_vocab_size: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.aux_layers = check_aux_layers(aux_layers, cfg.num_hidden_layers)
        # trunk_hidden "aux": TrunkOutput.aux, the three states side by side [B, T, 3D].
        self.spec = MTPSpec(1, trunk_hidden="aux", chain_hidden="pre_norm",
                            eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab_size, bias=False)
        self.heads = nn.ModuleDict()  # no per-layer copies of the target's lm_head
        # A parameter (not a buffer) so that checkpoint loading reads it like the weights.
        self.d2t = nn.Parameter(torch.zeros(draft_vocab_size, dtype=torch.long),
                                requires_grad=False)

    def layer_for(self, step: int) -> int:
        """One layer runs every step."""
        return 0

    def own_head(self, step: int):
        """Not a full-vocabulary output head: callers score drafts with ``logits`` and map
        rows with ``target_ids`` (the drafter and teacher eval do)."""
        raise ValueError("an EAGLE-3 head scores drafts over its own draft vocabulary "
                         "(Eagle3Head.logits, rows mapped by target_ids), not the target's")

    def target_ids(self) -> torch.Tensor:
        """The target token id of each draft row: j + d2t[j]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_vocab(self, token_ids) -> None:
        """Draft rows for these target ids (kept in increasing order)."""
        ids = sorted(int(t) for t in token_ids)
        if len(ids) != self.d2t.numel() or len(set(ids)) != len(ids):
            raise ValueError(f"the draft vocabulary needs {self.d2t.numel()} distinct token "
                             f"ids, got {len(ids)}")
        # Built where d2t lives: a head made on the GPU gets its ids there.
        t = torch.tensor(ids, dtype=torch.long, device=self.d2t.device)
        with torch.no_grad():
            self.d2t.copy_(t - torch.arange(len(ids), device=t.device))

    def forward(self, emb, hidden, step, cos, sin, cache: KVCache | None, start: int = 0):
        """emb [B, T, D]; hidden: trunk states [B, T, 3D] at step 0, else the head's own
        [B, T, D] -> (state after the final norm, before it)."""
        g = self.fc(hidden) if step == 0 else hidden
        x = self.layers[0](emb, g, cos, sin, cache)
        return self.norm(x), x

    def logits(self, post: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (fp32) for states after the final norm."""
        return self.lm_head(post).float()
