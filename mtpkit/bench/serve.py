"""Drive an OpenAI-compatible server with streaming requests and measure it.

Definitions follow vLLM's serving benchmark: TTFT is the time from sending a request to its
first content chunk; ITL the gaps between content chunks; TPOT a request's (latency - TTFT)
/ (output tokens - 1); throughput divides by the wall time of the whole level. Spec-decode
figures come from vLLM's Prometheus counters on /metrics, read before and after a level.

The client is aiohttp: it shares the server's CPU when both run on one machine, and it
spends about half the CPU time a streamed chunk that httpx does, time the server's model
threads then keep.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from .common import summarize
from .prompts import Prompt

READY_POLL_S = 0.5  # how often a loading server's /health is asked again

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Request:
    """What happened to one streamed request (times in seconds from its start)."""

    concurrency: int
    index: int
    prompt: int
    start_s: float = 0.0  # from the start of its level
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    output_tokens: int = 0
    chunks: int = 0
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk
    prompt_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def base_url(url: str) -> tuple[str, str]:
    """(server root, API root ending in /v1) from what a user typed; ValueError if not a URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    # Accept the server root, .../v1, or a full endpoint pasted from a client's config.
    path = re.sub(r"/(chat/)?completions$", "", path)
    root_path = path[: -len("/v1")] if path.endswith("/v1") else path
    root = f"{parts.scheme}://{parts.netloc}{root_path}"
    return root, f"{root}/v1"


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text format -> {sample name: [(labels, value), ...]}."""
    out: dict[str, list[tuple[dict, float]]] = {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = sample.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(label.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def spec_counters(text: str) -> dict | None:
    """vLLM spec-decode counters summed over engines and models; None when absent.

    prometheus_client exposes a counter named X as X_total; both spellings are read."""
    samples = parse_prometheus(text)

    def total(name: str) -> float | None:
        rows = samples.get(f"{name}_total", samples.get(name))
        return None if rows is None else sum(v for _, v in rows)

    got = {key: total(name) for name, key in SPEC_COUNTERS.items()}
    if got["num_drafts"] is None:
        return None
    got = {k: v or 0.0 for k, v in got.items()}
    per_pos: dict[int, float] = {}
    for labels, v in samples.get(f"{PER_POS}_total", samples.get(PER_POS, [])):
        if "position" in labels:
            p = int(labels["position"])
            per_pos[p] = per_pos.get(p, 0.0) + v
    got["per_pos"] = per_pos
    return got


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """Spec-decode figures over a run from two counter readings (vLLM's definitions)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in SPEC_COUNTERS.values()}
    positions = sorted(set(after["per_pos"]) | set(before["per_pos"]))
    accepted_pos = [after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)
                    for p in positions]
    drafts = d["num_drafts"]
    return {
        **d,
        "num_accepted_tokens_per_pos": accepted_pos,
        "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"]
        if d["num_draft_tokens"] else None,
        "mean_acceptance_length": 1 + d["num_accepted_tokens"] / drafts if drafts else None,
        # vLLM: accepted at position i over all drafts (a draft reaches every position).
        "per_position_acceptance_rate": [a / drafts for a in accepted_pos] if drafts else [],
    }


class ServeBench:
    """One server, one model name; runs levels of concurrency over a prompt list."""

    def __init__(self, url: str, model: str | None, prompts: list[Prompt], max_tokens: int,
                 endpoint: str = "chat", api_key: str | None = None, timeout_s: float = 600,
                 temperature: float = 0.0, ignore_eos: bool = False) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"--endpoint must be chat or completions, got {endpoint!r}")
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
        if not prompts:
            raise ValueError("no prompts to send")
        self.root, self.api = base_url(url)
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.temperature, self.ignore_eos = temperature, ignore_eos
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ready = False  # waited for and its model resolved (run)

    # -- server discovery ---------------------------------------------------------------
    async def _get(self, client, url: str) -> tuple[int, str]:
        # (status, body) of a GET; aiohttp's errors (and a timeout) as they come.
        import aiohttp

        async with client.get(url, headers=self.headers,
                              timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.text(errors="replace")

    async def resolve_model(self, client) -> str:
        """The --model given, else the first model the server lists; a clear error if down."""
        try:
            status, text = await self._get(client, f"{self.api}/models")
        except _ERRORS as e:
            raise ValueError(f"cannot reach the server at {self.root}: {_why(e)}") from None
        if self.model:
            return self.model
        try:
            if status != 200:
                raise ValueError(status)
            return json.loads(text)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"{self.api}/models did not list a model (HTTP {status}); "
                             "pass --model NAME") from None

    async def wait_ready(self, client, timeout_s: float = 900.0) -> None:
        """Wait while the server's /health answers 503 (mtpkit serve and llama-server while
        the model loads: requests sent then fail, and a level would measure nothing); any
        other answer, or no /health at all, ends the wait."""
        deadline, told = time.monotonic() + timeout_s, False
        while True:
            try:
                status, text = await self._get(client, f"{self.root}/health")
            except _ERRORS:
                return  # unreachable: resolve_model says so
            if status != 503:
                return
            if time.monotonic() > deadline:
                raise ValueError(f"{self.root}/health still answers 503 after {timeout_s:.0f} s "
                                 f"({text[:200]}): the server is not ready")
            if not told:
                print(f"waiting for {self.root} to finish loading (/health: 503) ...",
                      file=sys.stderr)
                told = True
            await asyncio.sleep(READY_POLL_S)

    async def read_counters(self, client) -> dict | None:
        """Spec-decode counters from /metrics, or None (no endpoint, no counters)."""
        try:
            status, text = await self._get(client, f"{self.root}/metrics")
        except _ERRORS:
            return None
        if status != 200:
            return None
        return spec_counters(text)

    # -- one request ----------------------------------------------------------------------
    def payload(self, prompt: Prompt) -> tuple[str, dict]:
        """Endpoint URL and JSON body of a streaming request."""
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                "temperature": self.temperature,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM / mtpkit extension; sent only when asked
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
            return f"{self.api}/chat/completions", body
        body["prompt"] = prompt.text
        return f"{self.api}/completions", body

    async def one(self, client, rec: Request, t_level: float) -> Request:
        """Send one streaming request and fill in its record."""
        url, body = self.payload(self.prompts[rec.prompt])
        t0 = time.perf_counter()
        rec.start_s = t0 - t_level
        last = None
        done = False
        try:
            async with client.post(url, json=body, headers=self.headers) as r:
                if r.status != 200:
                    text = await r.text(errors="replace")
                    rec.error = f"HTTP {r.status}: {text[:300]}"
                    return rec
                event = None
                async for raw in r.content:  # one line at a time, its newline kept
                    now = time.perf_counter()
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        continue
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        rec.error = f"unparseable stream data: {data[:200]}"
                        return rec
                    if event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                        err = chunk.get("error", chunk) if isinstance(chunk, dict) else chunk
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        rec.error = f"error event in stream: {msg}"
                        return rec
                    event = None
                    if _content(chunk):
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.chunks += 1
                    for choice in chunk.get("choices") or []:
                        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                    usage = chunk.get("usage")
                    if usage:
                        rec.usage_tokens = usage.get("completion_tokens")
                        rec.prompt_tokens = usage.get("prompt_tokens")
        except _ERRORS as e:
            rec.error = f"{type(e).__name__}: {_why(e)}"
            return rec
        end = time.perf_counter()
        if rec.finish_reason in ("error", "abort"):
            rec.error = f"finish_reason {rec.finish_reason}"
            return rec
        if not done and rec.finish_reason is None:
            rec.error = "stream ended without [DONE] or a finish_reason"
            return rec
        if rec.ttft_s is None:
            rec.error = "no content in the stream"
            return rec
        rec.latency_s = (last if last is not None else end) - t0
        # Chunks undercount tokens when a server sends several per chunk (speculative
        # decoding does): the usage chunk is the server's own count.
        rec.output_tokens = rec.usage_tokens if rec.usage_tokens is not None else rec.chunks
        rec.success = True
        return rec

    # -- a level --------------------------------------------------------------------------
    async def level(self, client, concurrency: int, num_prompts: int) -> dict:
        """num_prompts requests, at most ``concurrency`` in flight; summary and records."""
        before = await self.read_counters(client)
        queue = list(range(num_prompts))
        records: list[Request] = []
        t_level = time.perf_counter()

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                rec = Request(concurrency, i, i % len(self.prompts))
                records.append(await self.one(client, rec, t_level))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_prompts))))
        duration = time.perf_counter() - t_level
        after = await self.read_counters(client)
        records.sort(key=lambda r: r.index)
        return summarize_level(concurrency, records, duration, spec_delta(before, after))

    async def run(self, concurrencies: list[int], num_prompts: int, on_level=None) -> dict:
        """Every level in turn, on one connection pool sized for the largest."""
        import aiohttp

        # --timeout bounds connecting and each wait for the next bytes, not a whole stream.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s,
                                        sock_read=self.timeout_s)
        # A connection a request: llama-server closes a connection after a stream without
        # saying so, and aiohttp would send the next request down it (a failed request).
        # vLLM's serving benchmark opens a session a request for the same reason.
        connector = aiohttp.TCPConnector(limit=max(concurrencies) + 2, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            if not self._ready:  # once: a peer's levels come in turn with this one's
                await self.wait_ready(client)
                self.model = await self.resolve_model(client)
                self._ready = True
            levels = []
            for c in concurrencies:
                levels.append(await self.level(client, c, num_prompts))
                if on_level is not None:
                    on_level(levels[-1])
        return {"url": self.root, "model": self.model, "endpoint": self.endpoint,
                "max_tokens": self.max_tokens, "num_prompts": num_prompts, "levels": levels}


def summarize_level(concurrency: int, records: list[Request], duration: float,
                    spec: dict | None) -> dict:
    """Latency statistics over the successful requests, throughput over the level's time."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "failures": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.success}),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_s": summarize([r.ttft_s for r in ok]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": summarize([x for r in ok for x in r.itl_s]),
        "e2e_latency_s": summarize([r.latency_s for r in ok]),
        "spec_decode": spec,
        "records": [dict(asdict(r), tpot_s=r.tpot_s) for r in records],
    }


def _content(chunk) -> bool:
    # A chunk carries output when a choice has text (completions) or delta content (chat);
    # role-only and usage-only chunks do not count as tokens.
    if not isinstance(chunk, dict):
        return False
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
        if (c.get("delta") or {}).get("reasoning_content"):
            return True
    return False


def _why(e: Exception) -> str:
    msg = str(e) or type(e).__name__
    return msg.splitlines()[0][:200]


def _client_errors() -> tuple[type[BaseException], ...]:
    try:
        import aiohttp
    except ImportError:  # the bench extra is missing: the CLI says so before any request
        return (TimeoutError,)
    # A line longer than the client's buffer is a ValueError (not a server we can read).
    return (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError)


_ERRORS = _client_errors()
