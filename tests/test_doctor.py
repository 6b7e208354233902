"""mtpkit doctor / graft / fix-config, and the engines' runtime-name rules they rest on."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import warnings
from pathlib import Path

import broken
import pytest
import torch

from mtpkit.checkpoint.runtime_names import (
    IgnoreStatus,
    describe,
    ignore_list_for,
    ignore_status,
    is_ignored,
    runtime_module,
)
from mtpkit.cli import main
from mtpkit.doctor.findings import Report
from mtpkit.doctor.measure import Measurement, judge, measure

# ---------------------------------------------------------------------------------------------
# Runtime names: on-disk module -> what the engine builds (vLLM packed_modules_mapping, MTP
# model classes, HF -> engine name maps).

DS = {"num_hidden_layers": 61}
MIMO = {"num_hidden_layers": 36}

RUNTIME_CASES = [
    # (disk module, model_type, engine, config, runtime name)
    ("model.layers.0.self_attn.q_proj", "llama", "vllm", None, "model.layers.0.self_attn.qkv_proj"),
    ("model.layers.0.self_attn.v_proj", "qwen3", "vllm", None, "model.layers.0.self_attn.qkv_proj"),
    ("model.layers.0.self_attn.o_proj", "qwen2", "vllm", None, "model.layers.0.self_attn.o_proj"),
    ("model.layers.0.mlp.up_proj", "llama", "vllm", None, "model.layers.0.mlp.gate_up_proj"),
    ("model.layers.0.mlp.down_proj", "llama", "vllm", None, "model.layers.0.mlp.down_proj"),
    # no fusion in mtpkit / transformers
    ("model.layers.0.self_attn.q_proj", "llama", "mtpkit", None, "model.layers.0.self_attn.q_proj"),
    # Qwen3.5 VLM trunk: language_model.model.*, gated-delta projections fused
    ("model.language_model.layers.0.linear_attn.in_proj_qkv", "qwen3_5", "vllm", None,
     "language_model.model.layers.0.linear_attn.in_proj_qkvz"),
    ("model.language_model.layers.0.linear_attn.in_proj_z", "qwen3_5", "vllm", None,
     "language_model.model.layers.0.linear_attn.in_proj_qkvz"),
    ("model.language_model.layers.0.linear_attn.in_proj_a", "qwen3_5", "vllm", None,
     "language_model.model.layers.0.linear_attn.in_proj_ba"),
    ("model.language_model.layers.3.self_attn.k_proj", "qwen3_5_moe", "vllm", None,
     "language_model.model.layers.3.self_attn.qkv_proj"),
    ("model.visual.blocks.0.attn.qkv", "qwen3_5", "vllm", None, "visual.blocks.0.attn.qkv"),
    # text-only Qwen3.5 class: no VLM prefix map
    ("model.layers.0.linear_attn.in_proj_b", "qwen3_5_text", "vllm", None,
     "model.layers.0.linear_attn.in_proj_ba"),
    # Qwen3-Next stores in_proj_qkvz / in_proj_ba fused already
    ("model.layers.0.linear_attn.in_proj_qkvz", "qwen3_next", "vllm", None,
     "model.layers.0.linear_attn.in_proj_qkvz"),
    # Qwen MTP: mtp.* names as the MTP model builds them
    ("mtp.fc", "qwen3_5", "vllm", None, "mtp.fc"),
    ("mtp.layers.0.self_attn.q_proj", "qwen3_5", "vllm", None, "mtp.layers.0.self_attn.qkv_proj"),
    ("mtp.layers.0.mlp.shared_expert.up_proj", "qwen3_next", "vllm", None,
     "mtp.layers.0.mlp.shared_expert.gate_up_proj"),
    ("mtp.layers.0.mlp.experts.3.down_proj", "qwen3_5_moe", "vllm", None,
     "mtp.layers.0.mlp.experts"),
    # DeepSeek MLA: q_a_proj + kv_a_proj_with_mqa fused (vLLM and SGLang names differ)
    ("model.layers.0.self_attn.q_a_proj", "deepseek_v3", "vllm", None,
     "model.layers.0.self_attn.fused_qkv_a_proj"),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa", "deepseek_v3", "sglang", None,
     "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa", "deepseek_v3", "vllm",
     {"q_lora_rank": None}, "model.layers.0.self_attn.kv_a_proj_with_mqa"),
    ("model.layers.0.self_attn.q_proj", "deepseek_v3", "vllm", {"q_lora_rank": None},
     "model.layers.0.self_attn.q_proj"),
    ("model.layers.61.mlp.shared_experts.gate_proj", "deepseek_v3", "vllm", DS,
     "model.layers.61.mlp.shared_experts.gate_up_proj"),
    # DeepSeek MTP: vLLM keeps the prefix; SGLang builds model.decoder.* and model.eh_proj
    ("model.layers.61.self_attn.q_a_proj", "deepseek_v3", "vllm", DS,
     "model.layers.61.self_attn.fused_qkv_a_proj"),
    ("model.layers.61.self_attn.q_a_proj", "deepseek_v3", "sglang", DS,
     "model.decoder.self_attn.fused_qkv_a_proj_with_mqa"),
    ("model.layers.61.eh_proj", "deepseek_v3", "sglang", DS, "model.eh_proj"),
    ("model.layers.46.self_attn.q_proj", "glm4_moe", "vllm", {"num_hidden_layers": 46},
     "model.layers.46.self_attn.qkv_proj"),
    # MiMo: MTP layer i is built as model.layers.{L + i}
    ("model.mtp_layers.0.self_attn.q_proj", "mimo", "vllm", MIMO,
     "model.layers.36.self_attn.qkv_proj"),
    ("model.mtp_layers.0.mlp.down_proj", "mimo", "vllm", MIMO, "model.layers.36.mlp.down_proj"),
]


@pytest.mark.parametrize("disk,model_type,engine,config,expected", RUNTIME_CASES)
def test_runtime_module(disk, model_type, engine, config, expected):
    assert runtime_module(disk, model_type, engine, config=config) == expected


def test_runtime_module_errors():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        runtime_module("model.mtp_layers.0.self_attn.q_proj", "mimo")
    with pytest.raises(ValueError, match="llama.cpp"):
        runtime_module("model.layers.0.self_attn.q_proj", "llama", "llama.cpp")


Q = IgnoreStatus.QUANTIZED
IG = IgnoreStatus.IGNORED
NQ = IgnoreStatus.NOT_QUANTIZABLE
CONFLICT = IgnoreStatus.SHARD_CONFLICT
QKV = ["mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.k_proj",
       "mtp.layers.0.self_attn.v_proj"]

IGNORE_CASES = [
    # (disk module, ignore list, model_type, engine, config, status)
    ("mtp.fc", [], "qwen3_5", "vllm", None, Q),
    ("mtp.fc", ["mtp.fc"], "qwen3_5", "vllm", None, IG),
    ("mtp.fc", ["re:mtp.*"], "qwen3_5", "vllm", None, IG),
    ("mtp.fc", ["re:.*fc$"], "qwen3_5", "vllm", None, IG),
    # re.match is anchored at the start: a bare substring pattern does not match
    ("mtp.fc", ["re:fc"], "qwen3_5", "vllm", None, Q),
    # every shard listed: the fused module is ignored
    ("mtp.layers.0.self_attn.q_proj", QKV, "qwen3_5", "vllm", None, IG),
    # the fused name itself, exactly
    ("mtp.layers.0.self_attn.k_proj", ["mtp.layers.0.self_attn.qkv_proj"], "qwen3_5", "vllm",
     None, IG),
    # a regex on the fused name counts from vLLM 0.30.0 (test_vllm_rules: before, it does not)
    ("mtp.layers.0.self_attn.q_proj", [r"re:.*qkv_proj$"], "qwen3_5", "vllm", None, IG),
    # some shards only: vLLM refuses to load
    ("mtp.layers.0.self_attn.q_proj", QKV[:1], "qwen3_5", "vllm", None, CONFLICT),
    ("mtp.layers.0.mlp.up_proj", ["mtp.layers.0.mlp.gate_proj"], "qwen3_5", "vllm", None,
     CONFLICT),
    # regex covering every shard
    ("mtp.layers.0.mlp.up_proj", [r"re:mtp\.layers\.0\.mlp\.(gate|up)_proj"], "qwen3_5",
     "vllm", None, IG),
    # mtpkit / transformers: on-disk names, no fusion; a class name counts
    ("mtp.layers.0.self_attn.q_proj", QKV[:1], "qwen3_5", "mtpkit", None, IG),
    ("mtp.layers.0.self_attn.q_proj", ["Linear"], "qwen3_5", "transformers", None, IG),
    # vLLM does not match class names in ignore
    ("mtp.fc", ["Linear"], "qwen3_5", "vllm", None, Q),
    # never quantized by the engine
    ("model.layers.61.eh_proj", [], "deepseek_v3", "vllm", DS, NQ),
    ("model.mtp_layers.0.input_proj", [], "mimo", "vllm", MIMO, NQ),
    ("lm_head", [], "llama", "vllm", None, NQ),
    ("model.layers.61.shared_head.head", [], "deepseek_v3", "vllm", DS, NQ),
    # VLM trunk: exact entries are mapped by vLLM, re: patterns are not
    ("model.language_model.layers.0.mlp.down_proj",
     ["model.language_model.layers.0.mlp.down_proj"], "qwen3_5", "vllm", None, IG),
    ("model.language_model.layers.0.mlp.down_proj",
     [r"re:model\.language_model\.layers\.0\.mlp\..*"], "qwen3_5", "vllm", None, Q),
    ("model.language_model.layers.0.mlp.down_proj", [r"re:.*layers\.0\.mlp\..*"], "qwen3_5",
     "vllm", None, IG),
    # the MTP draft model has no name map: mtp.* entries match as written
    ("mtp.layers.0.mlp.down_proj", ["mtp.layers.0.mlp.down_proj"], "qwen3_5", "vllm", None, IG),
    # MiMo MTP: on-disk names name nothing the engine builds
    ("model.mtp_layers.0.mlp.down_proj", ["model.mtp_layers.0.mlp.down_proj"], "mimo", "vllm",
     MIMO, Q),
    ("model.mtp_layers.0.mlp.down_proj", ["model.layers.36.mlp.down_proj"], "mimo", "vllm",
     MIMO, IG),
    # experts: one fused-MoE module decided by experts.0.{gate,up,down}_proj alone; the
    # module's own name is never consulted, nor any other expert's entries
    ("mtp.layers.0.mlp.experts.1.up_proj", ["mtp.layers.0.mlp.experts"], "qwen3_5_moe", "vllm",
     {"num_experts": 2}, Q),
    ("mtp.layers.0.mlp.experts.1.up_proj", ["mtp.layers.0.mlp.experts.1.up_proj"],
     "qwen3_5_moe", "vllm", {"num_experts": 2}, Q),
    ("mtp.layers.0.mlp.experts.1.up_proj", ["mtp.layers.0.mlp.experts.0.up_proj"],
     "qwen3_5_moe", "vllm", {"num_experts": 2}, CONFLICT),
    ("mtp.layers.0.mlp.experts.1.up_proj", [r"re:mtp\.layers\.0\.mlp\.experts\..*"],
     "qwen3_5_moe", "vllm", {"num_experts": 2}, IG),
    # SGLang's Qwen3.5 MTP class has no packed-modules mapping: shards do not count
    ("mtp.layers.0.self_attn.q_proj", QKV, "qwen3_5", "sglang", None, Q),
    ("mtp.layers.0.self_attn.q_proj", ["mtp.layers.0.self_attn.qkv_proj"], "qwen3_5", "sglang",
     None, IG),
    # SGLang builds the DeepSeek MTP block as model.decoder and renames exact entries alike
    ("model.layers.61.mlp.down_proj", ["model.layers.61.mlp.down_proj"], "deepseek_v3",
     "sglang", DS, IG),
    ("model.layers.61.mlp.down_proj", [r"re:model\.layers\.61\..*"], "deepseek_v3", "sglang",
     DS, Q),
    # routers and the vision patch embedding are never quantized
    ("model.layers.3.mlp.gate", [], "deepseek_v3", "vllm", None, NQ),
    ("mtp.layers.0.mlp.shared_expert_gate", [], "qwen3_5_moe", "vllm", None, NQ),
    ("model.layers.61.mlp.down_proj", ["model.decoder.mlp.down_proj"], "deepseek_v3", "sglang",
     DS, IG),
]


@pytest.mark.parametrize("disk,ignore,model_type,engine,config,expected", IGNORE_CASES)
def test_ignore_status(disk, ignore, model_type, engine, config, expected):
    status = ignore_status(disk, ignore, model_type, engine, config=config)
    assert status == expected
    assert is_ignored(disk, ignore, model_type, engine, config=config) == (expected in (IG, NQ))


IGNORE_LIST_CASES = [
    # (unquantized disk modules, model_type, engine, config)
    (["mtp.fc", *QKV, "mtp.layers.0.self_attn.o_proj", "mtp.layers.0.mlp.gate_proj",
      "mtp.layers.0.mlp.up_proj", "mtp.layers.0.mlp.down_proj"], "qwen3_5", "vllm", None),
    (["mtp.fc", *QKV], "qwen3_5", "sglang", None),
    (["model.language_model.layers.0.linear_attn.in_proj_b",
      "model.language_model.layers.0.linear_attn.in_proj_a"], "qwen3_5", "vllm", None),
    (["model.layers.61.eh_proj", "model.layers.61.self_attn.q_a_proj",
      "model.layers.61.self_attn.kv_a_proj_with_mqa", "model.layers.61.mlp.down_proj"],
     "deepseek_v3", "vllm", DS),
    (["model.layers.61.self_attn.q_a_proj", "model.layers.61.self_attn.kv_a_proj_with_mqa",
      "model.layers.61.mlp.down_proj"], "deepseek_v3", "sglang", DS),
    (["model.mtp_layers.0.input_proj", "model.mtp_layers.0.self_attn.q_proj",
      "model.mtp_layers.0.self_attn.k_proj", "model.mtp_layers.0.self_attn.v_proj"], "mimo",
     "vllm", MIMO),
    ([f"mtp.layers.0.mlp.experts.{e}.{p}" for e in range(2)
      for p in ("gate_proj", "up_proj", "down_proj")], "qwen3_5_moe", "vllm",
     {"num_experts": 2}),
]


@pytest.mark.parametrize("modules,model_type,engine,config", IGNORE_LIST_CASES)
def test_ignore_list_for_round_trip(modules, model_type, engine, config):
    """The list it writes keeps exactly these modules unquantized in the engine and in
    compressed-tensors' own matching, and is sorted and free of duplicates."""
    ignore = ignore_list_for(modules + modules[:1], model_type, engine, config=config)
    assert ignore == sorted(set(ignore))
    for m in modules:
        assert is_ignored(m, ignore, model_type, engine, config=config), m
        assert is_ignored(m, ignore, model_type, "transformers", config=config), m
    # a quantized neighbour stays quantized
    neighbour = "model.layers.0.mlp.down_proj"
    if model_type.startswith("qwen3_5"):
        neighbour = "model.language_model.layers.0.mlp.down_proj"
    assert not is_ignored(neighbour, ignore, model_type, engine, config=config)


def test_ignore_list_for_refuses_partial_fused_module():
    with pytest.raises(ValueError, match="qkv_proj"):
        ignore_list_for(QKV[:2], "qwen3_5")
    # no fusion in mtpkit: any subset is fine
    assert ignore_list_for(QKV[:1], "qwen3_5", "mtpkit") == QKV[:1]


def test_describe_flags_mtp_modules():
    assert describe("mtp.fc", "qwen3_5").mtp
    assert describe("model.layers.61.mlp.down_proj", "deepseek_v3", config=DS).mtp
    assert not describe("model.layers.60.mlp.down_proj", "deepseek_v3", config=DS).mtp


# ---------------------------------------------------------------------------------------------
# doctor, graft and fix-config on broken checkpoints (tests/broken.py). Each case: doctor names
# the cause (by code), the repair command fixes it, doctor then passes, and the acceptance
# mtpkit measures on the result equals that of the healthy checkpoint it should now match.


# Loading quantized checkpoints in mtpkit lives in mtpkit.quant (formats + linear layers).
HAVE_QUANT = importlib.util.find_spec("mtpkit.quant.formats") is not None
needs_quant = pytest.mark.skipif(
    not HAVE_QUANT, reason="mtpkit.quant (loading quantized checkpoints) is not importable yet")


class Fixtures:
    """Healthy sources and their broken copies, built once per module, lazily."""

    def __init__(self, root: Path, checkpoint_factory):
        self.root = root
        self._factory = checkpoint_factory
        self._built: dict[str, Path] = {}
        self._measured: dict[str, list[float]] = {}

    def source(self, family: str) -> Path:
        """A private copy of the tiny checkpoint with a byte-level tokenizer."""
        key = f"src-{family}"
        if key not in self._built:
            p = broken.copy(self._factory(family), self.root / key)
            broken.write_bytelevel_tokenizer(p)
            self._built[key] = p
        return self._built[key]

    def get(self, name: str) -> Path:
        """A named (broken or reference) checkpoint."""
        if name in self._built:
            return self._built[name]
        src = self.source("qwen3_5_vlm")
        out = self.root / name
        builders = {
            "dropped": lambda: broken.drop_mtp(src, out),
            "dropped-deepseek": lambda: broken.drop_mtp(self.source("deepseek_v3"), out),
            "unindexed": lambda: broken.unindex_mtp(src, out),
            "nofield-text-config": lambda: broken.drop_config_field(src, out),
            "nofield-top-level": lambda: broken.drop_config_field(self.source("deepseek_v3"),
                                                                   out),
            "random-head": lambda: broken.random_head(src, out),
            "w4a16-healthy": lambda: broken.w4a16(src, out, mtp="bf16-listed"),
            "w4a16-healthy-head-as-stored": lambda: broken.w4a16(src, out, mtp="bf16-listed",
                                                                 head_as_stored=True),
            "w4a16-mtp-not-ignored": lambda: broken.w4a16(src, out),
            "w4a16-ignore-ondisk": lambda: broken.w4a16(src, out, mtp="bf16-listed",
                                                        ignore_style="ondisk"),
            "w4a16-ignore-regex": lambda: broken.w4a16(src, out, mtp="bf16-listed",
                                                       ignore_style="regex"),
            "w4a16-int4-head": lambda: broken.w4a16(src, out, mtp="int4"),
            "w4a16-ignore-partial": lambda: broken.w4a16(src, out, mtp="bf16-listed",
                                                         ignore_style="partial"),
            "w4a16-scale-missing": lambda: broken.edit_tensors(
                self.get("w4a16-healthy"), out,
                lambda t: {k: v for k, v in t.items()
                           if k != "model.language_model.layers.1.mlp.down_proj.weight_scale"}),
            "w4a16-quantized-ignored": lambda: broken.edit_config(
                self.get("w4a16-healthy"), out, lambda c: c["quantization_config"]["ignore"]
                .append("model.language_model.layers.1.mlp.down_proj")),
            "gptq-mtp-bf16": lambda: broken.fake_gptq(src, out, "gptq"),
            "awq-mtp-bf16": lambda: broken.fake_gptq(src, out, "awq"),
            "fp8-without-scale": lambda: broken.edit_tensors(
                src, out, lambda t: {k: (v.to(torch.float8_e4m3fn) if k == "mtp.fc.weight"
                                         else v) for k, v in t.items()}),
            "partial-head": lambda: broken.edit_tensors(
                src, out, lambda t: {k: v for k, v in t.items() if k != "mtp.fc.weight"}),
            "wrong-shape-head": lambda: broken.edit_tensors(
                src, out, lambda t: {k: (v[:, :64].contiguous() if k == "mtp.fc.weight" else v)
                                     for k, v in t.items()}),
            "no-lm-head": lambda: broken.edit_tensors(
                src, out, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}),
            "config-says-2": lambda: broken.edit_config(
                src, out, lambda c: c["text_config"].update(mtp_num_hidden_layers=2)),
            "dedicated-flag": lambda: broken.edit_config(
                src, out, lambda c: c["text_config"].update(mtp_use_dedicated_embeddings=True)),
            "nextn-key-no-tensors.gguf": lambda: broken.gguf_edit(
                self.get("no-nextn-q8.gguf"), out, {"qwen35.nextn_predict_layers": 1}),
            "no-tokenizer.gguf": lambda: broken.gguf_edit(
                self.get("good.gguf"), out,
                remove=[k for k in _gguf_keys(self.get("good.gguf"))
                        if k.startswith("tokenizer.")]),
            "good.gguf": lambda: broken.to_gguf(src, out, qtype="F32"),
            "good-q8.gguf": lambda: broken.to_gguf(src, out, qtype="Q8_0"),
            "no-nextn-q8.gguf": lambda: broken.to_gguf(src, out, mtp=False, qtype="Q8_0"),
            "bad-block-count.gguf": lambda: broken.gguf_edit(
                self.get("good.gguf"), out, {"qwen35.block_count": 4}),
            "no-nextn-key.gguf": lambda: broken.gguf_edit(
                self.get("good.gguf"), out, remove=["qwen35.nextn_predict_layers"]),
        }
        if name.startswith("src-"):
            return self.source(name[4:])
        self._built[name] = builders[name]()
        return self._built[name]

    def acceptance(self, path: Path) -> list[float]:
        """Teacher-mode acceptance per position on doctor's built-in sample (cached)."""
        key = str(path)
        if key not in self._measured:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = measure(path)
            assert m.loaded_head, m.note
            self._measured[key] = m.per_position
        return self._measured[key]


@pytest.fixture(scope="module")
def fx(tmp_path_factory, checkpoint_factory):
    return Fixtures(tmp_path_factory.mktemp("doctor"), checkpoint_factory)


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """Run an mtpkit subcommand with --json; (exit status, JSON report or None, stderr)."""
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def codes(report: dict) -> set[str]:
    return {f["code"] for f in report["findings"]}


def tree_digest(path: Path) -> str:
    """A digest of every file's name and bytes under path (or of one file)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", ["src-qwen3_5_vlm", "src-deepseek_v3", "w4a16-healthy",
                                  "good.gguf", "good-q8.gguf"])
def test_healthy_checkpoints_pass(fx, capsys, name):
    if name.startswith("w4a16") and not HAVE_QUANT:
        pytest.skip("mtpkit.quant is not importable yet")
    code, rep, _ = run_cli(capsys, "doctor", str(fx.get(name)))
    assert code == 0, rep["findings"]
    assert rep["verdict"] == "healthy"


# (broken fixture, expected code, repair argv builder, healthy reference it must then match)
CASES = [
    ("dropped", "mtp-missing",
     lambda fx, b, o: ["graft", "--from", fx.source("qwen3_5_vlm"), "--into", b, "--out", o],
     "src-qwen3_5_vlm"),
    ("dropped-deepseek", "mtp-missing",
     lambda fx, b, o: ["graft", "--from", fx.source("deepseek_v3"), "--into", b, "--out", o],
     "src-deepseek_v3"),
    ("unindexed", "mtp-file-unindexed", lambda fx, b, o: ["fix-config", b, "--out", o],
     "src-qwen3_5_vlm"),
    ("nofield-text-config", "mtp-config-missing",
     lambda fx, b, o: ["fix-config", b, "--out", o], "src-qwen3_5_vlm"),
    ("nofield-top-level", "mtp-config-missing",
     lambda fx, b, o: ["graft", "--config-only", "--into", b, "--out", o], "src-deepseek_v3"),
    ("w4a16-mtp-not-ignored", "mtp-unquantized-not-ignored",
     lambda fx, b, o: ["fix-config", b, "--out", o], "w4a16-healthy"),
    ("w4a16-ignore-ondisk", "ignore-shards-not-fused",
     lambda fx, b, o: ["fix-config", b, "--out", o], "w4a16-healthy"),
    ("w4a16-ignore-regex", "ignore-regex-no-match",
     lambda fx, b, o: ["fix-config", b, "--out", o], "w4a16-healthy"),
    ("w4a16-ignore-partial", "ignore-shard-conflict",
     lambda fx, b, o: ["fix-config", b, "--out", o], "w4a16-healthy"),
    ("w4a16-quantized-ignored", "quantized-but-ignored",
     lambda fx, b, o: ["fix-config", b, "--out", o], "w4a16-healthy"),
    ("partial-head", "mtp-incomplete",
     lambda fx, b, o: ["graft", "--from", fx.source("qwen3_5_vlm"), "--into", b, "--out", o],
     "src-qwen3_5_vlm"),
    ("wrong-shape-head", "shape-mismatch",
     lambda fx, b, o: ["graft", "--from", fx.source("qwen3_5_vlm"), "--into", b, "--out", o],
     "src-qwen3_5_vlm"),
    ("config-says-2", "mtp-config-mismatch", lambda fx, b, o: ["fix-config", b, "--out", o],
     "src-qwen3_5_vlm"),
    ("dedicated-flag", "mtp-dedicated-embeddings",
     lambda fx, b, o: ["fix-config", b, "--out", o], "src-qwen3_5_vlm"),
    ("nextn-key-no-tensors.gguf", "gguf-nextn-tensors-missing",
     lambda fx, b, o: ["graft", "--from", fx.get("good.gguf"), "--into", b, "--out", o,
                       "--mtp-precision", "match"], "good-q8.gguf"),
    ("w4a16-int4-head", "int4-mtp-head",
     lambda fx, b, o: ["graft", "--from", fx.source("qwen3_5_vlm"), "--into", b, "--out", o,
                       "--mtp-precision", "keep"], "w4a16-healthy-head-as-stored"),
    ("no-nextn-q8.gguf", "mtp-missing",
     lambda fx, b, o: ["graft", "--from", fx.get("good.gguf"), "--into", b, "--out", o,
                       "--mtp-precision", "match"], "good-q8.gguf"),
    ("bad-block-count.gguf", "gguf-block-count",
     lambda fx, b, o: ["fix-config", b, "--out", o], "good.gguf"),
    ("no-nextn-key.gguf", "gguf-nextn-key-missing",
     lambda fx, b, o: ["fix-config", b, "--out", o], "good.gguf"),
]


@pytest.mark.parametrize("name,code,repair,reference", CASES, ids=[c[0] for c in CASES])
def test_doctor_names_cause_and_repair_restores_acceptance(fx, capsys, tmp_path, name, code,
                                                           repair, reference):
    if name.startswith("w4a16") and not HAVE_QUANT:
        pytest.skip("mtpkit.quant (loading quantized checkpoints) is not importable yet")
    bad = fx.get(name)
    status, rep, _ = run_cli(capsys, "doctor", str(bad))
    assert code in codes(rep), rep["findings"]
    expected_status = 1 if code in ("int4-mtp-head", "mtp-dedicated-embeddings") else 2
    assert status == expected_status and rep["exit_code"] == expected_status
    before = tree_digest(bad)

    out = tmp_path / ("repaired.gguf" if name.endswith(".gguf") else "repaired")
    argv = [str(a) for a in repair(fx, bad, out)]
    status, rep, err = run_cli(capsys, *argv)
    assert status == 0, (err, rep["findings"])
    assert tree_digest(bad) == before, "the input was modified"
    # doctor on the output passes, for every engine
    status, rep, _ = run_cli(capsys, "doctor", str(out))
    assert status == 0, rep["findings"]
    assert fx.acceptance(out) == fx.acceptance(fx.get(reference))


@pytest.mark.parametrize("name,code", [
    ("w4a16-scale-missing", "quantized-tensors-missing"),
    ("no-lm-head", "shared-embedding-missing"),
    ("no-tokenizer.gguf", "gguf-tokenizer-missing"),
])
def test_doctor_names_cause(fx, capsys, name, code):
    if name.startswith("w4a16") and not HAVE_QUANT:
        pytest.skip("mtpkit.quant is not importable yet")
    status, rep, _ = run_cli(capsys, "doctor", str(fx.get(name)))
    assert status == 2 and code in codes(rep), rep["findings"]


@pytest.mark.parametrize("name", ["gptq-mtp-bf16", "awq-mtp-bf16"])
def test_gptq_awq_skip_lists(fx, capsys, tmp_path, name):
    """GPTQ (dynamic '-:' patterns) and AWQ (modules_to_not_convert) keep modules unquantized
    in vLLM by other rules than compressed-tensors; fix-config writes them."""
    bad = fx.get(name)
    status, rep, _ = run_cli(capsys, "doctor", str(bad), "--engine", "vllm")
    assert status == 2 and "mtp-unquantized-not-ignored" in codes(rep), rep["findings"]
    out = tmp_path / "fixed"
    status, rep, err = run_cli(capsys, "fix-config", str(bad), "--out", str(out))
    assert status == 0, (err, rep["findings"])
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    if name.startswith("gptq"):
        assert any(k.startswith("-:mtp") for k in q["dynamic"])
    else:
        assert "mtp.fc" in q["modules_to_not_convert"]


def test_fp8_weight_without_scale_is_a_dtype_error(fx, capsys):
    status, rep, _ = run_cli(capsys, "doctor", str(fx.get("fp8-without-scale")))
    assert status == 2 and "dtype-unexpected" in codes(rep), rep["findings"]


def _gguf_keys(path: Path) -> list[str]:
    from gguf import GGUFReader

    return list(GGUFReader(path, "r").fields)


def test_random_head_is_found_by_measuring_and_graft_restores_it(fx, capsys, tmp_path):
    bad, src = fx.get("random-head"), fx.source("qwen3_5_vlm")
    status, rep, _ = run_cli(capsys, "doctor", str(bad))
    assert status == 0  # nothing static is wrong: the weights are
    status, rep, _ = run_cli(capsys, "doctor", str(bad), "--measure", "--reference", str(src))
    assert status == 2 and "mtp-acceptance-zero" in codes(rep)
    assert rep["facts"]["measured"]["acceptance_per_position"][0] < 0.05
    assert rep["facts"]["reference"]["acceptance_per_position"][0] > 0.3
    out = tmp_path / "grafted"
    status, rep, err = run_cli(capsys, "graft", "--from", str(src), "--into", str(bad),
                               "--out", str(out))
    assert status == 0, err
    status, rep, _ = run_cli(capsys, "doctor", str(out), "--measure", "--reference", str(src))
    assert status == 0 and "mtp-acceptance-ok" in codes(rep), rep["findings"]
    assert fx.acceptance(out) == fx.acceptance(src)


def test_graft_hf_head_into_gguf_and_gguf_head_into_hf(fx, capsys, tmp_path):
    src = fx.source("qwen3_5_vlm")
    out = tmp_path / "from-hf.gguf"
    status, _, err = run_cli(capsys, "graft", "--from", str(src), "--into",
                             str(fx.get("no-nextn-q8.gguf")), "--out", str(out),
                             "--mtp-precision", "match")
    assert status == 0, err
    assert fx.acceptance(out) == fx.acceptance(fx.get("good-q8.gguf"))
    out = tmp_path / "from-gguf"
    status, _, err = run_cli(capsys, "graft", "--from", str(fx.get("good.gguf")), "--into",
                             str(fx.get("dropped")), "--out", str(out))
    assert status == 0, err
    assert fx.acceptance(out) == fx.acceptance(src)


@needs_quant
def test_graft_match_quantizes_head_like_target(fx, capsys, tmp_path):
    pytest.importorskip("mtpkit.quant.pack")
    out = tmp_path / "matched"
    status, rep, err = run_cli(capsys, "graft", "--from", str(fx.source("qwen3_5_vlm")),
                               "--into", str(fx.get("w4a16-mtp-not-ignored")), "--out", str(out),
                               "--mtp-precision", "match")
    # a 4-bit head is what "match" means for a W4A16 target: doctor warns about it
    assert status == 1 and codes(rep) == {"int4-mtp-head"}, (err, rep["findings"])
    assert fx.acceptance(out)[0] > 0.3


def test_outputs_are_atomic_and_never_overwrite(fx, capsys, tmp_path):
    bad = fx.get("unindexed")
    out = tmp_path / "fixed"
    assert run_cli(capsys, "fix-config", str(bad), "--out", str(out))[0] == 0
    stamp = tree_digest(out)
    code = main(["fix-config", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--force" in err and "Traceback" not in err
    assert tree_digest(out) == stamp
    assert main(["fix-config", str(bad), "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    # writing into the input folder is refused
    code = main(["fix-config", str(bad), "--out", str(bad / "inner")])
    assert code == 2 and "inputs are never modified" in capsys.readouterr().err
    # no temporary folders are left behind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("argv,message", [
    (["doctor", "/nonexistent/ckpt"], "no such checkpoint"),
    (["graft", "--into", "/nonexistent/a", "--out", "/tmp/x"], "--from"),
    (["doctor", "__FILE__"], "not a checkpoint folder"),
])
def test_user_mistakes_are_one_clear_line(capsys, tmp_path, argv, message):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    argv = [str(f) if a == "__FILE__" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_engine_option_applies_that_engines_rules(fx, capsys):
    bad = str(fx.get("w4a16-ignore-ondisk"))
    if not HAVE_QUANT:
        pytest.skip("mtpkit.quant is not importable yet")
    # vLLM honours every-shard ignore lists; SGLang's Qwen3.5 MTP class does not
    assert run_cli(capsys, "doctor", bad, "--engine", "vllm")[0] == 0
    status, rep, _ = run_cli(capsys, "doctor", bad, "--engine", "sglang")
    assert status == 2 and "ignore-shards-not-fused" in codes(rep)
    # mtpkit decides precision from the tensors: the ignore list does not matter to it
    assert run_cli(capsys, "doctor", bad, "--engine", "mtpkit")[0] == 0


def test_rich_table_output(fx, capsys):
    assert main(["doctor", str(fx.get("dropped"))]) == 2
    out = capsys.readouterr().out
    assert "mtp-missing" in out and "mtpkit graft" in out and "broken" in out


def test_measure_verdicts():
    def m(rate):
        return Measurement("x", [rate], 1000, True)

    rep = Report("x")
    judge(rep, m(0.01))
    assert rep.codes() == {"mtp-acceptance-zero"}
    rep = Report("x")
    judge(rep, m(0.40), m(0.70))
    assert rep.codes() == {"mtp-acceptance-drift"} and rep.exit_code == 1
    rep = Report("x")
    judge(rep, m(0.68), m(0.70))
    assert rep.codes() == {"mtp-acceptance-ok"} and rep.exit_code == 0
    rep = Report("x")
    judge(rep, Measurement("x", [], 0, False, "no head"))
    assert rep.codes() == {"measure-failed"}



@pytest.mark.parametrize("mtp, flagged", [("w8a16", False), ("same", True)])
def test_head_bits_come_from_the_heads_own_config_group(fx, capsys, tmp_path, mtp, flagged):
    # A --mtp w8a16 head under a w4a16 trunk is int8: its own config group says so (the
    # first group, the trunk's, says 4 bits).
    if not HAVE_QUANT:
        pytest.skip("mtpkit.quant is not importable yet")
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(fx.source("qwen3_5_vlm")), "--scheme", "w4a16",
                 "--group-size", "32", "--mtp", mtp, "--out", str(out)]) == 0
    capsys.readouterr()
    _, rep, _ = run_cli(capsys, "doctor", str(out))
    assert ("int4-mtp-head" in codes(rep)) == flagged, rep["findings"]
