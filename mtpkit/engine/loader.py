"""Checkpoint path -> ready model and tokenizer on a device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..checkpoint import CheckpointError, open_checkpoint
from ..models.base import CausalLM, LoadReport
from ..models.registry import family_for


@dataclass
class Loaded:
    """A model with what came with it."""

    model: CausalLM
    tokenizer: object | None
    checkpoint: object
    report: LoadReport


def resolve_device(device: str | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None (CUDA when available); a clear error when absent."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            "--device cuda was asked for but this torch build sees no CUDA device; "
            "use --device cpu"
        )
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Default fp32 on CPU (bf16 matmuls with several rows are very slow there), bf16 on GPU."""
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(table)}")
    return table[dtype]


def hf_config_of(ckpt) -> dict:
    """The (text) config dict of an opened checkpoint, whatever its format."""
    return ckpt.hf_config() if callable(getattr(ckpt, "hf_config", None)) else ckpt.config


def build_model(config: dict, device: torch.device) -> CausalLM:
    """An uninitialised model of the family the config names (weights to be loaded)."""
    cls = family_for(config.get("model_type"))
    cfg = cls.config_class.from_hf_config(config)
    # Build on the meta device: no time spent initialising weights that are overwritten.
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    return model


def load_model(
    path, device: str | None = "cpu", dtype: str | None = None, tokenizer: bool = True
) -> Loaded:
    """Open, build, load and cast a model; MTP head kept when the checkpoint has one."""
    dev = resolve_device(device)
    ckpt = open_checkpoint(path)
    model = build_model(hf_config_of(ckpt), dev)
    report = model.load_checkpoint(ckpt)
    for note in report.notes:
        warnings.warn(note, stacklevel=2)
    model.to(resolve_dtype(dtype, dev)).eval().requires_grad_(False)
    tok = None
    if tokenizer:
        from ..checkpoint.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(ckpt) if hasattr(ckpt, "arch") else Tokenizer.from_hf_dir(
            ckpt.path
        )
    return Loaded(model, tok, ckpt, report)
