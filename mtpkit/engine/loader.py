"""Checkpoint path -> ready model and tokenizer on a device."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

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
    draft_vocab: object = None  # token ids a separately trained head drafts from


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
    path,
    device: str | None = "cpu",
    dtype: str | None = None,
    tokenizer: bool = True,
    head=None,
    new_head_layers: int = 0,
) -> Loaded:
    """Open, build, load and cast a model; ``head`` lays a separately trained head over it.

    ``new_head_layers`` builds an uninitialised head of that many layers for training.
    """
    dev = resolve_device(device)
    ckpt = open_checkpoint(path)
    if head is not None:
        from ..train.heads import WithHead

        ckpt = WithHead(ckpt, head)
    config = dict(hf_config_of(ckpt))
    if new_head_layers:
        config["num_nextn_predict_layers"] = config["mtp_num_hidden_layers"] = new_head_layers
    model = build_model(config, dev)
    report = model.load_checkpoint(ckpt, keep_missing_head=bool(new_head_layers))
    for note in report.notes:
        warnings.warn(note, stacklevel=2)
    model.to(resolve_dtype(dtype, dev)).eval().requires_grad_(False)
    tok = None
    if tokenizer:
        from ..checkpoint.tokenizer import Tokenizer

        base = getattr(ckpt, "trunk", ckpt)
        tok = Tokenizer.from_gguf(base) if hasattr(base, "arch") else Tokenizer.from_hf_dir(
            base.path
        )
    vocab = getattr(ckpt, "draft_vocab", None)
    if vocab is None and head is None:
        # A head merged into a checkpoint (mtpkit quantize --head) keeps its vocabulary here.
        from ..train.heads import DRAFT_VOCAB

        f = Path(ckpt.path) / DRAFT_VOCAB if getattr(ckpt, "path", None) else None
        if f is not None and f.is_file() and model.mtp is not None:
            vocab = json.loads(f.read_text())["token_ids"]
    vocab = torch.tensor(vocab, device=dev) if vocab else None
    return Loaded(model, tok, ckpt, report, vocab)
