"""Doctor rules for MLX checkpoints: what vllm-mlx 0.6.0 and mlx-lm 0.32 do with an MTP head.

Read from vllm-mlx's ``vllm_mlx/patches/qwen3_5_mtp.py`` and ``qwen3_next_mtp.py`` and from
mlx-lm's ``models/qwen3_5.py`` / ``qwen3_next.py`` (``sanitize``) and ``utils.py``
(``load_model``); docs/mlx.md lists the rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ..checkpoint.errors import CheckpointError
from ..quant.mlx import (
    HIDDEN_STATE_MODE,
    MANIFEST,
    MTP_DIR_FILE,
    MTP_FILE,
    QWEN3_NEXT_HEAD,
    mtp_relative,
)
from .findings import Finding, Report

MLX_ENGINES = ("vllm-mlx", "mlx-lm")
_NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                  "k_norm.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight",
                  "norm.weight")
_MODES = ("post_norm", "pre_norm")


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def is_mlx_checkpoint(path) -> bool:
    """An MLX folder: mlx-lm's ``quantization`` config, a vllm-mlx head file, or weights
    saved with MLX's ``format`` metadata."""
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").exists():
        return False
    cfg = _config(p)
    q = cfg.get("quantization")
    if isinstance(q, dict) and "bits" in q and "group_size" in q:
        return True
    if (p / MTP_DIR_FILE).exists():
        return True
    for f in sorted(p.glob("*.safetensors"))[:1]:
        try:
            with safe_open(str(f), framework="pt") as h:
                return (h.metadata() or {}).get("format") == "mlx"
        except Exception:  # an unreadable file is the HF checks' business
            return False
    return False


def _text(cfg: dict) -> dict:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _head_file(path: Path, family: str) -> Path | None:
    names = [MTP_FILE] if family == "qwen3_next" else [MTP_DIR_FILE, MTP_FILE]
    for n in names:
        if (path / n).exists():
            return path / n
    return None


def _layers_declared(cfg: dict, family: str) -> int:
    tc = _text(cfg)
    if family == "qwen3_next":
        return int(cfg.get("num_nextn_predict_layers") or 0)
    return int(tc.get("mtp_num_hidden_layers") or tc.get("num_nextn_predict_layers")
               or cfg.get("num_nextn_predict_layers") or 0)


def _graft(path: Path) -> str:
    return (f"mtpkit graft --from <the BF16 HF release> --into {path} "
            f"--out {str(path).rstrip('/')}-mtp")


def diagnose_mlx(path, engines=None) -> Report:
    """Static checks of an MLX checkpoint folder for vllm-mlx and mlx-lm."""
    p = Path(path)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{p}: no config.json; pass the MLX checkpoint folder")
    wanted = [e for e in (engines or MLX_ENGINES) if e in MLX_ENGINES]
    cfg = _config(p)
    family = cfg.get("model_type") or ""
    rep = Report(str(p), "mlx", family, list(engines or MLX_ENGINES))
    q = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else None
    rep.facts["quantization"] = {k: v for k, v in (q or {}).items() if not isinstance(v, dict)}
    if "mlx-lm" in wanted:
        rep.add(Finding(
            "mlx-lm-no-mtp", "info", "mlx-lm runs this model without its MTP head",
            "mlx-lm builds no MTP modules (its Qwen3.5 sanitize drops every mtp. tensor); "
            "only vllm-mlx injects the head", "serve it with vllm-mlx to draft with the head",
            ["mlx-lm"]))
        if family == "qwen3_next" and (p / MTP_FILE).exists():
            rep.add(Finding(
                "mlx-lm-mtp-file-breaks-load", "error",
                f"{MTP_FILE} in a converted Qwen3-Next folder: mlx_lm.load refuses it "
                "(\"parameters not in model\")",
                "mlx-lm reads every model*.safetensors and its Qwen3-Next sanitize drops "
                "mtp.* only from unconverted checkpoints, then loads strictly",
                f"move {MTP_FILE} out of the folder for mlx-lm (vllm-mlx loads it with "
                "strict=False and needs it there)", ["mlx-lm"], MTP_FILE))
    if "vllm-mlx" in wanted:
        _vllm_mlx(rep, p, cfg, family, q)
    return rep


def _vllm_mlx(rep: Report, p: Path, cfg: dict, family: str, q: dict | None) -> None:
    eng = ["vllm-mlx"]
    declared = _layers_declared(cfg, family)
    head = _head_file(p, family)
    rep.facts["mtp_file"] = str(head.relative_to(p)) if head else None
    rep.facts["mtp_layers_declared"] = declared
    if family not in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        rep.add(Finding("mlx-no-mtp-family", "info",
                        f"vllm-mlx injects MTP heads into qwen3_5 / qwen3_5_moe / qwen3_next "
                        f"only, not {family or 'this model'}", "", "", eng))
        return
    if head is None and family == "qwen3_next":
        rep.add(Finding("mlx-qwen3-next-head", "warning", QWEN3_NEXT_HEAD,
                        "so mtpkit writes no head for it: vllm-mlx serves without MTP",
                        "serve Qwen3-Next's MTP with vLLM or mtpkit", eng, MTP_FILE))
        return
    if head is None:
        elsewhere = [f.name for f in p.glob("*.safetensors") if _has_mtp(f)]
        where = MTP_FILE if family == "qwen3_next" else f"{MTP_DIR_FILE} or {MTP_FILE}"
        hint = f"; MTP tensors sit in {', '.join(elsewhere)}, which it does not open" \
            if elsewhere else ""
        rep.add(Finding(
            "mlx-mtp-file-missing", "error", f"no MTP head file ({where}){hint}",
            "vllm-mlx reads the head from that file alone (mlx-lm's conversion drops mtp.*): "
            "without it speculative decoding is off", _graft(p), eng, where))
        return
    if family == "qwen3_next":
        rep.add(Finding("mlx-qwen3-next-head", "warning", QWEN3_NEXT_HEAD,
                        "its drafts then disagree with the trunk far more than the head's "
                        "own acceptance", "serve Qwen3-Next's MTP with vLLM or mtpkit", eng,
                        MTP_FILE))
    rel = str(head.relative_to(p))
    with safe_open(str(head), framework="pt") as h:
        names = list(h.keys())
        prefixes = ("mtp.",) if family == "qwen3_next" else ("mtp.", "language_model.mtp.")
        read = [n for n in names if n.startswith(prefixes)]
        if not read:
            seen = sorted({n.split(".layers.")[0].split(".fc")[0] for n in names
                           if mtp_relative(n) is not None})
            rep.add(Finding(
                "mlx-mtp-prefix", "error",
                f"{rel}: no tensor under {' or '.join(prefixes)}"
                + (f" (they are under {', '.join(s + '.' for s in seen)})" if seen else ""),
                "vllm-mlx keeps only names with those prefixes and loads the rest with "
                "strict=False: the head runs on its initial weights",
                f"rename the keys, or rebuild the file: {_graft(p)}", eng, rel))
            return
        rel_names = {mtp_relative(n): n for n in read}
        if not declared:
            key = "num_nextn_predict_layers" if family == "qwen3_next" \
                else "text_config.mtp_num_hidden_layers"
            rep.add(Finding("mlx-mtp-config-missing", "error",
                            f"{rel} is present but {key} is absent or 0",
                            "vllm-mlx skips MTP when the config declares no layer",
                            f"set {key} to 1 in config.json", eng, key))
        _check_experts(rep, rel, rel_names)
        _check_triplets(rep, rel, rel_names, h, q)
        _check_norms(rep, p, head, rel, rel_names, h, family)
    if family != "qwen3_next":
        mode = _text(cfg).get("mtp_hidden_state_mode", cfg.get("mtp_hidden_state_mode"))
        rep.facts["mtp_hidden_state_mode"] = mode
        if mode is None:
            rep.add(Finding(
                "mlx-hidden-state-mode", "warning", "mtp_hidden_state_mode is not set",
                "vllm-mlx then assumes post_norm, right for Qwen3.5's released heads but a "
                "guess for any other (a head trained on pre-norm states accepts little)",
                f"set text_config.mtp_hidden_state_mode to \"{HIDDEN_STATE_MODE}\" (the state "
                "the head was trained on)", eng, "mtp_hidden_state_mode"))
        elif mode not in _MODES:
            rep.add(Finding(
                "mlx-hidden-state-mode", "error", f"mtp_hidden_state_mode is {mode!r}",
                f"vllm-mlx accepts {' or '.join(_MODES)} and falls back to post_norm",
                f"set it to \"{HIDDEN_STATE_MODE}\"", eng, "mtp_hidden_state_mode"))


def _has_mtp(f: Path) -> bool:
    try:
        with safe_open(str(f), framework="pt") as h:
            return any(mtp_relative(n) is not None for n in h.keys())
    except Exception:  # unreadable files are reported elsewhere
        return False


def _check_experts(rep: Report, rel: str, rel_names: dict) -> None:
    per_expert = sorted(n for r, n in rel_names.items() if ".experts." in r
                        and r.split(".experts.")[1].split(".")[0].isdigit())
    if per_expert:
        rep.add(Finding(
            "mlx-mtp-experts-unloadable", "error",
            f"{rel}: {len(per_expert)} MTP expert tensors stored one expert at a time "
            f"({per_expert[0]}, ...)",
            "vllm-mlx's head is mlx-lm's decoder layer, whose experts are stacked "
            "switch_mlp.{gate,up,down}_proj (or fused experts.gate_up_proj); per-expert names "
            "are dropped by its strict=False load", f"rebuild the file: {_graft(Path(rep.path))}",
            ["vllm-mlx"], rel))


def _check_triplets(rep: Report, rel: str, rel_names: dict, h, q: dict | None) -> None:
    scaled = [r for r in rel_names if r and r.endswith(".scales")]
    if not scaled:
        rep.facts["mtp_precision"] = "float"
        return
    if not q:
        rep.add(Finding("mlx-mtp-bits-mismatch", "error",
                        f"{rel}: quantized MTP tensors in a checkpoint whose config has no "
                        "quantization", "vllm-mlx then dequantizes them as 4-bit, group 64",
                        _graft(Path(rep.path)), ["vllm-mlx"], rel))
        return
    bits, group = int(q.get("bits", 4)), int(q.get("group_size", 64))
    wrong, low = [], []
    for r in scaled:
        base = r[: -len(".scales")]
        wname = next((rel_names[c] for c in (f"{base}.weight", base) if c in rel_names), None)
        if wname is None:
            continue
        pshape = h.get_slice(wname).get_shape()
        sshape = h.get_slice(rel_names[r]).get_shape()
        b = pshape[-1] * 32 / (sshape[-1] * group)
        if b != bits:
            wrong.append(base)
        elif bits <= 4:
            low.append(base)
    rep.facts["mtp_precision"] = f"{bits}-bit" if not wrong else "mixed"
    if wrong:
        rep.add(Finding(
            "mlx-mtp-bits-mismatch", "error",
            f"{rel}: {len(wrong)} MTP modules quantized with other bits or group size than the "
            f"trunk ({bits}-bit, group {group}): {', '.join(wrong[:4])}",
            "vllm-mlx dequantizes every head triplet with the trunk's bits and group size: "
            "these come out as garbage", f"rewrite the head in BF16: {_graft(Path(rep.path))}",
            ["vllm-mlx"], rel))
    if low:
        rep.add(Finding(
            "mlx-mtp-low-bits", "warning",
            f"{rel}: {len(low)} MTP modules stored at {bits} bits",
            "a 4-bit Qwen3.5 head was reported to accept 0% in vllm-mlx against 78-85% in "
            "BF16 (vllm-mlx #471)", f"graft the BF16 head: {_graft(Path(rep.path))}",
            ["vllm-mlx"], rel))


def _check_norms(rep: Report, p: Path, head: Path, rel: str, rel_names: dict, h,
                 family: str) -> None:
    means = {}
    for r, n in rel_names.items():
        if r and r.endswith(_NORM_SUFFIXES):
            t = h.get_tensor(n)
            if t.ndim == 1:
                means[r] = float(t.float().mean())
    centred = sorted(r for r, m in means.items() if m < 0.5)
    if not means:
        return
    declared = _manifest_gamma(head)
    rep.facts["mtp_norms"] = "mlx_gamma (manifest)" if declared else "guessed per weight"
    fix = f"rebuild the head file: {_graft(p)}"
    if family == "qwen3_next" and centred:
        why = "vllm-mlx's Qwen3-Next loader uses the stored values as MLX gammas, with no +1"
    elif declared and centred:
        why = ("manifest.json declares MLX gammas, so vllm-mlx adds nothing: these norms "
               "scale by w instead of 1 + w")
    elif not declared and centred and len(centred) < len(means):
        why = ("without a manifest vllm-mlx adds 1 to each norm whose mean is below 0.5 and "
               "keeps the others: the head comes out in two conventions")
    else:
        return
    rep.add(Finding(
        "mlx-mtp-norm-convention", "error",
        f"{rel}: {len(centred)} of {len(means)} MTP norm weights look zero-centred (HF "
        f"convention, mean < 0.5): {', '.join(centred[:4])}", why, fix, ["vllm-mlx"], rel))


def _manifest_gamma(head: Path) -> bool:
    try:
        m = json.loads(head.with_name("manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(m, dict) and all(m.get(k) == v for k, v in MANIFEST.items())


def graft_into_mlx(src, dst, out, precision: str = "keep", engines=None):
    """Write ``out``: a copy of the MLX checkpoint ``dst`` with the MTP head of the HF folder
    ``src`` where vllm-mlx loads it (BF16 with ``keep``; the trunk's bits with ``match``)."""
    import shutil
    import tempfile

    from ..checkpoint import is_gguf, open_checkpoint
    from ..outputs import publish
    from ..quant.mlx import mlx_head_tensors, set_head_config, write_head
    from .graft import GraftResult

    src, dst, out = Path(src), Path(dst), Path(out)
    if is_gguf(src) or not src.is_dir():
        raise ValueError("graft into an MLX checkpoint takes the head from an HF folder (the "
                         "BF16 release); a GGUF head is not supported here")
    cfg = _config(dst)
    family = cfg.get("model_type") or ""
    if family == "qwen3_next":
        raise ValueError(f"no head grafted: {QWEN3_NEXT_HEAD}")
    if family not in ("qwen3_5", "qwen3_5_moe"):
        raise ValueError(f"vllm-mlx injects MTP heads into qwen3_5 / qwen3_5_moe; {dst} is "
                         f"{family or 'of unknown model_type'}")
    ck = open_checkpoint(src)
    src_family = (ck.raw_config.get("model_type") or "").removesuffix("_text")
    if src_family != family:
        raise ValueError(f"{src} is {src_family or 'of unknown model_type'}, {dst} is {family}: "
                         "graft the head of the same model's release")
    head = {mtp_relative(n): ck.get_tensor(n) for n in ck.tensor_names()
            if mtp_relative(n) is not None}
    if not head:
        raise CheckpointError(f"{src}: no MTP tensors (mtp.*) to graft")
    tc = _text(cfg)
    hidden = int(tc.get("hidden_size") or 0)
    fc = head.get("fc.weight")
    if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
        raise CheckpointError(
            f"{src}: mtp.fc.weight is {None if fc is None else tuple(fc.shape)}, {dst} needs "
            f"({hidden}, {2 * hidden}): the head belongs to another model")
    q = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else None
    mode = {"keep": "bf16", "match": "same"}[precision]
    tensors, rel = mlx_head_tensors(head, family, int(tc.get("num_experts") or 0), mode, q)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    changes = []
    try:
        shutil.copytree(dst, tmp, dirs_exist_ok=True)
        for old in (tmp / MTP_FILE, tmp / MTP_DIR_FILE):
            if old.exists():
                old.unlink()
                changes.append(f"removed the old head file {old.relative_to(tmp)}")
        write_head(tmp, tensors, rel)
        n = len({k.split(".")[1] for k in head if k.startswith("layers.")}) or 1
        set_head_config(cfg, n)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))
        changes.append(f"wrote {rel} ({len(tensors)} tensors, "
                       f"{'BF16' if mode == 'bf16' else 'quantized like the trunk'}) and its "
                       "manifest.json (norms as MLX gammas)")
        changes.append(f"set mtp_num_hidden_layers = {n}, mtp_hidden_state_mode = "
                       f"{HIDDEN_STATE_MODE}")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mlx_engines = [e for e in engines or () if e in MLX_ENGINES] or None
    return GraftResult(out, changes, diagnose_mlx(out, mlx_engines))
