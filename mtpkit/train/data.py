"""Training text: files, folders and JSONL, streamed in token chunks, split by file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go",
                 ".java", ".cpp", ".toml", ".yaml", ".yml", ".html", ".css", ".sh"}


class DataError(ValueError):
    """Training data cannot be read as given."""


@dataclass
class Split:
    """Which files train and which are held out (recorded in every output)."""

    train: list[str]
    heldout: list[str]


def list_files(paths: list[str]) -> list[Path]:
    """Every text or JSONL file under the given files and folders, in a stable order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(
                f for f in p.rglob("*")
                if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.suffix == ".jsonl")
                and f.name != "distill.json"  # distill-data's record of the folder, not text
            )
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or folder (--data takes files, folders, JSONL)")
    if not out:
        raise DataError(f"no text files found under {', '.join(paths)}")
    return out


def split_files(files: list[Path], heldout_fraction: float, seed: int) -> Split:
    """Hold out a fraction of files, chosen by a hash of their path: stable across runs."""
    def score(f: Path) -> float:
        h = hashlib.sha256(f"{seed}:{f}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    heldout = [str(f) for f in files if score(f) < heldout_fraction]
    if not heldout and heldout_fraction > 0 and len(files) > 1:
        heldout = [str(min(files, key=score))]
    train = [str(f) for f in files if str(f) not in set(heldout)]
    return Split(train, heldout)


def iter_texts(files: list[str], text_field: str = "text") -> Iterator[str]:
    """The texts of files one at a time (a JSONL file yields one text per line)."""
    for f in files:
        p = Path(f)
        if p.suffix == ".jsonl":
            with open(p, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{p}:{n}: not valid JSON ({e})") from e
                    if text_field not in rec:
                        raise DataError(f"{p}:{n}: no {text_field!r} field")
                    yield str(rec[text_field])
        else:
            yield p.read_text(encoding="utf-8", errors="replace")


def iter_chunks(tokenizer, files: list[str], seq_len: int) -> Iterator[list[int]]:
    """Token chunks of ``seq_len`` packed across file boundaries.

    Files are read one at a time, so memory stays bounded whatever the corpus size.
    """
    buf: list[int] = []
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    for text in iter_texts(files):
        buf += tokenizer.encode(text, add_special_tokens=False)
        if eos is not None:
            buf.append(eos)
        while len(buf) >= seq_len:
            chunk, buf = buf[:seq_len], buf[seq_len:]
            yield chunk
