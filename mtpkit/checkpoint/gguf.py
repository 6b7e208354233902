"""GGUF checkpoints: HF-named, lazily dequantized tensors, an HF-style config, and a writer.

llama.cpp's converter changes some tensors on their way into a GGUF file. The reader undoes
each change, so that ``get_tensor`` returns what the HF safetensors file holds, and
``write_gguf`` redoes them, so that llama.cpp reads our files as its own:

- ``llama``: the rows of q_proj / k_proj are permuted (the two rotary halves of every head
  interleaved, for ggml's pairwise RoPE);
- ``qwen3next`` / ``qwen35``: RMSNorm weights are zero-centred (``x * (1 + w)``) and are stored
  as ``w + 1``, except the gated-delta ``linear_attn.norm``; ``A_log`` is stored as
  ``-exp(A_log)``; ``conv1d`` loses its middle axis; ``dt_bias`` becomes ``ssm_dt.bias``;
  qwen3next splits ``in_proj_qkvz`` into ``attn_qkv`` and ``attn_gate``; qwen35 reorders the
  linear-attention value heads from grouped-by-key-head to tiled when there are more value
  heads than key heads;
- ``glm4moe`` / ``deepseek2`` / ``glm-dsa`` (DeepSeek-style MoE, MLA, DSA): see ``gguf_moe``;
- ``step35`` (Step-3.5 / 3.7-Flash) and ``mimo2`` (MiMo-V2-Flash), three MTP layers each:
  see ``gguf_step``;
- MTP heads live in blocks ``n .. n + k - 1`` (``n = block_count - nextn_predict_layers``) as
  ``blk.N.nextn.*`` plus an ordinary decoder block. They read back as DeepSeek-style
  ``model.layers.N.*`` names, or as the ``mtp.*`` layout for qwen3next / qwen35.

The rules for a GGUF tensor are keyed on its GGUF name (``blk.N.<base>[.weight|.bias]``),
so reader and writer share one description of each change.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys

from ..outputs import publish_modes
from . import gguf_moe, gguf_step
from .errors import CheckpointError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["GGUFCheckpoint", "open_gguf", "write_gguf"]

_KNOWN_ARCHS = set(gguf.MODEL_ARCH_NAMES.values())
# gguf arch -> (HF model_type, HF architecture class). Archs this gguf package does not know
# are left out, so that a file naming them reports the arch rather than a half-built config.
_ARCHS = {
    arch: spec
    for arch, spec in {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen2": ("qwen2", "Qwen2ForCausalLM"),
        "qwen3": ("qwen3", "Qwen3ForCausalLM"),
        "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
        "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
        "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
        "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
        # GLM-4.7-Flash files too: the same model as DeepSeek-V3's, whatever the release.
        "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
        "glm-dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
        "step35": ("step3p5", "Step3p5ForCausalLM"),
        "mimo2": ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    }.items()
    if arch in _KNOWN_ARCHS
}
_PERMUTED_QK = {"llama"}
# Zero-centred norms folded to w + 1, gated-delta linear attention, and the mtp.* layout.
_QWEN_NEXT = {"qwen3next", "qwen35", "qwen35moe"}
_V_TILED = {"qwen35", "qwen35moe"}

# GGUF tensor name (without .weight/.bias) -> HF name, outside the blocks.
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF block tensor base -> HF name below the layer prefix. The reverse direction (writing)
# asks gguf's TensorNameMap first, and falls back to this table where it has no entry.
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Tensors whose HF name has no .weight suffix, or a different one.
_BLOCK_EXACT = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
                "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# Experts are one 3-D GGUF tensor per projection, [expert, out, in] in torch order.
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# blk.N.nextn.<key> -> (DeepSeek-style name below model.layers.N, mtp.* name or None).
_NEXTN = {
    "eh_proj": ("eh_proj", "mtp.fc"),
    "enorm": ("enorm", "mtp.pre_fc_norm_embedding"),
    "hnorm": ("hnorm", "mtp.pre_fc_norm_hidden"),
    "shared_head_norm": ("shared_head.norm", "mtp.norm"),
    "shared_head_head": ("shared_head.head", None),
    "embed_tokens": ("embed_tokens", None),
}
_NEXTN_BY_HF = {ds: key for key, (ds, _) in _NEXTN.items()}
_NEXTN_BY_MTP = {mtp: key for key, (_, mtp) in _NEXTN.items() if mtp}
# Archs whose files carry MTP layers as blk.N.nextn.* (llama.cpp runs them with draft-mtp).
_NEXTN_ARCHS = _QWEN_NEXT | gguf_moe.MOE_ARCHS | gguf_step.STEP_ARCHS | gguf_step.MIMO_ARCHS

# qtype name -> file type written to general.file_type (llama.cpp shows it in its logs).
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}
_INT_TYPES = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
    GGMLQuantizationType.F64,
}


# Not in every gguf package release's Keys (llama.cpp's own gguf-py has it).
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"


def _key(template: str, arch: str) -> str:
    return template.format(arch=arch)


def _split_suffix(name: str) -> tuple[str, str]:
    """``'blk.0.attn_q.weight'`` -> ``('blk.0.attn_q', '.weight')``; no suffix -> ``''``."""
    for suffix in (".weight", ".bias"):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def _plain(value: Any, vtype: GGUFValueType | None) -> Any:
    # GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal
    # that rounds to the same float32 is what the HF config held, so report that.
    if vtype == GGUFValueType.FLOAT32 and isinstance(value, float):
        return float(str(np.float32(value)))
    return value


# ---------------------------------------------------------------------------------------------
# Tensor transforms. ``to_gguf`` picks the direction (HF -> GGUF when writing, GGUF -> HF when
# reading); tensors are always in torch order ([out, in]).


def _permute_rotary(t: torch.Tensor, n_head: int, to_gguf: bool) -> torch.Tensor:
    """Interleave (to GGUF) or de-interleave (to HF) the two rotary halves of each head."""
    shape = t.shape
    half = shape[0] // n_head // 2
    if to_gguf:  # per head: [half, 2] rows <- [2, half] rows
        t = t.reshape(n_head, 2, half, *shape[1:]).transpose(1, 2)
    else:
        t = t.reshape(n_head, half, 2, *shape[1:]).transpose(1, 2)
    return t.reshape(shape).contiguous()


def _swap_groups(t: torch.Tensor, dim: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """View ``dim`` as [outer, inner, size] and swap the first two axes."""
    dim = dim % t.dim()
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], outer, inner, size, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


@dataclass(frozen=True)
class _Linear:
    """Gated-delta linear-attention sizes, needed to undo the converter's reorderings."""

    nk: int  # key heads
    dk: int  # key head dim
    nv: int  # value heads
    dv: int  # value head dim

    @property
    def r(self) -> int:
        return self.nv // self.nk

    def tile(self, t: torch.Tensor, dim: int, size: int, to_gguf: bool) -> torch.Tensor:
        """Value heads grouped by key head (HF) <-> tiled across key heads (qwen35 GGUF)."""
        if to_gguf:
            return _swap_groups(t, dim, self.nk, self.r, size)
        return _swap_groups(t, dim, self.r, self.nk, size)

    def tile_after_qk(self, t: torch.Tensor, size: int, to_gguf: bool) -> torch.Tensor:
        """Reorder only the value rows of a [q; k; v] stack (in_proj_qkv, conv1d)."""
        qk = 2 * self.nk * self.dk
        return torch.cat([t[:qk], self.tile(t[qk:], 0, size, to_gguf)], dim=0)

    def qkvz_to_hf(self, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """qwen3next: [q_all; k_all; v_all] and z -> in_proj_qkvz grouped per key head."""
        h = qkv.shape[-1]
        kd, vd = self.nk * self.dk, self.nk * self.r * self.dv
        q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd : 2 * kd + vd]
        parts = [
            q.reshape(self.nk, self.dk, h),
            k.reshape(self.nk, self.dk, h),
            v.reshape(self.nk, self.r * self.dv, h),
            z.reshape(self.nk, self.r * self.dv, h),
        ]
        return torch.cat(parts, dim=1).reshape(-1, h)

    def qkvz_to_gguf(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``qkvz_to_hf``."""
        h = w.shape[-1]
        sizes = [self.dk, self.dk, self.r * self.dv, self.r * self.dv]
        q, k, v, z = torch.split(w.reshape(self.nk, sum(sizes), h), sizes, dim=1)
        qkv = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)], dim=0)
        return qkv.contiguous(), z.reshape(-1, h).contiguous()


def _value_transform(
    arch: str, base: str, suffix: str, heads: tuple[int, int], lin: _Linear | None, to_gguf: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The change llama.cpp makes to one block/global tensor, or its inverse; None if none."""
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if arch in _PERMUTED_QK and base in ("attn_q", "attn_k"):
        n = heads[0] if base == "attn_q" else heads[1]
        steps.append(lambda t: _permute_rotary(t, n, to_gguf))
    if arch in _QWEN_NEXT:
        if base.endswith("norm") and base != "ssm_norm" and suffix == ".weight":
            steps.append((lambda t: t + 1) if to_gguf else (lambda t: t - 1))
        if base == "ssm_a":
            steps.append((lambda t: -torch.exp(t)) if to_gguf else (lambda t: torch.log(-t)))
        if base == "ssm_conv1d":
            steps.append((lambda t: t.squeeze(1)) if to_gguf else (lambda t: t.unsqueeze(1)))
        if arch in _V_TILED and lin is not None and lin.nk != lin.nv:
            tile = _v_tiling(base, suffix, lin, to_gguf)
            if tile is not None:
                # First in both directions: the reorder commutes with the element-wise steps,
                # and conv1d must be reordered in its 2-D GGUF layout before it is unsqueezed.
                steps.insert(0, tile)
    if not steps:
        return None

    def run(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t

    return run


def _v_tiling(
    base: str, suffix: str, lin: _Linear, to_gguf: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if base == "attn_qkv":
        return lambda t: lin.tile_after_qk(t, lin.dv, to_gguf)
    if base == "attn_gate":
        return lambda t: lin.tile(t, 0, lin.dv, to_gguf)
    if base in ("ssm_beta", "ssm_alpha", "ssm_a") or (base == "ssm_dt" and suffix == ".bias"):
        return lambda t: lin.tile(t, 0, 1, to_gguf)
    if base == "ssm_conv1d":
        # Works on the 2-D GGUF layout [channels, kernel]: squeezed first when writing.
        def conv(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 3:
                return lin.tile_after_qk(t.squeeze(1), lin.dv, to_gguf).unsqueeze(1)
            return lin.tile_after_qk(t, lin.dv, to_gguf)

        return conv
    if base == "ssm_out":
        return lambda t: lin.tile(t, 1, lin.dv, to_gguf)
    return None


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class _Entry:
    """How one HF tensor is made from GGUF tensors."""

    sources: tuple[str, ...]  # GGUF tensor names
    index: int | None = None  # expert index into a 3-D expert tensor
    fn: Callable[..., torch.Tensor] | None = None  # applied to the loaded sources


class GGUFCheckpoint:
    """A GGUF file opened memory-mapped; tensors are dequantized one at a time on request."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue  # file-format bookkeeping (version, counts), not model metadata
            value = field.contents()
            vtype = field.types[0] if field.types else None
            self.metadata[name] = _plain(value, vtype)
        arch = self.metadata.get(Keys.General.ARCHITECTURE)
        if not isinstance(arch, str):
            raise CheckpointError(
                f"{path}: the GGUF metadata has no general.architecture; the file was not "
                "written by a llama.cpp-compatible converter. Re-convert the model."
            )
        self.arch: str = arch
        self._index = self._build_index()

    # -- metadata ------------------------------------------------------------------------

    def _md(self, template: str, default: Any = None) -> Any:
        return self.metadata.get(_key(template, self.arch), default)

    @property
    def n_nextn(self) -> int:
        """Number of MTP (nextn) layers the file declares."""
        return int(self._md(Keys.LLM.NEXTN_PREDICT_LAYERS, 0) or 0)

    @property
    def n_layer(self) -> int:
        """Number of trunk decoder layers (block_count without the MTP blocks)."""
        return int(self._md(Keys.LLM.BLOCK_COUNT, 0)) - self.n_nextn

    def _heads(self) -> tuple[int, int]:
        heads = _scalar(self._md(Keys.Attention.HEAD_COUNT, 0))
        kv = _scalar(self._md(Keys.Attention.HEAD_COUNT_KV, heads))
        return heads, kv or heads

    def _linear(self) -> _Linear | None:
        nk = self._md(Keys.SSM.GROUP_COUNT)
        dk = self._md(Keys.SSM.STATE_SIZE)
        nv = self._md(Keys.SSM.TIME_STEP_RANK)
        inner = self._md(Keys.SSM.INNER_SIZE)
        if None in (nk, dk, nv, inner) or not nv:
            return None
        return _Linear(int(nk), int(dk), int(nv), int(inner) // int(nv))

    def hf_config(self) -> dict:
        """An HF-style config.json dict rebuilt from the GGUF metadata."""
        return dict(self.config)

    @cached_property
    def config(self) -> dict:
        """The HF-style config (cached; ``hf_config()`` returns a copy)."""
        md = self._md
        model_type, hf_class = _ARCHS.get(self.arch, (self.arch, None))
        heads, kv = self._heads()
        hidden = md(Keys.LLM.EMBEDDING_LENGTH)
        head_dim = md(Keys.Attention.KEY_LENGTH) or (hidden // heads if hidden and heads else None)
        cfg: dict[str, Any] = {"model_type": model_type}
        if hf_class:
            cfg["architectures"] = [hf_class]
        cfg.update(
            hidden_size=hidden,
            intermediate_size=_scalar(md(Keys.LLM.FEED_FORWARD_LENGTH)),
            num_hidden_layers=self.n_layer,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=md(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
            rope_theta=md(Keys.Rope.FREQ_BASE, 10000.0),
            max_position_embeddings=md(Keys.LLM.CONTEXT_LENGTH),
            vocab_size=self._vocab_size(),
            tie_word_embeddings="output.weight" not in self._tensors,
        )
        if self.n_nextn:
            cfg["num_nextn_predict_layers"] = self.n_nextn
        rope_dim = md(Keys.Rope.DIMENSION_COUNT)
        if rope_dim and head_dim and rope_dim != head_dim:
            cfg["partial_rotary_factor"] = rope_dim / head_dim
        scaling = self._rope_scaling()
        if scaling:
            cfg["rope_scaling"] = scaling
        if self.arch == "llama" and "blk.0.attn_q.bias" in self._tensors:
            cfg["attention_bias"] = True
        for field, key in (
            ("bos_token_id", Keys.Tokenizer.BOS_ID),
            ("eos_token_id", Keys.Tokenizer.EOS_ID),
            ("pad_token_id", Keys.Tokenizer.PAD_ID),
        ):
            if key in self.metadata:
                cfg[field] = int(self.metadata[key])
        if self.arch in _QWEN_NEXT:
            cfg.update(self._qwen_next_config())
        if self.arch in gguf_step.STEP_ARCHS | gguf_step.MIMO_ARCHS:
            for key in ("num_key_value_heads", "rope_theta"):
                cfg.pop(key, None)  # per layer type: read_config's
            read = (gguf_step.read_config if self.arch in gguf_step.STEP_ARCHS
                    else gguf_step.read_mimo_config)
            try:
                cfg.update(read(md, self.n_layer, self.n_nextn, self._tensors.__contains__))
            except ValueError as e:
                raise CheckpointError(f"{self.path}: {e}") from e
        if self.arch in gguf_moe.MOE_ARCHS:
            try:
                cfg.update(gguf_moe.read_config(self.arch, md, self._tensors.__contains__))
            except ValueError as e:
                raise CheckpointError(f"{self.path}: {e}") from e
            if self.arch in gguf_moe.MLA_ARCHS:
                for key in ("head_dim", "partial_rotary_factor", "num_key_value_heads"):
                    cfg.pop(key, None)  # MLA's are the absorbed form's: not config fields
                if cfg.get("rope_scaling"):
                    cfg["rope_scaling"].update(gguf_moe.yarn_mscale(md))
        return {k: v for k, v in cfg.items() if v is not None}

    def _vocab_size(self) -> int | None:
        emb = self._tensors.get("token_embd.weight")
        if emb is not None:
            return int(emb.shape[-1])  # GGUF shape is [hidden, vocab]
        tokens = self.metadata.get(Keys.Tokenizer.LIST)
        if tokens:
            return len(tokens)
        return self._md(Keys.LLM.VOCAB_SIZE)

    def _rope_scaling(self) -> dict | None:
        kind = self._md(Keys.Rope.SCALING_TYPE)
        if not kind or kind == "none":
            return None
        out: dict[str, Any] = {"rope_type": kind}
        for field, key in (
            ("factor", Keys.Rope.SCALING_FACTOR),
            ("original_max_position_embeddings", Keys.Rope.SCALING_ORIG_CTX_LEN),
            ("attention_factor", Keys.Rope.SCALING_ATTN_FACTOR),
            ("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST),
            ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW),
        ):
            value = self._md(key)
            if value is not None:
                out[field] = value
        return out

    def _qwen_next_config(self) -> dict:
        md = self._md
        out: dict[str, Any] = {}
        lin = self._linear()
        if lin is not None:
            out.update(
                linear_num_key_heads=lin.nk,
                linear_key_head_dim=lin.dk,
                linear_num_value_heads=lin.nv,
                linear_value_head_dim=lin.dv,
            )
        out["linear_conv_kernel_dim"] = md(Keys.SSM.CONV_KERNEL)
        interval = md(Keys.LLM.FULL_ATTENTION_INTERVAL)
        recurrent = md(RECURRENT_LAYERS)
        if interval:
            out["full_attention_interval"] = interval
        if recurrent is not None and len(recurrent) >= self.n_layer:
            # The per-layer list outranks the interval, as in llama.cpp's loaders.
            out["layer_types"] = ["linear_attention" if r else "full_attention"
                                  for r in list(recurrent)[: self.n_layer]]
        elif interval:
            out["layer_types"] = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.n_layer)
            ]
        out["num_experts"] = md(Keys.LLM.EXPERT_COUNT)
        out["num_experts_per_tok"] = md(Keys.LLM.EXPERT_USED_COUNT)
        out["moe_intermediate_size"] = md(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
        out["shared_expert_intermediate_size"] = md(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        if self.n_nextn and self.arch in _V_TILED:
            out["mtp_num_hidden_layers"] = self.n_nextn  # the Qwen3.5 config's own name
        return {k: v for k, v in out.items() if v is not None}

    # -- tensors ---------------------------------------------------------------------------

    def _build_index(self) -> dict[str, _Entry]:
        index: dict[str, _Entry] = {}
        arch, n_layer, heads, lin = self.arch, self.n_layer, self._heads(), self._linear()
        qwen_next = arch in _QWEN_NEXT
        block = {**_BLOCK, **gguf_moe.READ_BLOCK} if arch in gguf_moe.MOE_ARCHS else _BLOCK
        for gname, rt in self._tensors.items():
            if arch in gguf_step.STEP_ARCHS:
                named = gguf_step.read_name(gname, n_layer)
                if named is None:
                    index[gname] = _Entry((gname,))
                else:
                    index[named[0]] = _Entry((gname,), fn=named[1])
                continue
            if arch in gguf_step.MIMO_ARCHS:
                n_experts = int(rt.shape[-1]) if len(rt.shape) == 3 else 0
                named = gguf_step.read_mimo_names(gname, n_layer, self._md, n_experts)
                for hf, e, fn in named:
                    index[hf] = _Entry((gname,), index=e, fn=fn)
                if not named:
                    index[gname] = _Entry((gname,))
                continue
            stem, suffix = _split_suffix(gname)
            if stem in _GLOBAL:
                fn = _value_transform(arch, stem, suffix, heads, lin, to_gguf=False)
                index[_GLOBAL[stem] + suffix] = _Entry((gname,), fn=fn)
                continue
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", stem)
            if m is None:
                index[gname] = _Entry((gname,))  # not an HF tensor (e.g. rope_freqs): as is
                continue
            bid, base = int(m.group(1)), m.group(2)
            if qwen_next and bid >= n_layer:
                prefix = f"mtp.layers.{bid - n_layer}"
            else:
                prefix = f"model.layers.{bid}"
            if base.startswith("nextn."):
                key = base[len("nextn.") :]
                ds_name, mtp_name = _NEXTN.get(key, (None, None))
                if qwen_next and mtp_name:
                    # The converter writes these once per MTP block; they are copies.
                    if bid == n_layer:
                        fn = _value_transform(arch, "nextn." + key, suffix, heads, lin, False)
                        index[mtp_name + suffix] = _Entry((gname,), fn=fn)
                    continue
                if ds_name is None:
                    index[gname] = _Entry((gname,))
                    continue
                fn = _value_transform(arch, "nextn." + key, suffix, heads, lin, False)
                index[f"model.layers.{bid}.{ds_name}{suffix}"] = _Entry((gname,), fn=fn)
                continue
            if base in _EXPERTS and suffix == ".weight":
                proj = _EXPERTS[base]
                for e in range(int(rt.shape[-1])):  # GGUF shape is [in, out, expert]
                    index[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = _Entry((gname,), index=e)
                continue
            exact = _BLOCK_EXACT.get(base + suffix)
            if exact is not None:
                fn = _value_transform(arch, base, suffix, heads, lin, to_gguf=False)
                index[f"{prefix}.{exact}"] = _Entry((gname,), fn=fn)
                continue
            if arch == "qwen3next" and base in ("attn_qkv", "attn_gate") and lin is not None:
                if base == "attn_qkv":
                    gate = f"blk.{bid}.attn_gate{suffix}"
                    index[f"{prefix}.linear_attn.in_proj_qkvz{suffix}"] = _Entry(
                        (gname, gate), fn=lin.qkvz_to_hf
                    )
                continue
            if base in ("attn_k_b", "attn_v_b") and arch in gguf_moe.MLA_ARCHS:
                if base == "attn_k_b":
                    index[f"{prefix}.self_attn.kv_b_proj{suffix}"] = _Entry(
                        (gname, f"blk.{bid}.attn_v_b{suffix}"), fn=gguf_moe.merge_kv_b)
                continue
            hf = block.get(base)
            if hf is None:
                index[gname] = _Entry((gname,))
                continue
            fn = _value_transform(arch, base, suffix, heads, lin, to_gguf=False)
            index[f"{prefix}.{hf}{suffix}"] = _Entry((gname,), fn=fn)
        return index

    def tensor_names(self) -> list[str]:
        """Every tensor in HF names (GGUF names are kept for tensors HF has no name for)."""
        return list(self._index)

    def _entry(self, hf_name: str) -> _Entry:
        entry = self._index.get(hf_name)
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor named {hf_name}")
        return entry

    def tensor_type(self, hf_name: str) -> str:
        """The GGML type name the tensor is stored in (e.g. 'Q4_1', 'Q8_0', 'F32')."""
        return self._tensors[self._entry(hf_name).sources[0]].tensor_type.name

    tensor_dtype = tensor_type  # same name as HFCheckpoint's

    def gguf_names(self, hf_name: str) -> tuple[str, ...]:
        """The GGUF tensor(s) an HF tensor is read from."""
        return self._entry(hf_name).sources

    def raw_tensor(self, gguf_name: str) -> tuple[np.ndarray, str]:
        """A GGUF tensor as stored: torch-order array (quantized rows as uint8 blocks), type.

        No llama.cpp change is undone here; the array is a copy, safe after ``close``.
        """
        rt = self._tensors.get(gguf_name)
        if rt is None:
            raise CheckpointError(f"{self.path}: no GGUF tensor named {gguf_name}")
        return np.array(rt.data), rt.tensor_type.name

    def _load(self, gname: str, index: int | None, meta: bool = False) -> torch.Tensor:
        rt = self._tensors[gname]
        shape = [int(x) for x in reversed(rt.shape.tolist())]  # GGUF order is innermost first
        if index is not None:
            shape = shape[1:]
        if meta:
            return torch.empty(shape, device="meta")
        data = rt.data if index is None else rt.data[index]
        qtype = GGMLQuantizationType(rt.tensor_type)
        try:
            if qtype in _INT_TYPES:
                arr = np.asarray(data)
            else:
                arr = gguf.quants.dequantize(data, qtype)
            if arr.dtype != np.float32 or not arr.flags.writeable:
                arr = arr.astype(np.float32)  # copy: never hand out a view of the mapping
            return torch.from_numpy(arr.reshape(shape))
        except NotImplementedError as e:
            raise CheckpointError(
                f"{self.path}: tensor {gname} is stored as {qtype.name}, which the installed "
                f"gguf package cannot dequantize ({e}). Re-quantize the file to a supported "
                "type (F16, Q8_0, Q4_K, ...) or upgrade the gguf package."
            ) from e
        except (ValueError, IndexError) as e:
            raise CheckpointError(
                f"{self.path}: tensor {gname} cannot be read ({e}); the file is truncated or "
                "corrupt. Download or convert it again."
            ) from e

    def get_tensor(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor, dequantized, in its HF name, shape and values (undoing llama.cpp's edits)."""
        entry = self._entry(hf_name)
        parts = [self._load(g, entry.index) for g in entry.sources]
        t = entry.fn(*parts) if entry.fn is not None else parts[0]
        return t.to(dtype)

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """HF shape of a tensor, without reading its data."""
        entry = self._entry(hf_name)
        parts = [self._load(g, entry.index, meta=True) for g in entry.sources]
        t = entry.fn(*parts) if entry.fn is not None else parts[0]
        return tuple(t.shape)

    def close(self) -> None:
        """Drop the memory mapping (tensors already returned stay valid: they are copies)."""
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, arch={self.arch!r}, tensors={len(self._index)})"


def _scalar(value: Any) -> Any:
    """Per-layer arrays (some archs store head counts per layer) -> their largest entry."""
    if isinstance(value, list):
        return max(value) if value else None
    return value


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a GGUF file memory-mapped; CheckpointError names the file and the fix."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such GGUF file. Check the path and that it downloaded.")
    if not p.is_file():
        raise CheckpointError(f"{p}: not a file; pass the path of the .gguf file itself.")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"{p}: not a GGUF file (it starts with {magic!r}, not b'GGUF'). Pass a .gguf file, "
            "or the folder of a Hugging Face checkpoint."
        )
    try:
        reader = GGUFReader(p, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on malformed files
        raise CheckpointError(
            f"{p}: unreadable GGUF file ({type(e).__name__}: {e}). It is truncated or corrupt: "
            "download or convert it again."
        ) from e
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(
                f"{p}: truncated: tensor {t.name} needs bytes up to {end} but the file has "
                f"{size}. Download or convert it again."
            )
    return GGUFCheckpoint(p, reader)


# ---------------------------------------------------------------------------------------------
# Writing


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    for enum, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return enum
    raise ValueError(f"unknown GGUF architecture {arch!r}; known: {sorted(_KNOWN_ARCHS)}")


def _rope_theta(cfg: dict) -> float | None:
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params["rope_theta"]) if "rope_theta" in params else None


def _config_linear(cfg: dict) -> _Linear | None:
    keys = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads")
    if any(cfg.get(k) is None for k in keys):
        return None
    return _Linear(
        int(cfg["linear_num_key_heads"]),
        int(cfg["linear_key_head_dim"]),
        int(cfg["linear_num_value_heads"]),
        int(cfg.get("linear_value_head_dim", cfg["linear_key_head_dim"])),
    )


def _count_mtp(cfg: dict, names: list[str], n_layer: int) -> int:
    """MTP layers among the tensors (the tensors decide: a config may declare a head the
    export dropped, and block_count must match what the file holds)."""
    ids = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    deep = {i for i in ids if i >= n_layer}
    if deep:
        return max(deep) - n_layer + 1
    mtp = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    if mtp:
        return max(mtp) + 1
    if any(n.startswith("mtp.") for n in names):
        declared = cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers")
        return int(declared or 1)
    return 0


_EXPERT_RE = re.compile(r"(?:model|mtp)\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


class _Renamer:
    """HF name -> GGUF name(s) and the changes llama.cpp makes to the values."""

    def __init__(self, arch: str, cfg: dict, n_layer: int, n_mtp: int):
        self.arch, self.n_layer, self.n_mtp, self.cfg = arch, n_layer, n_mtp, cfg
        heads = int(cfg["num_attention_heads"])
        self.heads = (heads, int(cfg.get("num_key_value_heads") or heads))
        self.lin = _config_linear(cfg)
        self.tmap = gguf.get_tensor_name_map(_arch_enum(arch), n_layer + n_mtp)
        self.hf_block = {hf: base for base, hf in _BLOCK.items() if base != "post_attention_norm"}
        self.experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self.mimo = gguf_step.MimoRenamer(n_layer) if arch in gguf_step.MIMO_ARCHS else None
        # step35: MTP layers' own output heads, and the lm_head they may merely copy.
        self.own_heads: dict[str, torch.Tensor] = {}
        self.lm_head: torch.Tensor | None = None

    def block_name(self, hf_name: str) -> str:
        """HF name -> GGUF name, for one tensor that maps one-to-one."""
        name = hf_name
        m = re.match(r"mtp\.layers\.(\d+)\.(.+)", name)
        if m and self.arch in _NEXTN_ARCHS:
            name = f"model.layers.{self.n_layer + int(m.group(1))}.{m.group(2)}"
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m:
            bid, rest = int(m.group(1)), m.group(2)
            for hf_exact_base, hf in _BLOCK_EXACT.items():
                if rest == hf:
                    return f"blk.{bid}.{hf_exact_base}"
            sub, suffix = _split_suffix(rest)
            if bid >= self.n_layer and sub in _NEXTN_BY_HF:
                return f"blk.{bid}.nextn.{_NEXTN_BY_HF[sub]}{suffix}"
        base, suffix = _split_suffix(name)
        mapped = self.tmap.get_name(base)
        if mapped is not None:
            return mapped + suffix
        if m:
            sub, suffix = _split_suffix(m.group(2))
            if sub in self.hf_block:
                return f"blk.{m.group(1)}.{self.hf_block[sub]}{suffix}"
        glob = {hf: g for g, hf in _GLOBAL.items()}.get(base)
        if glob is not None:
            return glob + suffix
        raise ValueError(f"no GGUF name for tensor {hf_name!r} (arch {self.arch})")

    def convert(self, hf_name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The GGUF tensors one HF tensor becomes (experts are gathered until ``finish``)."""
        if self.arch in gguf_step.STEP_ARCHS:
            head = gguf_step.own_head(hf_name, self.n_layer)
            if head is not None:
                self.own_heads[head] = t  # kept where it differs from the lm_head (finish)
                return []
            if hf_name == "lm_head.weight":
                self.lm_head = t
            return gguf_step.convert(hf_name, t, self.n_layer)
        qwen_next = self.arch in _QWEN_NEXT
        m = _EXPERT_RE.fullmatch(hf_name)
        if m:
            bid = int(m.group(1)) + (self.n_layer if hf_name.startswith("mtp.") else 0)
            self.experts.setdefault((bid, m.group(3)), {})[int(m.group(2))] = t
            return []
        if self.mimo is not None:
            return self.mimo.convert(hf_name, t)
        stem, suffix = _split_suffix(hf_name)
        if qwen_next and stem in _NEXTN_BY_MTP:
            key = _NEXTN_BY_MTP[stem]
            fn = _value_transform(self.arch, "nextn." + key, suffix, self.heads, self.lin, True)
            value = fn(t) if fn else t
            # llama.cpp reads these per MTP block, so every block gets its own copy.
            return [
                (f"blk.{self.n_layer + i}.nextn.{key}{suffix}", value) for i in range(self.n_mtp)
            ]
        if self.arch in gguf_moe.MOE_ARCHS:
            own = re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(.+)", stem)
            if own and f"mtp.{own[2]}" in _NEXTN_BY_MTP:
                bid = self.n_layer + int(own[1] or 0)
                return [(f"blk.{bid}.nextn.{_NEXTN_BY_MTP['mtp.' + own[2]]}{suffix}", t)]
            if self.arch in gguf_moe.MLA_ARCHS:
                return self._mla(hf_name, t)
        if self.arch == "qwen3next" and hf_name.endswith("linear_attn.in_proj_qkvz.weight"):
            if self.lin is None:
                raise ValueError("qwen3next in_proj_qkvz needs the linear_* config fields")
            qkv_name = self.block_name(hf_name.replace("in_proj_qkvz", "in_proj_qkv"))
            qkv, z = self.lin.qkvz_to_gguf(t)
            return [(qkv_name, qkv), (qkv_name.replace(".attn_qkv.", ".attn_gate."), z)]
        gname = self.block_name(hf_name)
        return [(gname, self._apply(gname, t))]

    def _mla(self, hf_name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """deepseek2 / glm-dsa: kv_b_proj split for absorbed MLA, rope rows as adjacent pairs."""
        if hf_name.endswith("self_attn.kv_b_proj.weight"):
            k_b, v_b = gguf_moe.split_kv_b(t, self.cfg)
            kb = self.block_name(hf_name.replace("kv_b_proj", "k_b_proj"))
            vb = self.block_name(hf_name.replace("kv_b_proj", "v_b_proj"))
            return [(kb, k_b), (vb, v_b)]
        if hf_name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            t = gguf_moe.interleave_rope_rows(t, self.cfg, self.heads[0])
        elif hf_name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            t = gguf_moe.interleave_rope_rows(t, self.cfg, 0)
        return [(self.block_name(hf_name), t)]

    def _apply(self, gname: str, t: torch.Tensor) -> torch.Tensor:
        stem, suffix = _split_suffix(gname)
        m = re.fullmatch(r"blk\.\d+\.(.+)", stem)
        base = m.group(1) if m else stem
        fn = _value_transform(self.arch, base, suffix, self.heads, self.lin, to_gguf=True)
        return fn(t) if fn else t

    def finish(self) -> list[tuple[str, torch.Tensor]]:
        """The stacked expert tensors, [expert, out, in] per projection (step35, whose
        experts come stacked: the MTP layers' own heads that differ from the lm_head, and
        its rope_freqs, if any)."""
        if self.arch in gguf_step.STEP_ARCHS:
            own = [(n, t) for n, t in sorted(self.own_heads.items())
                   if self.lm_head is None or not torch.equal(t, self.lm_head)]
            return own + gguf_step.rope_freqs(self.cfg)
        if self.mimo is not None:
            self.mimo.finish()
        by_proj = {proj: base for base, proj in _EXPERTS.items()}
        out = []
        for (bid, proj), experts in sorted(self.experts.items()):
            if proj not in by_proj or sorted(experts) != list(range(len(experts))):
                raise ValueError(f"layer {bid}: experts of {proj} are not 0..{len(experts) - 1}")
            stacked = torch.stack([experts[e] for e in range(len(experts))])
            out.append((f"blk.{bid}.{by_proj[proj]}.weight", stacked))
        return out


def _keep_f32(gname: str, t: torch.Tensor) -> bool:
    """Tensors llama.cpp keeps in F32 whatever the file type: norms, 1-D, small, routers."""
    stem, _ = _split_suffix(gname)
    base = stem.rsplit(".", 1)[-1]
    return (
        t.dim() < 2
        or base.endswith("norm")
        or base in ("ssm_conv1d", "ssm_a", "ffn_gate_inp", "ffn_gate_inp_shexp")
        or stem.endswith(".indexer.proj")  # DSA's head weights, float32 in the model too
    )


def _encode(t: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    arr = t.detach().to(torch.float32).cpu().contiguous().numpy()
    if qtype == GGMLQuantizationType.F32:
        return arr
    return gguf.quants.quantize(arr, qtype)


def _partial_rotary(cfg: dict, default: float | None = 1.0) -> float | None:
    """The rotated fraction of each head: transformers 5 configs keep it in rope_parameters."""
    for where in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if where.get("partial_rotary_factor") is not None:
            return float(where["partial_rotary_factor"])
    return default


def _write_metadata(
    w: GGUFWriter, arch: str, cfg: dict, n_layer: int, n_mtp: int, vocab_size: int | None
) -> None:
    if arch in gguf_step.STEP_ARCHS:
        gguf_step.write_metadata(w, cfg, n_layer, n_mtp, vocab_size)
        return
    if arch in gguf_step.MIMO_ARCHS:
        gguf_step.write_mimo_metadata(w, cfg, n_layer, n_mtp, vocab_size)
        return
    heads = int(cfg["num_attention_heads"])
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden else None)
    w.add_block_count(n_layer + n_mtp)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    if cfg.get("max_position_embeddings") is not None:
        w.add_context_length(int(cfg["max_position_embeddings"]))
    if hidden is not None:
        w.add_embedding_length(int(hidden))
    if cfg.get("intermediate_size") is not None:
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(gguf_moe.head_count_kv(arch, cfg)
                        or int(cfg.get("num_key_value_heads") or heads))
    if arch in gguf_moe.MOE_ARCHS:
        gguf_moe.write_metadata(w, arch, cfg, n_mtp, _partial_rotary(cfg, None))
    elif head_dim is not None:
        if cfg.get("head_dim") is not None:
            w.add_key_length(int(head_dim))
            w.add_value_length(int(head_dim))
        rope_dim = int(head_dim * _partial_rotary(cfg))
        w.add_rope_dimension_count(rope_dim)
    if (theta := _rope_theta(cfg)) is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if vocab_size is not None:
        w.add_vocab_size(int(vocab_size))
    scaling = gguf_moe.rope_scaling(cfg)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind and kind != "default":
        w.add_string(_key(Keys.Rope.SCALING_TYPE, arch), str(kind))
        if scaling.get("factor") is not None:
            w.add_rope_scaling_factor(float(scaling["factor"]))
        if scaling.get("original_max_position_embeddings") is not None:
            w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    if arch in _V_TILED:
        # llama.cpp's qwen35 loader requires the M-RoPE sections; HF keeps them in
        # rope_parameters (transformers 5) or rope_scaling, defaulting to [11, 11, 10].
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        sections = list(params.get("mrope_section") or [11, 11, 10])
        w.add_rope_dimension_sections((sections + [0] * 4)[:4])
    if arch in _QWEN_NEXT:
        lin = _config_linear(cfg)
        if lin is not None:
            w.add_ssm_group_count(lin.nk)
            w.add_ssm_state_size(lin.dk)
            w.add_ssm_time_step_rank(lin.nv)
            w.add_ssm_inner_size(lin.nv * lin.dv)
        if cfg.get("linear_conv_kernel_dim") is not None:
            w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
        interval = _full_attention_interval(cfg)
        if interval is not None:
            w.add_full_attention_interval(interval)
        types = cfg.get("layer_types")
        if types:
            # Which layers are linear-attention ones, the MTP layers after them (not): what
            # llama.cpp's converter writes and its qwen35/qwen3next loaders read before the
            # interval (src/models/qwen35.cpp), so any layout loads, periodic or not.
            w.add_array(_key(RECURRENT_LAYERS, arch),
                        [t == "linear_attention" for t in types] + [False] * n_mtp)
        for key, add in (
            ("num_experts", w.add_expert_count),
            ("num_experts_per_tok", w.add_expert_used_count),
            ("moe_intermediate_size", w.add_expert_feed_forward_length),
            ("shared_expert_intermediate_size", w.add_expert_shared_feed_forward_length),
        ):
            if cfg.get(key) is not None:
                add(int(cfg[key]))


def _write_tokenizer(
    w: GGUFWriter, tokenizer: Tokenizer, vocab_size: int | None, model_type: str | None
) -> None:
    vocab = gguf_moe.special_tokens(model_type, tokenizer.gguf_vocab(vocab_size))
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_types"])
    if vocab.get("merges"):
        w.add_token_merges(vocab["merges"])
    if vocab.get("scores"):
        w.add_token_scores(vocab["scores"])
    for key, add in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("unknown_token_id", w.add_unk_token_id),
        ("padding_token_id", w.add_pad_token_id),
        ("eot_token_id", w.add_eot_token_id),
        ("eom_token_id", w.add_eom_token_id),
    ):
        if vocab.get(key) is not None:
            add(int(vocab[key]))
    w.add_add_bos_token(bool(vocab.get("add_bos_token", False)))
    if vocab.get("chat_template"):
        w.add_chat_template(vocab["chat_template"])


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    hf_config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None = None,
    qtype: str = "F32",
    mtp_qtype: str | None = None,
) -> None:
    """Write HF-named tensors as a llama.cpp-style GGUF file (atomically: temp file + rename);
    the MTP (nextn) layers' matrices in ``mtp_qtype`` when given, else in ``qtype``."""
    q = _qtype(qtype)
    q_mtp = _qtype(mtp_qtype) if mtp_qtype is not None else q
    n_layer = int(hf_config["num_hidden_layers"])
    n_mtp = _count_mtp(hf_config, list(tensors), n_layer)
    if arch in _QWEN_NEXT and _config_linear(hf_config) is None:
        if any(".linear_attn." in name for name in tensors):
            raise ValueError(
                f"{arch}: linear-attention tensors need linear_num_key_heads, "
                "linear_key_head_dim, linear_num_value_heads and linear_value_head_dim in "
                "hf_config (their layout in GGUF depends on them)"
            )
    renamer = _Renamer(arch, hf_config, n_layer, n_mtp)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        for gname, gt in renamer.convert(name, t.detach().to(torch.float32).cpu()):
            if gname in out:
                raise ValueError(f"two tensors map to GGUF name {gname} (the second: {name})")
            out[gname] = gt
    out.update(renamer.finish())
    emb = out.get("token_embd.weight")
    vocab_size = int(emb.shape[0]) if emb is not None else hf_config.get("vocab_size")

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, arch)
        w.add_type(gguf.GGUFType.MODEL)
        w.add_file_type(_FILE_TYPES[q.name])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_metadata(w, arch, hf_config, n_layer, n_mtp, vocab_size)
        if tokenizer is not None:
            _write_tokenizer(w, tokenizer, vocab_size, hf_config.get("model_type"))
        for gname, t in out.items():
            bid = re.match(r"blk\.(\d+)\.", gname)
            tq = q_mtp if bid and int(bid.group(1)) >= n_layer else q
            tq = GGMLQuantizationType.F32 if _keep_f32(gname, t) else tq
            block = gguf.GGML_QUANT_SIZES[tq][0]
            if t.shape[-1] % block:
                tq = GGMLQuantizationType.F32  # rows that do not fill whole blocks stay exact
            w.add_tensor(gname, _encode(t, tq), raw_dtype=tq)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        publish_modes(Path(tmp))
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _qtype(name: str) -> GGMLQuantizationType:
    if name.upper() not in _FILE_TYPES:
        raise ValueError(f"GGUF type {name!r}: mtpkit writes {', '.join(_FILE_TYPES)} (the "
                         "gguf package quantizes to these; k-quants need llama.cpp's own "
                         "llama-quantize, run on an F16 file)")
    return GGMLQuantizationType[name.upper()]


def file_types() -> list[str]:
    """The GGUF tensor types write_gguf can write."""
    return list(_FILE_TYPES)


def _full_attention_interval(cfg: dict) -> int | None:
    """The hybrid layout as an interval (what loaders without the per-layer list read):
    the config's, else that of ``layer_types`` where it has one (None where it has not;
    the per-layer list then describes it alone)."""
    if cfg.get("full_attention_interval") is not None:
        return int(cfg["full_attention_interval"])
    types = cfg.get("layer_types")
    if not types or "full_attention" not in types:
        return None
    n = types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % n == 0) for i, t in enumerate(types)):
        return None
    return n


def arch_for_model_type(model_type: str) -> str:
    """The GGUF architecture name llama.cpp uses for an HF model_type."""
    for arch, (mt, _) in _ARCHS.items():
        if mt in (model_type, f"{model_type}_text"):
            return arch
    if model_type in gguf_moe.MOE_MODEL_TYPES:
        return gguf_moe.MOE_MODEL_TYPES[model_type]
    if model_type in gguf_step.STEP_MODEL_TYPES:
        return gguf_step.STEP_MODEL_TYPES[model_type]
    known = sorted({mt for mt, _ in _ARCHS.values()} | set(gguf_moe.MOE_MODEL_TYPES)
                   | set(gguf_step.STEP_MODEL_TYPES))
    raise ValueError(f"no GGUF architecture for model_type {model_type!r}; GGUF output "
                     f"supports {', '.join(known)}")
