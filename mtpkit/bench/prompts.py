"""Benchmark prompts: a small built-in set (code and chat) or a user's file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt; ``chat`` wraps it in the model's chat template as a user turn."""

    text: str
    chat: bool = False
    name: str = ""


# Written for these benchmarks. Code prompts are raw completions (where drafting pays most:
# boilerplate is predictable); chat prompts are user turns answered under the chat template.
_CODE = {
    "fibonacci": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "binary_search": (
        "def binary_search(items, target):\n"
        '    """Index of target in the sorted list items, or -1."""\n'
        "    lo, hi = 0, len(items) - 1\n"
    ),
    "dataclass": (
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n"
        '    """A point in the plane."""\n\n    x: float\n    y: float\n\n'
        "    def distance(self, other: \"Point\") -> float:\n"
    ),
    "csv_reader": (
        "import csv\n\n\ndef read_rows(path):\n"
        '    """Yield each row of a CSV file as a dict."""\n'
    ),
    "quicksort": "def quicksort(xs: list[int]) -> list[int]:\n",
    "http_handler": (
        "from http.server import BaseHTTPRequestHandler\n\n\n"
        "class Hello(BaseHTTPRequestHandler):\n    def do_GET(self):\n"
    ),
}
_CHAT = {
    "explain_gc": "Explain in a few sentences how garbage collection works in Python.",
    "email": "Write a short, polite email asking a colleague to review my pull request.",
    "list_fruits": "List five fruits that are rich in vitamin C, one per line.",
    "capital": "What is the capital of France, and what is it famous for?",
    "recipe": "Give me a simple recipe for pancakes.",
    "summary": (
        "Summarise in two sentences: The water cycle describes how water evaporates from "
        "the surface of the earth, rises into the atmosphere, cools and condenses into "
        "clouds, and falls again to the surface as precipitation."
    ),
}

BUILTIN: tuple[Prompt, ...] = tuple(
    [Prompt(t, False, f"code/{n}") for n, t in _CODE.items()]
    + [Prompt(t, True, f"chat/{n}") for n, t in _CHAT.items()]
)


def load_prompts(source: str | None) -> list[Prompt]:
    """``builtin`` (or None) or a file: JSONL, JSON list, or plain text with one prompt a line.

    JSONL / JSON records take ``prompt`` or ``text`` (and an optional ``chat`` flag), or a
    ShareGPT-style ``conversations`` list whose first human turn becomes a chat prompt.
    """
    if source in (None, "", "builtin"):
        return list(BUILTIN)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"{source}: no such prompt file (give 'builtin' or a .jsonl, .json "
                         "or .txt file)")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    elif path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
    else:
        records = [line for line in text.splitlines() if line.strip()]
    prompts = [_prompt_of(r, f"{path.name}:{i}") for i, r in enumerate(records, 1)]
    prompts = [p for p in prompts if p is not None]
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


def _prompt_of(rec, where: str) -> Prompt | None:
    if isinstance(rec, str):
        return Prompt(rec, False, where)
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a prompt must be a string or an object")
    for key in ("prompt", "text"):
        if key in rec:
            return Prompt(str(rec[key]), bool(rec.get("chat", False)), rec.get("name", where))
    turns = rec.get("conversations")
    if isinstance(turns, list):
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                return Prompt(str(turn.get("value", "")), True, where)
        return None  # a conversation without a user turn has nothing to send
    raise ValueError(f"{where}: no 'prompt', 'text' or 'conversations' field")
