"""Text in, text out: a loaded model, its tokenizer, stop strings and streaming."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from ..quant.linear import route_rows_through_kernel
from ..quant.pack import int8_head_beside_int8_trunk
from .generate import Engine, Result
from .loader import load_model
from .metrics import SpecMetrics
from .sampling import SamplingParams


@dataclass
class Completion:
    """One finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: SpecMetrics = field(default_factory=SpecMetrics)


class Session:
    """A model ready for text requests; every request starts from empty caches."""

    def __init__(self, engine: Engine, tokenizer, name: str) -> None:
        self.engine, self.tokenizer, self.name = engine, tokenizer, name

    @classmethod
    def load(
        cls, path=None, head=None, device: str = "cpu", dtype: str | None = None,
        full_draft_vocab: bool = False, compile: str | None = "auto",
        draft_p_min: float | None = None, draft_vocab_size: int | None = None,
    ) -> Session:
        """Load a checkpoint folder or GGUF file (default: the built-in model) and tokenizer;
        ``compile`` (auto, aoti, inductor or eager; None or "off" for none) serves greedy
        requests through engine.fast (FastDecoder) where the model can take it."""
        from ..builtin import builtin_name, resolve_model

        if builtin_name(path) is not None:
            path, head = resolve_model(path, head)
        loaded = load_model(path, device=device, dtype=dtype, head=head)
        # Decoding steps (1 to k+1 rows) through mtpkit's fp32 kernel: faster here than
        # torch's GEMM at those row counts, and each row the same bits whatever rows come
        # with it. A no-op where the model is not fp32 on a CPU or the kernels cannot build.
        # Weights stored in 16 bits stay in them (widened exactly in the kernel, so the
        # same bits as upcast ones, at half the bytes a step reads).
        int8_head_beside_int8_trunk(loaded.model)
        route_rows_through_kernel(loaded.model, stored_half_dtype(loaded.checkpoint))
        vocab = None if full_draft_vocab else loaded.draft_vocab
        if draft_vocab_size is not None:
            if draft_vocab_size < 1:
                raise ValueError(f"--draft-vocab-size must be >= 1, got {draft_vocab_size}")
            if vocab is None:
                raise ValueError("--draft-vocab-size needs a head with a draft vocabulary "
                                 "(draft_vocab.json, written by mtpkit calibrate)")
            # The list is most frequent first, so a prefix is the N most frequent tokens.
            vocab = vocab[:draft_vocab_size]
        engine = Engine(loaded.model, loaded.tokenizer, draft_vocab=vocab)
        if compile not in (None, "off"):
            from .fast import enable_fast

            enable_fast(engine, compile, draft_p_min=draft_p_min)
        elif draft_p_min is not None:
            raise ValueError("--draft-p-min needs the fast path: drop --compile off")
        return cls(engine, loaded.tokenizer, str(path))

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of a raw prompt, or of a user message under the chat template."""
        if chat:
            return self.tokenizer.chat_ids([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def complete(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        num_draft_tokens: int,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        """Generate; ``on_text`` receives text pieces as they are final (stop strings held)."""
        pieces = self.stream(prompt, params, num_draft_tokens, chat)
        try:
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as done:
                    return done.value
                if on_text:
                    on_text(piece)
        finally:
            pieces.close()  # a failing on_text ends the request here, not when collected

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        num_draft_tokens: int,
        chat: bool = False,
    ) -> Generator[str, None, Completion]:
        """Yield text pieces as they are final (stop strings held); return the Completion.

        ``prompt`` is text, or token ids taken as they are."""
        ids = self.encode_prompt(prompt, chat) if isinstance(prompt, str) else list(prompt)
        res = Result()
        decoder = self.tokenizer.stream_decoder()
        text = ""
        sent = 0
        # Text that could still turn into a stop string is held back from the stream.
        hold = max((len(s) for s in params.stop), default=1) - 1
        finish = None
        gen = self.engine.generate(ids, params, num_draft_tokens, result=res)
        try:
            for token in gen:
                text += decoder.push(token)
                hit = _first_stop(text, params.stop)
                if hit is not None:
                    text, finish = text[:hit], "stop"
                    break
                if len(text) - hold > sent:
                    piece, sent = text[sent : len(text) - hold], len(text) - hold
                    yield piece
        finally:
            gen.close()
        if finish is None:
            text += decoder.flush()
            hit = _first_stop(text, params.stop)
            if hit is not None:
                text, finish = text[:hit], "stop"
        if len(text) > sent:
            yield text[sent:]
        return Completion(text, list(res.tokens), finish or res.finish_reason or "stop",
                          res.metrics)


def stored_half_dtype(ckpt) -> torch.dtype | None:
    """float16 or bfloat16 when a checkpoint (as the loader opened it) stores its Linear
    weights so (the first decoder projection tells), else None."""
    ckpt = getattr(ckpt, "trunk", ckpt)  # a trunk with a separately trained head over it
    if not callable(getattr(ckpt, "tensor_dtype", None)):
        return None  # GGUF: dequantised on load
    for name in ckpt.tensor_names():
        if name.endswith(("q_proj.weight", "gate_proj.weight", "qkv_proj.weight")):
            return {"F16": torch.float16, "BF16": torch.bfloat16}.get(ckpt.tensor_dtype(name))
    return None


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
