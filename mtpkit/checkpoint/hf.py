"""Hugging Face checkpoint folders: config.json, safetensors shards, index, extra MTP files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files some releases ship the MTP head in, beside the trunk shards.
MTP_FILES = ("model_mtp.safetensors", "mtp.safetensors")


def text_config(config: dict) -> dict:
    """The language model's config: ``text_config`` merged over the top level (VLM layouts)."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return dict(config)
    merged = {k: v for k, v in config.items() if k != "text_config" and k != "vision_config"}
    merged.update(inner)
    # The top-level model_type names the checkpoint (qwen3_5); keep it for the registry
    # unless the text config names its own family.
    merged.setdefault("model_type", config.get("model_type"))
    if config.get("model_type") == "kimi_k25" and merged["model_type"] == "deepseek_v3":
        # transformers writes Kimi-K2.5's kimi_k2 text model as deepseek_v3; the name
        # the release uses picks the family that knows the wrapper's tensor prefixes.
        merged["model_type"] = "kimi_k2"
    return merged


@dataclass
class HFCheckpoint:
    """A checkpoint folder opened lazily: tensors are read (memory-mapped) when asked for."""

    path: Path
    raw_config: dict
    config: dict
    files: list[Path]  # every safetensors file read
    indexed_files: list[str] = field(default_factory=list)  # listed in the index
    unindexed_mtp_files: list[str] = field(default_factory=list)  # present, not in the index
    _where: dict[str, Path] = field(default_factory=dict)  # tensor name -> file
    _handles: dict[Path, object] = field(default_factory=dict)

    def tensor_names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._where)

    def file_of(self, name: str) -> Path:
        """The file a tensor lives in."""
        return self._where[name]

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a KeyError names the checkpoint when it is absent)."""
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: no tensor named {name}")
        try:
            return self._handle(f).get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad data
            raise CheckpointError(
                f"{f}: tensor {name} cannot be read ({e}). The file is truncated or corrupt: "
                "download it again and compare its size/checksum with the original."
            ) from e

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without reading its data."""
        return tuple(self._handle(self._where[name]).get_slice(name).get_shape())

    def tensor_dtype(self, name: str) -> str:
        """Stored dtype name of a tensor (e.g. 'BF16', 'F8_E4M3', 'I32')."""
        return self._handle(self._where[name]).get_slice(name).get_dtype()


def _open_safetensors(f: Path) -> list[str]:
    if not f.exists():
        raise CheckpointError(
            f"{f}: file is missing. model.safetensors.index.json lists it; download the "
            "missing shard or fix the index."
        )
    try:
        with safe_open(str(f), framework="pt") as h:
            names = list(h.keys())
    except Exception as e:
        raise CheckpointError(
            f"{f}: not a readable safetensors file ({e}). It is truncated or corrupt: "
            "download it again."
        ) from e
    # safetensors checks the header only: compare the declared data size with the file size
    # so that a cut-off download is caught at open, not as garbage later.
    with open(f, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if os.path.getsize(f) < 8 + header_len + end:
        raise CheckpointError(
            f"{f}: truncated: the header declares {8 + header_len + end} bytes but the file "
            f"has {os.path.getsize(f)}. Download it again."
        )
    return names


def open_hf(path: str | os.PathLike) -> HFCheckpoint:
    """Open a checkpoint folder; raise CheckpointError naming the file and the fix."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder or file")
    if not cfg_path.exists():
        raise CheckpointError(
            f"{cfg_path}: missing. A Hugging Face checkpoint folder needs its config.json "
            "(copy it from the original model)."
        )
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); fix or re-download it") from e
    st_files = sorted(root.glob("*.safetensors"))
    if not st_files:
        pickles = [p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise CheckpointError(
                f"{root}: only pickle weights ({', '.join(pickles)}). mtpkit never unpickles "
                "checkpoint files (they can run arbitrary code). Convert them to safetensors "
                "on a trusted machine (e.g. transformers' save_pretrained(safe_serialization="
                "True)) or use the model's safetensors release."
            )
        raise CheckpointError(f"{root}: no .safetensors weight files found")
    ckpt = HFCheckpoint(root, raw, text_config(raw), [])
    index_path = root / "model.safetensors.index.json"
    files: list[Path]
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e}); re-download it") from e
        ckpt.indexed_files = sorted(set(weight_map.values()))
        files = [root / f for f in ckpt.indexed_files]
        # Extra MTP files that the index does not list: vLLM ignores them; we read them and
        # record the fact so that `doctor` can report it.
        for f in st_files:
            if f.name not in ckpt.indexed_files and f.name in MTP_FILES:
                ckpt.unindexed_mtp_files.append(f.name)
                files.append(f)
    else:
        files = st_files
    for f in files:
        for name in _open_safetensors(f):
            ckpt._where.setdefault(name, f)
    ckpt.files = files
    return ckpt
