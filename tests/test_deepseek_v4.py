"""DeepSeek-V4 (``deepseek_v4``) against transformers 5.23: logits in one pass and over the
cache, each MTP layer against transformers' own modules wired as vLLM's DeepSeekV4MTP, the
release's names and config spelling, greedy decoding with MTP, and what is refused."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import (
    DSV4_CSA,
    DSV4_HCA,
    DSV4_MTP_LAYERS,
    DSV4_SLIDING,
    VOCAB,
    _dsv4_native,
    write_deepseek_v4,
)

from mtpkit.checkpoint.errors import CheckpointError
from mtpkit.engine.generate import Engine, MTPDrafter, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.models.config import ConfigError
from mtpkit.models.deepseek_v4 import DeepseekV4Config


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    """(checkpoint folder, the transformers model it was saved from)."""
    out = tmp_path_factory.mktemp("deepseek_v4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = write_deepseek_v4(out)
    return out, ref.eval()


@pytest.fixture(scope="module")
def model(dsv4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(dsv4[0], tokenizer=False)
    assert not loaded.report.unexpected, loaded.report.unexpected
    return loaded.model


def _ids(seed: int, n: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(4))
def test_logits_match_transformers_in_one_pass_and_over_the_cache(seed, dsv4, model):
    """Every attention kind (sliding, CSA with its indexer choosing, HCA), both routers: the
    logits of a 40-token pass, and of a prefill followed by single-token and 3-token steps
    over the cache, equal transformers' within 1e-4."""
    ref = dsv4[1]
    ids = _ids(seed)
    with torch.no_grad():
        want = ref(ids).logits
        assert (want - model.logits(model(ids).hidden)).abs().max() < 1e-4
        for chunk in (1, 3):
            cache = model.new_cache(64)
            parts = [model.logits(model(ids[:, :9], cache).hidden)]
            for i in range(9, ids.shape[1], chunk):
                parts.append(model.logits(model(ids[:, i:i + chunk], cache).hidden))
            assert (want - torch.cat(parts, 1)).abs().max() < 1e-4, chunk


def test_cache_returns_to_an_earlier_position_exactly(model):
    """Rejected drafts written into every cache (window keys, compressor and indexer pools)
    and trimmed away leave no trace: the next tokens' logits equal a run that never saw
    them."""
    ids = _ids(7)
    with torch.no_grad():
        want = model.logits(model(ids).hidden)
        cache = model.new_cache(64)
        model(ids[:, :13], cache)
        for bad_len in (5, 2, 9):
            model(torch.randint(0, VOCAB, (1, bad_len)), cache)
            cache.trim(13)
        got = model.logits(model(ids[:, 13:], cache).hidden)
    assert (want[:, 13:] - got).abs().max() < 1e-4


def test_release_block_names_are_transformers_own(dsv4, model):
    """transformers saves a block in the release's names (its conversion mapping, reversed);
    the names the tests write MTP layers with agree with it, and mtpkit maps them back."""
    path, ref = dsv4
    saved = set(load_file(path / "model.safetensors"))
    for k in ref.state_dict():
        if k.startswith("model.layers.") and ".experts." not in k:
            native = _dsv4_native(k)
            # The release names the attention's norm kv_norm; transformers reads both that
            # and "norm" (its rename is .norm. -> .kv_norm.), and writes "norm".
            assert "model." + native.replace(".kv_norm.", ".norm.") in saved, (k, native)
            assert model.map_checkpoint_name(native) == k
            assert model.map_checkpoint_name("model." + native) == k
    assert model.map_checkpoint_name("layers.2.ffn.experts.3.w3.weight") == (
        "model.layers.2.mlp.experts.3.up_proj.weight")
    assert model.map_checkpoint_name("mtp.1.hc_head_base") == "mtp.layers.1.hc_head.hc_base"
    assert model.map_checkpoint_name("mtp.0.norm.weight") == "mtp.layers.0.norm.weight"
    assert model.map_checkpoint_name("mtp.0.attn.norm.weight") == (
        "mtp.layers.0.block.self_attn.kv_norm.weight")
    assert model.map_checkpoint_name("mtp.0.head.weight") is None
    assert model.map_checkpoint_name("mtp.1.emb.tok_emb.weight") is None
    with pytest.raises(CheckpointError, match="FP8"):
        model.map_checkpoint_name("layers.0.attn.wq_a.scale")


def test_release_layout_loads_like_transformers(dsv4, model, tmp_path):
    """The whole checkpoint in the release's top-level names (embed, head, norm, hc_head_*,
    layers.{i}.*, no model. prefix): transformers and mtpkit both read it as before."""
    from transformers import DeepseekV4ForCausalLM

    path, ref = dsv4
    tensors = load_file(path / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    release = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    save_file(release, tmp_path / "model.safetensors", metadata={"format": "pt"})
    save_file(load_file(path / "model_mtp.safetensors"), tmp_path / "model_mtp.safetensors",
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = _ids(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
        loaded = load_model(tmp_path, tokenizer=False)
    assert not loaded.report.unexpected
    with torch.no_grad():
        want = ref(ids).logits
        assert (again(ids).logits - want).abs().max() < 1e-5  # transformers reads it too
        got = loaded.model.logits(loaded.model(ids).hidden)
    assert (got - want).abs().max() < 1e-4


def _reference_mtp_layer(ref, tensors: dict, i: int):
    """MTP layer i from transformers' modules, filled from the release's mtp.{i}.* tensors."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer,
        DeepseekV4HyperHead,
        DeepseekV4RMSNorm,
    )

    cfg = copy.deepcopy(ref.config)
    cfg.layer_types, cfg.mlp_layer_types = [DSV4_SLIDING], ["moe"]
    d = cfg.hidden_size
    layer = torch.nn.Module()
    layer.block = DeepseekV4DecoderLayer(cfg, 0)
    layer.enorm, layer.hnorm, layer.norm = (DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
                                            for _ in range(3))
    layer.e_proj = torch.nn.Linear(d, d, bias=False)
    layer.h_proj = torch.nn.Linear(d, d, bias=False)
    layer.hc_head = DeepseekV4HyperHead(cfg)
    p = f"mtp.{i}."
    state = {f"{k}.weight": tensors[f"{p}{k}.weight"]
             for k in ("enorm", "hnorm", "norm", "e_proj", "h_proj")}
    for k in ("fn", "base", "scale"):
        state[f"hc_head.hc_{k}"] = tensors[f"{p}hc_head_{k}"]
    block = layer.block.state_dict()
    for k in block:
        if k.endswith("experts.gate_up_proj"):
            e = block[k].shape[0]
            state["block." + k] = torch.stack([
                torch.cat([tensors[f"{p}ffn.experts.{j}.w{w}.weight"] for w in (1, 3)])
                for j in range(e)])
        elif k.endswith("experts.down_proj"):
            state["block." + k] = torch.stack([tensors[f"{p}ffn.experts.{j}.w2.weight"]
                                               for j in range(block[k].shape[0])])
        else:
            native = _dsv4_native(f"model.layers.0.{k}")
            state["block." + k] = tensors[p + native[len("layers.0."):]]
    layer.load_state_dict(state, strict=True)
    return layer.eval(), cfg


def test_mtp_layers_match_transformers_modules(dsv4, model):
    """Each MTP layer equals transformers' DeepseekV4DecoderLayer (a sliding, top-k MoE
    layer), RMSNorms and HyperHead filled from the release's tensors and wired as vLLM's
    DeepSeekV4MTP: x = h_proj(hnorm(streams)) + e_proj(enorm(emb)), the embedding at position
    0 zeroed, logits = lm_head(norm(hc_head(block(x)))), the block's streams chained."""
    path, ref = dsv4
    tensors = load_file(path / "model_mtp.safetensors")
    ids = _ids(13, 30)
    captured = {}
    hook = ref.model.hc_head.register_forward_hook(
        lambda mod, args, out: captured.update(streams=args[0]))
    with torch.no_grad():
        ref(ids)
        hook.remove()
        want_state = got_state = captured["streams"]
        for i in range(DSV4_MTP_LAYERS):
            layer, cfg = _reference_mtp_layer(ref, tensors, i)
            t = ids.shape[1] - 1 - i
            next_ids = ids[:, 1 + i: 1 + i + t]
            emb = ref.model.embed_tokens(next_ids).clone()
            emb[:, 0] = 0
            pos = torch.arange(t)[None]
            q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
            allowed = (k <= q) & (q - k < cfg.sliding_window)
            mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
            rope = {kind: ref.model.rotary_emb(emb, pos, layer_type=kind)
                    for kind in ("main", "compress")}
            x = layer.h_proj(layer.hnorm(want_state[:, :t])) + layer.e_proj(
                layer.enorm(emb)).unsqueeze(-2)
            y = layer.block(x, input_ids=next_ids, position_embeddings=rope, position_ids=pos,
                            attention_mask=mask, past_key_values=None)
            want = ref.lm_head(layer.norm(layer.hc_head(y)))
            out = model.mtp_forward(next_ids, got_state[:, :t], i, 0, None)
            diff = (model.logits(out.hidden) - want).abs().max()
            assert diff < 1e-4, (i, float(diff))
            want_state, got_state = y, out.pre_norm


def _generate(engine, prompt, k, drafter=None):
    res = Result()
    tokens = list(engine.generate(prompt, SamplingParams(max_tokens=24), k, result=res,
                                  drafter=drafter, eos_ids=set()))
    return tokens, res


def test_greedy_with_mtp_equals_without(model):
    """k = 1..5 (both MTP layers, then the last again): token-for-token the output of plain
    decoding, and some drafts are accepted."""
    engine = Engine(model)
    drafted = accepted = 0
    for seed in range(3):
        prompt = _ids(20 + seed, 7)[0].tolist()
        want, _ = _generate(engine, prompt, 0)
        for k in range(1, 6):
            got, res = _generate(engine, prompt, k)
            assert got == want, (seed, k)
            drafted += res.metrics.num_draft_tokens
            accepted += res.metrics.num_accepted_tokens
    assert drafted > 0 and accepted > 0


class _PlantedMiss(MTPDrafter):
    """Drafts the known greedy continuation with one wrong token at a rotating index, so that
    every accept length 0..k occurs and every cache rolls back."""

    def __init__(self, model, sequence, k):
        super().__init__(model)
        self.sequence, self.k, self.round, self.planned = sequence, k, 0, []

    def propose(self, st, k, cache, params, gen):
        self.miss, self.st = self.round % (self.k + 1), st
        self.round += 1
        self.planned.append(min(self.miss, k))
        return super().propose(st, k, cache, params, gen)

    def pick(self, s, logits, params, gen):
        true = self.sequence[self.st.pos + 1 + s]
        return ((true + 1) % VOCAB if s == self.miss else true), None


@pytest.mark.parametrize("k", [2, 4])
def test_every_accept_length_rolls_back_exactly(k, model):
    engine = Engine(model)
    prompt = _ids(31, 9)[0].tolist()
    want, _ = _generate(engine, prompt, 0)
    drafter = _PlantedMiss(model, prompt + want, k)
    got, res = _generate(engine, prompt, k, drafter)
    assert got == want
    assert set(range(k + 1)) <= set(drafter.planned)
    assert res.metrics.num_accepted_tokens == sum(drafter.planned)


def _release_config(d: dict) -> dict:
    """The saved config.json in the release's spelling: per-layer compress_ratios with the MTP
    layers' entries, num_hash_layers, qk_rope_head_dim, flat YaRN, scalar compress rates."""
    r = {k: v for k, v in d.items() if k not in (
        "layer_types", "mlp_layer_types", "partial_rotary_factor", "rope_parameters",
        "compress_rates")}
    ratio = {DSV4_SLIDING: 0, DSV4_CSA: 4, DSV4_HCA: 128}
    r["compress_ratios"] = [ratio[t] for t in d["layer_types"]] + [0] * DSV4_MTP_LAYERS
    r["num_hash_layers"] = d["mlp_layer_types"].count("hash_moe")
    r["qk_rope_head_dim"] = int(d["head_dim"] * d["partial_rotary_factor"])
    r["compress_rate_csa"] = d["compress_rates"][DSV4_CSA]
    r["compress_rate_hca"] = d["compress_rates"][DSV4_HCA]
    comp = d["rope_parameters"]["compress"]
    r["rope_scaling"] = {k: comp[k] for k in ("rope_type", "factor",
                                              "original_max_position_embeddings",
                                              "beta_fast", "beta_slow")}
    return r


def test_release_config_is_read_as_transformers_reads_it(dsv4):
    from transformers import DeepseekV4Config as HFConfig

    d = json.loads((dsv4[0] / "config.json").read_text())
    release = _release_config(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = HFConfig(**release)
    for spelling in (d, release):
        cfg = DeepseekV4Config.from_hf_config(spelling)
        assert cfg.layer_types == tc.layer_types
        assert cfg.mlp_layer_types == tc.mlp_layer_types
        assert cfg.compress_rates == tc.compress_rates
        assert cfg.rot_dim == tc.qk_rope_head_dim
        main, comp = tc.rope_parameters["main"], tc.rope_parameters["compress"]
        assert (cfg.rope_theta, cfg.compress_rope_theta) == (main["rope_theta"],
                                                             comp["rope_theta"])
        assert cfg.compress_scaling["factor"] == comp["factor"]
        assert cfg.compress_scaling["attention_factor"] == comp["attention_factor"] == 1.0
        assert cfg.mtp_layer_types == [DSV4_SLIDING] * DSV4_MTP_LAYERS


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"dspark_block_size": 5, "dspark_target_layer_ids": [1, 2]}, "DSpark"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": None, "compress_ratios": [0, 4, 64, 4]}, "compress_ratios"),
    ({"layer_types": None, "compress_ratios": [0, 4, 128, 4, 4, 0]}, "MTP layers"),
    ({"layer_types": [DSV4_SLIDING, "full_attention", DSV4_HCA, DSV4_CSA]}, "layer_types"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "linear", "factor": 2.0}}},
     "rope scaling"),
])
def test_unsupported_configs_are_refused(change, message, dsv4):
    """What mtpkit does not run as transformers computes it fails with one clear line."""
    d = json.loads((dsv4[0] / "config.json").read_text())
    d = {k: v for k, v in {**d, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_hf_config(d)


def test_doctor_counts_the_mtp_layers_and_misses_none(dsv4, tmp_path):
    from mtpkit.doctor import diagnose

    rep = diagnose(dsv4[0])
    assert rep.facts["mtp_layers_stored"] == DSV4_MTP_LAYERS and rep.exit_code == 0, \
        rep.to_json()
    # The release without its mtp.* tensors (an export that dropped them): a head is missing.
    out = tmp_path / "no-mtp"
    out.mkdir()
    for f in dsv4[0].iterdir():
        if f.name == "model_mtp.safetensors":
            continue
        if f.suffix == ".safetensors":
            kept = {k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}
            save_file(kept, out / f.name)
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    index = out / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items()
                             if not k.startswith("mtp.")}
        index.write_text(json.dumps(idx))
    assert "mtp-missing" in diagnose(out).codes()
