"""MTP head files: a head trained apart from its trunk, saved and loaded under ``mtp.*`` names.

A head folder holds ``mtp_head.safetensors`` (tensors named as in Qwen3.5 checkpoints) and
``head_config.json``. ``--head DIR`` lays it over any trunk checkpoint of the same shape, so
that "trunk + head" loads as one MTP model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..checkpoint.errors import CheckpointError
from ..checkpoint.hf import PICKLE_SUFFIXES
from ..outputs import publish

HEAD_FILE = "mtp_head.safetensors"
HEAD_CONFIG = "head_config.json"
DRAFT_VOCAB = "draft_vocab.json"  # token ids the head drafts from, most frequent first
# head_config.json "version": 1, an MTP head (mtp.* names as Qwen3.5's); 2 adds "head_type"
# ("mtp" or "eagle3", models/eagle3.py). A later format is refused, not loaded as garbage.
HEAD_FORMAT_VERSION = 2
HEAD_TYPES = ("mtp", "eagle3")


class WithHead:
    """A trunk checkpoint with a separately stored head laid over it (replacing any own head)."""

    def __init__(self, trunk, head_dir: str | os.PathLike) -> None:
        self.trunk = trunk
        self.head_dir = Path(head_dir)
        f = self.head_dir / HEAD_FILE if self.head_dir.is_dir() else self.head_dir
        if not f.exists() and (self.head_dir / "config.json").exists():
            # `mtpkit calibrate --init head` on a checkpoint with a head of its own writes the
            # whole checkpoint again, the recalibrated head inside it, not a head folder.
            raise CheckpointError(
                f"{self.head_dir} is a whole checkpoint, not a head folder (`mtpkit calibrate "
                "--init head` on a checkpoint with its own head writes one, the new head "
                f"inside): pass it as --model {self.head_dir}, without --head")
        if not f.exists():
            raise CheckpointError(
                f"{f}: no MTP head file; --head takes a folder written by `mtpkit calibrate` "
                f"(with {HEAD_FILE}) or such a .safetensors file"
            )
        if f.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{f}: a pickle file. mtpkit never unpickles weight files "
                                  "(they can run arbitrary code); --head takes a folder written "
                                  f"by `mtpkit calibrate` (with {HEAD_FILE}) or such a "
                                  ".safetensors file")
        self.head_file = f
        try:
            self._h = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a safetensors file ({e}); --head takes a folder "
                                  f"written by `mtpkit calibrate` (with {HEAD_FILE}) or such "
                                  "a .safetensors file") from None
        cfg_path = f.parent / HEAD_CONFIG
        self.head_config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        check_head_format(self.head_config, cfg_path)
        self._names = list(self._h.keys())
        n_layers = 1 + max(
            (int(k.split(".")[2]) for k in self._names if k.startswith("mtp.layers.")), default=0
        )
        self.n_layers = self.head_config.get("num_nextn_predict_layers", n_layers)
        self.path = getattr(trunk, "path", None)
        dv = f.parent / DRAFT_VOCAB
        self.draft_vocab = json.loads(dv.read_text())["token_ids"] if dv.exists() else None

    def hf_config(self) -> dict:
        """The trunk's config with the head declared (under both families' key names)."""
        from ..engine.loader import hf_config_of

        cfg = dict(hf_config_of(self.trunk))
        cfg["num_nextn_predict_layers"] = self.n_layers
        cfg["mtp_num_hidden_layers"] = self.n_layers
        if self.head_config.get("head_type") == "eagle3":
            hc = self.head_config
            cfg["mtpkit_eagle3"] = {"aux_layers": hc["eagle_aux_hidden_state_layer_ids"],
                                    "draft_vocab_size": hc["draft_vocab_size"]}
        return cfg

    def tensor_names(self) -> list[str]:
        """Trunk tensors (its own head dropped) followed by the head's."""
        own = [n for n in self.trunk.tensor_names() if not n.startswith("mtp.")]
        return own + self._names

    def get_tensor(self, name: str) -> torch.Tensor:
        """From the head file for mtp.* names, else from the trunk."""
        if name in self._names:
            return self._h.get_tensor(name)
        return self.trunk.get_tensor(name)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the tensor."""
        if name in self._names:
            return tuple(self._h.get_slice(name).get_shape())
        return tuple(self.trunk.tensor_shape(name))

    def __getattr__(self, name):
        return getattr(self.trunk, name)


def save_head(
    head: torch.nn.Module, out: Path, config: dict, draft_vocab: list[int] | None = None
) -> None:
    """Write a head folder atomically (temp folder beside it, then rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # Integer tensors (an EAGLE-3 head's d2t) stay integers.
        tensors = {f"mtp.{k}": (v.detach().float() if v.is_floating_point() else v.detach())
                   .contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(tensors, tmp / HEAD_FILE, metadata={"format": "pt"})
        (tmp / HEAD_CONFIG).write_text(json.dumps(config, indent=2))
        if draft_vocab:
            write_draft_vocab(tmp, draft_vocab)
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_head_format(config: dict, path) -> None:
    """Refuse a head_config.json of a format or head type this mtpkit does not know."""
    version = config.get("version", 1)
    head_type = config.get("head_type", "mtp")
    if (config.get("format", "mtpkit-head") != "mtpkit-head" or not isinstance(version, int)
            or version > HEAD_FORMAT_VERSION or head_type not in HEAD_TYPES):
        raise CheckpointError(
            f"{path}: a head of format {config.get('format')!r} version {version!r}, type "
            f"{head_type!r}; this mtpkit reads mtpkit-head up to version "
            f"{HEAD_FORMAT_VERSION} ({', '.join(HEAD_TYPES)} heads): upgrade mtpkit "
            "(pip install -U mtpkit) to load it")


def write_draft_vocab(head_dir: Path, token_ids: list[int]) -> None:
    """Record the draft vocabulary (most frequent first) in a head folder."""
    tmp = Path(head_dir) / f".{DRAFT_VOCAB}.tmp"
    tmp.write_text(json.dumps({"token_ids": [int(t) for t in token_ids]}))
    os.replace(tmp, Path(head_dir) / DRAFT_VOCAB)


def top_tokens(counts: torch.Tensor, n: int) -> list[int]:
    """The ``n`` most frequent token ids (those seen at all), most frequent first."""
    order = torch.argsort(counts, descending=True, stable=True)[:n]
    return [int(t) for t in order if counts[t] > 0]
