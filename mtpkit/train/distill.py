"""Self-distillation data for an MTP head: the trunk's own answers to chat and code prompts.

A head learns to draft what the trunk will say, so the text to train it on is the trunk's
own output, not human text: on a quantized trunk, the quantized trunk's. ``mtpkit
distill-data`` writes templated chat prompts (none about the topics of ``mtpkit bench``'s
chat prompts, which stay unseen) and code prompts made from functions of the Python
standard library, answers each with the trunk (greedy, or sampled for a share of them, as
EAGLE regenerates its data), and stores the rendered conversations as JSONL shards
(``text``: what ``mtpkit calibrate --data`` trains on; several shards, because calibrate
holds out whole files).

The run is resumable: prompt i goes to shard i % shards, and ``distill.json`` records the
arguments, the versions the data depends on (mtpkit, Python, whose standard library the
code prompts come from, torch) and how many prompts are done, rewritten atomically after
each. A stopped run continues where the record says when started again with the same
arguments; lines written after the last record are dropped first. Prompts and sampling
seeds depend only on the arguments, so a resumed run writes what an uninterrupted one would.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "distill.json"  # in the output folder; calibrate's folder reader skips it

TOPICS = [
    "photosynthesis", "black holes", "the immune system", "volcanoes", "the stock market",
    "inflation", "compound interest", "machine learning", "the internet", "blockchain",
    "climate change", "renewable energy", "the Roman Empire", "the French Revolution",
    "the printing press", "democracy", "the human heart", "sleep", "meditation",
    "a healthy breakfast", "learning a new language", "public speaking", "time management",
    "remote work", "electric cars", "solar panels", "recycling", "composting", "bees",
    "coral reefs", "the moon", "Mars", "gravity", "magnets", "electricity", "rainbows",
    "earthquakes", "tides", "DNA", "vaccines", "antibiotics", "the brain", "memory",
    "habits", "chess", "football", "the Olympic Games", "jazz", "classical music",
    "painting with watercolours", "photography", "gardening", "houseplants", "dogs", "cats",
    "birds migrating", "the ocean", "deserts", "rainforests", "mountains", "rivers",
    "coffee", "tea", "bread baking", "cheese", "chocolate", "vegetarian cooking",
    "a budget for students", "saving money", "job interviews", "writing a CV",
    "team meetings", "giving feedback", "starting a small business", "customer service",
    "social media", "online privacy", "passwords", "cloud computing", "databases",
    "version control with git", "unit testing", "recursion", "sorting algorithms",
    "HTTP", "encryption", "operating systems", "spreadsheets", "search engines",
    "the water in a city", "bridges", "skyscrapers", "trains", "airplanes", "bicycles",
    "running a marathon", "yoga", "swimming", "hiking safety", "camping", "travelling on a budget",
    "packing for a trip", "Japan", "Italy", "Egypt", "Brazil", "Canada", "India",
    "the Renaissance", "Shakespeare", "poetry", "science fiction", "fairy tales",
    "museums", "libraries", "friendship", "kindness", "stress", "motivation",
    "a rainy day", "autumn", "winter holidays", "birthdays", "moving to a new city",
    "first day at a new job", "learning to cook", "fixing a flat tyre", "smartphones",
    "video games", "robots", "artificial intelligence", "the speed of light", "atoms",
    "the periodic table", "stars", "the seasons", "weather forecasts", "clouds",
]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in two or three sentences.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a short story for children about {t}.",
    "List the main advantages and disadvantages of {t}.",
    "How would you explain {t} to a ten-year-old?",
    "Write a tweet about {t}.",
    "Give me some tips about {t}.",
    "What are common misconceptions about {t}?",
    "Write a paragraph for a blog post about {t}.",
    "Describe {t} in one paragraph.",
    "Why is {t} important?",
    "Write a short dialogue between two friends talking about {t}.",
    "Suggest five questions a student could ask about {t}.",
    "Summarise what most people should know about {t}.",
    "Write a haiku about {t}.",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
    "Write an introduction for a presentation about {t}.",
    "Give a step-by-step guide to getting started with {t}.",
    "What is the history of {t}?",
    "Write a product description for a book about {t}.",
    "Create a short quiz with three questions about {t}.",
    "Write a motivational message about {t}.",
    "What are the most important words to know when talking about {t}?",
    "Tell me a fun fact about {t} and explain why it is true.",
    "Write a formal letter to a newspaper about {t}.",
    "Plan a one-day workshop about {t}.",
    "hi! can you tell me about {t}?",
]

CODE_TEMPLATES = [
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Write a docstring for this Python function:\n\n```python\n{src}\n```",
    "Write a unit test for this Python function:\n\n```python\n{src}\n```",
    "Rewrite this Python function to be easier to read:\n\n```python\n{src}\n```",
    "Find possible bugs or edge cases in this code:\n\n```python\n{src}\n```",
]

# mtpkit's benchmark chat prompts (mtpkit/bench/prompts.py) are about these; leaving them out
# keeps the benchmark's chat prompts unseen by the head.
EXCLUDED = ("garbage collection", "pull request", "vitamin", "capital of france", "pancake",
            "water cycle")


def excluded(prompt: str) -> bool:
    """Whether a prompt is about one of the benchmark's chat topics."""
    return any(x in prompt.lower() for x in EXCLUDED)


def distinct_prompts() -> int:
    """How many distinct chat prompts the templates and topics make, excluded ones left out."""
    every = {tpl.format(t=t, u=u) for tpl in TEMPLATES for t in TOPICS
             for u in ([x for x in TOPICS if x != t] if "{u}" in tpl else [t])}
    return sum(not excluded(p) for p in every)


def prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct templated chat prompts, seeded (the list head v4 was trained on for
    ``prompts(3000, 0)``: keep the order of draws)."""
    limit = distinct_prompts()
    if n > limit:
        # Sampling until n distinct prompts exist would never end.
        raise ValueError(f"--prompts {n}: the templates and topics make only {limit} distinct "
                         "prompts")
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        t, u = rng.sample(TOPICS, 2)
        p = rng.choice(TEMPLATES).format(t=t, u=u)
        if p in seen or excluded(p):
            continue
        seen.add(p)
        out.append(p)
    return out


def stdlib_functions(min_lines: int = 4, max_lines: int = 40) -> list[str]:
    """Source of the standard library's top-level functions and methods of ``min_lines`` to
    ``max_lines`` lines (tests, idlelib, lib2to3 and site-packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if skip & set(rel) or f.name.startswith("test_"):
            continue
        try:
            source = f.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    body = lines[node.lineno - 1 : node.end_lineno]
                    indent = len(body[0]) - len(body[0].lstrip())
                    out.append("\n".join(line[indent:] for line in body))
    return out


def code_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts about standard-library functions, seeded; distinct functions."""
    if n <= 0:
        return []
    funcs = stdlib_functions()
    if n > len(funcs):
        raise ValueError(f"--code-prompts {n}: this Python's standard library has "
                         f"{len(funcs)} functions of the right size")
    rng = random.Random(seed)
    return [rng.choice(CODE_TEMPLATES).format(src=src) for src in rng.sample(funcs, n)]


def cut_end(text: str, answer: str) -> str:
    """The conversation up to the end of ``answer``: a cut answer has no end-of-turn, so the
    one the template adds after it would teach the head a turn end the trunk never chose."""
    end = text.rfind(answer) if answer else -1
    return text[: end + len(answer)] if end >= 0 else text


@dataclass
class DistillConfig:
    """What ``mtpkit distill-data`` writes; every field but ``out`` and ``minutes`` is
    recorded and must match when a run is resumed."""

    model: str
    out: str
    prompts: int = 2000  # templated chat prompts
    code_prompts: int = 0  # prompts about standard-library functions
    sampled: float = 0.0  # share of prompts answered by sampling instead of greedily
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 192
    shards: int = 20
    seed: int = 0
    num_draft_tokens: int = 1
    minutes: float = 0.0  # stop after this long (0: when every prompt is answered)

    def validate(self) -> None:
        """ValueError naming the bad argument."""
        if self.prompts < 0 or self.code_prompts < 0 or self.prompts + self.code_prompts == 0:
            raise ValueError("--prompts and --code-prompts must be >= 0, and not both 0")
        if not 0.0 <= self.sampled <= 1.0:
            raise ValueError(f"--sampled is a share of the prompts, 0 to 1; got {self.sampled}")
        if self.shards < 1 or self.max_tokens < 1:
            raise ValueError("--shards and --max-tokens must be >= 1")
        if self.sampled and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError("sampling needs --temperature > 0 and 0 < --top-p <= 1")

    def recorded(self) -> dict:
        """The fields a resumed run must repeat."""
        d = asdict(self)
        for key in ("minutes", "out"):  # how long, and by which path the folder is named
            d.pop(key)
        return d


def all_prompts(cfg: DistillConfig) -> list[tuple[str, str]]:
    """(kind, prompt) for every prompt of the run, chat and code interleaved by a seeded
    shuffle (so that a run stopped early still holds both kinds); chat alone in the order
    ``prompts`` draws them."""
    items = [("chat", p) for p in prompts(cfg.prompts, cfg.seed)]
    if cfg.code_prompts:
        items += [("code", p) for p in code_prompts(cfg.code_prompts, cfg.seed)]
        random.Random(cfg.seed + 1).shuffle(items)
    return items


def is_sampled(cfg: DistillConfig, i: int) -> bool:
    """Whether prompt i is answered by sampling (a seeded draw per prompt)."""
    return cfg.sampled > 0 and random.Random(f"{cfg.seed}:{i}").random() < cfg.sampled


def versions() -> dict:
    """The versions the data depends on: the standard library's source is the code
    prompts', the rest decides the answers."""
    import torch

    from .. import __version__

    return {"mtpkit": __version__, "python": platform.python_version(),
            "torch": torch.__version__}


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _lines_in_shard(done: int, shard: int, shards: int) -> int:
    return len(range(shard, done, shards))


def _prepare(cfg: DistillConfig, out: Path) -> dict | None:
    """Create the folder, or check a stopped run's record and trim its shards to it; that
    record (None for a new run)."""
    record = out / MANIFEST
    if not out.exists():
        out.mkdir(parents=True)
        return None
    if not record.exists():
        if any(out.iterdir()):
            raise ValueError(f"{out} is not empty and holds no {MANIFEST}: give a new --out "
                             "folder (or the folder of a stopped distill-data run)")
        return None
    rec = json.loads(record.read_text(encoding="utf-8"))
    differ = {k: (rec["args"].get(k), v) for k, v in cfg.recorded().items()
              if rec["args"].get(k) != v}
    if differ:
        said = ", ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in differ.items())
        raise ValueError(f"{out} holds a run with other arguments ({said}); resume with the "
                         "same arguments or give a new --out folder")
    done = int(rec["done"])
    for j in range(cfg.shards):
        shard = out / f"distill-{j:03d}.jsonl"
        want = _lines_in_shard(done, j, cfg.shards)
        data = shard.read_bytes() if shard.exists() else b""
        lines = data.split(b"\n")[:-1]  # complete lines; a torn last line is dropped
        if len(lines) < want:
            raise ValueError(f"{shard} holds {len(lines)} answers, but {MANIFEST} counts "
                             f"{want}: the folder was changed; give a new --out folder")
        if len(lines) > want or not data.endswith(b"\n") and data:
            shard.write_bytes(b"".join(line + b"\n" for line in lines[:want]))
    return rec


def run(cfg: DistillConfig, session=None, log: Callable[[str], None] = print) -> dict:
    """Write (or continue) the data; returns the record. ``session``: a loaded
    engine.session.Session (default: load ``cfg.model``)."""
    from ..engine.sampling import SamplingParams

    cfg.validate()
    out = Path(cfg.out)
    items = all_prompts(cfg)
    old = _prepare(cfg, out)
    done = int(old["done"]) if old else 0
    if session is None:
        from ..engine.session import Session

        session = Session.load(cfg.model)
    k = cfg.num_draft_tokens if session.engine.model.mtp is not None else 0
    # Versions per part of the run: a resumed run under other versions is kept (its
    # answers are the trunk's either way), and the record says from which prompt on.
    parts, tokens = (old["versions"], old["answer_tokens"]) if old else ([], 0)
    now = versions()
    if not parts or {k: v for k, v in parts[-1].items() if k != "from_prompt"} != now:
        parts = [*parts, {"from_prompt": done, **now}]
    record = {"format": "mtpkit-distill", "version": 1, "model": session.name,
              "args": cfg.recorded(), "versions": parts, "prompts_total": len(items),
              "done": done, "answer_tokens": tokens, "finished": False}
    _write_json_atomic(out / MANIFEST, record)
    chat = session.tokenizer.chat_template is not None
    t0, new_tokens = time.time(), 0
    files = {}
    try:
        for i in range(done, len(items)):
            if cfg.minutes and time.time() - t0 > cfg.minutes * 60:
                log(f"stopped after {cfg.minutes:g} minutes; run the same command to go on")
                break
            kind, prompt = items[i]
            sampled = is_sampled(cfg, i)
            params = (SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                     top_p=cfg.top_p, seed=cfg.seed * 1_000_003 + i)
                      if sampled else SamplingParams(max_tokens=cfg.max_tokens))
            c = session.complete(prompt, params, k, chat=chat)
            if chat:
                conv = [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": c.text}]
                text = session.tokenizer.apply_chat_template(conv, add_generation_prompt=False)
                if c.finish_reason == "length":
                    text = cut_end(text, c.text)
            else:
                text = f"{prompt}\n{c.text}"
            j = i % cfg.shards
            if j not in files:
                files[j] = open(out / f"distill-{j:03d}.jsonl", "a", encoding="utf-8")
            files[j].write(json.dumps({"text": text, "prompt": prompt, "kind": kind,
                                       "sampled": sampled, "finish": c.finish_reason}) + "\n")
            files[j].flush()
            new_tokens += len(c.token_ids)
            record.update(done=i + 1, answer_tokens=record["answer_tokens"] + len(c.token_ids))
            _write_json_atomic(out / MANIFEST, record)
            if (i + 1) % 50 == 0:
                rate = new_tokens / max(time.time() - t0, 1e-9)
                log(f"{i + 1}/{len(items)} prompts, {record['answer_tokens']} answer tokens "
                    f"({rate:.0f} tok/s)")
    finally:
        for f in files.values():
            f.close()
    if record["done"] == len(items):
        record["finished"] = True
        _write_json_atomic(out / MANIFEST, record)
    return record
