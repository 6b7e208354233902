"""Static checks: every cause of a broken MTP head in mtp-formats.md section 2, per engine."""

from __future__ import annotations

import re
from pathlib import Path

from ..checkpoint.errors import CheckpointError
from ..checkpoint.runtime_names import (
    _MIMO_V2,
    _MIMO_V2_VLLM_LAYERS,
    IgnoreStatus,
    VllmRules,
    describe,
    entry_matches,
    ignore_status,
    is_class_name,
    map_ignore_entries,
    vllm_mtp_class,
)
from ..checkpoint.runtime_names import (
    _NEXTN as _NEXTN_FAMILIES,
)
from .findings import Finding, Report
from .layout import (
    GGUF_NATIVE_MTP,
    NATIVE_MTP,
    QWEN35,
    HFLayout,
    get_key,
    is_mtp_tensor,
    logical_shape,
    mtp_config_key,
    mtp_layer_count,
    read_hf,
)

HF_ENGINES = ("vllm", "sglang", "mtpkit")
# model_types with MTP-style layers vLLM builds no MTP draft for (config/speculative.py).
_NO_VLLM_MTP = {"deepseek_v2", "kimi_k2"}
# model_type -> the MTP layers vLLM's draft builds whatever the checkpoint stores (the others
# build every stored layer and draft step i with layer i mod n, as mtpkit does).
_VLLM_MTP_LAYERS_BUILT = {mt: _MIMO_V2_VLLM_LAYERS for mt in _MIMO_V2}
GGUF_ENGINES = ("llama.cpp", "mtpkit")
ALL_ENGINES = ("vllm", "sglang", "llama.cpp", "mtpkit")
_FUSING = ("vllm", "sglang")
_LIST = 6  # names shown per finding before "..."


def _few(names, n: int = _LIST) -> str:
    names = list(names)
    return ", ".join(map(str, names[:n])) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def graft_cmd(path) -> str:
    """The graft command for a checkpoint that lost (or broke) its head."""
    out = _out_name(path, "mtp")
    return f"mtpkit graft --from <the BF16 release with its MTP head> --into {path} --out {out}"


def fix_config_cmd(path) -> str:
    """The fix-config command for a checkpoint whose config / index / ignore list is wrong."""
    return f"mtpkit fix-config {path} --out {_out_name(path, 'fixed')}"


def _out_name(path, tag: str) -> str:
    p = Path(path)
    if p.suffix == ".gguf":
        return str(p.with_name(f"{p.stem}-{tag}.gguf"))
    return f"{str(p).rstrip('/')}-{tag}"


def diagnose(path, engines=None, vllm_version=None) -> Report:
    """Run every static check on a checkpoint folder or GGUF file for the given engines;
    ``vllm_version`` ("0.28", None: the latest rules read) picks vLLM's ignore-list rules."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint folder or file")
    is_gguf = p.is_file() and (p.suffix == ".gguf" or _magic(p) == b"GGUF")
    if p.is_file() and not is_gguf:
        raise CheckpointError(
            f"{p}: not a checkpoint folder or .gguf file; pass the folder that holds "
            "config.json and the .safetensors files, or a .gguf file"
        )
    from .mlx import MLX_ENGINES, diagnose_mlx, is_mlx_checkpoint

    if any(e in MLX_ENGINES for e in engines or ()) or (not engines and is_mlx_checkpoint(p)):
        return diagnose_mlx(p, engines)
    wanted = tuple(engines) if engines else ALL_ENGINES
    for e in wanted:
        if e not in ALL_ENGINES:
            raise ValueError(f"--engine {e!r} is not one of {', '.join(ALL_ENGINES)}")
    # An engine that does not read this format leaves the format's engine-neutral checks.
    if is_gguf:
        rep = _gguf_checks(p, [e for e in wanted if e in GGUF_ENGINES])
    else:
        VllmRules.of(vllm_version)  # a malformed version is a user mistake, said up front
        rep = _hf_checks(p, [e for e in wanted if e in HF_ENGINES], vllm_version)
    rep.engines = list(wanted)
    return rep


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


# ---------------------------------------------------------------------------------------------
# HF folders


def _hf_checks(path: Path, engines: list[str], vllm_version=None) -> Report:
    lay = read_hf(path)
    rep = Report(str(path), "hf", lay.model_type, engines)
    mt = lay.text_model_type
    mtp_names = lay.mtp_names()
    n_mtp = mtp_layer_count(mtp_names, lay.n_layer)
    key = mtp_config_key(mt, lay.raw)
    declared = get_key(lay.raw, key)
    rep.facts.update({"mtp_layers_stored": n_mtp, "mtp_config": f"{key}={declared}",
                      "quant_method": lay.quant_config.get("quant_method", "none")})
    _check_presence(rep, lay, mtp_names, n_mtp, key, declared, engines)
    _check_dsa_head(rep, lay, mtp_names)
    _check_index(rep, lay, engines)
    model = _meta_model(rep, lay, max(n_mtp, 1))
    if model is not None:
        _check_shapes(rep, lay, model, bool(mtp_names))
    if lay.quant_config:
        _check_quantization(rep, lay, engines, vllm_version)
    _check_mtp_precision(rep, lay)
    _check_dtypes(rep, lay)
    return rep


def _check_presence(rep, lay: HFLayout, mtp_names, n_mtp, key, declared, engines) -> None:
    mt = lay.text_model_type
    path = lay.path
    try:
        declared_n = int(declared) if declared is not None else None
    except (TypeError, ValueError):
        declared_n = None
    expected = mt in NATIVE_MTP or bool(declared_n)
    if not mtp_names:
        if expected:
            why = ("the config declares an MTP head" if declared_n else
                   f"{mt} releases ship an MTP head")
            rep.add(Finding(
                "mtp-missing", "error",
                f"no MTP tensors in {path.name} ({why}; {key}={declared})",
                "an export through transformers' save_pretrained drops the MTP weights "
                "(transformers builds no MTP modules); engines then either refuse MTP "
                "speculation or, worse, build the head from uninitialised memory "
                "(0% acceptance)",
                graft_cmd(path), subject="mtp.*"))
        else:
            rep.add(Finding(
                "mtp-none", "info", f"{path.name} has no MTP head ({mt} releases ship none)",
                "there is nothing to draft with", f"mtpkit calibrate --model {path} --data "
                "<text files> --out <head dir>", subject="mtp.*"))
        return
    if "vllm" in engines and vllm_mtp_class(mt) is None and mt in _NO_VLLM_MTP:
        rep.add(Finding(
            "engine-no-mtp-class", "warning",
            f"{len(mtp_names)} MTP tensors are stored, but vLLM has no MTP draft model for "
            f"model_type {mt!r}",
            "vLLM picks the MTP draft class from the model_type (deepseek_v3, deepseek_v32, "
            "glm_moe_dsa, glm4_moe, glm4_moe_lite, qwen3_next, qwen3_5*, mimo); for this one "
            "--speculative-config method mtp has nothing to build",
            "set model_type to the family the weights follow (deepseek_v3 for a DeepSeek-V3 "
            "layout) if that is what they are", ["vllm"], "model_type"))
    if "sglang" in engines and mt in _MIMO_V2 and n_mtp > 1:
        rep.add(Finding(
            "sglang-one-mtp-layer", "warning",
            f"{n_mtp} MTP layers are stored; SGLang builds one and loads every stored layer "
            "into it, so the layer it reads last is the one it drafts with, at every step",
            "SGLang's MiMoV2MTP maps model.mtp.layers.{i}.* onto its single block for every "
            "i (mimo_v2_flash_nextn.py); layer 0 is the one trained on the trunk's states. "
            "vLLM reads layer 0 only; mtpkit runs layer i at draft step i",
            "to draft with layer 0 in SGLang, keep only layer 0 in the copy it loads",
            ["sglang"], "model.mtp.layers"))
    built = _VLLM_MTP_LAYERS_BUILT.get(mt)
    if "vllm" in engines and built is not None and n_mtp > built:
        rep.add(Finding(
            "vllm-one-mtp-layer", "info",
            f"{n_mtp} MTP layers are stored; vLLM builds layer 0 only and drafts every step "
            "with it, where mtpkit drafts step i with layer i",
            f"vLLM's {vllm_mtp_class(mt)} builds {built} MTP layer and its loader skips the "
            "other layers' tensors; acceptance mtpkit measures at k >= 2 (eval, bench, "
            "doctor --measure) comes from layers vLLM never runs and does not carry over "
            "(at k = 1 both draft with layer 0)",
            "to measure what vLLM runs, give mtpkit a copy whose config declares 1 MTP "
            "layer: it then drafts every step with layer 0, as vLLM does",
            ["vllm"], "model.mtp.layers"))
    if not declared_n:
        severity = "error"
        why = ("engines enable the MTP head from this field: without it the head's "
               "tensors are ignored and nothing is drafted")
        if mt == "qwen3_next" and declared is None:
            why += " (vLLM assumes 1 for qwen3_next when the field is absent; mtpkit does not)"
        rep.add(Finding(
            "mtp-config-missing", severity,
            f"{len(mtp_names)} MTP tensors stored ({n_mtp} layer(s)) but {key} is "
            f"{'absent' if declared is None else declared}",
            why, fix_config_cmd(path), subject=key))
    elif declared_n != n_mtp:
        rep.add(Finding(
            "mtp-config-mismatch", "warning" if declared_n < n_mtp else "error",
            f"{key}={declared_n} but the tensors hold {n_mtp} MTP layer(s)",
            "the engine builds the declared number of layers; layers without tensors run "
            "on uninitialised memory, extra stored layers are ignored",
            fix_config_cmd(path), subject=key))
    if mt in QWEN35:
        flag = get_key(lay.raw, "text_config.mtp_use_dedicated_embeddings")
        if flag is None:
            flag = lay.raw.get("mtp_use_dedicated_embeddings")
        own = any(n.startswith("mtp.embed_tokens") for n in mtp_names)
        if flag and not own:
            rep.add(Finding(
                "mtp-dedicated-embeddings", "warning",
                "mtp_use_dedicated_embeddings is true but there is no mtp.embed_tokens tensor",
                "an engine that honours the flag builds the head's own embedding and finds "
                "no weights for it (vLLM ignores the flag and shares the trunk's)",
                fix_config_cmd(path), subject="mtp_use_dedicated_embeddings"))
        elif own and not flag:
            rep.add(Finding(
                "mtp-dedicated-embeddings", "warning",
                "mtp.embed_tokens is stored but mtp_use_dedicated_embeddings is not true",
                "the head's own embedding is ignored; the trunk's is used instead",
                fix_config_cmd(path), subject="mtp_use_dedicated_embeddings"))


def _check_dsa_head(rep, lay: HFLayout, mtp_names) -> None:
    """GLM-5's MTP layer where mtpkit and vLLM select its keys differently."""
    cfg = lay.config
    if lay.text_model_type != "glm_moe_dsa" or not mtp_names \
            or not cfg.get("index_share_for_mtp_iteration"):
        return
    topk = cfg.get("index_topk", 2048)
    rep.add(Finding(
        "dsa-mtp-index-share", "info",
        "index_share_for_mtp_iteration is true: vLLM's chained draft steps reuse the first "
        f"step's top-{topk} key selection, mtpkit runs the MTP layer's indexer at every step",
        f"past index_topk={topk} tokens of context the drafts from the second step on can "
        "differ between the two, so acceptance measured with mtpkit may not carry over to "
        "vLLM; generated text is unaffected (drafts are verified)",
        "", ["mtpkit"], "index_share_for_mtp_iteration"))


def _check_index(rep, lay: HFLayout, engines) -> None:
    if lay.index is None:
        return
    listed = set(lay.index.values())
    for fname in lay.files:
        if fname in listed:
            continue
        names = [n for n, f in lay.file_of.items() if f == fname]
        mtp = [n for n in names if is_mtp_tensor(n, lay.n_layer)]
        if not mtp:
            continue
        affected = [e for e in engines if e in _FUSING]
        if fname not in lay.read_by_mtpkit and "mtpkit" in engines:
            affected.append("mtpkit")
        if not affected:
            continue
        rep.add(Finding(
            "mtp-file-unindexed", "error",
            f"{fname} holds {len(mtp)} MTP tensors but model.safetensors.index.json does not "
            "list it",
            "engines read only the files the index lists: the MTP head is silently missing "
            "(vLLM then drafts from uninitialised weights or refuses MTP)",
            fix_config_cmd(lay.path), engines=affected, subject=fname))


def _meta_model(rep, lay: HFLayout, n_mtp: int):
    """The family's model built on the meta device (expected names and shapes), or None."""
    import torch

    from ..models.config import ConfigError
    from ..models.registry import family_for

    config = dict(lay.config)
    config["num_nextn_predict_layers"] = config["mtp_num_hidden_layers"] = n_mtp
    try:
        cls = family_for(config.get("model_type"))
        cfg = cls.config_class.from_hf_config(config)
        with torch.device("meta"):
            return cls(cfg)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        rep.add(Finding(
            "unknown-model-type", "info",
            f"mtpkit cannot build model_type {config.get('model_type')!r} ({e}); shape checks "
            "skipped", "", "", subject="model_type"))
        return None


def _check_shapes(rep, lay: HFLayout, model, has_mtp: bool) -> None:
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    found: set[str] = set()
    mismatches = []
    for mod in lay.modules.values():
        for suffix, tname in mod.params.items():
            if mod.fmt != "float" and suffix != "bias":
                continue  # quantized tensors: compared below through their logical shape
            mapped = model.map_checkpoint_name(tname)
            if mapped is None:
                continue
            if mapped in params:
                found.add(mapped)
                if params[mapped] != lay.shapes[tname]:
                    mismatches.append((tname, lay.shapes[tname], params[mapped]))
            elif re.search(r"\.experts\.(gate_up_proj|down_proj)$", mapped):
                prefix = mapped.rsplit(".", 1)[0]
                found.update(p for p in params if p.startswith(prefix + "."))
        if mod.fmt != "float":
            mapped = model.map_checkpoint_name(mod.name + ".weight")
            if mapped in params:
                found.add(mapped)
                shape = logical_shape(lay, mod)
                if shape is not None and tuple(shape) != params[mapped]:
                    mismatches.append((mod.name, tuple(shape), params[mapped]))
    for tname, got, want in mismatches:
        rep.add(Finding(
            "shape-mismatch", "error",
            f"{tname} has shape {got}, the config implies {want}",
            "the weights do not belong to this config (wrong hidden/intermediate size, head "
            "counts, vocab_size, or a head taken from another model)",
            "take the head from the release this trunk came from: " + graft_cmd(lay.path),
            subject=tname))
    tied = bool(lay.config.get("tie_word_embeddings"))
    for shared in ("model.embed_tokens.weight", "lm_head.weight"):
        if shared == "lm_head.weight" and tied:
            continue
        if shared in params and shared not in found:
            rep.add(Finding(
                "shared-embedding-missing", "error",
                f"{shared} (as the model names it) is missing",
                "the MTP head embeds the next token with the trunk's embedding and scores "
                "its drafts with the trunk's lm_head",
                "copy the tensor from the original release (every shard present?)",
                subject=shared))
    if has_mtp and getattr(model, "mtp", None) is not None:
        want = [p for p in params if p.startswith("mtp.")]
        missing = [p for p in want if p not in found]
        if missing and len(missing) < len(want):
            rep.add(Finding(
                "mtp-incomplete", "error",
                f"the MTP head lacks {len(missing)} of its {len(want)} tensors: "
                f"{_few(missing)} (names as mtpkit's model calls them)",
                "the missing modules are built uninitialised: drafts are garbage",
                graft_cmd(lay.path), subject="mtp.*"))


def _check_mtp_precision(rep, lay: HFLayout) -> None:
    low = sorted(m.name for m in lay.modules.values()
                 if m.fmt != "float" and m.bits is not None and m.bits <= 4
                 and is_mtp_tensor(m.name, lay.n_layer))
    if low:
        rep.add(Finding(
            "int4-mtp-head", "warning",
            f"{len(low)} MTP modules are stored at 4 bits or less: {_few(low)}",
            "a 4-bit draft head loses most of its acceptance (0% vs 78-85% BF16 reported, "
            "vllm-mlx #471); the head is small, so BF16 costs little",
            f"{graft_cmd(lay.path)} --mtp-precision keep   (or recalibrate: mtpkit "
            f"calibrate --model {lay.path} --init head)", subject="mtp.*"))


# Storage dtypes each quantized format's tensors must have (safetensors dtype names).
_INT_PARTS = {"weight_packed": {"I32"}, "weight_shape": {"I32", "I64"}, "qweight": {"I32"},
              "qzeros": {"I32"}, "g_idx": {"I32", "I64"}, "weight_g_idx": {"I32", "I64"}}
_FLOATS = {"F32", "F16", "BF16", "F64"}


def _check_dtypes(rep, lay: HFLayout) -> None:
    bad = []
    for mod in lay.modules.values():
        for suffix, tname in mod.params.items():
            dt = lay.dtypes[tname]
            if mod.fmt == "float" and suffix in ("weight", "bias") and dt not in _FLOATS:
                bad.append((tname, dt, "a float tensor (no scale stored beside it)"))
            elif suffix in _INT_PARTS and dt not in _INT_PARTS[suffix]:
                bad.append((tname, dt, "/".join(sorted(_INT_PARTS[suffix]))))
            elif suffix == "weight_scale_inv" and dt == "F8_E8M0":
                continue  # DeepSeek-V4's ue8m0 block scales: powers of two in a byte
            elif suffix in ("weight_scale", "scales", "weight_scale_inv") and dt not in _FLOATS:
                bad.append((tname, dt, "a float scale"))
    for tname, dt, want in bad:
        rep.add(Finding(
            "dtype-unexpected", "error", f"{tname} is stored as {dt}; its format needs {want}",
            "engines read the raw values as the wrong type (e.g. FP8 or int8 codes without "
            "their scale): the module computes garbage",
            "re-export the module, or " + graft_cmd(lay.path), subject=tname))


# -- quantization --------------------------------------------------------------------------


def _check_quantization(rep, lay: HFLayout, engines, version=None) -> None:
    q = lay.quant_config
    method = str(q.get("quant_method", "")).lower()
    path = lay.path
    for mod in lay.modules.values():
        if mod.fmt != "float" and mod.missing:
            rep.add(Finding(
                "quantized-tensors-missing", "error",
                f"{mod.name} is stored {mod.fmt} but lacks "
                f"{', '.join(mod.name + '.' + s for s in mod.missing)}",
                "the engine builds the quantized module and finds no values for those "
                "parameters (uninitialised memory or a load failure)",
                "re-export the module, or " + graft_cmd(path), subject=mod.name))
    fusing = [e for e in engines if e in _FUSING]
    if not fusing:
        return  # mtpkit decides precision by the tensors on disk, not the config
    if method == "compressed-tensors":
        for engine in fusing:
            for f in _ct_module_findings(lay, engine, version):
                rep.add(f)
            _check_ct_entries(rep, lay, engine, version)
        if "vllm" in fusing:
            _check_vllm_versions(rep, lay, version)
    elif method in ("fp8", "deepseek_v4_fp8") and lay.model_type == "deepseek_v4" \
            and "vllm" in fusing:
        _check_skip_list(rep, lay, "vllm", _fp8_skipped(lay),
                         "ignored_layers (exact names, renamed as vLLM renames the weights)")
    elif method == "awq":
        skip = list(q.get("modules_to_not_convert") or [])
        for engine in fusing:
            _check_skip_list(rep, lay, engine, lambda rt, s=skip: any(e and e in rt for e in s),
                             "modules_to_not_convert (substring match)")
    elif method == "gptq":
        negs = [k[2:] for k in (q.get("dynamic") or {}) if k.startswith("-:")]
        for engine in fusing:
            _check_skip_list(
                rep, lay, engine,
                lambda rt, n=negs: any(re.match(p, rt) for p in n) or rt.endswith("lm_head"),
                "dynamic '-:' patterns")


def _linear_modules(lay: HFLayout):
    return [m for m in lay.modules.values() if m.linear]


def ct_targets(lay: HFLayout) -> list[str]:
    """Every config group's targets (compressed-tensors)."""
    return [t for group in (lay.quant_config.get("config_groups") or {}).values()
            for t in group.get("targets") or []]


def _ct_targeted(lay: HFLayout, module: str, runtime: str) -> bool:
    for t in ct_targets(lay):
        if t == "Linear" or entry_matches(t, runtime) or entry_matches(t, module):
            return True
    return False


def _ct_names(lay: HFLayout, module: str) -> bool:
    """Whether a config group targets this module by name (not by class)."""
    return any(not is_class_name(t) and entry_matches(t, module) for t in ct_targets(lay))


def _mtp_code(lay: HFLayout, name: str) -> str:
    return ("mtp-unquantized-not-ignored" if is_mtp_tensor(name, lay.n_layer)
            else "unquantized-not-ignored")


# Where one of vLLM's version-dependent ignore rules changes (VllmRules): the releases from
# each of these to the next behave alike.
_VLLM_STEPS = ((0, 14, 0), (0, 20, 0), (0, 28, 0), (0, 30, 0))


def _vname(v) -> str:
    return ".".join(map(str, v))


def _ct_module_findings(lay: HFLayout, engine: str, version=None) -> list[Finding]:
    """What the engine builds for each stored module, against how it is stored."""
    ignore = list(lay.quant_config.get("ignore") or [])
    targets = ct_targets(lay)
    mt, path = lay.model_type, lay.path
    rules = VllmRules.of(version)
    ver = f" {_vname(rules.version)}" if engine == "vllm" and version is not None else ""
    eng = f"{engine}{ver}"
    out: list[Finding] = []
    not_ignored: dict[str, list[str]] = {}
    fused_only: list[str] = []
    conflicts: dict[str, list[str]] = {}
    quant_but_ignored: list[str] = []
    named_heads: list[str] = []
    unnamed_heads: list[str] = []
    experts_by_module: list[str] = []
    old_fused_regex: list[str] = []
    stacked_mtp: list[str] = []
    for mod in _linear_modules(lay):
        try:
            rt = describe(mod.name, mt, engine, config=lay.raw, vllm_version=version)
            status = ignore_status(mod.name, ignore, mt, engine, config=lay.raw,
                                   targets=targets, vllm_version=version)
        except ValueError as e:
            out.append(Finding("unknown-model-type", "info", str(e), "", "", [engine],
                               mod.name))
            continue
        if not rt.built:
            continue  # the engine never reads it (MiMo-V2-Flash MTP layers past the first)
        if (engine == "vllm" and mod.stacked_experts and rt.mtp and mt in _NEXTN_FAMILIES):
            stacked_mtp.append(mod.name)
        names = [e for e in map_ignore_entries(ignore, mt, engine, mtp=rt.mtp, config=lay.raw,
                                               vllm_version=version)
                 if not is_class_name(e)]
        if status == IgnoreStatus.SHARD_CONFLICT:
            conflicts.setdefault(rt.name, []).append(mod.name)
        elif status == IgnoreStatus.QUANTIZED and mod.fmt == "float":
            if not _ct_targeted(lay, mod.name, rt.name):
                continue  # no config group targets it: the engine leaves it unquantized
            shown = mod.name if rt.name == mod.name else f"{mod.name} (built as {rt.name})"
            if rt.kind == "experts" and engine == "vllm" and any(
                    entry_matches(e, rt.name) for e in names):
                experts_by_module.append(shown)
            elif (rt.kind == "fused" and engine == "vllm" and not rules.fused_regex
                  and any(entry_matches(e, rt.name) for e in names)):
                old_fused_regex.append(shown)
            elif rt.fused and not rt.shards and ignore_status(
                    mod.name, ignore, mt, "vllm", config=lay.raw,
                    vllm_version=version) == IgnoreStatus.IGNORED:
                fused_only.append(f"{mod.name} -> {rt.name}")
            else:
                not_ignored.setdefault(_mtp_code(lay, mod.name), []).append(shown)
        elif status != IgnoreStatus.QUANTIZED and mod.fmt != "float":
            if rt.kind == "head" and status == IgnoreStatus.NOT_QUANTIZABLE:
                unnamed_heads.append(shown_name(mod.name, rt.name))
            else:
                quant_but_ignored.append(mod.name)
        elif rt.kind == "head" and mod.fmt != "float" and status == IgnoreStatus.QUANTIZED:
            named_heads.append(mod.name)
    if named_heads and engine in ("vllm", "sglang"):
        # vLLM builds the lm_head as a ParallelLMHead, not a Linear: a compressed-tensors
        # scheme reaches it only through a target naming it, and only in recent versions.
        since = {"vllm": "vllm#37291 (March 2026; 0.20.0 and later)",
                 "sglang": "sglang#35228 (August 2026)"}
        out.append(Finding(
            "quantized-lm-head", "warning",
            f"{_few(named_heads)} is stored quantized and named in a config group's targets",
            f"{engine} loads a quantized lm_head only in versions with {since[engine]}; "
            "older ones build it as a float embedding and serve wrong tokens without an error",
            f"use a {engine} release with that change, or write the checkpoint with "
            "`mtpkit quantize --lm-head keep`", [engine], named_heads[0]))
    if unnamed_heads:
        out.append(Finding(
            "quantized-head-not-targeted", "error",
            f"{len(unnamed_heads)} heads are stored quantized but {eng} builds them "
            f"unquantized (no config group's target names the module it builds"
            f"{'' if rules.heads_by_name or engine != 'vllm' else ', and it predates 0.20.0'}"
            f"): {_few(unnamed_heads)}",
            f"{eng} builds lm_head and the DeepSeek/GLM MTP head (model.layers.{{L}}.head, not "
            "shared_head.head) as a ParallelLMHead, which a \"Linear\" target never reaches "
            "and a target reaches only by its runtime name: it is built as a float head over "
            "packed tensors (a load failure or garbage logits)",
            "add the runtime name (as shown) to the targets of the head's config group, or "
            "store the head in BF16: " + graft_cmd(path), [engine], unnamed_heads[0]))
    if experts_by_module:
        out.append(Finding(
            "ignore-experts-module-name", "error",
            f"{len(experts_by_module)} expert modules are stored unquantized and the ignore "
            f"list names the experts module, which {eng} never consults: "
            f"{_few(sorted(experts_by_module))}",
            f"{eng} decides a whole ...mlp.experts module from exactly three names, "
            "...experts.0.gate_proj, ...experts.0.up_proj and ...experts.0.down_proj "
            "(compressed-tensors MoE method selection); with \"Linear\" among the targets the "
            "experts are built quantized over float weights"
            + (": 0% draft acceptance" if any(_is_mtp_shown(lay, n) for n in experts_by_module)
               else ""),
            fix_config_cmd(path) + "   (adds the experts.0.* names)", [engine],
            "quantization_config.ignore"))
    if old_fused_regex:
        out.append(Finding(
            "ignore-fused-regex-old-vllm", "error",
            f"{len(old_fused_regex)} fused modules are stored unquantized and ignored only by a "
            f"pattern matching the fused name, which {eng} does not apply: "
            f"{_few(sorted(old_fused_regex))}",
            "vLLM before 0.30.0 excludes a fused module only by its exact name or by entries "
            "for every shard; from 0.30.0 a re: pattern matching the fused name is enough",
            fix_config_cmd(path) + "   (adds the exact fused names), or serve with vLLM "
            "0.30.0 or later", [engine], "quantization_config.ignore"))
    if stacked_mtp:
        out.append(Finding(
            "mtp-experts-stacked-unloadable", "error",
            f"the MTP layer's routed experts are stored stacked (3-D experts.gate_up_proj / "
            f"experts.down_proj): {_few(stacked_mtp)}",
            f"vLLM's {vllm_mtp_class(lay.text_model_type) or 'DeepSeek/GLM'} weight loader maps "
            "only per-expert names (experts.E.gate_proj/up_proj/down_proj.weight): loading the "
            "draft fails whatever the ignore list says",
            "store the MTP layer's experts one by one: " + graft_cmd(path).replace(
                "<the BF16 release with its MTP head>",
                "<a release that stores the MTP experts one by one>"), [engine],
            stacked_mtp[0]))
    for code, mods in not_ignored.items():
        mtp = code.startswith("mtp")
        out.append(Finding(
            code, "error",
            f"{len(mods)} {'MTP ' if mtp else ''}modules are stored unquantized but the "
            f"quantization config quantizes them in {eng}: {_few(sorted(mods))}",
            f"{eng} matches quantization_config.ignore against the modules it builds (fused "
            "qkv_proj / gate_up_proj, experts by experts.0.*, renamed prefixes); these are "
            "built quantized, find no quantized tensors and run on uninitialised memory"
            + (": 0% draft acceptance" if mtp else ""),
            fix_config_cmd(path) + "   (adds the engine's names to the ignore list)",
            [engine], "quantization_config.ignore"))
    if fused_only:
        out.append(Finding(
            "ignore-shards-not-fused", "error",
            f"the ignore list names the on-disk shards of {len(fused_only)} MTP modules that "
            f"{eng} builds fused: {_few(fused_only)}",
            f"{eng}'s model for this family (Qwen3.5's MTP, sglang#35797; MiMo-V2) declares "
            "no packed-modules mapping: only the fused name itself excludes a fused module, "
            "so the head is built quantized over BF16 weights",
            fix_config_cmd(path) + "   (adds the fused names)", [engine],
            "quantization_config.ignore"))
    for fused, mods in conflicts.items():
        out.append(Finding(
            "ignore-shard-conflict", "error",
            f"the ignore list covers some but not all shards of {fused}: "
            f"{_few(sorted(mods))}",
            f"{eng} fuses the shards (or experts.0.gate_proj/up_proj/down_proj) into one "
            "module and refuses to load when they disagree (\"Found different quantization "
            "schemes\")",
            fix_config_cmd(path) + "   (lists every shard and the fused name)", [engine],
            fused))
    if quant_but_ignored:
        out.append(Finding(
            "quantized-but-ignored", "error",
            f"{len(quant_but_ignored)} modules are stored quantized but {eng} builds them "
            f"unquantized: {_few(sorted(quant_but_ignored))}",
            "the unquantized module expects a float 'weight' and finds packed tensors: the "
            "load fails or the module is left uninitialised",
            "remove them from quantization_config.ignore, or " + graft_cmd(path),
            [engine], "quantization_config.ignore"))
    return out


def shown_name(disk: str, runtime: str) -> str:
    """A module as findings show it: its on-disk name, and the engine's when it differs."""
    return disk if disk == runtime else f"{disk} (built as {runtime})"


def _is_mtp_shown(lay: HFLayout, shown: str) -> bool:
    return is_mtp_tensor(shown.split(" ")[0] + ".w", lay.n_layer)


def _check_vllm_versions(rep, lay: HFLayout, version) -> None:
    """Which vLLM releases load this checkpoint's quantized modules as stored (the module
    rules only), and the rules applied."""
    rules = VllmRules.of(version)
    rep.facts["vllm_rules"] = rules.applied()
    ok, ok_but_heads = {}, {}
    for i, start in enumerate(_VLLM_STEPS):
        end = _VLLM_STEPS[i + 1] if i + 1 < len(_VLLM_STEPS) else None
        span = (f"{start[0]}.{start[1]}-{end[0]}.{end[1] - 1}" if end
                else f"{start[0]}.{start[1]}+")
        bad = [f.code for f in _ct_module_findings(lay, "vllm", start)
               if f.severity == "error"]
        ok[span] = not bad
        ok_but_heads[span] = not [c for c in bad if c != "quantized-head-not-targeted"]
    rep.facts["vllm_versions_ok"] = ok
    good = [s for s, v in ok.items() if v]
    # A quantized lm_head's versions are what quantized-lm-head says already.
    explained = "quantized-lm-head" in rep.codes() and all(ok_but_heads.values())
    if good and len(good) < len(ok) and not explained:
        rep.add(Finding(
            "vllm-version-range", "warning" if ok[list(ok)[-1]] else "info",
            f"the quantization config loads as stored in vLLM {', '.join(good)} only "
            f"(not {', '.join(s for s, v in ok.items() if not v)})",
            "vLLM's ignore-list rules changed across releases (docs/doctor.md, \"What vLLM "
            "loads\"); run doctor with --vllm-version X for the findings of one release",
            fix_config_cmd(lay.path) + "   (writes exact names, which every release honours)",
            ["vllm"], "quantization_config.ignore"))


def _check_ct_entries(rep, lay: HFLayout, engine: str, version=None) -> None:
    """Ignore entries that name nothing the engine builds."""
    ignore = list(lay.quant_config.get("ignore") or [])
    fix = fix_config_cmd(lay.path) + "   (rewrites the ignore list in the engine's names)"
    for entry, code, severity, what, why in entry_problems(lay, ignore, engine, version):
        rep.add(Finding(code, severity, what, why, "" if severity == "info" else fix,
                        [engine], entry))


def _runtime_modules(lay: HFLayout, engine: str, version=None):
    """What ``engine`` builds for each on-disk module it knows (others are skipped)."""
    for mod in lay.modules.values():
        try:
            yield describe(mod.name, lay.model_type, engine, config=lay.raw,
                           vllm_version=version)
        except ValueError:
            continue


def entry_problems(lay: HFLayout, ignore: list[str], engine: str, version=None) -> list[tuple]:
    """(entry, code, severity, what, why) for every ignore entry the engine does not apply."""
    if not ignore or engine not in _FUSING:
        return []
    mt = lay.model_type
    exact: set[str] = set()  # names an exact entry can match
    regex_ok: set[str] = set()  # names a re: entry is tested against
    fused_names: set[str] = set()
    leaves_nq: set[str] = set()
    fused_regex = engine == "vllm" and VllmRules.of(version).fused_regex
    for rt in _runtime_modules(lay, engine, version):
        exact.add(rt.name)
        if not rt.quantizable or rt.by_name_only:
            leaves_nq.add(rt.name.rsplit(".", 1)[-1])
        if rt.shards:
            if rt.kind == "fused" and not fused_regex:
                fused_names.add(rt.name)
            else:
                regex_ok.add(rt.name)
            exact.update(rt.shards)
            regex_ok.update(rt.shards)
        else:
            regex_ok.add(rt.name)
        parts = rt.name.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        exact |= parents
        regex_ok |= parents
    disk = set(lay.modules)
    # Names other engines build: an exact entry written for another engine (the ignore list
    # serves vLLM, SGLang and transformers at once) is not dead.
    elsewhere: set[str] = set(disk)
    for other in _FUSING:
        for rt in _runtime_modules(lay, other):
            elsewhere.add(rt.name)
            elsewhere.update(rt.shards)
    out = []
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                pat = re.compile(entry[3:])
            except re.error as e:
                out.append((entry, "ignore-regex-invalid", "error",
                            f"ignore entry {entry!r} is not a valid regular expression ({e})",
                            "it matches nothing, so the modules it was meant for are "
                            "quantized"))
                continue
            if any(pat.match(n) for n in regex_ok):
                continue
            renamed = _renamed_prefix_hint(lay, pat, engine, version)
            if renamed:
                out.append((entry, "ignore-regex-renamed-prefix", "warning",
                            f"ignore entry {entry!r} matches on-disk names under a prefix "
                            f"{engine} renames ({renamed}); it matches nothing {engine} "
                            "builds",
                            "vLLM rewrites exact ignore entries with the class's name map "
                            "but never re: patterns; the modules it was meant to keep "
                            "unquantized are built quantized"))
                continue
            hint = _regex_hint(pat, fused_names, disk, regex_ok, exact)
            out.append((entry, "ignore-regex-no-match", "warning",
                        f"ignore entry {entry!r} matches no module {engine} builds{hint}",
                        "re: patterns are matched with Python re.match (anchored at the "
                        f"start) against {engine}'s module names; the modules it was meant "
                        "to keep unquantized are built quantized"))
            continue
        if is_class_name(entry):
            out.append((entry, "ignore-class-name", "info",
                        f"ignore entry {entry!r} is a class name; {engine} does not match "
                        "class names in ignore (compressed-tensors does)", ""))
            continue
        mapped = map_ignore_entries([entry], mt, engine, config=lay.raw,
                                    mtp=is_mtp_tensor(entry + ".w", lay.n_layer),
                                    vllm_version=version)[0]
        if mapped in exact or entry in exact:
            continue
        if "." not in entry and entry in leaves_nq:
            continue  # e.g. "lm_head": never quantized by the engine anyway
        if entry in elsewhere and entry not in disk:
            continue  # another engine's name for a module that exists
        hint = ""
        if entry in disk:
            # An on-disk name serves llm-compressor / transformers; it is only a problem for
            # this engine when the engine still builds that module quantized.
            try:
                if ignore_status(entry, ignore, mt, engine, config=lay.raw,
                                 targets=ct_targets(lay), vllm_version=version) in (
                        IgnoreStatus.IGNORED, IgnoreStatus.NOT_QUANTIZABLE):
                    continue
            except ValueError:
                pass
            try:
                hint = (f"; {engine} builds it as "
                        f"{describe(entry, mt, engine, config=lay.raw, vllm_version=version).name}")
            except ValueError:
                pass
        out.append((entry, "ignore-matches-nothing", "warning",
                    f"ignore entry {entry!r} names no module {engine} builds{hint}",
                    f"{engine} compares ignore entries with the names of the modules it "
                    "builds (after fusing and renaming); this one keeps nothing unquantized"))
    return out


def _renamed_prefix_hint(lay: HFLayout, pat, engine: str, version) -> str:
    """"model.language_model. -> ..." when the pattern matches on-disk names only under a
    prefix the engine's name map rewrites (a Qwen3.5 class)."""
    if engine != "vllm":
        return ""
    from ..checkpoint.runtime_names import _prefix_map

    for hf, ours in _prefix_map(lay.model_type, lay.raw, VllmRules.of(version)):
        if any(n.startswith(hf) and pat.match(n) for n in lay.modules):
            return f"{hf} -> {ours}"
    return ""


def _regex_hint(pat, fused, disk, regex_ok, exact) -> str:
    if any(pat.match(n) for n in fused):
        return (" (it matches a fused module's name, but before vLLM 0.30.0 a fused module "
                "is excluded only by its exact name or by patterns matching every shard)")
    if any(pat.match(n) for n in disk):
        return " (it matches the on-disk names, not the names the engine builds)"
    if any(pat.search(n) for n in regex_ok | exact):
        return " (re.match anchors at the start of the name: prefix the pattern with .*)"
    return ""


def _fp8_skipped(lay: HFLayout):
    """vLLM's Fp8Config skip test (exact mode) on runtime names: the name listed, every
    shard of a fused module listed, or (routed experts) an entry holding the name."""
    q = lay.quant_config
    skip = list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
    entries = set(map_ignore_entries(skip, lay.model_type, "vllm", config=lay.raw))
    shards: dict[str, tuple[str, ...]] = {}
    for mod in _linear_modules(lay):
        try:
            rt = describe(mod.name, lay.model_type, "vllm", config=lay.raw)
        except ValueError:
            continue
        shards[rt.name] = rt.shards if rt.kind == "fused" else ()

    def skipped(name: str) -> bool:
        if name in entries or name.endswith(".experts") and any(name in e for e in entries):
            return True
        return bool(shards.get(name)) and all(s in entries for s in shards[name])
    return skipped


def _check_skip_list(rep, lay: HFLayout, engine: str, skipped, what: str) -> None:
    mt, path = lay.model_type, lay.path
    by_code: dict[str, list[str]] = {}
    for mod in _linear_modules(lay):
        if mod.fmt != "float":
            continue
        try:
            rt = describe(mod.name, mt, engine, config=lay.raw)
        except ValueError:
            continue
        if not rt.quantizable or rt.by_name_only or skipped(rt.name):
            continue
        by_code.setdefault(_mtp_code(lay, mod.name), []).append(rt.name)
    for code, mods in by_code.items():
        rep.add(Finding(
            code, "error",
            f"{len(mods)} modules are stored unquantized but {engine} builds them quantized "
            f"({what} does not cover them): {_few(sorted(mods))}",
            "they find no quantized tensors and run on uninitialised memory",
            fix_config_cmd(path), [engine], "quantization_config"))


# ---------------------------------------------------------------------------------------------
# GGUF files


def gguf_facts(path: Path) -> dict:
    """Metadata and tensor layout of a GGUF file (memory-mapped; no tensor is read)."""
    from gguf import GGUFReader

    from ..checkpoint.gguf import open_gguf

    open_gguf(path)  # validates the file (magic, truncation) with clear errors
    reader = GGUFReader(path, "r")
    fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    md = {}
    for name, f in fields.items():
        try:
            md[name] = f.contents()
        except Exception:  # a field the gguf package cannot decode: leave it out
            continue
    blocks: dict[int, set[str]] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        if m := re.match(r"blk\.(\d+)\.(.+)", t.name):
            blocks.setdefault(int(m[1]), set()).add(m[2])
    nextn_blocks = sorted(b for b, names in blocks.items()
                          if any(n.startswith("nextn.") for n in names))
    trunk = sorted(b for b in blocks if b not in nextn_blocks)
    return {"arch": arch, "md": md, "blocks": blocks, "types": types,
            "nextn_blocks": nextn_blocks, "trunk_blocks": trunk}


def _gguf_checks(path: Path, engines: list[str]) -> Report:
    f = gguf_facts(path)
    arch, md = f["arch"], f["md"]
    rep = Report(str(path), "gguf", arch, engines)
    block_count = md.get(f"{arch}.block_count")
    nextn_key = f"{arch}.nextn_predict_layers"
    nextn = md.get(nextn_key)
    nb, trunk = f["nextn_blocks"], f["trunk_blocks"]
    n_trunk = (max(trunk) + 1) if trunk else 0
    rep.facts.update({"block_count": block_count, nextn_key: nextn,
                      "nextn_blocks": nb, "trunk_blocks": n_trunk})
    if not md.get("tokenizer.ggml.tokens"):
        rep.add(Finding(
            "gguf-tokenizer-missing", "error",
            f"{path.name} has no tokenizer (tokenizer.ggml.tokens)",
            "llama.cpp and mtpkit read the tokenizer from the GGUF metadata; without it the "
            "model cannot be run", "convert again with the tokenizer (llama.cpp's "
            "convert_hf_to_gguf.py reads it from the HF folder)", engines, "tokenizer"))
    if nb:
        k = len(nb)
        if not nextn:
            rep.add(Finding(
                "gguf-nextn-key-missing", "error",
                f"blk.{{{_few(nb)}}}.nextn.* tensors are present but {nextn_key} is "
                f"{'absent' if nextn is None else nextn}",
                "llama.cpp builds MTP layers from this key; without it the nextn blocks are "
                "read as trunk layers (or rejected) and nothing is drafted",
                fix_config_cmd(path), engines, nextn_key))
        if nb != list(range(n_trunk, n_trunk + k)):
            rep.add(Finding(
                "gguf-block-count", "error",
                f"nextn blocks are {nb} but the trunk has {n_trunk} blocks; MTP blocks must "
                f"follow the trunk as blk.{n_trunk}..{n_trunk + k - 1}",
                "llama.cpp puts the MTP layers at n_layer..block_count-1", graft_cmd(path),
                engines, "blk.N.nextn"))
        elif block_count != n_trunk + k:
            rep.add(Finding(
                "gguf-block-count", "error",
                f"{arch}.block_count is {block_count} but the file holds {n_trunk} trunk "
                f"blocks and {k} nextn block(s): it must be {n_trunk + k}",
                "llama.cpp counts the MTP layers in block_count (n_layer = block_count - "
                "nextn_predict_layers); a wrong count shifts every layer",
                fix_config_cmd(path), engines, f"{arch}.block_count"))
        elif nextn and int(nextn) != k:
            rep.add(Finding(
                "mtp-config-mismatch", "error",
                f"{nextn_key}={nextn} but {k} nextn block(s) are stored",
                "llama.cpp derives the trunk depth from it", fix_config_cmd(path), engines,
                nextn_key))
        _gguf_precision(rep, path, f)
    else:
        if nextn:
            rep.add(Finding(
                "gguf-nextn-tensors-missing", "error",
                f"{nextn_key}={nextn} but no blk.N.nextn.* tensors are stored",
                "llama.cpp expects the MTP layers' tensors and fails to load, or drafts from "
                "nothing", graft_cmd(path), engines, "blk.N.nextn"))
        elif arch in GGUF_NATIVE_MTP:
            rep.add(Finding(
                "mtp-missing", "error",
                f"no nextn (MTP) tensors in {path.name}; {arch} releases ship an MTP head",
                "the converter or quantizer dropped the MTP layers: llama.cpp cannot "
                "speculate with them",
                graft_cmd(path).replace("<the BF16 release with its MTP head>",
                                        "<a GGUF or HF release with the MTP head>"),
                engines, "blk.N.nextn"))
        else:
            rep.add(Finding("mtp-none", "info", f"{path.name} has no MTP (nextn) layers",
                            "", "", engines, "blk.N.nextn"))
    if "mtpkit" in engines:
        from ..checkpoint.gguf import _ARCHS

        if arch not in _ARCHS:
            rep.add(Finding(
                "unknown-model-type", "info",
                f"mtpkit does not read GGUF architecture {arch!r}", "", "", ["mtpkit"], arch))
    return rep


def _gguf_precision(rep, path: Path, f) -> None:
    import gguf

    low = []
    for b in f["nextn_blocks"]:
        for base in sorted(f["blocks"][b]):
            name = f"blk.{b}.{base}"
            qname = f["types"].get(name)
            if qname is None or not base.endswith("weight"):
                continue
            qt = gguf.GGMLQuantizationType[qname]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            if size * 8 / block <= 4.6:  # Q4_0 is 4.5 bits per weight, Q4_K 4.5
                low.append(f"{name} ({qname})")
    if low:
        rep.add(Finding(
            "int4-mtp-head", "warning",
            f"{len(low)} MTP tensors are stored at about 4 bits or less: {_few(low)}",
            "a 4-bit draft head loses most of its acceptance; it is small, so Q8_0 or BF16 "
            "costs little",
            f"mtpkit graft --from <a Q8_0/BF16 GGUF with the head> --into {path} --out "
            f"{_out_name(path, 'mtp')} --mtp-precision keep", subject="blk.N.nextn"))
