"""Shared fixtures: tiny checkpoints per family, built once per test session."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# Tiny models gain nothing from threads, and two threads contending with another process on
# a 2-core machine make every small op ~100x slower.
torch.set_num_threads(1)

_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """family name -> path of a tiny checkpoint with a distilled MTP head (cached)."""

    def get(name: str) -> Path:
        if name not in _BUILT:
            out = tmp_path_factory.mktemp(name)
            if name == "deepseek_v4":  # built with its MTP layers trained (tiny.py)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tiny.write_deepseek_v4(out)
            else:
                fam = next(f for f in tiny.FAMILIES + tiny.MORE_FAMILIES if f.name == name)
                tiny.write_checkpoint(fam, out)
                tiny.add_mtp_head(out, fam, layers=fam.mtp_layers)
            _BUILT[name] = out
        return _BUILT[name]

    return get


@pytest.fixture(scope="session")
def engine_factory(checkpoint_factory):
    """family name -> (Engine, transformers-free) loaded once."""
    from mtpkit.engine.generate import Engine
    from mtpkit.engine.loader import load_model

    engines = {}

    def get(name: str):
        if name not in engines:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = load_model(checkpoint_factory(name), tokenizer=False)
            engines[name] = Engine(loaded.model)
        return engines[name]

    return get


@pytest.fixture(scope="session")
def model_dir(checkpoint_factory, tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with its MTP head and a character tokenizer (read-only)."""
    out = tmp_path_factory.mktemp("text-model") / "m"
    shutil.copytree(checkpoint_factory("llama"), out)
    tiny.write_char_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def ref(model_dir) -> tiny.Reference:
    """Direct single-request engine runs on the tiny text checkpoint."""
    return tiny.Reference(model_dir)
