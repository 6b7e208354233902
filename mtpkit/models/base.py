"""What every family shares: the trunk forward over caches, the MTP draft step, weight loading."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..checkpoint.errors import CheckpointError
from .cache import KVCache, ModelCache
from .mtp import MTPHead


@dataclass
class TrunkOutput:
    """Hidden states of one forward pass."""

    hidden: torch.Tensor  # [B, T, D] after the final norm (what the lm_head reads)
    pre_norm: torch.Tensor  # [B, T, D] before it

    def for_mtp(self, which: str) -> torch.Tensor:
        """The state an MTP head reads: 'post_norm' or 'pre_norm'."""
        return self.hidden if which == "post_norm" else self.pre_norm


class CausalLM(nn.Module):
    """A decoder-only trunk (``model.*``, ``lm_head``) with an optional MTP head (``mtp.*``).

    A family subclass builds ``self.model`` (embed_tokens, layers, norm), ``self.lm_head``,
    ``self.rotary`` and, when the config has one, ``self.mtp``; its decoder layers take
    ``(x, cos, sin, layer_cache)``.
    """

    # (regex, replacement) applied to checkpoint tensor names before matching module names;
    # a replacement of None drops the tensor (e.g. a vision tower).
    checkpoint_renames: ClassVar[list[tuple[str, str | None]]] = []

    mtp: MTPHead | None

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def tie_weights(self) -> None:
        """Share the embedding with the lm_head when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- caches -------------------------------------------------------------------------
    def new_cache(self, max_len: int, batch: int = 1) -> ModelCache:
        """Caches for every trunk layer, preallocated for ``max_len`` positions."""
        return ModelCache([layer.new_cache(batch, max_len) for layer in self.model.layers])

    def new_mtp_cache(self, max_len: int, batch: int = 1) -> ModelCache | None:
        """One KV cache per MTP layer (None without a head)."""
        if self.mtp is None:
            return None
        return ModelCache([layer.new_cache(batch, max_len) for layer in self.mtp.layers])

    # -- forward passes -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: ModelCache | None = None) -> TrunkOutput:
        """Run tokens [B, T] at positions cache.length.. through the trunk."""
        start = cache.length if cache is not None else 0
        cos, sin = self.rotary.cos_sin(self._positions(start, input_ids.shape[1]))
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache[i] if cache is not None else None)
        return TrunkOutput(self.model.norm(x), x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fp32) for hidden states [B, T, D]."""
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        step: int,
        start: int,
        cache: ModelCache | None,
    ) -> TrunkOutput:
        """One draft step: tokens t_{i+1} [B, T] and states h_i [B, T, D] at positions start.."""
        layer_cache: KVCache | None = None
        if cache is not None:
            layer_cache = cache[step % len(cache)]
            # Speculative entries past `start` are stale; a layer not used at every step
            # may lag behind, and its skipped slots are masked out.
            if layer_cache.length > start:
                layer_cache.trim(start)
            layer_cache.skip_to(start)
        cos, sin = self.rotary.cos_sin(self._positions(start, next_ids.shape[1]))
        emb = self.model.embed_tokens(next_ids)
        post, pre = self.mtp(emb, hidden, step, cos, sin, layer_cache, start)
        return TrunkOutput(post, pre)

    def _positions(self, start: int, t: int) -> torch.Tensor:
        return torch.arange(start, start + t, device=self.lm_head.weight.device)

    # -- loading --------------------------------------------------------------------------
    def map_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> module parameter name (None: not ours, skip it)."""
        for pattern, repl in self.checkpoint_renames:
            if re.match(pattern, name):
                if repl is None:
                    return None
                name = re.sub(pattern, repl, name)
        return name

    def split_checkpoint_tensor(
        self, name: str, tensor_fn
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Hook for tensors stored fused on disk (e.g. stacked experts); None: no split."""
        return None

    def load_checkpoint(self, ckpt, keep_missing_head: bool = False) -> LoadReport:
        """Copy every parameter from ``ckpt``; drop the MTP head when the checkpoint has none
        (``keep_missing_head``: keep it uninitialised, to be trained)."""
        params = dict(self.named_parameters())
        by_module: dict[str, str] = {}
        loaded: set[str] = set()
        unexpected: list[str] = []
        fp8 = Fp8Blocks.of(ckpt)
        for name in ckpt.tensor_names():
            if name in fp8.scale_names:
                continue  # read together with its weight
            mapped = self.map_checkpoint_name(name)
            if mapped is None:
                continue
            if mapped in params:
                by_module[mapped] = name
                continue
            split = self.split_checkpoint_tensor(mapped, lambda n=name: fp8.read(ckpt, n))
            if split is None:
                unexpected.append(name)
                continue
            for sub_name, tensor in split:
                if sub_name not in params:
                    unexpected.append(f"{name} -> {sub_name}")
                    continue
                self._copy_param(params[sub_name], tensor, sub_name, name, ckpt)
                by_module[sub_name] = name
                loaded.add(sub_name)
        report = LoadReport(unexpected=unexpected)
        missing = [p for p in params if p not in by_module]
        missing_mtp = [p for p in missing if p.startswith("mtp.")]
        if self.mtp is not None and missing_mtp and not keep_missing_head:
            if len(missing_mtp) == sum(p.startswith("mtp.") for p in params):
                report.notes.append(
                    "the config declares an MTP head but the checkpoint has no MTP tensors "
                    "(an export that dropped them?); decoding without speculation. "
                    "Run `mtpkit doctor` on the checkpoint for the cause and fix."
                )
                self.mtp = None
            else:
                raise CheckpointError(
                    f"{ckpt.path}: the MTP head is incomplete; missing tensors: "
                    f"{', '.join(missing_mtp[:8])}{' ...' if len(missing_mtp) > 8 else ''}. "
                    "Graft the head from the original release (mtpkit graft)."
                )
        missing = [p for p in missing if not p.startswith("mtp.")]
        if missing:
            raise CheckpointError(
                f"{ckpt.path}: {len(missing)} tensors the model needs are missing from the "
                f"checkpoint, e.g. {', '.join(missing[:5])}. Is the checkpoint complete "
                "(every shard present) and of the model_type its config.json says?"
            )
        for module_name, ckpt_name in by_module.items():
            if module_name in loaded or (module_name.startswith("mtp.") and self.mtp is None):
                continue
            p = params[module_name]
            self._copy_param(p, fp8.read(ckpt, ckpt_name), module_name, ckpt_name, ckpt)
        if unexpected:
            report.notes.append(
                f"{len(unexpected)} checkpoint tensors are not used by the "
                f"{type(self).__name__} model, e.g. {', '.join(unexpected[:5])}"
            )
        return report

    @staticmethod
    def _copy_param(param, tensor, module_name, ckpt_name, ckpt) -> None:
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{ckpt.path}: tensor {ckpt_name} has shape {tuple(tensor.shape)}, but the "
                f"config implies {tuple(param.shape)} for {module_name}. The config.json does "
                "not match the weights (wrong hidden_size / head counts / vocab_size?)."
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Fp8Blocks:
    """DeepSeek-native FP8 (``quant_method: fp8``): an e4m3 ``weight`` with an fp32
    ``weight_scale_inv`` per block (128x128 unless ``weight_block_size`` says otherwise);
    the real weight is the stored value times the scale (the name notwithstanding)."""

    scale_names: set[str]
    block: tuple[int, int] = (128, 128)

    @classmethod
    def of(cls, ckpt) -> Fp8Blocks:
        """The scales a checkpoint holds (none for an unquantized one)."""
        names = {n for n in ckpt.tensor_names() if n.endswith(".weight_scale_inv")}
        if not names:
            return cls(set())
        config = getattr(ckpt, "config", None)
        quant = (config if isinstance(config, dict) else {}).get("quantization_config") or {}
        block = quant.get("weight_block_size") or (128, 128)
        return cls(names, (int(block[0]), int(block[1])))

    def read(self, ckpt, name: str) -> torch.Tensor:
        """A tensor as the model uses it: FP8 weights dequantized to fp32, others as stored."""
        scale_name = name + "_scale_inv"
        tensor = ckpt.get_tensor(name)
        if scale_name not in self.scale_names:
            if tensor.dtype in FP8_DTYPES:
                # Copying e4m3 values without their scales would give a model that runs and
                # talks nonsense; refuse instead.
                raise CheckpointError(
                    f"{ckpt.path}: {name} is stored as FP8 without a DeepSeek-style "
                    f"{scale_name}; this FP8 format (e.g. compressed-tensors float-quantized) "
                    "is not supported. Use the BF16 release or a DeepSeek-native FP8 one."
                )
            return tensor
        scale = ckpt.get_tensor(scale_name).float()
        rows, cols = tensor.shape
        br, bc = self.block
        if tuple(scale.shape) != (math.ceil(rows / br), math.ceil(cols / bc)):
            raise CheckpointError(
                f"{ckpt.path}: {scale_name} has shape {tuple(scale.shape)}, which does not "
                f"tile {name} {tuple(tensor.shape)} in {br}x{bc} blocks; is "
                "quantization_config.weight_block_size in config.json right?"
            )
        full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        return tensor.float() * full


@dataclass
class LoadReport:
    """What loading noticed without failing."""

    unexpected: list[str]
    notes: list[str] = field(default_factory=list)
