"""The fast path's step functions: fixed-shape programs over a static KV cache, which
``engine/fast.py`` (FastDecoder) runs and ``engine/program_cache.py`` compiles.

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
- several sequences' steps share one pass (``trunk_pool`` / ``head_pool`` over pooled
  caches, a server's batched rounds), each row with its sequence's own position and cache.

Exactness: greedy output with MTP equals output without MTP (the accept rule and the
models are those of the eager engine). On quantized trunks that needs every verified row to
equal the one-token step bit for bit, so their steps attend row by row and every trunk step
has the same QUANT_ROWS rows with shape-chosen GEMM kernels (``Programs.rowwise`` and
``Programs.rows``), unless every GEMM of the trunk and the lm_head is row-exact
(``Programs.row_exact``: mtpkit's int8/W4A8 kernels, or ``f32_mm`` for fp32 trunks on a
CPU): then a decode step is one row and a round k+1.

Compiled programs are keyed by this file's code (program_cache.traced_sources): the
decoding loop around them lives in fast.py so that a change to it rebuilds nothing.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from ..models.attention import Attention, position_mask, row_kernel_fits
from ..models.eagle3 import is_eagle3
from ..models.layers import MLP, PreNormDecoderLayer, swapped
from ..quant.kernels import argmax_rows
from ..quant.linear import QuantLinear, RowExactLinear, every_row_exact, linear_rows, stack_outputs
from ..quant.w8a8_layer import W8A8Forms, w8a8_block, w8a8_block_fits, w8a8_trunk, w8a8_whole

SPAN_STEP = 64  # attention reads the cache up to the next multiple of this
QUANT_ROWS = 2  # trunk rows of every compiled step on quantized trunks: drafts k <= 1
POOL_KINDS = ("trunk_pool", "head_pool")  # programs over pooled caches (FastDecoder.make_pool)
# Rows a pooled step may have: a prompt's threshold for torch's GEMM (QuantLinear), which the
# compiled pool programs are built below; steps of more rows take the unpooled passes.
POOL_MAX_ROWS = 256


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
    @functools.cached_property
    def batchable(self) -> bool:
        """Whether several sequences' steps can share one trunk pass with each row's bits
        those of its sequence alone: every GEMM row-exact, natural row counts."""
        # Cached: a server asks every round, and the model does not change.
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
    def round_many(self, items, k: int, trunk=None, head=None):
        """round() of several sequences, items = [(tokens, pos0, kc, vc, hk, hv, span)],
        with one trunk pass and one head pass per draft step -> [(out, probs)].
        The passes (default: trunk_rows and head_rows over the items' own caches) take
        every sequence's rows in one tensor: ``trunk(ids, pos, seqs)`` over ids [1, N] at
        pos [N], seqs = [(tokens, pos [T], kc, vc, span)] a sequence -> (the target's
        argmaxes [N], the head's input states [1, N, D]); ``head(ids, states, pos, seqs)``
        over ids [1, M], states [1, M, D] at pos [M], seqs = [(rows, hk, hv, span)] a
        sequence -> (the states drafts are picked from, the states chained steps read)
        [1, M, D]."""
        # The batch's rows stay in one tensor from pass to pass, and acceptance is counted
        # on the host from one read of the tokens and targets: a few tensor operations a
        # sequence, each tiny, had made a drafting round's bookkeeping cost as much as the
        # head's pass.
        trunk = trunk or self._trunk_targets
        head = head or self._head_states
        dev = items[0][0].device
        sizes = [tokens.shape[1] for tokens, *_ in items]
        starts = list(itertools.accumulate(sizes, initial=0))[:-1]
        ids = torch.cat([tokens for tokens, *_ in items], 1)  # [1, N]
        first = torch.cat([p0 for _, p0, *_ in items])  # [B]
        within = torch.tensor([j for t in sizes for j in range(t)], device=dev)
        pos = first.repeat_interleave(torch.tensor(sizes, device=dev)) + within  # [N]
        targets, hidden = trunk(ids, pos, [(tokens, p, kc, vc, span) for
                                           (tokens, _, kc, vc, _, _, span), p
                                           in zip(items, pos.split(sizes), strict=True)])
        tok, tgt = ids[0].tolist(), targets.tolist()
        # n: how many of a sequence's drafts equal the target's choices before them.
        ns = []
        for a, t in zip(starts, sizes, strict=True):
            n = 0
            while n < t - 1 and tok[a + n + 1] == tgt[a + n]:
                n += 1
            ns.append(n)
        # Head catch-up over every sequence's positions with its target tokens (round());
        # each sequence's row n is what the eager engine computes next.
        heads = [(hk, hv, span) for *_, hk, hv, span in items]
        hpost, hstate = head(targets[None], hidden, pos,
                             [(t, *h) for t, h in zip(sizes, heads, strict=True)])
        at = torch.tensor([a + n for a, n in zip(starts, ns, strict=True)], device=dev)
        post, state = hpost[0].index_select(0, at), hstate[0].index_select(0, at)  # [B, D]
        drafted, p = self.draft_pick(post)  # [B] each
        drafts, ps = [drafted], [p]
        step = first + torch.tensor(ns, device=dev) + 1
        ones = [(1, *h) for h in heads]
        for _ in range(k - 1):
            post, state = head(drafted[None], state[None], step, ones)
            drafted, p = self.draft_pick(post[0])
            drafts.append(drafted)
            ps.append(p)
            state = state[0]
            step = step + 1
        chosen = torch.stack(drafts, 1).tolist()  # [B][k]
        return [(torch.tensor(tgt[a:a + t] + [n] + d, device=dev), q)
                for a, t, n, d, q in zip(starts, sizes, ns, chosen,
                                         torch.stack(ps, 1).unbind(0), strict=True)]

    def _trunk_targets(self, ids, pos, seqs):
        # round_many's default trunk pass: trunk_rows over the sequences' own caches.
        states = self.trunk_rows(seqs)
        targets = argmax_rows(self.logits(torch.cat([p for p, _ in states], 1)[0]))
        post_norm = self.model.mtp.spec.trunk_hidden == "post_norm"
        return targets, torch.cat([post if post_norm else pre for post, pre in states], 1)

    def _head_states(self, ids, states, pos, seqs):
        # round_many's default head pass: head_rows over the sequences' own head caches.
        sizes = [t for t, *_ in seqs]
        rows = [(i, h, p, hk, hv, span) for i, h, p, (_, hk, hv, span)
                in zip(ids.split(sizes, 1), states.split(sizes, 1), pos.split(sizes), seqs,
                       strict=True)]
        chain_post = self.model.mtp.spec.chain_hidden == "post_norm"
        out = self.head_rows(rows)
        post = torch.cat([hp for hp, _ in out], 1)
        return post, post if chain_post else torch.cat([hq for _, hq in out], 1)

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


class StepModule(nn.Module):
    """One program as a module's forward (what torch.export takes)."""

    def __init__(self, programs: Programs, kind: str, k: int = 0) -> None:
        super().__init__()
        self.programs, self.kind, self.k = programs, kind, k

    def forward(self, *args):
        if self.kind == "round":
            return self.programs.round(*args, self.k)
        return getattr(self.programs, self.kind)(*args)

