"""The Python API: load a model, generate or stream text with MTP speculative decoding,
evaluate a head, diagnose a checkpoint.

A thin face over what the ``mtpkit`` command uses (engine.session.Session, train.evaluate,
doctor): errors that name command-line flags are reworded with the Python parameter names,
and a user's mistake raises ValueError (or FileNotFoundError, TypeError) with a clear message.
See docs/python-api.md.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Generator
from dataclasses import dataclass, field

from .checkpoint.errors import CheckpointError
from .engine.metrics import SpecMetrics
from .engine.sampling import SamplingParams
from .engine.session import Completion, Session
from .threads import compute

__all__ = ["Generation", "LoadError", "Model", "Stream", "doctor", "evaluate", "load"]

BUILTIN_NAME = "SmolLM2-135M-Instruct"  # as `mtpkit serve` names the built-in model
COMPILE_MODES = ("auto", "off", "aoti", "inductor", "eager")

# load()'s options and their defaults: those `mtpkit generate` takes for loading.
LOAD_OPTIONS = {
    "device": "cpu",
    "dtype": None,
    "compile": "auto",
    "full_draft_vocab": False,
    "draft_p_min": None,
    "draft_vocab_size": None,
    "threads": None,
}


class LoadError(CheckpointError, ValueError):
    """A checkpoint, head, tokenizer or load option cannot be used as given."""


# -- errors worded for Python callers ----------------------------------------------------------

_VALUED_FLAGS = ("device", "dtype", "compile", "engine")  # --flag VALUE -> name='VALUE'
_FLAGS = {"draft-p-min": "draft_p_min", "draft-vocab-size": "draft_vocab_size",
          "full-draft-vocab": "full_draft_vocab", "num-draft-tokens": "k",
          "threads": "threads", "head": "head", "model": "model", "data": "data"}


def python_message(msg: str) -> str:
    """An engine or CLI error message with command-line flags named as API parameters."""
    msg = msg.replace("(raise --max-model-len)",
                      "(shorten the prompt, lower max_tokens or load with compile='off')")
    msg = msg.replace("drop --compile off", "load with compile='auto' (not 'off')")
    msg = msg.replace("drop --compile,", "load with compile='off',")
    msg = msg.replace("no --model given", "no model given")
    msg = msg.replace("pass --model PATH", "pass a checkpoint path to mtpkit.load()")
    msg = re.sub(r"(?<![\w-])-k (\d+)", r"k=\1", msg)

    def valued(m: re.Match) -> str:
        value = m[2] if m[2].startswith("'") else repr(m[2])
        return f"{m[1]}={value}"

    msg = re.sub(r"--(" + "|".join(_VALUED_FLAGS) + r") ('[^']*'|[\w.:]+)", valued, msg)
    return re.sub(r"--(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m[1]], msg)


class _UserErrors:
    """Re-raise a user's mistake with a message for Python callers: a checkpoint problem as
    LoadError (a ValueError), a ValueError naming CLI flags reworded."""

    def __enter__(self) -> _UserErrors:
        return self

    def __exit__(self, typ, e, tb) -> bool:
        if e is None or isinstance(e, LoadError):
            return False
        if isinstance(e, CheckpointError):
            raise LoadError(python_message(str(e))) from e
        if isinstance(e, ValueError):
            msg = python_message(str(e))
            if msg != str(e):
                try:
                    new = type(e)(msg)
                except Exception:
                    new = ValueError(msg)
                raise new from e
        return False


def _path(p, what: str, required: bool = False) -> str | None:
    """``p`` as a string path that exists (None passes unless required)."""
    if p is None:
        if required:
            raise ValueError(f"{what} is required")
        return None
    if not isinstance(p, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(p).__name__}")
    p = os.fspath(p)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{p}: no such {what}")
    return p


def _int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


# -- loading -----------------------------------------------------------------------------------

def load(model=None, head=None, **options) -> Model:
    """Load a checkpoint folder or .gguf file (default: the built-in model; "builtin-f16" for its
    float16 weights) to generate with."""
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"load() got unknown option(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(LOAD_OPTIONS)}")
    opts = {**LOAD_OPTIONS, **options}
    from .builtin import BUILTIN_NAMES, builtin_name

    if model not in BUILTIN_NAMES:  # "builtin", "builtin-f16": the built-in model's weights
        model = _path(model, "checkpoint folder or .gguf file")
    head = _path(head, "MTP head folder")
    compile_mode = "off" if opts["compile"] is None else opts["compile"]
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile={compile_mode!r} is not one of {', '.join(COMPILE_MODES)}")
    _check_device(opts["device"])
    p_min = opts["draft_p_min"]
    if p_min is not None:
        if compile_mode == "off":
            raise ValueError("draft_p_min needs the fast path: load with compile='auto' (or "
                             "'aoti', 'inductor', 'eager'), not compile='off'")
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) \
                or not 0.0 <= p_min < 1.0:
            raise ValueError(f"draft_p_min must be a number in [0, 1), got {p_min!r}")
    if opts["draft_vocab_size"] is not None:
        _int(opts["draft_vocab_size"], "draft_vocab_size", 1)
    if opts["threads"] is not None:
        from . import threads

        threads.configure(_int(opts["threads"], "threads", 1))
    with _UserErrors():
        session = compute(
            Session.load, model, head=head, device=opts["device"], dtype=opts["dtype"],
            full_draft_vocab=bool(opts["full_draft_vocab"]), compile=compile_mode,
            draft_p_min=p_min, draft_vocab_size=opts["draft_vocab_size"],
        )
    if session.tokenizer is None:
        raise LoadError(f"{session.name}: no tokenizer found; generating text needs one")
    return Model(session, {**opts, "compile": compile_mode},
                 builtin=builtin_name(model) is not None)


def _check_device(device) -> None:
    if device is None or device == "auto":
        return
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device: use 'cpu', 'cuda' or "
                         "'cuda:N'") from None


# -- results -----------------------------------------------------------------------------------

@dataclass
class Generation:
    """One finished request: its text, token ids, why it ended and its MTP metrics."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    num_draft_tokens: int  # the draft length k the request ran with (0: no speculation)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @classmethod
    def _of(cls, done: Completion, k: int) -> Generation:
        return cls(done.text, done.token_ids, done.finish_reason, k, done.metrics)

    def as_dict(self) -> dict:
        """Plain data, as `mtpkit generate --json` prints it (plus the token ids)."""
        return {"text": self.text, "token_ids": list(self.token_ids),
                "finish_reason": self.finish_reason, "num_draft_tokens": self.num_draft_tokens,
                "metrics": self.metrics.as_dict()}


class Stream:
    """Text pieces of one request as they become final; ``result`` once it is exhausted."""

    def __init__(self, pieces: Generator[str, None, Completion], k: int) -> None:
        self._pieces: Generator[str, None, Completion] | None = pieces
        self._k = k
        self._interrupted = False
        self.result: Generation | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self._interrupted:
            raise RuntimeError("this stream was ended by a later request on the same model "
                               "(a model serves one request at a time)")
        if self._pieces is None:
            raise StopIteration
        try:
            with _UserErrors():
                return compute(next, self._pieces)
        except StopIteration as done:
            self.result = Generation._of(done.value, self._k)
            self._pieces = None
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    @property
    def done(self) -> bool:
        """True once the request has ended (exhausted, closed or failed)."""
        return self._pieces is None

    def close(self) -> None:
        """End the request now (the rest is not generated; ``result`` stays None)."""
        if self._pieces is not None:
            compute(self._pieces.close)
            self._pieces = None

    def _interrupt(self) -> None:
        if self._pieces is not None:
            self.close()
            self._interrupted = True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the model ---------------------------------------------------------------------------------

class Model:
    """A loaded model and tokenizer; one request at a time, nothing kept between requests."""

    def __init__(self, session: Session, options: dict | None = None,
                 builtin: bool = False) -> None:
        self.session = session
        self.options = dict(options or {})
        self._builtin = builtin
        self._warm: set[int] = set()
        self._live: Stream | None = None

    @property
    def tokenizer(self):
        """The model's tokenizer (encode, decode, chat_ids)."""
        return self.session.tokenizer

    @property
    def name(self) -> str:
        """The path it was loaded from, or "SmolLM2-135M-Instruct" for the built-in model."""
        return BUILTIN_NAME if self._builtin else self.session.name

    @property
    def has_mtp(self) -> bool:
        """True when the model has a usable MTP head (else requests run with k=0)."""
        return self.session.engine.has_mtp

    @property
    def engine(self):
        """The underlying engine.generate.Engine (advanced use)."""
        return self.session.engine

    def __repr__(self) -> str:
        return f"<mtpkit.Model {self.name!r} has_mtp={self.has_mtp}>"

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt as generate() encodes it (chat: under the chat template)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with _UserErrors():
            return self.session.encode_prompt(prompt, bool(chat))

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 256,
        k: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        chat: bool = False,
        ignore_eos: bool = False,
        stream: bool = False,
    ) -> Generation | Stream:
        """Generate after ``prompt`` (text or token ids): a Generation, or a Stream if stream."""
        ids = self._prompt_ids(prompt, chat)
        k = _int(k, "k", 0)
        if not self.has_mtp:
            k = 0  # as mtpkit generate: no head, no speculation
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise TypeError("stop must be a str or a list of str")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=_int(max_tokens, "max_tokens", 1), stop=stops,
                                seed=seed, ignore_eos=bool(ignore_eos))
        engine = self.session.engine
        with _UserErrors():
            params.validate()
            engine.check_length(len(ids), params.max_tokens)
            if engine.fast_takes(params):
                engine.fast.check_length(len(ids), params.max_tokens, k)
        self._end_live()
        warm = k if params.greedy else "sampled"
        if engine.fast_takes(params) and warm not in self._warm:
            with _UserErrors():  # load (or, with compile="aoti", build) its programs
                compute(engine.fast.warmup_for, params, k)
            self._warm.add(warm)
        pieces = Stream(self.session.stream(ids, params, k), k)
        if stream:
            self._live = pieces
            return pieces
        for _ in pieces:  # piece by piece: an interrupt (Ctrl-C) ends the request
            pass
        return pieces.result

    def _end_live(self) -> None:
        # One request at a time: a stream left unfinished ends before the next request.
        if self._live is not None:
            self._live._interrupt()
            self._live = None

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt, chat)
        else:
            if chat:
                raise ValueError("chat=True needs the prompt as text (a user message), not "
                                 "token ids")
            if hasattr(prompt, "tolist"):  # a tensor or array
                prompt = prompt.tolist()
            if not isinstance(prompt, (list, tuple)):
                raise TypeError("prompt must be a str or a list of token ids, got "
                                f"{type(prompt).__name__}")
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise TypeError("prompt token ids must be ints") from None
            vocab = self.session.engine.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"(0 to {vocab - 1})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def evaluate(self, data, k: int = 3, mode: str = "teacher", max_tokens: int | None = None,
                 prompts: int = 8) -> dict:
        """Per-position MTP acceptance on text files, as `mtpkit eval --json` reports it."""
        from .train.data import list_files
        from .train.evaluate import generate_eval, teacher_eval

        k = _int(k, "k", 1)
        if mode not in ("teacher", "generate"):
            raise ValueError(f"mode={mode!r} is not one of teacher, generate")
        paths = [data] if isinstance(data, (str, os.PathLike)) else list(data or [])
        if not paths:
            raise ValueError("data is empty: give text files, folders or JSONL files")
        files = [str(f) for f in list_files([_path(p, "data file or folder") for p in paths])]
        if not self.has_mtp:
            raise ValueError(f"{self.name} has no MTP head to evaluate; load it with head=DIR")
        engine = self.session.engine
        self._end_live()
        with _UserErrors():
            if mode == "teacher":
                n = 20000 if max_tokens is None else _int(max_tokens, "max_tokens", 1)
                rep = compute(teacher_eval, engine.model, self.tokenizer, files, k, n,
                              draft_vocab=engine.drafter.vocab)
                return rep.as_dict()
            n = 64 if max_tokens is None else _int(max_tokens, "max_tokens", 1)
            return compute(generate_eval, engine, self.tokenizer, files, k,
                           _int(prompts, "prompts", 1), max_tokens=n)


def evaluate(data, model=None, head=None, k: int = 3, mode: str = "teacher",
             max_tokens: int | None = None, prompts: int = 8, **options) -> dict:
    """Load a model (as load()) and measure its head's acceptance on ``data``."""
    return load(model, head, **options).evaluate(data, k=k, mode=mode, max_tokens=max_tokens,
                                                 prompts=prompts)


# -- doctor ------------------------------------------------------------------------------------

def doctor(path, engines=None, measure: bool = False, reference=None, device: str = "cpu"):
    """Diagnose a checkpoint's MTP head as `mtpkit doctor` does; returns the doctor Report."""
    from .doctor.checks import ALL_ENGINES, diagnose
    from .doctor.findings import Finding

    path = _path(path, "checkpoint folder or .gguf file", required=True)
    reference = _path(reference, "reference checkpoint folder or .gguf file")
    if reference is not None and not measure:
        raise ValueError("reference compares measured acceptance: pass measure=True")
    if isinstance(engines, str):
        engines = None if engines == "all" else [engines]
    for e in engines or ():
        if e not in ALL_ENGINES:
            raise ValueError(f"engines: {e!r} is not one of {', '.join(ALL_ENGINES)} (or 'all')")
    _check_device(device)
    with _UserErrors():
        report = diagnose(path, engines)
    if measure:
        from .doctor.measure import judge
        from .doctor.measure import measure as measure_acceptance

        try:
            m = compute(measure_acceptance, path, device=device)
        except (CheckpointError, ValueError, RuntimeError) as e:
            # As the CLI: a load failure is a finding, not a crash of doctor.
            report.add(Finding("measure-failed", "error", f"mtpkit cannot load {path}: {e}",
                               "the checkpoint does not load as its config describes it",
                               "see the static findings", ["mtpkit"], "load"))
        else:
            with _UserErrors():
                ref = compute(measure_acceptance, reference, device=device) if reference else None
            judge(report, m, ref)
    return report
