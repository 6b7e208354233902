"""Quantized checkpoints against vLLM's own ignore-list rules, re-implemented here from vLLM
0.33.0's source (not from mtpkit.checkpoint.runtime_names, which they check):

- vllm/model_executor/layers/quantization/utils/config_utils.py, find_matching_patterns and
  is_equal_or_regex_match: an entry matching a module's own name decides it (``re:`` with
  re.match); otherwise a packed module is ignored when every shard is;
- .../compressed_tensors/utils.py, should_ignore_layer (shards that disagree: ValueError) and
  find_matched_target (name, then packed shards, then the class name by substring);
- .../compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py, get_moe_method:
  routed experts are decided by ``{prefix}.0.gate_proj/up_proj/down_proj`` alone;
- .../compressed_tensors/compressed_tensors.py, get_quant_method: a ParallelLMHead is
  quantized only through a target naming it (its class name does not contain "linear");
- the model classes for module prefixes and packed_modules_mapping: deepseek_v2.py
  (DeepseekV2ForCausalLM), deepseek_mtp.py (SharedHead builds ``{layer}.head``, eh_proj is an
  nn.Linear), glm4_moe.py / glm4_moe_mtp.py, qwen3_next.py / qwen3_next_mtp.py,
  qwen3_5.py / qwen3_5_mtp.py (Qwen3_5ForConditionalGeneration's prefix map);
- MiMo-V2-Flash: mimo_v2.py (MiMoV2FlashForCausalLM.packed_modules_mapping: qkv_proj,
  gate_up_proj; MiMoV2Attention builds o_proj with quant_config=None when its prefix holds
  "mtp.layers") and mimo_v2_mtp.py (MiMoV2MultiTokenPredictor builds model.mtp.layers.0 only,
  num_mtp_layers = 1; MiMoV2MTP.load_weights skips every name it has no parameter for, so
  layers 1 and 2 on disk are never read; eh_proj is a ReplicatedLinear without a
  quantization config).

Older releases differ where VllmRules says (fused-name patterns before 0.30.0, heads before
0.20.0, experts before 0.14.0, the text-only Qwen3.5 rename before 0.28.0).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import broken
import pytest
import tiny
import torch
from safetensors import safe_open

from mtpkit.checkpoint.runtime_names import VllmRules, ignore_list_for, ignore_status
from mtpkit.cli import main
from mtpkit.doctor import diagnose, fix_config
from mtpkit.quant.pack import Scheme
from mtpkit.quant.quantize import quantize_checkpoint

# -- vLLM 0.33.0's matching, written out from its source ---------------------------------------


def _match(value: str, target: str) -> bool:
    # config_utils.is_equal_or_regex_match
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target == value


def vllm_ignored(layer: str, ignore: list[str], packed: dict) -> bool:
    """compressed_tensors/utils.should_ignore_layer over find_matching_patterns (0.33.0)."""
    if any(_match(layer, p) for p in ignore):
        return True
    proj = layer.split(".")[-1]
    if proj not in packed:
        return False
    hits = [any(_match(layer.replace(proj, s), p) for p in ignore) for s in packed[proj]]
    if any(hits) and not all(hits):
        raise ValueError(f"Found different quantization schemes for the shards of {layer}")
    return all(hits)


def vllm_targeted(layer: str, cls: str, targets: list[str], packed: dict) -> bool:
    """find_matched_target: the name, every packed shard's name, or the class by substring."""
    if any(_match(layer, t) for t in targets):
        return True
    fused = next((k for k in packed if layer.endswith(k)), None)
    if fused and all(any(_match(layer.replace(fused, s), t) for t in targets)
                     for s in packed[fused]):
        return True
    return any(t.lower() in cls.lower() for t in targets if not t.startswith("re:"))


QKV_GATE_UP = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# packed_modules_mapping of the class each family's trunk (and so its DeepSeek/GLM MTP draft,
# which declares none) and Qwen MTP draft is built with.
PACKED = {
    "deepseek_v3": {"gate_up_proj": ["gate_proj", "up_proj"],
                    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
    "glm4_moe": QKV_GATE_UP,
    "qwen3_next": {**QKV_GATE_UP, "in_proj_qkvz": ["in_proj_qkvz"], "in_proj_ba": ["in_proj_ba"]},
    "qwen3_5_moe": {**QKV_GATE_UP, "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
                    "in_proj_ba": ["in_proj_b", "in_proj_a"]},
    "mimo_v2_flash": QKV_GATE_UP,
}
MTP_PACKED = {"qwen3_next": QKV_GATE_UP, "qwen3_5_moe": QKV_GATE_UP}
# The loaders' stacked_params_mapping: on-disk leaf -> the packed module it is loaded into.
SHARD_OF = {s: fused for m in PACKED.values() for fused, shards in m.items() for s in shards
            if s != fused}


def built_modules(names: list[str], cfg: dict, model_type: str) -> dict:
    """runtime prefix -> (kind, mtp, on-disk modules) for every module vLLM may quantize."""
    text = cfg.get("text_config", cfg)
    n_layer = text["num_hidden_layers"]
    vlm = (cfg.get("architectures") or [""])[0].endswith("ForConditionalGeneration")
    out: dict[str, tuple[str, bool, set]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and module.endswith(".mlp.experts"):
            pass  # stacked experts: the module itself
        elif leaf not in ("weight", "weight_packed", "weight_scale", "weight_shape",
                          "weight_zero_point"):
            continue
        else:
            leaf_mod = module.rsplit(".", 1)[-1]
            if leaf_mod in ("eh_proj", "gate", "shared_expert_gate", "embed_tokens", "A_log",
                            "conv1d", "dt_bias") or "norm" in leaf_mod or "visual" in module:
                continue  # nn.Linear, GateLinear, quant_config=None, embeddings, non-linear
        rt, mtp = module, False
        if module.startswith("mtp."):
            mtp = True
        elif m := re.match(r"model\.mtp\.layers\.(\d+)\.(.+)$", module):
            mtp = True
            if int(m[1]) >= 1:
                continue  # MiMoV2MultiTokenPredictor builds layer 0 only
            if m[2] == "self_attn.o_proj":
                out.setdefault(rt, ("float", mtp, set()))[2].add(module)
                continue  # MiMoV2Attention: quant_config=None under "mtp.layers"
        elif m := re.match(r"model\.layers\.(\d+)\.(.+)$", module):
            mtp = int(m[1]) >= n_layer
            if mtp and m[2] == "shared_head.head":
                rt = f"model.layers.{m[1]}.head"  # deepseek_mtp.SharedHead
        if not mtp and vlm:  # Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper
            rt = rt.replace("model.language_model.", "language_model.model.", 1)
            rt = "language_model.lm_head" if rt == "lm_head" else rt
        kind = "linear"
        if m := re.match(r"(.+\.mlp\.experts)(\.\d+\.\w+)?$", rt):
            rt, kind = m[1], "experts"
        elif rt.endswith(("lm_head", ".head")):
            kind = "head"
        else:
            prefix, _, last = rt.rpartition(".")
            fused = SHARD_OF.get(last)
            packed = (MTP_PACKED.get(model_type, PACKED[model_type]) if mtp
                      else PACKED[model_type])
            if fused and fused in packed:
                rt = f"{prefix}.{fused}"
        out.setdefault(rt, (kind, mtp, set()))[2].add(module)
    return out


def vllm_builds_quantized(rt: str, kind: str, mtp: bool, qc: dict, model_type: str) -> bool:
    """Whether vLLM 0.33.0 builds this module quantized (ValueError where it refuses)."""
    ignore = list(qc.get("ignore") or [])
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    packed = MTP_PACKED.get(model_type, PACKED[model_type]) if mtp else PACKED[model_type]
    if kind == "float":
        return False  # built without a quantization config
    if kind == "experts":
        probes = [f"{rt}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        decided = {not vllm_ignored(p, ignore, packed)
                   and vllm_targeted(p, "RoutedExperts", targets + (
                       ["RoutedExperts"] if "Linear" in targets else []), packed)
                   for p in probes}
        if len(decided) > 1:
            raise ValueError(f"{rt}: All MoE projections need to have same quantization scheme")
        return decided.pop()
    if vllm_ignored(rt, ignore, packed):
        return False
    return vllm_targeted(rt, "ParallelLMHead" if kind == "head" else "RowParallelLinear",
                         targets, packed)


def stored_quantized(folder: Path, modules: set) -> bool:
    """Whether these on-disk modules are stored quantized (all alike: asserted)."""
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    kinds = {any(n.startswith(m + ".") and n.rsplit(".", 1)[-1] in (
        "weight_packed", "weight_scale") for n in names) for m in modules}
    assert len(kinds) == 1, f"{sorted(modules)[:3]}: stored partly quantized"
    return kinds.pop()


def assert_vllm_loads(folder: Path, model_type: str, mtp_experts: bool = True) -> int:
    """Every module vLLM builds is built as it is stored; returns how many were checked
    (``mtp_experts``: the head's MLP is MoE, and its experts must have been seen)."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    names = []
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    built = built_modules(names, cfg, model_type)
    wrong = {}
    for rt, (kind, mtp, mods) in built.items():
        want = stored_quantized(folder, mods)
        got = vllm_builds_quantized(rt, kind, mtp, qc, model_type)
        if got != want:
            wrong[rt] = f"stored {'quantized' if want else 'float'}, built " \
                        f"{'quantized' if got else 'float'}"
    assert not wrong, wrong
    assert any(mtp for _, mtp, _ in built.values()), "no MTP module seen"
    if mtp_experts:
        assert any(k == "experts" and mtp for k, mtp, _ in built.values()), \
            "no MTP experts seen"
    return len(built)


# -- tiny MoE checkpoints with MTP experts, stored one by one and stacked ------------------------


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.25,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return Qwen3_5MoeForCausalLM(cfg)


MOE_FAMILIES = {
    "qwen3_next": next(f for f in tiny.FAMILIES if f.name == "qwen3_next_moe"),
    "glm4_moe": next(f for f in tiny.FAMILIES if f.name == "glm4_moe"),
    "deepseek_v3": next(f for f in tiny.FAMILIES if f.name == "deepseek_v3"),
    "qwen3_5_moe": tiny.Family("qwen3_5_moe", _qwen3_5_moe,
                               mtp_config_key="mtp_num_hidden_layers", vlm_layout=True),
}


def _unstack(folder: Path) -> None:
    # transformers may save Qwen3.5-MoE experts stacked; the per-expert layout is the base.
    def fn(tensors):
        out = {}
        for k, v in tensors.items():
            if k.endswith(".mlp.experts.gate_up_proj"):
                half = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :half]
                    out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, half:]
            elif k.endswith(".mlp.experts.down_proj"):
                for e in range(v.shape[0]):
                    out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
            else:
                out[k] = v
        return out

    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.contiguous() for k, v in fn(tensors).items()}, str(f),
                  metadata={"format": "pt"})


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """(family, layout) -> a float checkpoint with a one-layer MTP head whose MLP is MoE."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, layout: str) -> Path:
        key = (family, layout)
        if key in made:
            return made[key]
        if layout == "stacked":
            made[key] = broken.stack_experts(
                get(family, "per-expert"), tmp_path_factory.mktemp(f"{family}-stacked"))
            return made[key]
        fam = MOE_FAMILIES[family]
        out = tmp_path_factory.mktemp(family)
        tiny.write_checkpoint(fam, out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tiny.add_mtp_head(out, fam, steps=0, separate_file=False)
        _unstack(out)
        made[key] = out
        return out

    return get


def _scheme(name: str) -> Scheme:
    return {"w4a16": Scheme("w4a16", 32), "w4a8": Scheme("w4a8", 32), "w8a16": Scheme("w8a16"),
            "w8a8": Scheme("w8a8"), "fp8": Scheme("fp8")}[name]


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("scheme", ["w4a16", "w4a8", "w8a16", "w8a8", "fp8"])
def test_quantize_ignore_list_matches_what_is_float(moe_checkpoints, tmp_path, family, layout,
                                                     scheme):
    src = moe_checkpoints(family, layout)
    out = tmp_path / "q"
    quantize_checkpoint(src, out, _scheme(scheme), mtp="keep", fit_groups=True)
    assert assert_vllm_loads(out, family) > 10
    rep = diagnose(out, ["vllm"])
    codes = rep.codes()
    bad = {"mtp-unquantized-not-ignored", "unquantized-not-ignored", "ignore-shard-conflict",
           "quantized-but-ignored", "ignore-experts-module-name", "quantized-head-not-targeted",
           "ignore-matches-nothing", "ignore-regex-no-match"}
    assert not codes & bad, rep.to_json()
    # DeepSeek/GLM MTP loaders read experts one by one only: quantize writes the MTP
    # layer's experts so whatever the source stored, and the draft loads.
    assert "mtp-experts-stacked-unloadable" not in codes
    assert rep.facts["vllm_versions_ok"]["0.30+"]
    if layout == "stacked" and family in ("glm4_moe", "deepseek_v3"):
        with open(out / "model.safetensors.index.json") as f:
            names = set(json.load(f)["weight_map"])
        mtp = {n for n in names if n.startswith("model.layers.3.mlp.experts.")}
        assert mtp and not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in mtp)
        assert any(n.startswith("model.layers.0.") or n.startswith("model.layers.1.")
                   for n in names if n.endswith(".mlp.experts.gate_up_proj"))  # trunk: as stored


def test_unstacked_mtp_experts_are_the_stacked_ones(moe_checkpoints, tmp_path):
    """--mtp keep writes a stacked DeepSeek MTP layer's experts one by one with the very
    values of the per-expert source; --mtp same quantizes each of them."""
    per, stacked = (moe_checkpoints("deepseek_v3", lay) for lay in ("per-expert", "stacked"))
    out = tmp_path / "keep"
    quantize_checkpoint(stacked, out, Scheme("w8a16"), mtp="keep")

    def tensors(folder):
        got = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()
                            if k.startswith("model.layers.3.mlp.experts.")})
        return got

    want, have = tensors(per), tensors(out)
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[k], have[k]) for k in want)
    same = tmp_path / "same"
    quantize_checkpoint(stacked, same, Scheme("w8a16"), mtp="same")
    assert stored_quantized(same, {"model.layers.3.mlp.experts.0.gate_proj",
                                   "model.layers.3.mlp.experts.1.down_proj"})
    assert_vllm_loads(same, "deepseek_v3")


def test_the_check_fails_on_the_old_ignore_list(moe_checkpoints, tmp_path):
    # The list mtpkit used to write for stacked experts: no experts.0.* entry, the experts
    # module by name. vLLM builds the MTP experts quantized over float weights.
    out = tmp_path / "q"
    quantize_checkpoint(moe_checkpoints("deepseek_v3", "stacked"), out, Scheme("w4a16", 32),
                        fit_groups=True)
    cfg = json.loads((out / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    old = [e for e in ignore if ".experts.0." not in e] + ["model.layers.3.mlp.experts"]
    cfg["quantization_config"]["ignore"] = old
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError, match="model.layers.3.mlp.experts"):
        assert_vllm_loads(out, "deepseek_v3")
    rep = diagnose(out, ["vllm"])
    assert "ignore-experts-module-name" in rep.codes()
    f = next(f for f in rep.findings if f.code == "ignore-experts-module-name")
    assert "fix-config" in f.fix and "0% draft acceptance" in f.why
    # fix-config writes the experts.0.* names and the check passes
    fixed = fix_config(out, tmp_path / "fixed").out
    assert_vllm_loads(fixed, "deepseek_v3")
    assert "ignore-experts-module-name" not in diagnose(fixed, ["vllm"]).codes()


def _reindex(folder: Path) -> Path:
    weight_map = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            weight_map.update({k: f.name for k in h.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_mtp_same_keeps_deepseek_head_float(moe_checkpoints, tmp_path):
    # --mtp same quantizes the MTP layer but not its shared_head.head: vLLM builds it as a
    # ParallelLMHead (model.layers.3.head) that a "Linear" target never reaches.
    for lm_head in ("keep", "same"):
        out = tmp_path / f"q-{lm_head}"
        quantize_checkpoint(moe_checkpoints("deepseek_v3", "per-expert"), out, Scheme("w8a16"),
                            mtp="same", lm_head=lm_head)
        assert not stored_quantized(out, {"model.layers.3.shared_head.head"})
        assert stored_quantized(out, {"model.layers.3.mlp.experts.0.gate_proj"})
        assert stored_quantized(out, {"lm_head"}) == (lm_head == "same")
        assert_vllm_loads(out, "deepseek_v3")


def test_quantized_head_not_targeted(moe_checkpoints, tmp_path):
    # A DeepSeek MTP head stored quantized and targeted by its on-disk name: vLLM names the
    # module model.layers.3.head, so it builds a float head over packed tensors.
    out = tmp_path / "q"
    quantize_checkpoint(moe_checkpoints("deepseek_v3", "per-expert"), out, Scheme("w8a16"),
                        mtp="same", lm_head="same")

    def fn(t):
        t.pop("model.layers.3.shared_head.head.weight", None)
        for k in [k for k in t if k.startswith("lm_head.")]:
            t["model.layers.3.shared_head.head." + k[len("lm_head."):]] = t[k].clone()
        return t

    edited = _reindex(broken.edit_tensors(out, tmp_path / "e", fn))
    cfg = json.loads((edited / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["targets"] = ["Linear", "lm_head", "model.layers.3.shared_head.head"]
    # quantize listed the float copy it wrote as ignored; the edited one is quantized
    cfg["quantization_config"]["ignore"] = [e for e in cfg["quantization_config"]["ignore"]
                                            if e not in ("model.layers.3.head",
                                                         "model.layers.3.shared_head.head")]
    (edited / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError, match=r"model\.layers\.3\.head"):
        assert_vllm_loads(edited, "deepseek_v3")
    rep = diagnose(edited, ["vllm"])
    f = next(f for f in rep.findings if f.code == "quantized-head-not-targeted")
    assert "model.layers.3.head" in f.what and f.severity == "error"
    # named by its runtime name, vLLM quantizes it
    group["targets"].append("model.layers.3.head")
    (edited / "config.json").write_text(json.dumps(cfg))
    assert_vllm_loads(edited, "deepseek_v3")
    assert "quantized-head-not-targeted" not in diagnose(edited, ["vllm"]).codes()
    # vLLM before 0.20.0 quantizes no head at all
    old = diagnose(edited, ["vllm"], vllm_version="0.19")
    assert "lm_head" in next(f for f in old.findings
                             if f.code == "quantized-head-not-targeted").what


# -- one rule at a time, by version --------------------------------------------------------------


def test_fused_regex_depends_on_version():
    ignore = [r"re:mtp\.layers\.0\.self_attn\.qkv_proj$"]
    args = ("mtp.layers.0.self_attn.q_proj", ignore, "qwen3_5")
    assert ignore_status(*args, vllm_version="0.30").value == "ignored"
    assert ignore_status(*args, vllm_version="0.29.0").value == "quantized"
    assert ignore_status(*args).value == "ignored"
    # vLLM's own matching agrees (0.33.0)
    assert vllm_ignored("mtp.layers.0.self_attn.qkv_proj", ignore, QKV_GATE_UP)


def test_experts_rules_by_version():
    cfg = {"num_experts": 4}
    probes = [f"mtp.layers.0.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    disk = "mtp.layers.0.mlp.experts.2.up_proj"
    assert ignore_status(disk, probes, "qwen3_5_moe", config=cfg).value == "ignored"
    assert ignore_status(disk, probes, "qwen3_5_moe", config=cfg,
                         vllm_version="0.13").value == "quantized"
    # stacked: the module on disk is ...mlp.experts, decided the same way
    assert ignore_status("mtp.layers.0.mlp.experts", probes, "qwen3_5_moe").value == "ignored"
    assert ignore_status("mtp.layers.0.mlp.experts", ["mtp.layers.0.mlp.experts"],
                         "qwen3_5_moe").value == "quantized"
    # ignore_list_for writes the three names for either layout, all experts or none
    assert set(probes) <= set(ignore_list_for(["mtp.layers.0.mlp.experts"], "qwen3_5_moe"))
    per = [f"mtp.layers.0.mlp.experts.{e}.{p}" for e in range(4)
           for p in ("gate_proj", "up_proj", "down_proj")]
    assert set(probes) <= set(ignore_list_for(per, "qwen3_5_moe", config=cfg))
    with pytest.raises(ValueError, match="every expert"):
        ignore_list_for(per[3:], "qwen3_5_moe", config=cfg)


def test_text_only_qwen35_prefix_map():
    cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
           "num_hidden_layers": 4}
    disk = "model.language_model.layers.0.mlp.down_proj"
    assert ignore_status(disk, [disk], "qwen3_5_text", config=cfg).value == "ignored"
    # re: patterns are never renamed; before 0.28.0 the class maps nothing
    assert ignore_status(disk, [r"re:model\.language_model\.layers\.0\..*"], "qwen3_5_text",
                         config=cfg).value == "quantized"
    assert ignore_status(disk, ["model.layers.0.mlp.down_proj"], "qwen3_5_text", config=cfg,
                         vllm_version="0.27").value == "quantized"
    assert ignore_status(disk, ["model.layers.0.mlp.down_proj"], "qwen3_5_text",
                         config=cfg).value == "ignored"


def test_dsa_indexer_runtime_names():
    """GLM-5's indexer (trunk and MTP layer alike): wq_b is a quantizable linear, wk and
    weights_proj are vLLM's unquantized wk_weights_proj (SGLang: weights_proj alone)."""
    from mtpkit.checkpoint.runtime_names import describe

    cfg = {"model_type": "glm_moe_dsa", "num_hidden_layers": 78}
    for layer, mtp in ((0, False), (78, True)):
        pre = f"model.layers.{layer}.self_attn.indexer"
        q = describe(f"{pre}.wq_b", "glm_moe_dsa", config=cfg)
        assert (q.name, q.quantizable, q.mtp) == (f"{pre}.wq_b", True, mtp)
        assert ignore_status(f"{pre}.wq_b", [], "glm_moe_dsa", config=cfg).value == "quantized"
        for leaf in ("wk", "weights_proj"):
            rt = describe(f"{pre}.{leaf}", "glm_moe_dsa", config=cfg)
            assert (rt.name, rt.quantizable, rt.mtp) == (f"{pre}.wk_weights_proj", False, mtp)
            assert ignore_status(f"{pre}.{leaf}", [], "glm_moe_dsa",
                                 config=cfg).value == "not-quantizable"
        assert not describe(f"{pre}.k_norm", "glm_moe_dsa", config=cfg).quantizable
    pre = "model.layers.78.self_attn.indexer"
    assert describe(f"{pre}.wk", "glm_moe_dsa", "sglang", config=cfg).quantizable
    assert not describe(f"{pre}.weights_proj", "glm_moe_dsa", "sglang", config=cfg).quantizable
    # Another MLA family's module of that name is not touched.
    assert describe(f"{pre}.wk", "glm4_moe_lite", config=cfg).name == f"{pre}.wk"


def test_rules_listed():
    assert any("exact fused name" in r for r in VllmRules.of("0.29").applied())
    assert any("re: included" in r for r in VllmRules.of("0.30.1").applied())
    with pytest.raises(ValueError, match="0.30"):
        VllmRules.of("latest")


# -- doctor on hand-made cases -------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_w4(tmp_path_factory, moe_checkpoints):
    out = tmp_path_factory.mktemp("qwen-w4") / "q"
    quantize_checkpoint(moe_checkpoints("qwen3_next", "per-expert"), out, Scheme("w4a16", 32),
                        fit_groups=True)
    return out


def _with_ignore(src: Path, out: Path, fn) -> Path:
    def edit(cfg):
        cfg["quantization_config"]["ignore"] = fn(cfg["quantization_config"]["ignore"])
    return broken.edit_config(src, out, edit)


def test_doctor_fused_regex_and_versions(qwen_w4, tmp_path, capsys):
    # The MTP attention's fused module ignored by a pattern on its fused name only.
    def fn(ignore):
        keep = [e for e in ignore if not re.search(r"mtp\.layers\.0\.self_attn\.(q|k|v|qkv)_proj$",
                                                   e)]
        return keep + [r"re:mtp\.layers\.0\.self_attn\.qkv_proj$"]

    out = _with_ignore(qwen_w4, tmp_path / "rx", fn)
    latest = diagnose(out, ["vllm"])
    assert "ignore-regex-no-match" not in latest.codes()  # no false alarm on 0.30+
    assert "mtp-unquantized-not-ignored" not in latest.codes()
    rng = next(f for f in latest.findings if f.code == "vllm-version-range")
    assert "0.30+" in rng.what and "0.28-0.29" in rng.what
    assert latest.facts["vllm_versions_ok"] == {"0.14-0.19": False, "0.20-0.27": False,
                                               "0.28-0.29": False, "0.30+": True}
    old = diagnose(out, ["vllm"], vllm_version="0.29")
    assert "ignore-fused-regex-old-vllm" in old.codes()
    assert old.facts["vllm_rules"][0] == "vLLM 0.29.0"
    # the CLI flag, and a malformed version as one error line
    assert main(["doctor", str(out), "--engine", "vllm", "--vllm-version", "0.29",
                 "--json"]) == 2
    assert "ignore-fused-regex-old-vllm" in capsys.readouterr().out
    assert main(["doctor", str(out), "--vllm-version", "newest"]) != 0


def test_doctor_regex_on_renamed_prefix(tmp_path, moe_checkpoints):
    out = tmp_path / "q"
    quantize_checkpoint(moe_checkpoints("qwen3_5_moe", "per-expert"), out, Scheme("w8a16"))
    # A trunk module kept float, listed by a pattern on its on-disk (VLM) prefix.
    def fn(ignore):
        return [*ignore, r"re:model\.language_model\.layers\.0\.linear_attn\.out_proj"]

    def tensors(t):
        name = "model.language_model.layers.0.linear_attn.out_proj"
        w = torch.randn(64, 64)
        for s in ("weight_packed", "weight_scale", "weight_shape", "weight"):
            t.pop(f"{name}.{s}", None)
        t[f"{name}.weight"] = w.to(torch.bfloat16)
        return t

    edited = broken.edit_tensors(_with_ignore(out, tmp_path / "e1", fn), tmp_path / "e2",
                                 tensors)
    rep = diagnose(_reindex(edited), ["vllm"])
    assert "ignore-regex-renamed-prefix" in rep.codes()
    assert "unquantized-not-ignored" in rep.codes()


def test_doctor_no_vllm_mtp_class(tmp_path, moe_checkpoints):
    out = broken.edit_config(moe_checkpoints("deepseek_v3", "per-expert"), tmp_path / "v2",
                             lambda c: c.update(model_type="kimi_k2"))
    rep = diagnose(out, ["vllm"])
    assert "engine-no-mtp-class" in rep.codes()
    assert "engine-no-mtp-class" not in diagnose(moe_checkpoints("deepseek_v3", "per-expert"),
                                                 ["vllm"]).codes()


# -- MiMo-V2-Flash: MTP layers under model.mtp.layers.{i}, vLLM drafting with layer 0 ------------


@pytest.fixture(scope="module")
def mimo_v2(tmp_path_factory):
    """A float MiMo-V2-Flash checkpoint with its three MTP layers in the release's names."""
    fam = next(f for f in tiny.FAMILIES if f.name == "mimo_v2_flash")
    out = tmp_path_factory.mktemp("mimo_v2_flash")
    tiny.write_checkpoint(fam, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny.add_mtp_head(out, fam, steps=0, separate_file=False, layers=3)
    return out


MIMO_V2_LAYER0 = ("model.mtp.layers.0.self_attn.qkv_proj", "model.mtp.layers.0.mlp.gate_up_proj",
                  "model.mtp.layers.0.mlp.down_proj")
_DOCTOR_BAD = {"mtp-missing", "mtp-unquantized-not-ignored", "unquantized-not-ignored",
               "ignore-shard-conflict", "quantized-but-ignored", "ignore-matches-nothing",
               "ignore-regex-no-match", "mtp-incomplete", "mtp-config-mismatch"}


@pytest.mark.parametrize("mtp", ["keep", "same"])
def test_mimo_v2_quantize_mtp(mimo_v2, tmp_path, mtp):
    out = tmp_path / "q"
    quantize_checkpoint(mimo_v2, out, Scheme("w8a16"), mtp=mtp)
    assert assert_vllm_loads(out, "mimo_v2_flash", mtp_experts=False) > 10
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    layer0 = {"model.mtp.layers.0.self_attn.q_proj", "model.mtp.layers.0.mlp.gate_proj",
              "model.mtp.layers.0.mlp.down_proj"}
    # o_proj and eh_proj: built float by vLLM, so kept float (and listed) either way.
    float_always = {"model.mtp.layers.0.self_attn.o_proj", "model.mtp.layers.0.eh_proj"}
    assert not stored_quantized(out, float_always)
    assert float_always <= set(ignore)
    if mtp == "keep":
        assert not stored_quantized(out, layer0 | {"model.mtp.layers.2.self_attn.q_proj"})
        # vLLM's names (fused) and the on-disk ones, for every MTP layer stored
        assert set(MIMO_V2_LAYER0) <= set(ignore)
        assert "model.mtp.layers.2.self_attn.qkv_proj" in ignore
        assert "model.mtp.layers.2.self_attn.v_proj" in ignore
    else:
        assert stored_quantized(out, layer0)
        assert not set(MIMO_V2_LAYER0) & set(ignore)
    rep = diagnose(out, ["vllm"])
    assert rep.facts["mtp_layers_stored"] == 3
    assert not rep.codes() & _DOCTOR_BAD, rep.to_json()
    assert rep.exit_code == 0, rep.to_json()


def test_mimo_v2_ignore_list_missing_mtp(mimo_v2, tmp_path):
    # A release whose ignore list names no MTP module, the MTP layers stored float: vLLM builds
    # layer 0's attention and MLP quantized over float weights (0% acceptance).
    out = tmp_path / "q"
    quantize_checkpoint(mimo_v2, out, Scheme("w8a16"), mtp="keep")
    bad = _with_ignore(out, tmp_path / "bad",
                       lambda ignore: [e for e in ignore if ".mtp." not in e])
    with pytest.raises(AssertionError, match=r"model\.mtp\.layers\.0\.self_attn\.qkv_proj"):
        assert_vllm_loads(bad, "mimo_v2_flash", mtp_experts=False)
    rep = diagnose(bad, ["vllm"])
    f = next(f for f in rep.findings if f.code == "mtp-unquantized-not-ignored")
    assert all(name in f.what for name in MIMO_V2_LAYER0), f.what
    # layers 1 and 2 are never built by vLLM, o_proj and eh_proj never quantized
    assert ".layers.1." not in f.what and ".layers.2." not in f.what
    assert "o_proj" not in f.what and "eh_proj" not in f.what
    assert rep.exit_code == 2
    fixed = fix_config(bad, tmp_path / "fixed").out
    assert_vllm_loads(fixed, "mimo_v2_flash", mtp_experts=False)
    assert "mtp-unquantized-not-ignored" not in diagnose(fixed, ["vllm"]).codes()
    # Entries for layer 0 only are enough for vLLM: layers 1 and 2 are not read.
    only0 = _with_ignore(out, tmp_path / "only0", lambda ignore: [
        e for e in ignore if not re.match(r"model\.mtp\.layers\.[12]\.", e)])
    assert_vllm_loads(only0, "mimo_v2_flash", mtp_experts=False)
    assert not diagnose(only0, ["vllm"]).codes() & _DOCTOR_BAD


# SGLang's MiMo-V2-Flash MTP, re-implemented from sgl-project/sglang's
# python/sglang/srt/models/mimo_v2_flash_nextn.py (MiMoV2MTP, MiMoV2ModelNextN,
# MiMoV2MTPLayer) and mimo_v2_flash.py (MiMoV2Attention, MiMoV2MLP):
# - one block, built with the prefix "model.decoder": qkv_proj (QKVParallelLinear), o_proj
#   (RowParallelLinear, with the quantization config), gate_up_proj / down_proj (a dense
#   MiMoV2MLP); eh_proj is a plain nn.Linear;
# - map_model_name_to_mtp_param_name sends model.mtp.layers.{i}.* to the one block for
#   every i;
# - no packed_modules_mapping on MiMoV2FlashForCausalLM / MiMoV2MTP, so compressed-tensors'
#   ignore check sees the fused prefix alone: an exact entry equal to it, or a re: pattern
#   matching it, keeps the module float; the quantization config's "Linear" targets do the
#   rest.
SGLANG_MIMO_V2_BLOCK = {
    "model.decoder.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "model.decoder.self_attn.o_proj": ("o_proj",),
    "model.decoder.mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "model.decoder.mlp.down_proj": ("down_proj",),
}


def sglang_mimo_v2_mtp_wrong(folder: Path, layers: int) -> dict:
    """The SGLang MTP modules built otherwise than the stored layers hold them."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    wrong = {}
    for prefix, leaves in SGLANG_MIMO_V2_BLOCK.items():
        ignored = any(e == prefix or e.startswith("re:") and re.match(e[3:], prefix)
                      for e in qc["ignore"])
        sub = prefix.split(".", 2)[2]  # self_attn.qkv_proj
        parent = sub.rsplit(".", 1)[0]
        for i in range(layers):  # every stored layer loads into the block
            stored = stored_quantized(folder, {f"model.mtp.layers.{i}.{parent}.{leaf}"
                                               for leaf in leaves})
            if stored == ignored:
                wrong[f"{prefix} <- layer {i}"] = "quantized" if stored else "float"
    return wrong


@pytest.mark.parametrize("mtp", ["keep", "same"])
def test_sglang_builds_mimo_v2_mtp_as_quantize_stores_it(mimo_v2, tmp_path, mtp):
    out = tmp_path / "q"
    quantize_checkpoint(mimo_v2, out, Scheme("w8a16"), mtp=mtp)
    assert sglang_mimo_v2_mtp_wrong(out, 3) == {}
    rep = diagnose(out, ["sglang"])
    assert not rep.codes() & _DOCTOR_BAD, rep.to_json()
    assert "sglang-one-mtp-layer" in rep.codes()  # three layers into one block
    assert "sglang-one-mtp-layer" not in diagnose(out, ["vllm"]).codes()


def test_sglang_mimo_v2_needs_its_own_names_in_the_ignore_list(mimo_v2, tmp_path):
    """The on-disk and vLLM names alone leave SGLang's block quantized over float weights
    (SGLang renames no ignore entry for this family); doctor says so and fix-config adds
    the model.decoder names."""
    out = tmp_path / "q"
    quantize_checkpoint(mimo_v2, out, Scheme("w8a16"), mtp="keep")
    bad = _with_ignore(out, tmp_path / "bad",
                       lambda ignore: [e for e in ignore if not e.startswith("model.decoder.")])
    assert set(sglang_mimo_v2_mtp_wrong(bad, 3)) >= {
        "model.decoder.self_attn.qkv_proj <- layer 0", "model.decoder.mlp.down_proj <- layer 0"}
    assert_vllm_loads(bad, "mimo_v2_flash", mtp_experts=False)  # vLLM is served already
    rep = diagnose(bad, ["sglang"])
    f = next(f for f in rep.findings if f.code == "mtp-unquantized-not-ignored")
    assert "model.decoder.self_attn.qkv_proj" in f.what and "eh_proj" not in f.what
    fixed = fix_config(bad, tmp_path / "fixed").out
    assert sglang_mimo_v2_mtp_wrong(fixed, 3) == {}
    assert "mtp-unquantized-not-ignored" not in diagnose(fixed, ["sglang"]).codes()


def test_mimo_v2_runtime_names():
    from mtpkit.checkpoint.runtime_names import describe, vllm_mtp_class

    cfg = {"model_type": "mimo_v2_flash", "num_hidden_layers": 4}
    qkv = describe("model.mtp.layers.0.self_attn.k_proj", "mimo_v2_flash", config=cfg)
    assert (qkv.name, qkv.mtp, qkv.built) == ("model.mtp.layers.0.self_attn.qkv_proj", True,
                                              True)
    assert not describe("model.mtp.layers.0.self_attn.o_proj", "mimo_v2_flash",
                        config=cfg).quantizable
    assert not describe("model.mtp.layers.0.eh_proj", "mimo_v2_flash", config=cfg).quantizable
    later = describe("model.mtp.layers.2.mlp.up_proj", "mimo_v2_flash", config=cfg)
    assert (later.name, later.built) == ("model.mtp.layers.2.mlp.gate_up_proj", False)
    assert ignore_status("model.mtp.layers.2.mlp.up_proj", [], "mimo_v2_flash",
                         config=cfg).value == "not-quantizable"
    assert ignore_status("model.mtp.layers.0.mlp.up_proj", [], "mimo_v2_flash",
                         config=cfg).value == "quantized"
    assert ignore_status("model.mtp.layers.0.mlp.up_proj", [MIMO_V2_LAYER0[1]], "mimo_v2_flash",
                         config=cfg).value == "ignored"
    # vLLM's own matching agrees (the trunk class's packed mapping reaches the draft)
    assert vllm_ignored(MIMO_V2_LAYER0[1], ["model.mtp.layers.0.mlp.gate_proj",
                                            "model.mtp.layers.0.mlp.up_proj"], QKV_GATE_UP)
    assert vllm_mtp_class("mimo_v2_flash") == "MiMoV2MTP"
    # the trunk's modules are not MTP
    assert not describe("model.layers.3.self_attn.q_proj", "mimo_v2_flash", config=cfg).mtp


# -- Step-3.5/3.7-Flash: vLLM's Step3p5MTP builds every MTP layer, its block as mtp_block ------
# Read from vllm-project/vllm's step3p5.py (Step3p5ForCausalLM: packed q/k/v and gate/up,
# hf_to_vllm_mapper ".share_expert." -> ".moe.share_expert.", the router an fp32
# ReplicatedLinear without a quantization config, stacked moe.{gate,up,down}_proj loaded into
# one FusedMoE "moe.experts") and step3p5_mtp.py (Step3p5MTP: layers model.layers.{L + i}
# with enorm / hnorm / a quantizable eh_proj / shared_head.head from shared_head.output, every
# other weight renamed into model.layers.{L + i}.mtp_block.*, ".transformer." dropped).

STEP_CFG = {"model_type": "step3p7", "text_config": {"model_type": "step3p5",
                                                     "num_hidden_layers": 4}}


def test_step_runtime_names():
    from mtpkit.checkpoint.runtime_names import describe, map_ignore_entries, vllm_mtp_class

    def rt(name):
        return describe(name, "step3p7", config=STEP_CFG)

    q = rt("model.layers.4.self_attn.q_proj")
    assert (q.name, q.mtp, q.shards[0]) == ("model.layers.4.mtp_block.self_attn.qkv_proj", True,
                                            "model.layers.4.mtp_block.self_attn.q_proj")
    assert rt("model.layers.6.mlp.down_proj").name == "model.layers.6.mtp_block.mlp.down_proj"
    assert rt("model.layers.5.transformer.self_attn.g_proj").name \
        == "model.layers.5.mtp_block.self_attn.g_proj"
    eh = rt("model.layers.4.eh_proj")
    assert eh.quantizable and eh.mtp and eh.name == "model.layers.4.eh_proj"
    head = rt("model.layers.4.transformer.shared_head.output")
    assert (head.name, head.kind) == ("model.layers.4.shared_head.head", "head")
    assert not rt("model.layers.1.moe.gate").quantizable
    experts = rt("model.layers.1.moe.up_proj")
    assert experts.kind == "experts" and experts.name == "model.layers.1.moe.experts"
    assert "model.layers.1.moe.experts.0.down_proj" in experts.shards
    shared = rt("model.layers.1.share_expert.up_proj")
    assert shared.name == "model.layers.1.moe.share_expert.gate_up_proj" and not shared.mtp
    assert not rt("model.layers.3.self_attn.q_proj").mtp
    # vLLM maps exact entries as it maps the weights: the on-disk name matches
    assert map_ignore_entries(["model.layers.1.share_expert.down_proj", "re:.*share_expert.*",
                               "lm_head"], "step3p7", config=STEP_CFG) == [
        "model.layers.1.moe.share_expert.down_proj", "re:.*share_expert.*", "lm_head"]
    assert ignore_status("model.layers.1.share_expert.down_proj",
                         ["model.layers.1.share_expert.down_proj"], "step3p7",
                         config=STEP_CFG).value == "ignored"
    assert vllm_mtp_class("step3p7") == vllm_mtp_class("step3p5") == "Step3p5MTP"


# SGLang's Step, read from sgl-project/sglang's step3p5.py (Step3p5DecoderLayer: the MoE
# under the prefix "mlp", share_expert at its on-disk name, g_proj and the router built
# without a quantization config, no packed_modules_mapping) and step3p5_mtp.py (Step3p5MTP:
# one draft model a layer, draft_model_idx, its modules at model.enorm / hnorm / eh_proj (a
# plain nn.Linear) / shared_head.head, its block at model.mtp_block).
def test_step_runtime_names_in_sglang():
    from mtpkit.checkpoint.runtime_names import describe

    cfg = {**STEP_CFG, "text_config": {**STEP_CFG["text_config"], "moe_num_experts": 8}}

    def rt(name):
        return describe(name, "step3p7", "sglang", config=cfg)

    q = rt("model.layers.5.self_attn.q_proj")
    assert (q.name, q.shards, q.mtp) == ("model.mtp_block.self_attn.qkv_proj", (), True)
    assert rt("model.layers.6.transformer.shared_head.output").name == "model.shared_head.head"
    assert not rt("model.layers.4.eh_proj").quantizable
    assert not rt("model.layers.0.self_attn.g_proj").quantizable
    assert rt("model.layers.1.share_expert.up_proj").name \
        == "model.layers.1.share_expert.gate_up_proj"
    experts = rt("model.layers.1.moe.down_proj")
    assert experts.name == "model.layers.1.mlp.experts" and len(experts.shards) == 8 * 3
    assert rt("model.layers.0.mlp.up_proj").name == "model.layers.0.mlp.gate_up_proj"


@pytest.fixture(scope="module")
def step(checkpoint_factory):
    return checkpoint_factory("step3p7")


@pytest.mark.parametrize("mtp", ["keep", "same"])
def test_step_quantize_lists_what_vllm_builds(step, tmp_path, mtp):
    out = tmp_path / "q"
    quantize_checkpoint(step, out, Scheme("w8a16"), mtp=mtp)
    ignore = set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    # the router, stacked experts, the vision tower and the per-layer lm_head copies are
    # written as stored: listed, in vLLM's names too
    assert {"model.layers.1.moe.experts.0.gate_proj", "model.layers.4.shared_head.head",
            "vit_large_projector"} <= ignore
    block = {"model.layers.4.mtp_block.self_attn.qkv_proj",
             "model.layers.6.mtp_block.mlp.gate_up_proj"}
    if mtp == "keep":
        assert block <= ignore and "model.layers.4.eh_proj" in ignore
        assert not stored_quantized(out, {"model.layers.4.self_attn.q_proj"})
    else:
        assert not block & ignore
        assert stored_quantized(out, {"model.layers.4.self_attn.q_proj"})
    rep = diagnose(out, ["vllm"])
    assert rep.facts["mtp_layers_stored"] == 3
    assert not rep.codes() & _DOCTOR_BAD, rep.to_json()


def test_step_g_proj_stays_float_for_sglang(step):
    from mtpkit.quant.quantize import _Layout, open_checkpoint

    layout = _Layout(open_checkpoint(step))
    # SGLang builds it without a quantization config, vLLM with one: kept float for both
    assert layout.never_quantized("model.layers.0.self_attn.g_proj")
    assert not layout.never_quantized("model.layers.0.self_attn.q_proj")


def test_step_sglang_needs_its_own_mtp_names(step, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(step, out, Scheme("w8a16"), mtp="keep")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.mtp_block.self_attn.qkv_proj", "model.mtp_block.mlp.gate_up_proj"} \
        <= set(ignore)
    assert not diagnose(out, ["sglang"]).codes() & _DOCTOR_BAD
    bad = _with_ignore(out, tmp_path / "bad",
                       lambda ignore: [e for e in ignore if not e.startswith("model.mtp_block.")])
    rep = diagnose(bad, ["sglang"])
    found = {f.code: f.what for f in rep.findings}
    assert "built as model.mtp_block.self_attn.o_proj" in found["mtp-unquantized-not-ignored"]
    # the on-disk shards do not reach SGLang's fused modules (no packed-modules mapping)
    assert "-> model.mtp_block.self_attn.qkv_proj" in found["ignore-shards-not-fused"]
    assert rep.exit_code == 2
    assert "mtp-unquantized-not-ignored" not in diagnose(bad, ["vllm"]).codes()
    fixed = fix_config(bad, tmp_path / "fixed").out
    assert "mtp-unquantized-not-ignored" not in diagnose(fixed, ["sglang"]).codes()


def test_step_ignore_list_without_mtp_block_names(step, tmp_path):
    # The on-disk names of the MTP block alone: vLLM builds model.layers.{L+i}.mtp_block.*
    # quantized over float weights (0% acceptance); doctor says so, fix-config repairs it.
    out = tmp_path / "q"
    quantize_checkpoint(step, out, Scheme("w8a16"), mtp="keep")
    bad = _with_ignore(out, tmp_path / "bad",
                       lambda ignore: [e for e in ignore if ".mtp_block." not in e])
    rep = diagnose(bad, ["vllm"])
    f = next(f for f in rep.findings if f.code == "mtp-unquantized-not-ignored")
    assert "built as model.layers.4.mtp_block.self_attn.qkv_proj" in f.what
    # every layer is drafted with: q, k, v, o, g, gate, up, down in each of the three
    assert f.what.startswith("24 MTP modules")
    assert rep.exit_code == 2
    fixed = fix_config(bad, tmp_path / "fixed").out
    assert "mtp-unquantized-not-ignored" not in diagnose(fixed, ["vllm"]).codes()


DSV4_CFG = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "n_routed_experts": 4}


def test_deepseek_v4_runtime_names():
    """vLLM's DeepseekV4ForCausalLM / DeepSeekV4MTP module names for the release's names:
    fused wq_a + wkv and shared w1 + w3, shared w2 renamed down_proj, float compressors,
    weights_proj and router, experts decided by expert 0's w1 / w3 / w2, MTP layer i at
    model.layers.{L + i} with its block under mtp_block."""
    from mtpkit.checkpoint.runtime_names import (
        describe,
        ignore_list_for,
        ignore_status,
        map_ignore_entries,
        vllm_mtp_class,
    )

    def rt(name):
        return describe(name, "deepseek_v4", config=DSV4_CFG)

    assert vllm_mtp_class("deepseek_v4") == "DeepSeekV4MTP"
    q = rt("layers.0.attn.wkv")
    assert (q.name, q.shards) == ("model.layers.0.attn.fused_wqa_wkv",
                                  ("model.layers.0.attn.wq_a", "model.layers.0.attn.wkv"))
    assert rt("model.layers.0.attn.wq_a").name == q.name  # save_pretrained's model. prefix
    for float_module in ("layers.1.attn.compressor.wgate", "layers.1.attn.indexer.weights_proj",
                         "layers.1.attn.indexer.compressor.wkv", "layers.2.ffn.gate",
                         "mtp.0.enorm", "mtp.0.norm"):
        assert not rt(float_module).quantizable, float_module
    assert rt("layers.1.attn.indexer.wq_b").quantizable
    shared = rt("layers.2.ffn.shared_experts.w3")
    assert shared.name == "model.layers.2.ffn.shared_experts.gate_up_proj"
    assert rt("layers.2.ffn.shared_experts.w2").name == \
        "model.layers.2.ffn.shared_experts.down_proj"
    experts = rt("layers.2.ffn.experts.3.w1")
    assert experts.kind == "experts" and experts.name == "model.layers.2.ffn.experts"
    assert "model.layers.2.ffn.experts.0.w2" in experts.shards
    e = rt("mtp.1.e_proj")
    assert (e.name, e.mtp, e.quantizable) == ("model.layers.5.e_proj", True, True)
    assert rt("mtp.0.attn.wq_a").name == "model.layers.4.mtp_block.attn.fused_wqa_wkv"
    assert rt("mtp.0.ffn.shared_experts.w2").name == \
        "model.layers.4.mtp_block.ffn.shared_experts.down_proj"
    assert (rt("mtp.0.head").name, rt("mtp.0.head").kind) == ("model.layers.4.head", "head")
    assert rt("head").name == "lm_head"
    # The mapper renames exact entries as it renames weights: the trunk's on-disk names
    # reach its modules, an mtp.* name becomes model.mtp.* and reaches nothing the draft
    # builds; the draft's own runtime names do.
    assert map_ignore_entries(["layers.2.ffn.shared_experts.w2", "mtp.0.e_proj", "re:mtp.*"],
                              "deepseek_v4", config=DSV4_CFG) == [
        "model.layers.2.ffn.shared_experts.down_proj", "model.mtp.0.e_proj", "re:mtp.*"]
    assert ignore_status("layers.2.ffn.shared_experts.w2", ["layers.2.ffn.shared_experts.w2"],
                         "deepseek_v4", config=DSV4_CFG) == "ignored"
    assert ignore_status("mtp.0.e_proj", ["mtp.0.e_proj"], "deepseek_v4",
                         config=DSV4_CFG) == "quantized"
    mtp0 = ["mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wkv",
            *(f"mtp.0.ffn.experts.{x}.w{w}" for x in range(4) for w in (1, 2, 3))]
    entries = ignore_list_for(mtp0, "deepseek_v4", config=DSV4_CFG)
    for m in mtp0:
        assert ignore_status(m, entries, "deepseek_v4", config=DSV4_CFG) == "ignored", m
    with pytest.raises(ValueError, match="num_hidden_layers"):
        describe("mtp.0.e_proj", "deepseek_v4")


# SGLang's DeepSeek-V4, read from sgl-project/sglang's deepseek_v4.py (DeepseekV4ForCausalLM:
# remap_weight_name_to_dpsk_hf_format renames the weights attn -> self_attn, ffn -> mlp,
# w1 / w3 / w2 -> gate_proj / up_proj / down_proj; wq_a + wkv loaded into one wqkv_a when
# SGLANG_OPT_FUSE_WQA_WKV (default on), from .weight / .weight_scale_inv only; wo_a built
# with the quantization config only for SGLANG_OPT_FP8_WO_A_GEMM, which asserts FP8 block
# scales; the compressors' wkv_gate a plain parameter; the indexer's weights_proj with
# quant_config=None; no packed_modules_mapping) and deepseek_v4_nextn.py
# (DeepseekV4ForCausalLMNextN: e_proj / h_proj ReplicatedLinear with the quantization config
# at model.*, the block at model.decoder, the head at model.shared_head.head).
def test_deepseek_v4_runtime_names_in_sglang():
    from mtpkit.checkpoint.runtime_names import describe, map_ignore_entries

    def rt(name):
        return describe(name, "deepseek_v4", "sglang", config=DSV4_CFG)

    a = rt("layers.0.attn.wq_a")
    assert (a.name, a.shards, a.loads_quantized) == ("model.layers.0.self_attn.wqkv_a", (),
                                                     False)
    assert rt("model.layers.0.attn.wkv").name == a.name
    assert not rt("layers.0.attn.wo_a").quantizable
    assert rt("layers.1.attn.wo_b").name == "model.layers.1.self_attn.wo_b"
    assert rt("layers.1.attn.indexer.wq_b").quantizable
    for float_module, name in (
            ("layers.1.attn.compressor.wgate", "model.layers.1.self_attn.compressor.wkv_gate"),
            ("layers.1.attn.indexer.weights_proj", "model.layers.1.self_attn.indexer.weights_proj"),
            ("layers.2.ffn.gate", "model.layers.2.mlp.gate"),
            ("layers.2.attn_norm", "model.layers.2.input_layernorm"),
            ("mtp.0.norm", "model.shared_head.norm")):
        got = rt(float_module)
        assert (got.name, got.quantizable) == (name, False), float_module
    shared = rt("layers.2.ffn.shared_experts.w1")
    assert (shared.name, shared.shards) == ("model.layers.2.mlp.shared_experts.gate_up_proj", ())
    assert rt("layers.2.ffn.shared_experts.w2").name == \
        "model.layers.2.mlp.shared_experts.down_proj"
    experts = rt("layers.2.ffn.experts.3.w2")
    assert experts.name == "model.layers.2.mlp.experts" and len(experts.shards) == 4 * 3
    assert "model.layers.2.mlp.experts.3.down_proj" in experts.shards
    e = rt("mtp.1.e_proj")
    assert (e.name, e.mtp, e.quantizable) == ("model.e_proj", True, True)
    assert rt("mtp.0.attn.wq_b").name == "model.decoder.self_attn.wq_b"
    assert rt("mtp.0.ffn.shared_experts.w3").name == \
        "model.decoder.mlp.shared_experts.gate_up_proj"
    assert (rt("mtp.0.head").name, rt("mtp.0.head").kind) == ("model.shared_head.head", "head")
    assert rt("head").name == "lm_head"
    # SGLang renames weights, never ignore entries: the on-disk names reach nothing it builds.
    assert map_ignore_entries(["layers.2.ffn.shared_experts.w2", "mtp.0.e_proj"],
                              "deepseek_v4", "sglang", config=DSV4_CFG) == [
        "layers.2.ffn.shared_experts.w2", "mtp.0.e_proj"]
    assert ignore_status("layers.2.ffn.shared_experts.w2", ["layers.2.ffn.shared_experts.w2"],
                         "deepseek_v4", "sglang", config=DSV4_CFG) == "quantized"
    # A fused module without a packed-modules mapping: its shards' names do not reach it.
    assert ignore_status("layers.0.attn.wq_a", ["layers.0.attn.wq_a", "layers.0.attn.wkv"],
                         "deepseek_v4", "sglang", config=DSV4_CFG) == "quantized"
    mods = ["mtp.0.e_proj", "mtp.0.attn.wq_a", "mtp.0.attn.wkv", "layers.2.ffn.shared_experts.w1",
            "layers.2.ffn.shared_experts.w3",
            *(f"mtp.0.ffn.experts.{x}.w{w}" for x in range(4) for w in (1, 2, 3))]
    entries = ignore_list_for(mods, "deepseek_v4", "sglang", config=DSV4_CFG)
    for m in mods:
        assert ignore_status(m, entries, "deepseek_v4", "sglang", config=DSV4_CFG) \
            == "ignored", m
