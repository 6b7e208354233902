"""Tokenizers from an HF folder or from GGUF metadata, with chat templates and streaming.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary, the merges, the token
types and the name of a llama.cpp pre-tokenizer (``tokenizer.ggml.pre``). We rebuild an
equivalent ``tokenizers.Tokenizer`` from those: the pre-tokenizer regexes below are the ones
llama.cpp runs for each name (split in sequence, every piece kept, as ``Split(isolated)``
does), followed by the byte-level alphabet mapping.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .errors import CheckpointError

if TYPE_CHECKING:
    from .gguf import GGUFCheckpoint

__all__ = ["StreamDecoder", "Tokenizer"]

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 split (llama.cpp leaves out the final `|\s+`; the whitespace it would match is kept
# as an unmatched piece anyway, so both split the same).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _family(names: str, splits: list[str]) -> dict[str, list[str]]:
    return dict.fromkeys(names.split(), splits)


# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order.
_PRE_SPLITS: dict[str, list[str]] = {
    "default": _DEFAULT,
    **_family("gpt-2 phi-2 mpt olmo jais roberta-bpe trillion exaone4", [_GPT2]),
    # SmolLM (and StarCoder, ...): digits one by one, then the GPT-2 split.
    **_family("smollm starcoder refact command-r codeshell exaone minerva-7b", [r"\p{N}", _GPT2]),
    **_family("llama-bpe llama3 llama-v3 falcon3 dbrx smaug-bpe", [_LLAMA3]),
    **_family("qwen2 stablelm2 deepseek-r1-qwen megrez hunyuan", [_QWEN2]),
    "qwen35": [_QWEN35],
}
# llama.cpp looks a whole piece up in the vocabulary before merging, for these.
_IGNORE_MERGES = set("llama-bpe llama3 llama-v3 falcon3".split())
# Their HF tokenizers normalize to NFC before splitting (llama.cpp does not); we follow HF,
# the tokenizer the model was trained with.
_NFC = set("qwen2 deepseek-r1-qwen qwen35".split())
# Tried in this order when recognising an HF tokenizer's pre-tokenizer.
_DETECT_ORDER = ["gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "default"]
# Texts that exercise every difference between the splits above.
_PROBES = [
    "Hello world! It's 2024, isn't it?  Yes...\n\n\tTabs\r\nCRLF",
    "x = 12345 + 678.9e-3; a1b22c333d4444",
    "  leading and trailing  \n  ",
    "naïve café — ünïcödé 中文字符 日本語 한국어 😀👍 e\u0301",
    "I'VE DONE IT, they'LL see. DON'T",
    "$100 <=> ~|^ @#% (a)[b]{c}",
    "def f(x):\n    return x**2  # comment\n\n\n",
]
# Texts llama.cpp also treats as end of generation when they are control tokens.
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
)


def _byte_level_pre(splits: list[str]) -> pre_tokenizers.PreTokenizer:
    parts = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in splits]
    parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(parts)


def _detect_pre(backend: _Backend) -> str | None:
    """The llama.cpp pre-tokenizer name that splits like this tokenizer, if any."""
    pre = backend.pre_tokenizer
    if pre is None:
        return None
    try:
        want = [[p for p, _ in pre.pre_tokenize_str(t)] for t in _PROBES]
    except Exception:
        return None
    for name in _DETECT_ORDER:
        cand = _byte_level_pre(_PRE_SPLITS[name])
        if all(
            [p for p, _ in cand.pre_tokenize_str(t)] == w
            for t, w in zip(_PROBES, want, strict=True)
        ):
            return name
    return None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); fix or re-download it") from e
    return data if isinstance(data, dict) else {}


def _pick_template(value: Any) -> str | None:
    """A chat template: a string, or a list of {name, template} where "default" wins."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        return next(iter(named.values()), None)
    return None


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Chat templates expect real JSON (not jinja's HTML-escaped tojson), unicode kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers' chat templating, so templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces,
    best (highest-scoring) merged piece first."""
    found = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                score = scores[pid] if pid < len(scores) else 0.0
                found.append((-score, pid, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the checkpoint's special tokens and chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: set[int] | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        pre: str | None = None,
        source: str = "",
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id  # the primary one (written back to GGUF)
        self.eos_token_ids: set[int] = set(eos_token_ids or ())
        if eos_token_id is not None:
            self.eos_token_ids.add(eos_token_id)
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.pre = pre  # llama.cpp pre-tokenizer name, needed to write the tokenizer to GGUF
        self.source = source
        self._template: jinja2.Template | None = None
        self._plain: _Backend | None = None

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config / chat template / generation config."""
        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.exists():
            raise CheckpointError(
                f"{tj}: missing. mtpkit needs the fast-tokenizer file tokenizer.json; copy it "
                "from the original model repository (or write one with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(folder))."
            )
        try:
            backend = _Backend.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception on bad files
            raise CheckpointError(
                f"{tj}: not a readable tokenizer.json ({e}); re-download it"
            ) from e
        cfg = _read_json(root / "tokenizer_config.json")
        gen = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        text_cfg = (
            model_cfg.get("text_config") if isinstance(model_cfg.get("text_config"), dict) else {}
        )

        def token_id(field: str) -> int | None:
            text = _token_text(cfg.get(field))
            return backend.token_to_id(text) if text is not None else None

        bos = token_id("bos_token")
        if bos is None:
            bos = next(
                iter(_ids(model_cfg.get("bos_token_id") or text_cfg.get("bos_token_id"))), None
            )
        eos = token_id("eos_token")
        eos_ids = set(_ids(gen.get("eos_token_id")))
        eos_ids |= set(_ids(model_cfg.get("eos_token_id")) + _ids(text_cfg.get("eos_token_id")))
        if eos is None:
            eos = next(
                iter(_ids(gen.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))), None
            )

        template = None
        jinja_file = root / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None:
            template = _pick_template(cfg.get("chat_template"))
        if template is None:
            template = _pick_template(_read_json(root / "chat_template.json").get("chat_template"))

        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            chat_template=template,
            pre=_detect_pre(backend),
            source=str(root),
        )

    @classmethod
    def from_gguf(cls, ckpt: GGUFCheckpoint | dict | str | os.PathLike) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its ``tokenizer.ggml.*`` metadata."""
        if isinstance(ckpt, (str, os.PathLike)):
            from .gguf import open_gguf

            ckpt = open_gguf(ckpt)
        md: dict = ckpt if isinstance(ckpt, dict) else ckpt.metadata
        source = "GGUF metadata" if isinstance(ckpt, dict) else str(ckpt.path)
        model = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise CheckpointError(
                f"{source}: the GGUF metadata has no tokenizer (tokenizer.ggml.model/tokens). "
                "Load the tokenizer from the original model's tokenizer.json instead."
            )
        types = list(md.get("tokenizer.ggml.token_type") or [])
        types += [_NORMAL] * (len(tokens) - len(types))
        pre = md.get("tokenizer.ggml.pre") or "default"
        if model == "gpt2":
            backend = _bpe_backend(md, tokens, pre, source)
            default_add_bos = pre in _IGNORE_MERGES
        elif model == "llama":
            backend = _spm_backend(md, tokens, types)
            default_add_bos, pre = True, None
        else:
            raise CheckpointError(
                f"{source}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                "mtpkit reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece). Load the "
                "tokenizer from the original model's tokenizer.json instead."
            )
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types[: len(tokens)], strict=True)
            if ty == _CONTROL and t
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types[: len(tokens)], strict=True)
            if ty == _USER_DEFINED and t
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(user)

        def md_id(name: str) -> int | None:
            value = md.get(f"tokenizer.ggml.{name}")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        eos = md_id("eos_token_id")
        eos_ids = {i for i in (eos, md_id("eot_token_id"), md_id("eom_token_id")) if i is not None}
        control = {t for t, ty in zip(tokens, types[: len(tokens)], strict=True) if ty == _CONTROL}
        for text in _EOG_TEXTS:  # as llama.cpp does: these end generation whatever eos says
            if text in control:
                eos_ids.add(tokens.index(text))
        return cls(
            backend,
            bos_token_id=md_id("bos_token_id"),
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            pad_token_id=md_id("padding_token_id"),
            unk_token_id=md_id("unknown_token_id"),
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=_pick_template(md.get("tokenizer.chat_template")),
            pre=pre,
            source=source,
        )

    # -- use -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text."""
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """The primary EOS token's text."""
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def token_to_id(self, token: str) -> int | None:
        """Id of a token text (None if it is not in the vocabulary)."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Text of a token id as the vocabulary spells it."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True,
               special_text: bool = False) -> list[int]:
        """Token ids of ``text``; BOS/EOS added only when the checkpoint asks for them.
        ``special_text``: spellings of control tokens (``<|im_start|>``) stay plain text."""
        backend = self._plain_backend() if special_text else self.backend
        # encode_batch releases the GIL (encode holds it): a server tokenizing a long prompt
        # in a worker thread keeps answering other clients meanwhile.
        ids = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            # The post-processor of some tokenizer.json files adds BOS already; never twice.
            if self.add_bos_token and self.bos_token_id is not None:
                if not ids or ids[0] != self.bos_token_id:
                    ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                if not ids or ids[-1] != self.eos_token_id:
                    ids = [*ids, self.eos_token_id]
        return ids

    def _plain_backend(self) -> _Backend:
        # A copy, so that the shared backend's setting never changes under another thread.
        if self._plain is None:
            plain = _Backend.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    @functools.cached_property
    def added_texts(self) -> tuple[str, ...]:
        """The texts that encode to one added (control) token each."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values()
                     if t.content)

    @functools.cached_property
    def max_piece_chars(self) -> int:
        """The longest vocabulary entry, in characters: a token never covers more characters
        of the text, before normalization (byte-level pieces spell one character a byte)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def chat_ids(self, messages: list[dict], special_text: bool = True) -> list[int]:
        """Token ids of ``messages`` under the chat template, ready for a reply.
        ``special_text``: control-token spellings inside message contents stay plain text, so
        a user cannot forge role markers; the template's own markers are control tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt=True)
        # The template wrote any BOS token it wants.
        if not special_text or not any(a in m["content"] for m in messages
                                       for a in self.added_texts):
            return self.encode(text, add_special_tokens=False)
        # Render again with a marker in place of each content, then encode the template's
        # text and the contents apart. Only for messages that spell control tokens: the
        # boundaries can tokenize differently from one pass over the whole text.
        marks = [f"\x00{i}\x00" for i in range(len(messages))]
        marked = self.apply_chat_template([{**m, "content": mk} for m, mk in
                                           zip(messages, marks, strict=True)],
                                          add_generation_prompt=True)
        pieces = re.split("\x00(\\d+)\x00", marked)
        if [int(i) for i in pieces[1::2]] != list(range(len(messages))):
            raise CheckpointError(
                "a message spells a control token and this chat template does not place "
                "each message's content once, in order, so it cannot be kept plain text; "
                "remove the control token from the message")
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids += self.encode(messages[int(piece)]["content"], False, special_text=True)
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A decoder fed one token at a time that returns only complete new text."""
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the checkpoint's chat template (sandboxed jinja, as transformers does)."""
        if not self.chat_template:
            raise CheckpointError(
                f"{self.source or 'this tokenizer'}: the checkpoint has no chat template. "
                "Send a plain prompt instead of chat messages, or use the instruct release "
                "of the model, which ships one."
            )
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    # -- export ----------------------------------------------------------------------------

    def gguf_vocab(self, size: int | None = None) -> dict:
        """The ``tokenizer.ggml.*`` fields of this tokenizer (byte-level BPE only), the token
        list padded to ``size`` (the model's vocab_size: llama.cpp takes the vocabulary size
        from the list's length and checks the embedding against it)."""
        data = json.loads(self.backend.to_str())
        model = data.get("model", {})
        decoder = json.dumps(data.get("decoder"))
        if model.get("type") != "BPE" or '"ByteLevel"' not in decoder:
            raise ValueError(
                "only byte-level BPE tokenizers can be written to GGUF (tokenizer.ggml.model "
                f"'gpt2'); this one is {model.get('type')} with decoder {decoder[:80]}"
            )
        if self.pre is None:
            raise ValueError(
                "the pre-tokenizer of this tokenizer matches none llama.cpp knows; set "
                f"tokenizer.pre to one of {sorted(_PRE_SPLITS)} if you know it splits the same"
            )
        vocab = self.backend.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1
        if size is not None and size < n:
            raise ValueError(f"the tokenizer has token ids up to {n - 1}, more than the "
                             f"model's vocab_size {size}")
        size = max(n, size or 0)
        tokens = [f"[PAD{i}]" for i in range(size)]  # llama.cpp's filler for unused ids
        types = [_UNUSED] * size
        for text, i in vocab.items():
            tokens[i], types[i] = text, _NORMAL
        for i, added in self.backend.get_added_tokens_decoder().items():
            tokens[i] = added.content
            types[i] = _CONTROL if added.special else _USER_DEFINED
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        return {
            "model": "gpt2",
            "pre": self.pre,
            "tokens": tokens,
            "token_types": types,
            "merges": merges,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "padding_token_id": self.pad_token_id,
            "unknown_token_id": self.unk_token_id,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, pre={self.pre!r})"


def _bpe_backend(md: dict, tokens: list[str], pre: str, source: str) -> _Backend:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for m in md.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)  # the first space after the first character, as llama.cpp cuts
        merges.append((m[:cut], m[cut + 1 :]))
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        warnings.warn(
            f"{source}: unknown pre-tokenizer {pre!r}; using llama.cpp's 'default' split, "
            "which may tokenize differently from the original model",
            stacklevel=3,
        )
        splits = _DEFAULT
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _byte_level_pre(splits)
    backend.decoder = decoders.ByteLevel()
    if pre in _NFC:
        backend.normalizer = normalizers.NFC()
    return backend


def _spm_backend(md: dict, tokens: list[str], types: list[int]) -> _Backend:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    scores = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if md.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        # Control/byte/unused pieces never take part in merges.
        normal = {t: i for t, i in vocab.items() if types[i] in (_NORMAL, _USER_DEFINED)}
        merges = _spm_merges(normal, scores)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = _Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Replace(" ", "\u2581")]
    if md.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


class StreamDecoder:
    """Incremental detokenizer: ``push`` returns the text a new token completes.

    Decoding a token alone is wrong for byte-level and SentencePiece vocabularies (a character
    can span tokens; a leading space depends on the previous token), so each step decodes a
    short window that starts at the previous emission's start, and emits the part beyond
    what was already emitted. Text that ends in U+FFFD (half a UTF-8 character) waits.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # window start: context for the text being emitted
        self._done = 0  # tokens up to here are emitted

    def _text(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, final: bool) -> str:
        before = self._text(self._ids[self._start : self._done])
        now = self._text(self._ids[self._start :])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            if final:
                self._start = self._done = len(self._ids)
            return ""
        self._start, self._done = self._done, len(self._ids)
        return now[len(before) :]

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (the stream has ended)."""
        return self._emit(final=True)
