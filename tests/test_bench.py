"""`mtpkit bench`: the offline k-sweep and compare on a tiny model, serve against a stub
OpenAI-compatible server started here (streams with known delays, vLLM-style counters)."""

from __future__ import annotations

import asyncio
import csv
import inspect
import json
import re
import shutil
import socket
import statistics
import threading
import time
import warnings

import pytest
from fastapi import Request

from mtpkit.cli import main


def _run(capsys, *args):
    code = main(["bench", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# -- offline ---------------------------------------------------------------------------------
def test_offline_sweep_writes_consistent_results(model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    code, stdout, err = _run(capsys, "offline", "--model", str(model_dir), "--k", "1,2",
                             "--max-tokens", "10", "--ignore-eos", "--out", str(out))
    assert code == 0, err
    for name in ("results.json", "summary.csv", "runs.csv", "speedup.png", "acceptance.png",
                 "tokens_per_s.png"):
        data = (out / name).read_bytes()
        assert data, name
        if name.endswith(".png"):
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp files behind
    res = json.loads((out / "results.json").read_text())
    per_k = {r["k"]: r for r in res["per_k"]}
    assert sorted(per_k) == [0, 1, 2]  # k=0 is always measured: it is the baseline
    assert res["identical_across_k"] and all(r["identical_to_k0"] for r in per_k.values())
    n_prompts = len(res["prompts"])
    # The k values took turns on each prompt, their order rotated by one per prompt.
    order = [[x["k"] for x in res["runs"] if x["prompt"] == i] for i in range(n_prompts)]
    assert order == [([0, 1, 2] * 2)[i % 3:i % 3 + 3] for i in range(n_prompts)]
    # Every figure is recomputed here from the per-run records.
    for k, r in per_k.items():
        runs = [x for x in res["runs"] if x["k"] == k]
        assert len(runs) == n_prompts
        assert all(x["generated_tokens"] == 10 for x in runs)  # --ignore-eos
        decode_s = sum(x["elapsed_s"] - x["ttft_s"] for x in runs)
        assert r["tokens_per_s"] == pytest.approx(9 * n_prompts / decode_s, rel=1e-6)
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / per_k[0]["tokens_per_s"])
        assert r["bound_tokens_per_s"] > 0
        if k:
            drafts = sum(x["num_drafts"] for x in runs)
            acc = sum(x["num_accepted_tokens"] for x in runs)
            assert drafts > 0 and r["mean_acceptance_length"] == pytest.approx(1 + acc / drafts)
            assert len(r["per_position_acceptance_rate"]) == k
    # The recommendation is the fastest k (all are identical here).
    fastest = max(per_k.values(), key=lambda r: r["tokens_per_s"])["k"]
    assert res["recommended_k"] == fastest
    assert res["bandwidth_gbs"] > 0.1
    assert f"recommended k: {fastest}" in stdout
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [int(r["k"]) for r in rows] == [0, 1, 2]


def test_offline_acceptance_agrees_with_eval(model_dir, tmp_path, capsys):
    """The sweep's figures at k equal `mtpkit eval --mode generate` on the same prompts."""
    import csv as csv_mod

    from mtpkit.checkpoint.tokenizer import Tokenizer
    from mtpkit.train.data import iter_chunks

    # One line of printable text: the character tokenizer round-trips it exactly, so that
    # prompt texts written to a file encode back to the token chunks eval cuts.
    data = tmp_path / "data.txt"
    data.write_text(" ".join(inspect.getsource(csv_mod).split()))
    code = main(["eval", "--model", str(model_dir), "--data", str(data), "-k", "2",
                 "--mode", "generate", "--prompts", "3", "--max-tokens", "12", "--json"])
    ev = json.loads(capsys.readouterr().out)
    assert code == 0
    tok = Tokenizer.from_hf_dir(model_dir)
    chunks = [c for _, c in zip(range(3), iter_chunks(tok, [str(data)], 64), strict=False)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": tok.decode(c)}) + "\n" for c in chunks))
    assert [tok.encode(tok.decode(c)) for c in chunks] == chunks
    res_dir = tmp_path / "res"
    code, _, err = _run(capsys, "offline", "--model", str(model_dir), "--k", "0,2",
                        "--prompts", str(prompts), "--max-tokens", "12", "--out", str(res_dir),
                        "--no-bandwidth")
    assert code == 0, err
    k2 = next(r for r in json.loads((res_dir / "results.json").read_text())["per_k"]
              if r["k"] == 2)
    assert ev["num_drafts"] > 0
    # (eval's JSON reuses the key num_draft_tokens for k, so the draft-token count is
    # compared through acceptance_rate = accepted / draft tokens.)
    for key in ("num_drafts", "num_accepted_tokens", "acceptance_rate",
                "per_position_acceptance_rate", "mean_acceptance_length", "generated_tokens"):
        assert k2[key] == pytest.approx(ev[key]), key
    assert k2["num_accepted_tokens_per_pos"] == ev["num_accepted_tokens_per_pos"]
    assert k2["identical_to_k0"] and ev["identical_to_no_mtp"]


def test_offline_user_mistakes_are_one_line(model_dir, tmp_path, capsys):
    for args, message in (
        (["--k", "0,x"], "--k: 'x' is not an integer"),
        (["--k", "-1"], "--k: -1 is outside"),
        (["--k", ""], "--k needs a comma-separated list"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--prompts", str(tmp_path / "none.jsonl")], "no such prompt file"),
    ):
        code, _, err = _run(capsys, "offline", "--model", str(model_dir), *args)
        assert code == 2 and err.startswith("error: ") and message in err, (args, err)
        assert "Traceback" not in err
    # A model without a head can only be measured at k=0.
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "model_mtp.safetensors").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = _run(capsys, "offline", "--model", str(bare), "--k", "0,1")
    assert code == 2 and "has no MTP head" in err


# -- serve: a stub OpenAI-compatible server --------------------------------------------------
FIRST_DELAY, GAP, CHUNKS = 0.15, 0.04, 5
# Counters one request adds on the stub, and their starting values.
PER_REQ = {"drafts": 4, "draft_tokens": 12, "accepted": 6, "per_pos": [3, 2, 1]}
START = {"drafts": 1000, "draft_tokens": 3000, "accepted": 1400, "per_pos": [600, 500, 300]}


class Stub:
    """A streaming OpenAI-style server in a thread; ``fail_every`` requests end in an error
    event, ``usage`` sends a final usage chunk claiming two tokens a chunk."""

    def __init__(self, fail_every=0, usage=True, metrics=True, loading_polls=0):
        self.fail_every, self.usage, self.metrics = fail_every, usage, metrics
        # /health answers 503 this many times (a model still loading), and so do requests.
        self.loading_polls, self.health_calls = loading_polls, 0
        self.n = 0
        self.counts = {k: (list(v) if isinstance(v, list) else v) for k, v in START.items()}
        self.bodies = []

    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        @app.get("/health")
        async def health():
            self.health_calls += 1
            if self.health_calls <= self.loading_polls:
                return JSONResponse({"status": "loading"}, 503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics():
            if not self.metrics:
                return PlainTextResponse("not here", status_code=404)
            return PlainTextResponse(self.prometheus())

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.n += 1
            fail = self.fail_every and self.n % self.fail_every == 0
            return StreamingResponse(self.stream(fail), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            if self.health_calls <= self.loading_polls:
                return JSONResponse({"error": {"message": "the model is still loading",
                                               "code": "model_loading"}}, 503)
            body = await request.json()
            self.bodies.append(body)
            self.n += 1
            fail = self.fail_every and self.n % self.fail_every == 0
            return StreamingResponse(self.stream(fail, chat=False),
                                     media_type="text/event-stream")

        return app

    async def stream(self, fail, chat=True):
        def sse(obj):
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(delta, finish=None):
            if not chat:  # /v1/completions streams text, not deltas
                return sse({"id": "x", "object": "text_completion", "model": "stub-model",
                            "choices": [{"index": 0, "text": delta.get("content", ""),
                                         "finish_reason": finish}]})
            return sse({"id": "x", "object": "chat.completion.chunk", "model": "stub-model",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        if chat:
            yield chunk({"role": "assistant", "content": ""})  # not a token: TTFT must wait
        await asyncio.sleep(FIRST_DELAY)
        for i in range(CHUNKS):
            if i:
                await asyncio.sleep(GAP)
            if fail and i == 2:
                yield sse({"error": {"message": "boom: engine died", "code": 500}})
                return
            yield chunk({"content": f"tok{i} "})
        yield chunk({}, "length")
        for key in ("drafts", "draft_tokens", "accepted"):
            self.counts[key] += PER_REQ[key]
        self.counts["per_pos"] = [a + b for a, b in zip(self.counts["per_pos"],
                                                        PER_REQ["per_pos"], strict=True)]
        if self.usage:
            yield sse({"id": "x", "object": "chat.completion.chunk", "choices": [],
                       "usage": {"prompt_tokens": 7, "completion_tokens": 2 * CHUNKS,
                                 "total_tokens": 7 + 2 * CHUNKS}})
        yield "data: [DONE]\n\n"

    def prometheus(self):
        c = self.counts
        lab = 'engine="0",model_name="stub-model"'
        lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
                 "# TYPE vllm:spec_decode_num_drafts_total counter"]
        for name, key in (("num_drafts", "drafts"), ("num_draft_tokens", "draft_tokens"),
                          ("num_accepted_tokens", "accepted")):
            lines.append(f"vllm:spec_decode_{name}_total{{{lab}}} {float(c[key])}")
            # A second engine whose counters do not move: summed in, cancelled by the delta.
            lines.append(f'vllm:spec_decode_{name}_total{{engine="1"}} 17.0')
            lines.append(f"vllm:spec_decode_{name}_created{{{lab}}} 1.7e9")
        for p, v in enumerate(c["per_pos"]):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},'
                         f'position="{p}"}} {float(v)}')
        lines.append('vllm:num_requests_running{engine="0"} 0.0')
        return "\n".join(lines) + "\n"

    def __enter__(self):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        cfg = uvicorn.Config(self.app(), log_level="error", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "stub server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _serve(capsys, tmp_path, stub, *extra, levels="1,2", n=4):
    save = tmp_path / "records.json"
    code, out, err = _run(capsys, "serve", "--url", stub.url, "--concurrency", levels,
                          "--num-prompts", str(n), "--max-tokens", "16", "--save", str(save),
                          *extra)
    return code, out, err, (json.loads(save.read_text()) if save.exists() else None)


def test_serve_latencies_and_spec_counters(tmp_path, capsys):
    with Stub() as stub:
        code, out, err, res = _serve(capsys, tmp_path, stub)
    assert code == 0, err
    assert res["model"] == "stub-model"  # found through /v1/models
    body = stub.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "stub-model" and body["max_tokens"] == 16
    slack = 0.5  # the machine is shared: delays only ever grow
    for lv in res["levels"]:
        assert lv["completed"] == 4 and lv["failures"] == 0
        for r in lv["records"]:
            assert r["success"] and r["chunks"] == CHUNKS
            assert r["output_tokens"] == 2 * CHUNKS  # from the usage chunk, not chunk count
            assert FIRST_DELAY - 0.01 <= r["ttft_s"] <= FIRST_DELAY + slack
            assert len(r["itl_s"]) == CHUNKS - 1
            assert all(GAP - 0.01 <= x <= GAP + slack for x in r["itl_s"])
            e2e = FIRST_DELAY + (CHUNKS - 1) * GAP
            assert e2e - 0.02 <= r["latency_s"] <= e2e + slack
            assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"])
                                                / (2 * CHUNKS - 1))
        lat = [r["latency_s"] for r in lv["records"]]
        assert lv["e2e_latency_s"]["mean"] == pytest.approx(sum(lat) / len(lat))
        assert lv["e2e_latency_s"]["median"] == pytest.approx(statistics.median(lat))
        assert lv["ttft_s"]["p99"] <= max(r["ttft_s"] for r in lv["records"]) + 1e-12
        assert lv["itl_s"]["n"] == 4 * (CHUNKS - 1)
        assert lv["output_tokens"] == 4 * 2 * CHUNKS
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
        assert lv["requests_per_s"] == pytest.approx(4 / lv["duration_s"])
        # Four requests one at a time take at least four latencies; two at a time, two.
        assert lv["duration_s"] >= 4 / lv["concurrency"] * (FIRST_DELAY + (CHUNKS - 1) * GAP)
        # The counters moved by exactly what this level's requests added on the stub.
        s = lv["spec_decode"]
        assert s["num_drafts"] == 4 * PER_REQ["drafts"]
        assert s["num_draft_tokens"] == 4 * PER_REQ["draft_tokens"]
        assert s["num_accepted_tokens"] == 4 * PER_REQ["accepted"]
        assert s["num_accepted_tokens_per_pos"] == [4 * x for x in PER_REQ["per_pos"]]
        assert s["acceptance_rate"] == pytest.approx(PER_REQ["accepted"]
                                                     / PER_REQ["draft_tokens"])
        assert s["mean_acceptance_length"] == pytest.approx(1 + PER_REQ["accepted"]
                                                            / PER_REQ["drafts"])
        assert s["per_position_acceptance_rate"] == pytest.approx(
            [x / PER_REQ["drafts"] for x in PER_REQ["per_pos"]])
    assert "TTFT p99 ms" in out and "spec: mean acceptance length" in out


def test_serve_waits_for_a_loading_server(tmp_path, capsys):
    """A server still loading its model (/health 503, requests 503, as mtpkit serve and
    llama-server answer then) is waited for: every request of every level succeeds."""
    with Stub(loading_polls=3) as stub:
        code, _, err, res = _serve(capsys, tmp_path, stub, "--endpoint", "completions")
    assert code == 0, err
    assert stub.health_calls == 4 and "finish loading" in err
    assert [lv["completed"] for lv in res["levels"]] == [4, 4]


class _Closer:
    """A raw HTTP/1.1 server that, as llama-server does, closes a connection shortly after
    each streamed response without saying so (no ``Connection: close``); other requests
    are answered on a kept-alive connection."""

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def handle(self, reader, writer):
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                size = re.search(r"(?i)content-length: *(\d+)", head)
                if size:
                    await reader.readexactly(int(size.group(1)))
                if head.startswith("POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    for i in range(3):
                        event = json.dumps({"choices": [{"index": 0, "text": f"t{i} ",
                                                         "finish_reason": None}]})
                        data = f"data: {event}\n\n".encode()
                        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                    done = b"data: [DONE]\n\n"
                    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                    await writer.drain()
                    await asyncio.sleep(0.05)  # a next request sent meanwhile is lost
                    break
                body = b'{"data": [{"id": "closer"}]}' if "/models" in head else b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def test_serve_against_a_server_that_closes_after_each_stream(tmp_path, capsys):
    """llama-server closes a connection after a stream without a ``Connection: close``: the
    client must not send the next request down it (every request of a level succeeds)."""
    with _Closer() as closer:
        code, _, err, res = _serve(capsys, tmp_path, closer, "--endpoint", "completions",
                                   levels="1", n=4)
    assert code == 0, err
    assert res["levels"][0]["completed"] == 4, res["levels"][0]


def test_serve_with_a_peer_runs_levels_in_turn(tmp_path, capsys, monkeypatch):
    """--url with --llama-server: every level on both servers before the next level, the
    order reversed level by level (a drift in the machine's speed falls on both alike);
    each server's record holds all its levels in order."""
    import contextlib

    from mtpkit.bench import peers

    order = []
    with Stub() as ours, Stub() as peer:
        for stub, name in ((ours, "ours"), (peer, "peer")):
            seen = stub.stream

            async def stream(fail, chat=True, seen=seen, name=name):
                order.append(name)
                async for piece in seen(fail, chat):
                    yield piece

            stub.stream = stream

        @contextlib.contextmanager
        def fake_llama_server(binary, gguf, slots, threads=None):
            assert slots == 3  # one slot per request of the highest concurrency
            yield peer.url

        monkeypatch.setattr(peers, "llama_server", fake_llama_server)
        code, out, err, res = _serve(capsys, tmp_path, ours, "--endpoint", "completions",
                                     "--llama-server", "llama-server", levels="1,2,3", n=2)
    assert code == 0, err
    runs = [name for i, name in enumerate(order) if i % 2 == 0]  # two requests a level
    assert runs == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert [r["url"] for r in res] == [ours.url, peer.url]
    for r in res:
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 2, 3]
        assert all(lv["completed"] == 2 for lv in r["levels"])
    assert err.count(f"{peer.url} concurrency") == 3


def test_serve_error_event_mid_stream_is_a_failure(tmp_path, capsys):
    with Stub(fail_every=2, usage=False, metrics=False) as stub:
        code, out, err, res = _serve(capsys, tmp_path, stub, "--model", "stub-model",
                                     "--endpoint", "completions", levels="2", n=6)
    assert code == 0, err  # some requests succeeded
    assert all("prompt" in b and "messages" not in b for b in stub.bodies)
    lv = res["levels"][0]
    assert lv["requests"] == 6 and lv["failures"] == 3 and lv["completed"] == 3
    failed = [r for r in lv["records"] if not r["success"]]
    assert all("boom: engine died" in r["error"] for r in failed)
    ok = [r for r in lv["records"] if r["success"]]
    # Without a usage chunk, tokens are counted as content chunks.
    assert all(r["output_tokens"] == CHUNKS for r in ok)
    assert lv["output_tokens"] == 3 * CHUNKS
    assert lv["ttft_s"]["n"] == 3  # failures are left out of the latency figures
    assert lv["spec_decode"] is None and "no spec-decode counters" in out
    assert "boom: engine died" in out


def test_serve_user_mistakes_are_one_line(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    for args, message in (
        (["--url", f"http://127.0.0.1:{port}"], "cannot reach the server"),
        (["--url", "localhost:8000"], "is not an http(s) URL"),
        (["--url", "http://127.0.0.1:1", "--concurrency", "1,0"], "--concurrency: 0 is outside"),
        (["--url", "http://127.0.0.1:1", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    ):
        code, _, err = _run(capsys, "serve", *args)
        assert code == 2 and err.startswith("error: ") and message in err, (args, err)


# -- compare ---------------------------------------------------------------------------------
def test_compare_with_transformers(model_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from mtpkit.bench.compare import llama_cpp_available

    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))  # the Q8_0 GGUF goes there
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ("def f(x):", "abc abc abc", "Hello world")))
    out = tmp_path / "cmp"
    code, stdout, err = _run(capsys, "compare", "--model", str(model_dir), "--prompts",
                             str(prompts), "--max-tokens", "12", "--k", "2", "--out", str(out))
    assert code == 0, err
    res = json.loads((out / "results.json").read_text())
    rows = {r["engine"]: r for r in res["engines"]}
    base, mtp = rows["mtpkit fp32 (no MTP)"], rows["mtpkit fp32 MTP k=2"]
    assert res["mtpkit_lossless"]
    assert mtp["agreement_with_mtpkit_fp32"]["identical_prompts"] == 3
    assert base["vs_mtpkit_no_mtp"] == pytest.approx(1.0)
    for name in ("transformers fp32", "transformers bf16",
                 "transformers fp32 prompt lookup (10)"):
        r = rows[name]
        assert not r["skipped"] and r["tokens_per_s"] > 0 and r["generated_tokens"] > 0
        assert r["vs_mtpkit_no_mtp"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        assert r["vs_mtpkit_mtp"] == pytest.approx(r["tokens_per_s"] / mtp["tokens_per_s"])
    # fp32 logits agree within 1e-4 on these models: greedy texts agree for a while.
    ag = rows["transformers fp32"]["agreement_with_mtpkit_fp32"]
    assert ag["earliest_divergence"] is None or ag["earliest_divergence"] >= 4, ag
    toks = res["tokens"]
    assert toks["transformers fp32"][0][:4] == toks["mtpkit fp32 (no MTP)"][0][:4]
    # mtpkit's two runs took turns prompt by prompt, the order rotated per prompt.
    b, m = "mtpkit fp32 (no MTP)", "mtpkit fp32 MTP k=2"
    assert res["in_turns"] == [b, m, m, b, b, m]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "compare.csv").exists()
    # Nothing built in this cache: mtpkit ran uncompiled, and the notes say how to build.
    assert any("mtpkit ran uncompiled" in n and f"`mtpkit warmup --model {model_dir} -k 2`" in n
               for n in res["notes"]), res["notes"]
    if not llama_cpp_available():
        assert any("llama-cpp-python is not installed" in n for n in res["notes"])
        assert "llama.cpp skipped" in stdout
    else:
        # The tiny model's character tokenizer cannot go into a GGUF: a clear note, no row.
        assert not any(e.startswith("llama.cpp Q8_0") for e in rows)
        assert any("only byte-level BPE tokenizers can be written" in n for n in res["notes"])


def test_interleave_takes_turns_and_isolates_failures():
    """Engines run prompt by prompt in a rotating order; warm-up calls are not measured; a
    peer that fails midway becomes a skipped row, mtpkit failing is an error."""
    from mtpkit.bench.compare import EngineRun, Runner, interleave

    calls = []

    def engine(name, fail_at=None):
        def gen(ids, n, warm=False):
            calls.append((name, ids[0], warm))
            if ids[0] == fail_at:
                raise RuntimeError(f"{name} broke\nsecond line")
            return [ids[0]] * n, 0.01, [1.0 + i for i in range(n)]
        return gen

    done = []
    a = Runner(EngineRun("a"), engine("a"), catch=False, done=lambda: done.append("a"))
    b = Runner(EngineRun("b"), engine("b", fail_at=12))
    c = Runner(EngineRun("c"), engine("c"))
    skipped = Runner(EngineRun("s", skipped="not installed"))
    prompts = [[10], [11], [12], [13]]
    schedule = interleave([a, b, skipped, c], prompts, max_tokens=3)
    assert calls[:3] == [("a", 10, True), ("b", 10, True), ("c", 10, True)]  # warm-ups
    assert schedule == ["a", "b", "c", "b", "c", "a", "c", "a", "a", "c"]
    assert a.run.tokens == [[10] * 3, [11] * 3, [12] * 3, [13] * 3] and done == ["a"]
    assert c.run.decode_tokens == 4 * 2 and c.run.decode_s == pytest.approx(4 * 2.0)
    assert b.run.skipped == "b failed: b broke" and b.gen is None and not b.run.tokens
    assert skipped.run.skipped == "not installed" and not any(n == "s" for n, _, _ in calls)
    bad = Runner(EngineRun("mtpkit"), engine("mtpkit", fail_at=11), catch=False)
    with pytest.raises(RuntimeError, match="mtpkit broke"):
        interleave([bad, Runner(EngineRun("c"), engine("c"))], prompts, max_tokens=2)


def test_first_divergence():
    from mtpkit.bench.compare import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_distinct_ggufs_runs_each_file_once(tmp_path):
    """The packaged Q4_1 given again with --gguf (or one file twice, or by another path)
    is timed once, under its first name, with a note."""
    from mtpkit.bench.compare import distinct_ggufs

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    (tmp_path / "sub").mkdir()
    pairs = [("llama.cpp Q4_1 (packaged)", a), ("llama.cpp b", b),
             ("llama.cpp a", tmp_path / "sub" / ".." / "a.gguf"), ("llama.cpp b", b)]
    kept, notes = distinct_ggufs(pairs)
    assert kept == [("llama.cpp Q4_1 (packaged)", a), ("llama.cpp b", b)]
    assert len(notes) == 2 and "'llama.cpp Q4_1 (packaged)'" in notes[0]
    assert distinct_ggufs(pairs[:2]) == (pairs[:2], [])


def test_bench_serve_llama_server_errors_are_one_line(tmp_path, capsys):
    """`bench serve --llama-server`: no server named, a path that is not an executable, and
    a binary that exits before it answers /health each end in one clear error (exit 2)."""
    cases = [(["--concurrency", "1"], "--llama-server PATH"),
             (["--llama-server", str(tmp_path / "nope")], "not an executable file")]
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: unknown model' >&2\nexit 3\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cases.append((["--llama-server", str(fake), "--gguf", str(gguf)],
                  "exited with 3 before it was ready"))
    for args, words in cases:
        assert main(["bench", "serve", "--num-prompts", "1", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err
