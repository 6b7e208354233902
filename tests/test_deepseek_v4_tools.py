"""DeepSeek-V4 as released: block-scaled FP8 (e4m3, ue8m0 scales per 128x128 block) with
FP4 routed experts (e2m1 two to an int8, a ue8m0 scale per 32 inputs of a row), scales named
``.scale``, the MTP layers ``mtp.{i}.*`` quantized alike. The tests quantize a tiny float
model in that encoding and compare mtpkit's load against the float model built from a slow
reference dequantization of the same tensors."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import DSV4_MTP_LAYERS, VOCAB, write_deepseek_v4

from mtpkit.checkpoint.errors import CheckpointError
from mtpkit.engine.loader import load_model

RELEASE_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                 "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
# What the release stores FP8 (vLLM builds these with the quantization config) and FP4.
_FP8 = re.compile(r"^(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wkv|wq_b|wo_a|wo_b|indexer\.wq_b)"
                  r"|ffn\.shared_experts\.w[123]|[eh]_proj)\.weight$")
_FP4 = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale"}


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0): a ue8m0 scale."""
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0 ** -100))))


def _fp8_block(w: torch.Tensor, block=(128, 128)):
    n, k = w.shape
    br, bc = block
    gr, gc = -(-n // br), -(-k // bc)
    pad = torch.zeros(gr * br, gc * bc)
    pad[:n, :k] = w
    amax = pad.abs().reshape(gr, br, gc, bc).amax(dim=(1, 3))
    scale = _pow2_at_least(amax / 448.0)
    full = scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fp4_rows(w: torch.Tensor):
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    scale = _pow2_at_least(groups.abs().amax(-1) / 6.0)
    v = groups / scale[..., None]
    mag = (v.abs()[..., None] - _E2M1).abs().argmin(-1)
    codes = (mag | ((v < 0).long() << 3)).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def _ref_dequant(w: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Element by element, from the encodings' definitions."""
    s = [[2.0 ** (int(b) - 127) for b in row] for row in scale.view(torch.uint8).tolist()]
    if w.dtype == torch.int8:
        def e2m1(c):
            e, m = (c >> 1) & 3, c & 1
            mag = m * 0.5 if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1)
            return -mag if c & 8 else mag
        rows = []
        for i, row in enumerate(w.view(torch.uint8).tolist()):
            vals = [e2m1(c) for b in row for c in (b & 15, b >> 4)]
            rows.append([v * s[i][j // 32] for j, v in enumerate(vals)])
        return torch.tensor(rows)
    vals = w.float().tolist()
    br, bc = block
    return torch.tensor([[v * s[i // br][j // bc] for j, v in enumerate(row)]
                         for i, row in enumerate(vals)])


def _release_names(tensors: dict) -> dict:
    return {_TOP.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def release(tmp_path_factory, dsv4_float):
    """(release folder, float folder of its reference dequantization, the float originals)."""
    src = dsv4_float
    original = _release_names(load_file(src / "model.safetensors"))
    original.update(load_file(src / "model_mtp.safetensors"))
    quant, deq = {}, {}
    for name, w in original.items():
        base = name[: -len(".weight")]
        if _FP8.match(name) or _FP4.match(name):
            q, s = (_fp8_block if _FP8.match(name) else _fp4_rows)(w)
            quant[name], quant[base + ".scale"] = q, s
            deq[name] = _ref_dequant(q, s)
        else:
            quant[name] = deq[name] = w
    config = json.loads((src / "config.json").read_text())
    out, flt = tmp_path_factory.mktemp("dsv4_release"), tmp_path_factory.mktemp("dsv4_deq")
    for folder, tensors, cfg in ((out, quant, {**config, "expert_dtype": "fp4",
                                              "quantization_config": RELEASE_QUANT}),
                                 (flt, deq, config)):
        trunk = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
        save_file(trunk, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        save_file(mtp, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        index = {k: ("model-00002-of-00002.safetensors" if k.startswith("mtp.")
                     else "model-00001-of-00002.safetensors") for k in tensors}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, flt, original


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False)


def _assert_lossless(model, seed: int) -> None:
    """Greedy output with MTP (k = 1..3, drafts made) equals output without."""
    from mtpkit.engine.generate import Engine, Result
    from mtpkit.engine.sampling import SamplingParams

    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine = Engine(model)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = list(engine.generate(ids, p, 0))
    for k in (1, 2, 3):
        res = Result()
        assert list(engine.generate(ids, p, k, result=res)) == plain, k
        assert res.metrics.num_drafts > 0

def test_release_loads_as_its_reference_dequantization(release):
    """Trunk logits and every MTP layer's logits of the FP8 / FP4 release equal those of the
    float model holding the reference dequantization; the weights are really quantized."""
    out, flt, original = release
    got, want = _load(out), _load(flt)
    assert not got.report.unexpected, got.report.unexpected
    assert not any("unquantized" in n for n in got.report.notes), got.report.notes
    gm, wm = got.model, want.model
    assert gm.mtp is not None and len(gm.mtp.layers) == DSV4_MTP_LAYERS
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        g, w = gm(ids), wm(ids)
        assert torch.equal(gm.logits(g.hidden), wm.logits(w.hidden))
        gs, ws = g.pre_norm, w.pre_norm
        for i in range(DSV4_MTP_LAYERS):
            t = ids.shape[1] - 1 - i
            go = gm.mtp_forward(ids[:, 1 + i: 1 + i + t], gs[:, :t], i, 0, None)
            wo = wm.mtp_forward(ids[:, 1 + i: 1 + i + t], ws[:, :t], i, 0, None)
            assert torch.equal(gm.logits(go.hidden), wm.logits(wo.hidden)), i
            gs, ws = go.pre_norm, wo.pre_norm
    # What was loaded is the quantized weight, not the float original.
    expert = gm.model.layers[2].mlp.experts[1].down_proj.weight
    e_proj = gm.mtp.layers[1].e_proj.weight
    assert not torch.equal(expert, original["layers.2.ffn.experts.1.w2.weight"])
    assert not torch.equal(e_proj, original["mtp.1.e_proj.weight"])
    assert (expert - original["layers.2.ffn.experts.1.w2.weight"]).abs().max() < 0.5


def test_release_scales_without_their_config_are_refused(release, tmp_path):
    out = release[0]
    for f in out.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config"):
        _load(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"fmt": "e5m2"}, "fmt"),
])
def test_other_quantization_configs_are_refused(release, change, message):
    from mtpkit.models.config import ConfigError
    from mtpkit.models.deepseek_v4 import DeepseekV4Config

    d = json.loads((release[0] / "config.json").read_text())
    d["quantization_config"] = {**d["quantization_config"], **change}
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_hf_config(d)


def test_fp4_nibbles_and_scales_decode_as_the_encoding_defines():
    """Every e2m1 code in both nibbles, against the sign / exponent / mantissa definition."""
    from mtpkit.quant.formats import read_module, scan

    codes = torch.arange(16).repeat(4)  # 64 inputs: two groups a row
    w = torch.stack([codes, codes.flip(0)]).to(torch.uint8)
    packed = (w[:, 0::2] | (w[:, 1::2] << 4)).view(torch.int8)
    scale = torch.tensor([[0.5, 4.0], [1.0, 2.0 ** -3]]).to(torch.float8_e8m0fnu)

    class Ckpt:
        path, config = "mem", {"quantization_config": RELEASE_QUANT}
        tensors = {"x.weight": packed, "x.scale": scale}

        def tensor_names(self):
            return list(self.tensors)

        def get_tensor(self, n):
            return self.tensors[n]

    ckpt = Ckpt()
    plan = scan(ckpt)
    got = read_module(plan.modules["x"], ckpt, plan.config).dequantize()
    assert torch.equal(got, _ref_dequant(packed, scale))
    assert math.isclose(float(got[0, 7]), 6.0 * 0.5) and float(got[0, 9]) == -0.5 * 0.5


def _copy(src, deq, dst, keep_float_mtp: bool = False, quant: dict | None = None):
    """The release folder again; keep_float_mtp: its MTP layers as the float reference's
    (an export that dequantized them) under the same quantization config."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if keep_float_mtp:
        mtp_file = "model-00002-of-00002.safetensors"
        save_file(load_file(deq / mtp_file), dst / mtp_file, metadata={"format": "pt"})
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                               if not (k.startswith("mtp.") and k.endswith(".scale"))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    if quant is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quant
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_doctor_on_the_release(release, tmp_path):
    """The release: its MTP layers found, stored FP8 / FP4, nothing wrong. The same with
    float MTP layers under the release's config: vLLM's draft builds them FP8 (the
    runtime names say which), an error until ignored_layers lists those runtime names;
    listing the on-disk mtp.* names does not help (vLLM renames them model.mtp.*)."""
    from mtpkit.checkpoint.runtime_names import ignore_list_for
    from mtpkit.doctor import diagnose

    out, flt, _ = release
    rep = diagnose(out, engines=["vllm", "mtpkit"])
    assert rep.facts["mtp_layers_stored"] == DSV4_MTP_LAYERS and rep.exit_code == 0, \
        rep.to_json()
    bad = _copy(out, flt, tmp_path / "a", keep_float_mtp=True)
    codes = diagnose(bad, engines=["vllm", "mtpkit"]).codes()
    assert "mtp-unquantized-not-ignored" in codes, codes
    cfg = json.loads((out / "config.json").read_text())
    disk = sorted({k.rpartition(".")[0] for k in load_file(
        flt / "model-00002-of-00002.safetensors") if _FP8.match(k) or _FP4.match(k)})
    for entries, fixed in ((disk, False),
                           (ignore_list_for(disk, "deepseek_v4", config=cfg), True)):
        d = _copy(out, flt, tmp_path / f"b{int(fixed)}", keep_float_mtp=True,
                  quant={**RELEASE_QUANT, "ignored_layers": entries})
        codes = diagnose(d, engines=["vllm", "mtpkit"]).codes()
        assert ("mtp-unquantized-not-ignored" not in codes) == fixed, (fixed, codes)
    # mtpkit itself loads the float MTP layers as stored, and says vLLM would not.
    loaded = _load(bad)
    assert loaded.model.mtp is not None
    assert any("unquantized" in n and "mtp." in n for n in loaded.report.notes)


# -- quantize: compressed-tensors from a float DeepSeek-V4 ------------------------------------

_DOCTOR_BAD = {"mtp-missing", "mtp-unquantized-not-ignored", "unquantized-not-ignored",
               "ignore-shard-conflict", "quantized-but-ignored", "ignore-matches-nothing",
               "ignore-regex-no-match", "mtp-incomplete", "mtp-config-mismatch",
               "quantized-tensors-missing"}


@pytest.fixture(scope="module")
def dsv4_float(tmp_path_factory):
    """A float DeepSeek-V4 as save_pretrained writes it, its MTP layers in model_mtp (read
    only: the release fixture quantizes it into folders of its own)."""
    src = tmp_path_factory.mktemp("dsv4_float")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 32 expert inputs: the FP4 group, as every released expert's width is a multiple of.
        write_deepseek_v4(src, steps=5, over={"moe_intermediate_size": 32})
    return src


def _stored(folder) -> dict:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _modules(tensors: dict, pattern: str) -> set:
    return {k.rpartition(".")[0] for k in tensors if re.match(pattern, k)}


@pytest.mark.parametrize("scheme,mtp", [("w8a8", "keep"), ("w4a16", "same")])
def test_quantize_deepseek_v4(dsv4_float, tmp_path, scheme, mtp):
    """The quantized copy reloads, drafts losslessly (greedy with MTP = its own run without,
    k = 1..3), keeps float what vLLM or SGLang build float or load only float, lists it in
    both engines' names, and doctor finds nothing wrong for either."""
    from mtpkit.checkpoint.runtime_names import ignore_status
    from mtpkit.doctor import diagnose
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(dsv4_float, out, Scheme(scheme, group_size=32 if scheme == "w4a16"
                                                 else None), mtp=mtp)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    tensors = _stored(out)
    quantized = _modules(tensors, r".*\.(weight_packed|weight_scale)$")
    floats = {k[: -len(".weight")] for k in tensors if k.endswith(".weight")
              and tensors[k].dim() == 2 and k[: -len(".weight")] not in quantized}
    assert quantized and floats
    # What the engines build float (compressors, weights_proj, routers), and the wq_a / wkv
    # SGLang fuses from float tensors only, stayed float; every float module is unquantized
    # in both engines by the config written.
    for pat in (r".*compressor\.w(kv|gate)$", r".*indexer\.weights_proj$", r".*ffn\.gate$",
                r".*attn\.(wq_a|wkv|wo_a)$"):
        assert not any(re.match(pat, m) for m in quantized), pat
        assert any(re.match(pat, m) for m in floats), pat
    for engine in ("vllm", "sglang"):
        for m in floats:
            assert ignore_status(m, q["ignore"], "deepseek_v4", engine, config=cfg) in (
                "ignored", "not-quantizable"), (engine, m)
        for m in quantized:
            assert ignore_status(m, q["ignore"], "deepseek_v4", engine, config=cfg) \
                == "quantized", (engine, m)
    mtp_mods = {m for m in floats | quantized if m.startswith("mtp.")}
    if mtp == "keep":
        assert not mtp_mods & quantized
        # vLLM's draft modules are model.layers.{L+i}.*, SGLang's model.decoder.* / model.*
        assert "model.layers.5.mtp_block.attn.fused_wqa_wkv" in q["ignore"]
        assert {"model.decoder.self_attn.wq_b", "model.e_proj"} <= set(q["ignore"])
    else:
        assert {"mtp.0.ffn.shared_experts.w2", "mtp.1.e_proj"} <= quantized
    rep = diagnose(out, ["vllm", "sglang", "mtpkit"])
    assert not rep.codes() & _DOCTOR_BAD, rep.to_json()
    assert rep.facts["mtp_layers_stored"] == DSV4_MTP_LAYERS

    loaded = _load(out)
    model = loaded.model
    assert model.mtp is not None and len(model.mtp.layers) == DSV4_MTP_LAYERS
    # mtpkit runs DeepSeek-V4 in float: what it loaded is the stored codes dequantized,
    # not the float originals (MTP layers too with --mtp same).
    original = _stored(dsv4_float)
    for m in ("model.layers.2.ffn.shared_experts.w2", "mtp.1.ffn.experts.0.w1"):
        w = model.get_parameter(model.map_checkpoint_name(m + ".weight"))
        was = original[m + ".weight"]
        assert torch.equal(w, was) == (m not in quantized), m
        assert (w - was).abs().max() < 0.2 * was.abs().max(), m
    _assert_lossless(model, seed=1)


def test_quantized_deepseek_v4_without_mtp_names(dsv4_float, tmp_path):
    """--mtp keep without the draft's runtime names: each engine builds the float MTP layers
    quantized (0% acceptance); doctor says so per engine, fix-config repairs it."""
    from mtpkit.doctor import diagnose, fix_config
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(dsv4_float, out, Scheme("w8a8"), mtp="keep")
    dropped = {"vllm": re.compile(r"model\.layers\.[45]\."),
               "sglang": re.compile(r"model\.(decoder|e_proj|h_proj)")}
    for engine, pat in dropped.items():
        bad = tmp_path / f"bad_{engine}"
        bad.mkdir()
        for f in out.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((bad / "config.json").read_text())
        ignore = cfg["quantization_config"]["ignore"]
        cfg["quantization_config"]["ignore"] = [e for e in ignore if not pat.match(e)]
        assert len(cfg["quantization_config"]["ignore"]) < len(ignore)
        (bad / "config.json").write_text(json.dumps(cfg))
        rep = diagnose(bad, [engine])
        assert "mtp-unquantized-not-ignored" in rep.codes() and rep.exit_code == 2, engine
        other = "sglang" if engine == "vllm" else "vllm"
        assert "mtp-unquantized-not-ignored" not in diagnose(bad, [other]).codes()
        fixed = fix_config(bad, tmp_path / f"fixed_{engine}").out
        assert not diagnose(fixed, ["vllm", "sglang"]).codes() & _DOCTOR_BAD


# -- graft: MTP layers back into a release that dropped them ----------------------------------


def test_graft_deepseek_v4_mtp_layers(dsv4_float, tmp_path):
    """A save_pretrained export without mtp.*: graft copies them back; the result drafts
    losslessly with the source's MTP weights, and doctor is clean."""
    from mtpkit.doctor import diagnose
    from mtpkit.doctor.graft import graft

    dropped = tmp_path / "dropped"
    dropped.mkdir()
    for f in ("config.json", "model.safetensors"):
        (dropped / f).write_bytes((dsv4_float / f).read_bytes())
    assert "mtp-missing" in diagnose(dropped, ["vllm", "sglang", "mtpkit"]).codes()
    out = graft(dsv4_float, dropped, tmp_path / "g").out
    assert not any(dropped.glob("*mtp*"))  # the input is left as it was
    src_mtp = load_file(dsv4_float / "model_mtp.safetensors")
    got = _stored(out)
    assert all(torch.equal(got[k], v) for k, v in src_mtp.items())
    rep = diagnose(out, ["vllm", "sglang", "mtpkit"])
    assert rep.exit_code == 0 and rep.facts["mtp_layers_stored"] == DSV4_MTP_LAYERS, \
        rep.to_json()
    model = _load(out).model
    assert model.mtp is not None
    _assert_lossless(model, seed=2)


def test_graft_float_mtp_into_the_fp8_release(release, tmp_path):
    """Float MTP layers grafted into the FP8 release: vLLM's draft would build them FP8, so
    ignored_layers must list their runtime names; graft writes them, doctor is clean."""
    from mtpkit.checkpoint.runtime_names import ignore_list_for
    from mtpkit.doctor import diagnose
    from mtpkit.doctor.graft import graft

    out, flt, _ = release
    dropped = tmp_path / "dropped"
    dropped.mkdir()
    for f in ("config.json", "model-00001-of-00002.safetensors"):
        (dropped / f).write_bytes((out / f).read_bytes())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not k.startswith("mtp.")}
    (dropped / "model.safetensors.index.json").write_text(json.dumps(index))
    res = graft(flt, dropped, tmp_path / "g")
    cfg = json.loads((res.out / "config.json").read_text())
    listed = set(cfg["quantization_config"].get("ignored_layers") or [])
    stored = load_file(flt / "model-00002-of-00002.safetensors")
    disk = sorted({k.rpartition(".")[0] for k in stored if _FP8.match(k) or _FP4.match(k)})
    codes = diagnose(res.out, ["vllm", "mtpkit"]).codes()
    assert "mtp-missing" not in codes, codes
    assert set(ignore_list_for(disk, "deepseek_v4", "vllm", config=cfg)) - set(disk) <= listed
    assert "mtp-unquantized-not-ignored" not in codes, codes
