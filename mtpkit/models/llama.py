"""Llama family: Llama 2/3, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2 (tied embeddings),
and MiMo-7B (a Qwen2 trunk with native MTP layers).

Llama/Qwen checkpoints ship no MTP head; a head trained by ``mtpkit calibrate`` is stored
under Qwen3.5's ``mtp.*`` names with one decoder layer, and loads with the trunk as one model.
MiMo stores its head at ``model.mtp_layers.{i}`` (token_layernorm, hidden_layernorm,
input_proj, a Qwen2 block, final_layernorm) and concatenates [hidden, embedding], the reverse
of DeepSeek's order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .attention import Attention
from .base import CausalLM
from .config import ConfigBase, rope_settings
from .layers import MLP, DecoderStack, PreNormDecoderLayer, RMSNorm, Rotary
from .mtp import NEXTN_NAMES, MTPHead, MTPSpec, map_mimo_name, map_nextn_name


@dataclass
class LlamaConfig(ConfigBase):
    """Config of a Llama-family checkpoint (the keys of its config.json we use)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # MTP head trained for this trunk (0: none)
    num_nextn_predict_layers: int = 0
    # An EAGLE-3 head instead (models/eagle3.py): {"aux_layers": [...], "draft_vocab_size": N}
    eagle3: dict | None = None

    @classmethod
    def from_hf_config(cls, d: dict) -> LlamaConfig:
        """Keep the known keys of an HF config dict, fill family defaults, validate."""
        mt = d["model_type"]
        heads = d["num_attention_heads"]
        theta, rope, _ = rope_settings(d)
        cfg = cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 (and MiMo) have q/k/v biases, not o_proj, without saying so in config.
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            hidden_act=d.get("hidden_act", "silu"),
            num_nextn_predict_layers=int(
                d.get("num_nextn_predict_layers") or d.get("mtp_num_hidden_layers") or 0
            ),
            eagle3=d.get("mtpkit_eagle3"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject configs this family cannot run."""
        super().validate()
        if self.hidden_act != "silu":
            self.fail(f"hidden_act={self.hidden_act!r} is not supported (only silu)")


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm attention + SwiGLU block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            bias=cfg.attention_bias or cfg.model_type in ("qwen2", "mimo"),
            o_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            rms_norm_eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class LlamaForCausalLM(CausalLM):
    """Llama-family trunk, optionally with an mtpkit-trained MTP head."""

    model_types = ("llama", "qwen2", "qwen3", "mimo")
    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.model = DecoderStack(
            cfg.vocab_size, cfg.hidden_size,
            [LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)],
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.mtp = None
        if cfg.num_nextn_predict_layers:
            mimo = cfg.model_type == "mimo"
            # MiMo's MTP layers each carry their own norms and input_proj.
            spec = MTPSpec(cfg.num_nextn_predict_layers, eps=cfg.rms_norm_eps,
                           emb_first=not mimo, zero_first_embedding=mimo, own_combine=mimo)
            self.mtp = MTPHead(cfg.hidden_size, spec, lambda i: LlamaDecoderLayer(cfg))
        if cfg.eagle3:
            from .eagle3 import Eagle3Head

            self.mtp = Eagle3Head(cfg, cfg.eagle3["aux_layers"], cfg.eagle3["draft_vocab_size"])

    # DeepSeek-style names of an MTP layer (what GGUF's blk.N.nextn.* maps back to).
    _NEXTN = NEXTN_NAMES

    def map_checkpoint_name(self, name: str) -> str | None:
        """Also read a head stored as model.layers.{num_hidden_layers + i}.* (GGUF nextn)."""
        mapped = map_nextn_name(name, self.config.num_hidden_layers)
        if mapped == name:
            mapped = map_mimo_name(name)
        return super().map_checkpoint_name(name) if mapped == name else mapped
