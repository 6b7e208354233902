"""GGUF output for the DeepSeek-style MoE families: GLM-4.5 (``glm4moe``), MLA models
(``deepseek2``: DeepSeek-V3, GLM-4.7-Flash) and GLM-5 (``glm-dsa``: MLA with DSA indexers).

What llama.cpp's loaders read (src/models/glm4-moe.cpp, deepseek2.cpp, glm-dsa.cpp) and its
converter writes (conversion/glm.py, deepseek.py), beside what ``gguf.py`` does for every
family:

- Routed experts stack into one 3-D tensor per projection, the router's score bias is
  ``exp_probs_b.bias``, shared experts are ``ffn_*_shexp``; both archs route by sigmoid with
  group-limited top-k, and know only leading dense layers (``leading_dense_block_count``).
- ``deepseek2`` runs MLA in its absorbed form: one KV head of ``kv_lora_rank + rope`` width,
  and ``kv_b_proj`` split per head into ``attn_k_b`` ([head, kv_lora, nope], transposed) and
  ``attn_v_b`` ([head, v, kv_lora]). Its RoPE rotates adjacent pairs, which is how DeepSeek
  releases store the rope rows (``rope_interleave``, transformers' default); a checkpoint
  with half-split rope rows has them interleaved on the way.
- ``glm-dsa`` is ``deepseek2``'s MLA plus an indexer per layer (``blk.N.indexer.{attn_q_b,
  attn_k, k_norm, proj}``, the last kept in F32; head widths a multiple of 64, as
  llama.cpp rotates queries and keys by a Hadamard matrix), its sizes and top-k as
  ``attention.indexer.*`` and which layers run their own indexer as the per-layer
  ``attention.indexer.types`` (true: "full"; without it llama.cpp makes every layer of a
  model trained on under 1M positions a full one). Its trunk runs the sparse selection as
  transformers does (top-k keys per query, the rest masked); its MTP block attends densely
  and has no indexer at run time, so its drafts match mtpkit's (whose MTP layer runs its
  indexer) only while the context holds at most ``index_topk`` keys. The output is the
  trunk's either way.
- One MTP layer, appended as block ``n`` with ``blk.n.nextn.*``; its embedding and head fall
  back to the trunk's, so their per-layer copies are not written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gguf import GGUFWriter

MOE_ARCHS = {"glm4moe", "deepseek2", "glm-dsa"}
# Absorbed MLA: one KV head, kv_b_proj split into attn_k_b / attn_v_b.
MLA_ARCHS = {"deepseek2", "glm-dsa"}
# Not in every gguf package release's Keys (llama.cpp's own gguf-py has it).
INDEXER_TYPES = "{arch}.attention.indexer.types"
# HF model_type -> GGUF arch, for model types written as another's arch (gguf.py's _ARCHS
# holds each arch's own model type, which files of the arch read back as).
MOE_MODEL_TYPES = {"glm4_moe_lite": "deepseek2"}
# GLM-4.5 configs that omit it rotate half of each head (transformers' default).
_GLM_PARTIAL_ROTARY = 0.5


def leading_dense(cfg: dict) -> int:
    """The number of leading dense layers; ValueError where dense layers are not leading."""
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        k = kinds.index("sparse") if "sparse" in kinds else n
        if any(t != "sparse" for t in kinds[k:]):
            raise ValueError(
                f"mlp_layer_types {kinds}: llama.cpp runs dense layers only before the first "
                "MoE layer (leading_dense_block_count); this layout has no GGUF form")
        return k
    return int(cfg.get("first_k_dense_replace") or 0)


def write_metadata(w: GGUFWriter, arch: str, cfg: dict, n_mtp: int,
                   partial_rotary: float | None) -> None:
    """The MoE (and for deepseek2 MLA) keys llama.cpp's loader reads."""
    from gguf import ExpertGatingFuncType

    if n_mtp > 1:
        raise ValueError(f"the checkpoint has {n_mtp} MTP layers; llama.cpp's {arch} runs "
                         "one (nextn) layer, so this checkpoint has no GGUF form for it")
    w.add_leading_dense_block_count(leading_dense(cfg))
    if cfg.get("n_routed_experts") is not None:
        w.add_expert_count(int(cfg["n_routed_experts"]))
    if cfg.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(int(cfg["n_group"]))
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(int(cfg["topk_group"]))
    w.add_expert_feed_forward_length(int(cfg.get("moe_intermediate_size")
                                         or cfg["intermediate_size"]))
    w.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    # Written always: without it llama.cpp's deepseek2 falls back to softmax routing (the
    # converter writes it only when the config names scoring_func, which transformers'
    # configs drop). Every family here routes by sigmoid.
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if arch == "glm4moe":
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        rot = _GLM_PARTIAL_ROTARY if partial_rotary is None else partial_rotary
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * rot))
        return
    check_mla(cfg, arch)
    if arch == "glm-dsa":
        _write_indexer(w, cfg)
    kv_lora, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(int(cfg["q_lora_rank"]))
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(int(cfg["qk_nope_head_dim"]) + rope)
    w.add_value_length_mla(int(cfg["v_head_dim"]))
    w.add_rope_dimension_count(rope)
    scaling = rope_scaling(cfg)
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if scaling.get(key) is not None:
                add(float(scaling[key]))
        if scaling.get("mscale_all_dim") is not None:
            # llama.cpp's deepseek2 loader divides this key by 0.1 (a legacy of its converter).
            w.add_rope_scaling_yarn_log_mul(0.1 * float(scaling["mscale_all_dim"]))


def _write_indexer(w: GGUFWriter, cfg: dict) -> None:
    """glm-dsa's indexer sizes, top-k and per-layer schedule (what its loader reads)."""
    from ..models.glm_moe_dsa import indexer_schedule

    w.add_indexer_head_count(int(cfg.get("index_n_heads", 32)))
    w.add_indexer_key_length(int(cfg.get("index_head_dim", 128)))
    w.add_indexer_top_k(int(cfg.get("index_topk", 2048)))
    kinds = indexer_schedule(cfg, int(cfg["num_hidden_layers"]))
    # Written always (the converter only where the config lists them): without it
    # llama.cpp guesses the schedule from the context length, as for GLM-5 / 5.2 releases.
    w.add_array(INDEXER_TYPES.format(arch=w.arch), [k == "full" for k in kinds])


def check_mla(cfg: dict, arch: str = "deepseek2") -> None:
    """ValueError where llama.cpp's deepseek2 / glm-dsa would not load or would decode
    otherwise."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("q_lora_rank") is None and arch == "glm-dsa":
        raise ValueError("q_lora_rank is null (a plain q_proj): llama.cpp's glm-dsa requires "
                         "the query LoRA (its indexer reads the query latent); this "
                         "checkpoint has no GGUF form that llama.cpp loads")
    index_dim = int(cfg.get("index_head_dim", 128))
    if arch == "glm-dsa" and index_dim % 64:
        # The rotation is orthogonal (scores unchanged) but at least 64 channels wide.
        raise ValueError(f"index_head_dim {index_dim} is not a multiple of 64: llama.cpp's "
                         "glm-dsa rotates the indexer's queries and keys by a Hadamard "
                         "matrix of 64 or more channels and cannot run this checkpoint; "
                         "it has no GGUF form that llama.cpp runs")
    if cfg.get("q_lora_rank") is None and n not in (26, 27):
        # llama.cpp reads attention.q_lora_rank unless the layer count is that of the "lite"
        # releases (DeepSeek-V2-Lite and kin), so such a file would not load.
        raise ValueError(
            f"q_lora_rank is null (a plain q_proj) and the model has {n} layers: llama.cpp's "
            "deepseek2 loads plain-q models only with the 26 or 27 layers of DeepSeek-V2-Lite "
            "and kin; this checkpoint has no GGUF form that llama.cpp loads")
    scaling = rope_scaling(cfg)
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale is not None and mscale_all is not None and float(mscale) != float(mscale_all):
            # llama.cpp scales attention by mscale_all_dim alone and leaves the rotary
            # magnitude at 1; HF also multiplies cos/sin by mscale / mscale_all_dim.
            raise ValueError(
                f"YaRN mscale {mscale} differs from mscale_all_dim {mscale_all}: llama.cpp's "
                "deepseek2 assumes they are equal (as in DeepSeek-V3 and Kimi-K2 releases) and "
                "would decode this checkpoint differently from transformers")


def rope_scaling(cfg: dict) -> dict:
    """The config's RoPE scaling (transformers 5 keeps it in rope_parameters)."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def head_count_kv(arch: str, cfg: dict) -> int | None:
    """llama.cpp's KV head count where it differs from the config's (MLA: one)."""
    return 1 if arch in MLA_ARCHS else None


def split_kv_b(t: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [head * (nope + v), kv_lora] -> (k_b [head, kv_lora, nope], v_b [head, v,
    kv_lora]): what the absorbed attention multiplies by."""
    heads = int(cfg["num_attention_heads"])
    nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    per_head = t.reshape(heads, nope + v, t.shape[-1])
    k_b, v_b = per_head.split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def reorder_rope_rows(t: torch.Tensor, rope: int, heads: int,
                      to_pairs: bool = True) -> torch.Tensor:
    """Rows of q (``heads`` heads of nope + rope) or kv_a (kv_lora + rope, ``heads`` 0)
    with each head's last ``rope`` rows reordered from halves to adjacent pairs (llama.cpp's
    order), or back from pairs to halves; a copy."""
    split_as = (2, rope // 2) if to_pairs else (rope // 2, 2)

    def move(rows: torch.Tensor) -> torch.Tensor:  # [..., rope, in]
        split = rows.reshape(*rows.shape[:-2], *split_as, rows.shape[-1])
        return split.transpose(-3, -2).reshape(rows.shape)

    t = t.clone()
    if heads:
        per_head = t.view(heads, -1, t.shape[-1])
        per_head[:, -rope:] = move(per_head[:, -rope:])
    else:
        t[-rope:] = move(t[-rope:])
    return t


def interleave_rope_rows(t: torch.Tensor, cfg: dict, heads: int) -> torch.Tensor:
    """reorder_rope_rows to pairs, for checkpoints that store the rope rows as halves
    (unchanged where they are interleaved already)."""
    if cfg.get("rope_interleave", True):
        return t
    return reorder_rope_rows(t, int(cfg["qk_rope_head_dim"]), heads)


# GLM's chat turns end at <|user|> or <|observation|>, not at its eos: llama.cpp's converter
# writes them as end-of-turn / end-of-message ids (and [gMASK] as bos), so that llama-server
# stops a reply where the model hands the turn back.
_GLM_SPECIAL = {"bos_token_id": "[gMASK]", "eot_token_id": "<|user|>",
                "unknown_token_id": "<|endoftext|>", "eom_token_id": "<|observation|>"}


def special_tokens(model_type: str | None, vocab: dict) -> dict:
    """``vocab`` (Tokenizer.gguf_vocab's fields) with the family's special ids set."""
    if model_type not in ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa"):
        return vocab
    ids = {t: i for i, t in enumerate(vocab["tokens"])}
    found = {key: ids[tok] for key, tok in _GLM_SPECIAL.items() if tok in ids}
    return {**vocab, **found}


# ---------------------------------------------------------------------------------------------
# Reading: the same rules backwards.

# GGUF block tensor base -> HF name, where these families differ from gguf.py's table.
READ_BLOCK = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "indexer.attn_q_b": "self_attn.indexer.wq_b",
    "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.k_norm": "self_attn.indexer.k_norm",
    "indexer.proj": "self_attn.indexer.weights_proj",
}


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Inverse of ``split_kv_b``."""
    per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return per_head.reshape(-1, k_b.shape[1]).contiguous()


def read_config(arch: str, md, has_tensor) -> dict:
    """The HF config fields of a glm4moe / deepseek2 / glm-dsa file (``md(key_template,
    default)`` reads its metadata, ``has_tensor(name)`` asks whether a tensor is there)."""
    from gguf import ExpertGatingFuncType, Keys

    gating = md(Keys.LLM.EXPERT_GATING_FUNC)
    if gating is not None and int(gating) != ExpertGatingFuncType.SIGMOID:
        raise ValueError(f"{arch} file routes experts by gating function {gating}; mtpkit runs "
                         "the sigmoid routing of DeepSeek-V3 and GLM-4.5 only")
    out = {
        "n_routed_experts": md(Keys.LLM.EXPERT_COUNT),
        "num_experts_per_tok": md(Keys.LLM.EXPERT_USED_COUNT),
        "n_group": md(Keys.LLM.EXPERT_GROUP_COUNT, 1),
        "topk_group": md(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1),
        "moe_intermediate_size": md(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        "n_shared_experts": md(Keys.LLM.EXPERT_SHARED_COUNT, 0),
        "first_k_dense_replace": md(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "routed_scaling_factor": md(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        "norm_topk_prob": bool(md(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
    }
    if arch == "glm4moe":
        head_dim = md(Keys.Attention.KEY_LENGTH)
        out.update(head_dim=head_dim,
                   attention_bias=has_tensor("blk.0.attn_q.bias"),
                   use_qk_norm=has_tensor("blk.0.attn_q_norm.weight"))
        rope = md(Keys.Rope.DIMENSION_COUNT)
        if rope and head_dim:
            out["partial_rotary_factor"] = rope / head_dim
        return out
    rope = int(md(Keys.Rope.DIMENSION_COUNT))
    out.update(
        q_lora_rank=md(Keys.Attention.Q_LORA_RANK),
        kv_lora_rank=md(Keys.Attention.KV_LORA_RANK),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(md(Keys.Attention.KEY_LENGTH_MLA)) - rope,
        v_head_dim=md(Keys.Attention.VALUE_LENGTH_MLA),
        rope_interleave=True,  # written as adjacent pairs, whatever the source stored
    )
    if arch == "glm-dsa":
        out.update(_read_indexer(md))
    return out


def _read_indexer(md) -> dict:
    """glm-dsa's indexer fields; the schedule as llama.cpp's loader takes it when absent."""
    from gguf import Keys

    n = int(md(Keys.LLM.BLOCK_COUNT)) - int(md(Keys.LLM.NEXTN_PREDICT_LAYERS, 0) or 0)
    kinds = md(INDEXER_TYPES)
    if kinds is None:
        # GLM-5 / 5.1 files (trained on under 1M positions) run an indexer in every layer;
        # longer ones take GLM-5.2's schedule: layers 0 and 1, then every fourth from 2.
        long = int(md(Keys.LLM.CONTEXT_LENGTH, 0) or 0) >= 1 << 20
        kinds = [not long or i < 2 or (i - 2) % 4 == 0 for i in range(n)]
    kinds = list(kinds)
    if len(kinds) < n:
        raise ValueError(f"attention.indexer.types has {len(kinds)} entries for {n} layers")
    return {
        "index_n_heads": md(Keys.Attention.Indexer.HEAD_COUNT),
        "index_head_dim": md(Keys.Attention.Indexer.KEY_LENGTH),
        "index_topk": md(Keys.Attention.Indexer.TOP_K),
        "indexer_types": ["full" if k else "shared" for k in kinds[:n]],
    }


def yarn_mscale(md) -> dict:
    """deepseek2's YaRN attention scale as transformers' rope fields (mscale equal to
    mscale_all_dim, as llama.cpp assumes); empty without one."""
    from gguf import Keys

    log_mul = md(Keys.Rope.SCALING_YARN_LOG_MUL)
    if log_mul is None:
        return {}
    m = float(log_mul) / 0.1
    return {"mscale": m, "mscale_all_dim": m}
