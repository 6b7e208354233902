"""Train an MTP head against a frozen trunk by self-distillation.

The head's target at position i is the trunk's own distribution for the token after next
(and one further per chained depth), not the corpus token: the head learns what this trunk
will accept. Embeddings and the lm_head are the trunk's, shared and frozen; so are the output
heads of MTP layers that carry their own (``mtp.heads.{i}``, Step's per-layer copies of the
lm_head): a vocabulary-sized matrix is most of a layer's weights, the release trained it with
the trunk, and the engines score drafts with it as shipped, so the head's blocks learn to
serve it rather than it to serve a few tokens of calibration text. Runs alone or
data-parallel under torchrun (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..engine.loader import load_model
from ..models.eagle3 import is_eagle3
from .data import iter_chunks, list_files, split_files
from .heads import save_head


@dataclass
class CalibrateConfig:
    """Everything one calibration run depends on (recorded in its output)."""

    model: str
    data: list[str]
    out: str
    init: str = "scratch"  # "scratch": new head from the trunk's last layer; "head": existing
    head: str | None = None  # a head folder to start from (with init="head")
    # Chained depths trained (each one more position ahead); depth d trains MTP layer
    # layer_for(d - 1). None: the head's MTP layer count, so that every layer trains.
    draft_depth: int | None = None
    tokens: int | None = None  # stop after this many training tokens (all ranks together)
    steps: int | None = None  # or after this many optimiser steps
    seed: int = 0
    device: str = "cpu"
    seq_len: int = 256
    batch_size: int = 4  # sequences per step and rank
    lr: float = 1e-3
    warmup_steps: int = 20
    heldout_fraction: float = 0.05
    draft_vocab: int = 8192  # keep the N most frequent training tokens for drafting (0: all)
    checkpoint_every: int = 50
    resume: bool = False
    # A folder caching the frozen trunk's outputs (train/features.py): the trunk runs once
    # over --tokens tokens, then the head trains --epochs passes at head cost only.
    features: str | None = None
    # Passes over the data: over the feature cache, or (without one) over the files, the
    # trunk running again on every pass.
    epochs: float = 1.0
    # Stop after this much training time, writing what was learned; the learning rate then
    # decays over whichever of the steps and the minutes runs out first (0: no limit).
    minutes: float = 0.0
    top_k: int = 32  # teacher entries kept per position in the cache
    split: dict = field(default_factory=dict)
    # "mtp" (fc over [embedding, final state], the trunk's lm_head) or "eagle3" (fc over three
    # trunk states, its own lm_head over the draft vocabulary: train/eagle3.py)
    head_type: str = "mtp"
    aux_layers: list[int] | None = None  # an EAGLE-3 head's trunk layer ids (None: vLLM's)


UNBOUNDED = 10**12  # total steps of a run that only --minutes (or the data) ends


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_scratch_head(model, sample: torch.Tensor | None = None) -> None:
    """A new head: its block copies the trunk's last layer; fc passes the hidden state on,
    scaled to the size the residual stream has there (measured on ``sample`` token ids)."""
    head = model.mtp
    scale = 1.0
    if sample is not None:
        with torch.no_grad():
            pre = model(sample).pre_norm
        # The copied layer expects a residual of the trunk's magnitude (often far above the
        # sqrt(d) of a normalised vector); feeding it a small one makes its output garbage.
        scale = float(pre.norm(dim=-1).mean()) / model.config.hidden_size**0.5
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("heads."):  # the release's own output heads are kept
                p.zero_()
        head.layers[0].load_state_dict(model.model.layers[-1].state_dict())
        d = model.config.hidden_size
        head.pre_fc_norm_embedding.weight.fill_(1.0)
        head.pre_fc_norm_hidden.weight.fill_(1.0)
        head.norm.weight.copy_(model.model.norm.weight)
        # fc([e, h]) = h + small(e): the head starts as "one more trunk layer on h".
        e_first = head.spec.emb_first
        eye = torch.eye(d) * scale
        noise = torch.randn(d, d, generator=g) * (0.02 / d**0.5)
        head.fc.weight.copy_(torch.cat([noise, eye] if e_first else [eye, noise], dim=1))


def chained_head_logits(model, head, ids: torch.Tensor, hidden: torch.Tensor, depth: int,
                        logits_fn):
    """Per chained depth d = 1..depth: (d, n, logits [B, n, V]) of the head at positions
    0..n-1, which read token i+d and predict the trunk's choice at i+d.

    ``hidden`` [B, T, D] is the trunk state the head reads at depth 1; deeper steps read the
    head's own state, as drafting chains them. ``head`` is the module to call (a
    DistributedDataParallel wrapper under torchrun); ``logits_fn(states, step)`` maps draft
    step ``step``'s head states to logits (``model.draft_logits``: its layer's output head).
    """
    spec = model.mtp.spec
    t = ids.shape[1]
    for d in range(1, depth + 1):
        n = t - 1 - d  # positions i with a known token i+d and a target at i+d
        if n <= 0:
            return
        if not _has_forward(head):
            # A head run only through its model's mtp_forward (DeepSeek-V4's: its blocks
            # route by token id); run() refuses such a head under torchrun.
            out = model.mtp_forward(ids[:, d : d + n], hidden[:, :n], d - 1, 0, None)
            post, pre = out.hidden, out.pre_norm
        else:
            cos, sin = (getattr(model, "mtp_rotary", None) or model.rotary).cos_sin(
                torch.arange(n, device=ids.device))
            emb = model.model.embed_tokens(ids[:, d : d + n]).detach()
            post, pre = head(emb, hidden[:, :n], d - 1, cos, sin, None)
        yield d, n, logits_fn(post, d - 1)
        hidden = post if spec.chain_hidden == "post_norm" else pre


def _has_forward(head) -> bool:
    # Whether the head module runs a draft step itself (a DDP wrapper always does).
    return type(head).forward is not torch.nn.Module.forward


def resolve_draft_depth(cfg: CalibrateConfig, layers: int, new: bool) -> int:
    """The depths to train: --draft-depth, by default the head's MTP layer count (depth d
    trains layer (d - 1) % layers, so fewer depths leave the last layers untrained).

    A depth below the layer count is refused for a new head (its other layers would be
    written back as initialised); for an existing head it warns, naming the layers kept as
    loaded (recalibrating only the first layers is a choice, e.g. on little data)."""
    if cfg.draft_depth is None:
        cfg.draft_depth = layers
    if cfg.draft_depth < layers:
        untouched = ", ".join(str(i) for i in range(cfg.draft_depth, layers))
        fix = (f"drop --draft-depth (default: {layers}, every layer) or pass --draft-depth "
               f"{layers} or more")
        if new:
            raise ValueError(f"--draft-depth {cfg.draft_depth} trains MTP layers "
                             f"0..{cfg.draft_depth - 1} of a new {layers}-layer head; layers "
                             f"{untouched} would be written untrained: {fix}")
        warnings.warn(f"--draft-depth {cfg.draft_depth} trains MTP layers "
                      f"0..{cfg.draft_depth - 1} only: layers {untouched} of this "
                      f"{layers}-layer head are written back unchanged; to train every layer, "
                      f"{fix}", stacklevel=2)
    if cfg.seq_len < cfg.draft_depth + 2:
        raise ValueError(f"--seq-len must be >= {cfg.draft_depth + 2} (--draft-depth "
                         f"{cfg.draft_depth} + 2), got {cfg.seq_len}")
    return cfg.draft_depth


def distill_loss(
    model, ids: torch.Tensor, depth: int, head=None
) -> tuple[torch.Tensor, int, int]:
    """Soft cross-entropy of the head against the trunk, summed over depths; top-1 agreement.

    ``head`` is the module to call (a DistributedDataParallel wrapper under torchrun).
    """
    if is_eagle3(model.mtp):
        from .eagle3 import loss

        return loss(model, ids, depth, head)
    head = head if head is not None else model.mtp
    with torch.no_grad():
        out = model(ids)
        teacher = torch.log_softmax(model.logits(out.hidden), dim=-1)  # [B, T, V]
        hidden = out.for_mtp(model.mtp.spec.trunk_hidden)
    total = torch.zeros((), device=ids.device)
    agree = count = 0
    for d, n, logits in chained_head_logits(model, head, ids, hidden, depth,
                                            model.draft_logits):
        target = teacher[:, d : d + n]
        total = total + -(target.exp() * torch.log_softmax(logits, -1)).sum(-1).mean()
        if d == 1:
            agree = int((logits.argmax(-1) == target.argmax(-1)).sum())
            count = logits.shape[0] * n
    return total, agree, count


def run(cfg: CalibrateConfig, progress: str = "lines") -> torch.nn.Module:
    """Train and write the head; returns it. ``progress``: "bar", "lines" or "off"."""
    check_config(cfg)
    rank, world = _rank_world()
    if str(cfg.device).startswith("cuda"):
        # TF32 GEMMs: several times the fp32 rate, and a head trained against a teacher
        # rounded to 10 mantissa bits drafts the same; inference keeps full fp32.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    files = list_files(cfg.data)
    split = split_files(files, cfg.heldout_fraction, cfg.seed)
    cfg.split = {"train": split.train, "heldout": split.heldout}
    # A seeded shuffle of the training files: a run that stops early has seen a mix of them.
    train_files = list(split.train)
    random.Random(cfg.seed).shuffle(train_files)
    new = cfg.init == "scratch" and cfg.head is None
    native = cfg.init == "head" and cfg.head is None  # recalibrating the checkpoint's own head
    if native:
        _check_native_out(Path(cfg.model), Path(cfg.out))
    loaded = load_model(cfg.model, device=cfg.device, dtype="float32",
                        head=cfg.head,
                        new_head_layers=1 if new and cfg.head_type != "eagle3" else 0)
    model, tok = loaded.model, loaded.tokenizer
    if model.mtp is None and not (new and cfg.head_type == "eagle3"):
        raise ValueError(
            f"{cfg.model}: --init head needs a head (the checkpoint has none; pass --head DIR "
            "or use --init scratch)"
        )
    if new and cfg.head_type == "eagle3":
        _new_eagle3_head(cfg, model, tok, train_files)
    elif new:
        first = next(iter_chunks(tok, train_files, cfg.seq_len), None)
        init_scratch_head(model, torch.tensor([first], device=cfg.device) if first else None)
    head = model.mtp
    resolve_draft_depth(cfg, len(head.layers), new)
    if world > 1 and not _has_forward(head):
        raise ValueError(f"{type(head).__name__} heads train in one process only (their "
                         "draft steps run through the model, past the data-parallel "
                         "wrapper): run calibrate without torchrun")
    if cfg.features and is_eagle3(head):
        raise ValueError("--features caches the trunk's final state, not the three states an "
                         "EAGLE-3 head reads: drop --features for --head-type eagle3")
    head.train()
    for p in head.parameters():  # an EAGLE-3 head's d2t is integer, and fixed
        p.requires_grad_(p.is_floating_point())
    if hasattr(head, "heads"):
        head.heads.requires_grad_(False)  # frozen as the lm_head is (the module docstring)
    trainable = head
    if world > 1:
        trainable = torch.nn.parallel.DistributedDataParallel(head)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    out = Path(cfg.out)
    state_dir = out.parent / f".{out.name}.state"
    step, tokens_done, skip = 0, 0, 0
    if cfg.resume and (state_dir / "state.json").exists():
        step, tokens_done, skip = _load_state(state_dir, head, opt)
    total_steps = cfg.steps or max(1, (cfg.tokens or 10**6) // (cfg.seq_len * cfg.batch_size
                                                              * world))
    if cfg.minutes and not (cfg.steps or cfg.tokens):
        total_steps = UNBOUNDED  # the clock (or the data) ends the run

    def lr_at(s: int) -> float:
        warm = min(1.0, (s + 1) / max(cfg.warmup_steps, 1))
        done = s / total_steps
        if cfg.minutes:
            done = max(done, (time.perf_counter() - t0) / (60 * cfg.minutes))
        return cfg.lr * warm * max(0.1, 1 - done)

    if cfg.features:
        source = _CachedSource(cfg, model, tok, train_files, rank, world, step)
        total_steps = cfg.steps or source.steps
    else:
        vocab = None
        if cfg.draft_vocab and not is_eagle3(head):  # an EAGLE-3 head's is its d2t
            # Counted before training (over the chunks the run reads, one pass at most), so
            # the loss can score the draft vocabulary only, and a resumed run drafts the
            # same tokens as an uninterrupted one.
            from .features import frequent_tokens

            planned = total_steps * cfg.batch_size * world * cfg.seq_len
            vocab = frequent_tokens(tok, train_files, cfg.seq_len, planned,
                                    model.config.vocab_size, cfg.draft_vocab)
        # A head written into its checkpoint (native) is drafted from the whole vocabulary
        # by every engine that loads the checkpoint, and an EAGLE-3 head has a loss of its
        # own: both keep the whole-vocabulary loss.
        own = vocab is not None and not native
        source = _OnlineSource(cfg, model, tok, train_files, rank, world, skip, vocab, own)
    autocast = _autocast(cfg.device)
    if rank == 0 and progress != "off" and autocast is not _FP32:
        print("calibrate: bfloat16 autocast on this CPU's AMX tiles (weights and updates stay "
              "float32)", file=sys.stderr, flush=True)
    bar = _progress(progress if rank == 0 else "off", total_steps, step)
    t0 = time.perf_counter()
    agree_run = count_run = 0
    loss_v = float("nan")
    while step < total_steps:
        batch = next(source.batches, None)
        if batch is None:
            break  # the data ran out: stop with what was learned
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        # Through the DDP wrapper (when distributed) so gradients are averaged across ranks.
        with autocast:
            loss, agree, count = source.loss(batch, trainable)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_done += batch["ids"].numel() * world
        agree_run = 0.9 * agree_run + agree
        count_run = 0.9 * count_run + count
        loss_v = float(loss.detach())
        if bar:
            bar.update(step, loss_v, agree_run / max(count_run, 1), tokens_done)
        if rank == 0 and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            _save_state(state_dir, head, opt, step, tokens_done, source.skip)
        if cfg.tokens and tokens_done >= cfg.tokens and not cfg.features:
            break
        if cfg.minutes and time.perf_counter() - t0 >= 60 * cfg.minutes:
            break
    if bar:
        bar.close()
    head.eval().requires_grad_(False)
    rank_diff = _rank_weight_diff(head) if world > 1 else 0.0
    if rank == 0:
        summary = {
            "format": "mtpkit-head",
            "version": 1,
            "base_model": str(cfg.model),
            "model_type": model.config.model_type,
            "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size,
            "num_nextn_predict_layers": len(head.layers),
            "calibration": {
                **{k: v for k, v in asdict(cfg).items() if k != "split"},
                "steps_done": step,
                "tokens_done": tokens_done,
                "seconds": round(time.perf_counter() - t0, 1),
                "final_loss": loss_v,
                "running_top1_agreement": agree_run / max(count_run, 1),
                "precision": _precision(cfg.device, autocast),
                "world_size": world,
                "max_weight_diff_between_ranks": rank_diff,
                "device": str(cfg.device),
                "torch": torch.__version__,
            },
            "data": cfg.split,
        }
        vocab = source.draft_vocab() if cfg.draft_vocab else None
        if native:
            # The head lives in the checkpoint (a native MTP release, or a quantized one
            # written by `mtpkit quantize --head`): the result is that checkpoint with the
            # new head, in its own layout and format, checked by doctor.
            from .export import write_with_head

            result = write_with_head(model, cfg.model, out, vocab)
            summary["doctor"] = result.report.as_dict() if result.report else None
            # A GGUF output is one file: the summary goes beside it.
            note = (out.with_name(out.name + ".calibration.json") if out.suffix == ".gguf"
                    else out / "mtpkit_calibration.json")
            note.write_text(json.dumps(summary, indent=2, default=str))
        else:
            if is_eagle3(head):
                from .eagle3 import head_config

                # Its vocabulary is its d2t; a draft_vocab.json would say another.
                summary.update(head_config(model))
                vocab = None
            save_head(head, out, summary, vocab)
    return head


def _new_eagle3_head(cfg: CalibrateConfig, model, tok, files) -> None:
    """Count the draft vocabulary over the tokens the run will read, then build the head."""
    from . import eagle3, features

    n = cfg.draft_vocab or model.config.vocab_size
    vocab = features.frequent_tokens(tok, files, cfg.seq_len, cfg.tokens or 10**6,
                                     model.config.vocab_size, n)
    if len(vocab) < n:  # fill with unseen ids so the head has the rows asked for
        seen = set(vocab)
        vocab += [t for t in range(model.config.vocab_size) if t not in seen][: n - len(vocab)]
    eagle3.new_head(model, vocab, cfg.aux_layers)


def check_config(cfg: CalibrateConfig) -> None:
    """Refuse, before any work, settings that cannot train (ValueError naming the option)
    and an --out that would write over an input."""
    # An unset depth becomes the head's layer count once it is loaded (resolve_draft_depth).
    depth = 1 if cfg.draft_depth is None else cfg.draft_depth
    checks = [
        (depth >= 1, f"--draft-depth must be >= 1, got {depth}"),
        (cfg.tokens is None or cfg.tokens >= 1, f"--tokens must be >= 1, got {cfg.tokens}"),
        (cfg.steps is None or cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}"),
        (cfg.seq_len >= depth + 2,
         f"--seq-len must be >= {depth + 2} (--draft-depth + 2), got {cfg.seq_len}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}"),
        (0 <= cfg.heldout_fraction < 1,
         f"--heldout-fraction must be in [0, 1), got {cfg.heldout_fraction}"),
        (cfg.checkpoint_every >= 0,
         f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (cfg.draft_vocab >= 0, f"--draft-vocab must be >= 0, got {cfg.draft_vocab}"),
        (cfg.epochs > 0, f"--epochs must be > 0, got {cfg.epochs}"),
        (cfg.minutes >= 0, f"--minutes must be >= 0, got {cfg.minutes}"),
        (cfg.top_k >= 1, f"--teacher-top-k must be >= 1, got {cfg.top_k}"),
        (cfg.head_type in ("mtp", "eagle3"),
         f"--head-type must be mtp or eagle3, got {cfg.head_type!r}"),
        (cfg.head_type == "eagle3" or cfg.aux_layers is None,
         "--aux-layers applies to --head-type eagle3 only"),
        (not (cfg.head_type == "eagle3" and cfg.features),
         "--features caches the trunk's final state, not the three states an EAGLE-3 head "
         "reads: drop --features for --head-type eagle3"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    out = Path(cfg.out).resolve()
    inputs = [("--model", cfg.model), ("--head", cfg.head), ("--features", cfg.features),
              *(("--data", d) for d in cfg.data)]
    for option, path in inputs:
        if path is None:
            continue
        src = Path(path).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise ValueError(f"--out {out} overlaps the input {option} {src}; mtpkit never "
                             "writes over its input: choose another folder")


def _check_native_out(model: Path, out: Path) -> None:
    """A recalibrated checkpoint keeps its input's format: refuse a mismatched --out early."""
    from ..checkpoint import is_gguf

    if is_gguf(model) and out.suffix != ".gguf":
        raise ValueError(f"{model} is a GGUF file and the recalibrated checkpoint is written "
                         f"as GGUF too: give --out a file name ending in .gguf (got {out})")
    if not is_gguf(model) and out.suffix == ".gguf":
        raise ValueError(f"{model} is a checkpoint folder and the recalibrated checkpoint is "
                         f"written as a folder in the same format: drop .gguf from --out {out}")


class _OnlineSource:
    """Batches of token chunks; the trunk runs on each (the head trains on its outputs).

    ``vocab``: the draft vocabulary (most frequent first; None without one). ``own``: the
    head drafts from it alone (an mtpkit head with draft_vocab.json), so the loss is
    cached_loss's, over the draft vocabulary and the teacher's top-k, computed on the
    spot; otherwise distill_loss's over the whole vocabulary. Scoring 8,192 of SmolLM2's
    49,152 tokens made a CPU step several times faster: the vocabulary-wide softmaxes and
    their gradients, not the GEMMs, were most of its time."""

    def __init__(self, cfg, model, tok, files, rank, world, skip,
                 vocab: list[int] | None = None, own: bool = False) -> None:
        self.cfg, self.model, self.rank, self.world, self.skip = cfg, model, rank, world, skip
        self.chunks = self._passes(tok, files, skip)
        self.vocab = vocab
        self.scored = (torch.tensor(vocab, device=cfg.device)
                       if own and vocab is not None else None)
        self.batches = self._batches()

    def _batches(self):
        cfg = self.cfg
        while True:
            batch = []
            for _ in range(cfg.batch_size * self.world):
                c = next(self.chunks, None)
                if c is None:
                    break
                self.skip += 1
                batch.append(c)
            batch = batch[self.rank::self.world]
            if len(batch) < cfg.batch_size:
                return
            yield {"ids": torch.tensor(batch, device=cfg.device)}

    def _passes(self, tok, files, skip):
        """--epochs passes over the files' chunks, in the same order each time; ``skip``
        counts chunks over all passes (a resumed run's)."""
        epochs = self.cfg.epochs
        per_pass = n = 0  # chunks in a whole pass (known after the first), chunks so far
        for p in range(math.ceil(epochs)):
            share = epochs - p  # below 1 only on a fractional last pass
            if share < 1 and not per_pass:  # a fractional first pass: its length first
                per_pass = sum(1 for _ in iter_chunks(tok, files, self.cfg.seq_len))
            for i, c in enumerate(iter_chunks(tok, files, self.cfg.seq_len)):
                if share < 1 and i >= per_pass * share:
                    break
                n += 1
                if n > skip:
                    yield c
            per_pass = per_pass or n

    def loss(self, batch, head):
        if self.scored is None:
            return distill_loss(self.model, batch["ids"], self.cfg.draft_depth, head)
        from .features import cached_loss, teacher_targets

        targets = teacher_targets(self.model, batch["ids"], self.scored, self.cfg.top_k,
                                  self.model.mtp.spec.trunk_hidden)  # without gradients
        return cached_loss(self.model, targets, self.cfg.draft_depth, self.scored, head)

    def draft_vocab(self) -> list[int]:
        """The most frequent tokens of the chunks the run reads, most frequent first."""
        return self.vocab or []


class _CachedSource:
    """Batches from a feature cache (built first when missing): epochs at head cost only."""

    def __init__(self, cfg, model, tok, files, rank, world, step) -> None:
        from . import features

        self.cfg, self.model, self.skip = cfg, model, 0
        tokens = cfg.tokens or 10**6
        key = features.cache_key(cfg.model, files, cfg.seq_len, cfg.draft_vocab, cfg.top_k,
                                 tokens, model.mtp.spec.trunk_hidden)
        self.cache = features.open_matching(cfg.features, key)
        if self.cache is None:
            if cfg.draft_vocab:
                vocab = features.frequent_tokens(tok, files, cfg.seq_len, tokens,
                                                 model.config.vocab_size, cfg.draft_vocab)
            else:
                vocab = list(range(model.config.vocab_size))
            say = (lambda s, n: print(f"features: shard {s}/{n}", file=sys.stderr,
                                      flush=True)) if rank == 0 else None
            self.cache = features.build(model, tok, files, cfg.features, seq_len=cfg.seq_len,
                                        tokens=tokens, vocab=vocab, top_k=cfg.top_k, key=key,
                                        batch_size=cfg.batch_size, device=cfg.device,
                                        rank=rank, world=world, progress=say)
        self.vocab = self.cache.vocab.to(cfg.device)
        per_epoch = len(self.cache) // (cfg.batch_size * world)
        if per_epoch == 0:
            raise ValueError(f"the feature cache holds {len(self.cache)} sequences, fewer than "
                             f"one step needs ({cfg.batch_size * world}); lower --batch-size")
        self.steps = max(1, round(cfg.epochs * per_epoch))
        self.batches = self._batches(rank, world, step, per_epoch)

    def _batches(self, rank, world, step, per_epoch):
        epoch, skip = divmod(step, per_epoch)  # resume: the same order, minus what was done
        while True:
            for i, b in enumerate(self.cache.batches(self.cfg.batch_size, self.cfg.seed, epoch,
                                                     rank, world)):
                if i >= skip:
                    yield b
            epoch, skip = epoch + 1, 0

    def loss(self, batch, head):
        from .features import cached_loss

        return cached_loss(self.model, batch, self.cfg.draft_depth, self.vocab, head)

    def draft_vocab(self) -> list[int]:
        """The cache's draft vocabulary, most frequent first."""
        return self.cache.meta["draft_vocab"]


_FP32 = contextlib.nullcontext()


def _autocast(device: str):
    """bfloat16 autocast where the CPU multiplies bfloat16 on AMX tiles (several times its
    float32 GEMM rate), else plain float32 (CUDA takes TF32 instead, set in run())."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if str(device) == "cpu" and amx is not None and amx():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return _FP32


def _precision(device: str, autocast) -> str:
    if autocast is not _FP32:
        return "bfloat16 autocast"
    return "tf32" if str(device).startswith("cuda") else "float32"


def _rank_weight_diff(head) -> float:
    """Largest difference of any weight between ranks (0 when data parallelism is sound)."""
    flat = torch.cat([p.detach().float().flatten().cpu() for p in head.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max(float((g - flat).abs().max()) for g in gathered)


def _save_state(d: Path, head, opt, step: int, tokens: int, skip: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    # Our own resume state, in safetensors + JSON: nothing here is ever unpickled.
    tensors = {f"head.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    names = {id(p): n for n, p in head.named_parameters()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"opt.{names[id(p)]}.{key}"] = st[key].contiguous()
    tmp = d / "state.safetensors.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, d / "state.safetensors")
    meta = {"step": step, "tokens": tokens, "skip": skip,
            "opt_step": {names[id(p)]: float(st["step"]) for p, st in opt.state.items()}}
    (d / "state.json.tmp").write_text(json.dumps(meta))
    os.replace(d / "state.json.tmp", d / "state.json")


def _load_state(d: Path, head, opt) -> tuple[int, int, int]:
    meta = json.loads((d / "state.json").read_text())
    tensors = load_file(d / "state.safetensors")
    head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
    for n, p in head.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {
                "step": torch.tensor(meta["opt_step"][n]),
                "exp_avg": tensors[f"opt.{n}.exp_avg"].clone(),
                "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"].clone(),
            }
    return meta["step"], meta["tokens"], meta["skip"]


class _Bar:
    def __init__(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bounded = total < UNBOUNDED
        count = "{task.completed}/{task.total}" if bounded else "step {task.completed}"
        self.p = Progress(TextColumn("calibrate"), BarColumn(), TextColumn(count),
                          TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.p.start()
        self.task = self.p.add_task("", total=total if bounded else None, completed=done,
                                    info="")

    def update(self, step, loss, acc, tokens) -> None:
        self.p.update(self.task, completed=step,
                      info=f"loss {loss:.3f} top-1 {100 * acc:.1f}% tokens {tokens}")

    def close(self) -> None:
        self.p.stop()


class _Lines:
    """Progress for logs: one line every ``every`` steps."""

    def __init__(self, total: int, every: int = 10) -> None:
        self.total, self.every = total, every

    def update(self, step, loss, acc, tokens) -> None:
        if step % self.every == 0 or step == self.total:
            of = f"/{self.total}" if self.total < UNBOUNDED else ""
            print(f"step {step}{of} loss {loss:.3f} top-1 {100 * acc:.1f}% "
                  f"tokens {tokens}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(mode: str, total: int, done: int):
    if mode == "bar":
        return _Bar(total, done)
    return _Lines(total) if mode == "lines" else None
