"""An mtpkit EAGLE-3 head written as vLLM's ``Eagle3LlamaForCausalLM`` draft model.

The folder holds the head alone (the trunk is served as it is): ``config.json`` (a one-layer
Llama config with ``draft_vocab_size``, ``target_hidden_size`` and the trunk layer ids as
``eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with vLLM's names:
``midlayer.*`` (the decoder layer, ``hidden_norm`` included), ``fc.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (int64: target id minus draft id) and ``t2d``
(bool over the target vocabulary). vLLM, SGLang and llama.cpp's converter
(``convert_hf_to_gguf.py HEAD --target-model-dir TRUNK``) read this layout; the embedding is
the trunk's (no ``embed_tokens`` is written).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def eagle3_tensors(head, vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's tensors under vLLM's names (floats as float32)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in head.state_dict().items():
        if name == "d2t":
            continue
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = p.detach().float().cpu().contiguous()
    out["d2t"] = head.d2t.detach().cpu().to(torch.int64).contiguous()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[head.target_ids().cpu()] = True
    out["t2d"] = t2d
    return out


def eagle3_config(model, dtype: str) -> dict:
    """config.json of the draft model vLLM builds as Eagle3LlamaForCausalLM."""
    cfg, head = model.config, model.mtp
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": int(head.d2t.numel()),
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = cfg.rope_scaling
    return config


def export_eagle3(model_path, head, out, dtype: str = "bfloat16") -> Path:
    """Write the EAGLE-3 head ``head`` (a folder from calibrate) of ``model_path`` at ``out``."""
    from ..engine.loader import load_model
    from ..outputs import publish

    if dtype not in DTYPES:
        raise ValueError(f"export-head: --dtype must be one of {', '.join(DTYPES)}, "
                         f"got {dtype!r}")
    dst = Path(out).resolve()
    for option, path in (("--model", model_path), ("--head", head)):
        src = Path(path).resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ValueError(f"--out {dst} overlaps the input {option} {src}; mtpkit never "
                             "writes over its input: choose another folder")
    loaded = load_model(str(model_path), head=str(head), dtype="float32", tokenizer=False)
    model = loaded.model
    if getattr(model.mtp, "head_type", None) != "eagle3":
        raise ValueError(f"export-head --format eagle3: {head} is not an EAGLE-3 head (train "
                         "one with `mtpkit calibrate --head-type eagle3`); an MTP head "
                         "exports with --format mimo")
    tensors = eagle3_tensors(model.mtp, model.config.vocab_size)
    tensors = {n: t.to(DTYPES[dtype]) if t.is_floating_point() else t
               for n, t in tensors.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, stage / "model.safetensors", metadata={"format": "pt"})
        config = eagle3_config(model, dtype)
        (stage / "config.json").write_text(json.dumps(config, indent=2))
        publish(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out
