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
- a fused module is left unquantized when its own name is listed *exactly*, or when every
  shard name (the fused name with the shard's leaf put back) is matched; shards that disagree
  make vLLM refuse to load ("Found a different quantization schemes ...");
- vLLM does not match class names (``Linear``) in ``ignore``; compressed-tensors and
  llm-compressor do (engine ``transformers`` / ``mtpkit`` here);
- the Qwen3.5 VLM trunk (``model.language_model.*``) is built as ``language_model.model.*``;
  vLLM rewrites exact (dotted, non-``re:``) ignore entries with the same prefix map before
  matching, but never ``re:`` patterns; the MTP draft model has no such map;
- vLLM builds one fused-MoE module per layer (``...mlp.experts``); per-expert entries count as
  its shards (every expert's gate/up/down must be listed);
- modules vLLM builds as plain ``nn.Linear``, routers (``GateLinear``, no quantization
  config), convolutions or embeddings are never quantized: DeepSeek/GLM ``eh_proj``, MiMo
  ``input_proj``, ``mlp.gate``, ``shared_expert_gate``, ``lm_head``/``shared_head.head``,
  ``embed_tokens``, a vision ``patch_embed``.

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
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "ENGINES",
    "IgnoreStatus",
    "RuntimeModule",
    "describe",
    "disk_module_of",
    "entry_matches",
    "ignore_list_for",
    "ignore_status",
    "is_ignored",
    "map_ignore_entries",
    "runtime_module",
]

ENGINES = ("vllm", "sglang", "mtpkit", "transformers")
_FUSING = ("vllm", "sglang")

# Tensor-name suffixes that sit below a module name, for every quantized format mtpkit knows.
PARAM_SUFFIXES = (
    "weight", "bias", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
    "weight_g_idx", "weight_global_scale", "input_scale", "input_global_scale",
    "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
)
# Qwen3.5 MoE stores experts stacked: ``...mlp.experts.gate_up_proj`` is a parameter of the
# ``...mlp.experts`` module, not a module of its own.
_STACKED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class IgnoreStatus(str, Enum):
    """What an engine does with one on-disk module, given an ignore list."""

    QUANTIZED = "quantized"  # built as a quantized module: needs quantized tensors on disk
    IGNORED = "ignored"  # left unquantized because the ignore list covers it
    NOT_QUANTIZABLE = "not-quantizable"  # never quantized by this engine (nn.Linear, lm_head...)
    SHARD_CONFLICT = "shard-conflict"  # shards of one fused module disagree: vLLM refuses to load


@dataclass(frozen=True)
class RuntimeModule:
    """One module as the engine builds it."""

    name: str  # the engine's module name (the ``prefix`` its quantization config sees)
    shards: tuple[str, ...] = ()  # names whose ignore decisions combine (empty: not fused)
    quantizable: bool = True  # False: the engine never quantizes it
    mtp: bool = False  # part of the MTP draft model (matched without the trunk's name map)
    fused: bool = False  # built from several on-disk modules (shards)


# -- families --------------------------------------------------------------------------------

_QWEN35 = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_DEEPSEEK = {"deepseek_v3", "deepseek_v2", "deepseek_v32", "kimi_k2"}
_GLM = {"glm4_moe"}
# Architectures whose vLLM class is a VLM wrapper with the Qwen3-VL name map (the VLM
# release layout; a ``*_text`` model_type is the text-only class without it).
_VLM_MAPPED = {"qwen3_5", "qwen3_5_moe"}
# vLLM's hf_to_vllm_mapper prefixes for those classes (HF name -> engine name).
_VLM_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
)

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


def _fusions(model_type: str | None, engine: str, mtp: bool, config: dict | None) -> dict:
    """fused leaf -> shard leaves for this family and engine."""
    if engine not in _FUSING:
        return {}
    mt = model_type or ""
    if mt in _DEEPSEEK:
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
    for key in ("n_routed_experts", "num_experts"):
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


# -- on-disk name -> runtime module ----------------------------------------------------------


def disk_module_of(tensor_name: str) -> tuple[str, str]:
    """Tensor name -> (module name, parameter name); stacked experts belong to ``...experts``."""
    head, _, last = tensor_name.rpartition(".")
    return (head, last) if head else (tensor_name, "")


_NEVER_QUANTIZED_LEAVES = ("eh_proj", "input_proj", "lm_head", "head", "embed_tokens")


def describe(
    disk_module: str, model_type: str | None, engine: str = "vllm", *, config: dict | None = None
) -> RuntimeModule:
    """The runtime module an engine builds for one on-disk module (see the module docstring)."""
    _check_engine(engine)
    name = disk_module
    mtp = False
    n_layer = _num_layers(config)
    mt = model_type or ""
    if engine not in _FUSING:
        # mtpkit and transformers build the on-disk modules as they are.
        return RuntimeModule(name, (), _quantizable_leaf(name), _is_mtp_name(name, n_layer))

    # MTP layouts first: they decide the prefix and which name map applies.
    if name.startswith("mtp."):
        mtp = True
    elif m := re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", name):
        # MiMo: vLLM builds MTP layer i as model.layers.{num_hidden_layers + i}.
        if n_layer is None:
            raise ValueError(
                f"{disk_module}: MiMo MTP modules are renamed to model.layers.{{L+i}} by the "
                "engine; pass config= (config.json) so that num_hidden_layers is known"
            )
        mtp = True
        name = f"model.layers.{n_layer + int(m[1])}.{m[2]}"
    elif m := re.match(r"model\.layers\.(\d+)\.(.+)$", name):
        rest = m[2]
        deep = n_layer is not None and int(m[1]) >= n_layer
        if deep or rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
            mtp = True
            if engine == "sglang" and (mt in _DEEPSEEK or mt in _GLM) and deep:
                # SGLang's NextN model: the block is model.decoder, its own modules model.*
                own = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head")
                name = f"model.{rest}" if own else f"model.decoder.{rest}"
    elif engine == "vllm" and mt in _VLM_MAPPED:
        for hf, ours in _VLM_PREFIXES:
            if name.startswith(hf):
                name = ours + name[len(hf):]
                break
        else:
            if name == "lm_head" and isinstance((config or {}).get("text_config"), dict):
                name = "language_model.lm_head"

    if not _quantizable_leaf(name):
        return RuntimeModule(name, (), False, mtp)

    # Experts: one fused-MoE module per layer; per-expert modules are its shards.
    if m := re.match(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$", name):
        base = m[1]
        count = _num_experts(config)
        experts = range(count) if count else [int(m[2])]
        shards = tuple(f"{base}.{e}.{p}" for e in experts for p in ("gate_proj", "up_proj",
                                                                      "down_proj"))
        return RuntimeModule(base, shards, True, mtp, fused=True)
    if name.endswith(".experts"):
        return RuntimeModule(name, (), True, mtp)

    prefix, _, leaf = name.rpartition(".")
    for fused, shard_leaves in _fusions(mt, engine, mtp, config).items():
        if leaf in shard_leaves:
            runtime = f"{prefix}.{fused}" if prefix else fused
            if engine == "sglang" and mtp and mt in _QWEN35:
                # SGLang's Qwen3.5 MTP class declares no packed-modules mapping (sglang#35797):
                # only the fused name itself can exclude the module.
                return RuntimeModule(runtime, (), True, mtp, fused=True)
            shards = tuple(f"{prefix}.{s}" if prefix else s for s in shard_leaves)
            return RuntimeModule(runtime, shards, True, mtp, fused=True)
    return RuntimeModule(name, (), True, mtp)


def _quantizable_leaf(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NEVER_QUANTIZED_LEAVES or leaf.endswith("norm") or leaf.endswith("layernorm"):
        return False
    # MoE routers are GateLinear / unquantized linears; patch embeddings are convolutions.
    if name.endswith(".mlp.gate") or leaf == "shared_expert_gate" or "patch_embed" in name:
        return False
    # vLLM builds the gated-delta conv1d as a linear layer without a quantization config.
    return leaf not in ("conv1d", "A_log", "dt_bias")


def _is_mtp_name(name: str, n_layer: int | None) -> bool:
    if name.startswith(("mtp.", "model.mtp_layers.")):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m and n_layer is not None and int(m[1]) >= n_layer)


def runtime_module(
    disk_module: str, model_type: str | None, engine: str = "vllm", *, config: dict | None = None
) -> str:
    """On-disk module path -> the module name the engine builds (its quantization prefix)."""
    return describe(disk_module, model_type, engine, config=config).name


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
) -> list[str]:
    """The ignore list as the engine holds it after its HF -> engine name map (vLLM VLMs;
    SGLang's DeepSeek/GLM MTP layer, renamed model.decoder like its weights)."""
    ignore = list(ignore)
    mt = model_type or ""
    n_layer = _num_layers(config)
    if engine == "sglang" and mtp and (mt in _DEEPSEEK or mt in _GLM) and n_layer is not None:
        out = []
        for entry in ignore:
            m = re.match(r"model\.layers\.(\d+)\.(.+)$", entry)
            if m and int(m[1]) >= n_layer and not entry.startswith("re:"):
                own = m[2].split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head")
                entry = f"model.{m[2]}" if own else f"model.decoder.{m[2]}"
            out.append(entry)
        return out
    if engine != "vllm" or mtp or mt not in _VLM_MAPPED:
        return ignore
    out = []
    for entry in ignore:
        # vLLM maps dotted, non-regex entries only; class names and re: patterns stay.
        if "." in entry and not entry.startswith("re:"):
            for hf, ours in _VLM_PREFIXES:
                if entry.startswith(hf):
                    entry = ours + entry[len(hf):]
                    break
        out.append(entry)
    return out


def is_class_name(entry: str) -> bool:
    """Whether a compressed-tensors ignore entry or target names a class ("Linear")."""
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def ignore_status(
    disk_module: str,
    ignore: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    config: dict | None = None,
) -> IgnoreStatus:
    """Whether the engine builds this on-disk module quantized, given a compressed-tensors
    ``ignore`` list (see the module docstring for the rules)."""
    rt = describe(disk_module, model_type, engine, config=config)
    if not rt.quantizable:
        return IgnoreStatus.NOT_QUANTIZABLE
    entries = map_ignore_entries(ignore, model_type, engine, mtp=rt.mtp, config=config)
    if engine not in _FUSING:
        # compressed-tensors' own matching: names, regexes and class names ("Linear" is every
        # linear layer; the modules asked about here are linear layers).
        hit = any(entry_matches(e, rt.name) or e == "Linear" for e in entries)
        return IgnoreStatus.IGNORED if hit else IgnoreStatus.QUANTIZED
    names = [e for e in entries if not is_class_name(e)]  # vLLM does not match classes
    if rt.shards and rt.name not in names:
        hits = {any(entry_matches(e, s) for e in names) for s in rt.shards}
        if len(hits) > 1:
            return IgnoreStatus.SHARD_CONFLICT
        return IgnoreStatus.IGNORED if hits == {True} else IgnoreStatus.QUANTIZED
    hit = any(entry_matches(e, rt.name) for e in names)
    return IgnoreStatus.IGNORED if hit else IgnoreStatus.QUANTIZED


def is_ignored(
    disk_module: str,
    ignore: Iterable[str],
    model_type: str | None,
    engine: str = "vllm",
    *,
    config: dict | None = None,
) -> bool:
    """True when the engine leaves this module unquantized (ignored, or never quantized).

    A shard conflict (vLLM refuses to load) is False here; ``ignore_status`` reports it."""
    status = ignore_status(disk_module, ignore, model_type, engine, config=config)
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
    engine; ``engine="all"``: for vLLM and SGLang at once), sorted and deduplicated. Raises
    ValueError when only some shards of a fused module are given: no ignore list can make
    vLLM load that."""
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
        if rt.shards:
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
    return sorted(out)


def _runtime_shard_of(disk: str, model_type, engine, config) -> str:
    """The runtime shard name of an on-disk shard module (its runtime prefix + disk leaf)."""
    rt = describe(disk, model_type, engine, config=config)
    leaf = disk.rsplit(".", 1)[-1]
    if rt.name.endswith(".experts"):
        m = re.search(r"\.experts\.(\d+)\.\w+$", disk)
        return f"{rt.name}.{m[1]}.{leaf}" if m else rt.name
    prefix = rt.name.rpartition(".")[0]
    return f"{prefix}.{leaf}" if prefix else leaf
