"""`mtpkit serve` against real server processes on 127.0.0.1, driven by `openai` and httpx.

Every expected output comes from a direct, single-request `Engine.generate` run on the same
tiny checkpoint in this process, never from hard-coded text. Three servers are started once
for the module (in parallel): A with MTP (k=3) and a small prefill chunk, B without MTP and
with an API key, C with one free slot and a one-request queue for the queue-full and SIGTERM
tests. Two tests drive the scheduler and the app in-process where a real process cannot be
made to fail on cue (an engine fault, the exact order of turns).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tiny import Reference

from mtpkit.engine.sampling import SamplingParams

NAME = "tiny-llama"
A_BODY_LIMIT = 65536
KEY = "s3cret-key"
PROMPTS = ["def f(x):", "abc", "Hello, world", "for i in range(10):", "The cat", "x = 1\ny =",
           "import os", "42 + 17 ="]


# -- servers ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `python -m mtpkit.cli serve` process."""

    def __init__(self, model_dir: Path, logs: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"server-{self.port}.log"
        # One torch thread: two threads contending with other processes on a small machine
        # make every tiny op ~100x slower (as tests/conftest.py does for this process).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mtpkit.cli", "serve", "--model", str(model_dir),
                 "--served-model-name", NAME, "--port", str(self.port),
                 "--log-level", "warning", *args],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 240.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    servers = {
        "A": Server(model_dir, logs, "-k", "3", "--max-num-seqs", "8", "--max-queue", "200",
                    "--prefill-chunk", "32", "--max-request-bytes", str(A_BODY_LIMIT),
                    "--header-timeout", "2", "--default-max-tokens", "16"),
        "B": Server(model_dir, logs, "-k", "0", "--api-key", KEY),
        "C": Server(model_dir, logs, "-k", "2", "--max-num-seqs", "2", "--max-queue", "1",
                    "--shutdown-timeout", "1"),
    }
    yield servers
    for s in servers.values():
        s.stop()
    for s in servers.values():
        # A server answers every failure itself; a traceback in its log is a bug.
        assert "Traceback" not in s.log(), s.log()


@pytest.fixture(scope="module")
def A(fleet):
    return fleet["A"].wait_ready()


@pytest.fixture(scope="module")
def B(fleet):
    return fleet["B"].wait_ready()


@pytest.fixture(scope="module")
def C(fleet):
    return fleet["C"].wait_ready()


# -- helpers ----------------------------------------------------------------------------------

def metrics(server: Server) -> dict:
    """{(name, ((label, value), ...)): value} without the model_name label."""
    out = {}
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        labels = tuple(sorted((k, v) for k, v in re.findall(r'(\w+)="([^"]*)"', m[2] or "")
                              if k != "model_name"))
        out[(m[1], labels)] = float(m[3])
    return out


def idle(server: Server, timeout: float = 10.0) -> dict:
    """Wait until nothing runs or waits; return the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m[("vllm:num_requests_running", ())] == 0 and \
                m[("vllm:num_requests_waiting", ())] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"gauges did not return to 0: {m}")
        time.sleep(0.05)


def sse_events(server: Server, path: str, body: dict, headers=None) -> list:
    """Every data: payload of a streamed request, parsed ([DONE] kept as the string)."""
    out = []
    with httpx.stream("POST", server.url + path, json=body, headers=headers,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def ok_request(server: Server, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                   json={"model": NAME, "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- tests ------------------------------------------------------------------------------------

def test_models_health_metrics(A):
    models = A.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(A.url + "/health").json() == {"status": "ok"}
    text = httpx.get(A.url + "/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum"):
        assert name in text, name


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_equals_nonstream(A, ref, chat):
    client = A.client()
    prompt, n = "def f(x):", 40
    want, res = ref.run(ref.ids(prompt, chat), n, 3)
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=n,
                                              temperature=0)
        text = full.choices[0].message.content
        chunks = list(client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        full = client.completions.create(model=NAME, prompt=prompt, max_tokens=n,
                                         temperature=0)
        text = full.choices[0].text
        chunks = list(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == streamed == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason is not None]
    assert finishes == [full.choices[0].finish_reason]
    assert finishes[0] == ("length" if res.finish_reason == "length" else "stop")
    # The usage chunk comes last, has no choices, and agrees with the non-streamed usage.
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.completion_tokens == len(res.tokens)
    assert full.usage.prompt_tokens == len(ref.ids(prompt, chat))
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done_and_stop_strings(A, ref):
    want, _ = ref.run(ref.ids("xyz"), 30, 3, ignore_eos=True)
    stop = want[10:12]
    events = sse_events(A, "/v1/completions", {"model": NAME, "prompt": "xyz",
                                               "max_tokens": 30, "temperature": 0,
                                               "ignore_eos": True, "stop": [stop],
                                               "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == want[: want.index(stop)]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "stop"


def _greedy_batch(server: Server, ref: Reference, k: int, clients: int, key: str = "x"):
    """Run PROMPTS (chat and not, some sampled with a seed) with `clients` concurrent
    clients; compare each with its own single-request Engine run."""
    client = server.client(key)
    jobs = [(p, i % 2 == 1, 0.0 if i % 3 else 0.8) for i, p in enumerate(PROMPTS)]

    def one(job):
        prompt, chat, temp = job
        kw = {"model": NAME, "max_tokens": 32, "temperature": temp, "seed": 1234}
        if chat:
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kw)
            return r.choices[0].message.content, r.usage.completion_tokens
        r = client.completions.create(prompt=prompt, **kw)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, jobs))
    for (prompt, chat, temp), (text, n) in zip(jobs, got, strict=True):
        want, res = ref.run(ref.ids(prompt, chat), 32, k, temperature=temp, seed=1234)
        assert (text, n) == (want, len(res.tokens)), (prompt, chat, temp)
    return got


@pytest.mark.parametrize("clients", [1, 8])
def test_outputs_match_engine_with_and_without_mtp(A, B, ref, clients):
    with_mtp = _greedy_batch(A, ref, 3, clients)
    without = _greedy_batch(B, ref, 0, clients, key=KEY)
    # Greedy requests (temperature 0): identical with MTP on and off.
    for i, (a, b) in enumerate(zip(with_mtp, without, strict=True)):
        if i % 3:
            assert a == b


def test_long_prompt_prefilled_in_chunks_matches_engine(A, ref):
    prompt = "".join(chr(32 + (i * 7919) % 95) for i in range(300))  # > 9 chunks of 32
    r = A.client().completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                      temperature=0)
    want, res = ref.run(ref.ids(prompt), 12, 3)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == 300 and r.usage.completion_tokens == len(res.tokens)


_LONG = "a" * 600
BAD = [  # (path, body (dict, or bytes sent raw), status, message part, param)
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0",
     "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "at least 1", "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 10, "max_tokens": 600}, 400, "context is 512 tokens",
     "max_tokens"),
    ("/v1/completions", {"prompt": _LONG}, 400, "the prompt has 600 tokens, which leaves no "
     "room for output in this model's context of 512 tokens", "prompt"),
    # Text that cannot fit whatever it tokenizes to: refused before tokenizing (5-character
    # pieces at most, so 6,000 characters are at least 600 tokens).
    ("/v1/completions", {"prompt": "ab" * 3000}, 400, "too long: its 6000 characters make at "
     "least", "prompt"),
    # Lone surrogates (JSON escapes that are no Unicode text), wherever text goes.
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "lone surrogate",
     "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400,
     "lone surrogate", "messages[0].content"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', 400, "lone surrogate",
     "stop"),
    ("/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', 400, "lone surrogate",
     "model"),
    # What Python's json reads but must not crash on: deep nesting, huge integers, NaN.
    ("/v1/completions", b'{"prompt": "a", "junk": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "nested too deeply", None),
    ("/v1/completions", b'{"prompt": "a", "junk": ' + b"9" * 5000 + b"}", 400,
     "integer too long", None),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "NaN is not a JSON number",
     None),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e400}', 400, "must be a finite "
     "number", "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70, "temperature": 1}, 400,
     "seed must be between", "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**70), "temperature": 1}, 400,
     "seed must be between", "seed"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, 400, "non-empty", "messages"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "'messages' is required", "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, 400, "must be an object", "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "role must be one of", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "content must be a string", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400,
     "content must be a string", "messages[0].content"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400,
     "invalid type for 'temperature'", "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "expected an integer",
     "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "expected a boolean", "stream"),
    ("/v1/completions", b'{"prompt": "x", ', 400, "not valid JSON", None),
    ("/v1/completions", b'["x"]', 400, "must be a JSON object", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "only allowed when 'stream' is true", "stream_options"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "'n' must be 1", "n"),
    ("/v1/completions", {"max_tokens": 3}, 400, "'prompt' is required", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": [5, 1000]}, 400, "outside the vocabulary", "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 7}, 400, "invalid type for 'stop'", "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "not supported", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -3}, 400, "at least 1",
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist", "model"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{i}-{c[3][:24]}" for i, c in enumerate(BAD)])
def test_bad_input_is_refused_and_the_next_request_works(A, case):
    path, body, status, part, param = case
    if isinstance(body, bytes):
        r = httpx.post(A.url + path, content=body, timeout=30,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(A.url + path, json={"model": NAME, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert part in err["message"] and err["param"] == param
    ok_request(A)


def test_request_body_limit_gives_413_before_the_body_is_read(A):
    big = {"model": NAME, "prompt": "a" * A_BODY_LIMIT, "max_tokens": 2}
    r = httpx.post(A.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit applies as the body arrives
        yield b'{"prompt": "'
        for _ in range(A_BODY_LIMIT // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    r = httpx.post(A.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok_request(A)


def test_tiny_temperature_is_greedy_and_no_max_tokens_takes_the_default(A, ref):
    want, _ = ref.run(ref.ids("def f(x):"), 8, 3)
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 8}
    for t in (1e-300, 1e-6):
        r = httpx.post(A.url + "/v1/completions", json={**body, "temperature": t}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    # A's --default-max-tokens 16 caps a request that names no max_tokens.
    r = httpx.post(A.url + "/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "abc", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_control_token_spellings_in_chat_stay_text(A, ref):
    content = "say<eos>more"
    msgs = [{"role": "user", "content": content}]
    ids = ref.tok.chat_ids(msgs)
    assert ref.tok.eos_token_id not in ids  # spelled out, character by character
    assert ref.tok.eos_token_id in ref.tok.chat_ids(msgs, special_text=False)
    want, _ = ref.run(ids, 6, 3)
    r = A.client().chat.completions.create(model=NAME, messages=msgs, max_tokens=6,
                                           temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)


def test_stalled_headers_are_cut_off(A):
    # A connection that never finishes its request head is closed after --header-timeout
    # (2 s on A); one that is served is not.
    with socket.create_connection(("127.0.0.1", A.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        s.settimeout(20)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server, not by our timeout
        assert 1.5 < time.monotonic() - t0 < 15
    with httpx.Client(base_url=A.url, timeout=30) as c:  # a kept-alive client
        for _ in range(2):
            r = c.post("/v1/completions", json={"model": NAME, "prompt": "abc",
                                                 "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200
    ok_request(A)


def test_served_connections_send_small_writes_at_once():
    """The server's listening socket names TCP, so that the connections asyncio accepts on
    it get TCP_NODELAY: without it each request after a connection's first had its streamed
    tokens held back by Nagle until the client's delayed ACK (about 40 ms, in one burst)."""
    from mtpkit.serve.app import _bind

    async def accepted_nodelay() -> int:
        sock = _bind("127.0.0.1", 0)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(got, 10)
            writer.close()
        finally:
            server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_other_http_errors_in_openai_shape(A):
    r = httpx.get(A.url + "/v1/nothing-here")
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = httpx.get(A.url + "/v1/completions")
    assert r.status_code == 405 and "message" in r.json()["error"]
    with pytest.raises(openai.BadRequestError) as e:
        A.client().completions.create(model=NAME, prompt="x", temperature=-0.5)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    ok_request(A)


def test_cancellation_storm_frees_every_slot(A):
    before = idle(A)

    async def storm():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=A.url, timeout=60, limits=limits) as c:
            async def one(i: int) -> None:
                body = {"model": NAME, "prompt": f"storm {i}", "max_tokens": 400,
                        "ignore_eos": True, "temperature": 0, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    if i % 2:
                        return  # abandoned at once, most likely while still queued
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return  # abandoned mid-stream

            await asyncio.gather(*(one(i) for i in range(100)))

    asyncio.run(storm())
    t0 = time.monotonic()
    r = A.client().completions.create(model=NAME, prompt="after the storm", max_tokens=16,
                                      temperature=0)
    assert time.monotonic() - t0 < 5.0
    assert r.choices[0].finish_reason in ("stop", "length")
    after = idle(A)
    aborted = after[("vllm:request_success_total", (("finished_reason", "abort"),))] - \
        before[("vllm:request_success_total", (("finished_reason", "abort"),))]
    assert aborted == 100
    assert httpx.get(A.url + "/health").status_code == 200


def test_counters_match_usage_and_engine(A, ref):
    before = idle(A)
    client = A.client()
    usage, want = [], []
    for i, p in enumerate(PROMPTS[:6]):
        kw = {"model": NAME, "max_tokens": 20 + i, "temperature": 0}
        if i % 2:
            chunks = list(client.completions.create(
                prompt=p, stream=True, stream_options={"include_usage": True}, **kw))
            usage.append(chunks[-1].usage)
        else:
            usage.append(client.completions.create(prompt=p, **kw).usage)
        want.append(ref.run(ref.ids(p), 20 + i, 3)[1].metrics)
    after = idle(A)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    done = sum(delta("vllm:request_success_total", (("finished_reason", r),))
               for r in ("stop", "length"))
    assert done == len(usage)
    assert delta("vllm:spec_decode_num_drafts_total") == sum(m.num_drafts for m in want)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == \
        sum(m.num_draft_tokens for m in want)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == \
        sum(m.num_accepted_tokens for m in want)
    for pos in range(3):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     (("position", str(pos)),)) == \
            sum(m.accepted_per_pos[pos] for m in want if len(m.accepted_per_pos) > pos)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(usage)


def test_api_key(B):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = httpx.post(B.url + "/v1/completions", json=body)
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    r = httpx.post(B.url + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "incorrect API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        B.client("wrong").models.list()
    r = httpx.post(B.url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert [m.id for m in B.client(KEY).models.list().data] == [NAME]
    assert httpx.get(B.url + "/health").status_code == 200
    assert httpx.get(B.url + "/metrics").status_code == 200


def _stream_in_thread(server: Server, body: dict, out: list, started: threading.Event):
    def run():
        events, error = [], None
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=60) as r:
                if r.status_code != 200:
                    events.append(("status", r.status_code))
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        started.set()
        except httpx.HTTPError as e:
            error = e
        started.set()
        out.append((events, error))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _post_into(server: Server, body: dict, out: list) -> None:
    out.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))


def test_queue_full_gives_429(C):
    """With both slots busy and the one-place queue taken, a request gets 429 queue_full;
    the streams it was refused beside all end normally."""
    body = {"model": NAME, "prompt": "q", "max_tokens": 450, "ignore_eos": True,
            "temperature": 0, "stream": True}
    # Two streams hold the slots, then two requests go out at once: the one that arrives
    # first takes the queue's place and the other is refused. (Sending the fourth only once
    # /metrics showed the third waiting left a window in which, on a loaded machine, a
    # 450-token stream of the tiny model ended: a slot freed, the queue emptied, and the
    # fourth was served.) A try in which a slot freed before both arrived (both served)
    # proves nothing either way and runs again; a server that never refuses fails.
    refused = None
    for _ in range(5):
        outs: list = []
        threads = []
        for _ in range(2):  # both slots busy
            ev = threading.Event()
            threads.append(_stream_in_thread(C, body, outs, ev))
            ev.wait(30)
        late: list = []
        pair = [threading.Thread(target=_post_into, args=(C, {**body, "stream": False}, late),
                                 daemon=True) for _ in range(2)]
        for t in pair:
            t.start()
        for t in threads + pair:
            t.join(60)
        assert all(ev and ev[-1] == "[DONE]" for ev, err in outs)
        codes = sorted(r.status_code for r in late)
        assert codes in ([200, 200], [200, 429]), [r.text for r in late]
        if codes == [200, 429]:
            refused = next(r for r in late if r.status_code == 429)
            break
    assert refused is not None, "no request was refused in five tries"
    assert refused.json()["error"]["code"] == "queue_full" and "queue is full" in \
        refused.json()["error"]["message"]
    ok_request(C)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_sigterm_under_load(C, ref):
    before = idle(C)[("vllm:e2e_request_latency_seconds_count", ())]
    want, _ = ref.run(ref.ids("term"), 400, 2, ignore_eos=True)
    body = {"model": NAME, "prompt": "term", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    outs: list = []
    started = [threading.Event() for _ in range(3)]
    threads = [_stream_in_thread(C, body, outs, ev) for ev in started]
    for ev in started[:2]:
        assert ev.wait(30)
    deadline = time.monotonic() + 10
    while True:  # all three accepted by the server (finished, running or queued)
        m = metrics(C)
        if m[("vllm:num_requests_running", ())] + m[("vllm:num_requests_waiting", ())] + \
                m[("vllm:e2e_request_latency_seconds_count", ())] - before >= 3:
            break
        assert time.monotonic() < deadline, (m, outs)
        time.sleep(0.01)
    kids = _children(C.proc.pid)
    C.proc.send_signal(signal.SIGTERM)
    # Draining: the socket stays open, new requests and /health get 503 (what load
    # balancers expect) while the requests in flight end.
    r = httpx.post(C.url + "/v1/completions", timeout=10,
                   json={"model": NAME, "prompt": "late", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    h = httpx.get(C.url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["status"] == "draining"
    C.proc.wait(30)
    assert C.proc.returncode in (0, -signal.SIGTERM), C.log()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert not [k for k in kids if Path(f"/proc/{k}").exists()]
    assert len(outs) == 3
    for events, error in outs:
        # Each request either finished (full text) or was aborted with an error event; both
        # end with [DONE]. None hangs or is cut off without a word.
        assert error is None and events and events[-1] == "[DONE]", (events, error)
        last = events[-2]
        if "error" in last:
            assert last["error"]["code"] == "aborted"
        else:
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            assert text == want and last["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(C.url + "/health", timeout=5)


# -- in-process: the scheduler's turns and a failing engine -----------------------------------

def _scheduler(ref: Reference, stats=None, fast: bool = False, **kw):
    from mtpkit.engine.fast import FastDecoder
    from mtpkit.serve.scheduler import Scheduler

    args = {"drafter": ref.engine.drafter, "num_draft_tokens": 3, "max_num_seqs": 4,
            "max_queue": 8, "max_model_len": 512, "prefill_chunk": 16, **kw}
    if fast:
        # What `mtpkit serve` gives greedy requests by default (uncompiled programs).
        args["fast"] = FastDecoder(ref.model, backend="eager", max_len=512)
    return Scheduler(ref.model, ref.tok, stats=stats, **args)


def _run_all(sched, reqs, done) -> None:
    """Submit every request to the scheduler, wait for each done event, stop it."""
    try:
        for r in reqs:
            sched.submit(r)
        for e in done:
            assert e.wait(120)
    finally:
        sched.stop()


def _served_texts(sched, ref: Reference, prompts: list[str], temps: list[float],
                  max_tokens: int, seed: int) -> list[str]:
    """Submit one request a prompt to the scheduler at once (seeded where sampled), wait
    for all, stop the scheduler -> the text each request streamed."""
    from mtpkit.serve.scheduler import Request

    done = {i: threading.Event() for i in range(len(prompts))}
    texts = dict.fromkeys(range(len(prompts)), "")

    def on_event(i):
        def f(ev):
            if ev[0] == "text":
                texts[i] += ev[1]
            else:
                done[i].set()
        return f

    reqs = [Request(str(i), ref.ids(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                        temperature=t, seed=seed), on_event(i))
            for i, (p, t) in enumerate(zip(prompts, temps, strict=True))]
    _run_all(sched, reqs, done.values())
    return [texts[i] for i in range(len(prompts))]


def test_a_rounds_events_reach_the_server_in_one_delivery(ref):
    """With ``deliver`` (what the server passes), the events the engine thread posts in a
    round go out in one call: several requests' events a call, each request's in order,
    none through its on_event; the text is the engine's."""
    from mtpkit.serve.scheduler import Request

    deliveries: list[int] = []
    direct: list[tuple] = []
    texts: dict[str, str] = {}
    done = {str(i): threading.Event() for i in range(3)}

    def take(rid, ev):
        if ev[0] == "text":
            texts[rid] = texts.get(rid, "") + ev[1]
        else:
            done[rid].set()

    def deliver(items):
        deliveries.append(len(items))
        for req, ev in items:
            take(req.id, ev)

    sched = _scheduler(ref, fast=True, deliver=deliver)
    prompts = ["def f(x):", "import os\n", "class A:\n    pass\n"]
    reqs = [Request(str(i), ref.ids(p), SamplingParams(max_tokens=16, ignore_eos=True,
                                                        temperature=0), direct.append)
            for i, p in enumerate(prompts)]
    _run_all(sched, reqs, done.values())
    assert not direct
    assert max(deliveries) > 1 and len(deliveries) < sum(deliveries)
    for r, p in zip(reqs, prompts, strict=True):
        want, _ = ref.run(ref.ids(p), 16, 3, ignore_eos=True)
        assert texts[r.id] == want and r.finish_reason == "length"


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "fast"])
def test_long_prefill_is_interleaved_with_running_streams(ref, fast):
    from mtpkit.serve.prometheus import ServeStats
    from mtpkit.serve.scheduler import Request

    turns: list[tuple[str, int]] = []

    class Recording(ServeStats):
        def turn(self, worker):
            turns.append((worker.req.id, worker.req.completion_tokens))
            super().turn(worker)

    sched = _scheduler(ref, Recording("t"), fast=fast)
    done = {"a": threading.Event(), "b": threading.Event()}

    texts = {"a": "", "b": ""}

    def req(rid, prompt, n):
        def on_event(ev):
            if ev[0] == "text":
                texts[rid] += ev[1]
            else:
                done[rid].set()
        return Request(rid, ref.ids(prompt), SamplingParams(max_tokens=n, ignore_eos=True,
                                                            temperature=0), on_event)

    try:
        a = req("a", "short", 400)
        sched.submit(a)
        while a.completion_tokens < 3:
            time.sleep(0.001)
        long_prompt = "".join(chr(32 + (i * 31) % 95) for i in range(200))
        b = req("b", long_prompt, 12)
        sched.submit(b)
        assert done["b"].wait(60)
        sched.abort(a)
        assert done["a"].wait(60)
    finally:
        sched.stop()
    first_b = turns.index(next(t for t in turns if t[0] == "b"))
    first_token = next(i for i, t in enumerate(turns) if t[0] == "b" and t[1] > 0)
    # 200 prompt tokens in chunks of 16: b needs >= 13 turns before its first token, and
    # the running stream gets a turn between every two of them.
    a_turns = sum(1 for t in turns[first_b:first_token] if t[0] == "a")
    assert first_token - first_b >= 2 * 12 and a_turns >= 12
    # Prefill and MTP catch-up in 16-token pieces give the one-pass run's tokens.
    want, _ = ref.run(b.prompt_ids, 12, 3, ignore_eos=True)
    assert texts["b"] == want and b.completion_tokens == 12 and b.finish_reason == "length"
    assert a.finish_reason == "abort"
    if fast:
        assert sum(s._fast is not None for s in sched._free) == 2  # both ran the fast path


@pytest.mark.parametrize("packed, fast", [(True, False), (False, False), (True, True)],
                         ids=["packed", "alone", "fast"])
def test_concurrent_sequences_share_one_trunk_forward(ref, packed, fast, monkeypatch):
    """Running sequences verify, decode and prefill in one packed forward per step; each gets
    the tokens of a single-request run (greedy and seeded sampling), whatever it runs beside.
    With the fast path, greedy requests run its programs (a slot's own caches) between the
    sampled request's packed steps, with the same tokens."""
    from mtpkit import threads
    from mtpkit.serve.scheduler import _Worker

    # Request threads compute alone: no OpenMP team beside the engine thread's (which would
    # make its workers sleep between regions), whatever their steps call.
    teams: list[int] = []
    real_decode = _Worker._decode

    def decode(self):
        try:
            return real_decode(self)
        finally:
            teams.append(torch.get_num_threads())

    monkeypatch.setattr(_Worker, "_decode", decode)
    monkeypatch.setattr(threads, "_governor", None)
    threads.configure(2)  # a team to leave (the tests run with one thread otherwise)
    sched = _scheduler(ref, packed=packed, fast=fast)
    prompts = ["def f(x):", "import os\n", "a" * 40, "class A:\n    pass\n" * 3, "x"]
    temps = [0.0, 0.0, 0.0, 0.8, 0.0]
    texts = _served_texts(sched, ref, prompts, temps, 24, 7)
    assert sched.packed == packed
    # With the fast path the greedy requests' steps share one trunk pass (the sampled
    # request runs the eager engine alone).
    assert (sched.packed_steps > 10) == (packed or fast)
    if fast:
        assert sum(s._fast is not None for s in sched._free) >= 3  # greedy slots forked
    torch.set_num_threads(1)
    for i, (p, t) in enumerate(zip(prompts, temps, strict=True)):
        want, _ = ref.run(ref.ids(p), 24, 3, ignore_eos=True, temperature=t, seed=7)
        assert texts[i] == want, p
    assert set(teams) == ({1} if not fast else set())  # the fast path runs no such thread


@pytest.mark.parametrize("family", ["qwen3_next_moe", "deepseek_v3", "mimo_v2_flash"])
def test_hybrid_and_mla_trunks_pack_their_sequences(family, checkpoint_factory, tmp_path):
    """Hybrid Gated-DeltaNet (Qwen3-Next), MLA (DeepSeek-V3) and sliding-window trunks with
    sinks (MiMo-V2-Flash) serve concurrent sequences in packed forwards too: each keeps the
    tokens of its single-request run (greedy and seeded sampling, MTP drafts rejected and
    rolled back in every recurrent layer, prompts in pieces)."""
    import shutil

    import tiny

    out = tmp_path / "m"
    shutil.copytree(checkpoint_factory(family), out)
    tiny.write_char_tokenizer(out)
    fam_ref = Reference(out)
    sched = _scheduler(fam_ref, packed=True)
    prompts = ["def f(x):", "import os\n", "a" * 40, "x"]
    temps = [0.0, 0.0, 0.8, 0.0]
    texts = _served_texts(sched, fam_ref, prompts, temps, 20, 3)
    assert sched.packed and sched.packed_steps > 10
    drafted = 0
    for i, (p, t) in enumerate(zip(prompts, temps, strict=True)):
        want, res = fam_ref.run(fam_ref.ids(p), 20, 3, ignore_eos=True, temperature=t, seed=3)
        assert texts[i] == want, p
        drafted += res.metrics.num_draft_tokens - res.metrics.num_accepted_tokens
    assert drafted > 0  # drafts were rejected, so caches rolled back


def test_failed_packed_forward_fails_only_what_cannot_roll_back(engine_factory):
    """A packed forward that fails after its layers ran: a sequence whose recurrent layers
    took a long prompt piece (no snapshot to return to) fails with the error; one whose
    step was short goes back to its position and runs alone, with its lone output."""
    from types import SimpleNamespace

    from mtpkit.serve.scheduler import Scheduler

    model = engine_factory("qwen3_next_moe").model

    class FailsAfter:
        """The model, whose packed forward fails once every layer has run."""

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, ids, cache=None):
            return model(ids, cache)

        def forward_packed(self, items):
            model.forward_packed(items)
            raise RuntimeError("injected fault")

    g = torch.Generator().manual_seed(2)
    long_ids, head, short = (torch.randint(0, 90, (1, n), generator=g) for n in (24, 5, 2))
    solo, b = model.new_cache(64), model.new_cache(64)
    with torch.no_grad():
        model(head, solo)
        model(head, b)
        want = model(short, solo)
    workers = [SimpleNamespace(job=(long_ids, model.new_cache(64)), job_out=None),
               SimpleNamespace(job=(short, b), job_out=None)]
    sched = Scheduler.__new__(Scheduler)
    sched.model, sched._running, sched.packed_steps = FailsAfter(), workers, 0
    sched._run_jobs()
    assert isinstance(workers[0].job_out, RuntimeError) and workers[0].job is None
    assert str(workers[0].job_out) == "injected fault"
    got = workers[1].job_out
    assert (model.logits(got.hidden) - model.logits(want.hidden)).abs().max() < 1e-5
    assert b.length == solo.length == 7 and sched.packed_steps == 0


def test_engine_failure_gives_500_and_the_engine_goes_on(ref, model_dir):
    from mtpkit.serve.app import ServeConfig, ServerState, create_app

    # The eager engine's failures (the fault is injected into its model; compile="off"
    # keeps greedy requests off the fast path).
    state = ServerState(ServeConfig(model=str(model_dir), served_model_name=NAME,
                                    num_draft_tokens=3, max_num_seqs=2, compile="off"))
    state._load()
    poison = ref.tok.encode("~")[0]

    class Faulty:
        """The model, except that a prompt containing '~' breaks it."""

        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, ids, cache=None):
            if poison in ids[0].tolist():
                raise RuntimeError("injected fault")
            return self.model(ids, cache)

        def forward_packed(self, items):
            if any(poison in ids[0].tolist() for ids, _ in items):
                raise RuntimeError("injected fault")
            return self.model.forward_packed(items)

    for slot in state.sched._free:
        slot.model._model = Faulty(slot.model._model)
    state.sched.model = Faulty(state.sched.model)  # the packed steps' forward
    app = create_app(state)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"model": NAME, "prompt": "a~b", "max_tokens": 8, "temperature": 0}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "internal_error"
            # No Python internals reach the client; the log keeps them.
            msg = r.json()["error"]["message"]
            assert "server log" in msg and "fault" not in msg and "RuntimeError" not in msg
            r = await c.post("/v1/completions", json={**body, "stream": True})
            lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["error"]["code"] == "internal_error"
            r = await c.post("/v1/completions", json={**body, "prompt": "fine"})
            assert r.status_code == 200
            want, _ = ref.run(ref.ids("fine"), 8, 3)
            assert r.json()["choices"][0]["text"] == want
            assert (await c.get("/health")).status_code == 200
            m = (await c.get("/metrics")).text
            assert 'finished_reason="error"} 2' in m

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            asyncio.run(go())
    finally:
        state.sched.stop()


def test_health_loading_stall_and_disconnect(ref, model_dir):
    """503 while loading; 503 while the engine makes no progress; a client that hangs up on
    a non-streamed request has it aborted and its slot freed (driven at the ASGI level)."""
    from mtpkit.serve.app import ServeConfig, ServerState, create_app

    state = ServerState(ServeConfig(model=str(model_dir), served_model_name=NAME,
                                    num_draft_tokens=3, max_num_seqs=2, stall_timeout=0.3,
                                    compile="off"))
    app = create_app(state)
    gate, blocked = threading.Event(), threading.Event()
    slow = ref.tok.encode("^")[0]

    class Gated:
        """The model, except that a prompt containing '^' waits for the gate."""

        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, ids, cache=None):
            if slow in ids[0].tolist():
                blocked.set()
                gate.wait(30)
            return self.model(ids, cache)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
            await asyncio.to_thread(state._load)
            for slot in state.sched._free:
                slot.model._model = Gated(slot.model._model)
            state.sched.model = Gated(state.sched.model)  # the packed steps' forward
            assert (await c.get("/health")).status_code == 200

            hangup = asyncio.Event()
            body = json.dumps({"prompt": "a^b", "max_tokens": 8, "temperature": 0}).encode()
            sent: list[dict] = []
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop(0)
                await hangup.wait()
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                     "http_version": "1.1", "method": "POST", "scheme": "http",
                     "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers":
                     [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                     "server": ("t", 80)}
            call = asyncio.ensure_future(app(scope, receive, send))
            assert await asyncio.to_thread(blocked.wait, 30)
            await asyncio.sleep(0.4)
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "stalled"
            hangup.set()  # the client goes away while its request is stuck in the engine
            await asyncio.wait_for(call, 10)
            gate.set()
            deadline = time.monotonic() + 10
            while state.sched.num_running:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert (await c.get("/health")).status_code == 200
            m = (await c.get("/metrics")).text
            assert 'finished_reason="abort"} 1' in m
            r = await c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4,
                                                      "temperature": 0})
            assert r.status_code == 200

            # Shutdown with a request still running past the grace period: its stream ends
            # with an error event and [DONE]; new requests get 503.
            gate.clear()
            blocked.clear()
            state.cfg.shutdown_timeout = 0.0
            body = {"prompt": "^^", "max_tokens": 8, "temperature": 0, "stream": True}
            streaming = asyncio.ensure_future(c.post("/v1/completions", json=body))
            assert await asyncio.to_thread(blocked.wait, 30)
            state.begin_shutdown()
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            gate.set()
            r = await asyncio.wait_for(streaming, 30)
            lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            err = json.loads(lines[-2])["error"]
            assert err["code"] == "aborted" and "shut down" in err["message"]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            asyncio.run(go())
    finally:
        gate.set()
        if state.sched is not None:
            state.sched.stop()


def test_missing_programs_are_built_in_the_background(model_dir, tmp_path, monkeypatch):
    """With --compile auto and programs not built, `mtpkit serve` starts `mtpkit warmup`
    for the same model, head, draft length and thread count at the lowest priority (the
    child is faked here: a real build takes minutes), says so, and stops it on exit."""
    import subprocess

    import mtpkit.serve.app as app_mod
    from mtpkit.serve.app import ServeConfig, ServerState

    monkeypatch.setenv("MTPKIT_COMPILE_CACHE", str(tmp_path))
    started = []
    real = subprocess.Popen

    class Child:
        pid = 4242

        def __new__(cls, cmd, **kw):
            if "warmup" not in cmd:  # the kernels' build, for one
                return real(cmd, **kw)
            return super().__new__(cls)

        def __init__(self, cmd, **kw):
            self.cmd, self.kw, self.ended = cmd, kw, None
            started.append(self)

        def poll(self):
            return self.ended

        def terminate(self):
            self.ended = -15

        def wait(self, timeout=None):
            return self.ended

    monkeypatch.setattr(subprocess, "Popen", Child)
    cfg = ServeConfig(model=str(model_dir), served_model_name=NAME, num_draft_tokens=2,
                      max_num_seqs=1, background_build=True, threads=1)
    state = ServerState(cfg)
    state._load()
    try:
        assert len(started) == 1 and state.builder is started[0]
        cmd = started[0].cmd
        assert cmd[1:4] == ["-m", "mtpkit.cli", "warmup"]
        flags = dict(zip(cmd[4::2], cmd[5::2], strict=False))
        assert flags["-k"] == "2" and flags["--threads"] == "1"
        assert flags["--model"] == str(model_dir)
        assert started[0].kw["preexec_fn"] is not None  # os.nice(19) in the child
        assert (tmp_path / "background-warmup.log").exists()
        app_mod._stop_builder(state.builder)
        assert started[0].ended == -15
        # Off (the default for embedded servers) or nothing missing: no child.
        ServerState(ServeConfig(model=str(model_dir), served_model_name=NAME,
                                max_num_seqs=1))._load()
        assert len(started) == 1
    finally:
        state.sched.stop()
