"""A cache of the frozen trunk's outputs, so a head trains for many epochs at head cost only.

The trunk is frozen during calibration, so its hidden states and its distributions never
change: computing them once and reading them back makes each further pass over the data
about 9x cheaper on a CPU (SmolLM2, 2 threads: trunk + teacher 2.0 s, head forward and
backward over the draft vocabulary 0.35 s per 1,024 tokens).

Per position the cache keeps the token id, the hidden state the head reads (fp16), the
trunk's greedy token over the whole vocabulary, and the trunk's distribution renormalised
over the draft vocabulary, truncated to its ``top_k`` most likely entries. The head drafts
only from the draft vocabulary, so that renormalised distribution is exactly what its
drafts are judged against; the greedy token over the whole vocabulary keeps the reported
agreement honest when the trunk's choice lies outside it.

Shards are safetensors files written atomically; ``meta.json`` is written last and names
what the cache was built from, so a cache is reused only for the same trunk, data, draft
vocabulary and sequence length.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .data import DataError, iter_chunks
from .heads import top_tokens

SHARD_SEQS = 64  # sequences per shard file (64 x 256 tokens x 576 dims x fp16: 19 MB)
META = "meta.json"
VERSION = 1


def cache_key(model_path: str, files: list[str], seq_len: int, draft_vocab: int,
              top_k: int, tokens: int, trunk_hidden: str) -> str:
    """What a cache depends on, hashed: trunk files (names, sizes, times), data, settings.

    The draft vocabulary enters as its size: its tokens follow from the data, the tokenizer
    (a trunk file) and that size, so a cache can be recognised without re-counting them.
    """
    h = hashlib.sha256()
    p = Path(model_path)
    trunk_files = sorted(p.rglob("*")) if p.is_dir() else [p]
    for f in trunk_files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:"
                     f"{st.st_mtime_ns}\n".encode())
    for f in files:
        st = Path(f).stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([seq_len, top_k, tokens, draft_vocab, trunk_hidden, VERSION]).encode())
    return h.hexdigest()[:24]


@dataclass
class FeatureCache:
    """A finished cache folder: ``len(self)`` sequences of ``seq_len`` positions."""

    root: Path
    meta: dict

    @classmethod
    def open(cls, root: str | os.PathLike) -> FeatureCache:
        """Open a finished cache (raises DataError when the folder is not one)."""
        root = Path(root)
        if not (root / META).exists():
            raise DataError(f"{root}: not a finished feature cache (no {META})")
        return cls(root, json.loads((root / META).read_text()))

    def __len__(self) -> int:
        return self.meta["sequences"]

    @property
    def vocab(self) -> torch.Tensor:
        """Draft vocabulary token ids (the rows of the lm_head the head scores)."""
        return torch.tensor(self.meta["draft_vocab"], dtype=torch.long)

    def batches(self, batch_size: int, seed: int, epoch: int, rank: int = 0,
                world: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's batches of one epoch, in a seeded order over all sequences.

        Every rank draws from the same permutation and takes its own slice of each global
        batch, so ranks never see the same sequence in a step. Rows are read one at a time
        from the shard files: memory stays bounded whatever the cache size.
        """
        order = list(range(len(self)))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        step = batch_size * world
        handles: dict[int, object] = {}
        for b in range(0, len(order) - step + 1, step):
            rows = order[b + rank * batch_size: b + (rank + 1) * batch_size]
            parts: dict[str, list[torch.Tensor]] = {}
            for r in rows:
                s, i = divmod(r, SHARD_SEQS)
                if s not in handles:
                    handles[s] = safe_open(str(self.root / f"{s:05d}.safetensors"), "pt")
                for name in ("ids", "hidden", "argmax", "top_idx", "top_logp"):
                    parts.setdefault(name, []).append(handles[s].get_slice(name)[i: i + 1])
            yield {k: torch.cat(v) for k, v in parts.items()}


def open_matching(root: str | os.PathLike, key: str) -> FeatureCache | None:
    """The finished cache at ``root`` built with ``key``; None when there is none yet."""
    root = Path(root)
    if not (root / META).exists():
        return None
    cache = FeatureCache.open(root)
    if cache.meta.get("key") != key:
        raise DataError(
            f"{root}: this feature cache was built from another trunk, data or settings; "
            "remove it or pass another --features folder"
        )
    return cache


@torch.no_grad()
def teacher_targets(model, ids: torch.Tensor, vocab: torch.Tensor, top_k: int,
                    trunk_hidden: str) -> dict[str, torch.Tensor]:
    """What cached_loss reads of the trunk for token ids [B, T], on the trunk's device: the
    state the head reads [B, T, D], the greedy token over the whole vocabulary [B, T], and
    the top_k entries of the trunk's log-distribution renormalised on the draft vocabulary
    (indices into ``vocab`` and their log-probabilities, best first) [B, T, top_k]."""
    out = model(ids)
    logits = model.logits(out.hidden)  # [B, T, V]
    dv = torch.log_softmax(logits.index_select(-1, vocab.to(logits.device)).float(), -1)
    top_logp, top_idx = dv.topk(min(top_k, dv.shape[-1]), dim=-1)  # sorted, best first
    return {"ids": ids, "hidden": out.for_mtp(trunk_hidden), "argmax": logits.argmax(-1),
            "top_idx": top_idx, "top_logp": top_logp}


def teacher_features(model, ids: torch.Tensor, vocab: torch.Tensor, top_k: int,
                     trunk_hidden: str) -> dict[str, torch.Tensor]:
    """teacher_targets in the cache's layout (CPU, 16-bit states and log-probabilities)."""
    t = teacher_targets(model, ids, vocab, top_k, trunk_hidden)
    idx_dtype = torch.int16 if vocab.numel() <= 32767 else torch.int32
    return {
        "ids": t["ids"].to(torch.int32).cpu(),
        "hidden": t["hidden"].half().cpu(),
        "argmax": t["argmax"].to(torch.int32).cpu(),
        "top_idx": t["top_idx"].to(idx_dtype).cpu(),
        "top_logp": t["top_logp"].half().cpu(),
    }


def build(model, tokenizer, files: list[str], root: str | os.PathLike, *, seq_len: int,
          tokens: int, vocab: list[int], top_k: int, key: str, batch_size: int = 4,
          device: str = "cpu", rank: int = 0, world: int = 1, progress=None) -> FeatureCache:
    """Fill ``root`` with the trunk's outputs for the first ``tokens`` tokens of ``files``.

    Resumable: finished shards are kept, and a rerun computes only the missing ones. Under
    torchrun each rank computes the shards ``i % world == rank``; the caller synchronises.
    """
    root = Path(root)
    cache = open_matching(root, key)
    if cache is not None:
        return cache
    root.mkdir(parents=True, exist_ok=True)
    want = max(1, tokens // seq_len)
    n_shards = -(-want // SHARD_SEQS)
    vocab_t = torch.tensor(vocab, dtype=torch.long)
    spec = model.mtp.spec
    chunks = iter_chunks(tokenizer, files, seq_len)
    total = 0
    for s in range(n_shards):
        rows = []
        for _ in range(min(SHARD_SEQS, want - s * SHARD_SEQS)):
            c = next(chunks, None)
            if c is None:
                break
            rows.append(c)
        total += len(rows)
        if not rows:
            break
        path = root / f"{s:05d}.safetensors"
        if s % world != rank or path.exists():
            continue
        feats: dict[str, list[torch.Tensor]] = {}
        for b in range(0, len(rows), batch_size):
            ids = torch.tensor(rows[b: b + batch_size], device=device)
            for k, v in teacher_features(model, ids, vocab_t, top_k, spec.trunk_hidden).items():
                feats.setdefault(k, []).append(v)
        tmp = path.with_suffix(".tmp")
        save_file({k: torch.cat(v).contiguous() for k, v in feats.items()}, str(tmp))
        os.replace(tmp, path)
        if progress:
            progress(s + 1, n_shards)
        if len(rows) < SHARD_SEQS:
            break
    if total == 0:
        raise DataError("the training files hold fewer tokens than one sequence "
                        f"({seq_len}); add data or lower --seq-len")
    meta = {"version": VERSION, "key": key, "sequences": total, "seq_len": seq_len,
            "top_k": top_k, "draft_vocab": [int(t) for t in vocab],
            "trunk_hidden": spec.trunk_hidden, "files": list(files)}
    _barrier(world)  # every rank's shards exist before the cache is declared finished
    if rank == 0:
        (root / f"{META}.tmp").write_text(json.dumps(meta))
        os.replace(root / f"{META}.tmp", root / META)
    _barrier(world)
    return FeatureCache(root, meta)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def count_tokens(tokenizer, files: list[str], seq_len: int, tokens: int,
                 vocab_size: int) -> torch.Tensor:
    """Token frequencies over the chunks a cache of ``tokens`` tokens will hold."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    want = max(1, tokens // seq_len)
    for n, c in enumerate(iter_chunks(tokenizer, files, seq_len)):
        if n >= want:
            break
        counts += torch.bincount(torch.tensor(c), minlength=vocab_size)
    return counts


def frequent_tokens(tokenizer, files: list[str], seq_len: int, tokens: int, vocab_size: int,
                    n: int) -> list[int]:
    """The ``n`` most frequent token ids (those seen) over the chunks of the first ``tokens``
    tokens of ``files``, most frequent first: a draft vocabulary."""
    return top_tokens(count_tokens(tokenizer, files, seq_len, tokens, vocab_size), n)


def cached_loss(model, batch: dict[str, torch.Tensor], depth: int, vocab: torch.Tensor,
                head=None) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy over the draft vocabulary against cached targets; top-1 agreement.

    loss = -sum_d mean_i sum_k p_teacher(k | i+d) log p_head(k | i), k over the cached top-k
    of the trunk's distribution renormalised on the draft vocabulary. Agreement counts a
    position when the head's draft (mapped back to a token id) is the trunk's greedy token
    over the WHOLE vocabulary, as verification would judge it.
    """
    from ..quant.linear import linear_rows
    from .calibrate import chained_head_logits

    head = head if head is not None else model.mtp
    dev = model.model.embed_tokens.weight.device
    ids = batch["ids"].to(dev, torch.long)
    hidden = batch["hidden"].to(dev, torch.float32)
    # Only the draft vocabulary's rows of each depth's output head, dequantized on their
    # own: a quantized lm_head's .weight would build and keep the whole float matrix (113 MB
    # for SmolLM2's).
    heads = [model.draft_head(s) for s in range(depth)]
    rows = {id(h): linear_rows(h, vocab.to(dev)).weight.detach()
            for h in {id(h): h for h in heads}.values()}
    total = torch.zeros((), device=dev)
    agree = count = 0
    for d, n, logits in chained_head_logits(
            model, head, ids, hidden, depth,
            lambda post, s: torch.nn.functional.linear(post, rows[id(heads[s])]).float()):
        logp = torch.log_softmax(logits, -1)
        idx = batch["top_idx"][:, d: d + n].to(dev, torch.long)
        p = batch["top_logp"][:, d: d + n].to(dev, torch.float32).exp()
        total = total - (p * logp.gather(-1, idx)).sum(-1).mean()
        if d == 1:
            draft = vocab.to(dev)[logp.argmax(-1)]
            agree = int((draft == batch["argmax"][:, d: d + n].to(dev)).sum())
            count = draft.numel()
    return total, agree, count
