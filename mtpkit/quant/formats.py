"""Read quantized checkpoints: which modules are stored quantized, in which format, and their
weights as ``QuantLinear`` layers.

Precision is decided by the tensors on disk, never by the config alone: a module stored as a
float ``weight`` loads as a float layer even when the config's quantization covers it (the
BF16 MTP head of a W4A16 release), and a module whose quantized tensors are incomplete is an
error naming them. Building quantized modules from a config and filling them from tensors
that are not there is how other engines end up drafting from uninitialised memory.

Formats, recognised by tensor names (suffixes of a module's prefix):
- compressed-tensors pack-quantized: weight_packed, weight_scale, weight_shape
  [, weight_zero_point, weight_g_idx]
- compressed-tensors int-quantized: weight (int8), weight_scale [, weight_zero_point]
- compressed-tensors float-quantized: weight (e4m3), weight_scale [, input_scale]
- DeepSeek native FP8: weight (e4m3), weight_scale_inv (one scale per 128x128 block)
- DeepSeek-V4 release (quant_method fp8): weight, scale; the weight is e4m3 with a scale per
  weight_block_size block, or FP4 (routed experts: e2m1 codes two to a byte, the first in the
  low nibble, stored as int8) with a scale per 32 input features of each row. Scales are
  float32 or, with scale_fmt ue8m0, powers of two (float8_e8m0fnu, or its raw bytes).
- GPTQ: qweight, qzeros, scales [, g_idx]   (packed along the input dimension)
- AWQ: qweight, qzeros, scales              (packed along the output dimension)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import torch

from ..checkpoint.errors import CheckpointError
from .linear import QuantLinear, a4_layout

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Tensors each format requires / may add, by suffix.
_FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pack-quantized": (("weight_packed", "weight_scale", "weight_shape"),
                       ("weight_zero_point", "weight_g_idx", "bias")),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx", "bias")),
    "awq": (("qweight", "qzeros", "scales"), ("bias",)),
    "fp8-block-inv": (("weight", "weight_scale_inv"), ("bias",)),
    "scaled": (("weight", "weight_scale"), ("weight_zero_point", "input_scale", "bias")),
}
# The DeepSeek-V4 release names a module's block scale ``scale``; it is read as the
# weight_scale_inv of DeepSeek's FP8 format (transformers and vLLM rename it so on load).
_SCALE_ALIASES = {"scale": "weight_scale_inv"}
_FP8_METHODS = ("fp8", "deepseek_v4_fp8")
# FP4 (e2m1) code -> value; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None))
                   if d is not None)
# AWQ packs eight 4-bit values per int32 in this order of output columns.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class QuantSpec:
    """One module stored quantized: its checkpoint prefix, format and tensor names."""

    prefix: str
    fmt: str
    tensors: dict[str, str]  # suffix -> full checkpoint name


@dataclass
class QuantPlan:
    """Every quantized module of a checkpoint, and the quantization config that came with it."""

    modules: dict[str, QuantSpec] = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    @property
    def consumed(self) -> set[str]:
        """Checkpoint tensor names that belong to quantized modules."""
        return {n for spec in self.modules.values() for n in spec.tensors.values()}

    def spec_for_weight(self, name: str) -> QuantSpec | None:
        """The quantized module whose ``weight`` this checkpoint name stands for."""
        if not name.endswith(".weight"):
            return None
        return self.modules.get(name[: -len(".weight")])


def quant_config_of(ckpt) -> dict:
    """The checkpoint's ``quantization_config`` (empty when there is none)."""
    config = getattr(ckpt, "config", None)
    return quant_config_in(config) if isinstance(config, dict) else {}


def quant_config_in(config: dict) -> dict:
    """A config.json's ``quantization_config``, top level or under ``text_config``."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization_config")
    return q or {}


def scan(ckpt) -> QuantPlan:
    """Find the quantized modules of a checkpoint by their tensors (headers only)."""
    names = set(ckpt.tensor_names())
    qcfg = quant_config_of(ckpt)
    method = str(qcfg.get("quant_method", "")).lower()
    plan = QuantPlan(config=qcfg)
    by_prefix: dict[str, set[str]] = {}
    aliases = _SCALE_ALIASES if method in _FP8_METHODS else {}
    for n in names:
        prefix, _, suffix = n.rpartition(".")
        by_prefix.setdefault(prefix, set()).add(suffix)
    for prefix, suffixes in by_prefix.items():
        fmt = None
        # A bare ``scale`` beside a ``weight`` only (hyper-connection scales have no weight).
        stored = {aliases.get(x, x): x for x in suffixes} if "weight" in suffixes else {}
        if any(k != v for k, v in stored.items()):
            suffixes = set(stored)
        else:
            stored = {x: x for x in suffixes}
        if "weight_packed" in suffixes:
            fmt = "pack-quantized"
        elif "qweight" in suffixes:
            fmt = "awq" if method == "awq" else "gptq"
        elif "weight_scale_inv" in suffixes:
            fmt = "fp8-block-inv"
        elif "weight_scale" in suffixes and "weight" in suffixes:
            fmt = "scaled"
        if fmt is None:
            continue
        required, optional = _FORMATS[fmt]
        missing = [s for s in required if s not in suffixes]
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: module {prefix} is stored quantized ({fmt}) but "
                f"{', '.join(prefix + '.' + s for s in missing)} is missing; the checkpoint is "
                "incomplete or mis-exported. mtpkit will not run a module on partial weights; "
                "re-export it or take the module from the original release (mtpkit graft)."
            )
        tensors = {s: f"{prefix}.{stored[s]}" for s in (*required, *optional) if s in suffixes}
        plan.modules[prefix] = QuantSpec(prefix, fmt, tensors)
    return plan


def read_module(spec: QuantSpec, ckpt, qcfg: dict) -> QuantLinear:
    """Build the QuantLinear for one module from its tensors."""
    t = {s: ckpt.get_tensor(n) for s, n in spec.tensors.items()}
    bias = t.get("bias")
    try:
        if spec.fmt == "pack-quantized":
            q = _pack_quantized(t, bias)
        elif spec.fmt == "gptq":
            q = _gptq(t, qcfg, bias)
        elif spec.fmt == "awq":
            q = _awq(t, qcfg, bias)
        elif spec.fmt == "fp8-block-inv":
            q = _fp8_block(t["weight"], t["weight_scale_inv"], qcfg, bias)
        else:
            q = _scaled(t, qcfg, bias)
        q.act_quant, q.act_note = activation_scheme(spec.prefix, qcfg, q)
        return q
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{ckpt.path}: cannot read quantized module {spec.prefix} ({spec.fmt}): {e}. "
            "Is quantization_config in config.json the one these tensors were written with?"
        ) from e


def _fp8_block(weight: torch.Tensor, scale: torch.Tensor, qcfg: dict, bias) -> QuantLinear:
    """DeepSeek's block-scaled FP8, or the V4 release's FP4 experts (as FP8: every e2m1
    value is an e4m3 value, so one layout serves both and dequantizes the same)."""
    if scale.dtype == torch.uint8:
        if str(qcfg.get("scale_fmt", "")).lower() != "ue8m0":
            raise ValueError("uint8 scales are only known as ue8m0 exponents, and the "
                             "config's scale_fmt is not ue8m0")
        scale = torch.exp2(scale.float() - 127)
    if weight.dtype in FP4_DTYPES:
        weight = unpack_fp4(weight)
        n, k = weight.shape
        if scale.dim() != 2 or n % scale.shape[0] or k % scale.shape[1]:
            raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not tile the "
                             f"{n}x{k} weight in groups")
        return QuantLinear.from_fp8(weight, scale, (n // scale.shape[0], k // scale.shape[1]),
                                    bias)
    block = qcfg.get("weight_block_size") or (128, 128)
    return QuantLinear.from_fp8(weight, scale, (int(block[0]), int(block[1])), bias)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """FP4 codes two to a byte (first in the low nibble) [N, K/2] -> e4m3 values [N, K]."""
    u8 = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2).long()
    return torch.tensor(FP4_E2M1_VALUES)[codes].to(torch.float8_e4m3fn)


def _perm_for(g_idx: torch.Tensor | None, k: int, group: int | None):
    """Column order that makes activation-ordered groups contiguous (None: already are)."""
    if g_idx is None or group is None:
        return None
    g_idx = g_idx.long()
    natural = torch.arange(k) // group
    if torch.equal(g_idx, natural):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise ValueError("g_idx does not assign group_size columns to each group")
    return perm


def unpack_codes(packed: torch.Tensor, bits: int, shape: torch.Size,
                 packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' unpack_from_int32 (codes int8 [shape] from pack-quantized words),
    8-bit rows on a little-endian host read as bytes."""
    if (bits == 8 and packed_dim == 1 and packed.dtype == torch.int32 and packed.dim() == 2
            and sys.byteorder == "little" and packed.shape[1] * 4 >= shape[1]):
        # Code i of a row is byte i of its words, stored as code + 128. By hand because
        # importing compressed-tensors costs a built-in model's start about 2.5 s (it loads
        # its whole package), more than the rest of loading, for what is a view here.
        raw = packed.contiguous().view(torch.uint8)[:, : shape[1]]
        return (raw ^ 0x80).view(torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, bits, shape, packed_dim=packed_dim)


def _pack_quantized(t: dict, bias) -> QuantLinear:
    packed, scale = t["weight_packed"], t["weight_scale"]
    if packed.dim() != 2:
        raise ValueError("fused (3-D) expert tensors are not supported quantized yet")
    n, k = (int(v) for v in t["weight_shape"].tolist())
    # The packing is dense (no padding bits), so the packed width tells the bit count.
    fits = [b for b in (4, 8, 2, 3, 5, 6, 7) if -(-k * b // 32) == packed.shape[1]]
    if not fits:
        raise ValueError(f"weight_packed width {packed.shape[1]} fits no bit width for {k} "
                         "input features")
    bits = fits[0]
    groups = scale.shape[1] if scale.dim() == 2 else 1
    group = None if groups == 1 else -(-k // groups)
    codes = unpack_codes(packed, bits, torch.Size((n, k)))
    zero = None
    if "weight_zero_point" in t:
        zero = unpack_codes(t["weight_zero_point"], bits, torch.Size((n, groups)),
                            packed_dim=0)
    perm = _perm_for(t.get("weight_g_idx"), k, group)
    if perm is not None:
        codes = codes[:, perm]
    return QuantLinear.from_int(codes, scale.reshape(n, groups), zero, bits, group, perm, bias)


def _scaled(t: dict, qcfg: dict, bias) -> QuantLinear:
    w, scale = t["weight"], t["weight_scale"]
    n, k = w.shape
    if w.dtype in FP8_DTYPES:
        block = None
        if scale.dim() == 2 and scale.shape[1] > 1:
            rows, cols = _block_structure(qcfg) or (-(-n // scale.shape[0]),
                                                   -(-k // scale.shape[1]))
            block = (rows, cols)
        return QuantLinear.from_fp8(w, scale, block, bias)
    if w.dtype != torch.int8:
        raise ValueError(f"weight of dtype {w.dtype} with a weight_scale is not a known format")
    groups = scale.shape[1] if scale.dim() == 2 else 1
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    group = None if groups == 1 else -(-k // groups)
    zero = t.get("weight_zero_point")
    if zero is not None and not bool(zero.any()):
        zero = None
    return QuantLinear.from_int(w, scale.reshape(n, groups), zero, 8, group, None, bias)


def _block_structure(qcfg: dict) -> tuple[int, int] | None:
    for group in (qcfg.get("config_groups") or {}).values():
        bs = (group.get("weights") or {}).get("block_structure")
        if bs:
            return int(bs[0]), int(bs[1])
    return None


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed low bits first into int32 along ``dim`` (GPTQ/AWQ layout).

    Written here because no maintained package that mtpkit depends on unpacks GPTQ/AWQ
    tensors (compressed-tensors' packer uses a different layout).
    """
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(-1 if dim == 1 else 1)
    if dim == 0:
        vals = (p >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
        return vals.reshape(packed.shape[0] * per, packed.shape[1])
    vals = (p >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def _gptq(t: dict, qcfg: dict, bias) -> QuantLinear:
    bits = int(qcfg.get("bits", 4))
    u = _unpack_int32(t["qweight"], bits, 0)  # [K, N]
    k, n = u.shape
    scales = t["scales"].float()  # [G, N]
    groups = scales.shape[0]
    zeros = _unpack_int32(t["qzeros"], bits, 1)[:, :n]  # [G, N]
    # GPTQ's original (v1) format stores zero - 1; "gptq_v2" stores the zero itself.
    if str(qcfg.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    half = 1 << (bits - 1)
    group = None if groups == 1 else k // groups
    codes = (u.T - half).to(torch.int8)
    zero = (zeros.T - half).to(torch.int8)
    if not bool(zero.any()):
        zero = None
    perm = _perm_for(t.get("g_idx"), k, group)
    if perm is not None:
        codes = codes[:, perm]
    return QuantLinear.from_int(codes, scales.T.contiguous(), zero, bits, group, perm, bias)


def _awq(t: dict, qcfg: dict, bias) -> QuantLinear:
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"AWQ with {bits} bits is not supported (4 only)")
    order = torch.tensor(_AWQ_ORDER)
    inv = torch.argsort(order)

    def unpack(x):
        v = _unpack_int32(x, 4, 1)  # [R, C*8], AWQ-ordered within each int32
        r, c = v.shape
        return v.view(r, c // 8, 8)[:, :, inv].reshape(r, c)

    u = unpack(t["qweight"])  # [K, N]
    k, n = u.shape
    scales = t["scales"].float()  # [G, N]
    groups = scales.shape[0]
    zeros = unpack(t["qzeros"])[:, :n]  # [G, N]
    group = None if groups == 1 else k // groups
    codes = (u.T - 8).to(torch.int8)
    zero = (zeros.T - 8).to(torch.int8)
    return QuantLinear.from_int(codes, scales.T.contiguous(), zero, 4, group, None, bias)


# -- what the config says ----------------------------------------------------------------


def config_covers(module: str, qcfg: dict) -> str | None:
    """The config entry that quantizes this Linear module (on-disk name), or None."""
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        found = _covering_group(module, qcfg)
        return None if found is None else f"quantization_config.config_groups.{found[0]}"
    skip = (qcfg.get("modules_to_not_convert") or qcfg.get("ignored_layers") or [])
    if module.split(".")[-1] == "lm_head" or any(s and s in module for s in skip):
        return None
    return f"quantization_config (quant_method {method or '?'})"


def activation_scheme(module: str, qcfg: dict, q: QuantLinear) -> tuple[str | None, str | None]:
    """How this module's inputs are quantized: ("int8-token", None) for int8 with dynamic
    per-token scales over int8 per-channel (W8A8) or grouped int4 (W4A8) weights, which
    mtpkit runs as written; (None, why) for activation schemes it
    runs weight-only instead (more precise than the checkpoint asks); (None, None) if none."""
    if str(qcfg.get("quant_method", "")).lower() != "compressed-tensors":
        return None, None
    found = _covering_group(module, qcfg)
    a = found[1].get("input_activations") if found else None
    if not a:
        return None, None
    if (a.get("type") == "int" and int(a.get("num_bits", 0)) == 8
            and a.get("strategy") == "token" and a.get("dynamic") is True
            and a.get("symmetric", True) and q.kind == "int" and q.perm is None
            and ((q.bits == 8 and q.group_size is None and q.zero is None) or a4_layout(q))):
        return "int8-token", None
    desc = (f"{a.get('type', '?')}{a.get('num_bits', '?')} "
            f"{'dynamic' if a.get('dynamic') else 'static'} {a.get('strategy', '?')} "
            f"{'symmetric' if a.get('symmetric', True) else 'asymmetric'}")
    what = "fp8" if q.kind == "fp8" else f"int{q.bits}"
    if q.kind == "int" and q.bits == 4:
        what += f" (group {q.group_size})" if q.group_size else " (per channel)"
    return None, (f"activation quantization {desc} is not implemented for "
                  f"{what} weights; these "
                  "layers run weight-only, with unquantized activations")


def _covering_group(module: str, qcfg: dict) -> tuple[str, dict] | None:
    """(name, entry) of the compressed-tensors config group that quantizes this on-disk
    module: the first whose targets match, unless the ignore list names it."""
    if _matches_any(module, qcfg.get("ignore") or []):
        return None
    # compressed-tensors ranks matches: an exact name over a regex over the class name, so
    # a group naming "lm_head" outranks one targeting every "Linear".
    best = None
    for gname, group in (qcfg.get("config_groups") or {}).items():
        rank = _match_rank(module, group.get("targets") or [])
        if rank is not None and (best is None or rank < best[0]):
            best = (rank, gname, group)
    return None if best is None else best[1:]


def _match_rank(module: str, entries: list[str]) -> int | None:
    # 0: exact name, 1: "re:" pattern, 2: class name; None: no match.
    ranks = [0 if e == module else 1 if e.startswith("re:") and re.match(e[3:], module)
             else 2 if e == "Linear" else None for e in entries]
    ranks = [r for r in ranks if r is not None]
    return min(ranks) if ranks else None


def _matches_any(module: str, entries: list[str]) -> bool:
    # compressed-tensors semantics on on-disk names: exact name, "re:" + re.match, or the
    # class name (every module mtpkit asks about is a Linear).
    for e in entries:
        if e == module or e == "Linear":
            return True
        if e.startswith("re:") and re.match(e[3:], module):
            return True
    return False
