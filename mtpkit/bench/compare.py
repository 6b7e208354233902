"""mtpkit against the engines a user would otherwise pick, on the same prompts and model.

Every engine gets the same prompt token ids (encoded once by mtpkit's tokenizer, chat
template applied where a prompt asks for it), decodes greedily and stops at the same
end-of-sequence tokens, so that the texts can be compared token by token.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.generate import Result
from ..engine.sampling import SamplingParams
from .common import in_turn


@dataclass
class EngineRun:
    """One engine over every prompt."""

    engine: str
    tokens: list[list[int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # tokens after the first of each request
    decode_s: float = 0.0
    bound_tokens_per_s: float | None = None
    skipped: str = ""  # why it did not run
    notes: list[str] = field(default_factory=list)
    mean_acceptance_length: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Pooled decode rate: tokens after the first / seconds after the first token."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    def add(self, tokens: list[int], ttft: float, times: list[float]) -> None:
        """Record one request: its tokens, TTFT and the arrival time of each token batch."""
        self.tokens.append(tokens)
        self.ttft_s.append(ttft)
        if len(tokens) > 1 and len(times) > 1:
            self.decode_tokens += len(tokens) - 1
            self.decode_s += times[-1] - times[0]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a length difference counts); None if
    they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(run: EngineRun, ref: EngineRun) -> dict:
    """How far ``run`` follows ``ref`` prompt by prompt."""
    div = [first_divergence(a, b) for a, b in zip(run.tokens, ref.tokens, strict=True)]
    diverged = [d for d in div if d is not None]
    return {"reference": ref.engine, "identical_prompts": div.count(None),
            "prompts": len(div), "first_divergence": div,
            "earliest_divergence": min(diverged) if diverged else None}


# -- engines in turns ------------------------------------------------------------------------
@dataclass
class Runner:
    """One engine, one prompt at a time: ``gen(ids, n, warm)`` -> (tokens, TTFT s, token
    arrival times); ``warm``: the warm-up call, not measured."""

    run: EngineRun
    gen: Callable | None = None  # None: skipped (run.skipped says why)
    catch: bool = True  # a peer failing midway is a note; mtpkit failing is an error
    done: Callable | None = None  # called once after the last prompt


def interleave(runners: list[Runner], prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Every prompt through every runner, the runners' order rotated by one per prompt.

    A small machine's speed can drift by a third within minutes (shared memory bandwidth),
    so engines timed one after another in blocks compare
    the hours they ran in as much as the engines. In turns, prompt by prompt, they share
    the drift. Returns the schedule (engine names in the order they ran)."""
    live = [r for r in runners if r.gen is not None]
    schedule = []

    def call(r: Runner, ids, n, warm=False):
        try:
            return r.gen(ids, n, warm)
        except Exception as e:
            if not r.catch:
                raise
            r.run = EngineRun(r.run.engine, skipped=f"{r.run.engine} failed: "
                              f"{(str(e) or type(e).__name__).splitlines()[0]}")
            r.gen = None
            return None

    for r in live:  # warm-up: code paths, caches, compiled programs
        call(r, max(prompts, key=len), 8, warm=True)
    for i, ids in enumerate(prompts):
        for r in in_turn(live, i):
            if r.gen is None:
                continue
            out = call(r, ids, max_tokens)
            if out is not None:
                r.run.add(*out)
                schedule.append(r.run.engine)
    for r in runners:
        if r.done is not None and r.gen is not None:
            r.done()
    return schedule


# -- mtpkit ----------------------------------------------------------------------------------
def mtpkit_runners(session, ks: list[int], names: list[str], fast=None) -> list[Runner]:
    """mtpkit at every k in ``ks``, on the engine's eager path or through ``fast`` (a
    FastDecoder: the compiled programs); runners of both kinds share one engine."""
    from ..engine.metrics import SpecMetrics

    engine = session.engine
    runners = []
    for k, name in zip(ks, names, strict=True):
        run, total = EngineRun(name), SpecMetrics()

        def gen(ids, n, warm=False, k=k, total=total):
            engine.fast = fast  # which path this runner measures (the engine routes on it)
            res, times = Result(), []
            for _ in engine.generate(ids, SamplingParams(max_tokens=n), k, result=res):
                times.append(time.perf_counter())
            if not warm:
                total.add(res.metrics)
            return list(res.tokens), res.metrics.ttft_s, times

        def done(run=run, total=total, k=k):
            run.mean_acceptance_length = total.mean_acceptance_length if k else None

        runners.append(Runner(run, gen, catch=False, done=done))
    return runners


# -- transformers ----------------------------------------------------------------------------
class _Clock:
    """A generate() streamer that only notes when tokens arrive (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


def run_transformers(folder: Path, prompts: list[list[int]], max_tokens: int, eos_ids,
                     variants: list[tuple[str, str, int | None]]) -> list[EngineRun]:
    """transformers ``generate``, greedy, for each (name, dtype, prompt-lookup tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(_Clock, BaseStreamer):
        pass

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar would fill the report
    eos = sorted(eos_ids)
    runs = []
    models: dict[str, object] = {}
    for name, dtype, lookup in variants:
        run = EngineRun(name)
        try:
            if dtype not in models:
                models.clear()  # one model in memory at a time
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    models[dtype] = AutoModelForCausalLM.from_pretrained(
                        str(folder), dtype=getattr(torch, dtype)).eval()
            model = models[dtype]
        except Exception as e:  # noqa: BLE001 - report any loader failure as a skip
            run.skipped = f"transformers could not load {folder}: {str(e).splitlines()[0]}"
            runs.append(run)
            continue
        def gen(ids, n, model=model, lookup=lookup):
            # A complete config of our own: the folder's generation_config.json (sampling
            # defaults, repetition penalties) must not change what is measured.
            cfg = GenerationConfig(
                max_new_tokens=n, do_sample=False, num_beams=1,
                eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                prompt_lookup_num_tokens=lookup,
            )
            clock = Clock()
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                     generation_config=cfg, streamer=clock)
            return out[0, len(ids):].tolist(), t0, clock

        try:
            gen(max(prompts, key=len), 8)  # warm-up
            for ids in prompts:
                toks, t0, clock = gen(ids, max_tokens)
                # generate pads nothing for a batch of one, but strip a trailing EOS: mtpkit
                # does not emit it either.
                while toks and toks[-1] in eos_ids:
                    toks.pop()
                ttft = clock.times[0] - t0 if clock.times else 0.0
                run.add(toks, ttft, _token_times(clock, len(toks)))
        except Exception as e:  # noqa: BLE001 - one engine failing must not lose the others
            run = EngineRun(name, skipped=f"transformers generate failed: "
                                          f"{(str(e) or type(e).__name__).splitlines()[0]}")
        runs.append(run)
    models.clear()
    return runs


def _token_times(clock: _Clock, n: int) -> list[float]:
    # Decode time runs from the first token to the arrival of the batch holding token n.
    times, seen = [], 0
    for t, c in zip(clock.times, clock.counts, strict=True):
        times.append(t)
        seen += c
        if seen >= n:
            break
    return times


# -- llama.cpp -------------------------------------------------------------------------------
def llama_cpp_available() -> bool:
    """True when llama-cpp-python can be imported (an optional extra)."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of tensor data one decode step reads from a GGUF (the embedding table counts
    only when the output layer reuses it)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def write_q8_0(folder: Path, tokenizer, dest: Path) -> Path:
    """Q8_0 GGUF of an HF folder's weights, written by mtpkit (once; reused if present)."""
    import json

    from safetensors.torch import load_file

    from ..checkpoint.gguf import write_gguf

    if dest.exists():
        return dest
    cfg = json.loads((folder / "config.json").read_text())
    from ..quant.formats import quant_config_in

    if quant_config_in(cfg):
        raise ValueError(f"{folder.name} is quantized; mtpkit writes Q8_0 from float weights "
                         "only (pass the float model's GGUF with --gguf)")
    tensors = {}
    for f in sorted(folder.glob("model*.safetensors")):
        if "mtp" not in f.name:
            tensors.update(load_file(f))
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    write_gguf(dest, cfg.get("model_type", "llama"), cfg, tensors, tokenizer, qtype="Q8_0")
    return dest


def distinct_ggufs(ggufs: list[tuple[str, Path]]) -> tuple[list[tuple[str, Path]], list[str]]:
    """The (name, path) pairs with each file once, the first name kept; a note per repeat.

    ``--gguf`` naming the packaged Q4_1 (which the built-in model's run adds by itself), or
    one file twice, would otherwise time the same engine twice in one table."""
    kept: list[tuple[str, Path]] = []
    seen: dict[Path, str] = {}
    notes = []
    for name, path in ggufs:
        key = Path(path).resolve()
        if key in seen:
            notes.append(f"{path} runs once, as {seen[key]!r}: it was given more than once")
            continue
        seen[key] = name
        kept.append((name, path))
    return kept, notes


def llama_cpp_runner(name: str, path: Path, prompts: list[list[int]], max_tokens: int, eos_ids,
                     threads: int) -> Runner:
    """llama-cpp-python on a GGUF, greedy (top-k 1, temperature 0, no repeat penalty)."""
    run = EngineRun(name)
    try:
        from llama_cpp import Llama

        ctx = max(len(p) for p in prompts) + max_tokens + 8
        llm = Llama(model_path=str(path), n_ctx=ctx, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
    except Exception as e:  # noqa: BLE001 - a broken optional engine is a note, not a crash
        run.skipped = f"llama.cpp could not load {path}: {str(e).splitlines()[0]}"
        return Runner(run)
    stop = set(eos_ids) | {llm.token_eos()}

    def gen(ids, n, warm=False):
        llm.reset()  # no prefix reuse from the previous prompt: TTFT includes the prefill
        toks, times = [], []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if tok in stop:
                break
            times.append(time.perf_counter())
            toks.append(int(tok))
            if len(toks) >= n:
                break
        return toks, times[0] - t0 if times else 0.0, times

    return Runner(run, gen)
