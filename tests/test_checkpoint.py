"""Checkpoint layouts that must load, and broken ones that must fail with a useful message."""

from __future__ import annotations

import json
import pickle
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import FAMILIES, VOCAB, write_checkpoint

from mtpkit.checkpoint import CheckpointError, open_checkpoint
from mtpkit.engine.loader import load_model

LLAMA = FAMILIES[0]


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, tokenizer=False)


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids).hidden)


@pytest.fixture()
def with_head(checkpoint_factory, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(checkpoint_factory(LLAMA.name), out)
    return out


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    ids = torch.arange(10)[None]
    ref = write_checkpoint(LLAMA, tmp_path / "one")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = _load(tmp_path / "one").model, _load(tmp_path / "sharded").model
    assert torch.equal(_logits(a, ids), _logits(b, ids))


def test_unindexed_mtp_file_is_read_and_recorded(with_head, tmp_path):
    """A model_mtp.safetensors beside an index that does not list it (vLLM ignores it)."""
    base = load_file(with_head / "model.safetensors")
    save_file(base, with_head / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (with_head / "model.safetensors").unlink()
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in base}}
    (with_head / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = open_checkpoint(with_head)
    assert ckpt.unindexed_mtp_files == ["model_mtp.safetensors"]
    assert _load(with_head).model.mtp is not None


def test_config_declares_head_but_tensors_missing(with_head):
    (with_head / "model_mtp.safetensors").unlink()
    loaded = _load(with_head)
    assert loaded.model.mtp is None
    assert any("no MTP tensors" in n for n in loaded.report.notes)


def test_partial_head_is_an_error(with_head):
    mtp = load_file(with_head / "model_mtp.safetensors")
    mtp.pop("mtp.fc.weight")
    save_file(mtp, with_head / "model_mtp.safetensors")
    with pytest.raises(CheckpointError, match="MTP head is incomplete.*mtp.fc.weight"):
        _load(with_head)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        open_checkpoint(tmp_path / "absent")
    write_checkpoint(LLAMA, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        open_checkpoint(tmp_path / "m")


def test_missing_shard_names_the_file(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: file is missing"):
        open_checkpoint(tmp_path)


def test_truncated_shard(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(tmp_path)


def test_corrupt_shard(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors"):
        open_checkpoint(tmp_path)


def test_shape_disagrees_with_config(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape .*implies"):
        _load(tmp_path)


def test_unsupported_model_type_lists_supported(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'gpt2' is not supported.*supported: .*llama"):
        _load(tmp_path)


def test_pickle_checkpoints_are_refused_unopened(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"x": 1}))

    def boom(*a, **k):
        raise AssertionError("a pickle file was deserialised")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    with pytest.raises(CheckpointError, match="never unpickles"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="never unpickles"):
        open_checkpoint(tmp_path / "pytorch_model.bin")


def test_vocab_mismatch_is_named(tmp_path):
    write_checkpoint(LLAMA, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vocab_size"] = VOCAB + 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape_error = r"(embed_tokens|lm_head)\.weight has shape \(96, 64\)"
    with pytest.raises(CheckpointError, match=shape_error):
        _load(tmp_path)
