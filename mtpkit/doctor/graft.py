"""``graft``: copy an MTP head into a checkpoint that lost it; ``fix-config``: repair the config
fields, index and ignore list (or the GGUF block_count / nextn key) that hide a head.

Outputs are written next to OUT in a temporary folder (or file) and renamed into place at the
end, so OUT is either complete or absent; inputs are only read. Doctor runs on OUT last.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import is_gguf
from ..checkpoint.errors import CheckpointError
from ..checkpoint.runtime_names import IgnoreStatus, describe, ignore_list_for, ignore_status
from ..outputs import publish
from .findings import Report
from .layout import (
    DEEPSEEK_STYLE,
    MIMO_V2_STYLE,
    QWEN35,
    STEP_STYLE,
    HFLayout,
    get_key,
    is_mtp_tensor,
    mtp_config_key,
    mtp_layer_count,
    read_hf,
    set_key,
)

INDEX = "model.safetensors.index.json"
MTP_FILE = "model_mtp.safetensors"
_FUSING = ("vllm", "sglang")


@dataclass
class GraftResult:
    """What was written, what changed, and doctor's verdict on it."""

    out: Path
    changes: list[str] = field(default_factory=list)
    report: Report | None = None


# ---------------------------------------------------------------------------------------------
# output handling



def _check_paths(inputs: list[Path], out: Path, force: bool) -> None:
    for p in inputs:
        if not p.exists():
            raise CheckpointError(f"{p}: no such checkpoint folder or file")
        rp, ro = p.resolve(), out.resolve()
        if rp == ro or (p.is_dir() and rp in ro.parents):
            raise ValueError(f"--out {out} would write into the input {p}; inputs are never "
                             "modified: choose another output path")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to replace it, or choose another --out")


def _stage_copy(src: Path, out: Path) -> Path:
    """A copy of folder ``src`` in a temporary folder beside ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    return tmp


def _finish(tmp: Path, out: Path, changes: list[str], engines) -> GraftResult:
    from .checks import diagnose

    publish(tmp, out)
    return GraftResult(out, changes, diagnose(out, engines))


# ---------------------------------------------------------------------------------------------
# fix-config


def fix_config(path, out, engines=None, force: bool = False) -> GraftResult:
    """Write a copy of ``path`` whose MTP config field, index and ignore list (or GGUF
    block_count and nextn key) agree with its tensors; then run doctor on it."""
    src, out = Path(path), Path(out)
    _check_paths([src], out, force)
    if is_gguf(src):
        return _fix_gguf(src, out, engines)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a checkpoint folder or .gguf file")
    read_hf(src)  # clear errors for a broken folder before anything is copied
    tmp = _stage_copy(src, out)
    try:
        changes = repair_hf_folder(tmp, engines)
        if not changes:
            changes.append("nothing to repair in config, index or ignore list")
        return _finish(tmp, out, changes, engines)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def repair_hf_folder(folder: Path, engines=None) -> list[str]:
    """Make config.json and the index of ``folder`` agree with its tensors (edits in place;
    only ever called on a staged copy)."""
    changes: list[str] = []
    lay = read_hf(folder)
    raw = copy.deepcopy(lay.raw)
    mt = lay.text_model_type
    n_mtp = mtp_layer_count(lay.mtp_names(), lay.n_layer)
    if n_mtp:
        key = mtp_config_key(mt, raw)
        if get_key(raw, key) != n_mtp:
            changes.append(f"config: {key} {get_key(raw, key)} -> {n_mtp}")
            set_key(raw, key, n_mtp)
        if mt in QWEN35:
            own = any(n.startswith("mtp.embed_tokens") for n in lay.mtp_names())
            dkey = ("text_config.mtp_use_dedicated_embeddings"
                    if isinstance(raw.get("text_config"), dict)
                    else "mtp_use_dedicated_embeddings")
            if bool(get_key(raw, dkey)) != own:
                changes.append(f"config: {dkey} {get_key(raw, dkey)} -> {own}")
                set_key(raw, dkey, own)
    if lay.index is not None:
        weight_map = dict(lay.index)
        added: dict[str, int] = {}
        for name, fname in lay.file_of.items():
            if name not in weight_map:
                weight_map[name] = fname
                added[fname] = added.get(fname, 0) + 1
        for fname, n in sorted(added.items()):
            changes.append(f"index: listed {fname} ({n} tensors)")
        if added:
            _write_index(folder, weight_map)
    q = _quant_config_ref(raw)
    if q is not None:
        lay.raw = raw  # the ignore fix reads the (possibly updated) config
        changes += _fix_quant_lists(lay, q, engines)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return changes


def _quant_config_ref(raw: dict) -> dict | None:
    q = raw.get("quantization_config")
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    return q


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    data = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(data, indent=2) + "\n")


def _fusing(engines) -> list[str]:
    return [e for e in (engines or _FUSING) if e in _FUSING] or list(_FUSING)


def _fix_quant_lists(lay: HFLayout, q: dict, engines) -> list[str]:
    method = str(q.get("quant_method", "")).lower()
    floats = [m for m in lay.modules.values() if m.linear and m.fmt == "float"]
    mt = lay.model_type
    if method == "compressed-tensors":
        return _fix_ct_ignore(lay, q, engines)
    if method in ("fp8", "deepseek_v4_fp8") and mt == "deepseek_v4" and "vllm" in _fusing(engines):
        return _fix_fp8_ignored(lay, q, floats)
    if method == "awq":
        skip = list(q.get("modules_to_not_convert") or [])
        new = sorted({describe(m.name, mt, e, config=lay.raw).name for m in floats
                      for e in _fusing(engines)
                      if _class_quantized(describe(m.name, mt, e, config=lay.raw))}
                     - set(skip))
        new = [n for n in new if not any(s and s in n for s in skip)]
        if new:
            q["modules_to_not_convert"] = skip + new
            return [f"quantization_config.modules_to_not_convert: added {len(new)} modules"]
        return []
    if method == "gptq":
        dyn = dict(q.get("dynamic") or {})
        added = 0
        for m in floats:
            for e in _fusing(engines):
                rt = describe(m.name, mt, e, config=lay.raw)
                key = "-:" + re.escape(rt.name) + "$"
                if _class_quantized(rt) and key not in dyn:
                    dyn[key] = {}
                    added += 1
        if added:
            q["dynamic"] = dyn
            return [f"quantization_config.dynamic: {added} '-:' entries keep modules "
                    "unquantized"]
    return []


def _fix_fp8_ignored(lay: HFLayout, q: dict, floats) -> list[str]:
    """DeepSeek-V4's FP8 config: list the float modules vLLM would build FP8 in
    ``ignored_layers``, under the names vLLM's draft model and trunk build them."""
    from .checks import _fp8_skipped

    skipped = _fp8_skipped(lay)
    need = []
    for m in floats:
        try:
            rt = describe(m.name, lay.model_type, "vllm", config=lay.raw)
        except ValueError:
            continue
        if _class_quantized(rt) and not skipped(rt.name):
            need.append(m.name)
    key = "modules_to_not_convert" if "modules_to_not_convert" in q \
        and "ignored_layers" not in q else "ignored_layers"
    old = list(q.get(key) or [])
    new = [n for n in ignore_list_for(need, lay.model_type, "vllm", config=lay.raw)
           if n not in old]
    if not new:
        return []
    q[key] = old + new
    return [f"quantization_config.{key}: added {len(new)} entries"]


def _class_quantized(rt) -> bool:
    """Whether a class target ("Linear") makes the engine quantize this runtime module."""
    return rt.quantizable and not rt.by_name_only


def _fix_ct_ignore(lay: HFLayout, q: dict, engines) -> list[str]:
    """Ignore list = the old entries every engine honours + exact entries (on-disk and engine
    names) for every module stored unquantized that a config group targets."""
    from .checks import _ct_targeted, ct_targets, entry_problems

    old = list(q.get("ignore") or [])
    mt = lay.model_type
    fusing = _fusing(engines)
    # Modules stored unquantized that some engine would build quantized, by fused group: a
    # group is added whole, and only when all of its members are stored unquantized.
    groups: dict[tuple[str, str], list[str]] = {}
    for m in lay.modules.values():
        if not m.linear:
            continue
        for e in fusing:
            rt = describe(m.name, mt, e, config=lay.raw)
            groups.setdefault((e, rt.name), []).append(m.name)
    fmt = {m.name: m.fmt for m in lay.modules.values()}
    keep_float: set[str] = set()
    for (e, rname), members in groups.items():
        if not all(fmt[n] == "float" for n in members):
            continue
        if not any(_ct_targeted(lay, n, rname) for n in members):
            continue
        if all(ignore_status(n, old, mt, e, config=lay.raw, targets=ct_targets(lay))
               in (IgnoreStatus.IGNORED, IgnoreStatus.NOT_QUANTIZABLE)
               for n in members) and rname not in _flagged_fused(lay, old, e):
            continue
        keep_float.update(members)
    flagged = {p[0] for e in fusing for p in entry_problems(lay, old, e)}
    # An exact entry naming a module stored quantized makes the engine build it unquantized.
    quantized = {m.name for m in lay.modules.values() if m.fmt != "float"}
    wrong = {e for e in old if e in quantized}
    kept = [e for e in old if e not in flagged and e not in wrong]
    new_entries: set[str] = set()
    if keep_float:
        for e in fusing:
            new_entries.update(ignore_list_for(sorted(keep_float), mt, e, config=lay.raw))
    new = sorted(set(kept) | new_entries)
    changes = []
    if set(new) != set(old):
        removed = sorted(set(old) - set(new))
        added = sorted(set(new) - set(old))
        if removed:
            changes.append(f"quantization_config.ignore: removed {len(removed)} entries no "
                           f"engine applies ({', '.join(removed[:4])}"
                           f"{' ...' if len(removed) > 4 else ''})")
        if added:
            changes.append(f"quantization_config.ignore: added {len(added)} entries "
                           f"({', '.join(added[:4])}{' ...' if len(added) > 4 else ''})")
        q["ignore"] = new
    return changes


def _flagged_fused(lay: HFLayout, ignore, engine) -> set[str]:
    """Fused modules an engine builds quantized although every shard is listed (SGLang)."""
    mt = lay.model_type
    out = set()
    for m in lay.modules.values():
        if not m.linear:
            continue
        rt = describe(m.name, mt, engine, config=lay.raw)
        if rt.fused and not rt.shards and \
                ignore_status(m.name, ignore, mt, engine, config=lay.raw) == IgnoreStatus.QUANTIZED:
            out.add(rt.name)
    return out


# ---------------------------------------------------------------------------------------------
# graft


def graft(src, dst, out, precision: str = "keep", engines=None, force: bool = False
          ) -> GraftResult:
    """Copy the MTP head of ``src`` into ``dst`` and write ``out`` (HF folders or GGUF files)."""
    src, dst, out = Path(src), Path(dst), Path(out)
    if precision not in ("keep", "match"):
        raise ValueError(f"--mtp-precision must be keep or match, got {precision!r}")
    _check_paths([src, dst], out, force)
    if is_gguf(dst):
        if out.suffix != ".gguf":
            raise ValueError(f"--into is a GGUF file: --out must end in .gguf, got {out}")
        return _graft_into_gguf(src, dst, out, precision, engines)
    if not dst.is_dir():
        raise CheckpointError(f"{dst}: not a checkpoint folder or .gguf file")
    from .mlx import graft_into_mlx, is_mlx_checkpoint

    if is_mlx_checkpoint(dst):
        return graft_into_mlx(src, dst, out, precision, engines)
    return _graft_into_hf(src, dst, out, precision, engines)


def _source_head(src: Path, dst_lay: HFLayout) -> tuple[dict, str]:
    """The source's MTP tensors in the destination's layout, and a description."""
    import torch

    if is_gguf(src):
        from ..checkpoint.gguf import open_gguf

        g = open_gguf(src)
        if not g.n_nextn:
            raise ValueError(f"{src}: has no MTP (nextn) layers to graft")
        names = [n for n in g.tensor_names() if is_mtp_tensor(n, g.n_layer)]
        tensors = {n: g.get_tensor(n) for n in names}
        dtype = _float_dtype(dst_lay)
        tensors = {n: t.to(dtype) for n, t in tensors.items()}
        return (_to_layout(tensors, g.n_layer, dst_lay, g.arch),
                f"{src.name} (GGUF {g.arch})")
    lay = read_hf(src)
    if lay.text_model_type != dst_lay.text_model_type:
        raise ValueError(
            f"{src} is {lay.text_model_type} but {dst_lay.path} is "
            f"{dst_lay.text_model_type}: a head only fits the trunk it was trained with")
    if lay.n_layer != dst_lay.n_layer:
        raise ValueError(f"{src} has {lay.n_layer} layers but {dst_lay.path} has "
                         f"{dst_lay.n_layer}: not the same model")
    names = lay.mtp_names()
    if not names:
        raise ValueError(f"{src}: has no MTP tensors to graft")
    quantized = sorted({n.rpartition(".")[0] for n in names
                        if lay.modules[n.rpartition(".")[0]].fmt != "float"})
    if quantized:
        raise ValueError(
            f"{src}: its MTP head is stored quantized ({', '.join(quantized[:3])} ...); graft "
            "from the release that stores it in BF16")
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(lay.file_of[n], []).append(n)
    for fname, ns in by_file.items():
        with safe_open(str(src / fname), framework="pt") as h:
            for n in ns:
                tensors[n] = h.get_tensor(n)
    return tensors, f"{src.name}"


def _float_dtype(lay: HFLayout):
    import torch

    table = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    for name, dt in lay.dtypes.items():
        if "embed_tokens" in name and dt in table:
            return table[dt]
    return torch.bfloat16


def _to_layout(tensors: dict, n_src: int, lay: HFLayout, arch: str | None = None) -> dict:
    """Head tensors read from a GGUF (mtp.* for Qwen archs, model.layers.{n}.* or
    model.mtp.layers.{i}.* otherwise) -> the destination family's on-disk layout."""
    from ..models.mtp import MIMO_NAMES, map_nextn_name

    mt = lay.text_model_type
    if mt in DEEPSEEK_STYLE | STEP_STYLE | MIMO_V2_STYLE:
        return _release_layout(tensors, n_src, lay, arch)
    out = {}
    for name, t in tensors.items():
        if mt != "mimo":  # Qwen's mtp.* layout, or an mtpkit head over a Llama-family trunk
            mapped = map_nextn_name(name, n_src) if name.startswith("model.layers.") else name
            if mapped is None:
                continue  # copies of the trunk's lm_head / embedding
            if mapped.startswith("mtp.per_layer."):
                # These families' heads share one combine across their blocks: a second
                # layer's own norms and eh_proj have nowhere to go, and dropping them would
                # leave a head that drafts with the wrong weights past step 0.
                raise ValueError(
                    f"{name}: the source's MTP layers each carry their own norms and eh_proj, "
                    f"but a {mt} head has one set shared by all its layers; graft a source "
                    "with one MTP layer (or a Qwen3.5-layout mtp.* head) instead")
            out[mapped] = t
        else:  # mimo
            mapped = map_nextn_name(name, n_src)
            if mapped is None:
                continue
            # Each MiMo MTP layer keeps its own norms and input_proj (layer i >= 1's read
            # back from mtp.per_layer.{i}.*).
            own = re.match(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)\.weight$", mapped)
            inv = {f"{new}": old for old, new in MIMO_NAMES.items()}
            if own and own[2] in inv:
                out[f"model.mtp_layers.{own[1] or 0}.{inv[own[2]]}.weight"] = t
                continue
            mm = re.match(r"mtp\.layers\.(\d+)\.(.+)", mapped)
            out[f"model.mtp_layers.{mm[1]}.{mm[2]}"] = t
    return out


# Pseudo-names (mtp.*) for the copies of the trunk's lm_head and embedding that a release's
# MTP layer i stores (the model maps the head copy of Step-3.5/3.7 to mtp.heads.{i}, a layer's
# own output head; DeepSeek-style copies it does not read).
_HEAD_COPY = "mtp.heads.{}.weight"
_EMBED_COPY = "mtp.embed_copies.{}.weight"
_OWN_MODULES = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")


@dataclass
class _ReleaseLayout:
    """Where a family's release keeps MTP layer i's tensors."""

    prefix: str  # format string over n (num_hidden_layers + i), i and tp (the text prefix)
    own: dict  # mtpkit's own-module names (fc, norm, ...) -> the release's
    copies: dict = field(default_factory=dict)  # "head" / "embed" -> name below the prefix
    block_renames: tuple = ()  # (mtpkit's, the release's) substrings of block names


def _release_spec(mt: str) -> _ReleaseLayout:
    """The release layout of a DeepSeek-style, Step or MiMo-V2 family. The own-module names
    are the model classes' own tables read backwards; what those tables cannot say (which
    copies a release stores, Step's transformer. infix) is written out here, and every name
    is checked against the class's checkpoint-name map before anything is written."""
    from ..models.mimo_v2_flash import _MTP_OWN as MIMO_V2_OWN
    from ..models.mtp import NEXTN_NAMES
    from ..models.step3p7 import _MTP_OWN as STEP_OWN

    if mt in STEP_STYLE:
        own = {ours: ("transformer." + rel if rel.startswith("shared_head.") else rel)
               for rel, ours in STEP_OWN.items()}
        return _ReleaseLayout("model.layers.{n}.", own,
                              {"head": "transformer.shared_head.output.weight"})
    if mt in MIMO_V2_STYLE:
        return _ReleaseLayout("model.mtp.layers.{i}.", {o: r for r, o in MIMO_V2_OWN.items()},
                              block_renames=(("post_attention_layernorm", "pre_mlp_layernorm"),
                                             ("self_attn.sinks", "self_attn.attention_sink_bias")))
    return _ReleaseLayout("{tp}layers.{n}.", {o: r for r, o in NEXTN_NAMES.items()},
                          {"head": "shared_head.head.weight", "embed": "embed_tokens.weight"})


def _family_model(lay: HFLayout, n_mtp: int):
    """The destination's family model with ``n_mtp`` MTP layers, on the meta device."""
    import torch

    from ..models.registry import family_for

    config = dict(lay.config)
    config["num_nextn_predict_layers"] = config["mtp_num_hidden_layers"] = max(n_mtp, 1)
    cls = family_for(config.get("model_type"))
    with torch.device("meta"):
        return cls(cls.config_class.from_hf_config(config))


def _release_layout(tensors: dict, n_src: int, lay: HFLayout, arch: str | None) -> dict:
    """A GGUF head (the reader's names: model.layers.{n_src + i}.*, model.mtp.layers.{i}.*) in
    the destination family's release names, every MTP layer of it, with the copies of the
    trunk's lm_head / embedding the release stores in each layer (the source's where it has
    them, else the destination's own). The destination class's checkpoint-name map reads
    the source's names, and must read each written name back as the same parameter."""
    mt, n_dst = lay.text_model_type, lay.n_layer
    n_mtp = mtp_layer_count(list(tensors), n_src)
    model = _family_model(lay, n_mtp)
    spec = _release_spec(mt)
    ours: dict[str, object] = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if m and int(m[1]) >= n_src:
            name = f"model.layers.{n_dst + int(m[1]) - n_src}.{m[2]}"
        mapped = model.map_checkpoint_name(name)
        if mapped is None:
            copy = re.match(r"model\.layers\.(\d+)\.(shared_head\.head|embed_tokens)\.weight$",
                            name)
            if copy is None:
                continue
            i = int(copy[1]) - n_dst
            mapped = (_HEAD_COPY if copy[2] == "shared_head.head" else _EMBED_COPY).format(i)
        if not mapped.startswith("mtp."):
            raise ValueError(f"GGUF tensor {name} has no place in a {mt} MTP head: is the "
                             "GGUF of the same model?")
        ours[mapped] = t
    if arch in ("deepseek2", "glm-dsa") and not lay.config.get("rope_interleave", True):
        ours = {k: _rope_rows_to_halves(k, v, lay.config) for k, v in ours.items()}
    prefix = _text_prefix(lay, model)
    trunk: dict | None = None
    out: dict[str, object] = {}
    for i in range(n_mtp):
        for kind in spec.copies:
            key = (_HEAD_COPY if kind == "head" else _EMBED_COPY).format(i)
            if key not in ours:
                if trunk is None:
                    trunk = _trunk_shared(lay, model)
                if kind in trunk:
                    ours[key] = trunk[kind].clone()
    for key, t in ours.items():
        name = _release_name(key, spec, prefix, n_dst)
        if name is None:
            continue
        back = model.map_checkpoint_name(name)
        copy = key.startswith(("mtp.heads.", "mtp.embed_copies."))
        if back != key and not (copy and back is None):
            raise ValueError(f"graft would write {name} for {key}, which the {mt} model reads "
                             f"as {back}; this family's layout is not known well enough")
        out[name] = t
    return out


def _release_name(key: str, spec: _ReleaseLayout, tp: str, n: int) -> str | None:
    """mtpkit's name of an MTP tensor (or a copy's pseudo-name) -> the release's."""
    if m := re.fullmatch(r"mtp\.(heads|embed_copies)\.(\d+)\.weight", key):
        sub = spec.copies.get("head" if m[1] == "heads" else "embed")
        i = int(m[2])
        rest = sub
    elif m := re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)\.(\w+)", key):
        if m[2] not in _OWN_MODULES:
            raise ValueError(f"no release name for MTP tensor {key}")
        i, rest = int(m[1] or 0), f"{spec.own[m[2]]}.{m[3]}"
    elif m := re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", key):
        i, rest = int(m[1]), m[2]
        for a, b in spec.block_renames:
            rest = rest.replace(a, b)
    else:
        raise ValueError(f"no release name for MTP tensor {key}")
    if rest is None:
        return None
    return spec.prefix.format(tp=tp, n=n + i, i=i) + rest


def _text_prefix(lay: HFLayout, model) -> str:
    """What comes before layers.N. in the destination's trunk names (model., Kimi-K2.5's
    language_model.model.): the prefix of a stored name its class reads as layer 0's."""
    want = "model.layers.0."
    for name in lay.names():
        mapped = model.map_checkpoint_name(name)
        if mapped and mapped.startswith(want) and (k := name.find("layers.0.")) >= 0:
            return name[:k]
    return "model."


def _trunk_shared(lay: HFLayout, model) -> dict:
    """The destination's float lm_head and embedding ("head", "embed"), which a release's MTP
    layers store copies of (a tied lm_head: the embedding)."""
    from safetensors import safe_open

    found = {}
    for name in lay.names():
        mapped = model.map_checkpoint_name(name)
        kind = {"lm_head.weight": "head", "model.embed_tokens.weight": "embed"}.get(mapped)
        if kind and lay.dtypes[name] in ("BF16", "F16", "F32"):
            with safe_open(str(lay.path / lay.file_of[name]), framework="pt") as h:
                found[kind] = h.get_tensor(name)
    if "head" not in found and "embed" in found and lay.config.get("tie_word_embeddings"):
        found["head"] = found["embed"]
    return found


def _rope_rows_to_halves(key: str, t, cfg: dict):
    """A GGUF MLA head's rope rows (adjacent pairs, as llama.cpp stores them) back to the
    half-split order of a destination whose config says rope_interleave false."""
    from ..checkpoint.gguf_moe import reorder_rope_rows

    if key.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        heads = int(cfg["num_attention_heads"])
    elif key.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        heads = 0
    else:
        return t
    return reorder_rope_rows(t, int(cfg["qk_rope_head_dim"]), heads, to_pairs=False)


def _check_head_shapes(head: dict, lay: HFLayout) -> None:
    """Every grafted tensor must have the shape the destination's config implies."""
    model = _family_model(lay, mtp_layer_count(list(head), lay.n_layer))
    params = {k: tuple(v.shape) for k, v in model.named_parameters()}
    for name, t in head.items():
        mapped = model.map_checkpoint_name(name)
        if mapped in params and tuple(t.shape) != params[mapped]:
            raise ValueError(
                f"head tensor {name} has shape {tuple(t.shape)} but {lay.path} needs "
                f"{params[mapped]}: the source is not the same model")


def _graft_into_hf(src: Path, dst: Path, out: Path, precision: str, engines) -> GraftResult:
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst_lay = read_hf(dst)
    head, desc = _source_head(src, dst_lay)
    _check_head_shapes(head, dst_lay)
    changes = [f"head: {len(head)} tensors from {desc}"]
    if precision == "match":
        head, note = _match_hf_precision(head, dst_lay)
        changes.append(note)
    tmp = _stage_copy(dst, out)
    try:
        # Drop the destination's own (missing, broken or low-precision) head first.
        old = [n for n in dst_lay.names() if is_mtp_tensor(n, dst_lay.n_layer)]
        weight_map = dict(dst_lay.index) if dst_lay.index is not None else None
        by_file: dict[str, list[str]] = {}
        for n in old:
            by_file.setdefault(dst_lay.file_of[n], []).append(n)
        for fname, names in by_file.items():
            rest = [n for n, f in dst_lay.file_of.items() if f == fname and n not in names]
            if rest:
                with safe_open(str(dst / fname), framework="pt") as h:
                    kept = {n: h.get_tensor(n) for n in rest}
                    meta = h.metadata()
                save_file(kept, str(tmp / fname), metadata=meta or {"format": "pt"})
            else:
                (tmp / fname).unlink()
        if old:
            changes.append(f"removed the destination's {len(old)} MTP tensors")
        fname = MTP_FILE
        i = 1
        while (tmp / fname).exists():
            fname = f"model_mtp-{i}.safetensors"
            i += 1
        save_file({k: v.contiguous() for k, v in head.items()}, str(tmp / fname),
                  metadata={"format": "pt"})
        files = sorted(p.name for p in tmp.glob("*.safetensors"))
        if weight_map is not None or len(files) > 1:
            if weight_map is None:
                weight_map = dict(dst_lay.file_of)
            weight_map = {k: v for k, v in weight_map.items() if k not in set(old)}
            weight_map.update({k: fname for k in head})
            _write_index(tmp, weight_map)
            changes.append(f"index: {fname} listed ({len(head)} tensors)")
        changes += repair_hf_folder(tmp, engines)
        return _finish(tmp, out, changes, engines)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _ct_scheme(q: dict):
    """The compressed-tensors weight scheme of the first config group, as mtpkit's Scheme."""
    try:
        from ..quant.pack import Scheme
    except ImportError as e:
        raise ValueError("--mtp-precision match needs mtpkit.quant.pack, which this install "
                         "lacks; use --mtp-precision keep") from e
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("the destination's quantization_config has no config_groups")
    w = groups[0].get("weights") or {}
    bits, kind = int(w.get("num_bits", 4)), w.get("type", "int")
    if kind == "float":
        name = "fp8"
    elif bits == 4:
        acts = groups[0].get("input_activations") or {}
        name = "w4a8" if acts.get("type") == "int" and int(acts.get("num_bits", 0)) == 8 \
            else "w4a16"
    elif bits == 8:
        # W8A8 stores int8 weights unpacked (int-quantized); writing the head packed would
        # not match the destination's format.
        acts = groups[0].get("input_activations") or {}
        name = "w8a8" if acts.get("type") == "int" and int(acts.get("num_bits", 0)) == 8 \
            else "w8a16"
    else:
        raise ValueError(f"--mtp-precision match: {bits}-bit {kind} weights are not supported")
    gs = w.get("group_size")
    return Scheme(name, int(gs) if gs and name not in ("fp8", "w8a8") else None,
                  bool(w.get("symmetric", True)))


def _match_hf_precision(head: dict, lay: HFLayout) -> tuple[dict, str]:
    """Quantize the head's linear modules the way the destination's config quantizes its
    trunk (compressed-tensors); modules whose shape the scheme cannot store stay BF16."""
    q = lay.quant_config
    if str(q.get("quant_method", "")).lower() != "compressed-tensors":
        raise ValueError(
            f"--mtp-precision match supports compressed-tensors destinations; {lay.path} uses "
            f"{q.get('quant_method') or 'no quantization'}: use --mtp-precision keep")
    from ..quant.pack import quantize_weight

    scheme = _ct_scheme(q)
    mt = lay.model_type
    # Fused groups are quantized whole or not at all (vLLM builds them as one module).
    groups: dict[str, list[str]] = {}
    for name, t in head.items():
        if name.endswith(".weight") and t.dim() == 2:
            mod = name[: -len(".weight")]
            rt = describe(mod, mt, "vllm", config=lay.raw)
            # Heads stay as stored: "Linear" targets never reach a ParallelLMHead in vLLM.
            if _class_quantized(rt):
                groups.setdefault(rt.name, []).append(mod)
    out = dict(head)
    done = kept = 0
    for mods in groups.values():
        if not all(scheme.fits(*head[m + ".weight"].shape) for m in mods):
            kept += len(mods)
            continue
        for m in mods:
            w = out.pop(m + ".weight")
            for suffix, t in quantize_weight(w, scheme).items():
                out[f"{m}.{suffix}"] = t
            done += 1
    return out, (f"head precision: {done} modules quantized as {scheme.name}"
                 + (f", {kept} kept BF16 (shape not storable)" if kept else ""))


# ---------------------------------------------------------------------------------------------
# GGUF


def _graft_into_gguf(src: Path, dst: Path, out: Path, precision: str, engines) -> GraftResult:
    from gguf import GGUFReader

    from .checks import gguf_facts

    d = gguf_facts(dst)
    arch = d["arch"]
    n_trunk = len(d["trunk_blocks"])
    tmp_src = None
    try:
        if is_gguf(src):
            src_gguf = src
        else:
            tmp_src = _hf_head_as_gguf(src, arch, n_trunk, out.parent)
            src_gguf = tmp_src
        s = gguf_facts(src_gguf)
        if s["arch"] != arch:
            raise ValueError(f"{src} is GGUF architecture {s['arch']} but {dst} is {arch}")
        if not s["nextn_blocks"]:
            raise ValueError(f"{src}: has no MTP (nextn) layers to graft")
        if tmp_src is None and len(s["trunk_blocks"]) != n_trunk:
            raise ValueError(f"{src} has {len(s['trunk_blocks'])} trunk blocks but {dst} has "
                             f"{n_trunk}: not the same model")
        reader = GGUFReader(src_gguf, "r")
        offset = n_trunk - s["nextn_blocks"][0]
        head = []
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.(.+)", t.name)
            if m and int(m[1]) in s["nextn_blocks"]:
                head.append((f"blk.{int(m[1]) + offset}.{m[2]}", t))
        target = _main_type(d) if precision == "match" else None
        k = len(s["nextn_blocks"])
        changes = [f"head: {len(head)} tensors of {k} nextn block(s) from {src.name}"
                   + (f", requantized to {target}" if target else ", kept as stored")]
        # The destination's own nextn blocks (if any) are replaced.
        drop = set(d["nextn_blocks"])
        tmp = _write_gguf_copy(dst, out, arch, n_trunk, k, drop, head, target)
        changes.append(f"metadata: {arch}.block_count -> {n_trunk + k}, "
                       f"{arch}.nextn_predict_layers -> {k}")
        return _finish(tmp, out, changes, engines or ["llama.cpp", "mtpkit"])
    finally:
        if tmp_src is not None and tmp_src.exists():
            tmp_src.unlink()


def _hf_head_as_gguf(src: Path, arch: str, n_trunk: int, where: Path) -> Path:
    """Convert an HF checkpoint's head to GGUF tensors (through mtpkit's GGUF writer)."""
    from ..checkpoint.gguf import write_gguf

    lay = read_hf(src)
    names = lay.mtp_names()
    if not names:
        raise ValueError(f"{src}: has no MTP tensors to graft")
    if lay.n_layer != n_trunk:
        raise ValueError(f"{src} has {lay.n_layer} layers but the GGUF has {n_trunk}")
    from safetensors import safe_open

    tensors = {}
    for n in names:
        with safe_open(str(src / lay.file_of[n]), framework="pt") as h:
            tensors[n] = h.get_tensor(n).float()
    if arch not in ("qwen3next", "qwen35", "qwen35moe"):
        tensors = _mtp_to_nextn_names(tensors, n_trunk)
    fd, tmp = tempfile.mkstemp(prefix=".mtpkit-head-", suffix=".gguf", dir=where)
    os.close(fd)
    write_gguf(tmp, arch, dict(lay.config), tensors, None, "F32")
    return Path(tmp)


def _mtp_to_nextn_names(tensors: dict, n: int) -> dict:
    """mtp.* (mtpkit's layout) -> model.layers.{n}.* (what blk.N.nextn.* stands for)."""
    from ..models.mtp import NEXTN_NAMES

    inv = {f"mtp.{new}.weight": f"model.layers.{n}.{old}.weight"
           for old, new in NEXTN_NAMES.items()}
    out = {}
    for k, v in tensors.items():
        if k in inv:
            out[inv[k]] = v
        elif m := re.match(r"mtp\.layers\.(\d+)\.(.+)", k):
            out[f"model.layers.{n + int(m[1])}.{m[2]}"] = v
        else:
            out[k] = v
    return out


def _main_type(facts) -> str:
    """The type most 2-D trunk weights of a GGUF are stored in (what 'match' quantizes to)."""
    counts: dict[str, int] = {}
    for name, t in facts["types"].items():
        if name.endswith(".weight") and t not in ("F32",) and "norm" not in name:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get) if counts else "F32"


def _write_gguf_copy(dst: Path, out: Path, arch: str, n_trunk: int, k: int, drop: set[int],
                     extra: list, target: str | None) -> Path:
    """Copy ``dst`` with block_count / nextn key set, blocks ``drop`` removed and ``extra``
    (name, source tensor) added (requantized to ``target`` when given); atomic temp file."""
    import gguf
    import torch
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from ..checkpoint.gguf import _keep_f32

    reader = GGUFReader(dst, "r")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, arch)
        block_key = f"{arch}.block_count"
        nextn_key = f"{arch}.nextn_predict_layers"
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            if name in (block_key, nextn_key):
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), vtype, sub_type=sub)
        w.add_block_count(n_trunk + k)
        if k:
            w.add_nextn_predict_layers(k)
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            if m and int(m[1]) in drop:
                continue
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        for name, t in extra:
            data, qtype = t.data, t.tensor_type
            if target is not None and qtype.name != target:
                values = gguf.quants.dequantize(t.data, qtype)
                shape = [int(x) for x in reversed(t.shape.tolist())]
                values = values.reshape(shape).astype("float32")
                q = gguf.GGMLQuantizationType[target]
                if _keep_f32(name, torch.from_numpy(values)) or \
                        shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
                    q = gguf.GGMLQuantizationType.F32
                data = values if q == gguf.GGMLQuantizationType.F32 else \
                    gguf.quants.quantize(values, q)
                qtype = q
            w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return Path(tmp)
    except NotImplementedError as e:
        os.unlink(tmp)
        raise ValueError(f"--mtp-precision match: the gguf package cannot quantize to "
                         f"{target} ({e}); use --mtp-precision keep") from e
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fix_gguf(src: Path, out: Path, engines) -> GraftResult:
    from .checks import gguf_facts

    f = gguf_facts(src)
    arch = f["arch"]
    nb, trunk = f["nextn_blocks"], f["trunk_blocks"]
    n_trunk = len(trunk)
    if nb and nb != list(range(n_trunk, n_trunk + len(nb))):
        raise ValueError(f"{src}: the nextn blocks {nb} do not follow the {n_trunk} trunk "
                         "blocks; graft them from a good file instead")
    k = len(nb)
    changes = []
    md = f["md"]
    if md.get(f"{arch}.block_count") != n_trunk + k:
        changes.append(f"metadata: {arch}.block_count {md.get(f'{arch}.block_count')} -> "
                       f"{n_trunk + k}")
    if k and md.get(f"{arch}.nextn_predict_layers") != k:
        changes.append(f"metadata: {arch}.nextn_predict_layers "
                       f"{md.get(f'{arch}.nextn_predict_layers')} -> {k}")
    if not changes:
        changes.append("nothing to repair in the metadata")
    tmp = _write_gguf_copy(src, out, arch, n_trunk, k, set(), [], None)
    return _finish(tmp, out, changes, engines or ["llama.cpp", "mtpkit"])
