"""Reading checkpoints: one entry point for every format."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError
from .hf import PICKLE_SUFFIXES, open_hf

__all__ = ["CheckpointError", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike):
    """Open an HF folder or a .gguf file; refuse pickle files; errors name the fix."""
    p = Path(path)
    if p.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{p}: a pickle checkpoint. mtpkit never unpickles weight files (they can run "
            "arbitrary code); convert it to safetensors on a trusted machine, or use the "
            "model's safetensors or GGUF release."
        )
    if p.suffix == ".gguf" or (p.is_file() and _magic(p) == b"GGUF"):
        from .gguf import open_gguf

        return open_gguf(p)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint folder or file")
    if p.is_file():
        raise CheckpointError(
            f"{p}: not a checkpoint folder or .gguf file; pass the folder that holds "
            "config.json and the .safetensors files"
        )
    return open_hf(p)


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)
