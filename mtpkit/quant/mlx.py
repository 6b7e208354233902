"""MLX checkpoints: affine quantization as mlx-lm stores it, and the MTP head where vllm-mlx
reads it.

mlx-lm keeps no MTP modules (its Qwen3.5 ``sanitize`` drops every ``mtp.`` tensor), so a
converted model has no head; vllm-mlx builds one itself from a separate file. Everything here
is computed with torch, so writing an MLX checkpoint does not need MLX installed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint import is_gguf, open_checkpoint
from ..checkpoint.errors import CheckpointError
from ..outputs import publish

# Families mlx-lm converts and vllm-mlx 0.6.0 can give an MTP head.
MLX_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# vllm-mlx looks for Qwen3.5 heads in the first, then the second; Qwen3-Next only in the second.
MTP_DIR_FILE = "mtp/weights.safetensors"
MTP_FILE = "model-mtp.safetensors"
# A manifest beside the head file stops vllm-mlx from guessing the norm convention from the
# mean of each weight (it adds 1 to any norm whose mean is below 0.5, which would shift a
# trained gamma that happens to be small a second time).
MANIFEST = {"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}
HIDDEN_STATE_MODE = "post_norm"  # what the HF/vLLM heads are trained on
SHARD_BYTES = 5 << 30  # mlx-lm's default shard size

# Norms whose HF weights are zero-centred (x * (1 + w)); MLX's RMSNorm is x * w.
_TRUNK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
_MTP_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
              ".k_norm.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight",
              "norm.weight")
# Read in vllm_mlx/patches/qwen3_next_mtp.py (0.6.0): its head sees other inputs than the
# ones Qwen3-Next's head is trained on, so no file mtpkit could write makes it draft right.
QWEN3_NEXT_HEAD = (
    "vllm-mlx 0.6.0 runs Qwen3-Next's head on the trunk's pre-norm hidden state and "
    "concatenates [hidden, embedding], the reverse of what its fc is trained on (HF, vLLM: "
    "post-norm, [embedding, hidden]); it also builds the head quantized like the trunk. "
    "Serve Qwen3-Next's MTP with vLLM or mtpkit, or Qwen3.5 with vllm-mlx")
_GATES = ("mlp.gate", "shared_expert_gate")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------
# affine quantization


def affine_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint32, scales, biases)`` with the same bits as ``mx.quantize`` (affine).

    Each group maps its range onto 0..2^bits-1 with the endpoint of larger magnitude stored
    exactly (so a group of one sign keeps its extreme value), all in float32; scales and
    biases come back in ``w``'s dtype.
    """
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"MLX affine quantization takes 2, 3, 4, 5, 6 or 8 bits, got {bits}")
    if w.shape[-1] % group_size:
        raise ValueError(f"input size {w.shape[-1]} is not a multiple of group size "
                         f"{group_size}")
    if (w.shape[-1] * bits) % 32:
        raise ValueError(f"input size {w.shape[-1]} at {bits} bits does not fill whole "
                         "32-bit words")
    lead = w.shape[:-1]
    g = w.reshape(-1, w.shape[-1] // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    w_max = g.amax(-1, keepdim=True).float()
    w_min = g.amin(-1, keepdim=True).float()
    neg_edge = w_min.abs() > w_max.abs()
    scales = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scales = torch.where(neg_edge, scales, -scales)
    edge = torch.where(neg_edge, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / q0, scales)
    biases = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    q = torch.clamp(torch.round((g.float() - biases) / scales), 0, n_bins).to(torch.int64)
    packed = _pack(q.reshape(*lead, -1), bits)
    return (packed, scales.to(w.dtype).reshape(*lead, -1), biases.to(w.dtype).reshape(*lead, -1))


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (int64, 0..2^bits-1) -> uint32 words, the first code in the lowest bits; codes
    may straddle two words (3, 5, 6 bits), as MLX packs them."""
    lead, n = q.shape[:-1], q.shape[-1]
    flat = q.reshape(-1, n)
    pos = torch.arange(n, dtype=torch.int64) * bits
    words = torch.zeros(flat.shape[0], n * bits // 32, dtype=torch.int64)
    lo_word, shift = pos // 32, pos % 32
    words.index_add_(1, lo_word, (flat << shift) & 0xFFFFFFFF)
    spill = shift + bits > 32
    if spill.any():
        idx = torch.nonzero(spill).squeeze(1)
        words.index_add_(1, lo_word[idx] + 1, flat[:, idx] >> (32 - shift[idx]))
    return _to_uint32(words).reshape(*lead, -1)


def _to_uint32(words: torch.Tensor) -> torch.Tensor:
    signed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return signed.view(torch.uint32)


def affine_dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                      bits: int, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """The weight ``packed``/``scales``/``biases`` stand for: scale * code + bias."""
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lead = words.shape[:-1]
    words = words.reshape(-1, words.shape[-1])
    n = words.shape[-1] * 32 // bits
    pos = torch.arange(n, dtype=torch.int64) * bits
    lo_word, shift = pos // 32, pos % 32
    codes = words[:, lo_word] >> shift
    spill = shift + bits > 32
    if spill.any():
        nxt = torch.clamp(lo_word + 1, max=words.shape[-1] - 1)
        codes = torch.where(spill, codes | (words[:, nxt] << (32 - shift)), codes)
    codes = (codes & ((1 << bits) - 1)).float().reshape(words.shape[0], -1, group_size)
    s = scales.float().reshape(words.shape[0], -1, 1)
    b = biases.float().reshape(words.shape[0], -1, 1)
    return (codes * s + b).reshape(*lead, n).to(dtype)


# ---------------------------------------------------------------------------------------------
# HF -> MLX names and values


def _family(raw: dict) -> str:
    mt = raw.get("model_type")
    if mt in ("qwen3_5_text", "qwen3_5_moe_text"):
        mt = mt[: -len("_text")]
    if mt not in MLX_MODEL_TYPES:
        raise ValueError(f"--format mlx writes {', '.join(MLX_MODEL_TYPES)} checkpoints (the "
                         f"families vllm-mlx gives an MTP head); this one is {mt!r}")
    return mt


def mtp_relative(name: str) -> str | None:
    """The head-relative name of an MTP tensor in any of the HF or MLX spellings, else None."""
    for prefix in ("mtp.", "language_model.mtp.", "model.mtp.", "model.language_model.mtp."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _trunk_name(name: str, family: str) -> str | None:
    """mlx-lm's parameter name for an HF trunk tensor (None: mlx-lm keeps no such module)."""
    if family == "qwen3_next":
        return name
    if name.startswith(("model.visual.", "vision_tower")):
        return None
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name
    return "language_model." + name


def _is_expert(name: str) -> tuple[str, str, int] | None:
    """(layer prefix up to ``mlp``, projection, expert) of a per-expert tensor."""
    parts = name.split(".")
    if "experts" not in parts or not name.endswith(".weight"):
        return None
    i = parts.index("experts")
    if i + 3 != len(parts) - 1 or not parts[i + 1].isdigit() or parts[i + 2] not in _EXPERT_PROJ:
        return None
    return ".".join(parts[:i]), parts[i + 2], int(parts[i + 1])


def _to_mlx_layout(tensors: dict, num_experts: int) -> dict:
    """Stack per-expert weights into ``switch_mlp`` (and split fused ``gate_up_proj``), move
    the conv's kernel axis last: the module layout mlx-lm builds."""
    out, pending = {}, {}
    for k, v in tensors.items():
        ex = _is_expert(k)
        if ex is not None:
            pending.setdefault((ex[0], ex[1]), {})[ex[2]] = v
            continue
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len(".experts.gate_up_proj")]
            mid = v.shape[-2] // 2
            out[f"{pre}.switch_mlp.gate_proj.weight"] = v[..., :mid, :].contiguous()
            out[f"{pre}.switch_mlp.up_proj.weight"] = v[..., mid:, :].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            out[k[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = v
        elif "conv1d.weight" in k and v.ndim == 3 and v.shape[-1] != 1:
            out[k] = v.movedim(2, 1).contiguous()
        else:
            out[k] = v
    for (pre, proj), by_e in pending.items():
        if sorted(by_e) != list(range(num_experts)):
            raise CheckpointError(f"{pre}.experts: {len(by_e)} of {num_experts} experts' "
                                  f"{proj} stored")
        out[f"{pre}.switch_mlp.{proj}.weight"] = torch.stack([by_e[e] for e in sorted(by_e)])
    return out


def _shift_norms(tensors: dict, suffixes) -> dict:
    return {k: (v.float() + 1.0).to(v.dtype) if v.ndim == 1 and k.endswith(suffixes) else v
            for k, v in tensors.items()}


def _quantizable(name: str, v: torch.Tensor, group_size: int) -> bool:
    # what mlx-lm's convert quantizes: Linear, Embedding and SwitchLinear weights whose input
    # size the group size divides; the conv and the 1-D parameters stay float
    return (name.endswith(".weight") and v.ndim >= 2 and "conv1d" not in name
            and v.shape[-1] % group_size == 0)


def _gate(name: str) -> bool:
    return name[: -len(".weight")].endswith(_GATES)


def quantize_tensors(tensors: dict, bits: int, group_size: int, moe: bool
                     ) -> tuple[dict, dict]:
    """Quantize every quantizable weight; return the tensors and the per-module entries
    mlx-lm records in ``quantization`` (its MoE gates run at 8 bits, group 64)."""
    out, special = {}, {}
    for k, v in tensors.items():
        gate = moe and k.endswith(".weight") and _gate(k)
        b, g = (8, 64) if gate else (bits, group_size)
        if not _quantizable(k, v, g):
            out[k] = v
            continue
        base = k[: -len(".weight")]
        q, s, z = affine_quantize(v, b, g)
        out[k], out[f"{base}.scales"], out[f"{base}.biases"] = q, s, z
        if gate:  # mlx-lm records every module its predicate gave its own parameters
            special[base] = {"group_size": g, "bits": b}
    return out, special


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class MlxReport:
    out: Path
    quantized: int = 0
    kept: int = 0
    head: str | None = None  # the head file written, relative to out
    head_precision: str = ""
    notes: list[str] = field(default_factory=list)


def _text_cfg(raw: dict) -> dict:
    tc = raw.get("text_config")
    return tc if isinstance(tc, dict) else raw


def _mlx_config_keys(tc: dict) -> None:
    """Spell out the fields mlx-lm reads but newer transformers configs only imply: mlx-lm
    places full attention every ``full_attention_interval`` layers (ignoring ``layer_types``)
    and Qwen3-Next's args need top-level ``rope_theta`` / ``partial_rotary_factor``."""
    types = tc.get("layer_types")
    if types and "full_attention" in types:
        step = types.index("full_attention") + 1
        want = ["full_attention" if (i + 1) % step == 0 else "linear_attention"
                for i in range(len(types))]
        if types != want:
            raise ValueError("mlx-lm places full attention every full_attention_interval "
                             f"layers; this layer_types pattern has no such interval: {types}")
        if tc.get("full_attention_interval", 4) != step:
            tc["full_attention_interval"] = step
    rope = tc.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if tc.get(key) is None and key in rope:
            tc[key] = rope[key]


def _save_shards(tensors: dict, folder: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n shards with an index, as mlx-lm saves."""
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k].contiguous()
        size += nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=4))


def mlx_head_tensors(head: dict, family: str, num_experts: int, precision: str,
                     quantization: dict | None) -> tuple[dict, str]:
    """HF head tensors (head-relative names) -> the file vllm-mlx loads, with its path.

    Qwen3.5: names under ``mtp.``, MoE experts stacked as mlx-lm's ``switch_mlp`` (vllm-mlx
    loads the module with strict=False, so any other expert spelling would be dropped without
    a word), norms as MLX gammas with the manifest saying so, BF16 unless ``precision`` is
    ``same`` (vllm-mlx dequantizes every triplet with the trunk's bits and group size, so a
    quantized head must use exactly those).
    """
    if family == "qwen3_next":
        raise ValueError(QWEN3_NEXT_HEAD)
    t = _shift_norms(_to_mlx_layout(head, num_experts), _MTP_NORMS)
    if precision == "same":
        if not quantization:
            raise ValueError("--mtp same needs a quantized trunk")
        t, _ = quantize_tensors(t, quantization["bits"], quantization["group_size"],
                                moe=False)
        # vllm-mlx dequantizes every triplet with the trunk's (bits, group): a gate at 8 bits
        # would come out wrong, so gates go in the trunk's own format too
    elif precision != "bf16":
        raise ValueError(f"MTP precision must be bf16 or same, got {precision!r}")
    else:
        t = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items()}
    return {f"mtp.{k}": v for k, v in t.items()}, MTP_DIR_FILE


def write_head(folder: Path, tensors: dict, rel: str) -> None:
    """Write the head file and, beside it, the manifest that fixes its norm convention."""
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path,
              metadata={"format": "mlx"})
    (path.parent / "manifest.json").write_text(json.dumps(MANIFEST, indent=2))


def set_head_config(raw: dict, n_layers: int) -> None:
    """The keys vllm-mlx reads to build the head: layer count and hidden-state mode."""
    tc = _text_cfg(raw)
    key = "num_nextn_predict_layers" if raw.get("model_type") == "qwen3_next" \
        else "mtp_num_hidden_layers"
    tc[key] = n_layers
    tc["mtp_hidden_state_mode"] = HIDDEN_STATE_MODE


def quantize_mlx(model, out, bits: int = 4, group_size: int = 64, mtp: str = "bf16",
                 force: bool = False) -> MlxReport:
    """Write an MLX checkpoint of the HF folder ``model``: the trunk quantized as mlx-lm's
    convert writes it, the MTP head (if any) where vllm-mlx loads it."""
    src, out = Path(model), Path(out)
    if is_gguf(src):
        raise ValueError("--format mlx converts an HF folder; pass the BF16 release")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to replace it, or choose another --out")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} would write into the input {src}")
    ck = open_checkpoint(src)
    raw = json.loads(json.dumps(ck.raw_config))
    family = _family(raw)
    if raw.get("quantization_config") or _text_cfg(raw).get("quantization_config"):
        raise ValueError(f"{src} is already quantized; --format mlx starts from the float "
                         "release")
    tc = _text_cfg(raw)
    num_experts = int(tc.get("num_experts") or 0)
    tied = bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
    trunk, head = {}, {}
    for name in ck.tensor_names():
        rel = mtp_relative(name)
        if rel is not None:
            head[rel] = ck.get_tensor(name)
            continue
        new = _trunk_name(name, family)
        if new is None or (tied and new.endswith("lm_head.weight")):
            continue
        trunk[new] = ck.get_tensor(name)
    trunk = _shift_norms(_to_mlx_layout(trunk, num_experts), _TRUNK_NORMS)
    rep = MlxReport(out)
    qtrunk, special = quantize_tensors(trunk, bits, group_size, moe=num_experts > 0)
    rep.quantized = sum(1 for k in qtrunk if k.endswith(".scales"))
    rep.kept = sum(1 for k in qtrunk if k.endswith(".weight")) - rep.quantized
    quant = {"group_size": group_size, "bits": bits, "mode": "affine", **special}
    raw["quantization"] = quant
    raw["quantization_config"] = quant
    raw.pop("vision_config", None)  # mlx-lm keeps no vision tower
    _mlx_config_keys(tc)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _save_shards(qtrunk, tmp)
        if head and family == "qwen3_next":
            rep.notes.append(f"no MTP head written: {QWEN3_NEXT_HEAD}")
        elif head:
            tensors, rel = mlx_head_tensors(head, family, num_experts, mtp, quant)
            write_head(tmp, tensors, rel)
            set_head_config(raw, _count_layers(head))
            rep.head, rep.head_precision = rel, mtp
        else:
            rep.notes.append(f"{src} stores no MTP head: graft one with `mtpkit graft --from "
                             "<BF16 release> --into OUT`")
        (tmp / "config.json").write_text(json.dumps(raw, indent=4, sort_keys=True))
        _copy_side_files(src, tmp)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rep


def _count_layers(head: dict) -> int:
    idx = {int(k.split(".")[1]) for k in head if k.startswith("layers.")}
    return len(idx) or 1


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation files: everything but weights, index and config."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
