"""What a checkpoint holds, read lazily (safetensors headers, GGUF metadata): MTP tensors and
layers per family layout, the config fields that enable them, and how each module is stored."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.errors import CheckpointError

# Families whose releases carry a native MTP head (GLM-4.7-Flash and GLM-5 ship one layer).
NATIVE_MTP = {
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
    "deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "mimo", "mimo_v2_flash",
    "deepseek_v4", "step3p5", "step3p7",
}
QWEN35 = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
QWEN_MTP = QWEN35 | {"qwen3_next"}  # heads stored as mtp.*
# Heads stored as model.layers.{L + i}.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens,
# the block} (Kimi-K2.5: below its wrapper's language_model.model. prefix).
DEEPSEEK_STYLE = {"deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "kimi_k2",
                  "kimi_k25"}
# Step-3.5 / 3.7: model.layers.{L + i}.{enorm, hnorm, eh_proj, transformer.shared_head.*,
# the block}, every layer with its own copy of the lm_head (shared_head.output).
STEP_STYLE = {"step3p5", "step3p7"}
# MiMo-V2-Flash: model.mtp.layers.{i}.{enorm, hnorm, eh_proj, final_layernorm, the block}.
MIMO_V2_STYLE = {"mimo_v2_flash"}
# GGUF architectures whose releases carry nextn layers.
GGUF_NATIVE_MTP = {"qwen3next", "qwen35", "qwen35moe", "deepseek2", "glm4moe", "glm-dsa",
                   "step35", "mimo2", "mimo"}

# Suffixes a quantized module stores, per format: (required, optional).
QUANT_FORMATS = {
    "pack-quantized": (("weight_packed", "weight_scale", "weight_shape"),
                       ("weight_zero_point", "weight_g_idx")),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "fp8-block-inv": (("weight", "weight_scale_inv"), ()),
    "scaled": (("weight", "weight_scale"), ("weight_zero_point", "input_scale")),
}
_QUANT_MARKERS = {"weight_packed": "pack-quantized", "qweight": "gptq",
                  "weight_scale_inv": "fp8-block-inv", "weight_scale": "scaled"}
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def mtp_config_key(model_type: str | None, raw: dict) -> str:
    """Dotted path of the config field that enables the MTP head for this family."""
    nested = isinstance(raw.get("text_config"), dict)
    if model_type in QWEN35:
        return "text_config.mtp_num_hidden_layers" if nested else "mtp_num_hidden_layers"
    if nested and "num_nextn_predict_layers" in raw["text_config"]:
        return "text_config.num_nextn_predict_layers"
    return "num_nextn_predict_layers"


def get_key(raw: dict, dotted: str):
    """A config value by dotted path (None when absent)."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_key(raw: dict, dotted: str, value) -> None:
    """Set a config value by dotted path."""
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


# A text layer's prefix: model.layers.N, Qwen3.5 VLM's model.language_model.layers.N, and
# Kimi-K2.5's language_model.model.layers.N (NVFP4 exports: language_model.layers.N).
_TEXT_LAYER = r"(?:model\.(?:language_model\.)?|language_model\.(?:model\.)?)layers\.(\d+)\."


def is_mtp_tensor(name: str, n_layer: int | None) -> bool:
    """Whether an on-disk tensor belongs to an MTP head (any family's layout)."""
    # mtp.* (Qwen), model.mtp_layers.{i}.* (MiMo), model.mtp.layers.{i}.* (MiMo-V2-Flash)
    if name.startswith(("mtp.", "model.mtp_layers.", "model.mtp.")):
        return True
    m = re.match(_TEXT_LAYER, name)
    return bool(m and n_layer is not None and int(m[1]) >= n_layer)


def mtp_layer_count(names: list[str], n_layer: int | None) -> int:
    """MTP decoder layers among the tensor names (a head with only its combine: 1)."""
    layers: set[int] = set()
    any_mtp = False
    for n in names:
        if not is_mtp_tensor(n, n_layer):
            continue
        any_mtp = True
        # ... and DeepSeek-V4's mtp.{i}.* (model.mtp.{i}.* as transformers saves it)
        if m := re.match(r"(?:mtp\.layers|model\.mtp_layers|(?:model\.)?mtp(?:\.layers)?)"
                         r"\.(\d+)\.", n):
            layers.add(int(m[1]))
        elif (m := re.match(_TEXT_LAYER, n)) and n_layer:
            layers.add(int(m[1]) - n_layer)
    if not any_mtp:
        return 0
    return max(layers) + 1 if layers else 1


@dataclass
class Module:
    """One on-disk module (a name prefix with its parameter tensors)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)  # suffix -> full tensor name
    fmt: str = "float"  # float | pack-quantized | gptq | awq | fp8-block-inv | scaled
    missing: list[str] = field(default_factory=list)  # required quantized suffixes absent
    bits: int | None = None
    linear: bool = False  # a 2-D weight or quantized tensors: a projection
    # Routed experts stored stacked (3-D ``gate_up_proj`` / ``down_proj`` parameters of
    # ``...mlp.experts``): one module holding every expert's projections.
    stacked_experts: bool = False


@dataclass
class HFLayout:
    """An HF checkpoint folder seen through its headers."""

    path: Path
    raw: dict
    config: dict  # text config merged over the top level
    model_type: str | None  # top level (the VLM wrapper's) model_type
    text_model_type: str | None  # the language model's
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    file_of: dict[str, str]  # tensor -> file name
    index: dict | None  # model.safetensors.index.json's weight_map, when there is one
    files: list[str]  # every *.safetensors file in the folder
    read_by_mtpkit: set[str]  # files mtpkit's loader reads
    modules: dict[str, Module] = field(default_factory=dict)

    @property
    def n_layer(self) -> int | None:
        """num_hidden_layers of the language model."""
        n = self.config.get("num_hidden_layers")
        return int(n) if n is not None else None

    @property
    def quant_config(self) -> dict:
        """quantization_config (top level or under text_config; empty when absent)."""
        q = self.raw.get("quantization_config")
        if q is None and isinstance(self.raw.get("text_config"), dict):
            q = self.raw["text_config"].get("quantization_config")
        return q or {}

    def names(self) -> list[str]:
        """Every tensor name in every safetensors file."""
        return list(self.shapes)

    def mtp_names(self) -> list[str]:
        """Tensor names of the MTP head."""
        return [n for n in self.shapes if is_mtp_tensor(n, self.n_layer)]


def read_hf(path: Path) -> HFLayout:
    """Open an HF folder through its headers only (CheckpointError names problems)."""
    from safetensors import safe_open

    from ..checkpoint.hf import open_hf

    ckpt = open_hf(path)  # validates config.json, the index and every listed shard
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else None
    files = sorted(p.name for p in path.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    file_of: dict[str, str] = {}
    for fname in files:
        try:
            with safe_open(str(path / fname), framework="pt") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    if name not in shapes:
                        shapes[name] = tuple(sl.get_shape())
                        dtypes[name] = sl.get_dtype()
                        file_of[name] = fname
        except Exception as e:  # safetensors raises its own types on bad files
            raise CheckpointError(
                f"{path / fname}: not a readable safetensors file ({e}); re-download it"
            ) from e
    text_mt = ckpt.config.get("model_type")
    layout = HFLayout(
        path=path, raw=ckpt.raw_config, config=ckpt.config,
        model_type=ckpt.raw_config.get("model_type") or text_mt, text_model_type=text_mt,
        shapes=shapes, dtypes=dtypes, file_of=file_of, index=index, files=files,
        read_by_mtpkit={f.name for f in ckpt.files},
    )
    layout.modules = _modules(layout)
    return layout


def _modules(layout: HFLayout) -> dict[str, Module]:
    """Group tensors into modules and classify how each is stored."""
    method = str(layout.quant_config.get("quant_method", "")).lower()
    out: dict[str, Module] = {}
    for name in layout.shapes:
        head, _, last = name.rpartition(".")
        if not head:
            continue
        out.setdefault(head, Module(head)).params[last] = name
    for mod in out.values():
        p = mod.params
        fmt = "float"
        for marker, f in _QUANT_MARKERS.items():
            if marker in p:
                fmt = f
                break
        if fmt == "float" and method in ("fp8", "deepseek_v4_fp8") and "weight" in p \
                and "scale" in p:
            # DeepSeek-V4's release names a module's block scale "scale" (weight_scale_inv).
            fmt = "fp8-block-inv"
            p["weight_scale_inv"] = p["scale"]
        if fmt == "scaled" and "weight" in p and layout.dtypes[p["weight"]] in _FLOAT_DTYPES:
            # a float weight with a scale is not a quantized format we know: treat as float
            fmt = "float"
        if fmt == "gptq" and method == "awq":
            fmt = "awq"
        if "scales" in p and "qweight" not in p:
            fmt = "gptq" if method != "awq" else "awq"
        mod.fmt = fmt
        if fmt != "float":
            required, _ = QUANT_FORMATS[fmt]
            mod.missing = [s for s in required if s not in p]
            mod.linear = True
            mod.bits = _bits(layout, mod)
        else:
            w = p.get("weight")
            mod.linear = w is not None and len(layout.shapes[w]) == 2
            stacked = [p[k] for k in ("gate_up_proj", "down_proj") if k in p]
            if mod.name.endswith(".mlp.experts") and stacked and all(
                    len(layout.shapes[t]) == 3 for t in stacked):
                mod.linear = mod.stacked_experts = True
    return out


def _bits(layout: HFLayout, mod: Module) -> int | None:
    """Bits per weight of a quantized module (None when unknown)."""
    p, q = mod.params, layout.quant_config
    if mod.fmt == "pack-quantized" and "weight_packed" in p:
        from ..quant.formats import _covering_group

        # The group that quantizes this module (a w8a16 head under a w4a16 trunk is int8),
        # else the first that says.
        found = _covering_group(mod.name, q)
        groups = ([found[1]] if found else []) + list((q.get("config_groups") or {}).values())
        for group in groups:
            bits = (group.get("weights") or {}).get("num_bits")
            if bits:
                return int(bits)
        return None
    if mod.fmt in ("gptq", "awq"):
        return int(q.get("bits", q.get("w_bit", 4)))
    return 8


def module_of_param(name: str) -> str:
    """``a.b.weight`` -> ``a.b``."""
    return name.rpartition(".")[0]


def logical_shape(layout: HFLayout, mod: Module) -> tuple[int, ...] | None:
    """The [out, in] shape a quantized module stands for (reads weight_shape, 2 numbers)."""
    p = mod.params
    if mod.fmt == "float" or "weight" in p and mod.fmt in ("fp8-block-inv", "scaled"):
        w = p.get("weight")
        if w and mod.fmt == "fp8-block-inv" and layout.dtypes[w] in ("I8", "U8", "F4"):
            n, half = layout.shapes[w]  # FP4: two e2m1 codes a byte
            return (n, 2 * half)
        return layout.shapes[w] if w else None
    if mod.fmt == "pack-quantized" and "weight_shape" in p:
        from safetensors import safe_open

        f = layout.path / layout.file_of[p["weight_shape"]]
        with safe_open(str(f), framework="pt") as h:
            return tuple(int(v) for v in h.get_tensor(p["weight_shape"]).tolist())
    if mod.fmt in ("gptq", "awq") and "qweight" in p and mod.bits:
        k, n = layout.shapes[p["qweight"]]
        per = 32 // mod.bits
        return (n, k * per) if mod.fmt == "gptq" else (n * per, k)
    return None
