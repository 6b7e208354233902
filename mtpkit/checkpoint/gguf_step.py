"""GGUF output and input for the families with several MTP layers: Step-3.5 / 3.7-Flash
(mtpkit ``step3p5`` / ``step3p7``) as llama.cpp's ``step35`` architecture, and MiMo-V2-Flash
(``mimo_v2_flash``) as ``mimo2`` (below), each with all of its MTP layers.

What llama.cpp's loader reads (src/models/step35.cpp) and its converter writes
(conversion/step3.py), beside what ``gguf.py`` does for every family:

- Per-layer query head counts (sliding layers may have more), one KV head count, and
  ``sliding_window_pattern`` saying which layers (MTP layers included) are sliding ones.
- Rotary: full-attention layers rotate half of ``rope.dimension_count`` (head_dim when
  absent) at ``rope.freq_base``; sliding layers rotate ``rope.dimension_count_swa``
  (``rope.dimension_count`` when absent) at ``rope.freq_base_swa``. One setting per layer
  type, so per-layer lists that vary within a type have no GGUF form.
- Llama-3 RoPE scaling of the full-attention layers (Step's default scaled layer type) is the
  one scaling step35 holds: one ``rope_freqs.weight`` of per-pair frequency divisors, which
  its graph applies to non-sliding blocks only (MTP blocks included), with no scaling key
  (any rope.scaling.* key would reach every layer). The divisors are those mtpkit's rotary
  computes; the scaling's parameters, which they cannot be read back from, are written
  beside them as ``rope.scaling.llama3.*`` keys (llama.cpp reads none of them).
- Attention scores are scaled by head_dim ** -0.5; the output gate is one sigmoid logit per
  head (``attn_gate``, Step's ``g_proj``).
- Every RMSNorm is zero-centred (x * (1 + w)) and is stored as ``w + 1``.
- MoE: stacked experts, sigmoid routing whose bias (``router_bias``) is ``exp_probs_b.bias``,
  a shared expert on every MoE layer. Dense or MoE is decided per layer by which tensors
  the block holds, so dense layers need not lead. ``swiglu_clamp_exp`` /
  ``swiglu_clamp_shexp`` clamp silu(gate) from above and up to [-L, L] as Step does (the
  second also in dense MLPs), 0 meaning none.
- MTP layer i is block ``n + i`` with ``blk.{n+i}.nextn.{eh_proj, enorm, hnorm,
  shared_head_norm}``. Its embedding and head fall back to the trunk's; the release's
  per-layer copies of the lm_head (``shared_head.output``) are written as
  ``nextn.shared_head_head`` only where they differ from it (llama.cpp, as vLLM, scores a
  layer's drafts with its own head where there is one). llama.cpp chains the layers
  as vLLM's Step3p5MTP does: layer 0 reads the trunk's state before the final norm, layer
  i + 1 the output of layer i before its shared_head norm, draft step i runs layer i.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gguf import GGUFWriter

STEP_ARCHS = {"step35"}
STEP_MODEL_TYPES = {"step3p5": "step35", "step3p7": "step35"}
_FULL, _SLIDING = "full_attention", "sliding_attention"

# Below the layer prefix: mtpkit / release name -> GGUF block tensor base.
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.g_proj": "attn_gate",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "moe.gate": "ffn_gate_inp",
    "moe.gate_proj": "ffn_gate_exps",  # experts stacked: [expert, out, in]
    "moe.up_proj": "ffn_up_exps",
    "moe.down_proj": "ffn_down_exps",
    "share_expert.gate_proj": "ffn_gate_shexp",
    "share_expert.up_proj": "ffn_up_shexp",
    "share_expert.down_proj": "ffn_down_shexp",
}
# An MTP layer's own modules: mtpkit's mtp.* name -> (GGUF nextn key, release name).
_NEXTN = {
    "fc": ("eh_proj", "eh_proj"),
    "pre_fc_norm_embedding": ("enorm", "enorm"),
    "pre_fc_norm_hidden": ("hnorm", "hnorm"),
    "norm": ("shared_head_norm", "shared_head.norm"),
}
_ROUTER_BIAS = "moe.gate.e_score_correction_bias"  # mtpkit's name of the release's router_bias


def parse(cfg: dict):
    """The mtpkit config of a Step checkpoint (either spelling)."""
    from ..models.step3p7 import Step3p7Config

    return Step3p7Config.from_hf_config(cfg)


def check(s, n_mtp: int) -> None:
    """ValueError where llama.cpp's step35 would not load the file or would decode it
    otherwise than the checkpoint."""
    no_form = "this checkpoint has no step35 GGUF form; serve the folder with mtpkit instead"
    if s.gate == "elementwise":
        raise ValueError("the attention gate is elementwise (one logit per channel); llama.cpp's "
                         f"step35 gates each head by one logit (attn_gate); {no_form}")
    if s.attention_bias:
        raise ValueError("attention_bias: llama.cpp's step35 loads no o_proj bias; "
                         f"{no_form}")
    if s.query_pre_attn_scalar != s.head_dim:
        raise ValueError(
            f"query_pre_attn_scalar {s.query_pre_attn_scalar:g} differs from head_dim "
            f"{s.head_dim}: llama.cpp's step35 scales attention scores by head_dim ** -0.5; "
            f"{no_form}")
    layers = s.layers + s.mtp[:n_mtp]
    _check_scaling(layers, no_form)
    for kind in (_FULL, _SLIDING):
        of_kind = [x for x in layers if x.kind == kind]
        for what, values in (("rope_theta", {x.rope_theta for x in of_kind}),
                             ("rotary width", {x.rot_dim for x in of_kind})):
            if len(values) > 1:
                raise ValueError(
                    f"{kind} layers differ in {what} ({sorted(values)}): llama.cpp's step35 "
                    f"has one per layer type (freq_base / freq_base_swa, dimension_count / "
                    f"dimension_count_swa); {no_form}")
    full = [x.rot_dim for x in layers if x.kind == _FULL]
    if full and 2 * full[0] > s.head_dim:
        raise ValueError(
            f"full-attention layers rotate {full[0]} of {s.head_dim} channels: llama.cpp's "
            "step35 rotates half of rope.dimension_count there, which would exceed the head; "
            f"{no_form}")


# Llama-3 scaling's parameters, as written beside rope_freqs (HF name -> GGUF key).
_LLAMA3 = {
    "factor": "{arch}.rope.scaling.llama3.factor",
    "low_freq_factor": "{arch}.rope.scaling.llama3.low_freq_factor",
    "high_freq_factor": "{arch}.rope.scaling.llama3.high_freq_factor",
    "original_max_position_embeddings": "{arch}.rope.scaling.llama3.original_context_length",
}
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _kind_of(scaling: dict) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _check_scaling(layers: list, no_form: str) -> None:
    """ValueError for RoPE scaling step35 cannot hold: anything but one Llama-3 scaling on
    the full-attention layers alone."""
    scaled = [x for x in layers if x.rope_scaling]
    if not scaled:
        return
    kinds = sorted({_kind_of(x.rope_scaling) for x in scaled})
    if kinds != ["llama3"]:
        raise ValueError(
            f"rope scaling {', '.join(kinds)}: llama.cpp's step35 holds Llama-3 scaling only "
            "(as rope_freqs, on full-attention layers); a rope.scaling type reaches every "
            f"layer (YaRN's attention factor the sliding ones too) while Step scales some "
            f"layer types only; {no_form}")
    if any(x.kind == _SLIDING for x in scaled):
        raise ValueError(
            "rope scaling on sliding-attention layers: llama.cpp's step35 applies rope_freqs "
            f"to full-attention layers only; {no_form}")
    full = [x for x in layers if x.kind == _FULL]
    params = {json.dumps(_llama3_params(x.rope_scaling), sort_keys=True) if x.rope_scaling
              else None for x in full}
    if len(params) > 1:
        raise ValueError(
            "full-attention layers differ in rope scaling: llama.cpp's step35 has one "
            f"rope_freqs for all of them; {no_form}")


def _llama3_params(scaling: dict) -> dict:
    """The Llama-3 scaling's parameters (ValueError naming a missing one)."""
    out = {k: scaling.get(k, _LLAMA3_DEFAULTS.get(k)) for k in _LLAMA3}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise ValueError(f"llama3 rope scaling without {', '.join(missing)}")
    return {k: float(v) for k, v in out.items()}


def rope_freqs(cfg: dict) -> list[tuple[str, torch.Tensor]]:
    """``rope_freqs.weight`` for a Step config with Llama-3 scaling (none without): per
    rotated pair of the full-attention layers, the divisor that turns their unscaled
    frequency into the scaled one, 1 past their width, as long as llama.cpp's loader
    expects (half the widest trunk layer's rotary width)."""
    from ..models.layers import rope_inv_freq

    s = parse(cfg)
    full = next((x for x in s.layers if x.kind == _FULL and x.rope_scaling), None)
    if full is None:
        return []
    plain = rope_inv_freq(full.rot_dim, full.rope_theta, None).double()
    scaled = rope_inv_freq(full.rot_dim, full.rope_theta, full.rope_scaling).double()
    width = max(x.rot_dim for x in s.layers) // 2
    divisors = torch.ones(width, dtype=torch.float64)
    divisors[: plain.numel()] = plain / scaled
    return [("rope_freqs.weight", divisors.float())]


def write_metadata(w: GGUFWriter, cfg: dict, n_layer: int, n_mtp: int,
                   vocab_size: int | None) -> None:
    """Every step35 key llama.cpp's loader reads (ValueError for configs it cannot run)."""
    from gguf import ExpertGatingFuncType

    s = parse(cfg)
    if n_mtp > len(s.mtp):
        raise ValueError(f"the checkpoint holds {n_mtp} MTP layers but its config declares "
                         f"{len(s.mtp)}; their attention and MLP kinds are unknown")
    check(s, n_mtp)
    layers = s.layers + s.mtp[:n_mtp]
    _write_sizes(w, s, n_layer, n_mtp)
    w.add_head_count([x.heads for x in layers])
    w.add_head_count_kv([s.num_key_value_heads] * len(layers))
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    full = next((x for x in layers if x.kind == _FULL), None)
    swa = next((x for x in layers if x.kind == _SLIDING), None)
    # llama.cpp halves rope.dimension_count for full layers and reads the sliding layers'
    # width from rope.dimension_count_swa, falling back to rope.dimension_count (head_dim
    # when absent): written only where these defaults are not the checkpoint's, as the
    # converter (which knows the release's half / whole arrangement only) leaves them out.
    dim = s.head_dim if full is None else 2 * full.rot_dim
    if dim != s.head_dim:
        w.add_rope_dimension_count(dim)
    if swa is not None and swa.rot_dim != dim:
        w.add_rope_dimension_count_swa(swa.rot_dim)
    w.add_rope_freq_base((full or swa).rope_theta)
    if swa is not None:
        w.add_rope_freq_base_swa(swa.rope_theta)  # llama.cpp's default is 10000
        w.add_sliding_window(int(s.sliding_window))
    w.add_sliding_window_pattern([x.kind == _SLIDING for x in layers])
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    if vocab_size is not None:
        w.add_vocab_size(int(vocab_size))
    moe = [i for i, x in enumerate(s.layers) if x.moe]
    # Metadata only (llama.cpp picks dense or MoE per layer by its tensors), as the
    # converter computes it: the first MoE layer's index.
    w.add_leading_dense_block_count(moe[0] if moe else n_layer)
    if any(x.moe for x in layers):
        w.add_expert_count(s.n_routed_experts)
        w.add_expert_used_count(s.num_experts_per_tok)
        w.add_expert_feed_forward_length(s.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(s.share_expert_dim)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(s.routed_scaling_factor)
        w.add_expert_weights_norm(s.norm_topk_prob)
    if any(x.limit for x in layers):
        w.add_swiglu_clamp_exp([x.limit or 0.0 for x in layers])
    if any(x.shared_limit for x in layers):
        w.add_swiglu_clamp_shexp([x.shared_limit or 0.0 for x in layers])
    scaled = next((x for x in layers if x.rope_scaling), None)
    if scaled is not None:
        for key, value in _llama3_params(scaled.rope_scaling).items():
            w.add_float32(_LLAMA3[key].format(arch=w.arch), value)


@functools.cache
def _global_names() -> tuple[dict, dict]:
    """gguf.py's names outside the blocks: GGUF -> HF, and HF -> GGUF."""
    from .gguf import _GLOBAL  # imported here: gguf.py imports this module

    return _GLOBAL, {hf: g for g, hf in _GLOBAL.items()}


def _write_sizes(w: GGUFWriter, s, n_layer: int, n_mtp: int) -> None:
    """Block count (MTP blocks included), context, embedding and dense MLP widths."""
    w.add_block_count(n_layer + n_mtp)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    w.add_context_length(int(s.max_position_embeddings))
    w.add_embedding_length(s.hidden_size)
    if s.intermediate_size:
        w.add_feed_forward_length(s.intermediate_size)


def own_head(hf_name: str, n_layer: int) -> str | None:
    """The nextn name of MTP layer i's own output head (``mtp.heads.{i}``); None for others.
    Written only where it differs from the lm_head: llama.cpp falls back to the trunk's."""
    m = re.fullmatch(r"mtp\.heads\.(\d+)\.weight", hf_name)
    return None if m is None else f"blk.{n_layer + int(m[1])}.nextn.shared_head_head.weight"


def convert(hf_name: str, t: torch.Tensor, n_layer: int) -> list[tuple[str, torch.Tensor]]:
    """One tensor in mtpkit's Step names (what ``map_checkpoint_name`` gives) -> GGUF."""
    stem, _, param = hf_name.rpartition(".")
    glob = _global_names()[1].get(stem)
    if glob is not None:
        return [(f"{glob}.{param}", _to_gguf(glob, t))]
    own = re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)", stem)
    if own and own[2] in _NEXTN:
        key = _NEXTN[own[2]][0]
        return [(f"blk.{n_layer + int(own[1] or 0)}.nextn.{key}.{param}", _to_gguf(key, t))]
    m = re.fullmatch(r"(model|mtp)\.layers\.(\d+)\.(.+)", hf_name)
    if m is None:
        raise ValueError(f"no step35 GGUF name for tensor {hf_name!r}")
    bid = int(m[2]) + (n_layer if m[1] == "mtp" else 0)
    if m[3] == _ROUTER_BIAS:
        return [(f"blk.{bid}.exp_probs_b.bias", t)]
    sub, _, param = m[3].rpartition(".")
    base = _BLOCK.get(sub)
    if base is None:
        raise ValueError(f"no step35 GGUF name for tensor {hf_name!r}")
    return [(f"blk.{bid}.{base}.{param}", _to_gguf(base, t))]


def _to_gguf(base: str, t: torch.Tensor) -> torch.Tensor:
    return t + 1 if base.endswith("norm") else t


# ---------------------------------------------------------------------------------------------
# Reading: the same rules backwards, to the release's names (which Step3p7ForCausalLM maps).

_READ_BLOCK = {base: sub for sub, base in _BLOCK.items()}
_READ_NEXTN = {key: release for key, release in _NEXTN.values()}
_READ_NEXTN.update(shared_head_head="shared_head.output", embed_tokens="embed_tokens")


def read_name(gname: str, n_layer: int):
    """GGUF tensor name -> (release name, value change or None); None for names Step has
    none for."""
    stem, _, param = gname.rpartition(".")
    glob = _global_names()[0].get(stem)
    if glob is not None:
        return f"{glob}.{param}", _from_gguf(stem)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", stem)
    if m is None:
        return None
    prefix, base = f"model.layers.{m[1]}", m[2]
    if base == "exp_probs_b" and param == "bias":
        return f"{prefix}.moe.router_bias", None
    if base.startswith("nextn.") and int(m[1]) >= n_layer:
        key = base[len("nextn."):]
        if key in _READ_NEXTN:
            return f"{prefix}.{_READ_NEXTN[key]}.{param}", _from_gguf(key)
        return None
    if base in _READ_BLOCK:
        return f"{prefix}.{_READ_BLOCK[base]}.{param}", _from_gguf(base)
    return None


def _from_gguf(base: str):
    return (lambda t: t - 1) if base.endswith("norm") else None


def read_config(md, n_layer: int, n_mtp: int, has_tensor) -> dict[str, Any]:
    """The HF config fields (transformers' spelling, per-layer lists covering the MTP layers
    too) of a step35 file; ``md(key_template, default)`` reads its metadata."""
    from gguf import Keys

    total = n_layer + n_mtp
    per_layer = _per_layer_reader(md, "step35", "Step", total)

    heads = per_layer(Keys.Attention.HEAD_COUNT, 0)
    kv = per_layer(Keys.Attention.HEAD_COUNT_KV, heads[0])
    head_dim = int(md(Keys.Attention.KEY_LENGTH))
    pattern = per_layer(Keys.Attention.SLIDING_WINDOW_PATTERN, False)
    types = [_SLIDING if p else _FULL for p in pattern]
    dim = int(md(Keys.Rope.DIMENSION_COUNT, head_dim))
    rot = {_FULL: dim // 2, _SLIDING: int(md(Keys.Rope.DIMENSION_COUNT_SWA, dim))}
    theta = {_FULL: float(md(Keys.Rope.FREQ_BASE, 10000.0)),
             _SLIDING: float(md(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    scaling = {k: md(key) for k, key in _LLAMA3.items()}
    if has_tensor("rope_freqs.weight") and None in scaling.values():
        raise ValueError(
            "the file scales its full-attention layers' RoPE by a rope_freqs tensor without "
            "the Llama-3 parameters it was computed from (rope.scaling.llama3.*, which "
            "mtpkit writes and llama.cpp's converter does not); mtpkit cannot rebuild the "
            "scaling from it: run the Hugging Face folder, or its GGUF from mtpkit quantize")
    if len(set(kv)) > 1:
        raise ValueError(f"KV head counts {kv} vary by layer; Step shares one")
    # A layer type's head count; trunk layers that differ from it are per_layer_config.
    if not len(heads) == len(kv) == len(types) == total:
        raise ValueError(f"per-layer head counts or sliding_window_pattern do not cover the "
                         f"{total} blocks")
    default_heads = {k: next((h for h, t in zip(heads, types, strict=True) if t == k),
                             heads[0]) for k in (_FULL, _SLIDING)}
    overrides = {str(i): {"num_attention_heads": heads[i]} for i in range(n_layer)
                 if heads[i] != default_heads[types[i]]}
    mlp = ["sparse" if has_tensor(f"blk.{i}.ffn_gate_inp.weight") else "dense"
           for i in range(total)]
    limits = per_layer(Keys.LLM.SWIGLU_CLAMP_EXP, 0.0)
    shared = per_layer(Keys.LLM.SWIGLU_CLAMP_SHEXP, 0.0)
    out = {
        "architectures": ["Step3p5ForCausalLM"],
        "num_attention_heads": default_heads[_FULL],
        "num_sliding_attention_heads": default_heads[_SLIDING],
        "num_key_value_heads": kv[0],
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "use_head_wise_attn_gate": has_tensor("blk.0.attn_gate.weight"),
        "layer_types": types,
        "mlp_layer_types": mlp,
        "sliding_window": md(Keys.Attention.SLIDING_WINDOW),
        "rope_parameters": {k: {"rope_type": "default", "rope_theta": theta[k],
                                "partial_rotary_factor": _factor(rot[k], head_dim)}
                            for k in (_FULL, _SLIDING)},
        "swiglu_limits": [_f32(x) for x in limits],
        "swiglu_limits_shared": [_f32(x) for x in shared],
        "n_routed_experts": md(Keys.LLM.EXPERT_COUNT),
        "num_experts_per_tok": md(Keys.LLM.EXPERT_USED_COUNT),
        "moe_intermediate_size": md(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "share_expert_dim": md(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH),
        "moe_router_scaling_factor": md(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        "norm_expert_weight": bool(md(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        "num_nextn_predict_layers": n_mtp,
    }
    if has_tensor("rope_freqs.weight"):
        out["rope_parameters"][_FULL].update(
            rope_type="llama3", **{k: _f32(v) for k, v in scaling.items()})
        out["rope_parameters"][_FULL]["original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"])
    if overrides:
        out["per_layer_config"] = overrides
    return out


def _per_layer_reader(md, arch: str, family: str, total: int):
    """After refusing a file whose experts do not route by sigmoid: a reader of per-block
    metadata (``per_layer(key_template, default)``, a scalar repeated over ``total``)."""
    from gguf import ExpertGatingFuncType, Keys

    gating = md(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is not None and int(gating) != ExpertGatingFuncType.SIGMOID:
        raise ValueError(f"{arch} file routes experts by gating function {gating}; {family} "
                         "routes by sigmoid")

    def per_layer(template: str, default):
        v = md(template, default)
        return list(v) if isinstance(v, list) else [v] * total

    return per_layer


def _f32(x) -> float:
    # GGUF arrays hold float32: 0.6 reads back as 0.60000002; the shortest decimal that
    # rounds to the same float32 is what the config held.
    import numpy as np

    return float(str(np.float32(x)))


# ---------------------------------------------------------------------------------------------
# MiMo-V2-Flash (mtpkit ``mimo_v2_flash``) as llama.cpp's ``mimo2`` (src/models/mimo2.cpp,
# conversion/mimo.py), its three MTP layers as blocks n .. n + 2:
#
# - One query head count and head width for both layer types, KV heads per layer, values
#   ``value_length`` wide and scaled by ``attention.value_scale``; one rotary width
#   (``rope.dimension_count``) at ``freq_base`` (full) / ``freq_base_swa`` (sliding); attention
#   sinks per layer where the checkpoint has them (``attn_sinks``).
# - Sigmoid, group-limited routing with ``exp_probs_b``; llama.cpp's mimo2 always renormalises
#   the chosen weights and reads no weights scale.
# - An MTP block needs a fused ``attn_qkv`` (llama.cpp's MTP graph asserts it; its trunk takes
#   q/k/v apart too) and a dense MLP; the final norm is written as ``layer_output_norm``, as the
#   converter writes the release's final_layernorm. llama.cpp feeds each MTP layer the state
#   BEFORE the trunk's final norm and chains each layer's output before that norm, where
#   mtpkit (as vLLM) feeds and chains the normed states: its drafts may differ, never its output.

MIMO_ARCHS = {"mimo2"}
# Not in every gguf package release's Keys (llama.cpp's own gguf-py has it).
VALUE_SCALE = "{arch}.attention.value_scale"

_MIMO_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
# An MTP layer's own modules: mtpkit's mtp.* name -> (GGUF name below blk.N, release name).
_MIMO_NEXTN = {
    "fc": ("nextn.eh_proj", "eh_proj"),
    "pre_fc_norm_embedding": ("nextn.enorm", "enorm"),
    "pre_fc_norm_hidden": ("nextn.hnorm", "hnorm"),
    "norm": ("layer_output_norm", "final_layernorm"),
}


def parse_mimo(cfg: dict):
    """The mtpkit config of a MiMo-V2-Flash checkpoint (either spelling)."""
    from ..models.mimo_v2_flash import MiMoV2FlashConfig

    return MiMoV2FlashConfig.from_hf_config(cfg)


def check_mimo(s) -> None:
    """ValueError where llama.cpp's mimo2 would not load the file or would decode it
    otherwise than the checkpoint."""
    no_form = "this checkpoint has no mimo2 GGUF form; serve the folder with mtpkit instead"
    full, swa = s.full, s.sliding
    for what, a, b in (("head_dim", full.head_dim, swa.head_dim),
                       ("v_head_dim", full.v_head_dim, swa.v_head_dim),
                       ("rotary width", full.rot_dim, swa.rot_dim)):
        if a != b:
            raise ValueError(f"full and sliding layers differ in {what} ({a}, {b}): llama.cpp's "
                             f"mimo2 has one for both; {no_form}")
    if s.routed_scaling_factor != 1.0:
        raise ValueError(
            f"routed_scaling_factor {s.routed_scaling_factor:g}: llama.cpp's mimo2 reads no "
            f"expert weights scale and leaves the routed weights unscaled; {no_form}")
    if not s.norm_topk_prob:
        raise ValueError("norm_topk_prob is false: llama.cpp's mimo2 always renormalises the "
                         f"chosen experts' weights; {no_form}")
    if s.attention_bias:
        raise ValueError("attention_bias: llama.cpp's mimo2 adds no q/k/v biases; "
                         f"{no_form}")


def write_mimo_metadata(w: GGUFWriter, cfg: dict, n_layer: int, n_mtp: int,
                        vocab_size: int | None) -> None:
    """Every mimo2 key llama.cpp's loader reads (ValueError for configs it cannot run)."""
    from gguf import ExpertGatingFuncType

    s = parse_mimo(cfg)
    check_mimo(s)
    types = list(s.layer_types[:n_layer]) + [_SLIDING] * n_mtp  # MTP blocks: sliding
    _write_sizes(w, s, n_layer, n_mtp)
    heads = [s.shape(t).heads for t in types]
    w.add_head_count(heads[0] if len(set(heads)) == 1 else heads)
    w.add_head_count_kv([s.shape(t).kv_heads for t in types])
    w.add_key_length(s.full.head_dim)
    w.add_value_length(s.full.v_head_dim)
    w.add_rope_dimension_count(s.full.rot_dim)
    w.add_rope_freq_base(s.full.rope_theta)
    w.add_rope_freq_base_swa(s.sliding.rope_theta)  # llama.cpp's default is 10000
    if s.sliding.window:
        w.add_sliding_window(int(s.sliding.window))
    # Integers, as the converter writes the release's hybrid_layer_pattern.
    w.add_sliding_window_pattern([int(t == _SLIDING) for t in types])
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    if s.attention_value_scale != 1.0:  # llama.cpp takes 1 (and a missing key) as none
        w.add_float32(VALUE_SCALE.format(arch=w.arch), s.attention_value_scale)
    if vocab_size is not None:
        w.add_vocab_size(int(vocab_size))
    if s.n_routed_experts:
        w.add_expert_count(s.n_routed_experts)
        w.add_expert_used_count(s.num_experts_per_tok)
        w.add_expert_feed_forward_length(s.moe_intermediate_size)
        w.add_expert_group_count(s.n_group)
        w.add_expert_group_used_count(s.topk_group)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


class MimoRenamer:
    """mtpkit's MiMo-V2-Flash names -> GGUF tensors (routed experts are stacked by the
    caller); an MTP block's q, k and v are held until all three have come, then fused."""

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.qkv: dict[int, dict[str, torch.Tensor]] = {}

    def convert(self, hf_name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        stem, _, param = hf_name.rpartition(".")
        glob = _global_names()[1].get(stem)
        if glob is not None:
            return [(f"{glob}.{param}", t)]
        own = re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)", stem)
        if own and own[2] in _MIMO_NEXTN:
            name = _MIMO_NEXTN[own[2]][0]
            return [(f"blk.{self.n_layer + int(own[1] or 0)}.{name}.{param}", t)]
        m = re.fullmatch(r"(model|mtp)\.layers\.(\d+)\.(.+)", hf_name)
        if m is None:
            raise ValueError(f"no mimo2 GGUF name for tensor {hf_name!r}")
        bid = int(m[2]) + (self.n_layer if m[1] == "mtp" else 0)
        if m[3] == "mlp.gate.e_score_correction_bias":
            return [(f"blk.{bid}.exp_probs_b.bias", t)]
        if m[3] == "self_attn.sinks":
            return [(f"blk.{bid}.attn_sinks.weight", t)]
        sub, _, param = m[3].rpartition(".")
        base = _MIMO_BLOCK.get(sub)
        if base is None:
            raise ValueError(f"no mimo2 GGUF name for tensor {hf_name!r}")
        if bid >= self.n_layer and base in ("attn_q", "attn_k", "attn_v"):
            if param != "weight":
                raise ValueError(f"{hf_name}: llama.cpp's mimo2 MTP blocks take no q/k/v bias")
            parts = self.qkv.setdefault(bid, {})
            parts[base] = t
            if len(parts) < 3:
                return []
            del self.qkv[bid]
            fused = torch.cat([parts["attn_q"], parts["attn_k"], parts["attn_v"]])
            return [(f"blk.{bid}.attn_qkv.weight", fused)]
        return [(f"blk.{bid}.{base}.{param}", t)]

    def finish(self) -> None:
        if self.qkv:
            raise ValueError(f"MTP blocks {sorted(self.qkv)} lack some of q/k/v_proj")


_READ_MIMO_BLOCK = {base: sub for sub, base in _MIMO_BLOCK.items()}
_READ_MIMO_BLOCK["attn_sinks"] = "self_attn.attention_sink_bias"
_READ_MIMO_NEXTN = {name: release for name, release in _MIMO_NEXTN.values()}
_READ_MIMO_NEXTN["nextn.shared_head_norm"] = "final_layernorm"


def read_mimo_names(gname: str, n_layer: int, md, n_experts: int):
    """GGUF tensor name -> [(release name, expert index or None, value change or None)];
    empty for names MiMo has none for."""
    from gguf import Keys

    stem, _, param = gname.rpartition(".")
    glob = _global_names()[0].get(stem)
    if glob is not None:
        return [(f"{glob}.{param}", None, None)]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", stem)
    if m is None:
        return []
    bid, base = int(m[1]), m[2]
    prefix = f"model.layers.{bid}" if bid < n_layer else f"model.mtp.layers.{bid - n_layer}"
    if base == "exp_probs_b" and param == "bias":
        return [(f"{prefix}.mlp.gate.e_score_correction_bias", None, None)]
    if bid >= n_layer and base in _READ_MIMO_NEXTN:
        return [(f"{prefix}.{_READ_MIMO_NEXTN[base]}.{param}", None, None)]
    experts = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
               "ffn_down_exps": "down_proj"}
    if base in experts:
        return [(f"{prefix}.mlp.experts.{e}.{experts[base]}.{param}", e, None)
                for e in range(n_experts)]
    if base == "attn_qkv":
        kv = md(Keys.Attention.HEAD_COUNT_KV)
        heads = md(Keys.Attention.HEAD_COUNT)
        kv = kv[bid] if isinstance(kv, list) else kv
        heads = heads[bid] if isinstance(heads, list) else heads
        k_dim = int(md(Keys.Attention.KEY_LENGTH))
        v_dim = int(md(Keys.Attention.VALUE_LENGTH, k_dim))
        q, k = int(heads) * k_dim, int(kv) * k_dim
        spans = {"q_proj": (0, q), "k_proj": (q, q + k), "v_proj": (q + k, q + k + int(kv) * v_dim)}
        return [(f"{prefix}.self_attn.{p}.{param}", None,
                 lambda t, a=a, b=b: t[a:b].contiguous()) for p, (a, b) in spans.items()]
    if base == "attn_sinks":
        return [(f"{prefix}.self_attn.attention_sink_bias", None, None)]
    if base in _READ_MIMO_BLOCK:
        return [(f"{prefix}.{_READ_MIMO_BLOCK[base]}.{param}", None, None)]
    return []


def read_mimo_config(md, n_layer: int, n_mtp: int, has_tensor) -> dict[str, Any]:
    """The HF config fields (the release's names for what transformers' lack) of a mimo2
    file; ``md(key_template, default)`` reads its metadata."""
    from gguf import Keys

    total = n_layer + n_mtp
    per_layer = _per_layer_reader(md, "mimo2", "MiMo", total)

    types = [_SLIDING if p else _FULL
             for p in per_layer(Keys.Attention.SLIDING_WINDOW_PATTERN, False)]
    heads = per_layer(Keys.Attention.HEAD_COUNT, 0)
    kv = per_layer(Keys.Attention.HEAD_COUNT_KV, heads[0])
    if not len(types) == len(heads) == len(kv) == total:
        raise ValueError(f"per-layer head counts or sliding_window_pattern do not cover the "
                         f"{total} blocks")

    def of(kind: str, values: list):
        return next((v for v, t in zip(values, types, strict=True) if t == kind), values[0])

    head_dim = int(md(Keys.Attention.KEY_LENGTH))
    rot = int(md(Keys.Rope.DIMENSION_COUNT, head_dim))
    theta = {_FULL: float(md(Keys.Rope.FREQ_BASE, 10000.0)),
             _SLIDING: float(md(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    sinks = {kind: any(has_tensor(f"blk.{i}.attn_sinks.weight")
                       for i, t in enumerate(types) if t == kind) for kind in (_FULL, _SLIDING)}
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "num_attention_heads": of(_FULL, heads),
        "swa_num_attention_heads": of(_SLIDING, heads),
        "num_key_value_heads": of(_FULL, kv),
        "swa_num_key_value_heads": of(_SLIDING, kv),
        "head_dim": head_dim,
        "v_head_dim": md(Keys.Attention.VALUE_LENGTH, head_dim),
        "layer_types": types[:n_layer],
        "mlp_layer_types": ["sparse" if has_tensor(f"blk.{i}.ffn_gate_inp.weight") else "dense"
                            for i in range(n_layer)],
        "rope_parameters": {k: {"rope_type": "default", "rope_theta": theta[k],
                                "partial_rotary_factor": _factor(rot, head_dim)}
                            for k in (_FULL, _SLIDING)},
        "sliding_window": md(Keys.Attention.SLIDING_WINDOW),
        "attention_value_scale": _f32(md(VALUE_SCALE, 1.0)),
        "add_full_attention_sink_bias": sinks[_FULL],
        "add_swa_attention_sink_bias": sinks[_SLIDING],
        "n_routed_experts": md(Keys.LLM.EXPERT_COUNT),
        "num_experts_per_tok": md(Keys.LLM.EXPERT_USED_COUNT),
        "moe_intermediate_size": md(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "n_group": md(Keys.LLM.EXPERT_GROUP_COUNT, 1),
        "topk_group": md(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1),
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": n_mtp,
    }


def _factor(rot: int, head_dim: int) -> float:
    """A partial_rotary_factor whose int(head_dim * factor) is ``rot`` (rot / head_dim can
    fall a rounding short of it)."""
    f = rot / head_dim
    return f if int(head_dim * f) == rot else (rot + 0.5) / head_dim
