"""Quantize one weight into compressed-tensors tensors (round to nearest), through the
``compressed-tensors`` package so the bit layout is exactly what vLLM reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("w4a16", "w4a8", "w8a16", "w8a8", "fp8")


@dataclass(frozen=True)
class Scheme:
    """``w4a16`` / ``w8a16`` (int weights, symmetric unless told), ``fp8`` (weights only),
    ``w8a8`` (int8 weights per channel, int8 activations quantized per token at run time,
    llm-compressor's W8A8 preset) or ``w4a8`` (int4 weights in groups, the same int8
    activations; llm-compressor's W4A8 preset)."""

    name: str
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ValueError(f"unknown scheme {self.name!r}; choose one of {', '.join(SCHEMES)}")
        if self.group_size is not None and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group size {self.group_size} is not one of 32, 64, 128, 256 "
                             "(or 0 for one scale per output channel)")
        if self.name in ("fp8", "w8a8") and self.group_size is not None:
            raise ValueError(f"{self.name} uses one scale per output channel; drop --group-size")
        if self.name == "w4a8" and self.group_size is None:
            raise ValueError("w4a8 weights are quantized in groups; pass --group-size 32, 64, "
                             "128 or 256")
        if self.name == "w8a8" and not self.symmetric:
            raise ValueError("w8a8 weights are symmetric (vLLM's int8 W8A8 kernels take no "
                             "weight zero points); drop --asymmetric")

    @property
    def bits(self) -> int:
        """Bits per weight."""
        return 4 if self.name in ("w4a16", "w4a8") else 8

    @property
    def format(self) -> str:
        """compressed-tensors format name."""
        return {"fp8": "float-quantized", "w8a8": "int-quantized"}.get(self.name,
                                                                       "pack-quantized")

    def scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The dtype scales are stored (and codes chosen) in: the weight's own, except w4a8's
        float16, which mtpkit's W4A8 kernel reads at 2 bytes a group (a fp32 source's scales
        would cost 4: an eighth of the codes' bytes at group 32)."""
        if self.name == "w4a8":
            return torch.float16
        return weight_dtype if weight_dtype.is_floating_point else torch.float32

    def input_args(self):
        """The compressed-tensors QuantizationArgs of the activations (None: not quantized)."""
        from compressed_tensors.quantization import QuantizationArgs

        if self.name not in ("w8a8", "w4a8"):
            return None
        return QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True,
                                symmetric=True)

    def args(self):
        """The compressed-tensors QuantizationArgs of the weights."""
        from compressed_tensors.quantization import QuantizationArgs

        if self.name == "fp8":
            return QuantizationArgs(num_bits=8, type="float", strategy="channel",
                                    symmetric=True)
        strategy = "channel" if self.group_size is None else "group"
        return QuantizationArgs(num_bits=self.bits, type="int", strategy=strategy,
                                group_size=self.group_size, symmetric=self.symmetric)

    def fits(self, out_features: int, in_features: int) -> bool:
        """Whether a weight of this shape can be stored in this scheme for vLLM's kernels."""
        if out_features % 16 or in_features % 32:
            return False
        return self.group_size is None or in_features % self.group_size == 0


def quantize_weight(
    weight: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Tensors (suffix -> tensor) that store ``weight`` [N, K] in ``scheme``, RTN."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.args()
    w = weight.detach().float()
    n, k = w.shape
    g = k if scheme.group_size is None else scheme.group_size
    wg = w.view(n, k // g, g)
    scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    # Round the scales to their stored dtype before choosing codes, so the codes are the
    # nearest ones for the scale a reader will actually see.
    dtype = scale_dtype or scheme.scale_dtype(weight.dtype)
    scale = scale.reshape(n, k // g).to(dtype).float()
    if scheme.name == "fp8":
        scale = scale.reshape(n, 1)
    sd = {"weight": w, "weight_scale": scale}
    if not args.symmetric:
        sd["weight_zero_point"] = zero.reshape(n, k // g)
    qs = QuantizationScheme(targets=["Linear"], weights=args)
    out = _compressor(scheme).compress(sd, qs)
    out["weight_scale"] = out["weight_scale"].to(dtype)
    return out


def _compressor(scheme: Scheme):
    if scheme.name in ("fp8", "w8a8"):
        from compressed_tensors.compressors.naive_quantized import base

        return (base.FloatQuantizationCompressor if scheme.name == "fp8"
                else base.IntQuantizationCompressor)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor


def config_group(scheme: Scheme, targets: list[str]) -> dict:
    """One ``config_groups`` entry as compressed-tensors writes it."""
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=targets, weights=scheme.args(),
                              input_activations=scheme.input_args()).model_dump(
        exclude_none=True, mode="json"
    )


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 codes [N, K] and scales [N, 1] of a float weight,
    round to nearest with the scales of ``w8a16`` (what `mtpkit quantize` writes)."""
    w = weight.detach().float()
    # compressed-tensors' calculate_qparams with w8a16's arguments (symmetric int8 per
    # channel): the largest magnitude over 255 / 2, a zero scale replaced by float32's eps.
    # By hand because importing compressed-tensors (transformers and scipy come with it)
    # costs every start of the built-in model, whose head this quantizes, about 2.5 s; a
    # test holds it to calculate_qparams.
    amax = torch.maximum(w.amin(-1, keepdim=True).clamp(max=0).abs(),
                         w.amax(-1, keepdim=True).clamp(min=0))
    scale = amax / 127.5
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale).reshape(-1, 1)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def int8_head_beside_int8_trunk(model) -> int:
    """Give a float draft head int8 weights (per channel, RTN) where every trunk GEMM and
    the lm_head hold int8 weights with float activations on mtpkit's kernels; returns how
    many Linears it changed.

    A draft step then reads a quarter of the bytes it read (the shipped head is 17 MB in
    fp32 beside a 135 MB int8 trunk, a tenth of every round's weight stream). Output cannot
    change: drafts only propose, the trunk verifies each one; acceptance moves by the
    rounding of the head's weights (docs/quantization.md)."""
    from torch import nn

    from .linear import QuantLinear

    head = getattr(model, "mtp", None)
    if head is None:
        return 0
    trunk = [m for m in model.model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    trunk.append(model.lm_head)
    if not trunk or not all(
            isinstance(m, QuantLinear) and m.kind == "int" and m.bits == 8
            and m.group_size is None and m.zero is None and m.perm is None
            and m.act_quant is None and m.row_exact for m in trunk):
        return 0
    n = 0
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                codes, scale = int8_rows(child.weight)
                q = QuantLinear.from_int(codes.to(child.weight.device),
                                         scale.to(child.weight.device), None, 8, None,
                                         bias=None if child.bias is None
                                         else child.bias.detach().float())
                setattr(parent, name, q)
                n += 1
    return n
