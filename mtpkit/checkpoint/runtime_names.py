"""The module names an inference engine builds from a checkpoint's on-disk names, and how a
compressed-tensors ``ignore`` list is matched against them.

Why this exists: a quantized checkpoint's ``quantization_config.ignore`` says which modules stay
unquantized. llm-compressor writes it in on-disk (transformers) names, but vLLM and SGLang match
it against the modules *they* build, after fusing projections (``q_proj``/``k_proj``/``v_proj``
-> ``qkv_proj``, ``gate_proj``/``up_proj`` -> ``gate_up_proj``, ...) and after renaming some
prefixes. A BF16 MTP module that the list does not cover is built quantized, finds no quantized
tensors, and drafts from uninitialised memory (0% acceptance). These rules were read from the
engines' model code (``packed_modules_mapping``, the MTP model classes, the HF->engine name
mappers) and vLLM's compressed-tensors ignore matching:

- an entry is an exact module name, or ``re:<pattern>`` matched with Python ``re.match``
  (anchored at the start only, so ``re:mlp`` does not match ``model.layers.0.mlp.down_proj``);
- a fused module is left unquantized when an entry matches its own name (vLLM 0.30.0 and
  later: exact or ``re:``; before: only an exact entry), or when every shard name (the fused
  name with the shard's leaf put back) is matched; shards that disagree make vLLM refuse to
  load ("Found different quantization schemes ...");
- vLLM does not match class names (``Linear``) in ``ignore``; compressed-tensors and
  llm-compressor do (engine ``transformers`` / ``mtpkit`` here);
- the Qwen3.5 VLM class (``*ForConditionalGeneration``) builds ``model.language_model.*`` as
  ``language_model.model.*``; the text-only class (``Qwen3_5ForCausalLM``, vLLM 0.28.0 and
  later) builds it as ``model.*``. vLLM rewrites exact (dotted, non-``re:``) ignore entries
  with the same prefix map before matching, never ``re:`` patterns; the MTP draft model
  (``mtp.*``) has no map of its own;
- routed experts are one module per layer (``...mlp.experts``), decided by exactly three
  names, ``...experts.0.gate_proj``, ``...experts.0.up_proj`` and ``...experts.0.down_proj``
  (vLLM 0.14.0 and later; before, no ignore entry reached them): an entry naming
  ``...mlp.experts`` itself is never consulted, whether the experts are stored one by one or
  stacked (3-D ``experts.gate_up_proj`` / ``experts.down_proj``);
- heads (``lm_head``, the DeepSeek/GLM MTP head, built as ``model.layers.{L}.head``) are
  ``ParallelLMHead`` modules: quantized only when a config group's target names or matches
  them (vLLM 0.20.0 and later), never through ``Linear``; embeddings likewise (0.25.0 and
  later, int weight-only);
- modules vLLM builds as plain ``nn.Linear``, routers (``GateLinear``, no quantization
  config), convolutions are never quantized: DeepSeek/GLM ``eh_proj``, MiMo ``input_proj``,
  ``mlp.gate``, ``shared_expert_gate``, a vision ``patch_embed``;
- MiMo-V2-Flash (``mimo_v2_flash``) stores its MTP layers as ``model.mtp.layers.{i}.*`` and
  vLLM's draft (``MiMoV2MTP``) builds them under the same names, fused as the trunk's class
  fuses (``qkv_proj``, ``gate_up_proj``), but only layer 0: its loader skips the other
  layers' tensors, so they are never built (``RuntimeModule.built``). The MTP layer's
  ``self_attn.o_proj`` is built without a quantization config, like ``eh_proj``;
- SGLang builds MiMo-V2-Flash's MTP as one layer (``MiMoV2MTP``, mimo_v2_flash_nextn.py):
  ``enorm``, ``hnorm``, ``eh_proj`` (a plain ``nn.Linear``) and ``final_layernorm`` at
  ``model.*``, the block under the prefix ``model.decoder`` (``qkv_proj``, ``o_proj``, a
  dense ``gate_up_proj`` / ``down_proj``), and its loader maps every stored layer
  ``model.mtp.layers.{i}.*`` onto that block, so the layer loaded last wins. Neither MiMo-V2
  class declares a packed-modules mapping: as for Qwen3.5's MTP, only a fused name excludes
  a fused module, and ignore entries are not renamed;
- Step-3.5/3.7-Flash (``step3p5``, ``step3p7``; vLLM's step3p5.py and step3p5_mtp.py): the
  trunk class maps ``.share_expert.`` to ``.moe.share_expert.`` (weights and exact ignore
  entries alike), builds the router ``moe.gate`` without a quantization config (fp32) and the
  stacked ``moe.{gate,up,down}_proj`` experts as one ``moe.experts`` module. The draft
  (``Step3p5MTP``) builds every stored MTP layer ``model.layers.{L + i}`` and drafts step j
  with layer j mod n: its ``enorm``, ``hnorm``, a quantizable ``eh_proj`` and
  ``shared_head.head`` (a ParallelLMHead loaded from ``shared_head.output``) under the layer's
  own prefix, the decoder block under ``model.layers.{L + i}.mtp_block`` (a ``.transformer.``
  infix on disk dropped), fused as the trunk fuses;
- DeepSeek Sparse Attention (``glm_moe_dsa``, ``deepseek_v32``, trunk and MTP layer alike):
  the indexer's ``wq_b`` is a quantizable linear under ``self_attn.indexer``; its ``wk`` and
  ``weights_proj`` are built as one ``self_attn.indexer.wk_weights_proj`` without a
  quantization config (SGLang: ``weights_proj`` only), ``k_norm`` is a LayerNorm.

- SGLang's DeepSeek-V4 (deepseek_v4.py, deepseek_v4_nextn.py, default settings): weights renamed
  ``attn`` -> ``self_attn``, ``ffn`` -> ``mlp``, ``w1/w3/w2`` -> ``gate/up/down_proj``, ignore
  entries never renamed, no packed-modules mapping; ``wq_a`` + ``wkv`` one ``wqkv_a`` whose
  loader reads float (or FP8 block-scaled) tensors only, ``wo_a`` float for compressed-tensors,
  compressors, ``weights_proj`` and the router never quantized; one draft layer with
  ``e_proj``/``h_proj`` at ``model.*`` and its block at ``model.decoder``.

The version-dependent rules are in ``VllmRules``; docs/doctor.md ("What vLLM loads") names
the vLLM file and function each rule was read from.

Engines: ``vllm``, ``sglang`` (vLLM's rules with its own names: DeepSeek MLA
``fused_qkv_a_proj_with_mqa``, the DeepSeek/GLM MTP block built as ``model.decoder.*`` with
exact ignore entries renamed the same way as its weights, and a Qwen3.5 MTP class without a
packed-modules mapping, sglang#35797), and ``mtpkit`` /
``transformers`` (no fusion: on-disk names, compressed-tensors matching). llama.cpp reads GGUF
and has no ignore list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "ENGINES",
    "VLLM_LATEST",
    "IgnoreStatus",
    "RuntimeModule",
    "VllmRules",
    "describe",
    "disk_module_of",
    "entry_matches",
    "expert_probe_names",
    "ignore_list_for",
    "ignore_status",
    "is_ignored",
    "map_ignore_entries",
    "parse_version",
    "runtime_module",
    "vllm_mtp_class",
]

ENGINES = ("vllm", "sglang", "mtpkit", "transformers")
_FUSING = ("vllm", "sglang")

# Tensor-name suffixes that sit below a module name, for every quantized format mtpkit knows.
PARAM_SUFFIXES = (
    "weight", "bias", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
    "weight_g_idx", "weight_global_scale", "input_scale", "input_global_scale",
    "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
)
# Experts stored stacked (transformers 5): ``...mlp.experts.gate_up_proj`` [E, 2I, H] and
# ``...mlp.experts.down_proj`` [E, H, I] are parameters of the ``...mlp.experts`` module.
_STACKED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def parse_version(v: str | tuple | None) -> tuple[int, int, int]:
    """``"0.30"`` / ``"0.30.1"`` / ``(0, 30)`` -> (0, 30, 0); None: the latest rules read."""
    if v is None:
        return VLLM_LATEST
    if isinstance(v, tuple):
        parts = list(v)
    else:
        m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-].*)?", str(v).strip())
        if not m:
            raise ValueError(f"vLLM version {v!r} is not of the form 0.30 or 0.30.1")
        parts = [int(x) for x in m.groups() if x is not None]
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


VLLM_LATEST = (0, 33, 0)


@dataclass(frozen=True)
class VllmRules:
    """The ignore-list rules of one vLLM release (see docs/doctor.md, "What vLLM loads")."""

    version: tuple[int, int, int] = VLLM_LATEST

    @classmethod
    def of(cls, version: str | tuple | None) -> VllmRules:
        """The rules of a release (None: the latest read, 0.33.0)."""
        return cls(parse_version(version))

    @property
    def fused_regex(self) -> bool:
        """An entry matching a fused module's own name (``re:`` too) ignores it whole
        (config_utils.find_matching_patterns, 0.30.0); before, only an exact fused name."""
        return self.version >= (0, 30, 0)

    @property
    def experts_by_first(self) -> bool:
        """Routed experts follow the ignore decisions for ``experts.0.{gate,up,down}_proj``
        (CompressedTensorsMoEMethod.get_moe_method, 0.14.0); before, ignore never reached
        them."""
        return self.version >= (0, 14, 0)

    @property
    def heads_by_name(self) -> bool:
        """A ParallelLMHead is quantized when a target names or matches it (0.20.0)."""
        return self.version >= (0, 20, 0)

    @property
    def qwen35_text_map(self) -> bool:
        """Qwen3_5ForCausalLM maps ``model.language_model.`` -> ``model.`` (0.28.0)."""
        return self.version >= (0, 28, 0)

    def applied(self) -> list[str]:
        """One line per version-dependent rule, as it applies to this release."""
        v = ".".join(map(str, self.version))
        return [
            f"vLLM {v}",
            "ignore entries matching a fused module's name (re: included) ignore it whole"
            if self.fused_regex else
            "only an exact fused name, or entries for every shard, ignore a fused module",
            "routed experts follow the entries for experts.0.gate_proj/up_proj/down_proj"
            if self.experts_by_first else
            "routed experts are quantized whatever the ignore list says",
            "lm_head and MTP heads are quantized only when a target names them"
            if self.heads_by_name else "lm_head and MTP heads are never quantized",
            "text-only Qwen3.5: model.language_model. is renamed model."
            if self.qwen35_text_map else "text-only Qwen3.5: no prefix rename",
        ]


class IgnoreStatus(str, Enum):
    """What an engine does with one on-disk module, given an ignore list."""

    QUANTIZED = "quantized"  # built as a quantized module: needs quantized tensors on disk
    IGNORED = "ignored"  # left unquantized because the ignore list covers it
    NOT_QUANTIZABLE = "not-quantizable"  # never quantized by this engine (nn.Linear, router...)
    SHARD_CONFLICT = "shard-conflict"  # shards of one fused module disagree: vLLM refuses to load


@dataclass(frozen=True)
class RuntimeModule:
    """One module as the engine builds it."""

    name: str  # the engine's module name (the ``prefix`` its quantization config sees)
    shards: tuple[str, ...] = ()  # names whose ignore decisions combine (empty: not fused)
    quantizable: bool = True  # False: the engine never quantizes it
    mtp: bool = False  # part of the MTP draft model (matched without the trunk's name map)
    fused: bool = False  # built from several on-disk modules (shards)
    # linear | fused | experts (decided by experts.0.*) | head (ParallelLMHead) | embedding
    kind: str = "linear"
    # False: the engine builds no such module and never reads its tensors (vLLM drafts
    # MiMo-V2-Flash with MTP layer 0 only); ignore entries for it are harmless and unneeded.
    built: bool = True
    # False: the engine's loader reads only float (or its own FP8) tensors for it, so a
    # compressed-tensors quantized copy is misloaded; keep it float and ignored.
    loads_quantized: bool = True

    @property
    def by_name_only(self) -> bool:
        """Quantized only when a target names or matches it (``Linear`` does not reach it)."""
        return self.kind in ("head", "embedding")


# -- families --------------------------------------------------------------------------------

_QWEN35 = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
# MLA trunks: q_a_proj + kv_a_proj_with_mqa fused (DeepseekV2ForCausalLM and its kin).
_MLA = {"deepseek_v3", "deepseek_v2", "deepseek_v32", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa"}
_DEEPSEEK = _MLA  # kept for callers that import the old name
# DeepSeek Sparse Attention: every indexer layer (and the MTP layer) has self_attn.indexer.*.
_DSA = {"deepseek_v32", "glm_moe_dsa"}
_GLM = {"glm4_moe"}
# model_type -> the MTP draft class vLLM builds (config/speculative.py, hf_config_override);
# deepseek_v2 and kimi_k2 have none there: their MTP tensors are never drafted with.
_VLLM_MTP_CLASS = {
    "deepseek_v3": "DeepSeekMTP", "deepseek_v32": "DeepseekV32MTP",
    "glm_moe_dsa": "DeepseekV32MTP", "glm4_moe": "Glm4MoeMTP",
    "glm4_moe_lite": "Glm4MoeLiteMTP", "mimo": "MiMoMTP", "mimo_v2_flash": "MiMoV2MTP",
    "qwen3_next": "Qwen3NextMTP",
    "qwen3_5": "Qwen3_5MTP", "qwen3_5_text": "Qwen3_5MTP", "qwen3_5_moe": "Qwen3_5MoeMTP",
    "qwen3_5_moe_text": "Qwen3_5MoeMTP", "step3p5": "Step3p5MTP", "step3p7": "Step3p5MTP",
    "deepseek_v4": "DeepSeekV4MTP",
}
# Families whose MTP layer sits at model.layers.{L + i} with enorm/hnorm/eh_proj/shared_head.
_NEXTN = _MLA | _GLM
# Kimi-K2.5 (kimi_k25): the DeepSeek-V3 text model (text_config kimi_k2) below the wrapper's
# language_model. prefix. vLLM's KimiK25ForConditionalGeneration (kimi_k25.py) builds it as a
# DeepseekV3ForCausalLM at the prefix language_model (language_model.model.layers.N.*, MLA's
# fused_qkv_a_proj, language_model.lm_head) and maps NVIDIA's NVFP4 names
# language_model.layers.* there (hf_to_vllm_mapper, exact ignore entries too). SGLang's
# (kimi_k25.py) builds its DeepseekV3ForCausalLM without a prefix (model.layers.N.*,
# fused_qkv_a_proj_with_mqa, lm_head; its loader strips language_model. from the weights,
# never from ignore entries). Neither builds an MTP draft for it: MTP layers are not built.
_KIMI_VLM = {"kimi_k25"}
_KIMI_TEXT = "kimi_k2"
_KIMI_NVFP4 = (("language_model.layers.", "language_model.model.layers."),)
_NEXTN_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
# Families whose MTP layers are stored as model.mtp.layers.{i}.* (vLLM's MiMoV2MTP).
_MIMO_V2 = {"mimo_v2_flash"}
# MTP layers vLLM's MiMoV2MTP builds (mimo_v2_mtp.py: num_mtp_layers = 1, whatever the
# checkpoint stores): later layers' tensors are skipped by its loader.
_MIMO_V2_VLLM_LAYERS = 1
# The modules of a MiMo-V2 MTP layer outside its decoder block.
_MIMO_V2_OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")
# Step-3.5/3.7: MTP layers at model.layers.{L + i} (vLLM's Step3p5MTP), the block under
# mtp_block, these modules outside it.
_STEP = {"step3p5", "step3p7"}
_STEP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
# DeepSeek-V4 (vLLM's models/deepseek_v4: DeepseekV4ForCausalLM and DeepSeekV4MTP), in the
# release's names. Its hf_to_vllm_mapper, applied to weights and exact ignore entries alike
# (substrings first, then prefixes):
_DSV4 = {"deepseek_v4"}
_DSV4_SUBSTR = ((".shared_experts.w2", ".shared_experts.down_proj"),)
_DSV4_PREFIXES = (("layers.", "model.layers."), ("embed.", "model.embed."),
                  ("norm.", "model.norm."), ("hc_head", "model.hc_head"), ("mtp.", "model.mtp."))
# packed_modules_mapping: fused leaf -> the shards' leaves.
_DSV4_FUSIONS = {"fused_wqa_wkv": ("wq_a", "wkv"), "gate_up_proj": ("w1", "w3")}
# The MTP layer's modules outside its block (the rest sits under mtp_block).
_DSV4_MTP_OWN = ("enorm", "hnorm", "e_proj", "h_proj", "norm", "head", "emb",
                 "hc_head_fn", "hc_head_base", "hc_head_scale")
# SGLang's DeepseekV4ForCausalLM / DeepseekV4ForCausalLMNextN (deepseek_v4.py,
# deepseek_v4_nextn.py): remap_weight_name_to_dpsk_hf_format renames the weights (never the
# ignore entries, and the classes declare no packed_modules_mapping).
_DSV4_SGL_SUBSTR = ((".attn", ".self_attn"), (".ffn", ".mlp"),
                    (".attn_norm", ".input_layernorm"), (".ffn_norm", ".post_attention_layernorm"),
                    (".w1", ".gate_proj"), (".w2", ".down_proj"), (".w3", ".up_proj"))
# The draft's modules outside its block, at model.* (SGLang's nextn_spec prefixes).
_DSV4_SGL_MTP_OWN = {"e_proj": "e_proj", "h_proj": "h_proj", "enorm": "enorm",
                     "hnorm": "hnorm", "norm": "shared_head.norm", "head": "shared_head.head",
                     "emb": "embed_tokens"}
# vLLM's hf_to_vllm_mapper prefixes of the Qwen3.5 VLM classes (HF name -> engine name).
_VLM_PREFIXES = (
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.language_model.", "language_model.model."),
)
_TEXT_PREFIXES = (("model.language_model.", "model."),)

_BASE_FUSIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Qwen3.5 gated-delta projections are stored split and built fused (Qwen3-Next stores them
# fused already: in_proj_qkvz / in_proj_ba keep their names).
_QWEN35_GDN = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_MLA_A = ("q_a_proj", "kv_a_proj_with_mqa")


def vllm_mtp_class(model_type: str | None) -> str | None:
    """The MTP draft class vLLM 0.33.0 builds for this model_type (None: none)."""
    return _VLLM_MTP_CLASS.get(model_type or "")


def _fusions(model_type: str | None, engine: str, mtp: bool, config: dict | None) -> dict:
    """fused leaf -> shard leaves for this family and engine."""
    if engine not in _FUSING:
        return {}
    mt = model_type or ""
    if mt in _MLA:
        out = {"gate_up_proj": _BASE_FUSIONS["gate_up_proj"]}
        # Without a q LoRA (q_lora_rank: null) there is no q_a_proj to fuse with; an absent
        # field means the class default (a q LoRA).
        if not _has_null(config, "q_lora_rank"):
            out["fused_qkv_a_proj_with_mqa" if engine == "sglang" else "fused_qkv_a_proj"] = _MLA_A
        return out
    out = dict(_BASE_FUSIONS)
    if mt in _QWEN35 and not mtp:
        out.update(_QWEN35_GDN)
    return out


def _cfg(config: dict | None, key: str):
    """A field of the text config (VLM configs nest it under text_config)."""
    if not config:
        return None
    inner = config.get("text_config")
    if isinstance(inner, dict) and key in inner:
        return inner[key]
    return config.get(key)


def _has_null(config: dict | None, key: str) -> bool:
    if not config:
        return False
    inner = config.get("text_config")
    scope = inner if isinstance(inner, dict) and key in inner else config
    return key in scope and scope[key] is None


def _num_layers(config: dict | None) -> int | None:
    n = _cfg(config, "num_hidden_layers")
    return int(n) if n is not None else None


def _num_experts(config: dict | None) -> int | None:
    for key in ("n_routed_experts", "num_experts", "moe_num_experts"):
        n = _cfg(config, key)
        if n:
            return int(n)
    return None


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(
            f"engine {engine!r} has no module-name rules; use one of {', '.join(ENGINES)} "
            "(llama.cpp reads GGUF files, which have no ignore list)"
        )


def _prefix_map(model_type: str | None, config: dict | None, rules: VllmRules):
    """The trunk's HF -> vLLM prefix map: the class is chosen from ``architectures`` as vLLM
    does (the model_type when the config names none)."""
    mt = model_type or ""
    if mt not in _QWEN35:
        return ()
    archs = (config or {}).get("architectures") or []
    arch = archs[0] if archs else ""
    if arch.endswith("ForConditionalGeneration") or (not arch and mt in ("qwen3_5",
                                                                          "qwen3_5_moe")):
        return _VLM_PREFIXES
    return _TEXT_PREFIXES if rules.qwen35_text_map else ()


def _apply_prefixes(name: str, prefixes) -> str:
    # vLLM's WeightsMapper tries every prefix in turn on the running name.
    for hf, ours in prefixes:
        if name.startswith(hf):
            name = ours + name[len(hf):]
    return name


# -- on-disk name -> runtime module ----------------------------------------------------------


def disk_module_of(tensor_name: str) -> tuple[str, str]:
    """Tensor name -> (module name, parameter name); stacked experts belong to ``...experts``."""
    head, _, last = tensor_name.rpartition(".")
    return (head, last) if head else (tensor_name, "")


def expert_probe_names(experts: str) -> tuple[str, str, str]:
    """The three names vLLM decides a routed-experts module by (experts.0.*)."""
    return tuple(f"{experts}.0.{p}" for p in _EXPERT_PROJS)  # type: ignore[return-value]


_NEVER_QUANTIZED_LEAVES = ("eh_proj", "input_proj")


def describe(
    disk_module: str, model_type: str | None, engine: str = "vllm", *, config: dict | None = None,
    vllm_version: str | tuple | None = None,
) -> RuntimeModule:
    """The runtime module an engine builds for one on-disk module (see the module docstring).

    A stacked-experts module (``...mlp.experts`` holding 3-D ``gate_up_proj``/``down_proj``)
    and each per-expert module describe the same ``...mlp.experts`` runtime module."""
    _check_engine(engine)
    rules = VllmRules.of(vllm_version)
    name = disk_module
    mtp = False
    n_layer = _num_layers(config)
    mt = model_type or ""
    if engine not in _FUSING:
        # mtpkit and transformers build the on-disk modules as they are.
        kind = _leaf_kind(name)
        return RuntimeModule(name, (), kind != "never", _is_mtp_name(name, n_layer), kind=kind)

    if mt in _KIMI_VLM:
        return _describe_kimi(name, engine, config, vllm_version)
    if mt in _DSV4 and engine == "vllm":
        return _describe_dsv4(name, n_layer)
    if mt in _DSV4 and engine == "sglang":
        return _describe_dsv4_sglang(name, config)
    # MTP layouts first: they decide the prefix and which name map applies.
    if name.startswith("mtp."):
        mtp = True
    elif m := re.match(r"model\.mtp\.layers\.(\d+)\.(.+)$", name):
        # MiMo-V2-Flash: vLLM builds them under the on-disk names, no prefix map.
        mtp = True
        if engine == "sglang" and mt in _MIMO_V2:
            # SGLang's MiMoV2MTP builds one layer: its own modules at model.*, the block
            # under the prefix model.decoder, and every stored layer loads into that block.
            rest = m[2].replace("pre_mlp_layernorm", "post_attention_layernorm")
            own = rest.split(".")[0] in _MIMO_V2_OWN
            name = f"model.{rest}" if own else f"model.decoder.{rest}"
        elif engine == "vllm" and mt in _MIMO_V2:
            if int(m[1]) >= _MIMO_V2_VLLM_LAYERS:
                # Described as layer 0 would be (fused names for the ignore list), not built.
                rt = describe(f"model.mtp.layers.0.{m[2]}", model_type, engine, config=config,
                              vllm_version=vllm_version)
                return replace(rt, name=name[:-len(m[2])] + rt.name[len("model.mtp.layers.0."):],
                               shards=tuple(name[:-len(m[2])] + s[len("model.mtp.layers.0."):]
                                            for s in rt.shards),
                               built=False)
            if m[2] == "self_attn.o_proj":
                # MiMoV2Attention passes quant_config=None to o_proj when its prefix holds
                # "mtp.layers": a float module whatever the ignore list says.
                return RuntimeModule(name, (), False, mtp, kind="never")
    elif m := re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", name):
        # MiMo: vLLM builds MTP layer i as model.layers.{num_hidden_layers + i}.
        if n_layer is None:
            raise ValueError(
                f"{disk_module}: MiMo MTP modules are renamed to model.layers.{{L+i}} by the "
                "engine; pass config= (config.json) so that num_hidden_layers is known"
            )
        mtp = True
        name = f"model.layers.{n_layer + int(m[1])}.{m[2]}"
    elif mt in _STEP and (m := re.match(r"model\.layers\.(\d+)\.(.+)$", name)):
        return _describe_step(engine, int(m[1]), m[2], n_layer, config)
    elif m := re.match(r"model\.layers\.(\d+)\.(.+)$", name):
        rest = m[2]
        deep = n_layer is not None and int(m[1]) >= n_layer
        own = rest.split(".")[0] in _NEXTN_OWN
        if deep or own and rest.split(".")[0] != "embed_tokens":
            mtp = True
            if engine == "sglang" and mt in _NEXTN and deep:
                # SGLang's NextN model: the block is model.decoder, its own modules model.*
                name = f"model.{rest}" if own else f"model.decoder.{rest}"
            elif engine == "vllm" and rest == "shared_head.head":
                # SharedHead builds its ParallelLMHead under the layer's prefix + "head".
                name = f"model.layers.{m[1]}.head"
    if not mtp and engine == "vllm":
        name = _apply_prefixes(name, _prefix_map(mt, config, rules))
        if name == "lm_head" and _prefix_map(mt, config, rules) is _VLM_PREFIXES:
            name = "language_model.lm_head"

    if mt in _DSA and (m := re.match(r"(.+\.indexer)\.(wk|weights_proj)$", name)):
        # The indexer's weights_proj is built without a quantization config by both engines;
        # vLLM also fuses wk into it (wk_weights_proj), so wk is never quantized there either.
        if engine == "vllm":
            return RuntimeModule(f"{m[1]}.wk_weights_proj", (), False, mtp, fused=True,
                                 kind="never")
        if m[2] == "weights_proj":
            return RuntimeModule(name, (), False, mtp, kind="never")

    kind = _leaf_kind(name)
    if kind != "linear":
        return RuntimeModule(name, (), kind != "never", mtp, kind=kind)

    # Routed experts: one module per layer, decided by its expert 0's three projections.
    m = re.match(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$", name)
    stacked = name.endswith(".mlp.experts")
    if m or stacked:
        base = m[1] if m else name
        if engine == "sglang":
            # SGLang's rule is not re-read here: every expert's three names, as before.
            count = _num_experts(config)
            experts = range(count) if count else [int(m[2]) if m else 0]
            shards = tuple(f"{base}.{e}.{p}" for e in experts for p in _EXPERT_PROJS)
        else:
            shards = expert_probe_names(base)
        return RuntimeModule(base, shards, True, mtp, fused=True, kind="experts")

    prefix, _, leaf = name.rpartition(".")
    for fused, shard_leaves in _fusions(mt, engine, mtp, config).items():
        if leaf in shard_leaves:
            runtime = f"{prefix}.{fused}" if prefix else fused
            if engine == "sglang" and (mtp and mt in _QWEN35 or mt in _MIMO_V2):
                # SGLang's Qwen3.5 MTP class (sglang#35797) and its MiMo-V2 classes declare
                # no packed-modules mapping: only the fused name itself excludes the module.
                return RuntimeModule(runtime, (), True, mtp, fused=True, kind="fused")
            shards = tuple(f"{prefix}.{s}" if prefix else s for s in shard_leaves)
            return RuntimeModule(runtime, shards, True, mtp, fused=True, kind="fused")
    return RuntimeModule(name, (), True, mtp)


def _describe_kimi(disk: str, engine: str, config: dict | None,
                   vllm_version: str | tuple | None) -> RuntimeModule:
    """The Kimi-K2.5 module vLLM or SGLang builds for an on-disk module (see _KIMI_VLM)."""
    name = _apply_prefixes(disk, _KIMI_NVFP4)
    if name.startswith("language_model.model."):
        inner = "model." + name[len("language_model.model."):]
    elif name == "language_model.lm_head":
        inner = "lm_head"
    else:  # the vision tower and projector, under their on-disk names
        return describe(disk, None, engine, config=config, vllm_version=vllm_version)
    if _is_mtp_name(inner, _num_layers(config)):
        kind = _leaf_kind(inner)
        return RuntimeModule(name, (), kind != "never", True, kind=kind, built=False)
    rt = describe(inner, _KIMI_TEXT, engine, config=config, vllm_version=vllm_version)
    if engine == "sglang":
        return rt
    return replace(rt, name="language_model." + rt.name,
                   shards=tuple("language_model." + s for s in rt.shards))


def _describe_step(engine: str, layer: int, rest: str, n_layer: int | None,
                   config: dict | None) -> RuntimeModule:
    """The Step-3.5/3.7 module vLLM or SGLang builds for model.layers.{layer}.{rest}."""
    mtp = n_layer is not None and layer >= n_layer
    sglang = engine == "sglang"
    if mtp:
        rest = rest.removeprefix("transformer.")
        # vLLM keeps each layer's prefix; SGLang builds one draft model per layer, each
        # with its modules at model.* and its block at model.mtp_block.
        at = "model." if sglang else f"model.layers.{layer}."
        if rest == "shared_head.output":
            return RuntimeModule(f"{at}shared_head.head", (), True, True, kind="head")
        if rest == "eh_proj":  # vLLM: a ReplicatedLinear given the config; SGLang: nn.Linear
            return RuntimeModule(f"{at}eh_proj", (), not sglang, True,
                                 kind="never" if sglang else "linear")
        base = at if rest.split(".")[0] in _STEP_OWN else f"{at}mtp_block."
    else:
        base = f"model.layers.{layer}."
        if re.match(r"moe\.(gate_proj|up_proj|down_proj)$", rest):
            # Stacked [E, ...] experts: one fused-MoE module a layer (SGLang's under "mlp").
            experts = f"{base}{'mlp' if sglang else 'moe'}.experts"
            if sglang:  # as for every family: each expert's three names
                count = _num_experts(config) or 1
                shards = tuple(f"{experts}.{e}.{p}" for e in range(count)
                               for p in _EXPERT_PROJS)
            else:
                shards = expert_probe_names(experts)
            return RuntimeModule(experts, shards, True, False, fused=True, kind="experts")
        if sglang:
            rest = re.sub(r"^moe\.", "mlp.", rest)  # Step3p5MoEMLP's prefix is "mlp"
        elif rest.startswith("share_expert."):
            rest = "moe." + rest  # vLLM's hf_to_vllm_mapper
    name = base + rest
    if sglang and name.endswith(".self_attn.g_proj"):
        # a ColumnParallelLinear built without the quantization config
        return RuntimeModule(name, (), False, mtp, kind="never")
    kind = _leaf_kind(name)
    if kind != "linear":
        return RuntimeModule(name, (), kind != "never", mtp, kind=kind)
    prefix, _, leaf = name.rpartition(".")
    for fused, shard_leaves in _BASE_FUSIONS.items():
        if leaf in shard_leaves:
            # SGLang's Step classes declare no packed-modules mapping: only the fused name
            # excludes a fused module.
            shards = () if sglang else tuple(f"{prefix}.{s}" for s in shard_leaves)
            return RuntimeModule(f"{prefix}.{fused}", shards, True, mtp, fused=True,
                                 kind="fused")
    return RuntimeModule(name, (), True, mtp)


def _dsv4_outside(disk: str) -> RuntimeModule:
    """A DeepSeek-V4 module outside the layers (embedding, head...): vLLM and SGLang alike."""
    if disk in ("embed", "model.embed_tokens"):
        return RuntimeModule("model.embed_tokens", (), True, False, kind="embedding")
    if disk in ("head", "lm_head"):
        return RuntimeModule("lm_head", (), True, False, kind="head")
    kind = _leaf_kind(disk)
    return RuntimeModule(disk, (), kind != "never", False, kind=kind)


def _describe_dsv4(disk: str, n_layer: int | None) -> RuntimeModule:
    """The DeepSeek-V4 module vLLM builds for a release module (``layers.{i}.attn.wq_a``,
    ``mtp.{i}.e_proj``..., with or without ``model.``)."""
    if m := re.match(r"mtp\.(\d+)\.(.+)$", disk):
        if n_layer is None:
            raise ValueError(
                f"{disk}: vLLM builds DeepSeek-V4 MTP layer i as model.layers.{{L+i}}; pass "
                "config= (config.json) so that num_hidden_layers is known")
        at, rest, mtp = f"model.layers.{n_layer + int(m[1])}.", m[2], True
        head = rest.split(".")[0]
        if head == "head":  # SharedHead's ParallelLMHead, under the layer's prefix + head
            return RuntimeModule(f"{at}head", (), True, True, kind="head")
        if head == "emb":  # the draft's one embedding, shared by its layers
            return RuntimeModule("model.embed_tokens", (), True, True, kind="embedding")
        if head == "norm":
            return RuntimeModule(f"{at}shared_head.norm", (), False, True, kind="never")
        if head not in _DSV4_MTP_OWN:
            at += "mtp_block."  # the decoder block
    elif m := re.match(r"(?:model\.)?layers\.(\d+)\.(.+)$", disk):
        at, rest, mtp = f"model.layers.{m[1]}.", m[2], False
    else:
        return _dsv4_outside(disk)
    name = at + rest
    if c := re.match(r"(.+\.compressor)\.(wkv|wgate)$", name):
        # Compressors (the attention's and the indexer's) are one fused_wkv_wgate each,
        # built without a quantization config: the release stores them in float.
        return RuntimeModule(f"{c[1]}.fused_wkv_wgate", (), False, mtp, fused=True,
                             kind="never")
    if name.endswith((".indexer.weights_proj", ".ffn.gate")) or _leaf_kind(name) == "never":
        # weights_proj: quant_config=None; the router: a GateLinear.
        return RuntimeModule(name, (), False, mtp, kind="never")
    if e := re.match(r"(.+\.ffn\.experts)\.\d+\.w[123]$", name):
        # One fused-MoE module a layer, decided (compressed-tensors) by expert 0's
        # checkpoint names w1 / w3 / w2, or (the release's fp8 config) by any ignore entry
        # holding the module's name.
        shards = tuple(f"{e[1]}.0.{w}" for w in ("w1", "w3", "w2"))
        return RuntimeModule(e[1], shards, True, mtp, fused=True, kind="experts")
    for a, b in _DSV4_SUBSTR:
        name = name.replace(a, b)
    prefix, _, leaf = name.rpartition(".")
    for fused, shard_leaves in _DSV4_FUSIONS.items():
        if leaf in shard_leaves:
            return RuntimeModule(f"{prefix}.{fused}",
                                 tuple(f"{prefix}.{s}" for s in shard_leaves), True, mtp,
                                 fused=True, kind="fused")
    return RuntimeModule(name, (), True, mtp)


def _describe_dsv4_sglang(disk: str, config: dict | None) -> RuntimeModule:
    """The DeepSeek-V4 module SGLang builds for a release module (its default settings)."""
    if m := re.match(r"mtp\.(\d+)\.(.+)$", disk):
        # DeepseekV4ForCausalLMNextN: one draft layer (num_nextn_predict_layers must be 1);
        # its loader maps every mtp.{i}.* onto it, own modules at model.*, the block at
        # model.decoder.
        rest, mtp = m[2], True
        own = rest.split(".")[0]
        if own == "emb":
            return RuntimeModule("model.embed_tokens", (), True, True, kind="embedding")
        if own == "head":  # a ParallelLMHead at model.shared_head.head
            return RuntimeModule("model.shared_head.head", (), True, True, kind="head")
        if own in _DSV4_SGL_MTP_OWN:
            name = f"model.{_DSV4_SGL_MTP_OWN[own]}"
            kind = _leaf_kind(name)
            return RuntimeModule(name, (), kind != "never", True, kind=kind)
        name = "model.decoder." + rest
    elif m := re.match(r"(?:model\.)?layers\.(\d+)\.(.+)$", disk):
        name, mtp = f"model.layers.{m[1]}.{m[2]}", False
    else:
        return _dsv4_outside(disk)
    name = "." + name  # so that the draft block's leading attn / ffn is renamed too
    for a, b in _DSV4_SGL_SUBSTR:  # each a whole name component
        name = re.sub(re.escape(a) + r"(?=\.|$)", b, name)
    name = name[1:]
    if c := re.match(r"(.+\.compressor)\.(wkv|wgate)$", name):
        # Compressor: one wkv_gate weight read by a bf16 x fp32 GEMM, never quantized.
        return RuntimeModule(f"{c[1]}.wkv_gate", (), False, mtp, fused=True, kind="never")
    if name.endswith((".indexer.weights_proj", ".mlp.gate")) or _leaf_kind(name) == "never":
        # weights_proj: quant_config=None; the router: a float parameter of the MoE gate.
        return RuntimeModule(name, (), False, mtp, kind="never")
    if name.endswith(".self_attn.wo_a"):
        # By default (SGLANG_OPT_FP8_WO_A_GEMM) wo_a needs FP8 block scales
        # (weight_scale_inv); a compressed-tensors checkpoint loads only with that off, where
        # wo_a is a bf16 layer without a quantization config.
        return RuntimeModule(name, (), False, mtp, kind="never")
    if a := re.match(r"(.+\.self_attn)\.(wq_a|wkv)$", name):
        # SGLANG_OPT_FUSE_WQA_WKV (on by default): one wqkv_a, decided by its own name only;
        # its loader fuses .weight / .weight_scale_inv alone, so compressed-tensors scales
        # (weight_scale, weight_packed) never reach it.
        return RuntimeModule(f"{a[1]}.wqkv_a", (), True, mtp, fused=True, kind="fused",
                             loads_quantized=False)
    if e := re.match(r"(.+\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$", name):
        # One FusedMoE a layer; as for every family in SGLang, each expert's three names.
        count = _num_experts(config)
        experts = range(count) if count else [int(name.split(".")[-2])]
        shards = tuple(f"{e[1]}.{x}.{p}" for x in experts for p in _EXPERT_PROJS)
        return RuntimeModule(e[1], shards, True, mtp, fused=True, kind="experts")
    if s := re.match(r"(.+\.shared_experts)\.(gate_proj|up_proj)$", name):
        return RuntimeModule(f"{s[1]}.gate_up_proj", (), True, mtp, fused=True, kind="fused")
    return RuntimeModule(name, (), True, mtp)


def _leaf_kind(name: str) -> str:
    """linear | head | embedding | never, from the module's name."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("lm_head", "head"):
        return "head"
    if leaf == "embed_tokens":
        return "embedding"
    if leaf in _NEVER_QUANTIZED_LEAVES or leaf.endswith("norm") or leaf.endswith("layernorm"):
        return "never"
    # MoE routers are GateLinear / unquantized linears; patch embeddings are convolutions.
    if name.endswith((".mlp.gate", ".moe.gate")) or leaf == "shared_expert_gate" \
            or "patch_embed" in name:
        return "never"
    # vLLM builds the gated-delta conv1d as a linear layer without a quantization config.
    return "never" if leaf in ("conv1d", "A_log", "dt_bias") else "linear"


def _is_mtp_name(name: str, n_layer: int | None) -> bool:
    if name.startswith(("mtp.", "model.mtp_layers.", "model.mtp.")):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m and n_layer is not None and int(m[1]) >= n_layer)


def runtime_module(
    disk_module: str, model_type: str | None, engine: str = "vllm", *, config: dict | None = None,
    vllm_version: str | tuple | None = None,
) -> str:
    """On-disk module path -> the module name the engine builds (its quantization prefix)."""
    return describe(disk_module, model_type, engine, config=config,
                    vllm_version=vllm_version).name


# -- ignore matching -------------------------------------------------------------------------


def entry_matches(entry: str, name: str) -> bool:
    """One ignore entry against one module name: exact, or ``re:`` with ``re.match``."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False  # an invalid pattern matches nothing (doctor reports it)
    return entry == name


def map_ignore_entries(
    ignore: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    mtp: bool = False,
    config: dict | None = None,
    vllm_version: str | tuple | None = None,
) -> list[str]:
    """The ignore list as the engine holds it after its HF -> engine name map (vLLM's Qwen3.5
    classes; SGLang's DeepSeek/GLM MTP layer, renamed model.decoder like its weights)."""
    ignore = list(ignore)
    mt = model_type or ""
    n_layer = _num_layers(config)
    if engine == "sglang" and mtp and mt in _NEXTN and n_layer is not None:
        out = []
        for entry in ignore:
            m = re.match(r"model\.layers\.(\d+)\.(.+)$", entry)
            if m and int(m[1]) >= n_layer and not entry.startswith("re:"):
                own = m[2].split(".")[0] in _NEXTN_OWN
                entry = f"model.{m[2]}" if own else f"model.decoder.{m[2]}"
            out.append(entry)
        return out
    if engine == "vllm" and mt in _DSV4:
        # DeepseekV4ForCausalLM's hf_to_vllm_mapper, on dotted exact entries. The draft
        # shares the target's config as mapped, so an exact mtp.{i}.* entry becomes
        # model.mtp.{i}.* and never names the draft's model.layers.{L + i}.* modules.
        out = []
        for e in ignore:
            if "." in e and not e.startswith("re:"):
                for a, b in _DSV4_SUBSTR:
                    e = e.replace(a, b, 1)
                e = _apply_prefixes(e, _DSV4_PREFIXES)
            out.append(e)
        return out
    if engine == "vllm" and mt in _KIMI_VLM:
        # KimiK25ForConditionalGeneration's hf_to_vllm_mapper (NVFP4 exports' prefix).
        return [_apply_prefixes(e, _KIMI_NVFP4) if "." in e and not e.startswith("re:")
                else e for e in ignore]
    if engine == "vllm" and mt in _STEP:
        # Step3p5ForCausalLM's substring map, applied to every dotted exact entry as to the
        # weights (an entry already naming moe.share_expert gets the prefix twice, as there).
        return [e.replace(".share_expert.", ".moe.share_expert.")
                if "." in e and not e.startswith("re:") else e for e in ignore]
    prefixes = _prefix_map(mt, config, VllmRules.of(vllm_version)) if engine == "vllm" else ()
    if not prefixes:
        return ignore
    # The draft model shares the target's quantization config, whose entries the target's
    # class has mapped already (exact ``mtp.*`` entries pass through it unchanged).
    # vLLM maps dotted, non-regex entries only; class names and re: patterns stay.
    return [_apply_prefixes(e, prefixes) if "." in e and not e.startswith("re:") else e
            for e in ignore]


def is_class_name(entry: str) -> bool:
    """Whether a compressed-tensors ignore entry or target names a class ("Linear")."""
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def _matched(name: str, entries: list[str]) -> bool:
    return any(entry_matches(e, name) for e in entries)


def ignore_status(
    disk_module: str,
    ignore: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    config: dict | None = None,
    targets: Iterable[str] | None = None,
    vllm_version: str | tuple | None = None,
) -> IgnoreStatus:
    """Whether the engine builds this on-disk module quantized, given a compressed-tensors
    ``ignore`` list and the config groups' ``targets`` (None: ``["Linear"]``, what quantize
    and llm-compressor write); see the module docstring for the rules."""
    rules = VllmRules.of(vllm_version)
    rt = describe(disk_module, model_type, engine, config=config, vllm_version=vllm_version)
    if not rt.quantizable or not rt.built:
        # A module the engine does not build is never built quantized either.
        return IgnoreStatus.NOT_QUANTIZABLE
    entries = map_ignore_entries(ignore, model_type, engine, mtp=rt.mtp, config=config,
                                 vllm_version=vllm_version)
    tlist = ["Linear"] if targets is None else list(targets)
    if rt.by_name_only:
        if engine == "vllm" and rt.kind == "head" and not rules.heads_by_name:
            return IgnoreStatus.NOT_QUANTIZABLE
        if engine in _FUSING:
            # Targets go through the same name map as ignore entries, then meet the runtime
            # name only (a target naming ...shared_head.head misses model.layers.{L}.head).
            named = map_ignore_entries([t for t in tlist if not is_class_name(t)], model_type,
                                       engine, mtp=rt.mtp, config=config,
                                       vllm_version=vllm_version)
            hit = any(entry_matches(t, rt.name) for t in named)
        else:
            # compressed-tensors' own matching: "Linear" reaches an lm_head
            hit = any(t == "Linear" or entry_matches(t, disk_module) for t in tlist)
        if not hit:
            return IgnoreStatus.NOT_QUANTIZABLE
    if engine not in _FUSING:
        # compressed-tensors' own matching: names, regexes and class names ("Linear" is every
        # linear layer; the modules asked about here are linear layers).
        hit = any(entry_matches(e, rt.name) or e == "Linear" for e in entries)
        return IgnoreStatus.IGNORED if hit else IgnoreStatus.QUANTIZED
    names = [e for e in entries if not is_class_name(e)]  # vLLM does not match classes
    if rt.kind == "experts" and engine == "vllm":
        if not rules.experts_by_first:
            return IgnoreStatus.QUANTIZED
        hits = {_matched(s, names) for s in rt.shards}
        if len(hits) > 1:
            return IgnoreStatus.SHARD_CONFLICT
        return IgnoreStatus.IGNORED if hits == {True} else IgnoreStatus.QUANTIZED
    if rt.shards:
        whole = (_matched(rt.name, names) if engine == "vllm" and rules.fused_regex
                 else rt.name in names)
        if whole:
            return IgnoreStatus.IGNORED
        hits = {_matched(s, names) for s in rt.shards}
        if len(hits) > 1:
            return IgnoreStatus.SHARD_CONFLICT
        return IgnoreStatus.IGNORED if hits == {True} else IgnoreStatus.QUANTIZED
    return IgnoreStatus.IGNORED if _matched(rt.name, names) else IgnoreStatus.QUANTIZED


def is_ignored(
    disk_module: str,
    ignore: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    config: dict | None = None,
    targets: Iterable[str] | None = None,
    vllm_version: str | tuple | None = None,
) -> bool:
    """True when the engine leaves this module unquantized (ignored, or never quantized).

    A shard conflict (vLLM refuses to load) is False here; ``ignore_status`` reports it."""
    status = ignore_status(disk_module, ignore, model_type, engine, config=config,
                           targets=targets, vllm_version=vllm_version)
    return status in (IgnoreStatus.IGNORED, IgnoreStatus.NOT_QUANTIZABLE)


def ignore_list_for(
    disk_modules: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    config: dict | None = None,
) -> list[str]:
    """Ignore entries that keep exactly these on-disk modules unquantized: the on-disk names
    (for llm-compressor / transformers) and the engine's fused or renamed names (for the
    engine; ``engine="all"``: for vLLM and SGLang at once), sorted and deduplicated.

    Routed experts (stored one by one, or a stacked ``...mlp.experts`` module) add the three
    ``experts.0.*`` names vLLM decides them by. Exact entries only: they hold in every vLLM
    release read (0.14.0 to 0.33.0), where ``re:`` entries on fused names do not. Raises
    ValueError when only some shards of a fused module (or some experts of a layer) are
    given: no ignore list can make vLLM load that."""
    disk = sorted(set(disk_modules))
    out: set[str] = set(disk)
    if engine == "all":
        for e in _FUSING:
            out.update(ignore_list_for(disk, model_type, e, config=config))
        return sorted(out)
    _check_engine(engine)
    if engine not in _FUSING:
        return sorted(out)
    by_runtime: dict[str, tuple[RuntimeModule, set[str]]] = {}
    for d in disk:
        rt = describe(d, model_type, engine, config=config)
        by_runtime.setdefault(rt.name, (rt, set()))[1].add(d)
    for name, (rt, members) in by_runtime.items():
        if rt.kind == "experts":
            _check_experts_complete(name, members, config)
        elif rt.shards:
            member_shards = {_runtime_shard_of(d, model_type, engine, config) for d in members}
            missing = [s for s in rt.shards if s not in member_shards]
            if missing:
                raise ValueError(
                    f"{sorted(members)[0]}: the engine fuses it into {name} together with "
                    f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which "
                    "would stay quantized; a fused module is quantized as a whole. Keep all "
                    "of its shards unquantized, or none."
                )
        out.add(name)
        out.update(rt.shards)
        if rt.kind == "experts" and engine == "vllm":
            out.discard(name)  # never consulted: the experts.0.* names decide
    return sorted(out)


def _check_experts_complete(name: str, members: set[str], config: dict | None) -> None:
    # A stacked module is every expert at once; per-expert modules must all be there.
    if any(m.endswith(".mlp.experts") or re.search(r"\.moe\.(gate|up|down)_proj$", m)
           for m in members):
        return
    count = _num_experts(config)
    if not count:
        return
    have = {m.rsplit(".", 2)[-2:][0] + "." + m.rsplit(".", 1)[-1] for m in members}
    # DeepSeek-V4's experts keep the release's w1 / w2 / w3.
    projs = ("w1", "w2", "w3") if any(m.endswith((".w1", ".w2", ".w3")) for m in members) \
        else _EXPERT_PROJS
    want = {f"{e}.{p}" for e in range(count) for p in projs}
    missing = sorted(want - have)
    if missing:
        raise ValueError(
            f"{sorted(members)[0]}: vLLM builds the experts of {name} as one module, quantized "
            f"or not as a whole; experts {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} would stay quantized. Keep every expert "
            "of the layer unquantized, or none."
        )


def _runtime_shard_of(disk: str, model_type, engine, config) -> str:
    """The runtime shard name of an on-disk shard module (its runtime prefix + disk leaf)."""
    rt = describe(disk, model_type, engine, config=config)
    leaf = disk.rsplit(".", 1)[-1]
    prefix = rt.name.rpartition(".")[0]
    return f"{prefix}.{leaf}" if prefix else leaf
