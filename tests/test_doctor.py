"""mtpkit doctor / graft / fix-config, and the engines' runtime-name rules they rest on."""

from __future__ import annotations

import pytest

from mtpkit.checkpoint.runtime_names import (
    IgnoreStatus,
    describe,
    ignore_list_for,
    ignore_status,
    is_ignored,
    runtime_module,
)

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
    # a regex on the fused name does not count (only an exact fused name does)
    ("mtp.layers.0.self_attn.q_proj", [r"re:.*qkv_proj$"], "qwen3_5", "vllm", None, Q),
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
    # experts: one fused-MoE module; the fused name, or every expert's projections
    ("mtp.layers.0.mlp.experts.1.up_proj", ["mtp.layers.0.mlp.experts"], "qwen3_5_moe", "vllm",
     {"num_experts": 2}, IG),
    ("mtp.layers.0.mlp.experts.1.up_proj", ["mtp.layers.0.mlp.experts.1.up_proj"],
     "qwen3_5_moe", "vllm", {"num_experts": 2}, CONFLICT),
    ("mtp.layers.0.mlp.experts.1.up_proj", [r"re:mtp\.layers\.0\.mlp\.experts\..*"],
     "qwen3_5_moe", "vllm", {"num_experts": 2}, IG),
    # SGLang's Qwen3.5 MTP class has no packed-modules mapping: shards do not count
    ("mtp.layers.0.self_attn.q_proj", QKV, "qwen3_5", "sglang", None, Q),
    ("mtp.layers.0.self_attn.q_proj", ["mtp.layers.0.self_attn.qkv_proj"], "qwen3_5", "sglang",
     None, IG),
    # SGLang builds the DeepSeek MTP block as model.decoder
    ("model.layers.61.mlp.down_proj", ["model.layers.61.mlp.down_proj"], "deepseek_v3",
     "sglang", DS, Q),
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
