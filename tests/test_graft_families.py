"""The MTP families of issue #46 (GLM-4.7-Flash, GLM-5, Kimi-K2.5, Step-3.5 / 3.7-Flash,
MiMo-V2-Flash) through graft and doctor: a head read from a GGUF goes back into the folder
that lost it under the release's own names, every layer of it, and the result loads and
decodes as the original; doctor's family facts (which releases ship a head, how many MTP
layers vLLM runs); Kimi-K2.5's module names under its wrapper.

Each tiny checkpoint (tests/tiny.py's models, in the variant llama.cpp's architecture holds)
gets a head as tiny.add_mtp_head lays it out, undistilled (the layout is what is tested, and
distilling costs a minute a family); its GGUF is what ``mtpkit quantize --format gguf``
writes (quantize_gguf), except Kimi-K2.5's: quantize has no GGUF architecture for kimi_k2 /
kimi_k25, so its text model is written as deepseek2 (what llama.cpp's converter makes of
Kimi-K2) by the writer behind it, write_gguf.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import broken
import pytest
import tiny
import torch

from mtpkit.checkpoint.runtime_names import describe, is_ignored, map_ignore_entries
from mtpkit.doctor.checks import diagnose
from mtpkit.doctor.graft import graft
from mtpkit.doctor.layout import is_mtp_tensor
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Case:
    fam: tiny.Family
    gguf_arch: str


_DENSE_FIRST = ["dense", "sparse", "sparse"]  # llama.cpp runs dense layers leading only
CASES = {c.fam.name: c for c in [
    Case(tiny.Family("glm4_moe_lite", lambda: tiny._glm4_moe_lite(mlp_layer_types=_DENSE_FIRST),
                     mtp_layout="deepseek", adjust=tiny._soften_mla_queries), "deepseek2"),
    # Half-split rope rows (rope_interleave false): llama.cpp's pairs go back to halves.
    Case(tiny.Family("glm4_moe_lite_half_split", lambda: tiny._glm4_moe_lite(
        mlp_layer_types=_DENSE_FIRST, rope_interleave=False), mtp_layout="deepseek",
        adjust=tiny._soften_mla_queries), "deepseek2"),
    Case(tiny.Family("glm_moe_dsa", lambda: tiny._glm_moe_dsa(
        num_hidden_layers=3, mlp_layer_types=_DENSE_FIRST, indexer_types=["full", "shared", "full"],
        index_head_dim=64, index_n_heads=16), mtp_layout="deepseek",
        adjust=tiny._soften_mla_queries), "glm-dsa"),
    Case(next(f for f in tiny.FAMILIES if f.name == "kimi_k25"), "deepseek2"),
    # llama.cpp's attention scale (head_dim ** -0.5): query_pre_attn_scalar = head_dim.
    Case(tiny.Family("step3p5", lambda: tiny._step3p7(query_pre_attn_scalar=16),
                     mtp_layout="step3p7", rewrite=tiny._step3p5_release_layout,
                     mtp_layers=tiny.STEP_MTP_LAYERS), "step35"),
    Case(tiny.Family("step3p7", lambda: tiny._step3p7(query_pre_attn_scalar=16),
                     mtp_layout="step3p7", rewrite=tiny._step_release_layout,
                     mtp_layers=tiny.STEP_MTP_LAYERS), "step35"),
    # Routed weights unscaled: llama.cpp's mimo2 reads no scale.
    Case(tiny.Family("mimo_v2_flash", lambda: tiny._mimo_v2_flash(routed_scaling_factor=1.0),
                     mtp_layout="mimo_v2", mtp_layers=3, rewrite=tiny._mimo_release_layout),
         "mimo2"),
]}


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False).model


def _mtp_tensors(path: Path) -> dict[str, torch.Tensor]:
    n = broken.n_layers(broken.config(path))
    return {k: v for k, v in broken.read_all(path).items() if is_mtp_tensor(k, n)}


def _write_gguf(case: Case, src: Path, out: Path) -> Path:
    from mtpkit.quant.quantize import quantize_gguf

    if case.fam.name != "kimi_k25":
        return quantize_gguf(src, out, "F32")
    from mtpkit.checkpoint import open_checkpoint
    from mtpkit.checkpoint.gguf import write_gguf
    from mtpkit.engine.loader import hf_config_of
    from mtpkit.models.registry import family_for

    ckpt = open_checkpoint(src)
    config = dict(hf_config_of(ckpt))
    cls = family_for(config["model_type"])
    with torch.device("meta"):
        model = cls(cls.config_class.from_hf_config(config))
    tensors = {}
    for name in ckpt.tensor_names():
        mapped = model.map_checkpoint_name(name)  # the text model's names, as quantize does
        if mapped is not None:
            tensors[mapped] = ckpt.get_tensor(name)
    write_gguf(out, "deepseek2", {**config, "model_type": "deepseek_v3"}, tensors, None, "F32")
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case name -> (its checkpoint with a head in the release layout, the head's GGUF)."""
    made = {}

    def get(name: str):
        if name not in made:
            case = CASES[name]
            out = tmp_path_factory.mktemp(name)
            src = out / "src"
            with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mp.setattr(tiny, "_distill", lambda *a, **k: None)
                mp.setattr(tiny, "_distill_chained", lambda *a, **k: None)
                tiny.write_checkpoint(case.fam, src)
                tiny.add_mtp_head(src, case.fam, layers=case.fam.mtp_layers)
                gguf = _write_gguf(case, src, out / "m.gguf")
            made[name] = src, gguf
        return made[name]

    return get


def _decode(model, k: int):
    res = Result()
    prompt = torch.randint(0, tiny.VOCAB, (10,), generator=torch.Generator().manual_seed(4))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = list(Engine(model).generate(prompt.tolist(), params, k, result=res))
    return tokens, (res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_head_grafts_back_under_the_release_names(name, built, tmp_path):
    """GGUF -> HF graft into the folder that lost its head: exactly the release's MTP tensor
    names (each layer's copies of the lm_head / embedding included), their values, no doctor
    error, and the same model: the original's greedy output and drafts for k = 1..3."""
    case = CASES[name]
    src, gguf = built(name)
    from mtpkit.checkpoint.gguf import open_gguf

    with open_gguf(gguf) as g:
        assert g.arch == case.gguf_arch and g.n_nextn == case.fam.mtp_layers
    trunk = broken.drop_mtp(src, tmp_path / "trunk")
    assert not _mtp_tensors(trunk)
    res = graft(gguf, trunk, tmp_path / "out")
    want, got = _mtp_tensors(src), _mtp_tensors(res.out)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=0, atol=1e-6, msg=k)
    errors = [f for f in res.report.findings if f.severity == "error"]
    assert not errors, res.report.to_json()
    a, b = _load(src), _load(res.out)
    assert len(b.mtp.layers) == len(a.mtp.layers) == case.fam.mtp_layers
    plain, _ = _decode(a, 0)
    assert _decode(b, 0)[0] == plain
    for k in (1, 3):
        mine, counts = _decode(b, k)
        assert mine == plain, k
        assert counts == _decode(a, k)[1] and counts[0] > 0, k


@pytest.mark.parametrize("name", ["glm4_moe_lite", "glm_moe_dsa"])
def test_stripped_glm_exports_are_mtp_missing(name, built, tmp_path):
    """GLM-4.7-Flash and GLM-5 releases ship an MTP layer: an export without it is an error
    (mtp-missing, with the graft command) even when its config no longer declares one."""
    src, _ = built(name)
    stripped = broken.drop_config_field(broken.drop_mtp(src, tmp_path / "d"), tmp_path / "s")
    rep = diagnose(stripped)
    assert "mtp-missing" in rep.codes() and "mtp-none" not in rep.codes(), rep.to_json()
    assert rep.exit_code == 2


@pytest.mark.parametrize("name", ["glm_moe_dsa", "step3p5", "mimo_v2_flash"])
def test_gguf_without_nextn_is_mtp_missing(name, built, tmp_path):
    """glm-dsa, step35 and mimo2 files come with nextn layers: one without is mtp-missing."""
    from mtpkit.quant.quantize import quantize_gguf

    src, _ = built(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer.json
        path = quantize_gguf(broken.drop_mtp(src, tmp_path / "d"), tmp_path / "t.gguf", "F32")
    rep = diagnose(path, ["llama.cpp"])
    assert "mtp-missing" in rep.codes() and "mtp-none" not in rep.codes(), rep.to_json()


def test_vllm_running_one_of_several_mtp_layers_is_said(built, tmp_path):
    """MiMo-V2-Flash stores three MTP layers and vLLM runs layer 0 at every step, where mtpkit
    drafts step i with layer i: an info finding for vLLM (not SGLang's warning), none for a
    copy holding layer 0 only, none for Step (vLLM runs all of its layers)."""
    src, _ = built("mimo_v2_flash")
    rep = diagnose(src, ["vllm"])
    f = next(f for f in rep.findings if f.code == "vllm-one-mtp-layer")
    assert f.severity == "info" and f.engines == ["vllm"] and "3 MTP layers" in f.what
    assert rep.exit_code == 0
    assert "vllm-one-mtp-layer" not in diagnose(src, ["sglang"]).codes()
    only0 = broken.edit_tensors(src, tmp_path / "only0", lambda t: {
        k: v for k, v in t.items() if not re.match(r"model\.mtp\.layers\.[12]\.", k)})
    cfg = broken.config(only0)
    cfg["num_nextn_predict_layers"] = 1
    broken.write_config(only0, cfg)
    assert "vllm-one-mtp-layer" not in diagnose(only0, ["vllm"]).codes()
    step, _ = built("step3p7")
    assert "vllm-one-mtp-layer" not in diagnose(step, ["vllm"]).codes()
    doc = (Path(__file__).parents[1] / "docs" / "doctor.md").read_text()
    assert "| `vllm-one-mtp-layer` | info |" in doc


def test_kimi_k25_runtime_names():
    """Kimi-K2.5's text model as the engines build it: vLLM at language_model.model.* (NVFP4
    names language_model.layers.* mapped there, ignore entries too), SGLang at model.*, MLA's
    q_a_proj and kv_a_proj_with_mqa fused; its MTP layer built by neither."""
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 3, "q_lora_rank": 32}}
    layer = "language_model.model.layers.1.self_attn"
    for disk in (f"{layer}.q_a_proj", "language_model.layers.1.self_attn.kv_a_proj_with_mqa"):
        rt = describe(disk, "kimi_k25", "vllm", config=cfg)
        assert rt.name == f"{layer}.fused_qkv_a_proj"
        assert set(rt.shards) == {f"{layer}.q_a_proj", f"{layer}.kv_a_proj_with_mqa"}
        rt = describe(disk, "kimi_k25", "sglang", config=cfg)
        assert rt.name == "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa"
    assert describe("language_model.lm_head", "kimi_k25", "vllm",
                    config=cfg).name == "language_model.lm_head"
    assert describe("language_model.lm_head", "kimi_k25", "sglang", config=cfg).name == "lm_head"
    for engine in ("vllm", "sglang"):
        rt = describe("language_model.model.layers.3.self_attn.q_b_proj", "kimi_k25", engine,
                      config=cfg)
        assert rt.mtp and not rt.built
    assert map_ignore_entries(["language_model.layers.1.self_attn.o_proj", "re:language_model.*"],
                              "kimi_k25", "vllm", config=cfg) == [
        f"{layer}.o_proj", "re:language_model.*"]


def test_kimi_k25_quantized_copy_loads_in_vllm_and_sglang(built, tmp_path):
    """quantize keeps each fused q_a_proj + kv_a_proj_with_mqa whole (both float or both
    quantized: vLLM refuses shards that differ) and writes the names both engines build."""
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    src, _ = built("kimi_k25")
    out = tmp_path / "q"
    quantize_checkpoint(src, out, Scheme("w8a16"))
    names = set(broken.read_all(out))
    config = broken.config(out)
    ignore = config["quantization_config"]["ignore"]
    for i in range(3):
        layer = f"language_model.model.layers.{i}.self_attn"
        stored = {p: f"{layer}.{p}.weight_packed" in names
                  for p in ("q_a_proj", "kv_a_proj_with_mqa")}
        assert len(set(stored.values())) == 1, stored
        for engine in ("vllm", "sglang"):
            for p, quantized in stored.items():
                assert is_ignored(f"{layer}.{p}", ignore, "kimi_k25", engine,
                                  config=config) != quantized, (engine, p)
    for engine in (["vllm"], ["sglang"]):
        rep = diagnose(out, engine)
        assert not [f for f in rep.findings if f.severity == "error"], rep.to_json()



@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "fp8", "w8a8"])
def test_glm_moe_dsa_quantized_copy_decodes_as_itself(scheme, checkpoint_factory, tmp_path):
    """GLM-5 through quantize (its indexers included): the head kept float, no doctor error
    for vLLM or SGLang, and greedy with MTP (k = 1, 3) the quantized model's own output.
    (tests/test_quant.py's comparison with the dequantized model is not run on it: a w4a16
    near-tie between two experts flips one token's routing there, a discrete change no
    tolerance covers.)"""
    from mtpkit.quant.linear import QuantLinear
    from mtpkit.quant.pack import Scheme
    from mtpkit.quant.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(checkpoint_factory("glm_moe_dsa"), out,
                        Scheme(scheme, 32 if scheme == "w4a16" else None))
    for engine in (["vllm"], ["sglang"]):
        rep = diagnose(out, engine)
        assert not [f for f in rep.findings if f.severity == "error"], rep.to_json()
    model = _load(out)
    assert any(isinstance(m, QuantLinear) for m in model.model.modules())
    assert not any(isinstance(m, QuantLinear) for m in model.mtp.modules())
    plain, _ = _decode(model, 0)
    for k in (1, 3):
        tokens, counts = _decode(model, k)
        assert tokens == plain and counts[0] > 0, k
