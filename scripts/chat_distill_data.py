"""Self-distillation chat data for an MTP head: the trunk's own greedy answers to varied prompts.

A head drafts what the trunk will say, so the best text to train it on is the trunk's own
output. This writes templated user prompts (none about the topics of mtpkit's benchmark chat
prompts, which stay unseen) and the model's greedy answers under its chat template, as JSONL
shards that ``mtpkit calibrate --data`` reads (``text`` = the whole rendered conversation).
Several shards, because calibrate holds out whole files.

    python scripts/chat_distill_data.py --model M --out DIR [--prompts 2000] [--minutes 30]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

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

# mtpkit's benchmark chat prompts (mtpkit/bench/prompts.py) are about these; leaving them out
# keeps the benchmark's chat prompts unseen by the head.
EXCLUDED = ("garbage collection", "pull request", "vitamin", "capital of france", "pancake",
            "water cycle")


def excluded(prompt: str) -> bool:
    """Whether a prompt is about one of the benchmark's chat topics."""
    return any(x in prompt.lower() for x in EXCLUDED)


def distinct_prompts() -> int:
    """How many distinct prompts the templates and topics make, the excluded ones left out."""
    every = {tpl.format(t=t, u=u) for tpl in TEMPLATES for t in TOPICS
             for u in ([x for x in TOPICS if x != t] if "{u}" in tpl else [t])}
    return sum(not excluded(p) for p in every)


def prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct templated prompts, seeded."""
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


def cut_end(text: str, answer: str) -> str:
    """The conversation up to the end of ``answer``: a cut answer has no end-of-turn, so the
    one the template adds after it would teach the head a turn end the trunk never chose."""
    end = text.rfind(answer) if answer else -1
    return text[: end + len(answer)] if end >= 0 else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="trunk (default: the built-in model)")
    ap.add_argument("--out", required=True, help="output folder of JSONL shards")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--minutes", type=float, default=0, help="stop after this long (0: none)")
    ap.add_argument("--compile", default="aoti", help="aoti, inductor or off")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        # Shards are written line by line (a stopped run keeps what it made), so a second
        # run into the same folder would mix or repeat conversations.
        raise SystemExit(f"{out} is not empty: give a new --out folder")

    from mtpkit.engine.sampling import SamplingParams
    from mtpkit.engine.session import Session

    s = Session.load(a.model, compile=a.compile)
    out.mkdir(parents=True, exist_ok=True)
    files = [open(out / f"chat-{i:02d}.jsonl", "x", encoding="utf-8") for i in range(a.shards)]
    t0, tokens = time.time(), 0
    params = SamplingParams(max_tokens=a.max_tokens)
    for i, p in enumerate(prompts(a.prompts, a.seed)):
        if a.minutes and time.time() - t0 > a.minutes * 60:
            break
        c = s.complete(p, params, 0, chat=True)
        conv = [{"role": "user", "content": p}, {"role": "assistant", "content": c.text}]
        text = s.tokenizer.apply_chat_template(conv, add_generation_prompt=False)
        if c.finish_reason == "length":
            text = cut_end(text, c.text)
        f = files[i % a.shards]
        f.write(json.dumps({"text": text, "prompt": p, "finish": c.finish_reason}) + "\n")
        f.flush()
        tokens += len(c.token_ids)
        if i % 50 == 0:
            print(f"{i} prompts, {tokens} tokens, {tokens / (time.time() - t0):.0f} tok/s",
                  flush=True)
    for f in files:
        f.close()
    print(f"done: {tokens} answer tokens in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
