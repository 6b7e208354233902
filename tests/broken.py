"""Broken checkpoints for the doctor tests: each reproduces one reported failure by copying a
tiny healthy checkpoint (tests/tiny.py, with a distilled MTP head) and breaking one thing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtpkit.doctor.layout import get_key, is_mtp_tensor, mtp_config_key

GROUP = 32  # W4A16 group size (the tiny models' widths are multiples of it)


# -- helpers ---------------------------------------------------------------------------------


def write_bytelevel_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer without merges: one token per printable ASCII character
    (the same ids as tiny.write_char_tokenizer) that can also be written into GGUF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # byte -> printable stand-in, e.g. " " -> "Ġ"
    mapping = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(mapping.values()) == set(alphabet)
    vocab = {mapping[b]: b - 32 for b in range(32, 127)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "add_bos_token": False}))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> unicode stand-in table (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def copy(src: Path, out: Path) -> Path:
    """A fresh copy of a checkpoint folder."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    return out


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def config(folder: Path) -> dict:
    """config.json of a folder."""
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, cfg: dict) -> None:
    """Write config.json."""
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def n_layers(cfg: dict) -> int:
    """num_hidden_layers of the language model."""
    return int(get_key(cfg, "text_config.num_hidden_layers") or cfg["num_hidden_layers"])


def _model_type(cfg: dict) -> str:
    return (cfg.get("text_config") or {}).get("model_type") or cfg["model_type"]


# -- the reported failures -------------------------------------------------------------------


def drop_mtp(src: Path, out: Path) -> Path:
    """An export through save_pretrained: the MTP tensors are gone, the config still says 1."""
    copy(src, out)
    n = n_layers(config(out))
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keep = {k: h.get_tensor(k) for k in h.keys() if not is_mtp_tensor(k, n)}
        f.unlink()
        if keep:
            save_file(keep, str(f), metadata={"format": "pt"})
    return out


def unindex_mtp(src: Path, out: Path) -> Path:
    """model_mtp.safetensors present, but the index lists only the trunk's file."""
    copy(src, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as h:
        names = list(h.keys())
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def drop_config_field(src: Path, out: Path) -> Path:
    """MTP tensors present but the config field that enables them removed (top level or
    under text_config, wherever the family keeps it)."""
    copy(src, out)
    cfg = config(out)
    key = mtp_config_key(_model_type(cfg), cfg)
    node = cfg
    parts = key.split(".")
    for p in parts[:-1]:
        node = node[p]
    del node[parts[-1]]
    write_config(out, cfg)
    return out


def random_head(src: Path, out: Path, seed: int = 123) -> Path:
    """Head tensors replaced by random values of the same shapes (static checks pass)."""
    copy(src, out)
    n = n_layers(config(out))
    g = torch.Generator().manual_seed(seed)
    for f in out.glob("*.safetensors"):
        tensors = read_all_file(f)
        changed = False
        for k, v in tensors.items():
            if is_mtp_tensor(k, n) and v.is_floating_point():
                tensors[k] = (torch.randn(v.shape, generator=g) * float(v.float().std() + 1e-3)
                              ).to(v.dtype)
                changed = True
        if changed:
            save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def edit_tensors(src: Path, out: Path, fn) -> Path:
    """A copy whose tensors pass through ``fn(dict) -> dict`` file by file."""
    copy(src, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = read_all_file(f)
        new = fn(dict(tensors))
        if new.keys() != tensors.keys() or any(new[k] is not tensors[k] for k in new):
            save_file({k: v.contiguous() for k, v in new.items()}, str(f),
                      metadata={"format": "pt"})
    return out


def edit_config(src: Path, out: Path, fn) -> Path:
    """A copy whose config.json passes through ``fn(dict)`` (edited in place)."""
    copy(src, out)
    cfg = config(out)
    fn(cfg)
    write_config(out, cfg)
    return out


def read_all_file(f: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file."""
    with safe_open(str(f), framework="pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


# -- W4A16 (compressed-tensors pack-quantized) -----------------------------------------------


def _w4_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=GROUP)


def pack_w4a16(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [N, K] -> pack-quantized tensors, through compressed-tensors' own functions."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _w4_args()
    w = weight.detach().float()
    n, k = w.shape
    wg = w.view(n, k // GROUP, GROUP)
    scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    scale = scale.reshape(n, k // GROUP).to(torch.bfloat16).float()
    zero = zero.reshape(n, k // GROUP)
    q = quantize(w, scale, zero, args, dtype=torch.int8)
    return {
        "weight_packed": pack_to_int32(q, 4),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }


def _fits(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[0] % 16 == 0 and t.shape[1] % GROUP == 0


def _quantizable(name: str) -> bool:
    skip = ("embed_tokens", "lm_head", "visual", "norm", "shared_head.head", "eh_proj",
            "mlp.gate.weight", "shared_expert_gate")
    return name.endswith(".weight") and not any(s in name for s in skip)


def w4a16(src: Path, out: Path, mtp: str = "bf16-unlisted", ignore_style: str = "exact",
          head_as_stored: bool = False) -> Path:
    """A W4A16 (group 32) release of ``src``: trunk linears quantized with compressed-tensors'
    packing; the MTP head stored BF16 (``mtp='bf16-unlisted'``: not in the ignore list, what
    llm-compressor writes; ``'bf16-listed'``: listed as ``ignore_style`` says) or quantized to
    4 bits (``mtp='int4'``).

    ignore_style for a listed head: ``exact`` (mtpkit's ignore_list_for, healthy),
    ``ondisk`` (every on-disk module name), ``partial`` (one shard of each fused module),
    ``regex`` (a pattern that matches nothing).

    ``head_as_stored``: an unquantized head keeps ``src``'s dtype instead of BF16, as
    ``graft --mtp-precision keep`` writes it from a float32 source."""
    from mtpkit.checkpoint.runtime_names import ignore_list_for

    copy(src, out)
    cfg = config(out)
    n = n_layers(cfg)
    mt = cfg["model_type"]
    tensors = read_all(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    index = out / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    trunk, head = {}, {}
    ignore = {"lm_head", "re:.*visual.*"}
    bf16_mtp = []
    for k, v in tensors.items():
        is_mtp = is_mtp_tensor(k, n)
        dest = head if is_mtp else trunk
        quantize = _quantizable(k) and (not is_mtp or mtp == "int4")
        # in_proj_b / in_proj_a (4 rows) cannot be stored: llm-compressor leaves them BF16
        if quantize and _fits(v):
            mod = k[: -len(".weight")]
            for suffix, t in pack_w4a16(v).items():
                dest[f"{mod}.{suffix}"] = t
            continue
        if v.is_floating_point() and not (is_mtp and head_as_stored):
            v = v.to(torch.bfloat16)
        dest[k] = v
        if k.endswith(".weight") and v.dim() == 2 and _quantizable(k):
            if is_mtp:
                bf16_mtp.append(k[: -len(".weight")])
            else:
                ignore.add(k[: -len(".weight")])
    if mtp == "bf16-listed":
        if ignore_style == "exact":
            ignore.update(ignore_list_for(bf16_mtp, mt, "vllm", config=cfg))
            ignore.update(ignore_list_for(bf16_mtp, mt, "sglang", config=cfg))
        elif ignore_style == "ondisk":
            ignore.update(bf16_mtp)
        elif ignore_style == "partial":
            # every MTP module, but of each fused group only its first shard
            ignore.update(m for m in bf16_mtp if not m.endswith(("k_proj", "v_proj",
                                                                  "up_proj")))
        elif ignore_style == "regex":
            # people expect the head under model.mtp; re.match finds nothing there
            ignore.add(r"re:model\.mtp\..*")
        else:
            raise ValueError(ignore_style)
    save_file(trunk, str(out / "model.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model.safetensors" for k in trunk}
    if head:
        save_file(head, str(out / "model_mtp.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: "model_mtp.safetensors" for k in head})
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "dynamic": False, "actorder": None},
            "input_activations": None, "output_activations": None}},
        "ignore": sorted(ignore),
    }
    write_config(out, cfg)
    return out


def fake_gptq(src: Path, out: Path, method: str = "gptq") -> Path:
    """A GPTQ or AWQ release whose trunk linears are packed 4-bit tensors (zero codes: for
    static checks only) and whose MTP head stays BF16, as AutoGPTQ / AutoAWQ exports leave it
    when the head is grafted back without telling the config."""
    copy(src, out)
    cfg = config(out)
    n = n_layers(cfg)
    tensors = read_all(out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    new = {}
    for k, v in tensors.items():
        if _quantizable(k) and _fits(v) and not is_mtp_tensor(k, n):
            mod = k[: -len(".weight")]
            o, i = v.shape
            if method == "gptq":
                new[f"{mod}.qweight"] = torch.zeros(i // 8, o, dtype=torch.int32)
                new[f"{mod}.g_idx"] = torch.arange(i, dtype=torch.int32) // GROUP
            else:
                new[f"{mod}.qweight"] = torch.zeros(i, o // 8, dtype=torch.int32)
            new[f"{mod}.qzeros"] = torch.zeros(i // GROUP, o // 8, dtype=torch.int32)
            new[f"{mod}.scales"] = torch.ones(i // GROUP, o, dtype=torch.float16)
        else:
            new[k] = v
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    q = {"quant_method": method, "bits": 4, "group_size": GROUP}
    q.update({"desc_act": False, "sym": True} if method == "gptq" else
             {"zero_point": True, "modules_to_not_convert": ["visual"]})
    cfg["quantization_config"] = q
    write_config(out, cfg)
    return out


# -- GGUF -----------------------------------------------------------------------------------


def to_gguf(src: Path, out: Path, mtp: bool = True, qtype: str = "F32") -> Path:
    """The HF checkpoint as a llama.cpp GGUF file (Qwen3.5 VLM: the language model only)."""
    from mtpkit.checkpoint.gguf import write_gguf
    from mtpkit.checkpoint.hf import text_config
    from mtpkit.checkpoint.tokenizer import Tokenizer

    cfg = config(src)
    text = text_config(cfg)
    n = int(text["num_hidden_layers"])
    arch = {"qwen3_5_text": "qwen35", "qwen3_5": "qwen35", "llama": "llama"}[text["model_type"]]
    tensors = {}
    for k, v in read_all(src).items():
        if k.startswith("model.visual."):
            continue
        k = k.replace("model.language_model.", "model.")
        if not mtp and is_mtp_tensor(k, n):
            continue
        tensors[k] = v
    if not mtp:
        text = {k: v for k, v in text.items() if k not in ("mtp_num_hidden_layers",
                                                           "num_nextn_predict_layers")}
    write_gguf(out, arch, text, tensors, Tokenizer.from_hf_dir(src), qtype)
    return out


def gguf_edit(src: Path, out: Path, set_keys: dict | None = None, remove=()) -> Path:
    """A copy of a GGUF file with metadata values changed or removed (tensors as stored)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    set_keys = set_keys or {}
    reader = GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(out, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in remove:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, set_keys.get(name, f.contents()), vtype, sub_type=sub)
    for name, value in set_keys.items():
        if name not in reader.fields:
            w.add_key_value(name, value, GGUFValueType.UINT32)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def stack_experts(src: Path, out: Path) -> Path:
    """A copy of ``src`` whose routed experts (trunk and MTP) are stored stacked, as
    transformers 5 saves MoE models: ``...mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
    first) and ``...mlp.experts.down_proj`` [E, H, I]."""
    import re as _re

    def fn(tensors: dict) -> dict:
        groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        out_t = {}
        for k, v in tensors.items():
            m = _re.match(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
            if m:
                groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
            else:
                out_t[k] = v
        for base, experts in groups.items():
            order = sorted(experts)
            out_t[f"{base}.gate_up_proj"] = torch.stack(
                [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in order])
            out_t[f"{base}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
        return out_t

    return edit_tensors(src, out, fn)
