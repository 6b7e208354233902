"""`mtpkit quantize`: write a quantized copy of a checkpoint that keeps its MTP head working.

compressed-tensors output is what vLLM loads: every tensor (MTP included) in indexed shards,
the config's MTP fields kept, and an ``ignore`` list in the engine's runtime module names
that covers every Linear left unquantized (the MTP head when kept in BF16, its combine
projection, lm_head, modules whose shape the kernels cannot take, and modules vLLM builds
without a quantization config, such as GLM-5's indexer wk / weights_proj). GGUF output is what
llama.cpp loads: MTP layers under ``blk.N.nextn.*`` with ``block_count`` and
``nextn_predict_layers`` set (see checkpoint/gguf.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint import open_checkpoint
from ..checkpoint.errors import CheckpointError
from .formats import quant_config_of, scan
from .pack import Scheme, config_group, quantize_weight

MTP_MODES = ("keep", "same", "w8a16")
LM_HEAD_MODES = ("keep", "same", "w8a16")
SHARD_BYTES = 2 << 30
# Linear modules that combine the MTP head's inputs: vLLM builds them unquantized.
_MTP_COMBINE = ("mtp.fc.",)
_PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# fit_groups: the group sizes a layer takes when the scheme's does not divide its input size.
GROUP_SIZES = (128, 64, 32)


@dataclass
class QuantizeReport:
    """What a quantize run wrote."""

    out: Path
    quantized: list[str] = field(default_factory=list)  # on-disk module names
    kept: list[str] = field(default_factory=list)  # Linear modules left unquantized
    ignore: list[str] = field(default_factory=list)
    # Modules written with a smaller group than the scheme's (fit_groups): (group, in size).
    regrouped: dict[str, tuple[int, int]] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0


def quantize_checkpoint(
    model: str | os.PathLike,
    out: str | os.PathLike,
    scheme: Scheme,
    mtp: str = "keep",
    head: str | os.PathLike | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda s: None,
    method: str = "rtn",
    calib_data: list[str] | None = None,
    calib_tokens: int = 8192,
    lm_head: str = "keep",
    smooth: float | str | None = None,
    fit_groups: bool = False,
) -> QuantizeReport:
    """Write ``model`` quantized with ``scheme`` as a compressed-tensors folder at ``out``;
    ``head`` (a `mtpkit calibrate` folder) is merged in as the checkpoint's own ``mtp.*``;
    ``lm_head="same"`` quantizes the lm_head too (untied from the embedding if tied),
    ``"w8a16"`` as int8 weights only; ``smooth``: SmoothQuant strength for schemes with
    int8 activations (quant/smooth.py), fitted on ``calib_data``. A layer whose input size
    the scheme's group size does not divide takes the largest of GROUP_SIZES below it that
    does (``fit_groups``), else is refused before anything is written (ValueError)."""
    src, dst = Path(model).resolve(), Path(out).resolve()
    _check_paths(src, dst, force)
    if mtp not in MTP_MODES:
        raise ValueError(f"--mtp must be one of {', '.join(MTP_MODES)}, got {mtp!r}")
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"--lm-head must be one of {', '.join(LM_HEAD_MODES)}, got {lm_head!r}")
    ckpt = open_checkpoint(src)
    if getattr(ckpt, "arch", None) is not None:
        raise ValueError(f"{src} is a GGUF file; quantize the HF (BF16/FP32) checkpoint instead")
    if scan(ckpt).modules or quant_config_of(ckpt):
        raise ValueError(f"{src} is already quantized; quantize its BF16 release instead")
    if head is not None:
        from ..train.heads import WithHead

        ckpt = WithHead(ckpt, head)
    if lm_head != "keep":
        ckpt = _untied(ckpt)
    if method not in ("rtn", "gptq"):
        raise ValueError(f"--method must be rtn or gptq, got {method!r}")
    if method == "gptq" and not calib_data:
        raise ValueError("--method gptq needs calibration text: pass --calib-data FILES")
    if method == "gptq" and scheme.name == "fp8":
        raise ValueError("--method gptq applies to the int schemes (w4a16, w8a16, w8a8), not fp8")
    if smooth is not None:
        if scheme.input_args() is None:
            raise ValueError(f"--smooth applies to schemes with int8 activations (w8a8, w4a8), "
                             f"not {scheme.name}: drop it")
        if not calib_data:
            raise ValueError("--smooth needs calibration text: pass --calib-data FILES")
        if method == "gptq":
            raise ValueError("--smooth and --method gptq cannot be combined yet; pick one")
        if smooth != "auto" and not 0.0 < float(smooth) < 1.0:
            raise ValueError(f"--smooth must be in (0, 1) or auto, got {smooth}")
    layout = _Layout(ckpt)
    mtp_scheme = {"keep": None, "same": scheme, "w8a16": Scheme("w8a16")}[mtp]
    head_scheme = {"keep": None, "same": scheme, "w8a16": Scheme("w8a16")}[lm_head]
    # Planned before any work (smoothing, calibration, output): shapes decide it.
    view = _unstack_mtp_experts(ckpt, layout)
    plan, fitted = _plan(view, layout, scheme, mtp_scheme, head_scheme, fit_groups)
    if isinstance(ckpt, _UntiedHead) and plan.get("lm_head") is None:
        # The scheme cannot take the lm_head's shape: it stays tied, not copied.
        view = _unstack_mtp_experts(ckpt.ckpt, layout)
        plan.pop("lm_head", None)
    ckpt = view
    if smooth is not None:
        ckpt = _smoothed(src, head, ckpt, layout, smooth, calib_data, calib_tokens, log)
    report = QuantizeReport(dst)
    report.regrouped = {m: (plan[m].group_size, k) for m, k in fitted.items()
                        if plan.get(m) is not None}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        hessians = {}
        if method == "gptq":
            hessians = _hessians(src, head, layout, plan, calib_data, calib_tokens, log)
        shards = _ShardWriter(tmp)
        groups: dict[Scheme, list[str]] = {}
        for name in ckpt.tensor_names():
            tensor = ckpt.get_tensor(name)
            report.bytes_in += tensor.numel() * tensor.element_size()
            prefix = name[: -len(".weight")]
            use = plan.get(prefix) if name.endswith(".weight") else None
            if use is None:
                if prefix in plan or layout.unread_linear(name, tuple(tensor.shape)):
                    report.kept.append(prefix)
                shards.add(name, tensor)
                continue
            if prefix in hessians and use.name != "fp8":
                from .gptq import gptq_codes, pack_codes

                codes, scales, zeros = gptq_codes(tensor, hessians.pop(prefix), use)
                packed = pack_codes(codes, scales, zeros, use, use.scale_dtype(tensor.dtype))
            else:
                packed = quantize_weight(tensor, use)
            for suffix, t in packed.items():
                shards.add(f"{prefix}.{suffix}", t)
            report.quantized.append(prefix)
            groups.setdefault(use, []).append(prefix)
            log(f"quantized {prefix} ({use.name})")
        index = shards.finish()
        report.bytes_out = index["metadata"]["total_size"]
        head_done = "lm_head" in report.quantized
        kept = [*report.kept, *layout.stacked_experts(ckpt.tensor_names())]
        report.ignore = _ignore_list(kept, layout, lm_head=not head_done)
        config = json.loads((src / "config.json").read_text())
        if head is not None:
            _declare_head(config, ckpt, tmp)
        if head_done:
            for c in (config, config.get("text_config")):
                if isinstance(c, dict) and "tie_word_embeddings" in c:
                    c["tie_word_embeddings"] = False
        config["quantization_config"] = _quant_config(scheme, groups, report.ignore,
                                                      layout,
                                                      plan["lm_head"] if head_done else None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _copy_side_files(src, tmp)
        from ..outputs import publish

        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _declare_head(config: dict, ckpt, folder: Path) -> None:
    # The merged head is declared the way the family's own releases declare theirs, and its
    # draft vocabulary travels with it.
    target = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    target["num_nextn_predict_layers"] = target["mtp_num_hidden_layers"] = ckpt.n_layers
    if ckpt.draft_vocab:
        from ..train.heads import write_draft_vocab

        write_draft_vocab(folder, ckpt.draft_vocab)


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise ValueError(f"{src} is not a checkpoint folder (config.json + *.safetensors)")
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError(f"--out {dst} overlaps the input {src}; mtpkit never writes over its "
                         "input: choose another folder")
    if dst.exists() and not force:
        raise ValueError(f"{dst} exists; choose another --out or pass --force to replace it")


class _Layout:
    """Which checkpoint tensors are Linear weights of the model, and which belong to MTP."""

    def __init__(self, ckpt) -> None:
        from ..engine.loader import hf_config_of
        from ..models.registry import family_for

        config = dict(hf_config_of(ckpt))
        self.config = config
        self.model_type = config.get("model_type")
        # Engine names follow the checkpoint's own config.json (a VLM wrapper's architectures
        # and model_type decide vLLM's class and name map), not the merged text config.
        raw = getattr(ckpt, "raw_config", None)
        self.raw = dict(raw) if isinstance(raw, dict) else config
        self.raw_model_type = self.raw.get("model_type") or self.model_type
        cls = family_for(self.model_type)
        with torch.device("meta"):
            self.model = cls(cls.config_class.from_hf_config(config))
        self.modules = dict(self.model.named_modules())

    def _mapped(self, name: str) -> str | None:
        if not name.endswith(".weight"):
            return None
        return self.model.map_checkpoint_name(name)

    def linear(self, name: str) -> tuple[str, bool] | None:
        """(on-disk module prefix, is it MTP) for a Linear weight; None for anything else."""
        mapped = self._mapped(name)
        if mapped is None:
            return None
        owner = self.modules.get(mapped[: -len(".weight")])
        if not isinstance(owner, nn.Linear):
            return None
        return name[: -len(".weight")], mapped.startswith("mtp.")

    def is_head(self, prefix: str) -> bool:
        """A module vLLM builds as a ParallelLMHead (lm_head, the DeepSeek/GLM MTP head)."""
        from ..checkpoint.runtime_names import describe

        try:
            return describe(prefix, self.raw_model_type, config=self.raw).kind == "head"
        except ValueError:
            return prefix == "lm_head"

    def stacked_experts(self, names) -> list[str]:
        """Modules holding stacked 3-D experts (``...mlp.experts`` with gate_up_proj /
        down_proj; Step's ``...moe.{gate,up,down}_proj.weight``): quantize writes them as
        stored, so they are always left float."""
        out = set()
        for n in names:
            head, _, last = n.rpartition(".")
            if head.endswith(".mlp.experts") and last in ("gate_up_proj", "down_proj"):
                if self.model.map_checkpoint_name(n) is not None:
                    out.add(head)
            elif re.search(r"\.moe\.(gate|up|down)_proj\.weight$", n) \
                    and self.model.map_checkpoint_name(n) is not None:
                out.add(n[: -len(".weight")])
        return sorted(out)

    def unread_linear(self, name: str, shape: tuple) -> str | None:
        """The module of a 2-D weight mtpkit does not read (a vision tower's, a per-layer
        copy of the lm_head) that an engine builds as a quantizable Linear or head: copied
        float, so it must be listed as ignored. None for anything else."""
        from ..checkpoint.runtime_names import describe

        if not name.endswith(".weight") or len(shape) != 2 or self._mapped(name) is not None:
            return None
        prefix = name[: -len(".weight")]
        try:
            kind = describe(prefix, self.raw_model_type, config=self.raw).kind
        except ValueError:
            return None
        return prefix if kind in ("linear", "head") else None

    def never_quantized(self, prefix: str) -> bool:
        """A module vLLM or SGLang builds without a quantization config (describe(...)
        .quantizable is False: eh_proj, routers, GLM-5's indexer wk / weights_proj, Step's
        g_proj in SGLang, DeepSeek-V4's wo_a there), or whose loader reads only float
        tensors for it (``loads_quantized`` False: SGLang's fused DeepSeek-V4 wqkv_a), which
        that engine therefore loads only from float weights: kept float, one checkpoint
        serves both."""
        from ..checkpoint.runtime_names import describe

        try:
            rts = [describe(prefix, self.raw_model_type, engine, config=self.raw)
                   for engine in ("vllm", "sglang")]
            return any(not rt.quantizable or not rt.loads_quantized for rt in rts)
        except ValueError:
            return False

    def is_combine(self, name: str) -> bool:
        """The MTP projection of [embedding, hidden] (eh_proj / fc / input_proj)."""
        mapped = self._mapped(name) or ""
        return mapped.startswith(_MTP_COMBINE)


def _plan(ckpt, layout: _Layout, scheme: Scheme, mtp_scheme: Scheme | None,
          lm_head: Scheme | None = None, fit_groups: bool = False) -> tuple[dict, dict]:
    """(On-disk Linear module -> the scheme it is written in (None: kept as stored), the
    modules given a smaller group by ``fit_groups`` -> their input size); ``lm_head``: the
    lm_head's scheme (None: kept). Without ``fit_groups`` a group size that does not divide
    a layer the scheme could otherwise take is a ValueError."""
    from ..checkpoint.runtime_names import runtime_module

    plan: dict[str, Scheme | None] = {}
    fitted: dict[str, int] = {}
    misfits: dict[str, int] = {}
    grouped: list[int] = []  # input sizes of the layers quantized in groups
    for name in ckpt.tensor_names():
        linear = layout.linear(name)
        if linear is None:
            continue
        prefix, is_mtp = linear
        # vLLM builds every head (lm_head, a DeepSeek/GLM MTP layer's shared_head.head, a Step
        # layer's shared_head.output, mtpkit's mtp.heads.{i}) as a ParallelLMHead that
        # "Linear" does not reach: heads follow --lm-head, MTP or not.
        if layout.is_head(prefix):
            use = lm_head
        else:
            use = mtp_scheme if is_mtp else scheme
        shape = tuple(ckpt.get_tensor(name).shape) if not hasattr(ckpt, "tensor_shape") \
            else tuple(ckpt.tensor_shape(name))
        if use is None or layout.is_combine(name) or len(shape) != 2 \
                or layout.never_quantized(prefix):
            use = None
        elif not use.fits(*shape):
            smaller = _smaller_group(use, *shape)
            if smaller is None:
                use = None  # a shape the kernels cannot take in any group size
            elif fit_groups:
                use, fitted[prefix] = smaller, shape[1]
            else:
                use, misfits[prefix] = None, shape[1]
        if use is not None and use.group_size is not None:
            grouped.append(shape[1])
        plan[prefix] = use
    if misfits:
        raise ValueError(_misfit_message(misfits, grouped, scheme))
    # The engine fuses q/k/v and gate/up into one module quantized as a whole: one shard
    # kept unquantized (a shape the kernels cannot take) keeps its siblings too.
    fused: dict[str, list[str]] = {}
    for prefix in plan:
        fused.setdefault(runtime_module(prefix, layout.raw_model_type, config=layout.raw),
                         []).append(prefix)
    for members in fused.values():
        schemes = {plan[m] for m in members}
        if len(schemes) > 1:
            for m in members:
                plan[m] = None
    return plan, fitted


def _smaller_group(use: Scheme, out_features: int, in_features: int) -> Scheme | None:
    # ``use`` with the largest of GROUP_SIZES below its group size that makes the shape fit
    # (None: its group size is not what keeps the shape out).
    if use.group_size is None or in_features % use.group_size == 0:
        return None
    for g in GROUP_SIZES:
        if g < use.group_size and in_features % g == 0:
            smaller = replace(use, group_size=g)
            return smaller if smaller.fits(out_features, in_features) else None
    return None


def _misfit_message(misfits: dict[str, int], grouped: list[int], scheme: Scheme) -> str:
    # The error of a group size some layers' input sizes do not divide, with the fixes: the
    # largest group size dividing every layer, or the per-layer default.
    sizes = ", ".join(map(str, sorted(set(misfits.values()))))
    every = [*misfits.values(), *grouped]
    fits_all = next(g for g in (256, *GROUP_SIZES) if all(k % g == 0 for k in every))
    return (f"group size {scheme.group_size} does not divide the input size ({sizes}) of "
            f"{len(misfits)} layers (e.g. {min(misfits)}), which would stay unquantized: "
            f"pass --group-size {fits_all}, which divides every layer's, or leave "
            f"--group-size out to give each layer the largest of "
            f"{', '.join(map(str, GROUP_SIZES))} that divides its own")


def _calibration(src, head, files, tokens: int, what: str):
    # The float model and calibration batches of 256 tokens from files.
    from ..engine.loader import load_model
    from ..train.data import iter_chunks, list_files

    loaded = load_model(src, head=head)
    if loaded.tokenizer is None:
        raise ValueError(f"{src}: {what} needs the checkpoint's tokenizer")
    seq = 256
    chunks = iter_chunks(loaded.tokenizer, [str(f) for f in list_files(files)], seq)
    batches = [torch.tensor([c]) for c in itertools.islice(chunks, max(1, tokens // seq))]
    if not batches:
        raise ValueError("--calib-data yielded no text")
    return loaded.model, batches


@torch.inference_mode()
def _smoothed(src, head, ckpt, layout: _Layout, alpha: float, files, tokens: int, log):
    """The checkpoint with SmoothQuant factors fitted on the float model applied."""
    from .smooth import Smoothed, input_maxima, smoothing

    model, batches = _calibration(src, head, files, tokens, "--smooth")
    log(f"SmoothQuant: activation maxima over {sum(b.numel() for b in batches)} tokens")
    factors = smoothing(model, input_maxima(model, batches), None if alpha == "auto" else alpha)
    on_disk = {}
    for name in ckpt.tensor_names():
        mapped = layout.model.map_checkpoint_name(name)
        if mapped in factors:
            on_disk[name] = factors[mapped]
    if not on_disk:
        warnings.warn("--smooth: no layer of this model can be smoothed (it needs RMSNorm + "
                      "attention + SwiGLU layers); quantizing without", stacklevel=2)
    return Smoothed(ckpt, on_disk)


def _hessians(src, head, layout: _Layout, plan: dict, files, tokens: int, log) -> dict:
    """Input statistics of every trunk Linear GPTQ will quantize, from the float model."""
    from .gptq import collect_hessians

    model, batches = _calibration(src, head, files, tokens, "--method gptq")
    seq = batches[0].shape[1]
    # Model module path -> on-disk prefix, for the modules the plan quantizes (trunk only:
    # the head's inputs come from a separate pass; its modules use round-to-nearest).
    wanted = {}
    for prefix, use in plan.items():
        mapped = layout.model.map_checkpoint_name(prefix + ".weight")
        if use is not None and mapped and not mapped.startswith("mtp."):
            wanted[mapped[: -len(".weight")]] = prefix
    modules = {p: model.get_submodule(p) for p in wanted}
    log(f"GPTQ: collecting input statistics over {len(batches) * seq} tokens")
    stats = collect_hessians(model, batches, modules)
    return {wanted[p]: h for p, h in stats.items()}


def _ignore_list(kept: list[str], layout: _Layout, lm_head: bool = True) -> list[str]:
    from ..checkpoint.runtime_names import ignore_list_for

    # An unquantized lm_head is listed even when tied to the embedding, as llm-compressor
    # writes it.
    names = {*kept, "lm_head"} if lm_head else set(kept)
    # The names vLLM and SGLang build (they differ for SGLang's MTP blocks, model.decoder.*).
    return ignore_list_for(sorted(names), layout.raw_model_type, "all", config=layout.raw)


def _quant_config(scheme, groups: dict, ignore: list[str], layout,
                  head_scheme=None) -> dict:
    """compressed-tensors quantization_config; ``groups``: each scheme written -> its on-disk
    modules; ``head_scheme``: the quantized lm_head's."""
    from ..checkpoint.runtime_names import runtime_module

    def names_of(m: str) -> set[str]:
        return {runtime_module(m, layout.raw_model_type, config=layout.raw), m}

    # A quantized head is named as well as matched by class: vLLM builds it as a
    # ParallelLMHead, not a Linear, and quantizes it only when a target names it (a Qwen3.5
    # VLM's as language_model.lm_head, a DeepSeek/GLM MTP layer's as model.layers.{L}.head).
    heads = {n for mods in groups.values() for m in mods if layout.is_head(m)
             for n in names_of(m)}
    same_head = head_scheme is not None and head_scheme == scheme
    targets: dict = {scheme: ["Linear", *sorted(heads)] if same_head else ["Linear"]}
    for sch, modules in groups.items():
        if sch == scheme:
            continue
        # Modules in another scheme (an int8 MTP head) or group size (fit_groups) are named:
        # exact names outrank the class target in vLLM's and compressed-tensors' matching.
        # vLLM matches the modules it builds (fused qkv_proj, gate_up_proj), transformers
        # those on disk: both are listed.
        names = {n for m in modules if not layout.is_head(m) for n in names_of(m)}
        if names:
            targets[sch] = sorted(names)
    if head_scheme is not None and not same_head:
        targets.setdefault(head_scheme, []).extend(sorted(heads))
    entries = list(targets.items())
    formats = {s.format for s, _ in entries}
    cfg_groups = {}
    for i, (sch, names) in enumerate(entries):
        group = config_group(sch, names)
        if len(formats) > 1:
            group["format"] = sch.format
        cfg_groups[f"group_{i}"] = group
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": cfg_groups,
        "ignore": ignore,
        "quantization_status": "compressed",
    }


def _unstack_mtp_experts(ckpt, layout: _Layout):
    """``ckpt`` with the DeepSeek/GLM MTP layers' stacked experts seen one by one (itself
    where it has none): vLLM's MTP weight loaders for those families map only per-expert
    names (experts.E.gate_proj/up_proj/down_proj.weight), so a checkpoint written with the
    stacked tensors transformers saves cannot load its draft (doctor:
    mtp-experts-stacked-unloadable). The trunk's experts stay as stored."""
    from ..checkpoint.runtime_names import _NEXTN

    if layout.raw_model_type not in _NEXTN and layout.model_type not in _NEXTN:
        return ckpt
    split: dict[str, tuple[str, str, int | None]] = {}  # per-expert name -> (stacked, part, e)
    names = []
    for n in ckpt.tensor_names():
        base, _, last = n.rpartition(".")
        if base.endswith(".mlp.experts") and last in ("gate_up_proj", "down_proj"):
            probe = layout.linear(f"{base}.0.{'down_proj' if last == 'down_proj' else 'gate_proj'}"
                                  ".weight")
            if probe is not None and probe[1]:
                shape = _shape(ckpt, n)
                parts = ("gate_proj", "up_proj") if last == "gate_up_proj" else ("down_proj",)
                for e in range(shape[0]):
                    for part in parts:
                        name = f"{base}.{e}.{part}.weight"
                        split[name] = (n, part, e)
                        names.append(name)
                continue
        names.append(n)
    return _UnstackedExperts(ckpt, names, split) if split else ckpt


def _shape(ckpt, name: str) -> tuple[int, ...]:
    """A tensor's shape, without reading it where the checkpoint can say."""
    if hasattr(ckpt, "tensor_shape"):
        return tuple(ckpt.tensor_shape(name))
    return tuple(ckpt.get_tensor(name).shape)


class _UnstackedExperts:
    """A checkpoint view whose listed stacked experts read as per-expert 2-D tensors:
    gate_up_proj [E, 2I, H] holds each expert's gate rows, then its up rows."""

    def __init__(self, ckpt, names: list[str], split: dict) -> None:
        self.ckpt, self._names, self._split = ckpt, names, split
        self._last: tuple[str, torch.Tensor] | None = None  # one stacked tensor, read once

    def tensor_names(self) -> list[str]:
        """Every tensor, the split experts one by one."""
        return list(self._names)

    def _stacked(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self.ckpt.get_tensor(name))
        return self._last[1]

    def get_tensor(self, name: str) -> torch.Tensor:
        """A tensor; a split expert's part is a copy of its rows of the stacked one."""
        if name not in self._split:
            return self.ckpt.get_tensor(name)
        stacked, part, e = self._split[name]
        t = self._stacked(stacked)[e]
        if part != "down_proj":
            half = t.shape[0] // 2
            t = t[:half] if part == "gate_proj" else t[half:]
        return t.contiguous().clone()

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the tensor (a split part: from the stacked shape)."""
        if name not in self._split:
            return _shape(self.ckpt, name)
        stacked, part, _ = self._split[name]
        _, rows, cols = _shape(self.ckpt, stacked)
        return (rows // 2 if part != "down_proj" else rows, cols)

    def __getattr__(self, name):
        return getattr(self.ckpt, name)


class _UntiedHead:
    """A checkpoint whose tied lm_head is stored as a tensor of its own (the embedding's
    values), so that it can be quantized apart from the embedding."""

    def __init__(self, ckpt, embedding: str) -> None:
        self.ckpt, self.embedding = ckpt, embedding

    def _src(self, name: str) -> str:
        return self.embedding if name == "lm_head.weight" else name

    def hf_config(self) -> dict:
        """The config, untied."""
        from ..engine.loader import hf_config_of

        return {**hf_config_of(self.ckpt), "tie_word_embeddings": False}

    def tensor_names(self) -> list[str]:
        """Every tensor, lm_head.weight added."""
        return [*self.ckpt.tensor_names(), "lm_head.weight"]

    def get_tensor(self, name: str) -> torch.Tensor:
        """A tensor; lm_head.weight reads the embedding."""
        return self.ckpt.get_tensor(self._src(name))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the tensor."""
        return _shape(self.ckpt, self._src(name))

    def __getattr__(self, name):
        return getattr(self.ckpt, name)


def _untied(ckpt):
    """``ckpt`` with an lm_head tensor of its own (itself when it has one already)."""
    from ..engine.loader import hf_config_of

    names = set(ckpt.tensor_names())
    if "lm_head.weight" in names:
        return ckpt
    if not hf_config_of(ckpt).get("tie_word_embeddings"):
        raise ValueError("--lm-head same: the checkpoint has no lm_head.weight and does not "
                         "tie it to the embedding; is it complete?")
    for embedding in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        if embedding in names:
            return _UntiedHead(ckpt, embedding)
    raise ValueError("--lm-head same: the lm_head is tied to an embedding tensor mtpkit does "
                     "not know the name of; quantize with --lm-head keep")


class _ShardWriter:
    """Safetensors shards of at most SHARD_BYTES, named and indexed as HF does."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        path = self.folder / f".part-{len(self.parts)}.safetensors"
        save_file(self.current, path, metadata={"format": "pt"})
        self.parts.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def finish(self) -> dict:
        """Name the shards model-0000i-of-0000n and return the index."""
        if self.current or not self.parts:
            self._flush()
        n = len(self.parts)
        weight_map = {}
        for i, (path, names) in enumerate(self.parts, 1):
            final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update({name: final for name in names})
        return {"metadata": {"total_size": self.total}, "weight_map": weight_map}


def _copy_side_files(src: Path, dst: Path) -> None:
    # Tokenizer, chat template, generation config...: everything but the weights (and never
    # pickles, which mtpkit does not read or pass on).
    for f in src.iterdir():
        if not f.is_file() or f.name.startswith(".") or f.name == "config.json":
            continue
        if f.suffix in (".safetensors", *_PICKLES) or f.name.endswith(".safetensors.index.json"):
            continue
        shutil.copy2(f, dst / f.name)


def quantize_gguf(
    model: str | os.PathLike, out: str | os.PathLike, qtype: str, force: bool = False,
    mtp: str = "keep",
) -> Path:
    """Write ``model`` as one GGUF file of type ``qtype`` with its MTP layers as nextn, their
    matrices kept as stored (``mtp="keep"``: F32, F16 or BF16), in ``qtype`` ("same") or
    Q8_0 ("w8a16")."""
    from ..checkpoint.gguf import arch_for_model_type, write_gguf
    from ..checkpoint.tokenizer import Tokenizer
    from ..engine.loader import hf_config_of

    src, dst = Path(model).resolve(), Path(out).resolve()
    if dst.suffix != ".gguf":
        raise ValueError(f"--out {dst} should name a .gguf file for --format gguf")
    if dst.exists() and not force:
        raise ValueError(f"{dst} exists; choose another --out or pass --force to replace it")
    if dst == src:
        raise ValueError("--out is the input file; mtpkit never writes over its input")
    ckpt = open_checkpoint(src)
    config = dict(hf_config_of(ckpt))
    arch = arch_for_model_type(config.get("model_type", ""))
    if scan(ckpt).modules:
        raise CheckpointError(f"{src}: quantized input; convert its BF16 release to GGUF")
    # GGUF names follow the text model's HF names: undo VLM prefixes, drop vision towers.
    layout = _Layout(ckpt)
    tensors = {}
    for n in ckpt.tensor_names():
        mapped = layout.model.map_checkpoint_name(n)
        if mapped is not None:
            tensors[mapped] = ckpt.get_tensor(n)
    tok = None
    if (src / "tokenizer.json").exists():
        tok = Tokenizer.from_hf_dir(src)
    else:
        warnings.warn(f"{src} has no tokenizer.json; the GGUF is written without a tokenizer "
                      "and llama.cpp will need one from elsewhere", stacklevel=2)
    stored = {ckpt.tensor_dtype(n) for n in ckpt.tensor_names() if _is_mtp_name(n, config)}
    mtp_qtype = {"same": qtype, "w8a16": "Q8_0"}.get(mtp)
    if mtp == "keep":
        # One type for the head: 16-bit only where every MTP tensor is stored so.
        mtp_qtype = next(iter(stored)) if len(stored) == 1 and stored <= {"F16", "BF16"} \
            else "F32"
    write_gguf(dst, arch, config, tensors, tokenizer=tok, qtype=qtype, mtp_qtype=mtp_qtype)
    return dst


def _is_mtp_name(name: str, config: dict) -> bool:
    # MTP layers: mtp.* (Qwen3-Next/3.5, MiMo) or decoder layers past num_hidden_layers
    # (DeepSeek-V3, GLM-4.5).
    if name.startswith(("mtp.", "model.mtp.")) or ".mtp." in name:
        return True
    m = re.search(r"layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= int(config.get("num_hidden_layers", 1 << 30))
