"""Putting finished outputs in place: atomically, and with the modes of a normal file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def publish_modes(path: Path) -> None:
    """Give a finished output the modes of a normally created one (umask applied).

    Temporary folders (mkdtemp) and safetensors' files are private (0700 / 0600); an output
    moved into place as is would be unreadable to, e.g., a serving container's user.
    """
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    items = [path, *path.rglob("*")] if path.is_dir() else [path]
    for f in items:
        if not f.is_symlink():
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~mask)


def publish(src: Path, dst: Path) -> None:
    """Move a finished temporary folder or file to ``dst``, with normal modes; an older
    ``dst`` is swapped out first and removed only once the new one is in place."""
    src, dst = Path(src), Path(dst)
    publish_modes(src)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
