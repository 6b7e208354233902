"""The FastAPI application: OpenAI endpoints, SSE streaming, /health, /metrics, lifecycle.

The port is bound before the model loads, so that /health can answer 503 while it loads;
the engine runs in its own threads (scheduler.py) and talks to request handlers through
per-request asyncio queues fed with ``call_soon_threadsafe``, a round's events of the fast
path in one call (Scheduler's ``deliver``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import protocol as P
from .prometheus import ServeStats
from .scheduler import NotAccepting, QueueFull, Scheduler
from .scheduler import Request as EngineRequest

log = logging.getLogger("mtpkit.serve")


@dataclass
class ServeConfig:
    """Everything `mtpkit serve` was asked for."""

    model: str | None = None
    head: str | None = None
    served_model_name: str | None = None
    num_draft_tokens: int = 3
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_num_seqs: int = 8
    max_queue: int = 256
    max_model_len: int | None = None
    prefill_chunk: int = 256
    packed: bool = True  # one trunk forward per step over all running sequences
    compile: str = "auto"  # how requests run the fast path's programs (or "off")
    device: str = "cpu"
    dtype: str | None = None
    full_draft_vocab: bool = False
    stall_timeout: float = 120.0
    shutdown_timeout: float = 10.0
    max_request_bytes: int = 4 << 20  # larger bodies get 413 before they are read
    default_max_tokens: int = 2048  # for requests that give none; 0: the rest of the context
    header_timeout: float = 30.0  # a connection must send a request's headers within this
    max_connections: int = 1024  # open connections; more get 503
    chat_special_tokens: str = "text"  # "parse": control-token spellings in messages count
    log_level: str = "info"
    # Build the compiled programs still missing in a low-priority child process (`mtpkit
    # warmup`) and switch to them when done. Off for servers embedded in other code (and
    # tests); `mtpkit serve` turns it on.
    background_build: bool = False
    threads: int | None = None  # --threads, passed on to the background build

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        checks = [
            (self.num_draft_tokens >= 0, f"--num-draft-tokens must be >= 0, got "
                                         f"{self.num_draft_tokens}"),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_queue >= 0, f"--max-queue must be >= 0, got {self.max_queue}"),
            (self.max_model_len is None or self.max_model_len >= 2,
             f"--max-model-len must be >= 2, got {self.max_model_len}"),
            (self.prefill_chunk >= 1, f"--prefill-chunk must be >= 1, got {self.prefill_chunk}"),
            (0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}"),
            (self.stall_timeout > 0, f"--stall-timeout must be > 0, got {self.stall_timeout}"),
            (self.shutdown_timeout >= 0,
             f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.api_key is None or self.api_key != "", "--api-key must not be empty"),
            (self.max_request_bytes >= 1024,
             f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}"),
            (self.default_max_tokens >= 0,
             f"--default-max-tokens must be >= 0, got {self.default_max_tokens}"),
            (self.header_timeout > 0, f"--header-timeout must be > 0, got {self.header_timeout}"),
            (self.max_connections >= 1,
             f"--max-connections must be >= 1, got {self.max_connections}"),
            (self.chat_special_tokens in ("text", "parse"),
             f"--chat-special-tokens must be text or parse, got {self.chat_special_tokens!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class ServerState:
    """The loaded model (once loaded), the scheduler and the counters, shared by handlers."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.name = cfg.served_model_name or cfg.model or "SmolLM2-135M-Instruct"
        self.stats = ServeStats(self.name)
        self.sched: Scheduler | None = None
        self.tokenizer = None
        self.vocab_size = 0
        self.max_model_len = 0
        self.num_draft_tokens = 0
        self.load_error: str | None = None
        self.created = int(time.time())
        self.on_fatal = lambda: None  # set by run(): stops the server
        self.on_drained = lambda: None  # set by run(): ends the server after a drain
        self.shutting_down = False
        # Parsing and tokenizing run here, never on the event loop: a long prompt must not
        # hold up /health or other clients' streams. Two threads bound what a flood can take.
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="mtpkit-tokenize")
        self.builder = None  # the background build of compiled programs (subprocess.Popen)

    # -- loading (a thread of its own) ------------------------------------------------------
    def load(self) -> None:
        """Load the model and start the scheduler; on failure record why and stop."""
        try:
            self._load()
        except Exception as e:  # any failure is reported once, as the reason the server ends
            if not isinstance(e, (ValueError, FileNotFoundError)):
                log.exception("loading the model failed")
            self.load_error = str(e) or type(e).__name__
            self.on_fatal()

    def _load(self) -> None:
        from ..engine.session import Session

        cfg = self.cfg
        t0 = time.perf_counter()
        session = Session.load(cfg.model, head=cfg.head, device=cfg.device, dtype=cfg.dtype,
                               full_draft_vocab=cfg.full_draft_vocab, compile=cfg.compile)
        model, tok = session.engine.model, session.tokenizer
        if tok is None:
            raise ValueError(f"{session.name}: no tokenizer found; the server needs one")
        limit = model.config.max_position_embeddings
        max_len = cfg.max_model_len or limit
        if max_len > limit:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's context of "
                             f"{limit} tokens")
        k = cfg.num_draft_tokens
        if k and not session.engine.has_mtp:
            log.warning("%s has no MTP head; serving without speculation", session.name)
            k = 0
        self.tokenizer, self.vocab_size = tok, model.config.vocab_size
        self.max_model_len, self.num_draft_tokens = max_len, k
        fast = session.engine.fast
        if fast is not None:
            fast.warmup(k)  # loaded (or built, --compile aoti) before the first request
            fast.warmup_pooled()  # the batched steps' programs
            if fast.pending and cfg.background_build:
                self.builder = _build_in_background(cfg, k)
        self.sched = Scheduler(
            model, tok, drafter=session.engine.drafter if k else None, num_draft_tokens=k,
            max_num_seqs=cfg.max_num_seqs, max_queue=cfg.max_queue, max_model_len=max_len,
            prefill_chunk=cfg.prefill_chunk, stats=self.stats, packed=cfg.packed, fast=fast,
            deliver=_deliver,
        )
        how = "eager engine"
        if fast is not None:
            st = fast.stats
            who = "requests" if fast.samples else "greedy requests"
            how = (f"{who} on the fast path ({st.loaded + st.compiled} compiled programs)"
                   if st.loaded or st.compiled else
                   f"{who} on the fast path (uncompiled programs)")
            if self.builder is not None:
                how += ("; building the compiled ones in the background (`mtpkit warmup`, "
                        f"pid {self.builder.pid}, low priority), used as soon as they are built")
            elif fast.pending:
                how += "; run `mtpkit warmup` once to compile them"
        log.info("model %s loaded in %.1f s: %d draft tokens per step, %d slots, context %d, "
                 "%s", self.name, time.perf_counter() - t0, k, cfg.max_num_seqs, max_len, how)

    def begin_shutdown(self) -> bool:
        """SIGTERM/SIGINT: answer new requests 503 while those in flight finish, abort what
        still runs after --shutdown-timeout (streams end with an error event and [DONE]),
        then call on_drained. False when there is nothing to drain (exit at once)."""
        sched = self.sched
        if self.shutting_down or sched is None:
            return False
        self.shutting_down = True
        sched.drain()
        log.info("shutting down: in-flight requests have %g s to finish",
                 self.cfg.shutdown_timeout)
        threading.Thread(target=self._drain, args=(sched,), name="mtpkit-drain",
                         daemon=True).start()
        return True

    def _drain(self, sched: Scheduler) -> None:
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        while sched.num_running + sched.num_waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        sched.stop()
        self.on_drained()

    # -- request checks ---------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """401 unless the request carries the configured key."""
        key = self.cfg.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise P.APIError(401, "missing API key: send the header 'Authorization: Bearer "
                                  "<key>'", code="invalid_api_key")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 key.encode()):
            raise P.APIError(401, "incorrect API key provided", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve."""
        if model is not None and model != self.name:
            raise P.APIError(404, f"the model '{model}' does not exist; this server serves "
                                  f"'{self.name}'", param="model", code="model_not_found")

    def ready(self) -> Scheduler:
        """The scheduler, or 503 while loading."""
        if self.sched is None:
            if self.load_error:
                raise P.APIError(503, f"the model failed to load: {self.load_error}",
                                 "service_unavailable", code="model_load_failed")
            raise P.APIError(503, "the model is still loading; retry shortly",
                             "service_unavailable", code="model_loading")
        return self.sched

    def tokenize(self, g: P.GenRequest) -> list[int]:
        """Prompt token ids (chat template for chat requests); 400 when unusable."""
        tok = self.tokenizer
        if g.chat:
            self._fits_at_all(sum(len(m["content"]) for m in g.messages), "messages")
            try:
                ids = tok.chat_ids(g.messages, self.cfg.chat_special_tokens == "text")
            except Exception as e:  # no template, or the template refused the messages
                raise P.bad(f"cannot apply the chat template: {e}", "messages") from None
        elif isinstance(g.prompt, str):
            self._fits_at_all(len(g.prompt), "prompt")
            ids = tok.encode(g.prompt)
        else:
            if len(g.prompt) > self.max_model_len:
                raise self._too_long(len(g.prompt), "prompt")
            ids = list(g.prompt)
            bad_ids = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad_ids:
                raise P.bad(f"token id {bad_ids[0]} is outside the vocabulary "
                            f"(0..{self.vocab_size - 1})", "prompt")
        if not ids:
            raise P.bad("the prompt is empty: give at least one token",
                        "messages" if g.chat else "prompt")
        return ids

    def _fits_at_all(self, chars: int, param: str) -> None:
        # A token covers at most max_piece_chars characters (twice that allows for
        # normalizers that compose characters), so a text this long cannot fit: refused
        # without tokenizing it.
        least = chars // (2 * self.tokenizer.max_piece_chars)
        if least > self.max_model_len:
            raise P.bad(f"the prompt is too long: its {chars} characters make at least "
                        f"{least} tokens, and this model's context is {self.max_model_len} "
                        "tokens. Shorten the prompt.", param, code="context_length_exceeded")

    def _too_long(self, n_prompt: int, param: str) -> P.APIError:
        return P.bad(f"the prompt has {n_prompt} tokens, which leaves no room for output in "
                     f"this model's context of {self.max_model_len} tokens. Shorten the "
                     "prompt.", param, code="context_length_exceeded")

    def fit(self, g: P.GenRequest, n_prompt: int) -> int:
        """max_tokens for this prompt (when not given: --default-max-tokens, at most the rest
        of the context); 400 if over."""
        room = self.max_model_len - n_prompt
        if g.max_tokens is None:
            if room < 1:
                raise self._too_long(n_prompt, "messages" if g.chat else "prompt")
            cap = self.cfg.default_max_tokens
            return min(room, cap) if cap else room
        if g.max_tokens > room:
            name = "max_completion_tokens" if g.chat else "max_tokens"
            raise P.bad(
                f"this model's context is {self.max_model_len} tokens; the prompt has "
                f"{n_prompt} and {g.max_tokens} more were asked for. Shorten the prompt or "
                f"lower {name}.", name, code="context_length_exceeded")
        return g.max_tokens

    async def read_body(self, request: Request) -> bytes:
        """The request body, or 413 once it passes --max-request-bytes (before reading it,
        when Content-Length says so)."""
        limit = self.cfg.max_request_bytes
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:
            raise _too_large(int(size), limit)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise _too_large(None, limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _too_large(size: int | None, limit: int) -> P.APIError:
    what = f"of {size} bytes " if size is not None else ""
    return P.APIError(413, f"the request body {what}is over this server's limit of {limit} "
                           "bytes (--max-request-bytes); send a shorter prompt",
                      code="request_too_large")


def create_app(state: ServerState) -> FastAPI:
    """The application; the model loads in a thread when it starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="mtpkit-load", daemon=True).start()
        yield
        if state.sched is not None:
            await asyncio.to_thread(state.sched.stop)
            log.info("engine stopped")

    app = FastAPI(title="mtpkit", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(e: P.APIError) -> JSONResponse:
        state.stats.rejected_request(str(e.status))
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return error(P.APIError(exc.status_code, msg, code=str(exc.status_code)))

    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "failed", "message": state.load_error}, 503)
        if state.sched is None:
            return JSONResponse({"status": "loading"}, 503)
        if state.shutting_down:
            return JSONResponse({"status": "draining", "message": "the server is shutting "
                                 "down"}, 503)
        if not state.sched.alive:
            return JSONResponse({"status": "stopped", "message": "the engine has stopped"},
                                503)
        stuck = state.sched.busy_for()
        if stuck > state.cfg.stall_timeout:
            return JSONResponse({"status": "stalled", "message": f"the engine has made no "
                                 f"progress for {stuck:.0f} s"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        s = state.sched
        text = state.stats.render(
            s.num_running if s else 0, s.num_waiting if s else 0, s.turns if s else 0,
            s.busy_for() if s else 0.0, s is not None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            state.check_key(request)
        except P.APIError as e:
            return error(e)
        card = {"id": state.name, "object": "model", "created": state.created,
                "owned_by": "mtpkit", "max_model_len": state.max_model_len or None}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool):
        try:
            state.check_key(request)
            raw = await state.read_body(request)
            loop = asyncio.get_running_loop()
            g = await loop.run_in_executor(state.pool, _parse, raw, chat)
            state.check_model(g.model)
            sched = state.ready()
            ids = await loop.run_in_executor(state.pool, state.tokenize, g)
            g.params.max_tokens = state.fit(g, len(ids))
            queue: asyncio.Queue = asyncio.Queue()
            req = EngineRequest(P.new_id(chat), ids, g.params, _Sink(loop, queue))
            try:
                sched.submit(req)
            except QueueFull as e:
                raise P.APIError(429, f"{e}; retry later", "rate_limit_error",
                                 code="queue_full") from None
            except NotAccepting as e:
                raise P.APIError(503, str(e), "service_unavailable",
                                 code="shutting_down") from None
        except P.APIError as e:
            return error(e)
        except ClientDisconnect:
            return Response(status_code=499)  # gone while sending its body
        except Exception:
            log.exception("request failed before reaching the engine")
            return error(P.APIError(500, "internal server error", "server_error",
                                    code="internal_error"))
        if g.stream:
            return StreamingResponse(
                stream(req, queue, g, chat), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, req, queue, chat)

    async def complete(request: Request, req: EngineRequest, queue: asyncio.Queue,
                       chat: bool) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        parts: list[str] = []
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    state.sched.abort(req)
                    return Response(status_code=499)  # nobody is listening any more
                kind, value = get.result()
                if kind == "text":
                    parts.append(value)
                elif kind == "done":
                    use = P.usage(len(req.prompt_ids), req.completion_tokens)
                    return JSONResponse(P.full_response(chat, req.id, state.name,
                                                        "".join(parts), value, use))
                elif kind == "aborted":
                    return error(P.APIError(503, value, "service_unavailable",
                                            code="aborted"))
                else:
                    return error(P.APIError(500, value, "server_error", code="internal_error"))
        finally:
            gone.cancel()
            if req.finished_at is None:
                state.sched.abort(req)

    async def stream(req: EngineRequest, queue: asyncio.Queue, g: P.GenRequest, chat: bool):
        created, name, iu = int(time.time()), state.name, g.include_usage
        ended = False
        try:
            if chat:
                yield P.sse(P.chunk(chat, req.id, created, name, "", role=True, with_usage=iu))
            while not ended:
                events = [await queue.get()]
                while not queue.empty():  # coalesce what piled up since the last write
                    events.append(queue.get_nowait())
                text = "".join(v for k, v in events if k == "text")
                if text:
                    yield P.sse(P.chunk(chat, req.id, created, name, text, with_usage=iu))
                for kind, value in events:
                    if kind == "done":
                        ended = True
                        yield P.sse(P.chunk(chat, req.id, created, name, None, finish=value,
                                            with_usage=iu))
                        if iu:
                            use = P.usage(len(req.prompt_ids), req.completion_tokens)
                            yield P.sse(P.usage_chunk(chat, req.id, created, name, use))
                    elif kind == "error":
                        ended = True
                        yield P.sse(P.APIError(500, value, "server_error",
                                               code="internal_error").body())
                    elif kind == "aborted":
                        ended = True
                        yield P.sse(P.APIError(503, value, "service_unavailable",
                                               code="aborted").body())
            yield "data: [DONE]\n\n"
        finally:
            # Reached with the client gone too (the response task is cancelled): free the slot.
            if req.finished_at is None:
                state.sched.abort(req)

    return app


class _Sink:
    """A request's events into its asyncio queue, from any thread (Request.on_event)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def __call__(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _deliver(items: list[tuple[EngineRequest, tuple]]) -> None:
    """Events of several requests, from the engine thread, into their queues in one wake-up
    of each loop (Scheduler's ``deliver``), each request's in the order posted."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
    for req, event in items:
        sink = req.on_event
        if isinstance(sink, _Sink):
            by_loop.setdefault(sink.loop, []).append((sink.queue, event))
        else:
            sink(event)
    for loop, events in by_loop.items():
        loop.call_soon_threadsafe(_put_all, events)


def _put_all(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


def _parse(raw: bytes, chat: bool) -> P.GenRequest:
    body = P.parse_json(raw)
    return P.parse_chat(body) if chat else P.parse_completion(body)


async def _disconnected(request: Request) -> None:
    """Return when the client of a (fully read) request hangs up."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's headers: uvicorn itself
    holds a connection that stalls mid-headers forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol, h11

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout, self._head_due)

        def _head_due(self) -> None:
            self._head_timer = None
            # Still no complete request head: close (a request being served is not touched).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named, not left 0: accepted sockets inherit it, and asyncio turns on
    # TCP_NODELAY only for sockets that say IPPROTO_TCP. Without it, a stream's small
    # chunks on a kept-alive connection waited for the client's delayed ACK (Nagle): each
    # request after a connection's first got its tokens in one burst about 40 ms late.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(cfg: ServeConfig) -> int:
    """Bind, serve until SIGINT/SIGTERM (in-flight requests get --shutdown-timeout to end)."""
    import uvicorn

    cfg.validate()
    level = cfg.log_level.upper()
    if not logging.getLogger("mtpkit").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logging.getLogger("mtpkit").addHandler(handler)
    logging.getLogger("mtpkit").setLevel(level)
    sock = _bind(cfg.host, cfg.port)
    state = ServerState(cfg)
    # uvicorn's own grace period is only a backstop: begin_shutdown() aborts what is still
    # running after --shutdown-timeout, which ends every stream with an error event.
    config = uvicorn.Config(create_app(state), log_level=cfg.log_level, lifespan="on",
                            timeout_graceful_shutdown=cfg.shutdown_timeout + 5,
                            access_log=level == "DEBUG", http=_protocol(cfg.header_timeout),
                            limit_concurrency=cfg.max_connections)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # The first signal drains: the socket stays open and new requests get 503 until
            # those in flight are done (what load balancers expect). A second one, or one
            # with nothing to drain, exits now.
            if not state.begin_shutdown():
                if state.sched is not None:
                    threading.Thread(target=state.sched.stop, daemon=True).start()
                super().handle_exit(sig, frame)

    server = _Server(config)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = state.on_drained = fatal
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d (model %s loading)", host, port, state.name)
    try:
        with contextlib.closing(sock):
            server.run(sockets=[sock])
    finally:
        _stop_builder(state.builder)
    if state.load_error:
        raise ValueError(state.load_error)
    return 0


def _build_in_background(cfg: ServeConfig, k: int):
    """Start `mtpkit warmup` for this server's model at the lowest CPU priority: it builds
    the programs the server runs uncompiled meanwhile (FastDecoder picks them up when their
    files appear), on CPU time that requests leave idle. Its output goes to a log file in
    the compile cache."""
    import os
    import subprocess

    from .. import threads
    from ..engine.program_cache import default_cache_dir

    cmd = [sys.executable, "-m", "mtpkit.cli", "warmup", "-k", str(k), "--device", cfg.device,
           # The programs' key holds the thread count: build for the server's.
           "--threads", str(cfg.threads or threads.limit())]
    for flag, value in (("--model", cfg.model), ("--head", cfg.head), ("--dtype", cfg.dtype)):
        if value is not None:
            cmd += [flag, str(value)]
    if cfg.full_draft_vocab:
        cmd.append("--full-draft-vocab")
    logs = default_cache_dir()
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / "background-warmup.log"
    with open(path, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                preexec_fn=lambda: os.nice(19))
    log.info("compiled programs missing: building them in the background (log: %s)", path)
    return proc


def _stop_builder(proc) -> None:
    # A build still running when the server ends stops with it (its partial file removed:
    # warmup ends on SIGTERM as on an error); the next start builds again.
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except Exception:
        proc.kill()
