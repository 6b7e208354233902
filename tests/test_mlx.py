"""MLX output: affine quantization against mx.quantize, checkpoints mlx-lm loads and decodes
like mtpkit, heads vllm-mlx injects, and doctor's MLX findings."""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpkit.cli import main
from mtpkit.doctor.checks import diagnose
from mtpkit.doctor.graft import graft
from mtpkit.quant.mlx import (
    MTP_DIR_FILE,
    _pack,
    affine_dequantize,
    affine_quantize,
    mtp_relative,
    quantize_mlx,
)

HAVE_MLX = (importlib.util.find_spec("mlx") is not None
            and importlib.util.find_spec("mlx_lm") is not None)
needs_mlx = pytest.mark.skipif(
    not HAVE_MLX, reason='needs MLX: pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2"')
needs_vllm_mlx = pytest.mark.skipif(
    not HAVE_MLX or importlib.util.find_spec("vllm_mlx") is None,
    reason='needs vllm-mlx: pip install "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" && '
           'pip install --no-deps vllm-mlx==0.6.0')

PROMPTS = [[3, 17, 42, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68], [90, 1, 90, 1, 90, 1, 33]]


# ---------------------------------------------------------------------------------------------
# quantization (torch only)


def _pack_one_by_one(codes: list[int], bits: int) -> list[int]:
    words = [0] * (len(codes) * bits // 32)
    for i, c in enumerate(codes):
        for b in range(bits):
            if c >> b & 1:
                pos = i * bits + b
                words[pos // 32] |= 1 << (pos % 32)
    return words


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_bit_by_bit(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=g)
    got = _pack(codes, bits).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for row in range(3):
        assert got[row].tolist() == _pack_one_by_one(codes[row].tolist(), bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_round_trip(bits):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    w[0, :64] = w[0, :64].abs()  # one-signed groups keep their extreme value exactly
    q, s, b = affine_quantize(w, bits, 64)
    assert q.dtype == torch.uint32 and q.shape == (8, 256 * bits // 32)
    assert s.shape == b.shape == (8, 4)
    back = affine_dequantize(q, s, b, bits, 64)
    # the edge kept exact can stretch the step so that the far end clips by up to a step
    step = s.abs().repeat_interleave(64, -1)
    assert ((back - w).abs() <= step + 1e-6).all()
    assert (back - w).abs().mean() < step.mean() / 3
    assert torch.isclose(back[0, :64].max(), w[0, :64].max())


# ---------------------------------------------------------------------------------------------
# checkpoints (torch only)


def _mlx_copy(checkpoint_factory, tmp_path, fam, bits=8, mtp="bf16", name="mlx") -> Path:
    out = tmp_path / name
    quantize_mlx(checkpoint_factory(fam), out, bits=bits, mtp=mtp)
    return out


def test_qwen3_5_layout(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_5_vlm")
    out = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_vlm", bits=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"] == {
        "bits": 4, "group_size": 64, "mode": "affine"}
    tc = cfg["text_config"]
    assert tc["mtp_num_hidden_layers"] == 1 and tc["mtp_hidden_state_mode"] == "post_norm"
    assert tc["full_attention_interval"] == 2 and "vision_config" not in cfg
    t = load_file(out / "model.safetensors")
    hf = load_file(src / "model.safetensors")
    assert not any("visual" in k or "mtp" in k for k in t)
    conv = "language_model.model.layers.0.linear_attn.conv1d.weight"
    assert t[conv].shape[-1] == 1
    norm = "language_model.model.layers.0.input_layernorm.weight"
    assert torch.equal(t[norm], hf["model.language_model.layers.0.input_layernorm.weight"] + 1)
    q = "language_model.model.layers.1.self_attn.q_proj"
    assert t[f"{q}.weight"].dtype == torch.uint32 and f"{q}.biases" in t
    head = load_file(out / MTP_DIR_FILE)
    assert all(k.startswith("mtp.") and v.dtype == torch.bfloat16 for k, v in head.items())
    assert json.loads((out / "mtp" / "manifest.json").read_text())["rmsnorm_weight_format"] \
        == "mlx_gamma"


def test_qwen3_next_moe_layout(checkpoint_factory, tmp_path):
    out = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_next_moe")
    cfg = json.loads((out / "config.json").read_text())
    gate = {"bits": 8, "group_size": 64}
    assert cfg["quantization"]["model.layers.0.mlp.gate"] == gate
    assert cfg["quantization"]["model.layers.0.mlp.shared_expert_gate"] == gate
    t = load_file(out / "model.safetensors")
    assert t["model.layers.0.mlp.switch_mlp.up_proj.weight"].shape[0] == 4
    assert not (out / "mtp").exists() and not (out / "model-mtp.safetensors").exists()
    assert "mlx-qwen3-next-head" in diagnose(out, ["vllm-mlx"]).codes()
    # the only file vllm-mlx reads a Qwen3-Next head from is one mlx-lm cannot load beside
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, out / "model-mtp.safetensors")
    assert "mlx-lm-mtp-file-breaks-load" in diagnose(out, ["mlx-lm"]).codes()
    if HAVE_MLX:
        from mlx_lm.utils import load_model

        with pytest.raises(ValueError, match="not in model"):
            load_model(out)


def test_qwen3_5_moe_layout(checkpoint_factory, tmp_path):
    """Qwen3.5-MoE: routed experts stacked as switch_mlp in the trunk and in the head (where
    vllm-mlx builds them so), routers at 8 bits, the head in BF16."""
    out = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_moe_vlm", bits=4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe"
    gate = {"bits": 8, "group_size": 64}
    assert cfg["quantization"]["language_model.model.layers.0.mlp.gate"] == gate
    t = load_file(out / "model.safetensors")
    experts = "language_model.model.layers.0.mlp.switch_mlp.up_proj"
    assert t[f"{experts}.weight"].shape[0] == 4 and t[f"{experts}.weight"].dtype == torch.uint32
    head = load_file(out / MTP_DIR_FILE)
    assert head["mtp.layers.0.mlp.switch_mlp.up_proj.weight"].shape == (4, 32, 64)
    assert all(v.dtype == torch.bfloat16 for v in head.values())
    assert diagnose(out, ["vllm-mlx"]).exit_code == 0


def test_refuses_other_families(checkpoint_factory, tmp_path):
    with pytest.raises(ValueError, match="qwen3_5"):
        quantize_mlx(checkpoint_factory("qwen3"), tmp_path / "o")


# ---------------------------------------------------------------------------------------------
# doctor and graft (torch only)


def _codes(path) -> set[str]:
    return diagnose(path, ["vllm-mlx"]).codes()


def _rewrite_head(out: Path, fn) -> None:
    f = out / MTP_DIR_FILE
    save_file({k: v.contiguous() for k, v in fn(load_file(f)).items()}, f)


def _set_cfg(out: Path, **kw) -> None:
    cfg = json.loads((out / "config.json").read_text())
    for k, v in kw.items():
        if v is None:
            cfg["text_config"].pop(k, None)
        else:
            cfg["text_config"][k] = v
    (out / "config.json").write_text(json.dumps(cfg))


def test_doctor_mlx_findings(checkpoint_factory, tmp_path):
    good = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_vlm", bits=4)
    rep = diagnose(good, ["vllm-mlx"])
    assert rep.exit_code == 0 and rep.findings == [], rep.findings
    assert "mlx-lm-no-mtp" in diagnose(good).codes()  # an MLX folder is recognised

    def broken(name):
        b = tmp_path / name
        shutil.copytree(good, b)
        return b

    b = broken("missing")
    shutil.rmtree(b / "mtp")
    assert "mlx-mtp-file-missing" in _codes(b)

    b = broken("prefix")
    _rewrite_head(b, lambda t: {"model.language_model." + k: v for k, v in t.items()})
    assert "mlx-mtp-prefix" in _codes(b)

    b = broken("norms")  # HF zero-centred values under a manifest that says MLX gammas
    _rewrite_head(b, lambda t: {k: v - 1 if k.endswith("norm.weight") else v
                                for k, v in t.items()})
    assert "mlx-mtp-norm-convention" in _codes(b)

    b = broken("mode")
    _set_cfg(b, mtp_hidden_state_mode=None)
    rep = diagnose(b, ["vllm-mlx"])
    assert rep.codes() == {"mlx-hidden-state-mode"} and rep.exit_code == 1
    _set_cfg(b, mtp_hidden_state_mode="last")
    assert diagnose(b, ["vllm-mlx"]).exit_code == 2

    b = broken("layers")
    _set_cfg(b, mtp_num_hidden_layers=0)
    assert "mlx-mtp-config-missing" in _codes(b)

    four = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_vlm", bits=4, mtp="same",
                     name="head4")
    assert _codes(four) == {"mlx-mtp-low-bits"}

    b = broken("bits")  # an 8-bit head in a 4-bit trunk: dequantized with 4 bits
    eight = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_vlm", bits=8, mtp="same",
                      name="head8")
    shutil.copy(eight / MTP_DIR_FILE, b / MTP_DIR_FILE)
    assert "mlx-mtp-bits-mismatch" in _codes(b)

    assert main(["doctor", str(b), "--engine", "vllm-mlx", "--json"]) == 2


def test_graft_into_mlx(checkpoint_factory, tmp_path, capsys):
    src = checkpoint_factory("qwen3_5_vlm")
    dst = _mlx_copy(checkpoint_factory, tmp_path, "qwen3_5_vlm", bits=4)
    shutil.rmtree(dst / "mtp")
    _set_cfg(dst, mtp_hidden_state_mode=None)
    assert "mlx-mtp-file-missing" in _codes(dst)
    res = graft(src, dst, tmp_path / "out", engines=["vllm-mlx"])
    assert res.report.exit_code == 0, res.report.findings
    assert not (dst / "mtp").exists()  # inputs are never written
    assert main(["graft", "--from", str(src), "--into", str(dst), "--out",
                 str(tmp_path / "out4"), "--mtp-precision", "match", "--engine", "vllm-mlx",
                 "--json"]) == 1  # a 4-bit head is a warning
    assert "mlx-mtp-low-bits" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# against MLX itself


@needs_mlx
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_affine_matches_mx_quantize(bits):
    import mlx.core as mx
    import numpy as np

    kinds = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    for group in (32, 64, 128):
        for dtype, mdt in kinds.items():
            w = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits + group))
            w[0, :64] = w[0, :64].abs()
            w[1, :64] = -w[1, :64].abs()
            w[2, :64] = 0
            w[3, :64] = 0.5
            w = w.to(dtype)
            q, s, b = affine_quantize(w, bits, group)
            mq, ms, mb = mx.quantize(mx.array(w.float().numpy()).astype(mdt),
                                     group_size=group, bits=bits)
            assert np.array_equal(np.array(mq), q.view(torch.int32).numpy().view(np.uint32))
            assert np.array_equal(np.array(ms.astype(mx.float32)), s.float().numpy())
            assert np.array_equal(np.array(mb.astype(mx.float32)), b.float().numpy())


def _dequantized_hf(src: Path, out: Path, bits: int, head_bf16: bool) -> Path:
    """The HF checkpoint holding exactly the weights the MLX copy stands for."""
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    moe = int(cfg.get("text_config", cfg).get("num_experts") or 0) > 0
    for f in out.glob("*.safetensors"):
        t = load_file(f)
        for k, v in t.items():
            if mtp_relative(k) is not None:
                if head_bf16 and v.is_floating_point():
                    t[k] = v.to(torch.bfloat16).float()
                continue
            if (not k.endswith(".weight") or v.ndim < 2 or "conv1d" in k or "visual" in k
                    or v.shape[-1] % 64):
                continue
            gate = moe and k[: -len(".weight")].endswith(("mlp.gate", "shared_expert_gate"))
            b = 8 if gate else bits
            t[k] = affine_dequantize(*affine_quantize(v, b, 64), b, 64)
        save_file(t, f, metadata={"format": "pt"})
    return out


def _mtpkit_model(path: Path):
    from mtpkit.engine.loader import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False).model


def _mtpkit_greedy(model, prompt, n, k):
    from mtpkit.engine.generate import Engine, Result
    from mtpkit.engine.sampling import SamplingParams

    res = Result()
    toks = list(Engine(model).generate(prompt, SamplingParams(max_tokens=n), k, result=res,
                                       eos_ids=set()))
    return toks, res


def _mlx_greedy(model, prompt, n):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


@needs_mlx
@pytest.mark.parametrize("fam,bits", [("qwen3_5_vlm", 8), ("qwen3_5_vlm", 4),
                                      ("qwen3_5_moe_vlm", 4), ("qwen3_next_dense", 8),
                                      ("qwen3_next_moe", 4)])
def test_mlx_lm_greedy_matches_mtpkit(checkpoint_factory, tmp_path, fam, bits):
    """mlx-lm on mtpkit's MLX copy decodes what mtpkit decodes on the same (dequantized)
    weights, and mtpkit's MTP decoding is the same text again."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    mlx_dir = _mlx_copy(checkpoint_factory, tmp_path, fam, bits=bits)
    ref = _dequantized_hf(checkpoint_factory(fam), tmp_path / "ref", bits, head_bf16=True)
    mlx_model, _ = load_model(mlx_dir)
    model = _mtpkit_model(ref)
    ids = PROMPTS[1]
    with torch.no_grad():
        want = model.logits(model(torch.tensor([ids])).hidden)
    got = torch.from_numpy(__import__("numpy").array(mlx_model(mx.array([ids])).astype(
        mx.float32)))
    assert (want - got).abs().max() < 2e-3
    for prompt in PROMPTS:
        mine, _ = _mtpkit_greedy(model, prompt, 24, 0)
        assert _mlx_greedy(mlx_model, prompt, 24) == mine, prompt
        assert _mtpkit_greedy(model, prompt, 24, 1)[0] == mine


def _vllm_mlx_drafts(path: Path, ids: list[int]):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model
    from vllm_mlx.patches.qwen3_5_mtp import inject_mtp_support

    model, _ = load_model(path)
    assert inject_mtp_support(model, path, json.loads((path / "config.json").read_text()))
    lm = model.language_model
    logits, hidden = lm(mx.array([ids]), return_hidden=True)
    n = len(ids) - 1
    d = lm.mtp_forward(hidden[:, :n], mx.array([ids[1 : 1 + n]]),
                       mtp_cache=lm.make_mtp_cache())
    return np.array(mx.argmax(d, -1))[0].tolist()


def _mtpkit_drafts(model, ids: list[int]):
    x = torch.tensor([ids])
    n = len(ids) - 1
    with torch.no_grad():
        out = model(x)
        cos, sin = model.rotary.cos_sin(torch.arange(n))
        hidden = out.for_mtp(model.mtp.spec.trunk_hidden)[:, :n]
        post, _ = model.mtp(model.model.embed_tokens(x[:, 1 : 1 + n]), hidden, 0, cos, sin,
                            None)
        return model.logits(post).argmax(-1)[0].tolist()


@needs_vllm_mlx
@pytest.mark.parametrize("fam,mtp,bits", [("qwen3_5_vlm", "bf16", 4),
                                          ("qwen3_5_vlm", "same", 8),
                                          ("qwen3_5_moe_vlm", "bf16", 4)])
def test_vllm_mlx_injects_the_head(checkpoint_factory, tmp_path, fam, mtp, bits):
    """vllm-mlx's own injection on mtpkit's output drafts what mtpkit's head drafts on the
    same weights, and accepts as often, on the trunk's greedy text (dense and MoE heads)."""
    mlx_dir = _mlx_copy(checkpoint_factory, tmp_path, fam, bits=bits, mtp=mtp)
    ref = tmp_path / "ref"
    _dequantized_hf(checkpoint_factory(fam), ref, bits, head_bf16=mtp == "bf16")
    if mtp == "same":  # the head as vllm-mlx dequantizes it
        f = ref / "model_mtp.safetensors"
        t = load_file(f)
        for k, v in t.items():
            if k.endswith(".weight") and v.ndim == 2:
                t[k] = affine_dequantize(*affine_quantize(v, bits, 64), bits, 64)
        save_file(t, f, metadata={"format": "pt"})
    model = _mtpkit_model(ref)
    agree = total = acc_mlx = acc_mine = 0
    for prompt in PROMPTS:
        ids = prompt + _mtpkit_greedy(model, prompt, 32, 0)[0]
        # from the last prompt token on, the token after each pending one is the trunk's
        start = len(prompt) - 1
        theirs = _vllm_mlx_drafts(mlx_dir, ids)[start:-1]
        mine = _mtpkit_drafts(model, ids)[start:-1]
        target = ids[start + 2:]
        agree += sum(a == b for a, b in zip(theirs, mine, strict=True))
        acc_mlx += sum(a == t for a, t in zip(theirs, target, strict=True))
        acc_mine += sum(a == t for a, t in zip(mine, target, strict=True))
        total += len(mine)
    assert agree / total >= 0.95, (agree, total)
    assert abs(acc_mlx - acc_mine) / total <= 0.05
    assert acc_mine / total > 0.5  # the distilled head does draft


def test_cli_refuses_options_mlx_does_not_take(tmp_path, capsys):
    """Options of the other formats are refused with --format mlx, not silently dropped."""
    from mtpkit.cli import main

    code = main(["quantize", "--format", "mlx", "--model", str(tmp_path), "--out",
                 str(tmp_path / "out"), "--scheme", "w8a8", "--lm-head", "same"])
    assert code == 2
    assert "drop --scheme, --lm-head" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
