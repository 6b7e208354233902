"""What every family shares: the trunk forward over caches, the MTP draft step, weight loading."""

from __future__ import annotations

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
    # [B, T, n*D]: the residual stream entering each layer an EAGLE-3 head reads, side by
    # side (None unless the model's head needs them; see CausalLM.aux_layer_ids)
    aux: torch.Tensor | None = None

    def for_mtp(self, which: str) -> torch.Tensor:
        """The state an MTP head reads: 'post_norm', 'pre_norm' or 'aux'."""
        if which == "aux":
            return self.aux
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
        x = self.model.embed_tokens(input_ids)
        return self._trunk(x, self._positions(start, input_ids.shape[1]),
                           lambda i: cache[i] if cache is not None else None)

    def _trunk(self, x, pos, cache_of) -> TrunkOutput:
        # The decoder layers over embedded rows x [B, T, D] at positions pos [T], layer i
        # with cache_of(i) (forward, and forward_packed's rows of several sequences). A
        # family whose layers rotate in more than one way overrides this.
        cos, sin = self.rotary.cos_sin(pos)
        return self._layers(x, cos, sin, cache_of)

    def _layers(self, x, cos, sin, cache_of) -> TrunkOutput:
        # The decoder layers over x, layer i with cache_of(i), keeping the input states of
        # the layers the head reads (aux_layer_ids).
        aux_ids, aux = self.aux_layer_ids(), []
        for i, layer in enumerate(self.model.layers):
            if i in aux_ids:
                aux.append(x)
            x = layer(x, cos, sin, cache_of(i))
        return TrunkOutput(self.model.norm(x), x, self.aux_states(aux_ids, aux, x))

    def aux_layer_ids(self) -> tuple[int, ...]:
        """Layer ids whose input states the head reads (an EAGLE-3 head's; else none)."""
        return tuple(getattr(self.mtp, "aux_layers", ())) if self.mtp is not None else ()

    def aux_states(self, aux_ids, aux: list[torch.Tensor], last: torch.Tensor):
        """The head's trunk states side by side [.., len(aux_ids) D] from the inputs of the
        layers it reads (aux, in layer order) and the last layer's output; None without."""
        # Id num_hidden_layers names the last layer's output (before the final norm).
        if not aux_ids:
            return None
        if len(self.model.layers) in aux_ids:
            aux = [*aux, last]
        return torch.cat(aux, dim=-1)

    def packable(self) -> bool:
        """Whether ``forward_packed`` can run this trunk: every layer's attention (GQA, MLA,
        Gated DeltaNet, windowed or with sinks) takes PackedCaches."""
        # Read off each mixer's own class, not inherited: a subclass that attends in its
        # own way (sparse, sliding-window, sinks) packs only where it says so itself.
        def packs(layer) -> bool:
            mixers = [m for m in (getattr(layer, "self_attn", None),
                                  getattr(layer, "linear_attn", None)) if m is not None]
            return bool(mixers) and all(vars(type(m)).get("packs", False) for m in mixers)

        return all(packs(layer) for layer in self.model.layers)

    def forward_packed(self, items: list[tuple[torch.Tensor, ModelCache]]) -> list[TrunkOutput]:
        """One trunk forward over several sequences: (ids [1, T_i], cache_i) each.

        Their rows go through every projection and MLP together (weights read once for all),
        each attends over its own cache; outputs are as ``forward`` on each alone, up to the
        rounding of a GEMM over more rows.
        """
        from .attention import PackedCaches

        lengths = [ids.shape[1] for ids, _ in items]
        positions = torch.cat([self._positions(c.length, n)
                               for (_, c), n in zip(items, lengths, strict=True)])
        x = self.model.embed_tokens(torch.cat([ids for ids, _ in items], dim=1))
        out = self._trunk(x, positions,
                          lambda i: PackedCaches([c[i] for _, c in items], lengths))
        outs, s = [], 0
        for n in lengths:
            outs.append(TrunkOutput(out.hidden[:, s : s + n], out.pre_norm[:, s : s + n],
                                    None if out.aux is None else out.aux[:, s : s + n]))
            s += n
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fp32) for hidden states [B, T, D]."""
        return self.lm_head(hidden).float()

    def draft_head(self, step: int) -> nn.Module:
        """The output head scoring draft step ``step``: its MTP layer's own, else the lm_head."""
        own = self.mtp.own_head(step)
        return self.lm_head if own is None else own

    def draft_logits(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Vocabulary logits (fp32) of draft step ``step`` for the head's states [B, T, D]."""
        return self.draft_head(step)(hidden).float()

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
            layer_cache = cache[self.mtp.layer_for(step)]
            # Speculative entries past `start` are stale; a layer not used at every step
            # may lag behind, and its skipped slots are masked out.
            if layer_cache.length > start:
                layer_cache.trim(start)
            layer_cache.skip_to(start)
        # A family whose MTP blocks rotate as some trunk layers do (MiMo-V2-Flash: the
        # sliding-window layers' theta) sets mtp_rotary.
        rotary = getattr(self, "mtp_rotary", None) or self.rotary
        cos, sin = rotary.cos_sin(self._positions(start, next_ids.shape[1]))
        emb = self.model.embed_tokens(next_ids)
        post, pre = self.mtp(emb, hidden, step, cos, sin, layer_cache, start)
        return TrunkOutput(post, pre)

    def _positions(self, start: int, t: int) -> torch.Tensor:
        return torch.arange(start, start + t, device=self.model.embed_tokens.weight.device)

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
        (``keep_missing_head``: keep it uninitialised, to be trained). Modules stored
        quantized become ``QuantLinear`` layers; the tensors on disk decide, not the config."""
        from ..quant.formats import scan

        plan = scan(ckpt)
        report = LoadReport(unexpected=[])
        quantized = self._install_quantized(plan, ckpt, report)
        params = dict(self.named_parameters())
        by_module: dict[str, str] = {}
        loaded: set[str] = set()
        unexpected = report.unexpected
        # Tensors of installed QuantLinears are read already; a quantized module that is not
        # a Linear here (stacked experts) is dequantized and seen as its plain ``weight``.
        names = [n for n in ckpt.tensor_names() if n not in plan.consumed]
        for prefix, spec in plan.modules.items():
            if prefix not in quantized:
                names.append(prefix + ".weight")
                names += [n for s, n in spec.tensors.items() if s == "bias"]
        for name in names:
            mapped = self.map_checkpoint_name(name)
            if mapped is None:
                continue
            if mapped in params:
                by_module[mapped] = name
                continue
            split = self.split_checkpoint_tensor(
                mapped, lambda n=name: self._read_float(plan, ckpt, n)
            )
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
        # A layer's own output head may be absent: the lm_head serves (_share_heads).
        missing = [p for p in params if p not in by_module and not p.startswith("mtp.heads.")]
        missing_mtp = [p for p in missing if p.startswith("mtp.")]
        n_mtp = sum(p.startswith("mtp.") and not p.startswith("mtp.heads.") for p in params) \
            + sum(m.startswith("mtp.") and not m.startswith("mtp.heads.")
                  for m in quantized.values())
        if self.mtp is not None and missing_mtp and not keep_missing_head:
            if len(missing_mtp) == n_mtp:
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
            hint = ""
            if plan.config:
                hint = (" The config declares quantization: are quantized tensors "
                        "(weight_packed/weight_scale, qweight/scales, ...) of these modules "
                        "missing too?")
            raise CheckpointError(
                f"{ckpt.path}: {len(missing)} tensors the model needs are missing from the "
                f"checkpoint, e.g. {', '.join(missing[:5])}. Is the checkpoint complete "
                f"(every shard present) and of the model_type its config.json says?{hint}"
            )
        for module_name, ckpt_name in by_module.items():
            if module_name in loaded or (module_name.startswith("mtp.") and self.mtp is None):
                continue
            p = params[module_name]
            self._copy_param(p, self._read_float(plan, ckpt, ckpt_name), module_name,
                             ckpt_name, ckpt)
        self._warn_unquantized(plan, by_module, report, getattr(ckpt, "_names", ()))
        if self.mtp is not None:
            self._share_heads({m for m in by_module if m.startswith("mtp.heads.")}
                              | {m + ".weight" for m in quantized.values()})
        if unexpected:
            report.notes.append(
                f"{len(unexpected)} checkpoint tensors are not used by the "
                f"{type(self).__name__} model, e.g. {', '.join(unexpected[:5])}"
            )
        return report

    def _share_heads(self, loaded: set[str]) -> None:
        """Drop every MTP layer's own output head that the checkpoint lacks or that equals
        the lm_head: the lm_head scores those layers' drafts, and no second matrix is kept."""
        from ..quant.linear import QuantLinear

        def weight(m: nn.Module) -> torch.Tensor:
            return m.dequantize() if isinstance(m, QuantLinear) else m.weight

        heads = self.mtp.heads
        for key in list(heads):
            if f"mtp.heads.{key}.weight" not in loaded or (
                    torch.equal(weight(heads[key]), weight(self.lm_head))):
                del heads[key]

    def _install_quantized(self, plan, ckpt, report) -> dict[str, str]:
        """Swap the Linear of every module stored quantized for a QuantLinear."""
        from ..quant.formats import read_module

        installed: dict[str, str] = {}  # checkpoint prefix -> module path
        for prefix, spec in plan.modules.items():
            mapped = self.map_checkpoint_name(prefix + ".weight")
            if mapped is None:
                continue
            path = mapped[: -len(".weight")]
            parent_path, _, child = path.rpartition(".")
            try:
                parent = self.get_submodule(parent_path) if parent_path else self
                old = getattr(parent, child)
            except AttributeError:
                continue  # not a module of ours (reported as unexpected), or a fused tensor
            if not isinstance(old, nn.Linear):
                continue  # e.g. stacked experts: dequantized through the split hook
            q = read_module(spec, ckpt, plan.config)
            if (q.in_features, q.out_features) != (old.in_features, old.out_features):
                raise CheckpointError(
                    f"{ckpt.path}: quantized module {prefix} holds a "
                    f"{q.out_features}x{q.in_features} weight, but the config implies "
                    f"{old.out_features}x{old.in_features} for {path}. The config.json does "
                    "not match the weights."
                )
            if (old.bias is None) != (q.bias is None):
                raise CheckpointError(f"{ckpt.path}: {prefix}.bias is "
                                      f"{'missing' if q.bias is None else 'unexpected'}")
            setattr(parent, child, q.to(old.weight.device))
            installed[prefix] = path
            if q.act_note and not any(q.act_note in n for n in report.notes):
                report.notes.append(f"{prefix} and others like it: {q.act_note}")
        return installed

    @staticmethod
    def _read_float(plan, ckpt, name: str) -> torch.Tensor:
        """A tensor as a float layer uses it; quantized weights dequantized."""
        from ..quant.formats import FP8_DTYPES, read_module

        spec = plan.spec_for_weight(name)
        if spec is not None:
            return read_module(spec, ckpt, plan.config).dequantize()
        tensor = ckpt.get_tensor(name)
        if tensor.dtype in FP8_DTYPES:
            # Copying e4m3 values without their scales would give a model that runs and
            # talks nonsense; refuse instead.
            raise CheckpointError(
                f"{ckpt.path}: {name} is stored as FP8 without a scale tensor "
                "(weight_scale or weight_scale_inv); the checkpoint is incomplete or in a "
                "format mtpkit does not know. Use the BF16 release."
            )
        return tensor

    def _warn_unquantized(self, plan, by_module: dict[str, str], report,
                          overlaid=()) -> None:
        # The BF16-head-under-a-W4A16-config case: mtpkit loads what is on disk (a float
        # module); engines that trust the config instead build a quantized module. A head
        # laid over the checkpoint (--head: WithHead's _names) is not the config's to cover.
        from ..quant.formats import config_covers

        if not plan.config:
            return
        overlaid = set(overlaid)
        found: list[tuple[str, str]] = []
        for module_name, ckpt_name in by_module.items():
            if not module_name.endswith(".weight") or ckpt_name in overlaid:
                continue
            owner = self.get_submodule(module_name[: -len(".weight")])
            prefix = ckpt_name[: -len(".weight")]
            if isinstance(owner, nn.Linear) and prefix not in plan.modules:
                entry = config_covers(prefix, plan.config)
                if entry and not (prefix.endswith("lm_head") and owner.weight is
                                  self.model.embed_tokens.weight):
                    found.append((prefix, entry))
        if found:
            names = ", ".join(p for p, _ in found[:6]) + (" ..." if len(found) > 6 else "")
            report.notes.append(
                f"{len(found)} modules are stored unquantized although {found[0][1]} covers "
                f"them (e.g. {names}); mtpkit loads them unquantized, as stored. Engines that "
                "follow the config (vLLM) build them quantized and run them on missing "
                "weights: add them to the config's ignore list (mtpkit doctor shows the fix)."
            )

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


@dataclass
class LoadReport:
    """What loading noticed without failing."""

    unexpected: list[str]
    notes: list[str] = field(default_factory=list)
