"""The MTP draft head shared by every family.

One draft step at positions p..p+T-1 combines, for each position i, the embedding of the
token at i+1 with a hidden state of position i (the trunk's for the first step, the head's own
output when chaining), then runs one decoder block with its own KV cache:

    x_i = fc(concat[norm_e(emb(t_{i+1})), norm_h(h_i)])      (Qwen3-Next / DeepSeek order)
    x_i = fc(concat[norm_h(h_i), norm_e(emb(t_{i+1}))])      (MiMo order)
    g_i = norm(block(x_i))  -> logits by its output head (below) -> a guess for t_{i+2}

Module names are Qwen3.5's ``mtp.*`` names; other layouts are renamed on load by their family.

Several MTP layers: draft step s runs layer ``layer_for(s, n)``: layer s while there is one,
then layers 0, 1... again, as vLLM cycles (every family's head, DeepSeek-V4's included,
calls this one function). Qwen3.5 shares one combine and final norm across its blocks
(``mtp.fc``, ``mtp.layers.{i}``); DeepSeek-style and MiMo layers each carry their own
(``MTPSpec.own_combine``): layer 0's under the shared names, layer i's (i >= 1) under
``mtp.per_layer.{i}.*``.

Output heads: draft logits come from ``CausalLM.draft_logits(state, step)``, which scores
with layer ``layer_for(step)``'s own head ``mtp.heads.{i}`` where it has one, else with the
trunk's lm_head. Only heads whose engine drafts with each layer's own copy build them
(``MTPSpec.own_heads``: Step-3.5 / 3.7's ``transformer.shared_head.output``, which vLLM's
Step3p5MTP proposer keeps); after loading, a copy equal to the lm_head (or absent from the
checkpoint) is dropped and the lm_head serves, so the common case holds no second matrix.
DeepSeek-style and DeepSeek-V4 layers carry copies too (``shared_head.head``, ``mtp.{i}.head``)
but vLLM's MTP proposer replaces each with the trunk's lm_head after loading them, so those
families map them to None and draft with the lm_head as well.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .cache import KVCache
from .layers import RMSNorm
from .moe import split_fused_experts


@dataclass
class MTPSpec:
    """How a family wires its MTP head."""

    num_layers: int
    emb_first: bool = True  # concat order: [embedding, hidden] (False: MiMo's [hidden, emb])
    trunk_hidden: str = "post_norm"  # which trunk state feeds step 0: after or before final norm
    chain_hidden: str = "post_norm"  # which head state feeds the next chained step
    zero_centered: bool = False  # RMSNorm weights stored as w-1 (Qwen3-Next / 3.5)
    eps: float = 1e-6
    # DeepSeek, GLM and MiMo heads were trained (and vLLM runs them) with the embedding at
    # position 0 zeroed: it has no preceding hidden state worth combining with.
    zero_first_embedding: bool = False
    # Every layer has its own combine norms, projection and final norm (DeepSeek-style,
    # MiMo); False: one set shared by every block (Qwen3-Next / 3.5).
    own_combine: bool = False
    # Every layer may score its drafts with its own output head (mtp.heads.{i}), read from
    # the checkpoint's per-layer copy of the lm_head (Step-3.5 / 3.7).
    own_heads: bool = False


def layer_for(step: int, num_layers: int) -> int:
    """The MTP layer that runs draft step ``step``: layer ``step``, then cycling
    (``step % num_layers``), as vLLM does.

    Layer i is trained (DeepSeek-V3's sequential MTP, MiMo's and Step's heads alike) at
    depth i + 1 only, each layer after the first on its predecessor's output. Past the last
    layer, cycling gives every layer but the first that same input again, where reusing the
    last layer would feed it its own output at every further step; on a small trained model
    cycling drafted better from the fourth position on (docs/architecture.md). The drafts
    only decide speed, never the output.
    """
    return step % num_layers


class DraftLayers:
    """What every family's MTP module shares (mixin): which layer and which output head
    serve a draft step."""

    layers: nn.ModuleList
    heads: nn.ModuleDict

    def layer_for(self, step: int) -> int:
        """The MTP layer that runs draft step ``step`` (see ``layer_for``)."""
        return layer_for(step, len(self.layers))

    def own_head(self, step: int) -> nn.Module | None:
        """The output head of draft step ``step``'s layer; None: the trunk's lm_head."""
        key = str(self.layer_for(step))
        return self.heads[key] if key in self.heads else None


class MTPCombine(nn.Module):
    """One MTP layer's own norms, combine projection and final norm (layers 1.. of a head
    whose layers each carry them)."""

    def __init__(self, hidden_size: int, spec: MTPSpec) -> None:
        super().__init__()
        zc = spec.zero_centered
        self.pre_fc_norm_embedding = RMSNorm(hidden_size, spec.eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(hidden_size, spec.eps, zc)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, spec.eps, zc)


class MTPHead(DraftLayers, nn.Module):
    """Combine, one decoder block per layer, final norm; draft step s runs layer_for(s)."""

    def __init__(
        self, hidden_size: int, spec: MTPSpec, make_layer: Callable[[int], nn.Module],
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        zc = spec.zero_centered
        self.pre_fc_norm_embedding = RMSNorm(hidden_size, spec.eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(hidden_size, spec.eps, zc)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList(make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(hidden_size, spec.eps, zc)
        # Layer i's own combine and final norm (i >= 1); layer 0's are the modules above.
        self.per_layer = nn.ModuleDict(
            {str(i): MTPCombine(hidden_size, spec) for i in range(1, spec.num_layers)}
            if spec.own_combine else {}
        )
        # Layer i's own output head; the loader drops those equal to the lm_head or absent
        # from the checkpoint (CausalLM.load_checkpoint), leaving the lm_head to serve.
        if spec.own_heads and vocab_size is None:
            raise ValueError("MTPSpec.own_heads needs the vocabulary size")
        self.heads = nn.ModuleDict(
            {str(i): nn.Linear(hidden_size, vocab_size, bias=False)
             for i in range(spec.num_layers)} if spec.own_heads else {}
        )

    def parts(self, i: int) -> nn.Module:
        """The module holding layer i's combine norms, ``fc`` and final ``norm``."""
        return self.per_layer[str(i)] if str(i) in self.per_layer else self

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        step: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, hidden [B, T, D] at positions start.. -> (state after the final norm, before)."""
        if self.spec.zero_first_embedding and start == 0:
            emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)
        i = self.layer_for(step)
        p = self.parts(i)
        e, h = p.pre_fc_norm_embedding(emb), p.pre_fc_norm_hidden(hidden)
        x = p.fc(torch.cat([e, h] if self.spec.emb_first else [h, e], dim=-1))
        x = self.layers[i](x, cos, sin, cache)
        return p.norm(x), x


# DeepSeek-style names of an MTP layer's own modules (below model.layers.{L}) -> MTPHead names.
NEXTN_NAMES = {
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "eh_proj": "fc",
    "shared_head.norm": "norm",
}


# MiMo's names below model.mtp_layers.{i} -> MTPHead names (the block's own names sit
# directly under model.mtp_layers.{i} as well).
MIMO_NAMES = {
    "token_layernorm": "pre_fc_norm_embedding",
    "hidden_layernorm": "pre_fc_norm_hidden",
    "input_proj": "fc",
    "final_layernorm": "norm",
}


def own_name(i: int, name: str) -> str:
    """``mtp.*`` name of layer i's own combine / final-norm module ``name`` (fc, norm...)."""
    return f"mtp.{name}" if i == 0 else f"mtp.per_layer.{i}.{name}"


def map_mimo_name(name: str) -> str:
    """``model.mtp_layers.{i}.*`` (MiMo) -> ``mtp.*``; other names unchanged."""
    m = re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", name)
    if not m:
        return name
    for old, new in MIMO_NAMES.items():
        if m[2] == f"{old}.weight":
            return own_name(int(m[1]), f"{new}.weight")
    return f"mtp.layers.{m[1]}.{m[2]}"


def map_nextn_name(name: str, num_hidden_layers: int, num_mtp_layers: int | None = None):
    """``model.layers.{num_hidden_layers + i}.*`` (DeepSeek / GLM / GGUF nextn) -> ``mtp.*``.

    Returns the name unchanged when it is not an MTP layer's (or belongs to a layer at or past
    ``num_mtp_layers``, which the caller then reports as unused), None for the copies of the
    trunk's lm_head / embedding that such a layer may carry: vLLM's MTP proposer replaces a
    DeepSeek-style layer's shared_head.head with the trunk's lm_head after loading it, so the
    drafts are scored by the lm_head here too.
    """
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if not m or int(m[1]) < num_hidden_layers:
        return name
    i, rest = int(m[1]) - num_hidden_layers, m[2]
    if num_mtp_layers is not None and i >= num_mtp_layers:
        return name
    for old, new in NEXTN_NAMES.items():
        if rest == f"{old}.weight":
            return own_name(i, f"{new}.weight")
    if rest.startswith(("shared_head.head", "embed_tokens")):
        return None
    return f"mtp.layers.{i}.{rest}"


def deepseek_mtp_spec(num_layers: int, eps: float) -> MTPSpec:
    """How DeepSeek-V3 and GLM-4.5 wire their MTP layer (shared by both families)."""
    # The first draft step reads the trunk's state after its final norm, as vLLM feeds it.
    # Chaining feeds back the MTP block's output BEFORE shared_head.norm: vLLM's
    # DeepSeekMultiTokenPredictorLayer returns that state and applies shared_head.norm only
    # in compute_logits, and the DeepSeek-V3 report defines depth k's input as depth k-1's
    # block output. (transformers' generic MtpLayer chains the normed state instead; the
    # releases were tuned and measured with vLLM / SGLang, so we follow them.)
    return MTPSpec(num_layers, emb_first=True, trunk_hidden="post_norm",
                   chain_hidden="pre_norm", eps=eps, zero_first_embedding=True,
                   own_combine=True)


class DeepSeekStyleMTP:
    """Loading shared by families whose MTP layers sit at model.layers.{L + i} (mixin)."""

    def build_mtp(self, cfg, make_layer) -> MTPHead | None:
        """The MTP head the config declares: every layer, each with its own combine."""
        if not cfg.num_nextn_predict_layers:
            return None
        spec = deepseek_mtp_spec(cfg.num_nextn_predict_layers, cfg.rms_norm_eps)
        return MTPHead(cfg.hidden_size, spec, make_layer)

    def map_checkpoint_name(self, name: str) -> str | None:
        """model.layers.{num_hidden_layers + i}.* -> mtp.*; the rest as the base class maps."""
        mapped = map_nextn_name(name, self.config.num_hidden_layers,
                                self.config.num_nextn_predict_layers)
        return super().map_checkpoint_name(name) if mapped == name else mapped

    def split_checkpoint_tensor(self, name: str, tensor_fn):
        """Experts stored stacked (gate_up_proj [E, 2I, H], down_proj) -> per-expert MLPs."""
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return split_fused_experts(name, tensor_fn)
        return None
