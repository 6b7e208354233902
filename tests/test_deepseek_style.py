"""DeepSeek-style families (GLM-4.5, DeepSeek-V3): the MTP layer against a plain
implementation of the documented formula, and the grouped router against transformers."""

from __future__ import annotations

import copy
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import test_families
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import FAMILIES, VOCAB, Family, _kimi_k25, _randomize_router_bias

from mtpkit.engine.loader import load_model
from mtpkit.models.moe import GroupedTopKRouter

DEEPSEEK_STYLE = [f.name for f in FAMILIES if f.mtp_layout == "deepseek"]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_block(ref, tensors: dict, prefix: str, n: int):
    """transformers' own decoder layer class (not ours) holding the MTP layer's block weights."""
    config = ref.config
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds is not None and len(kinds) <= n:
        # GLM-4.7-Flash lists trunk layers only; its MTP layer has experts, as released.
        config = copy.deepcopy(config)
        config.mlp_layer_types = list(kinds) + ["sparse"] * (n + 1 - len(kinds))
    indexers = getattr(config, "indexer_types", None)
    if indexers is not None and len(indexers) <= n:
        # GLM-5's MTP layer has its own indexer (vLLM builds one whatever the schedule says).
        config = copy.deepcopy(config)
        config.indexer_types = list(indexers) + ["full"] * (n + 1 - len(indexers))
    layer = type(ref.model.layers[-1])(config, layer_idx=n).eval()
    state = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if not k.startswith(prefix):
            continue
        rest = k[len(prefix):]
        if rest.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")):
            continue
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(int(e), {})[proj] = v
            continue
        state[rest] = v
    if experts:  # transformers stacks the experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        ids = sorted(experts)
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids])
        state["mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    layer.load_state_dict(state, strict=True)
    return layer


@pytest.mark.parametrize("name", DEEPSEEK_STYLE)
def test_mtp_layer_matches_plain_formula(name, checkpoint_factory):
    """logits = lm_head(shared_head.norm(block(eh_proj([enorm(emb(t+1)), hnorm(h_t)])))),
    and a chained step feeds back the block output before shared_head.norm."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(name)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    n, eps = text["num_hidden_layers"], text["rms_norm_eps"]
    prefix = f"model.layers.{n}."
    tensors = {**load_file(path / "model.safetensors"), **load_file(path / "model_mtp.safetensors")}
    assert not any(k.startswith("mtp.") for k in tensors)  # the real layout is what loads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "text_config" in cfg:  # a wrapper (Kimi-K2.5): its text model is the reference
            from transformers import AutoModelForImageTextToText

            from mtpkit.models.kimi_k25 import text_model_name

            assert any(k.startswith(f"language_model.{prefix}") for k in tensors)
            tensors = {text_model_name(k): v for k, v in tensors.items()}
            tensors.pop(None, None)
            wrapper = AutoModelForImageTextToText.from_pretrained(path).eval()
            ref = SimpleNamespace(model=wrapper.model.language_model,
                                  config=wrapper.config.text_config)
        else:
            ref = AutoModelForCausalLM.from_pretrained(path).eval()
        model = load_model(path, tokenizer=False).model
    block = _reference_block(ref, tensors, prefix, n)

    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    t = ids.shape[1] - 1
    draft = torch.tensor([[7]])
    with torch.no_grad():
        h = ref.model(ids).last_hidden_state[:, :-1]  # trunk states after the final norm
        emb = tensors["model.embed_tokens.weight"][torch.cat([ids[:, 1:], draft], 1)].clone()
        emb[:, 0] = 0  # vLLM zeroes the embedding at position 0 for these heads

        def combine(e, hid):
            x = torch.cat([_rms(e, tensors[prefix + "enorm.weight"], eps),
                           _rms(hid, tensors[prefix + "hnorm.weight"], eps)], -1)
            return F.linear(x, tensors[prefix + "eh_proj.weight"])

        def run_block(x):
            pos = torch.arange(x.shape[1])[None]
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
            cos_sin = ref.model.rotary_emb(x, pos)
            out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            return out[0] if isinstance(out, tuple) else out  # GLM-5's: (out, top-k)

        def head(y):
            return F.linear(_rms(y, tensors[prefix + "shared_head.norm.weight"], eps),
                            tensors["lm_head.weight"])

        x0 = combine(emb[:, :t], h)
        y0 = run_block(x0)
        # Chained step: the draft at position t with the block output (pre-norm) of t-1.
        y1 = run_block(torch.cat([x0, combine(emb[:, t:], y0[:, -1:])], 1))[:, -1:]
        want0, want1 = head(y0), head(y1)

        out = model(ids)
        cache = model.new_mtp_cache(64)
        got0 = model.mtp_forward(ids[:, 1:], out.hidden[:, :-1], 0, 0, cache)
        chain = got0.for_mtp(model.mtp.spec.chain_hidden)[:, -1:]
        got1 = model.mtp_forward(draft, chain, 1, t, cache)
    assert (model.logits(got0.hidden) - want0).abs().max() < 1e-4
    assert (model.logits(got1.hidden) - want1).abs().max() < 1e-4


def test_grouped_router_matches_transformers():
    """Sigmoid scores, correction bias for the choice only, best topk_group of n_group groups."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    g = torch.Generator().manual_seed(0)
    ref = Glm4MoeTopkRouter(cfg)
    ours = GroupedTopKRouter(32, 16, 4, 4, 2, True, 2.5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=g))
        ref.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
        x = torch.randn(512, 32, generator=g)
        _, w_ref, i_ref = ref(x)
        w, i = ours(x)
    order_ref, order = i_ref.argsort(-1), i.argsort(-1)
    assert torch.equal(i_ref.gather(1, order_ref), i.gather(1, order))
    assert torch.allclose(w_ref.gather(1, order_ref), w.gather(1, order), atol=1e-6)
    # The bias must stay fp32 when the model is cast (it only steers the choice).
    assert ours.to(torch.bfloat16).e_score_correction_bias.dtype == torch.float32


def test_mla_absorbed_equals_expanded(checkpoint_factory):
    """Latent-space attention (absorbed weights) gives the expanded attention's logits, for
    prefill and for cached decoding, and the cache holds only latents and rope keys."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint_factory("deepseek_v3"), tokenizer=False).model
    attn = [layer.self_attn for layer in model.model.layers]
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))

    def run(absorb: bool) -> torch.Tensor:
        for a in attn:
            a.absorb = absorb
        cache = model.new_cache(64)
        with torch.no_grad():
            steps = [model.logits(model(ids[:, :20], cache).hidden)]
            steps += [model.logits(model(ids[:, t : t + 1], cache).hidden) for t in range(20, 30)]
        return torch.cat(steps, 1), cache

    try:
        got, cache = run(True)
        want, _ = run(False)
    finally:
        for a in attn:
            a.absorb = None
    assert (got - want).abs().max() < 1e-5
    cfg = model.config
    assert cache[0].k.shape[1:] == (1, 64, cfg.kv_lora_rank)
    assert cache[0].v.shape[1:] == (1, 64, cfg.qk_rope_head_dim)


def _fp8_blocks(w: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, per-block scale, the weight those two stand for), block by block."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(rows / b), math.ceil(cols / b))
    deq = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * b : (i + 1) * b, j * b : (j + 1) * b]
            s = blk.abs().max() / 448.0
            qb = (blk / s).to(torch.float8_e4m3fn)
            q[i * b : (i + 1) * b, j * b : (j + 1) * b] = qb
            deq[i * b : (i + 1) * b, j * b : (j + 1) * b] = qb.float() * s
            scale[i, j] = s
    return q, scale, deq


def test_deepseek_fp8_checkpoint_loads_dequantized(checkpoint_factory, tmp_path):
    """DeepSeek-native FP8 (weight e4m3 + weight_scale_inv per block, ragged edges included)
    loads as block value x scale, trunk and MTP layer alike."""
    src = checkpoint_factory("deepseek_v3")
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    for f in ("model.safetensors", "model_mtp.safetensors"):
        fp8, ref = {}, {}
        for k, v in load_file(src / f).items():
            if v.ndim == 2 and k.endswith("_proj.weight") and "eh_proj" not in k:
                q, scale, deq = _fp8_blocks(v.float(), 16)
                fp8[k], fp8[k + "_scale_inv"], ref[k] = q, scale, deq
            else:
                fp8[k] = ref[k] = v
        save_file(fp8, fp8_dir / f)
        save_file(ref, ref_dir / f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = load_model(fp8_dir, tokenizer=False)
        want = load_model(ref_dir, tokenizer=False).model
    assert got.report.unexpected == []
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outs = []
        for m in (got.model, want):
            out = m(ids)
            mtp = m.mtp_forward(ids[:, 1:], out.hidden[:, :-1], 0, 0, None)
            outs.append((m.logits(out.hidden), m.logits(mtp.hidden)))
    assert (outs[0][0] - outs[1][0]).abs().max() < 1e-5
    assert (outs[0][1] - outs[1][1]).abs().max() < 1e-5


def _glm_air_like():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32,
        num_experts_per_tok=3, n_shared_experts=2, n_routed_experts=6, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
        use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25,
        max_position_embeddings=512,
    )
    model = Glm4MoeForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def _deepseek_v3_release_like():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # V3's own rope settings (mscale == mscale_all_dim), unnormalised top-k, two shared experts.
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 8}
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=320,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
        moe_intermediate_size=16, num_experts_per_tok=3, n_shared_experts=2, n_routed_experts=12,
        routed_scaling_factor=2.5, n_group=3, topk_group=2, first_k_dense_replace=1,
        norm_topk_prob=False, rope_parameters=rope, attention_bias=False,
    )
    model = DeepseekV3ForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def _glm4_moe_lite_plain():
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    # No q LoRA, half-split rope, YaRN; mlp_layer_types left to its default (dense first).
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 32}
    cfg = Glm4MoeLiteConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16,
        v_head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2, n_shared_experts=1,
        n_routed_experts=4, n_group=1, topk_group=1, rope_interleave=False,
        rope_parameters=rope,
    )
    model = Glm4MoeLiteForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def _config_says_first_k_dense_only(out):
    """The release's config.json: first_k_dense_replace, no mlp_layer_types."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["first_k_dense_replace"] = cfg.pop("mlp_layer_types").index("sparse")
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fam", [
    Family("glm_air_like", _glm_air_like),
    Family("deepseek_v3_release_like", _deepseek_v3_release_like),
    Family("glm4_moe_lite_plain", _glm4_moe_lite_plain, rewrite=_config_says_first_k_dense_only),
    # As transformers 5.23 saves it: language_model.model.blocks.*, text model deepseek_v3.
    Family("kimi_k25_transformers_saved", _kimi_k25),
], ids=lambda f: f.name)
def test_more_variants_match_transformers(fam, tmp_path):
    """Config variants beyond the table rows: logits within 1e-4, prefill and cached."""
    test_families.test_logits_match_transformers(fam, tmp_path)


def test_second_mtp_layer_loads_and_undeclared_layers_are_reported(checkpoint_factory,
                                                                     tmp_path):
    """A second DeepSeek-style MTP layer loads with its own weights when the config declares
    it; stored past the declared count it is named in the load notes, not silently lost."""
    src = checkpoint_factory("glm4_moe")
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    save_file(load_file(src / "model.safetensors"), tmp_path / "model.safetensors")
    mtp = load_file(src / "model_mtp.safetensors")
    mtp.update({k.replace(f"layers.{n}.", f"layers.{n + 1}."): 2 * v
                for k, v in mtp.items()})
    save_file(mtp, tmp_path / "model_mtp.safetensors")
    cfg["num_nextn_predict_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    head = load_model(tmp_path, tokenizer=False).model.mtp
    assert len(head.layers) == 2
    assert torch.equal(head.parts(1).fc.weight, mtp[f"model.layers.{n + 1}.eh_proj.weight"])
    assert torch.equal(head.layers[1].input_layernorm.weight,
                       mtp[f"model.layers.{n + 1}.input_layernorm.weight"])
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match=f"model.layers.{n + 1}"):
        loaded = load_model(tmp_path, tokenizer=False)
    assert loaded.model.mtp is not None and len(loaded.model.mtp.layers) == 1
    assert all(u.startswith(f"model.layers.{n + 1}.") for u in loaded.report.unexpected)


def test_fp8_weight_without_any_scale_is_refused(checkpoint_factory, tmp_path):
    """An FP8 weight with no scale tensor must not load as raw e4m3 values."""
    from mtpkit.checkpoint.errors import CheckpointError

    src = checkpoint_factory("glm4_moe")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="FP8 without a scale tensor"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_model(tmp_path, tokenizer=False)


def first_draft(model, ids: torch.Tensor) -> torch.Tensor:
    """The MTP head's logits for every position of ids (no cache)."""
    hidden = model(ids).hidden[:, :-1]
    return model.logits(model.mtp_forward(ids[:, 1:], hidden, 0, 0, None).hidden)


def test_dsa_selection_decides_logits(checkpoint_factory):
    """GLM-5's indexer: attending every key instead of the top index_topk moves the logits
    (so the table's comparisons with transformers see the selection), while a short prefill
    (every key selected, no mask built) continued token by token past index_topk matches
    transformers; shared layers hold no indexer, the MTP layer its own."""
    from tiny import DSA_TOPK
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory("glm_moe_dsa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(path).eval()
        model = load_model(path, tokenizer=False).model
    kinds = ref.config.indexer_types
    assert "shared" in kinds and kinds[0] == "full"
    names = {*load_file(path / "model.safetensors"), *load_file(path / "model_mtp.safetensors")}
    for i, kind in enumerate([*kinds, "full"]):  # the MTP layer last
        own = any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for k in names)
        assert own == (kind == "full")
    layers = [*model.model.layers, *model.mtp.layers]
    assert [layer.self_attn.indexer is not None for layer in layers] == \
        [k == "full" for k in kinds] + [True]
    assert model.mtp.layers[0].self_attn.indexer.wq_b.weight.shape[0] == 8 * 16

    ids = torch.randint(0, VOCAB, (1, 3 * DSA_TOPK), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
        cache = model.new_cache(64)
        steps = [model.logits(model(ids[:, : DSA_TOPK - 4], cache).hidden)]
        for t in range(DSA_TOPK - 4, ids.shape[1]):
            steps.append(model.logits(model(ids[:, t : t + 1], cache).hidden))
        stepped = torch.cat(steps, 1)
        mtp_sparse = first_draft(model, ids)
        for layer in layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.topk = 10**9
        dense = model.logits(model(ids).hidden)
        mtp_dense = first_draft(model, ids)
    assert (want - stepped).abs().max() < 1e-4
    # Up to index_topk keys everything is selected; past it, the selection matters.
    assert (want - dense)[:, :DSA_TOPK].abs().max() < 1e-4
    assert (want - dense)[:, DSA_TOPK:].abs().max() > 0.1
    assert (mtp_sparse - mtp_dense)[:, DSA_TOPK:].abs().max() > 0.1


@pytest.mark.parametrize("keys", [
    {},
    {"index_topk_freq": 4, "index_skip_topk_offset": 3},
    {"index_topk_freq": 2, "index_skip_topk_offset": 0},
    {"index_topk_pattern": "FSSFSF"},
    {"indexer_types": ["full", "full", "shared", "full", "shared", "shared"]},
])
def test_dsa_indexer_schedule_as_transformers(keys):
    """indexer_types as transformers' GlmMoeDsaConfig derives it from the config's keys."""
    from transformers import GlmMoeDsaConfig

    from mtpkit.models.glm_moe_dsa import indexer_schedule

    want = GlmMoeDsaConfig(num_hidden_layers=6, **keys).indexer_types
    assert indexer_schedule(keys, 6) == want


@pytest.mark.parametrize("change,match", [
    ({"indexer_types": ["shared", "full"]}, "indexer_types\\[0\\] must be 'full'"),
    ({"indexer_types": ["full"]}, "for each of the 2 layers"),
    ({"index_topk_pattern": "FX"}, "only 'F' and 'S'"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave=False is not supported"),
    ({"rope_interleave": False}, "rope_interleave=False is not supported"),
    ({"q_lora_rank": None}, "q_lora_rank is required"),
    ({"index_head_dim": 4}, "smaller than qk_rope_head_dim"),
    ({"index_topk": 0}, "index_topk=0 must be positive"),
])
def test_dsa_config_errors(change, match):
    """Configs GLM-5's model cannot run exactly are refused with the reason."""
    from mtpkit.models.config import ConfigError
    from mtpkit.models.glm_moe_dsa import GlmMoeDsaConfig

    d = {"model_type": "glm_moe_dsa", "vocab_size": 96, "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32,
         "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "index_head_dim": 16, "index_n_heads": 2}
    cfg = GlmMoeDsaConfig.from_hf_config(d)
    assert cfg.indexer_types == ["full", "full"] and cfg.mlp_layer_types == ["dense", "dense"]
    with pytest.raises(ConfigError, match=match):
        GlmMoeDsaConfig.from_hf_config({**d, **change})


def test_dsa_weights_proj_stays_float32(checkpoint_factory):
    """The indexer's head weights stay float32 in a bfloat16 model, as transformers keeps
    them, and bfloat16 decoding still runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(checkpoint_factory("glm_moe_dsa"), dtype="bfloat16",
                           tokenizer=False).model
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32
    assert indexer.wq_b.weight.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(model.logits(model(ids).hidden)).all()


def test_doctor_notes_vllm_index_share(checkpoint_factory, tmp_path):
    """A GLM-5 config asking vLLM to reuse the MTP layer's first key selection is reported
    (mtpkit reruns the indexer at each draft step); without the flag nothing is said."""
    import shutil

    from mtpkit.doctor import diagnose

    src = checkpoint_factory("glm_moe_dsa")
    assert "dsa-mtp-index-share" not in diagnose(src).codes()
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["index_share_for_mtp_iteration"] = True
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    rep = diagnose(tmp_path / "m")
    found = [f for f in rep.findings if f.code == "dsa-mtp-index-share"]
    assert len(found) == 1 and found[0].severity == "info" and rep.exit_code == 0


@pytest.fixture(scope="module")
def three_layer_head(tmp_path_factory):
    """A tiny DeepSeek-V3 with three MTP layers (model.layers.{3,4,5}.*), each with its own
    enorm/hnorm/eh_proj/shared_head.norm, layer i trained at chained depth i + 1."""
    from tiny import add_mtp_head, write_checkpoint

    fam = next(f for f in FAMILIES if f.name == "deepseek_v3")
    out = tmp_path_factory.mktemp("deepseek_v3_3mtp")
    write_checkpoint(fam, out)
    add_mtp_head(out, fam, layers=3, steps=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(out, tokenizer=False).model
    return out, model


def test_every_mtp_layer_loads_with_its_own_combine(three_layer_head):
    """Nothing is dropped: each layer's norms, eh_proj and block come from its own tensors."""
    path, model = three_layer_head
    tensors = load_file(path / "model_mtp.safetensors")
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    head = model.mtp
    assert len(head.layers) == 3 and sorted(head.per_layer) == ["1", "2"]
    for i in range(3):
        p = head.parts(i)
        pre = f"model.layers.{n + i}."
        for disk, mod in (("eh_proj", p.fc), ("enorm", p.pre_fc_norm_embedding),
                          ("hnorm", p.pre_fc_norm_hidden), ("shared_head.norm", p.norm),
                          ("input_layernorm", head.layers[i].input_layernorm)):
            assert torch.equal(mod.weight, tensors[pre + disk + ".weight"]), (i, disk)
    # The layers differ, so a head that ran layer 0 at every step would draft otherwise.
    assert not torch.equal(head.parts(1).fc.weight, head.fc.weight)


def test_draft_step_i_runs_layer_i(three_layer_head):
    """Step s runs layer s % 3 with that layer's own combine and final norm: step 1's
    output is the plain formula over model.layers.{L+1}.*, and k = 5 runs 0, 1, 2, 0, 1."""
    from mtpkit.engine.generate import DecodeState, MTPDrafter
    from mtpkit.engine.sampling import SamplingParams

    path, model = three_layer_head
    tensors = load_file(path / "model_mtp.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h = model(ids).hidden
        emb = model.model.embed_tokens(ids[:, 1:])
        t = emb.shape[1]
        cos, sin = model.rotary.cos_sin(torch.arange(1, 1 + t))
        pre = f"model.layers.{n + 1}."
        x = F.linear(torch.cat([_rms(emb, tensors[pre + "enorm.weight"], eps),
                                _rms(h[:, :t], tensors[pre + "hnorm.weight"], eps)], -1),
                     tensors[pre + "eh_proj.weight"])
        y = model.mtp.layers[1](x, cos, sin, None)
        want = _rms(y, tensors[pre + "shared_head.norm.weight"], eps)
        got = model.mtp_forward(ids[:, 1:], h[:, :t], 1, 1, None)
    assert (got.hidden - want).abs().max() < 1e-5
    assert (got.pre_norm - y).abs().max() < 1e-5

    ran: list[int] = []
    hooks = [block.register_forward_hook(lambda *a, i=i: ran.append(i))
             for i, block in enumerate(model.mtp.layers)]
    try:
        st = DecodeState(pos=ids.shape[1], pending=5, mtp_start=0,
                         mtp_ids=torch.cat([ids[:, 1:], torch.tensor([[5]])], 1), mtp_hidden=h)
        with torch.no_grad():
            MTPDrafter(model).propose(st, 5, model.new_mtp_cache(64),
                                      SamplingParams(max_tokens=8), None)
    finally:
        for hook in hooks:
            hook.remove()
    assert ran == [0, 1, 2, 0, 1]


def test_several_mtp_layers_greedy_equal_and_per_position(three_layer_head):
    """Greedy output with a three-layer head equals no MTP for k = 1..5; acceptance is
    counted per draft position; the fast path declines the head (eager engine)."""
    from test_families import PROMPTS, _run

    from mtpkit.engine.generate import Engine
    from mtpkit.engine.programs import unsupported_reason

    _, model = three_layer_head
    assert unsupported_reason(model) is not None
    engine = Engine(model)
    accepted = 0
    for prompt in PROMPTS:
        want, _ = _run(engine, prompt, 0)
        for k in range(1, 6):
            got, res = _run(engine, prompt, k)
            assert got == want, f"k={k} prompt={prompt}"
            m = res.metrics
            assert len(m.drafts_per_pos) == len(m.per_position_rate) == k
            assert sum(m.accepted_per_pos) == m.num_accepted_tokens
            accepted += m.num_accepted_tokens
    assert accepted > 0
