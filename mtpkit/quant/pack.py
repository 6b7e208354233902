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
