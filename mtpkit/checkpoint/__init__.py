"""Reading checkpoints: one entry point for every format."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError
from .hf import PICKLE_SUFFIXES, open_hf

__all__ = ["CheckpointError", "is_gguf", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike):
    """Open an HF folder or a .gguf file; refuse pickle files; errors name the fix."""
    p = Path(path)
    if p.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{p}: a pickle checkpoint. mtpkit never unpickles weight files (they can run "
            "arbitrary code); convert it to safetensors on a trusted machine, or use the "
            "model's safetensors or GGUF release."
        )
    if is_gguf(p):
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


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a path named .gguf or a file that starts with the GGUF magic."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    return False
