"""A GGUF file runs through the engine exactly like the HF checkpoint it was written from."""

from __future__ import annotations

import json
import warnings

import torch
from safetensors.torch import load_file
from tiny import FAMILIES

from mtpkit.checkpoint.gguf import write_gguf
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams
from mtpkit.models.llama import LlamaForCausalLM


def _nextn_names(tensors: dict, n_layers: int) -> dict:
    """mtp.* -> the DeepSeek-style names that GGUF's blk.N.nextn.* stand for."""
    inverse = {f"mtp.{v}.weight": f"model.layers.{n_layers}.{k}.weight"
               for k, v in LlamaForCausalLM._NEXTN.items()}
    out = {}
    for k, v in tensors.items():
        if k in inverse:
            out[inverse[k]] = v
        elif k.startswith("mtp.layers.0."):
            out[f"model.layers.{n_layers}." + k[len("mtp.layers.0."):]] = v
        else:
            out[k] = v
    return out


def test_gguf_with_nextn_head_matches_hf(checkpoint_factory, tmp_path):
    src = checkpoint_factory(FAMILIES[0].name)
    tensors = {**load_file(src / "model.safetensors"), **load_file(src / "model_mtp.safetensors")}
    cfg = json.loads((src / "config.json").read_text())
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, _nextn_names(tensors, cfg["num_hidden_layers"]), None, "F32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = load_model(src, tokenizer=False).model
        gg = load_model(path, tokenizer=False)
    assert gg.model.mtp is not None and not gg.report.unexpected
    runs = {}
    for name, model in (("hf", hf), ("gguf", gg.model)):
        res = Result()
        engine = Engine(model)
        ids = list(engine.generate([5, 6, 7], SamplingParams(max_tokens=24), 3, result=res,
                                   eos_ids=set()))
        runs[name] = (ids, res.metrics.accepted_per_pos)
    assert runs["hf"] == runs["gguf"]
    assert sum(runs["hf"][1]) > 0
    with torch.no_grad():
        ids = torch.arange(12)[None]
        assert torch.equal(hf.logits(hf(ids).hidden), gg.model.logits(gg.model(ids).hidden))
