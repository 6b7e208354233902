"""Fast decoding: fixed-shape steps over a static KV cache, compiled once and cached across
runs (``mtpkit generate --compile``).

Why: on a CPU, speculative decoding pays only when verifying k+1 tokens costs about what one
token costs, and eager PyTorch is far from that (small-row GEMMs, one Python dispatch per
op, attention over a growing cache). Here every step has a shape fixed for the whole run:

- the KV cache is preallocated, one [1, kv_heads, L, dim] buffer per layer (trunk and
  head); a step writes its keys and values at positions given as a tensor
  (``index_copy_``) and attends over the whole buffer under the mask ``key <= position``,
  so lengths never reach a graph shape and slots past the current position (stale entries
  of an earlier request or of a rejected draft) are never read;
- a greedy speculative round is one program: verify ``[pending, d1..dk]`` at positions
  ``pos..pos+k``, accept on the target's argmaxes, catch the MTP head up on those k+1
  positions (for greedy the token after position i is the target's argmax at i, so the
  head's inputs are known inside the round; entries past the accepted one are overwritten
  before they are ever attended), then chain the head k times from the accepted position.
  The host reads one small tensor per round (target tokens, accept count, next drafts);
- plain decoding is the same trunk without the head (one token in, its argmax out);
- the prompt (prefill, any length) runs the same functions eagerly.

Backends: ``aoti`` (default) exports each program and compiles it ahead of time with
inductor (weights frozen and prepacked, GEMMs autotuned, C++ wrapper) into a package under
``~/.cache/mtpkit/compiled``, keyed by the model's weights, the shapes, this file and the
torch build, so a later process only loads it (seconds); ``inductor`` uses
``torch.compile`` in process (nothing survives the process); ``eager`` runs the programs
as plain PyTorch (the reference the compiled ones are tested against). Either way the
shapes are fixed per ``FastDecoder``, so a generation never compiles anything.

Exactness: greedy output with MTP equals output without MTP (the accept rule and the
models are those of the eager engine). On quantized trunks that needs every verified row to
equal the one-token step bit for bit, so their steps attend row by row and every trunk step
has the same QUANT_ROWS rows with shape-chosen GEMM kernels (``Programs.rowwise`` and
``Programs.rows``), unless every GEMM of the trunk and the lm_head is row-exact
(``Programs.row_exact``: mtpkit's int8/W4A8 kernels, or ``f32_mm`` for fp32 trunks on a
CPU): then a decode step is one row and a round k+1.

Sampled requests run the pooled programs (``trunk_pool`` / ``head_pool``, a lone decoder's
own caches a pool of one slot): the trunk's logits come back, the host accepts by the
lossless rule (engine/accept.py) with the request's own seeded stream and draws the next
drafts from the head, in the order the eager engine draws, so a seed gives the eager
engine's tokens. Decoders whose steps do not pool leave sampling to the eager engine.
"""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import threads
from ..models.attention import Attention, position_mask, row_kernel_fits
from ..models.cache import zeros
from ..models.eagle3 import is_eagle3
from ..models.layers import MLP, PreNormDecoderLayer, swapped
from ..quant.kernels import aoti_c_shims, argmax_rows, int8_mm_available, kernel_choice
from ..quant.kernels import source_digest as kernel_source_digest
from ..quant.linear import (
    FORM_PREFIX,
    QuantLinear,
    RowExactLinear,
    every_row_exact,
    linear_rows,
    stack_outputs,
)
from ..quant.w8a8_layer import W8A8Forms, w8a8_block, w8a8_block_fits, w8a8_trunk, w8a8_whole
from .accept import accept_sampled
from .budget import DraftOdds, RoundCosts, choose_drafts, drafting_pays, top_drafts
from .generate import Result, draw_draft, emit
from .sampling import SamplingParams, probs, sample

BACKENDS = ("auto", "aoti", "inductor", "eager")
log = logging.getLogger("mtpkit.fast")

SPAN_STEP = 64  # attention reads the cache up to the next multiple of this
EXPLORE = 16  # a batched round in this many measures all drafts or none (_drafts_to_verify)
QUANT_ROWS = 2  # trunk rows of every compiled step on quantized trunks: drafts k <= 1
ADOPT_EVERY_S = 2.0  # how often uncompiled programs look for their built file (FastDecoder)
POOL_KINDS = ("trunk_pool", "head_pool")  # programs over pooled caches (make_pool)
# Rows a pooled step may have: a prompt's threshold for torch's GEMM (QuantLinear), which the
# compiled pool programs are built below; steps of more rows take the unpooled passes.
POOL_MAX_ROWS = 256
DRAFT_SEEN = 256  # sequences' draft probabilities whether drafting pays is judged on (_lean)
DEFAULT_MAX_LEN = 2048  # cache positions of a FastDecoder unless the model's context is shorter


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot take the fast path (None when it can)."""
    layers = list(model.model.layers)
    # An EAGLE-3 head's layer attends over [norm(embedding), norm(state)] (Programs.head);
    # an MTP head's is a plain decoder layer, checked with the trunk's.
    if model.mtp is not None and not is_eagle3(model.mtp):
        if len(model.mtp.layers) != 1:
            return "MTP heads with more than one layer are not supported"
        if len(getattr(model.mtp, "heads", ())):
            # The programs score drafts with the lm_head.
            return "MTP layers with output heads of their own are not supported"
        layers += list(model.mtp.layers)
    for layer in layers:
        if not isinstance(layer, PreNormDecoderLayer):
            return f"{type(layer).__name__} layers are not supported (attention + MLP only)"
        if type(layer.self_attn) is not Attention or not isinstance(layer.mlp, MLP):
            return (f"{type(layer.self_attn).__name__} / {type(layer.mlp).__name__} "
                    "blocks are not supported (GQA attention + SwiGLU MLP only)")
    return None


def _trunk_linears(model) -> list[nn.Module]:
    # Every Linear a trunk step runs: the layers' and the lm_head.
    mods = [m for m in model.model.modules()
            if isinstance(m, (nn.Linear, QuantLinear, RowExactLinear))]
    return mods + [model.lm_head]


def row_exact_trunk(model) -> bool:
    """Whether every Linear of the trunk and the lm_head computes each row independently of
    the rows around it, bit for bit (mtpkit's int8 kernels; see QuantLinear.row_exact)."""
    return all(isinstance(m, QuantLinear) and m.row_exact for m in _trunk_linears(model))


def float_row_exact_trunk(model) -> bool:
    """Whether every Linear of the trunk and the lm_head is an fp32 CPU layer that
    mtpkit's row-exact ``f32_mm`` kernel can run (RowExactLinear)."""
    return all(RowExactLinear.fits(m) for m in _trunk_linears(model))


def _accepted(tokens, target):
    """n [1]: how many drafts (tokens[0, 1:]) equal the target's choices before them."""
    return torch.cumprod((tokens[0, 1:] == target[:-1]).long(), 0).sum().view(1)


def _seqs_kernel_fits(x: torch.Tensor, buf: torch.Tensor) -> bool:
    # Whether Attention.attend_seqs can take a batched pass: mtpkit's row kernel, caches one
    # tensor a sequence [1, Hkv, L, hd].
    return row_kernel_fits(x, buf) and buf.dim() == 4 and buf.shape[0] == 1


def _span(span: torch.Tensor | None, buf: torch.Tensor) -> int:
    # The span's length is a shape, not a value: compiled programs take it as a dynamic
    # dimension, so one program serves every length without a host read or a recompile.
    return buf.shape[2] if span is None else span.shape[0]


class Programs(nn.Module):
    """The step functions; a module holding the model so that export and compilation see
    its weights as parameters (which freezing folds into the program)."""

    def __init__(self, model, draft_vocab: torch.Tensor | None,
                 forms: W8A8Forms | None = None) -> None:
        super().__init__()
        self.model = model
        cfg = model.config
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        # Quantized trunks attend row by row in their steps: torch's int kernels (int4, and
        # int8 where mtpkit's own kernel does not build) round activations to bf16, so any
        # difference between a one-token step and a row of a (k+1)-token one grows through
        # the layers into different greedy text, and one batched masked attention call
        # rounds its rows differently from single rows
        # (SmolLM2 w8a16 compiled, k=3: 7/12 prompts identical batched with autotuned GEMM
        # templates, 8/12 row by row with templates, 12/12 row by row with library GEMMs).
        quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
        # fp32 trunks on a CPU where mtpkit's kernels build are row-exact too: their GEMMs
        # go through f32_mm (RowExactLinear), so they take the row-exact path below: one-row
        # decode, k+1-row rounds, row-wise attention, which also ran faster than inductor's
        # two-row GEMM templates and torch's SDPA.
        self.float_rows = not quantized and float_row_exact_trunk(model)
        self.rowwise = bool(quantized) or self.float_rows
        # They also run every trunk step with the same number of rows (decode and rounds
        # padded to QUANT_ROWS), so that each GEMM is the same shape-chosen kernel in every
        # program and a row's result does not depend on which step computes it. That lets
        # the fp32 lm_head take inductor's CPU template (faster than the library sgemm)
        # while staying exact. Two rows, not k+1: the int kernels' cost grows with rows, so
        # padding every step to k+1 would slow decoding; the quantized fast path therefore
        # drafts one token per round, the best k on small CPUs anyway.
        # Unless every trunk GEMM, the lm_head's included, is one of mtpkit's int8 kernels:
        # those compute a row the same whatever rows come with it (QuantLinear.row_exact),
        # so steps keep their natural row counts (decode 1, a round k+1) and any k is exact.
        # (``mtpkit quantize --lm-head same`` writes such checkpoints.)
        self.row_exact = (bool(quantized) and row_exact_trunk(model)) or self.float_rows
        self.rows = QUANT_ROWS if quantized and not self.row_exact else None
        # Row-exact trunks also run q/k/v and gate/up as one int8 layer each (the same bits
        # as apart, see stack_outputs): 4 kernel calls a layer instead of 7, and one
        # activation quantization where W8A8 made three.
        self.fused = None
        self.lm_head = None  # the trunk's lm_head in a step's own form, where it has one
        if self.float_rows:
            self.fused = nn.ModuleList(nn.ModuleDict({
                name: RowExactLinear.of(getattr(part, name))
                for part, names in ((block.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                    (block.mlp, ("gate_proj", "up_proj", "down_proj")))
                for name in names}) for block in model.model.layers)
            self.lm_head = RowExactLinear.of(model.lm_head)
        elif self.row_exact:
            self.fused = nn.ModuleList(nn.ModuleDict({
                name: layer for name, layer in (
                    ("qkv", stack_outputs([block.self_attn.q_proj, block.self_attn.k_proj,
                                           block.self_attn.v_proj])),
                    ("gate_up", stack_outputs([block.mlp.gate_proj, block.mlp.up_proj])))
                if layer is not None}) for block in model.model.layers)
        # W8A8 layers on mtpkit's kernels run as fused ops (_w8a8_block).
        self.forms = forms = forms or W8A8Forms()
        fuse = forms.block
        layers = model.model.layers
        per_layer = self.fused if self.fused is not None else [None] * len(layers)
        self.w8a8_blocks = [fuse and w8a8_block_fits(block, f)
                            for block, f in zip(layers, per_layer, strict=True)]
        # A trunk of them, alike in norm epsilons, heads and MLP width, as one op.
        shapes = {(b.input_layernorm.eps, b.post_attention_layernorm.eps, b.self_attn.num_heads,
                   b.mlp.down_proj.in_features) for b in layers}
        # Not under an EAGLE-3 head: it reads states from inside the trunk, which the one op
        # does not give.
        self.eagle3 = is_eagle3(model.mtp)
        self.w8a8_trunk = (forms.trunk and len(layers) > 0 and all(self.w8a8_blocks)
                           and len(shapes) == 1 and not self.eagle3)
        # Whether every compiled trunk step runs as that one op (_w8a8_whole's conditions
        # that do not depend on a call), so that the steps can take the caches stacked
        # (FastDecoder.kv).
        emb = model.model.embed_tokens.weight
        self.stacked_caches = (self.w8a8_trunk and self.rowwise and forms.attn
                               and forms.layer and emb.device.type == "cpu"
                               and emb.dtype == torch.float32
                               and all(b.self_attn.q_norm is None for b in layers))
        # Rotary tables for the positions a decoder uses (set_positions): every step reads
        # them by index, so uncompiled and compiled programs rotate with the same bits
        # (computed in the graph, cos/sin came out of inductor's vector math a few ulps
        # away from torch's, and W8A8 trunks' int8 activations turned that into other
        # tokens).
        self.register_buffer("rope_cos", None)
        self.register_buffer("rope_sin", None)
        self.register_buffer("vocab", None)
        if self.eagle3:
            # Its own lm_head scores its own draft vocabulary (draft_logits), row j standing
            # for target token j + d2t[j]; a separately given vocabulary cannot apply.
            self.register_buffer("vocab", model.mtp.target_ids())
        elif model.mtp is not None and draft_vocab is not None and len(draft_vocab):
            dev = model.model.embed_tokens.weight.device
            self.register_buffer("vocab", draft_vocab.to(dev, torch.long))
            # The lm_head rows the draft scores, a layer of its own in the lm_head's form.
            self.draft_head = linear_rows(model.lm_head, self.vocab)
        # Quantized layers (the draft head's included) build their packed kernel forms on
        # first use; built here, before export traces the steps, they are the program's
        # constants rather than attributes assigned while tracing (which export warns
        # about, layer by layer).
        with torch.no_grad():
            for q in self.modules():
                if isinstance(q, QuantLinear):
                    q(torch.zeros(1, q.in_features, dtype=q.dtype, device=q.scale.device))

    def set_positions(self, n: int) -> None:
        """Tabulate the rotary cos/sin of positions 0..n-1 (steps must stay below n)."""
        if self.rope_cos is not None and len(self.rope_cos) >= n:
            return
        rot = self.model.rotary
        with torch.no_grad(), torch.inference_mode(False):
            cos, sin = rot.cos_sin(torch.arange(n, device=rot.inv_freq.device))
        self.rope_cos, self.rope_sin = cos.contiguous(), sin.contiguous()

    def _cos_sin(self, pos):
        if self.rope_cos is None:
            return self.model.rotary.cos_sin(pos)
        return self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)

    def trunk(self, ids, pos, kc, vc, span=None, rows: int | None = None):
        """Trunk states [1, T, D] of tokens [1, T] at pos: after the final norm, and the
        state the head reads (_head_state; before the final norm unless the head is EAGLE-3);
        attention reads the first len(span) cache slots (all without a span); ``rows``:
        attend that many leading rows one at a time (the rest are padding). kc, vc: a
        cache a layer, or each stacked in one tensor (FastDecoder.kv)."""
        m = self.model
        mask = position_mask(pos, _span(span, kc[0]), self.groups)
        cos, sin = self._cos_sin(pos)
        x = m.model.embed_tokens(ids)
        layers = m.model.layers
        aux_ids, aux = m.aux_layer_ids(), []
        if (self.w8a8_trunk and all(self.w8a8_blocks)
                and all(w8a8_whole(layer, x, kc[0], rows, self.forms) for layer in layers)):
            x = w8a8_trunk(layers, self.fused, x, cos, sin, kc, vc, pos, mask, rows)
            return m.model.norm(x), x
        if isinstance(kc, torch.Tensor) and (torch.compiler.is_compiling()
                                             or torch.compiler.is_exporting()):
            # Each layer would write a view of a compiled step's input: a copy of it all.
            raise RuntimeError("stacked caches compile only as one w8a8_trunk op")
        for i, layer in enumerate(layers):
            if i in aux_ids:
                aux.append(x)
            fused = None if self.fused is None else self.fused[i]
            if fused is not None and self.w8a8_blocks[i]:
                x = w8a8_block(layer, x, cos, sin, kc[i], vc[i], pos, mask, rows, fused,
                               self.forms)
            else:
                x = layer.forward_static(x, cos, sin, kc[i], vc[i], pos, mask, rows, fused)
        return m.model.norm(x), self._head_state(aux_ids, aux, x)

    def _head_state(self, aux_ids, aux, x):
        # The trunk's second output: its states before the final norm, or under an EAGLE-3
        # head the state the head's first step reads, fc over the states of the layers it
        # reads side by side (its chained steps read their own). Every caller that hands a
        # trunk state to the head takes this one (spec.trunk_hidden "aux" is not
        # "post_norm"), so the head's steps run as an MTP head's do.
        if not aux_ids:
            return x
        return self.model.mtp.fc(self.model.aux_states(aux_ids, aux, x))

    def head(self, ids, hidden, pos, hk, hv, span=None, zero_first: bool = False):
        """One head step over tokens t_{i+1} [1, T] and states h_i [1, T, D] at pos."""
        mtp = self.model.mtp
        cos, sin = self._cos_sin(pos)
        mask = position_mask(pos, _span(span, hk), self.groups)
        if self.eagle3:
            return self._eagle3_over(ids, hidden, lambda attn, qkv: attn.forward_static(
                None, cos, sin, hk, hv, pos, mask, qkv=qkv, project=False))
        x = self._head_input(ids, hidden, zero_first)
        x = mtp.layers[0].forward_static(x, cos, sin, hk, hv, pos, mask)
        return mtp.norm(x), x

    def _eagle3_over(self, ids, g, attend):
        # An EAGLE-3 head's step (models/eagle3.Eagle3Layer) over tokens ids [1, N] and
        # states g [1, N, D], its heads from attend(attn, qkv) -> (after, before the head's
        # final norm).
        mtp = self.model.mtp
        layer = mtp.layers[0]
        attn = layer.self_attn
        x = torch.cat([layer.input_layernorm(self.model.model.embed_tokens(ids)),
                       layer.hidden_norm(g)], dim=-1)
        r = g + attn.o_proj(attend(attn, attn.qkv(x)))
        r = r + layer.mlp(layer.post_attention_layernorm(r))
        return mtp.norm(r), r

    def _head_input(self, ids, hidden, zero_first: bool = False):
        # The head layer's input: the tokens' embeddings and the states, normed, through fc.
        m = self.model
        mtp = m.mtp
        emb = m.model.embed_tokens(ids)
        if zero_first:
            emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)
        e, h = mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden)
        return mtp.fc(torch.cat([e, h] if mtp.spec.emb_first else [h, e], dim=-1))

    def logits(self, post):
        """Full-vocabulary fp32 logits of trunk states (a step's greedy picks)."""
        return self.model.logits(post) if self.lm_head is None else self.lm_head(post).float()

    def draft_logits(self, state):
        """The head's fp32 logits [B, N] for states [B, D] (N: the draft vocabulary's size)."""
        if self.eagle3:
            return self.model.mtp.logits(state)
        return self.model.logits(state) if self.vocab is None else self.draft_head(state).float()

    def draft_pick(self, state):
        """Draft token (full-vocabulary id) [1] and its probability [1] for states [1, D]."""
        p, i = torch.softmax(self.draft_logits(state), -1).max(-1)
        # index_select, not vocab[i]: a tensor index stays inside a compiled graph.
        return (i if self.vocab is None else self.vocab.index_select(0, i)), p

    def chain(self, post, state, pos, hk, hv, k: int, span=None):
        """k drafts from the head state that predicts the first one: post [1, D] (read by
        the lm_head) and state [1, D] (fed on), first chained step at pos [1]
        -> drafts [k], their probabilities [k]."""
        chain_post = self.model.mtp.spec.chain_hidden == "post_norm"
        tok, p = self.draft_pick(post)
        drafts, ps = [tok], [p]
        for _ in range(k - 1):
            post, pre = self.head(tok.view(1, 1), state.view(1, 1, -1), pos, hk, hv, span)
            tok, p = self.draft_pick(post[:, 0])
            drafts.append(tok)
            ps.append(p)
            state = (post if chain_post else pre)[:, 0]
            pos = pos + 1
        return torch.cat(drafts), torch.cat(ps)

    # programs ----------------------------------------------------------------------------
    def decode(self, token, pos, kc, vc, span):
        """Plain greedy step: token [1, 1] at pos [1] -> the next token [1].

        Runs as two rows, the token and a copy of it at pos + 1, and keeps row 0: inductor
        (CPU, max-autotune) picks far better GEMM kernels for two rows than for one, so the
        two-row program is the faster one. The copy's cache slot pos + 1 is never read (row 0
        sees keys <= pos) and the next step writes its own token there first. Row-exact
        trunks (mtpkit's kernels, fp32 ones included) run one row: those kernels cost in
        proportion to rows, or stream the weights at the same speed whatever the rows.
        """
        r = self.rows or (1 if self.row_exact else 2)
        tokens = token.expand(1, r)
        post, _ = self.trunk(tokens, pos + torch.arange(r, device=pos.device), kc, vc, span,
                             1 if self.rowwise else None)
        return argmax_rows(self.logits(post[0]))[:1]  # all rows, as verify does

    def _pad(self, tokens):
        # Quantized trunks: pad a step to QUANT_ROWS rows with copies of its last token (their
        # cache slots lie past every position a real row reads, and are written before use).
        t = tokens.shape[1]
        if self.rows is None or t >= self.rows:
            return tokens
        return torch.cat([tokens, tokens[:, -1:].expand(1, self.rows - t)], dim=1)

    def verify(self, tokens, pos0, kc, vc, span):
        """Trunk over tokens [1, T] at pos0 [1].. -> the target's argmaxes [T]."""
        t = tokens.shape[1]
        padded = self._pad(tokens)
        pos = pos0 + torch.arange(padded.shape[1], device=tokens.device)
        post, _ = self.trunk(padded, pos, kc, vc, span, t if self.rowwise else None)
        return argmax_rows(self.logits(post[0]))[:t]

    def draft_step(self, token, state, pos, hk, hv, span):
        """One chained head step [1, 1] at pos [1] and its draft pick (cost tables)."""
        post, _ = self.head(token, state, pos, hk, hv, span)
        return self.draft_pick(post[:, 0])

    def round(self, tokens, pos0, kc, vc, hk, hv, span, k: int):
        """Greedy speculative round over tokens [1, T] = [pending, drafts] at pos0 [1].. ->
        (out [T + 1 + k]: target argmaxes, accept count n, next drafts; probs [k])."""
        t = tokens.shape[1]
        padded = self._pad(tokens)
        pos = pos0 + torch.arange(padded.shape[1], device=tokens.device)
        post, pre = self.trunk(padded, pos, kc, vc, span, t if self.rowwise else None)
        target = argmax_rows(self.logits(post[0]))[:t]  # [T]
        return self._round_head(tokens, pos0, post[:, :t], pre[:, :t], target, hk, hv, span, k)

    def _round_head(self, tokens, pos0, post, pre, target, hk, hv, span, k: int):
        # A round after its trunk pass: accept, catch the head up, draft the next k.
        t = tokens.shape[1]
        spec = self.model.mtp.spec
        pos = pos0 + torch.arange(t, device=tokens.device)
        n = _accepted(tokens, target)
        # Head catch-up over all T positions with the target's tokens; row n is what the
        # eager engine computes next round (later rows are overwritten before use).
        hidden = post if spec.trunk_hidden == "post_norm" else pre
        hpost, hpre = self.head(target[None], hidden, pos, hk, hv, span)
        chain_state = hpost if spec.chain_hidden == "post_norm" else hpre
        drafts, ps = self.chain(hpost[0].index_select(0, n), chain_state[0].index_select(0, n),
                                pos0 + n + 1, hk, hv, k, span)
        return torch.cat([target, n, drafts]), ps

    # several sequences at once (uncompiled): a server's step ---------------------------
    @property
    def batchable(self) -> bool:
        """Whether several sequences' steps can share one trunk pass with each row's bits
        those of its sequence alone: every GEMM row-exact, natural row counts."""
        layers = list(self.model.model.layers)
        if self.model.mtp is not None:
            layers += list(self.model.mtp.layers)
        return self.row_exact and not any(b.self_attn.output_gate for b in layers)

    # The batched passes keep every row on the row-exact kernels however many rows there
    # are (every_row_exact): a prompt's many rows may take torch's GEMM, a step's never.
    @every_row_exact()
    def trunk_rows(self, seqs):
        """The trunk over several sequences' rows in one pass: seqs = [(ids [1, T], pos [T],
        kc, vc, span)], each attending over its own caches, every GEMM and norm once over
        all rows -> [(post, pre)] a sequence. Row-exact kernels give each row the bits
        its sequence's own step gives (the fused W8A8 ops give those of the GEMMs apart)."""
        sizes = [ids.shape[1] for ids, *_ in seqs]
        x = self.model.model.embed_tokens(torch.cat([ids for ids, *_ in seqs], 1))
        pos = torch.cat([pos for _, pos, *_ in seqs])
        if _seqs_kernel_fits(x, seqs[0][2][0]):
            def attend(i, attn, qkv, cos, sin):
                return attn.attend_seqs(qkv, cos, sin, [kc[i] for _, _, kc, _, _ in seqs],
                                        [vc[i] for _, _, _, vc, _ in seqs], pos, sizes)
        else:
            # A call a sequence, each with its own rotary rows and mask.
            rope = [self._cos_sin(p) for _, p, *_ in seqs]
            masks = [position_mask(p, _span(span, kc[0]), self.groups)
                     for _, p, kc, _, span in seqs]

            def attend(i, attn, qkv, *_):
                return torch.cat([
                    attn.forward_static(None, cos, sin, kc[i], vc[i], p, mask, part.shape[1],
                                        qkv=part, project=False)
                    for (_, p, kc, vc, _), (cos, sin), mask, part
                    in zip(seqs, rope, masks, qkv.split(sizes, 1), strict=True)], 1)
        post, x = self._layers_over(x, pos, attend)
        return list(zip(post.split(sizes, 1), x.split(sizes, 1), strict=True))

    def _layers_over(self, x, pos, attend):
        # The trunk's layers over rows x [1, N, D] at positions pos [N], each layer's heads
        # from attend(i, attn, qkv, cos, sin) -> (after the final norm, _head_state).
        m = self.model
        cos, sin = self._cos_sin(pos)
        aux_ids, aux = m.aux_layer_ids(), []
        for i, layer in enumerate(m.model.layers):
            if i in aux_ids:
                aux.append(x)
            f = None if self.fused is None else self.fused[i]
            attn = layer.self_attn
            qkv = attn.qkv(layer.input_layernorm(x), f)
            x = x + swapped(f, "o_proj", attn.o_proj)(attend(i, attn, qkv, cos, sin))
            x = x + layer.mlp(layer.post_attention_layernorm(x), f)
        return m.model.norm(x), self._head_state(aux_ids, aux, x)

    @every_row_exact()
    def trunk_pool(self, ids, pos, slots, sizes, kpools, vpools, out):
        """trunk_rows over pooled caches: rows ids [1, N] at pos [N], sizes[b] of them
        sequence b's, whose caches are slot slots[b] of every layer's pools [S, Hkv, L, hd]
        -> (the target's argmax [M] and logits [M, V] of the rows out [M], the state the
        head reads [1, N, D]) as (argmax, state, logits). No shape depends on the batch, so
        one compiled program takes them all."""
        x = self.model.model.embed_tokens(ids)
        post, pre = self._layers_over(x, pos, lambda i, attn, qkv, cos, sin: attn.attend_pool(
            qkv, cos, sin, kpools[i], vpools[i], slots, sizes, pos))
        spec = self.model.mtp.spec if self.model.mtp is not None else None
        hidden = pre if spec is not None and spec.trunk_hidden != "post_norm" else post
        # A step needs every row's logits, a prompt only its last row's: the lm_head costs a
        # small model's prompt row about a fifth of what its layers do.
        logits = self.logits(post[0].index_select(0, out))
        return argmax_rows(logits), hidden, logits

    @every_row_exact()
    def head_pool(self, ids, states, pos, slots, sizes, hk, hv):
        """head_rows over pooled head caches hk, hv [S, Hkv, L, hd] -> (the state the draft
        is picked from, the state the next draft step reads) [1, N, D]."""
        post, pre = self._head_over(ids, states, pos, lambda attn, qkv, cos, sin: attn.attend_pool(
            qkv, cos, sin, hk, hv, slots, sizes, pos))
        return post, (post if self.model.mtp.spec.chain_hidden == "post_norm" else pre)

    def _head_over(self, ids, states, pos, attend):
        # The head's layer over rows ids [1, N], states [1, N, D] at positions pos [N], its
        # heads from attend(attn, qkv, cos, sin) -> (after, before the head's final norm).
        mtp = self.model.mtp
        cos, sin = self._cos_sin(pos)
        if self.eagle3:
            return self._eagle3_over(ids, states, lambda attn, qkv: attend(attn, qkv, cos, sin))
        x = self._head_input(ids, states)
        layer = mtp.layers[0]
        attn = layer.self_attn
        qkv = attn.qkv(layer.input_layernorm(x))
        x = x + attn.o_proj(attend(attn, qkv, cos, sin))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return mtp.norm(x), x

    @every_row_exact()
    def decode_many(self, items):
        """decode() of several sequences, items = [(token [1, 1], pos [1], kc, vc, span)]
        -> [next token [1]]."""
        states = self.trunk_rows(items)
        picks = argmax_rows(self.logits(torch.cat([p for p, _ in states], 1)[0]))
        return list(picks.split(1))

    @every_row_exact()
    def round_many(self, items, k: int, trunk=None, head=None, lean: bool = False):
        """round() of several sequences, items = [(tokens, pos0, kc, vc, hk, hv, span)],
        with one trunk pass and one head pass per draft step -> [(out, probs)].
        ``trunk(seqs)`` -> (the target's argmaxes [N], the head's input state a sequence)
        and ``head(seqs)`` -> [(draft state, chained state)] a sequence run the passes
        (default: trunk_rows and head_rows over the items' own caches). ``lean``: the
        trunk pass only, no drafting: k placeholder drafts of probability 0, which the
        next round verifies none of unless told to (any draft verified is exact; the
        head's cache keeps no entries for these positions, which can only cost the head
        some acceptance later)."""
        trunk = trunk or self._trunk_targets
        head = head or self._head_states
        dev = items[0][0].device
        poss = [pos0 + torch.arange(tokens.shape[1], device=dev)
                for tokens, pos0, *_ in items]
        seqs = [(tokens, pos, kc, vc, span)
                for (tokens, _, kc, vc, _, _, span), pos in zip(items, poss, strict=True)]
        targets, hidden = trunk(seqs)
        targets = targets.split([tokens.shape[1] for tokens, *_ in items])
        ns = [_accepted(tokens, target)
              for (tokens, *_), target in zip(items, targets, strict=True)]
        if lean:
            none = torch.zeros(k, device=dev)
            return [(torch.cat([target, n, target[-1:].expand(k)]), none)
                    for target, n in zip(targets, ns, strict=True)]
        # Head catch-up over every sequence's positions with its target tokens (round()).
        heads = head([(target[None], h, pos, hk, hv, span)
                      for target, h, pos, (_, _, _, _, hk, hv, span)
                      in zip(targets, hidden, poss, items, strict=True)])
        post = torch.cat([hp[0].index_select(0, n) for (hp, _), n in zip(heads, ns, strict=True)])
        state = torch.cat([hs[0].index_select(0, n) for (_, hs), n in zip(heads, ns, strict=True)])
        tok, p = self.draft_pick(post)  # [B] each
        drafts, ps = [tok], [p]
        pos = torch.cat([pos0 + n + 1 for (_, pos0, *_), n in zip(items, ns, strict=True)])
        for _ in range(k - 1):
            step = head([(tok[b].view(1, 1), state[b].view(1, 1, -1), pos[b:b + 1], hk, hv, span)
                         for b, (_, _, _, _, hk, hv, span) in enumerate(items)])
            post = torch.cat([hp[0] for hp, _ in step])
            state = torch.cat([hs[0] for _, hs in step])
            tok, p = self.draft_pick(post)
            drafts.append(tok)
            ps.append(p)
            pos = pos + 1
        drafts, ps = torch.stack(drafts, 1), torch.stack(ps, 1)  # [B, k]
        return [(torch.cat([target, n, drafts[b]]), ps[b])
                for b, (target, n) in enumerate(zip(targets, ns, strict=True))]

    def _trunk_targets(self, seqs):
        # round_many's default trunk pass: trunk_rows over the sequences' own caches.
        states = self.trunk_rows(seqs)
        targets = argmax_rows(self.logits(torch.cat([p for p, _ in states], 1)[0]))
        post_norm = self.model.mtp.spec.trunk_hidden == "post_norm"
        return targets, [post if post_norm else pre for post, pre in states]

    def _head_states(self, seqs):
        # round_many's default head pass: head_rows over the sequences' own head caches.
        chain_post = self.model.mtp.spec.chain_hidden == "post_norm"
        return [(hp, hp if chain_post else hq) for hp, hq in self.head_rows(seqs)]

    @every_row_exact()
    def head_rows(self, seqs):
        """The MTP head over several sequences' rows in one pass: seqs = [(ids [1, T],
        states [1, T, D], pos [T], hk, hv, span)], each attending over its own head cache
        -> [(post, pre)] a sequence."""
        sizes = [ids.shape[1] for ids, *_ in seqs]
        pos = torch.cat([pos for _, _, pos, *_ in seqs])
        if _seqs_kernel_fits(seqs[0][1], seqs[0][3]):
            def attend(attn, qkv, cos, sin):
                return attn.attend_seqs(qkv, cos, sin, [hk for *_, hk, _, _ in seqs],
                                        [hv for *_, hv, _ in seqs], pos, sizes)
        else:
            def attend(attn, qkv, *_):
                outs = []
                for (_, _, p, hk, hv, span), part in zip(seqs, qkv.split(sizes, 1),
                                                         strict=True):
                    cos, sin = self._cos_sin(p)
                    mask = position_mask(p, _span(span, hk), self.groups)
                    outs.append(attn.forward_static(None, cos, sin, hk, hv, p, mask,
                                                    part.shape[1], qkv=part, project=False))
                return torch.cat(outs, 1)
        post, x = self._head_over(torch.cat([ids for ids, *_ in seqs], 1),
                                  torch.cat([h for _, h, *_ in seqs], 1), pos, attend)
        return list(zip(post.split(sizes, 1), x.split(sizes, 1), strict=True))


class _Step(nn.Module):
    """One program as a module's forward (what torch.export takes)."""

    def __init__(self, programs: Programs, kind: str, k: int = 0) -> None:
        super().__init__()
        self.programs, self.kind, self.k = programs, kind, k

    def forward(self, *args):
        if self.kind == "round":
            return self.programs.round(*args, self.k)
        return getattr(self.programs, self.kind)(*args)


# -- compiled artefacts --------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where compiled programs persist: $MTPKIT_COMPILE_CACHE, else ~/.cache/mtpkit/compiled."""
    from ..envs import get

    own = get("MTPKIT_COMPILE_CACHE")
    if own is not None:
        return own
    from ..builtin import cache_dir

    return cache_dir() / "compiled"


def model_fingerprint(programs: Programs) -> str:
    """A digest of every weight (shape, dtype, float64 sum, a strided sample) and the config:
    compiled programs embed the weights, so a different model must never reuse them."""
    h = hashlib.sha256()
    h.update(json.dumps(programs.model.config.__dict__, sort_keys=True, default=str).encode())
    for name, t in list(programs.named_parameters()) + list(programs.named_buffers()):
        if name.rsplit(".", 1)[-1].startswith(FORM_PREFIX):
            continue  # a kernel's form of weights counted already (built lazily, or not)
        flat = t.detach().reshape(-1)
        if flat.is_floating_point():
            summary = [float(flat.sum(dtype=torch.float64))]
        else:
            summary = [int(flat.sum(dtype=torch.int64))]
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{summary}".encode())
        h.update(sample)
    # How a quantized layer computes is not all in its tensors: W8A8 and W8A16 copies of a
    # model hold the same int8 codes and scales, and must not share programs.
    for name, mod in programs.named_modules():
        if isinstance(mod, QuantLinear):
            h.update(f"{name}|{mod.extra_repr()}|{mod.dtype}|{mod.block}".encode())
    return h.hexdigest()[:24]


CONSTANTS_KEY = "mtpkit_constants"  # package metadata: "model" where it holds no weights

# Ops a weight passes through on its way to a GEMM without ceasing to be that weight.
_WEIGHT_VIEWS = {"t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze",
                 "squeeze", "_to_copy", "to", "clone", "contiguous", "detach", "alias",
                 "slice", "select", "type_as"}
_ATEN_GEMMS = {"mm", "addmm", "linear", "bmm", "baddbmm", "matmul", "_weight_int8pack_mm",
               "_weight_int4pack_mm_for_cpu"}


def _step_tensors(programs: Programs) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of programs by the path an exported _Step names it by
    (_Step.programs, then the module's own; shared ones under each name)."""
    named = dict(programs.named_parameters(prefix="programs", remove_duplicate=False))
    named.update(programs.named_buffers(prefix="programs", remove_duplicate=False))
    return named


def _runs_on_model_tensors(ep, programs: Programs) -> bool:
    """Whether an exported program can be built without its weights: every tensor it
    holds is a parameter or buffer of the model under the same name, and no aten GEMM
    takes one (inductor's CPU GEMMs want the prepacked copies freezing makes)."""
    named = _step_tensors(programs)
    if any(n not in named for n in (*ep.state_dict, *ep.constants)):
        return False
    weights = {spec.arg.name for spec in ep.graph_signature.input_specs
               if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        op = getattr(node.target, "_opname", None)
        takes = [a for a in node.args if isinstance(a, torch.fx.Node) and a.name in weights]
        if op in _ATEN_GEMMS and takes:
            return False
        if op in _WEIGHT_VIEWS and takes:
            weights.add(node.name)
    return True


def traced_sources(model) -> list[Path]:
    """The files a program of ``model`` is traced from: this file, the quantized linear,
    and the model modules (``mtpkit/models``) save the families this model is not built
    from (another family's file changes nothing it runs)."""
    from ..models.registry import FAMILIES

    root = Path(__file__).resolve().parent.parent
    families = {module for module, _ in FAMILIES.values()}
    own = {c.__module__.rsplit(".", 1)[-1] for cls in (type(model), type(model.config))
           for c in cls.__mro__}
    models = [f for f in sorted((root / "models").glob("*.py"))
              if f.stem not in families or f.stem in own]
    return [Path(__file__).resolve(), root / "quant" / "linear.py",
            root / "quant" / "w8a8_layer.py", *models]


def _source_digest(model) -> str:
    """A digest of the code a program is traced from (traced_sources) and the hand-written
    kernels; a change to any of them must not reuse a program built from the old code."""
    h = hashlib.sha256(kernel_source_digest().encode())
    for f in traced_sources(model):
        h.update(f.name.encode())
        h.update(_code_of(f.read_bytes()))
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _code_of(src: bytes) -> bytes:
    # A Python file's syntax tree without comments and layout, which change nothing a
    # program runs: an edit to a comment must not cost every user a rebuild (minutes).
    # Strings, docstrings included, stay in it. A file that does not parse is taken whole.
    # Cached by content: a program load asks for every traced file.
    import ast

    try:
        return hashlib.sha256(ast.dump(ast.parse(src)).encode()).digest()
    except (SyntaxError, ValueError):
        return src


def _build_key(fingerprint: str, kind: str, shapes: str, k: int, mode: str,
               forms: W8A8Forms, model) -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    parts = [
        fingerprint, kind, shapes, str(k), mode, forms.key(),
        torch.__version__, str(pick_vec_isa()),
        # GEMM templates are generated for the thread count in force at compile time.
        str(threads.limit()),
        _source_digest(model),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _inductor_configs(mode: str, rowwise: bool = False, low_precision: bool = False) -> dict:
    # Freezing folds the weights into the program; prepacking lays them out for inductor's
    # own CPU GEMM templates, which max-autotune measures against the library GEMMs.
    cfg = {"freezing": True, "cpp.weight_prepack": True,
           # Autotuning reports every choice on stderr; users see a progress note instead.
           "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    if low_precision and hasattr(torch._inductor.config, "emulate_precision_casts"):
        # bf16/fp16 models: inductor keeps a fused chain of ops in fp32 and rounds only
        # where a kernel ends, and where kernels end differs between the decode and round
        # programs (the round's head catch-up reads more of the trunk's values), so the
        # same row rounded differently in each and greedy MTP output left plain decoding's
        # (seen on a GPU with SmolLM2 in bf16, library GEMMs too). Rounding after every op,
        # as eager PyTorch does, makes them equal (identical across k) at no visible cost.
        cfg["emulate_precision_casts"] = True
    if mode == "max-autotune":
        cfg["max_autotune"] = True
    if rowwise:
        # Every trunk step has QUANT_ROWS rows (Programs.rows), and each GEMM takes the CPU
        # template when one applies (its blocking follows from the shape alone), else the
        # library kernel: no benchmark-driven choice, so a GEMM of the same shape is the
        # same kernel in every program. Autotuning between the two could pick differently
        # per program and break exactness (SmolLM2 w8a16, k=3, rows 2 and 4 mixed: 8/12
        # prompts identical; one row count with these settings: 12/12).
        cfg["max_autotune_gemm_backends"] = "CPP"
        cfg["autotune_fallback_to_aten"] = True
    return cfg


@dataclass
class CompileStats:
    """What building the programs cost so far."""

    seconds: float = 0.0  # wall time spent compiling or loading programs
    compiled: int = 0  # programs compiled in this process
    loaded: int = 0  # programs loaded from the cache


def dynamo_graphs() -> int:
    """Graphs torch.compile has produced in this process (each one a compilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class FastDecoder:
    """Greedy decoding, with or without MTP, through fixed-shape programs (module doc).

    ``max_len`` fixes the cache: prompt + max_tokens + 2k + 2 positions must fit.
    ``draft_p_min`` lets a round verify only the drafts before the first whose head
    probability falls below it (one program per verify length, built up front).
    ``forms`` picks how W8A8 layers run (default: the fastest; others to compare).
    """

    def __init__(
        self,
        model,
        draft_vocab: torch.Tensor | None = None,
        max_len: int = 1024,
        backend: str = "aoti",
        mode: str = "max-autotune",
        draft_p_min: float | None = None,
        cache_dir: str | Path | None = None,
        forms: W8A8Forms | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast path cannot run this model: {reason}")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.model = model
        if model.model.embed_tokens.weight.device.type == "cpu":
            # Whether mtpkit's kernels run here is answered once, outside any trace: the
            # programs ask it (argmax_rows), and its first answer reads the CPU's
            # capability, which dynamo cannot trace (a bf16 CPU model failed to compile).
            int8_mm_available()
        self.programs = Programs(model, draft_vocab, forms).eval()
        self.backend, self.mode = backend, mode
        self.draft_p_min = draft_p_min
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.stats = CompileStats()
        self._fingerprint: str | None = None
        self._used: set[Path] = set()  # program files this decoder loaded or built
        self._noted_depth = False
        self.device = model.model.embed_tokens.weight.device
        self.max_len = max(4, -(-max_len // SPAN_STEP)) * SPAN_STEP
        self.programs.set_positions(self.max_len + SPAN_STEP)
        self.slot: int | None = None  # this fork's slot in the pool (make_pool)
        self._pool: tuple | None = None
        self._alloc_caches()
        self._fns: dict[tuple, object] = {}
        # backend auto: programs running uncompiled because their file was not built yet
        # (key -> file), looked for again now and then (_adopt); shared with forks.
        self._pending: dict[tuple, Path] = {}
        self._looked = [0.0]
        self._spans: dict[int, torch.Tensor] = {}
        self._times: dict[tuple, float] = {}  # run_many's timings (shared by forks)
        self._counts: dict[tuple, int] = {}
        self._round_costs: dict[tuple, RoundCosts] = {}  # (k, sequences) -> round costs
        self._lean_costs: dict[tuple, RoundCosts] = {}  # the same, of rounds drafting nothing
        # The head's probabilities of the drafts of recent sequences in real rounds.
        self._draft_seen = DraftOdds(DRAFT_SEEN)
        # The same for sampled rounds: their costs, and how often a draft at each position
        # is accepted once those before it are.
        self._sample_costs: dict[tuple, RoundCosts] = {}
        self._sample_lean_costs: dict[tuple, RoundCosts] = {}
        self._sample_accept: list[list[float]] = []  # [hits, seen] a draft position

    @property
    def has_mtp(self) -> bool:
        """True when the model has a head to draft with."""
        return self.model.mtp is not None

    def _alloc_caches(self) -> None:
        # The decoder's own static caches (trunk and head), zeroed.
        model, cfg = self.model, self.model.config
        dtype = model.model.norm.weight.dtype
        max_len = self.max_len
        # One spare step beyond the longest span: a span as long as the buffer would make
        # the narrowed view the whole buffer, a case compilers specialize on.
        shape = (1, cfg.num_key_value_heads, max_len + SPAN_STEP, cfg.head_dim)

        def buf():
            # Normal tensors even when built in inference mode: export writes them outside it.
            with torch.inference_mode(False):
                return zeros(shape, dtype, self.device)

        # One tensor per layer, not one stacked tensor: a compiled step writes a whole
        # input tensor in place, where a view of a stacked buffer would be copied. Trunks
        # that run as one w8a8_trunk op are the exception: their steps take each cache list
        # as one tensor [layers, 1, Hkv, L, hd] that the op writes in place
        # (w8a8_trunk_kv): 2 inputs where there were 60 for SmolLM2, which halves an
        # AOTInductor call's own overhead; kc and vc are then views of those (for eager
        # calls: a compiled step given 60 views of one buffer ran far slower).
        # ``kv``: the caches as the compiled steps take them.
        # (Programs.stacked_caches: whether every compiled trunk step is that one op.)
        layers = len(model.model.layers)
        if self.programs.stacked_caches and dtype == torch.float32:
            with torch.inference_mode(False):
                kstack, vstack = (zeros((layers, *shape), dtype, self.device) for _ in range(2))
            self.kc, self.vc = list(kstack.unbind(0)), list(vstack.unbind(0))
            self.kv: tuple = (kstack, vstack)
        else:
            self.kc = [buf() for _ in range(layers)]
            self.vc = [buf() for _ in range(layers)]
            self.kv = (self.kc, self.vc)
        self.hk = self.hv = None
        if model.mtp is not None:
            self.hk, self.hv = buf(), buf()

    def fork(self, slot: int | None = None) -> FastDecoder:
        """A decoder with caches of its own that shares this one's programs (a server slot:
        sequences never share a cache, and every slot runs the same programs); ``slot``:
        its caches are that slot of the pool (make_pool), where there is one."""
        twin = copy.copy(self)
        if slot is None or self._pool is None:
            twin._alloc_caches()
            return twin
        kpools, vpools, hk, hv = self._pool
        if not 0 <= slot < kpools[0].shape[0]:
            raise ValueError(f"slot {slot} is outside the pool of {kpools[0].shape[0]}")
        twin.slot = slot
        twin.kc = [p[slot : slot + 1] for p in kpools]
        twin.vc = [p[slot : slot + 1] for p in vpools]
        twin.kv = (twin.kc, twin.vc)
        twin.hk = None if hk is None else hk[slot : slot + 1]
        twin.hv = None if hv is None else hv[slot : slot + 1]
        return twin

    @property
    def poolable(self) -> bool:
        """Whether batched steps can run on pooled caches (trunk_pool/head_pool): batchable
        programs on mtpkit's row kernels, caches one tensor a layer."""
        return (self.programs.batchable and not self.programs.stacked_caches
                and row_kernel_fits(self.kc[0], self.kc[0]))

    @property
    def pools_prompts(self) -> bool:
        """Whether prompts of at most POOL_MAX_ROWS tokens run through the pooled programs
        (_prefill): where the decoder pools, except torch.compile in process (--compile
        inductor), which does not build them; it keeps SDPA prompts, as the eager engine."""
        return self.poolable and self.backend != "inductor"

    @property
    def pools_prompt_heads(self) -> bool:
        """Whether the head catches up on such prompts through head_pool too (which has no
        zeroed first embedding: heads that zero it catch up eagerly)."""
        return (self.pools_prompts and self.has_mtp
                and not self.model.mtp.spec.zero_first_embedding)

    def make_pool(self, n: int) -> bool:
        """Allocate caches for n forks as slots of one tensor a layer (fork(slot)), so
        that a batched step of any of them is one program call (run_many); False (and
        nothing allocated) where the decoder cannot pool."""
        if not self.poolable:
            return False
        self._pool = self._pools(n)
        return True

    def _pools(self, n: int) -> tuple:
        # Zeroed pools [n, Hkv, L, hd] a layer (and the head's), as _alloc_caches' buffers.
        shape = (n, *self.kc[0].shape[1:])
        dtype, dev = self.kc[0].dtype, self.device
        with torch.inference_mode(False):
            def buf():
                return zeros(shape, dtype, dev)
            layers = len(self.kc)
            kpools = [buf() for _ in range(layers)]
            vpools = [buf() for _ in range(layers)]
            hk = hv = None
            if self.hk is not None:
                hk, hv = buf(), buf()
        return kpools, vpools, hk, hv

    # -- programs --------------------------------------------------------------------------
    def span(self, need: int) -> torch.Tensor:
        """The span argument for a step that reads cache slots 0..need-1: a tensor whose
        length, need rounded up to SPAN_STEP, is all that matters."""
        # At least two steps: export gives dimensions of size 0 and 1 special meaning.
        n = min(self.max_len, max(2, -(-need // SPAN_STEP)) * SPAN_STEP)
        sp = self._spans.get(n)
        if sp is None:
            # Always an inference tensor, whoever asks first (compiled guards check this).
            with torch.inference_mode():
                sp = self._spans[n] = torch.empty(n, dtype=torch.uint8, device=self.device)
        return sp

    def _example(self, kind: str, t: int) -> tuple:
        dev = self.device
        z = torch.zeros(1, dtype=torch.long, device=dev)
        if kind in POOL_KINDS:
            # Three rows of two sequences in a pool of four: sizes distinct from one
            # another, and none 0 or 1, which export would specialize on.
            kpools, vpools, hk, hv = self._pools(4)
            rows = (z.new_zeros(1, 3), torch.arange(3, device=dev),
                    torch.tensor([3, 1], device=dev), torch.tensor([2, 1], device=dev))
            if kind == "trunk_pool":
                # Five rows (three and two) of which four give logits: every size distinct.
                return (z.new_zeros(1, 5), torch.arange(5, device=dev),
                        torch.tensor([3, 1], device=dev), torch.tensor([3, 2], device=dev),
                        kpools, vpools, torch.tensor([0, 2, 3, 4], device=dev))
            state = torch.zeros(1, 3, self.model.config.hidden_size, device=dev,
                                dtype=self.kc[0].dtype)
            return (rows[0], state, *rows[1:], hk, hv)
        # An example span strictly inside its range, or export pins the length to it.
        span = self.span(2 * SPAN_STEP)
        if kind == "decode":
            return (z.view(1, 1), z, *self.kv, span)
        if kind == "verify":
            return (z.new_zeros(1, t), z, *self.kv, span)
        if kind == "draft_step":
            state = torch.zeros(1, 1, self.model.config.hidden_size, device=dev,
                                dtype=self.kc[0].dtype)
            return (z.view(1, 1), state, z, self.hk, self.hv, span)
        return (z.new_zeros(1, t), z, *self.kv, self.hk, self.hv, span)

    def _dynamic_shapes(self, example: tuple, kind: str = "") -> dict:
        if kind in POOL_KINDS:
            # Rows, sequences and pool slots all dynamic: one program for every batch, a
            # lone sequence's one-row step and a decoder's own caches (one slot) included.
            n = torch.export.Dim("rows", min=1, max=POOL_MAX_ROWS)
            b = torch.export.Dim("seqs", min=1, max=POOL_MAX_ROWS)
            sl = torch.export.Dim("slots", min=1, max=4096)
            if kind == "head_pool":  # ids, states, pos, slots, sizes, hk, hv
                return {"args": ({1: n}, {1: n}, {0: n}, {0: b}, {0: b}, {0: sl}, {0: sl})}
            layers = len(example[4])  # ids, pos, slots, sizes, kpools, vpools, out
            m = torch.export.Dim("out", min=1, max=POOL_MAX_ROWS)
            return {"args": ({1: n}, {0: n}, {0: b}, {0: b}, [{0: sl}] * layers,
                             [{0: sl}] * layers, {0: m})}
        # Everything static but the span's length, a multiple of SPAN_STEP.
        blocks = torch.export.Dim("span_blocks", min=2, max=self.max_len // SPAN_STEP)
        spec = []
        for a in example:
            if isinstance(a, list):
                spec.append([None] * len(a))
            else:
                spec.append(None)
        spec[-1] = {0: SPAN_STEP * blocks}
        return {"args": tuple(spec)}  # _Step.forward takes *args

    def program(self, kind: str, t: int = 1, k: int = 0):
        """The callable of one program (built, loaded or traced on first use)."""
        key = (kind, t, k)
        fn = self._fns.get(key)
        if self._pending and key in self._pending:
            fn = self._adopt(key) or fn
        if fn is None:
            t0 = time.perf_counter()
            with torch.inference_mode(False), torch.no_grad():
                fn = self._make(kind, t, k)
            self.stats.seconds += time.perf_counter() - t0
            self._fns[key] = fn
            # The model's and torch's ~300K objects live as long as the process; Python's
            # full collections, triggered by the few objects each step allocates, scanned
            # them all every few hundred steps, a measurable share of a small model's
            # step. Frozen, they are left out of every collection, as
            # serving engines do after loading (vLLM calls gc.freeze too).
            gc.freeze()
        return fn

    @property
    def pending(self) -> list[Path]:
        """Program files this decoder runs uncompiled until they are built (backend auto)."""
        return list(self._pending.values())

    def _adopt(self, key: tuple):
        # Load the programs built since the last look (by `mtpkit warmup`, e.g. the server's
        # background build), at most every ADOPT_EVERY_S: the look is a file-system call
        # per pending program, and a step is milliseconds.
        now = time.monotonic()
        if now - self._looked[0] < ADOPT_EVERY_S:
            return None
        self._looked[0] = now
        for kkey, path in list(self._pending.items()):
            if path.exists():
                try:
                    fn = self._load(path)
                except Exception as e:  # a corrupt file: keep the uncompiled program
                    log.warning("could not load %s (%s); running it uncompiled", path, e)
                else:
                    self._fns[kkey] = fn
                    log.info("loaded the compiled %s program (T=%d) built meanwhile",
                             kkey[0], kkey[1])
                del self._pending[kkey]
        return self._fns.get(key) if key not in self._pending else None

    def _make(self, kind: str, t: int, k: int):
        step = _Step(self.programs, kind, k)
        if self.backend == "auto":
            # The compiled program where `mtpkit warmup` (or an earlier --compile aoti run)
            # built it, else the same program uncompiled: no request waits on a build.
            path = self._aoti_path(kind, t, k)
            if path.exists():
                return self._load(path)
            self._pending[(kind, t, k)] = path
            return step
        if self.backend == "eager":
            return step
        # Built for the whole team (its key says so), whatever the load made it just now.
        with threads.full_team():
            if self.backend == "inductor":
                return self._torch_compile(step, kind, t)
            return self._aoti(step, kind, t, k, self._example(kind, t))

    def _configs(self) -> dict:
        low = self.kc[0].dtype in (torch.bfloat16, torch.float16)
        return _inductor_configs(self.mode, self.programs.rowwise, low)

    def _torch_compile(self, step, kind: str, t: int):
        from torch._inductor import config as inductor_config

        fn = torch.compile(step, dynamic=False, fullgraph=True)
        before = dynamo_graphs()
        # Dynamo reads the freezing flag while tracing, so it is set around the first call
        # (which compiles) rather than passed as a per-compile option. Generation runs in
        # inference mode, and guards compare dispatch keys: the first call must too. Every
        # program is one more cache entry of the same code object (_Step.forward), which
        # dynamo counts as a recompilation: a process that builds several decoders or
        # draft lengths passed its limit of 8 and failed (fullgraph). These are distinct
        # programs by design, so the limit is lifted for the compiling call only.
        with (inductor_config.patch(self._configs()),
              torch._dynamo.config.patch(recompile_limit=1 << 16),
              torch.inference_mode()):
            example = self._example(kind, t)
            torch._dynamo.mark_dynamic(example[-1], 0, min=2 * SPAN_STEP, max=self.max_len)
            fn(*example)
        self.stats.compiled += dynamo_graphs() - before
        return fn

    def _aoti_path(self, kind: str, t: int, k: int) -> Path:
        # Where the AOTInductor package of a program lives (its key in the name).
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.programs)
        # Which kernels the program calls (mtpkit's, through their C entry points, or
        # torch's); choosing also loads mtpkit's, which a program that calls them needs
        # before it is loaded.
        shapes = f"T={t},L={self.max_len},dtype={self.kc[0].dtype},int8={kernel_choice()}"
        key = _build_key(self._fingerprint, kind, shapes, k, self.mode, self.programs.forms,
                         self.model)
        return self.cache_dir / f"{kind}-{key}.pt2"

    def _load(self, path: Path):
        # A built program from the cache.
        try:
            os.utime(path)  # its mtime is its last use, which the cache cap prunes by
        except OSError:
            pass  # a read-only cache is still usable; it only loses that ordering
        self._used.add(path)
        self.stats.loaded += 1
        return self._open(path)

    def _open(self, path: Path):
        # A program file as a callable: where it was built without its weights (_aoti),
        # given the model's own tensors, kept alive by the program (user_managed: used in
        # place, not copied).
        compiled = torch._inductor.aoti_load_package(str(path))
        held = None
        if compiled.get_metadata().get(CONSTANTS_KEY) == "model":
            named = _step_tensors(self.programs)
            want = compiled.get_constant_fqns()
            missing = [n for n in want if n not in named]
            if missing:
                raise RuntimeError(f"{path.name} needs {missing[0]}, which this model does "
                                   "not hold; remove it (mtpkit cache clear) and rebuild")
            held = {n: named[n] for n in want}
            compiled.load_constants(held, check_full_update=True, user_managed=True)
        return _Loaded(compiled, held)

    def _aoti(self, step, kind: str, t: int, k: int, example):
        path = self._aoti_path(kind, t, k)
        if not path.exists():
            import sys

            from ..cachecmd import compiled_cap_bytes, prune_compiled

            cap = compiled_cap_bytes()  # a malformed setting fails before the build
            print(f"note: compiling the {kind} program (T={t}, first run only, 1.5-4 min "
                  f"on 2 cores) into {path.parent}", file=sys.stderr)
            path.parent.mkdir(parents=True, exist_ok=True)
            ep = torch.export.export(step, example, strict=False,
                                     dynamic_shapes=self._dynamic_shapes(example, kind))
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:
                configs = self._configs()
                configs["aot_inductor.custom_ops_to_c_shims"] = aoti_c_shims()
                if _runs_on_model_tensors(ep, self.programs):
                    # The package holds no weights: _load gives it the model's. Freezing
                    # would fold them into constants of its own, and buys nothing where
                    # mtpkit's kernels take them as they are.
                    configs.update({"freezing": False,
                                    "aot_inductor.package_constants_in_so": False,
                                    "aot_inductor.metadata": {CONSTANTS_KEY: "model"}})
                torch._inductor.aoti_compile_and_package(ep, package_path=tmp,
                                                         inductor_configs=configs)
                os.replace(tmp, path)  # atomic: a concurrent run sees all or nothing
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self.stats.compiled += 1
            self._used.add(path)
            prune_compiled(path.parent, cap, keep=self._used)
            return self._open(path)
        return self._load(path)

    def _lengths(self, k: int) -> list[int]:
        # Verify lengths a request with draft depth k may use.
        if k == 0:
            return [1]
        return list(range(1, k + 2)) if self.draft_p_min is not None else [k + 1]

    def _deepest(self) -> int | None:
        rows = self.programs.rows
        return None if rows is None or not self.has_mtp else rows - 1

    def check_draft(self, k: int) -> None:
        """Raise ValueError when this decoder cannot draft k tokens per round exactly."""
        deepest = self._deepest()
        if deepest is not None and k > deepest:
            raise ValueError(
                f"on quantized trunks the compiled path drafts at most {deepest} token(s) per "
                f"round (every step shares one {deepest + 1}-row shape, which keeps MTP "
                f"lossless); use -k {deepest} or less, drop --compile, or quantize the "
                "lm_head too (int8: `mtpkit quantize --lm-head same`), which lifts the limit")

    def served_k(self, k: int) -> int:
        """The draft depth a request asking for k gets: k, or the deepest this decoder drafts
        exactly (said once on stderr)."""
        deepest = self._deepest()
        if deepest is None or k <= deepest:
            return k
        if not self._noted_depth:
            import sys

            print(f"note: on quantized trunks the compiled path drafts {deepest} token(s) per "
                  f"round (one step shape keeps MTP lossless); -k {k} runs as -k {deepest}",
                  file=sys.stderr)
            self._noted_depth = True
        return deepest

    def warmup(self, k: int) -> float:
        """Build or load every program a request with draft depth k uses; seconds taken."""
        t0 = time.perf_counter()
        k = self.served_k(k) if self.has_mtp else 0
        for t in self._lengths(k):
            if k == 0:
                self.program("decode")
            else:
                self.program("round", t, k)
        if self.pools_prompts:  # short prompts run through them (_prefill)
            self.program("trunk_pool")
            if k and self.pools_prompt_heads:
                self.program("head_pool")
        return time.perf_counter() - t0

    def warmup_for(self, params: SamplingParams | None, k: int) -> float:
        """warmup(k) for a greedy request (params None or greedy), warmup_pooled() for a
        sampled one (its steps run the pool programs); seconds taken."""
        if params is None or params.greedy:
            return self.warmup(k)
        return self.warmup_pooled()

    def warmup_pooled(self) -> float:
        """Build or load the programs of batched steps over pooled caches (a server's);
        seconds taken (nothing where the decoder cannot pool)."""
        t0 = time.perf_counter()
        if self.poolable:
            self.program("trunk_pool")
            if self.has_mtp:
                self.program("head_pool")
        return time.perf_counter() - t0

    # -- generation ------------------------------------------------------------------------
    @staticmethod
    def _positions(prompt_len: int, max_tokens: int, k: int) -> int:
        # Cache positions a request may write: its tokens and the draft window past them.
        return prompt_len + max_tokens + 2 * k + 2

    def fits(self, prompt_len: int, max_tokens: int, k: int) -> bool:
        """Whether a request fits the static cache."""
        return self._positions(prompt_len, max_tokens, k) <= self.max_len

    def check_length(self, prompt_len: int, max_tokens: int, k: int) -> None:
        """Raise ValueError when a request does not fit the static cache."""
        if not self.fits(prompt_len, max_tokens, k):
            need = self._positions(prompt_len, max_tokens, k)
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) and the draft "
                f"window need {need} cache positions; the compiled cache holds "
                f"{self.max_len} (raise --max-model-len)"
            )

    def _prefill(self, prompt_ids: list[int], k: int, chunk: int | None = None,
                 sampler: _Sampler | None = None):
        """Run the prompt (any length), ``chunk`` positions at a time, yielding
        between pieces; returns the first token [1] and, with k, the first drafts and
        their probabilities (greedy: of each draft [k]; ``sampler``: the distributions the
        drafts were drawn from [k, V])."""
        pr, dev, n = self.programs, self.device, len(prompt_ids)
        ids = torch.tensor([prompt_ids], device=dev)
        pos = torch.arange(n, device=dev)
        chunk = chunk or n
        pieces = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
        spec = self.model.mtp.spec if k else None
        # A prompt of at most POOL_MAX_ROWS tokens runs through the pooled programs (the
        # server's batched steps), compiled where they are built: a short prompt's eager pass
        # spent more time dispatching ops than computing. Its rows then attend one at a time
        # (the row kernel), so its bits do not depend on how it is cut into pieces; which
        # way a prompt goes depends on its length alone, the same in every fast path (CLI
        # and server). Longer prompts keep torch's SDPA, the faster there.
        pooled = self.pools_prompts and n <= POOL_MAX_ROWS
        pools, slots = self._pools_of(self.slot, self.kc, self.vc, self.hk, self.hv)
        keep = []  # the states the head catch-up reads, piece by piece
        for i, (s, e) in enumerate(pieces):
            if i:
                yield
            if pooled:
                _, hidden, logits = self.program("trunk_pool")(
                    ids[:, s:e], pos[s:e], slots, torch.tensor([e - s], device=dev), *pools[:2],
                    torch.tensor([e - s - 1], device=dev))
                keep.append(hidden)
                continue
            # Attend over the slots in use, not the whole buffer: a short prompt against a
            # long cache would spend most of its time on masked keys.
            post, pre = pr.trunk(ids[:, s:e], pos[s:e], self.kc, self.vc, self.span(e))
            if spec is not None:
                keep.append(post if spec.trunk_hidden == "post_norm" else pre)
        last = logits if pooled else pr.model.logits(post[:, -1])
        first = last.argmax(-1) if sampler is None else sampler.pick(last[0])
        if not k:
            return first, (None if sampler is None else drafts_none(dev)), None
        hidden = torch.cat(keep, 1)
        head_ids = torch.cat([ids[:, 1:], first[None]], 1)
        head_pooled = pooled and self.pools_prompt_heads
        for s, e in pieces:
            if len(pieces) > 1:
                yield
            if head_pooled:
                hpost, state = self.program("head_pool")(
                    head_ids[:, s:e], hidden[:, s:e], pos[s:e], slots,
                    torch.tensor([e - s], device=dev), *pools[2:])
                continue
            hpost, hpre = pr.head(head_ids[:, s:e], hidden[:, s:e], pos[s:e], self.hk, self.hv,
                                  self.span(e), zero_first=spec.zero_first_embedding and s == 0)
            state = hpost if spec.chain_hidden == "post_norm" else hpre
        at = torch.tensor([n], device=dev)
        if sampler is not None:
            if not sampler.draws(k):
                return first, drafts_none(dev), None
            drafts, qs = self._draw_chain([sampler], hpost[0, -1:], state[0, -1:], at, k,
                                          slots, pools[2:])
            return first, drafts[0], qs[0]
        drafts, ps = pr.chain(hpost[0, -1:], state[0, -1:], at, self.hk, self.hv, k,
                              self.span(n + k))
        return first, drafts, ps

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], k: int):
        """Run the prompt in one piece; first token [1] and, with k, first drafts."""
        gen = self._prefill(prompt_ids, k)
        try:
            while True:
                next(gen)
        except StopIteration as done:
            return done.value

    def generate(self, prompt_ids: list[int], max_tokens: int, k: int = 0, result=None,
                 eos_ids: set[int] | None = None,
                 params: SamplingParams | None = None) -> Iterator[int]:
        """Tokens after ``prompt_ids``, greedy unless ``params`` samples; ``result``
        (engine.generate.Result) receives finish reason and metrics as the eager engine
        fills them."""
        steps = self.steps(prompt_ids, max_tokens, k, result, eos_ids, params=params)
        return self._drive(steps)

    def _drive(self, steps) -> Iterator[int]:
        # Run a generation's program calls one by one, yielding its tokens.
        item = next(steps, None)
        while item is not None:
            if isinstance(item, Step):
                item = steps.send(self.run(item))
                continue
            if item is not PIECE:
                yield from item
            item = next(steps, None)

    @torch.inference_mode()
    def run(self, step: Step):
        """One program call a generation asked for."""
        if step.kind == "sample":
            return self._sample_many([step], step.k)[0]
        return self.program(step.kind, step.t, step.k)(*step.args)

    @torch.inference_mode()
    def run_many(self, steps: list[Step]) -> list:
        """Program calls of several generations (forks of this decoder) at once: decode
        steps together and rounds of one draft depth together, each group either one trunk
        pass (Programs.decode_many / round_many, uncompiled) or a program call each, which
        ever has been the faster here (timed as they run; every way gives the same bits)."""
        out: list = [None] * len(steps)
        groups: dict[tuple, list[int]] = {}
        for i, st in enumerate(steps):
            groups.setdefault((st.kind, st.k), []).append(i)
        pr = self.programs
        for (kind, k), idx in groups.items():
            n = len(idx)
            if kind == "sample":
                # Pooled programs whatever the batch: one call for all is never the slower.
                # Requests without a seed draft nothing where drafting does not pay (a
                # seeded one keeps the draws of its lone run, and so its text).
                # (Drafts drawn before are still verified: that is what measures how often
                # they are accepted.)
                lean = k > 0 and n > 1 and self._lean(k, n, sampled=True)
                group = [steps[i] for i in idx]
                for st in group:
                    st.sampler.lean = lean and st.sampler.params.seed is None
                threads.tick()
                t0 = time.perf_counter()
                got = self._sample_many(group, k)
                seconds = time.perf_counter() - t0
                if k:
                    drew = any(len(d) for _, _, d, _ in got)
                    rows = sum(st.t for st in group)
                    # Drafting rounds draw; lean ones neither draw nor verify (a trunk pass).
                    # A round that only verifies what an exploring round drew is neither.
                    costs = (self._sample_costs if drew
                             else self._sample_lean_costs if rows == n else None)
                    if costs is not None:
                        costs.setdefault((k, n), RoundCosts()).record(rows, seconds)
                for i, g in zip(idx, got, strict=True):
                    out[i] = g
                continue
            group = [steps[i] for i in idx]
            pooled = (self._pool is not None and all(st.slot is not None for st in group)
                      and sum(st.t for st in group) <= POOL_MAX_ROWS)
            # Pooled forks batch through compiled pool programs, which read the weights once
            # for all: never slower than a program call each, so that way is not tried (a
            # try costs several batched steps).
            if n == 1 or not pr.batchable or not (pooled or self._batch_pays(kind, k, n)):
                t0 = time.perf_counter()
                for i in idx:
                    out[i] = self.run(steps[i])
                self._timed((kind, k, 1), (time.perf_counter() - t0) / n)
                continue
            threads.tick()
            t0 = time.perf_counter()
            if kind == "decode":
                if pooled:
                    got = list(self._decode_pooled(group, [st.args for st in group]).split(1))
                else:
                    got = pr.decode_many([st.args for st in group])
                self._timed((kind, k, n), time.perf_counter() - t0)
            else:
                take = self._drafts_to_verify(group, k)
                # Fewer rows verified: the pending token and the drafts chosen.
                args = [(st.args[0][:, : c + 1], *st.args[1:])
                        for st, c in zip(group, take, strict=True)]
                self._note_probs(group)
                lean = self._lean(k, n)
                if lean and not any(take):
                    # Nothing verified, nothing drafted: a decode step each (one pass).
                    got = self._lean_round(group, args, k, pooled)
                else:
                    passes = self._pooled_passes(group) if pooled else {}
                    got = pr.round_many(args, k, lean=lean, **passes)
                seconds = time.perf_counter() - t0
                self._timed((kind, k, n), seconds)
                costs = self._lean_costs if lean else self._round_costs
                costs.setdefault((k, n), RoundCosts()).record(n + sum(take), seconds)
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out

    def _decode_pooled(self, group: list[Step], args: list) -> torch.Tensor:
        # One-token steps of pooled forks as one trunk_pool call, args = [(token [1, 1],
        # pos [1], ...)] a step -> the next tokens [n].
        ids = torch.cat([a[0] for a in args], 1)
        pos = torch.cat([a[1] for a in args])
        slots = torch.tensor([st.slot for st in group], device=self.device)
        kpools, vpools, _, _ = self._pool
        every = torch.arange(len(group), device=self.device)
        targets, _, _ = self.program("trunk_pool")(ids, pos, slots, torch.ones_like(slots),
                                                   kpools, vpools, every)
        return targets

    def _pooled_passes(self, group: list[Step]) -> dict:
        # round_many's trunk and head passes for pooled forks: one trunk_pool call and one
        # head_pool call a pass, whatever the batch (each sequence's caches are its slot).
        slots = torch.tensor([st.slot for st in group], device=self.device)
        kpools, vpools, hk, hv = self._pool
        trunk_fn, head_fn = self.program("trunk_pool"), self.program("head_pool")

        def sizes_of(seqs):
            sizes = [ids.shape[1] for ids, *_ in seqs]
            return sizes, torch.tensor(sizes, device=self.device)

        def trunk(seqs):
            sizes, st = sizes_of(seqs)
            targets, hidden, _ = trunk_fn(torch.cat([ids for ids, *_ in seqs], 1),
                                          torch.cat([pos for _, pos, *_ in seqs]), slots, st,
                                          kpools, vpools,
                                          torch.arange(sum(sizes), device=self.device))
            return targets, list(hidden.split(sizes, 1))

        def head(seqs):
            sizes, st = sizes_of(seqs)
            post, chain = head_fn(torch.cat([ids for ids, *_ in seqs], 1),
                                  torch.cat([h for _, h, *_ in seqs], 1),
                                  torch.cat([pos for _, _, pos, *_ in seqs]), slots, st, hk, hv)
            return list(zip(post.split(sizes, 1), chain.split(sizes, 1), strict=True))

        return {"trunk": trunk, "head": head}

    def _pools_of(self, slot: int | None, kc, vc, hk, hv) -> tuple:
        # The pools a generation's pooled programs take and its slot there [1]: the
        # decoder's pool where the generation has a slot in it, else its own caches
        # (kc, vc, hk, hv), a pool of one.
        if slot is not None and self._pool is not None:
            return self._pool, torch.tensor([slot], device=self.device)
        return (kc, vc, hk, hv), torch.zeros(1, dtype=torch.long, device=self.device)

    def _sample_many(self, group: list[Step], k: int) -> list:
        """Sampled rounds of several generations: one trunk_pool call verifies every
        sequence's drafts, each accepts by the lossless rule (engine/accept.py) with its own
        settings and random stream, then one head_pool call a draft step catches every head
        up and chains k new drafts -> [(emitted tokens, drafts verified, next drafts [k],
        their q [k, V])]."""
        pooled = self._pool is not None and all(st.slot is not None for st in group)
        if len(group) > 1 and not pooled:
            return [self._sample_many([st], k)[0] for st in group]
        dev = self.device
        if pooled:
            (kpools, vpools, hk, hv) = self._pool
            slots = torch.tensor([st.slot for st in group], device=dev)
        else:
            (kpools, vpools, hk, hv), slots = self._pools_of(None, *group[0].args[2:])
        tokens = [st.args[0] for st in group]
        sizes = [t.shape[1] for t in tokens]
        pos0 = [st.args[1] for st in group]
        pos = torch.cat([p + torch.arange(n, device=dev) for p, n in zip(pos0, sizes, strict=True)])
        _, hidden, logits = self.program("trunk_pool")(
            torch.cat(tokens, 1), pos, slots, torch.tensor(sizes, device=dev), kpools, vpools,
            torch.arange(len(pos), device=dev))
        emitted = []
        chance = self._sample_accept
        for st, rows, tok in zip(group, logits.split(sizes), tokens, strict=True):
            sm = st.sampler
            drafts = tok[0, 1:].tolist()
            n, nxt = accept_sampled(drafts, st.probs, probs(rows, sm.params), sm.gen)
            emitted.append([*drafts[:n], nxt])
            sm.left -= n + 1
            # Each position's acceptance given the ones before it (observed up to the first
            # rejection), counted with a decay that keeps about the last hundred.
            for j in range(min(n + 1, len(drafts))):
                if j == len(chance):
                    chance.append([0.0, 0.0])
                hits, seen = chance[j]
                chance[j] = [0.99 * hits + (j < n), 0.99 * seen + 1]
        verified = [n - 1 for n in sizes]
        if not k:
            return [(e, v, drafts_none(dev), None) for e, v in zip(emitted, verified,
                                                                  strict=True)]
        # Head catch-up on every accepted position with its true token: the accepted drafts
        # and the token drawn after them (rows 0..n of the trunk's states). A sequence that
        # draws nothing this round (lean) keeps them for its next catch-up: its head cache
        # then misses no position once it drafts again, at the cost of one head pass then.
        drafts: list = [drafts_none(dev)] * len(group)
        qs: list = [None] * len(group)
        catch = []  # (index in group, token ids, states [1, r, D], first position)
        for b, (st, h, g, p) in enumerate(zip(group, hidden.split(sizes, 1), emitted, pos0,
                                              strict=True)):
            sm = st.sampler
            sm.behind(g, h[:, : len(g)], int(p))
            if sm.draws(k):
                catch.append((b, *sm.catch_up()))
        if not catch:
            return list(zip(emitted, verified, drafts, qs, strict=True))
        sel = torch.tensor([b for b, *_ in catch], device=dev)
        sub = slots.index_select(0, sel) if len(slots) > 1 else slots
        post, chain = self._catch_up(catch, sub, hk, hv)
        nxt = torch.tensor([f + len(ids) for _, ids, _, f in catch], device=dev)
        got, got_q = self._draw_chain([group[b].sampler for b, *_ in catch], post, chain,
                                      nxt, k, sub, (hk, hv))
        for (b, *_), d, q in zip(catch, got, got_q, strict=True):
            drafts[b], qs[b] = d, q
        return list(zip(emitted, verified, drafts, qs, strict=True))

    def _catch_up(self, catch: list[tuple], slots, hk, hv) -> tuple:
        """The head over each sequence's rows catch = [(_, token ids, states [1, r, D],
        first position)] (slots: theirs), in head_pool calls of at most POOL_MAX_ROWS rows
        (a sequence's rows in order, a piece a call) -> its state after the last row: the
        one the first draft is drawn from and the one fed on [B, D]."""
        dev = self.device
        piece = max(1, POOL_MAX_ROWS // len(catch))
        post = [None] * len(catch)
        chain = [None] * len(catch)
        start = 0
        while True:
            part = [(i, ids[start : start + piece], states[:, start : start + piece],
                     first + start) for i, (_, ids, states, first) in enumerate(catch)
                    if start < len(ids)]
            if not part:
                break
            sizes = [len(ids) for _, ids, _, _ in part]
            p, c = self.program("head_pool")(
                torch.tensor([[t for _, ids, _, _ in part for t in ids]], device=dev),
                torch.cat([st for _, _, st, _ in part], 1),
                torch.cat([torch.arange(f, f + n, device=dev)
                           for (_, _, _, f), n in zip(part, sizes, strict=True)]),
                slots.index_select(0, torch.tensor([i for i, *_ in part], device=dev)),
                torch.tensor(sizes, device=dev), hk, hv)
            last = torch.tensor(sizes, device=dev).cumsum(0) - 1
            for (i, *_), row in zip(part, last.tolist(), strict=True):
                post[i], chain[i] = p[0, row], c[0, row]
            start += piece
        return torch.stack(post), torch.stack(chain)

    def _draw_chain(self, samplers: list[_Sampler], post, state, pos, k: int, slots,
                    head_cache: tuple) -> tuple[list, list]:
        """Up to k sampled drafts a sequence (_Sampler.draws) from head states post, state
        [B, D] (the first draft's and the state fed on) at positions pos [B], each further
        draft one head_pool call for all -> (drafts [k_b] a sequence, their q [k_b, V])."""
        pr = self.programs
        vocab_size = self.model.config.vocab_size
        ones = torch.ones(len(samplers), dtype=torch.long, device=self.device)
        want = [sm.draws(k) for sm in samplers]
        drafts: list[list[int]] = [[] for _ in samplers]
        qs: list[list[torch.Tensor]] = [[] for _ in samplers]
        for step in range(max(want)):
            if step:
                # (a sequence that drafts no further rides along: its head cache's entries
                # past its drafts are overwritten before they are read)
                tok = torch.tensor([[d[-1] if d else 0 for d in drafts]], device=self.device)
                p, c = self.program("head_pool")(tok, state[None], pos, slots, ones,
                                                 *head_cache)
                post, state = p[0], c[0]
                pos = pos + 1
            logits = pr.draft_logits(post)
            for b, sm in enumerate(samplers):
                if step < want[b]:
                    token, q = draw_draft(logits[b], sm.params, sm.gen, pr.vocab, vocab_size)
                    drafts[b].append(token)
                    qs[b].append(q)
        return ([torch.tensor(d, dtype=torch.long, device=self.device) for d in drafts],
                [torch.stack(q) if q else None for q in qs])

    def _lean_round(self, group: list[Step], args: list, k: int, pooled: bool) -> list:
        # Rounds of one row each (the pending token) that draft nothing, as decode steps:
        # round_many(lean=True)'s results without its bookkeeping. Built for all sequences
        # in a few tensor ops (a few a sequence made a lean round cost clearly more than the
        # decode step it runs, and the lean regime is where that matters).
        if pooled:
            targets = self._decode_pooled(group, args)
        else:
            targets = torch.cat(self.programs.decode_many([(a[0], a[1], a[2], a[3], a[6])
                                                           for a in args]))
        t = targets[:, None]
        out = torch.cat([t, torch.zeros_like(t), t.expand(-1, k)], 1)
        none = torch.zeros(k, device=self.device)
        return [(row, none) for row in out.unbind(0)]

    def _note_probs(self, group: list[Step]) -> None:
        # The head's probabilities of the drafts of real rounds (a lean round's placeholders
        # have probability 0), the most recent kept.
        for st in group:
            if _drafted(st.probs):
                self._draft_seen.add(st.probs.tolist())

    def _lean(self, k: int, n: int, sampled: bool = False) -> bool:
        # Whether this batched round drafts nothing (engine/budget.py: drafting_pays). At a
        # batch size where the head's drafts cost more than their accepted tokens bring,
        # MTP would make the server slower than no MTP: its rounds then run the trunk only.
        # Drafting rounds that verify drafts are measured first, then a lean one; then the
        # measured costs decide, except every EXPLORE-th round, which takes the other way
        # to keep both costs current (and the head's probabilities known). A cost not
        # measured lately is forgotten (RoundCosts) and measured again the same way.
        # ``sampled``: of sampled rounds, whose costs are kept apart and whose chance of
        # acceptance is the counted one (with one hit and one miss of prior), not the
        # head's probabilities.
        if sampled:
            full, lean = self._sample_costs.get((k, n)), self._sample_lean_costs.get((k, n))
            chance = [(h + 1) / (s + 2) for h, s in self._sample_accept][:k]
            have_odds = bool(chance)

            def pays_at(cost, lean_seconds):
                return drafting_pays([chance], n, cost, lean_seconds)
        else:
            full, lean = self._round_costs.get((k, n)), self._lean_costs.get((k, n))
            have_odds = self._draft_seen.sequences > 0

            def pays_at(cost, lean_seconds):
                return self._draft_seen.pays(n, cost, lean_seconds)
        if (full is None or not have_odds
                or not any(n < r <= n * (k + 1) for r in full.fresh())):
            return False
        lean_seconds = None if lean is None else lean.estimate(n)
        if lean_seconds is None:
            return True
        pays = pays_at(full.estimate, lean_seconds)
        return pays if (full.turns + lean.turns) % (4 * EXPLORE) == 0 else not pays

    def _drafts_to_verify(self, group: list[Step], k: int) -> list[int]:
        # How many of its drafts each sequence of a batched round verifies (engine/budget.py):
        # all of them, then none, until both costs are measured at this batch size; then
        # what the costs and the head's probabilities say pays, except every EXPLORE-th
        # round, which measures one row count again in turn (the machine's speed moves, and
        # counts never chosen would stay unknown).
        full = [st.args[0].shape[1] - 1 for st in group]
        n, most = len(group), sum(full)
        if not any(_drafted(st.probs) for st in group):
            return [0] * n  # a lean round's placeholders (or no drafts): nothing to gain
        costs = self._round_costs.setdefault((k, n), RoundCosts())
        if not costs.known(n + most):
            return full
        if not costs.known(n):
            return [0] * n
        probs = [[] if st.probs is None else st.probs.tolist() for st in group]
        if costs.turns % EXPLORE == 0:
            return top_drafts(probs, costs.turns // EXPLORE % (most + 1))
        return choose_drafts(probs, costs.estimate)

    def _timed(self, key: tuple, seconds: float) -> None:
        # A moving average of what a call took (key: kind, k, sequences; 1 = one program).
        old = self._times.get(key)
        self._times[key] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self._counts[key] = self._counts.get(key, 0) + 1

    def _batch_pays(self, kind: str, k: int, n: int) -> bool:
        # One pass for n sequences against n program calls: batched passes run uncompiled,
        # so where compiled programs are loaded a call each can be the faster. Each way is
        # tried a few times before the averages decide, and the slower one again now and
        # then, since the machine's speed moves.
        single, batch = (kind, k, 1), (kind, k, n)
        for key in (batch, single):
            if self._counts.get(key, 0) < 3:
                return key == batch
        turn = self._counts[single] + self._counts[batch]
        prefer = self._times[batch] <= n * self._times[single]
        return prefer if turn % 50 else not prefer

    @property
    def samples(self) -> bool:
        """Whether sampled requests can take this decoder: their steps run the pooled
        programs (a lone decoder's own caches are a pool of one)."""
        return self.poolable

    def steps(self, prompt_ids: list[int], max_tokens: int, k: int = 0, result=None,
              eos_ids: set[int] | None = None, chunk: int | None = None,
              params: SamplingParams | None = None):
        """generate() a step at a time. Each next() or send() gives one of: a list of the
        tokens just emitted; PIECE, after a ``chunk``-position piece of the prompt; or a
        Step, a program call whose result the caller sends back (run, or run_many for
        several generations at once). A server interleaves other sequences between.
        ``params``: sample as they say (greedy when None or greedy)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        sampler = None
        if params is not None and not params.greedy:
            if not self.samples:
                raise ValueError("this decoder cannot sample (its steps do not pool); "
                                 "sampled requests run on the eager engine")
            params.validate()
            sampler = _Sampler(params, self.device, max_tokens)
        k = self.served_k(k) if self.has_mtp else 0
        self.check_length(len(prompt_ids), max_tokens, k)
        self.warmup_for(params, k)
        res = result if result is not None else Result()
        return self._steps(prompt_ids, max_tokens, k, res, eos_ids or set(), chunk, sampler)

    def _steps(self, prompt_ids, max_tokens, k, res, eos_ids, chunk, sampler=None):
        # Inference mode is entered per step, not around the generator: a server steps it
        # from its own thread between other work.
        with torch.inference_mode():
            m = res.metrics
            m.prompt_tokens = len(prompt_ids)
            threads.tick()
            t0 = time.perf_counter()
            prefill = self._prefill(prompt_ids, k, chunk, sampler)
        while True:
            with torch.inference_mode():
                try:
                    next(prefill)
                except StopIteration as done:
                    first, drafts, probs = done.value
                    break
            yield PIECE
        m.ttft_s = time.perf_counter() - t0
        at = len(prompt_ids)  # position of the pending token
        pending = first
        emitted = [int(first)]
        dev = self.device
        while True:
            yield list(emit(emitted, res, eos_ids, max_tokens, t0))
            if res.finish_reason is not None:
                return
            threads.tick()
            if sampler is not None:
                # A sampled round: its drafts (up to k; none at k = 0 or at the end) and
                # probs, the distributions they were drawn from [drafts, V].
                with torch.inference_mode():
                    tokens = torch.cat([pending.view(1), drafts])[None]
                    args = (tokens, torch.tensor([at], device=dev), self.kc, self.vc,
                            self.hk, self.hv)
                emitted, drafted, drafts, probs = yield Step(
                    "sample", len(drafts) + 1, k, args, probs, slot=self.slot, sampler=sampler)
                n = len(emitted) - 1
                m.record(drafted, n)
                at += n + 1
                pending = torch.tensor(emitted[-1:], device=dev)
                continue
            if k == 0:
                # Decode and round read the same span at a position (k <= 31), so a row's
                # attention call is the same whichever step computes it.
                with torch.inference_mode():  # compiled programs' guards check the mode
                    args = (pending.view(1, 1), torch.tensor([at], device=dev), *self.kv,
                            self.span(at + SPAN_STEP))
                nxt = yield Step("decode", 1, 0, args, slot=self.slot)
                m.record(0, 0)
                emitted = [int(nxt)]
                at += 1
                pending = nxt
                continue
            kk = k
            if self.draft_p_min is not None:
                ok = (probs >= self.draft_p_min).tolist()
                kk = ok.index(False) if False in ok else k
            t = kk + 1
            with torch.inference_mode():
                tokens = torch.cat([pending.view(1), drafts[:kk]])[None]
                args = (tokens, torch.tensor([at], device=dev), *self.kv, self.hk, self.hv,
                        self.span(at + max(SPAN_STEP, 2 * k + 2)))
            # A lean batched round's placeholders (probability 0, run_many) are no drafts:
            # a round that verifies them anyway (a lone round program verifies all k)
            # does not count them.
            drafting = kk > 0 and _drafted(probs)
            out, probs = yield Step("round", t, k, args, probs[:kk], slot=self.slot)
            vals = out.tolist()  # the one host read per round
            # A batched round may have verified fewer of the drafts (run_many).
            t = len(vals) - 1 - k
            n = vals[t]
            # Counted as the eager engine does: no more drafts than tokens still allowed.
            drafted = min(t - 1, max_tokens - m.generated_tokens - 1) if drafting else 0
            m.record(drafted, min(n, drafted))
            drafts = out[t + 1:]
            pending = out[n : n + 1]
            at += n + 1
            emitted = vals[: n + 1]


PIECE = "piece"  # what FastDecoder.steps gives after a piece of the prompt


def drafts_none(device: torch.device) -> torch.Tensor:
    """No drafts: an empty token tensor."""
    return torch.zeros(0, dtype=torch.long, device=device)


@dataclass
class Step:
    """A program call a generation asks for (FastDecoder.steps)."""

    kind: str  # "decode" or "round"
    t: int  # rows verified (round)
    k: int  # draft depth (round)
    args: tuple  # the program's arguments: tokens, position, the generation's caches, span
    # round: the head's probabilities of its drafts [t - 1]; sample: the distributions the
    # drafts were drawn from [k, V]
    probs: torch.Tensor | None = None
    slot: int | None = None  # the generation's slot in its decoder's pool (make_pool)
    sampler: _Sampler | None = None  # sample: the request's settings and random stream


class _Sampler:
    """A sampled request's settings and its own random stream, seeded as the eager
    engine seeds it."""

    def __init__(self, params: SamplingParams, device: torch.device, max_tokens: int) -> None:
        self.params = params
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.left = max_tokens  # tokens the request may still emit
        self.lean = False  # draft nothing for the next round (FastDecoder.run_many)
        # Positions the head has not caught up on (behind): tokens, states, the first.
        self._ids: list[int] = []
        self._states: list[torch.Tensor] = []
        self._first = 0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The first token [1], drawn from the target's logits [V]."""
        self.left -= 1
        return sample(probs(logits, self.params), self.gen).view(1)

    def behind(self, tokens: list[int], states: torch.Tensor, first: int) -> None:
        """Note this round's accepted tokens and their trunk states [1, r, D] from position
        first, which the head has yet to catch up on."""
        if not self._ids:
            self._first = first
        self._ids += tokens
        self._states.append(states)

    def catch_up(self) -> tuple[list[int], torch.Tensor, int]:
        """Every position noted since the last catch-up: (tokens, states [1, r, D], first
        position), for the head to run over now."""
        out = (self._ids, torch.cat(self._states, 1), self._first)
        self._ids, self._states = [], []
        return out

    def draws(self, k: int) -> int:
        """Drafts to draw for the next round: k, or fewer where the tokens still allowed
        would not take them all (as the eager engine drafts, so that both draw the same
        numbers from a seed)."""
        return 0 if self.lean else max(0, min(k, self.left - 1))


def _drafted(probs: torch.Tensor | None) -> bool:
    """Whether a round's drafts are the head's (a lean round's placeholders have
    probability 0, FastDecoder.run_many)."""
    return probs is not None and len(probs) > 0 and float(probs[0]) > 0.0


class _Loaded:
    """An AOTInductor program called with its tensors flattened by hand: torch's wrapper
    (AOTICompiledModel) parses its call spec and flattens and unflattens every call with
    pytree (63 tensors a SmolLM2 step), a cost this avoids on every step."""

    def __init__(self, compiled, held: dict | None = None) -> None:
        from torch.utils import _pytree as pytree

        self.compiled = compiled
        self.held = held  # the model's tensors the program runs on (kept alive with it)
        self._run = compiled.loader.boxed_run
        self._out = pytree.treespec_loads(compiled.loader.get_call_spec()[1])
        self._unflatten = pytree.tree_unflatten

    def __call__(self, *args):
        """The program's outputs for tensors and lists of tensors, in the exported order."""
        flat: list[torch.Tensor] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                flat.append(a)
            else:
                flat.extend(a)
        return self._unflatten(self._run(flat), self._out)


def enable_fast(engine, backend: str = "auto", draft_p_min: float | None = None,
                max_len: int | None = None, mode: str = "max-autotune") -> FastDecoder | None:
    """Give ``engine`` a FastDecoder for its greedy requests; None (with a note on stderr)
    when the model cannot take the fast path, which leaves the eager engine serving."""
    import sys

    reason = unsupported_reason(engine.model)
    if reason is not None:
        if backend != "auto":  # the default says nothing: the eager engine is its fallback
            print(f"note: --compile ignored, {reason}; decoding eagerly", file=sys.stderr)
        return None
    if draft_p_min is not None and not 0.0 <= draft_p_min < 1.0:
        raise ValueError(f"--draft-p-min must be in [0, 1), got {draft_p_min}")
    # A fixed cache length keeps the compiled programs' key stable across requests and runs;
    # attention reads only the slots in use, so a long cache costs memory, not time.
    max_len = max_len or min(engine.max_model_len, DEFAULT_MAX_LEN)
    vocab = engine.drafter.vocab if engine.drafter is not None else None
    engine.fast = FastDecoder(engine.model, vocab, max_len=max_len, backend=backend, mode=mode,
                              draft_p_min=draft_p_min)
    return engine.fast
