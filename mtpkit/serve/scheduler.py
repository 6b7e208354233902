"""The engine side of the server: a pool of slots over one model, advanced in turns.

Design. Every slot owns an ``Engine`` (its own trunk and MTP caches) over the one shared
model, so no state can pass from one request to the next or between concurrent requests.
Each running request is decoded by the unmodified ``Engine.generate`` in a thread of its own,
but those threads never run at the same time: a conductor thread hands a baton to one of
them, which runs until it is about to start its next unit of model work and then hands the
baton back. The units are seen through ``_TurnModel``, a thin proxy of the model that the
slot's engine calls instead of the model. A turn is therefore one draft + verify step of one
sequence (several tokens with MTP, each sequence accepting its own number), or one bounded
piece of a prompt's prefill: a prompt longer than ``prefill_chunk`` tokens is run in pieces,
one per turn, so that a long prompt does not stall the streams already running. Requests
join (a free slot) and leave (finished, stopped, aborted) between turns.

Why threads and a baton rather than one loop calling ``next()`` on each generator: prefill
happens inside a single ``next()`` of ``Engine.generate``; a generator cannot be suspended in
the middle of it, a thread can. The conductor keeps the accelerator single-owner and the
order deterministic (round robin), and each request runs exactly the code a single-request
``Engine.generate`` runs, which is what makes greedy outputs identical.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import threads
from ..engine.generate import Engine, MTPDrafter, Result
from ..engine.sampling import SamplingParams
from ..models.base import TrunkOutput

log = logging.getLogger("mtpkit.serve")


_SHUTDOWN = "the server shut down before the request finished"


class Aborted(Exception):
    """The request was cancelled (client gone, server shutting down)."""


class QueueFull(Exception):
    """No room in the waiting queue."""


class NotAccepting(Exception):
    """The scheduler is stopping or has stopped."""


@dataclass
class Request:
    """One generation request as the scheduler sees it.

    ``on_event`` is called from engine threads with ("text", str), then exactly one of
    ("done", finish_reason) or ("error", message); it must be thread-safe and non-blocking.
    """

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[tuple], None]
    arrival: float = field(default_factory=time.monotonic)
    aborted: bool = False  # set from any thread; honoured at the request's next turn
    abort_reason: str = "the request was cancelled"
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None  # stop, length, abort or error
    completion_tokens: int = 0


class _TurnModel:
    """The shared model as one slot's engine sees it: each unit of work is a scheduling point.

    Trunk forwards longer than ``chunk`` tokens (a prefill) and MTP catch-up passes longer than
    ``chunk`` run in pieces; the result is the same hidden states the whole pass returns, up to
    floating-point summation order.
    """

    def __init__(self, model, chunk: int) -> None:
        self._model = model
        self._chunk = chunk
        self.worker: _Worker | None = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids: torch.Tensor, cache=None) -> TrunkOutput:
        """Trunk forward, a chunk per turn."""
        outs = []
        for s in range(0, input_ids.shape[1], self._chunk):
            piece = input_ids[:, s : s + self._chunk]
            self.worker.before_unit(piece.shape[1], trunk=True)
            if self.worker.sched.packed:
                outs.append(self.worker.trunk(piece, cache))
            else:
                outs.append(self._model(piece, cache))
        return _concat(outs)

    def mtp_forward(self, next_ids, hidden, step, start, cache) -> TrunkOutput:
        """MTP head pass; a long catch-up (right after a prefill) runs a chunk per turn."""
        outs = []
        for s in range(0, next_ids.shape[1], self._chunk):
            ids = next_ids[:, s : s + self._chunk]
            self.worker.before_unit(ids.shape[1], trunk=False)
            outs.append(self._model.mtp_forward(
                ids, hidden[:, s : s + self._chunk], step, start + s, cache))
        return _concat(outs)


def _concat(outs: list[TrunkOutput]) -> TrunkOutput:
    if len(outs) == 1:
        return outs[0]
    aux = None if outs[0].aux is None else torch.cat([o.aux for o in outs], 1)
    return TrunkOutput(torch.cat([o.hidden for o in outs], 1),
                       torch.cat([o.pre_norm for o in outs], 1), aux)


class _Slot:
    """One engine over the shared model: its own caches, its own view of the model."""

    def __init__(self, index: int, model, tokenizer, max_model_len: int,
                 drafter: MTPDrafter | None, chunk: int, fast=None) -> None:
        self.index = index
        self.model = _TurnModel(model, chunk)
        self.engine = Engine(self.model, tokenizer, max_model_len)
        self._fast_source = fast
        self._fast = None
        self.drafter = None
        if drafter is not None:
            # Share the loaded drafter's draft-vocabulary weights; only the model it calls
            # changes (the slot's proxy, so that MTP catch-up passes are scheduled too).
            self.drafter = copy.copy(drafter)
            self.drafter.model = self.model

    @property
    def fast(self):
        """The slot's FastDecoder (the server's programs, the slot's own caches), made on
        the first greedy request it serves; None when the model has none."""
        if self._fast is None and self._fast_source is not None:
            self._fast = self._fast_source.fork(self.index)
        return self._fast


class _Worker:
    """The thread that decodes one request in a slot, running only while it holds the baton."""

    def __init__(self, sched: Scheduler, slot: _Slot, req: Request) -> None:
        self.sched, self.slot, self.req = sched, slot, req
        self.go = threading.Semaphore(0)
        self.done = False
        self.result = Result()
        self.text = ""  # text produced in this turn, not yet handed to the request
        self.turn_tokens = 0
        self.turn_trunk = False
        self.last_emit: float | None = None
        self.seen = _Seen()
        # A trunk forward handed to the engine thread, to run packed with the other
        # sequences' (ids, cache), and its outcome (a TrunkOutput or the exception it raised).
        self.job: tuple | None = None
        self.job_out: TrunkOutput | Exception | None = None
        self.thread = threading.Thread(target=self._main, daemon=True,
                                       name=f"mtpkit-slot-{slot.index}")

    def start(self) -> None:
        """Begin decoding (its thread waits for the baton)."""
        self.thread.start()

    def finished(self) -> None:
        """After the request's last turn."""
        self.thread.join()

    # -- called in the worker thread ------------------------------------------------------
    def before_unit(self, tokens: int, trunk: bool) -> None:
        """Hand the baton back first if this turn has done its share of work."""
        if self.turn_tokens and (
            (trunk and self.turn_trunk) or self.turn_tokens + tokens > self.sched.prefill_chunk
        ):
            self._pause()
        self.turn_tokens += tokens
        self.turn_trunk = self.turn_trunk or trunk

    def trunk(self, ids: torch.Tensor, cache) -> TrunkOutput:
        """Run a trunk forward in the engine thread's next packed step; wait for it."""
        self.job, self.job_out = (ids, cache), None
        self._pause()
        out, self.job_out = self.job_out, None
        if isinstance(out, Exception):
            raise out
        return out

    def _pause(self) -> None:
        self._flush()
        self._account()
        self.turn_tokens, self.turn_trunk = 0, False
        self.sched._back.release()
        self.go.acquire()
        if self.req.aborted:
            raise Aborted

    def _flush(self) -> None:
        if self.text:
            text, self.text = self.text, ""
            self._post(("text", text))

    def _post(self, event: tuple) -> None:
        try:
            self.sched._send(self.req, event)
        except Exception:  # the client side is gone (loop closed): nothing to tell
            log.debug("request %s: event dropped", self.req.id, exc_info=True)

    def _account(self) -> None:
        # Counted by the worker itself (it holds the baton, so nothing else runs) and before
        # the final event, so that /metrics agrees with a response the moment it is received.
        if self.sched.stats is not None:
            try:
                self.sched.stats.turn(self)
            except Exception:
                log.exception("metrics accounting failed")

    def _main(self) -> None:
        # The engine thread runs the trunk, with the process's thread team; a request
        # thread's own team would slow that one (threads.compute_alone).
        threads.compute_alone()
        self.go.acquire()
        req = self.req
        final: tuple | None = None
        try:
            if req.aborted:
                raise Aborted
            self.slot.model.worker = self
            req.finish_reason = self._decode()
            self._flush()
            final = ("done", req.finish_reason)
        except Exception as e:
            final = self._failed(e)
        finally:
            try:
                self.slot.model.worker = None
                self._close(final)
            finally:
                # Whatever happened, the baton goes back: the engine thread must never wait
                # on a request that has ended.
                self.sched._back.release()

    def _failed(self, e: Exception) -> tuple:
        # The final event of a request whose decoding raised e (its finish reason set).
        req = self.req
        if isinstance(e, Aborted):
            req.finish_reason = "abort"
            return ("aborted", req.abort_reason)
        log.error("request %s failed in the engine", req.id, exc_info=e)
        req.finish_reason = "error"
        # The client gets no Python internals; the log has the traceback under this id.
        return ("error", f"internal error in the engine while serving {req.id}; the server "
                         "log has the details")

    def _close(self, final: tuple | None) -> None:
        # Count the request as finished (before its last event: /metrics then agrees with
        # the response) and send that event; the request is done whatever fails here.
        req = self.req
        try:
            req.finished_at = time.monotonic()
            self._account()
            if self.sched.stats is not None:
                self.sched.stats.finished(req)
            self._post(final or ("aborted", req.abort_reason))
        except Exception:
            log.exception("request %s: cleanup failed", req.id)
        finally:
            self.done = True

    def _decode(self) -> str:
        req, sched = self.req, self.sched
        stream = TextStream(sched.tokenizer, req.params.stop)
        gen = self.slot.engine.generate(req.prompt_ids, req.params, sched.num_draft_tokens,
                                        result=self.result, drafter=self.slot.drafter)
        try:
            for token in gen:
                if self._push(stream, token):
                    return "stop"
        finally:
            gen.close()
        return self._ended(stream)

    def _push(self, stream: TextStream, token: int) -> bool:
        # One emitted token into the request's text; True when a stop string ended it.
        req = self.req
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.completion_tokens += 1
        self.text += stream.push(token)
        return stream.stopped

    def _ended(self, stream: TextStream) -> str:
        # The generation ended: the text held back goes out; the finish reason.
        self.text += stream.flush()
        return "stop" if stream.stopped else (self.result.finish_reason or "stop")


class _FastWorker(_Worker):
    """A request on the fast path, advanced by the engine thread itself
    (FastDecoder.steps): no thread of its own. A turn streams what the last step emitted
    and stops at the next program call (or after a prompt piece); the engine thread runs
    every waiting call of every sequence together at the start of each round
    (FastDecoder.run_many: one trunk pass for all of them), so all fast-path model work
    runs in that one thread. (A thread team per slot thread made libgomp throttle every
    team's spinning, which cost more than a third of the speed.)"""

    def __init__(self, sched: Scheduler, slot: _Slot, req: Request) -> None:
        super().__init__(sched, slot, req)
        self.steps = None
        self.stream = TextStream(sched.tokenizer, req.params.stop)
        self.step = None  # the program call this request waits on (FastDecoder.Step)
        self.step_out = None  # its result, sent back at the next turn
        self.has_out = False

    def start(self) -> None:
        """Nothing to start: the engine thread calls turn()."""

    def finished(self) -> None:
        """Nothing to join."""

    def turn(self) -> None:
        """Advance the request to its next program call, in the engine thread."""
        from ..engine.fast import PIECE, Step

        req, sched = self.req, self.sched
        final = None
        try:
            if req.aborted:
                raise Aborted
            if self.steps is None:
                eos = set() if req.params.ignore_eos else set(sched.tokenizer.eos_token_ids)
                others = sum(1 for w in sched._running
                             if isinstance(w, _FastWorker) and w is not self)
                self.steps = self.slot.fast.steps(
                    req.prompt_ids, req.params.max_tokens, sched.num_draft_tokens,
                    result=self.result, eos_ids=eos, chunk=sched.prefill_chunk,
                    params=req.params, joining=others)
            if self.step is not None and not self.has_out:
                return  # its call has not run yet
            item = self._advance()
            while item is not None and item is not PIECE and not isinstance(item, Step):
                if (any(self._push(self.stream, token) for token in item)
                        or self.result.finish_reason is not None):
                    item = None
                    break
                item = self._advance()
            self.step = item if isinstance(item, Step) else None
            if item is None:
                req.finish_reason = self._ended(self.stream)
                final = ("done", req.finish_reason)
            self._flush()
        except Exception as e:
            final = self._failed(e)
        if final is None:
            self._account()
            return
        self.step = None
        try:
            if self.steps is not None:
                self.steps.close()
        finally:
            self._close(final)

    def _advance(self):
        # The generation's next item, the waiting call's result sent in; None at its end.
        if self.has_out:
            out, self.step_out, self.has_out = self.step_out, None, False
            if isinstance(out, Exception):
                raise out
            try:
                return self.steps.send(out)
            except StopIteration:
                return None
        return next(self.steps, None)


@dataclass
class _Seen:
    """What a worker's counters stood at when last accounted (for per-turn deltas)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    generated: int = 0


class TextStream:
    """Token ids -> final text pieces; text that could still become a stop string is held."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.decoder = tokenizer.stream_decoder()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the text that is now final."""
        self.text += self.decoder.push(token)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: return everything still held."""
        self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped, final = self.text[: min(hits)], True, True
        end = len(self.text) if final else max(len(self.text) - self.hold, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece


class Scheduler:
    """Owns the model: admits requests into slots and advances them a turn at a time."""

    def __init__(self, model, tokenizer, *, drafter: MTPDrafter | None, num_draft_tokens: int,
                 max_num_seqs: int, max_queue: int, max_model_len: int, prefill_chunk: int,
                 stats=None, packed: bool = True, fast=None,
                 deliver: Callable[[list[tuple[Request, tuple]]], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        # One trunk forward per step for all running sequences (each verifying its own
        # drafts, decoding or prefilling a chunk) where the model allows it.
        self.packed = packed and model.packable()
        self.packed_steps = 0  # forwards that packed two or more sequences
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 0
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.max_model_len = max_model_len
        self.stats = stats
        # ``fast``: a FastDecoder whose programs serve the requests (each slot forks caches
        # of its own from it); sampled requests run the eager engine where it cannot sample.
        self.fast = fast
        if fast is not None:
            # Every slot's caches a slot of one pool: a step of any running sequences is
            # then one program call (FastDecoder.run_many), compiled for all batches.
            fast.make_pool(max_num_seqs)
        self._free = [_Slot(i, model, tokenizer, max_model_len, drafter, prefill_chunk, fast)
                      for i in range(max_num_seqs)]
        self._waiting: deque[Request] = deque()
        self._running: list[_Worker] = []
        self._cv = threading.Condition()
        self._back = threading.Semaphore(0)
        self._stopping = False
        self._stopping_soon = False
        self.heartbeat = time.monotonic()
        self.turns = 0
        # ``deliver``: the events the engine thread posts in a round (the fast path's
        # streams) go out in one call, as [(request, event)], when the round's model work
        # starts, rather than one request.on_event each: a server's event loop then wakes
        # once a round, where each stream's wake-up was a system call in the engine thread
        # that then waited for the loop's thread.
        self.deliver = deliver
        self._outbox: list[tuple[Request, tuple]] = []
        self._thread = threading.Thread(target=self._loop, name="mtpkit-engine", daemon=True)
        self._thread.start()

    # -- called from the server's event loop ------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        """False once the engine thread has ended."""
        return self._thread.is_alive()

    def busy_for(self) -> float:
        """Seconds since the engine last made progress while it had work (0 when idle)."""
        if not self._running and not self._waiting:
            return 0.0
        return time.monotonic() - self.heartbeat

    def submit(self, req: Request) -> None:
        """Queue a request; QueueFull when the queue is at --max-queue."""
        with self._cv:
            if self._stopping or self._stopping_soon:
                raise NotAccepting("the server is shutting down")
            # Slots not yet claimed by the engine thread count as room too.
            if len(self._waiting) >= self.max_queue + len(self._free):
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._waiting.append(req)
            self._cv.notify()

    def abort(self, req: Request, reason: str | None = None) -> None:
        """Cancel a request: dropped from the queue now, or stopped at its next turn."""
        with self._cv:
            if reason:
                req.abort_reason = reason
            req.aborted = True
            if req in self._waiting:
                self._waiting.remove(req)
                req.finish_reason = "abort"
                req.finished_at = time.monotonic()
                if self.stats is not None:
                    self.stats.finished(req)
                try:
                    req.on_event(("aborted", req.abort_reason))
                except Exception:
                    log.debug("request %s: event dropped", req.id, exc_info=True)

    def drain(self) -> None:
        """Refuse new requests; those queued or running go on."""
        with self._cv:
            self._stopping_soon = True

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the engine thread."""
        with self._cv:
            self._stopping = True
            waiting = list(self._waiting)
        for req in waiting:
            self.abort(req, _SHUTDOWN)
        for w in list(self._running):
            self.abort(w.req, _SHUTDOWN)
        with self._cv:
            self._cv.notify()
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------
    def _send(self, req: Request, event: tuple) -> None:
        # An event for a request: held for the round's delivery where the engine thread
        # posts it and the server batches (deliver), else sent now.
        if self.deliver is not None and threading.current_thread() is self._thread:
            self._outbox.append((req, event))
        else:
            req.on_event(event)

    def _flush_outbox(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        try:
            self.deliver(items)
        except Exception:  # the client side is gone (loop closed): nothing to tell
            log.debug("%d events dropped", len(items), exc_info=True)

    def _loop(self) -> None:
        try:
            self._turns()
        finally:
            self._flush_outbox()

    def _turns(self) -> None:
        turn = 0
        while True:
            with self._cv:
                self._admit()
                if not self._running:
                    self._flush_outbox()
                    self.heartbeat = time.monotonic()
                    if self._stopping:
                        return
                    self._cv.wait(timeout=1.0)
                    continue
                if self._stopping:
                    for w in self._running:
                        w.req.abort_reason, w.req.aborted = _SHUTDOWN, True
            turn %= len(self._running)
            if turn == 0:
                # A new round: every sequence's pending model work at once, the last
                # round's events on their way meanwhile.
                self._flush_outbox()
                self._run_steps()
                if self.packed:
                    threads.tick()
                    self._run_jobs()
            w = self._running[turn]
            if isinstance(w, _FastWorker):
                w.turn()
            else:
                w.go.release()
                self._back.acquire()
            self.heartbeat = time.monotonic()
            self.turns += 1
            if w.done:
                w.finished()
                with self._cv:
                    self._running.pop(turn)
                    self._free.append(w.slot)
            else:
                turn += 1

    def _run_steps(self) -> None:
        # The fast path's waiting program calls, all sequences' in one pass where possible.
        waiting = [w for w in self._running
                   if isinstance(w, _FastWorker) and w.step is not None and not w.has_out]
        if not waiting:
            return
        try:
            outs = self.fast.run_many([w.step for w in waiting])
        except Exception:
            # Each alone, so that one request's failure stays its own (a batched step
            # writes only the caches' slots past each sequence's position, which its next
            # step overwrites).
            log.debug("batched fast-path step failed; running its sequences one by one",
                      exc_info=True)
            outs = []
            for w in waiting:
                try:
                    outs.append(self.fast.run(w.step))
                except Exception as e:
                    outs.append(e)
        else:
            if len(waiting) > 1:
                self.packed_steps += 1
        for w, out in zip(waiting, outs, strict=True):
            w.step_out, w.has_out = out, True

    @torch.inference_mode()
    def _run_jobs(self) -> None:
        pending = [w for w in self._running if w.job is not None]
        if len(pending) > 1:
            starts = [w.job[1].length for w in pending]
            try:
                outs = self.model.forward_packed([w.job for w in pending])
            except Exception as failure:
                # Put every cache back where it was, then let each sequence fail (or not)
                # alone below: one request's error must never become another's. A recurrent
                # layer that a long prompt piece went through keeps no snapshot to return
                # to (GatedDeltaNetCache): that sequence's state is lost, and it fails.
                log.debug("packed forward failed; running its sequences one by one",
                          exc_info=True)
                for w, start in zip(pending, starts, strict=True):
                    try:
                        w.job[1].trim(start)
                    except ValueError:
                        w.job, w.job_out = None, failure
                pending = [w for w in pending if w.job is not None]
            else:
                self.packed_steps += 1
                for w, out in zip(pending, outs, strict=True):
                    w.job, w.job_out = None, out
                return
        for w in pending:  # a lone sequence, or those of a packed step that failed
            try:
                out = self.model(*w.job)
            except Exception as e:
                out = e
            w.job, w.job_out = None, out

    def _admit(self) -> None:
        while self._free and self._waiting:
            req = self._waiting.popleft()
            req.admitted_at = time.monotonic()
            slot = self._free.pop()
            kind = _FastWorker if self._fast_fits(req) else _Worker
            w = kind(self, slot, req)
            self._running.append(w)
            if self.stats is not None:
                self.stats.admitted(req)
            w.start()

    def _fast_fits(self, req: Request) -> bool:
        # Requests that fit the fast path's cache take it (sampled ones where it samples);
        # the rest run the eager engine (longer contexts).
        return (self.fast is not None and (req.params.greedy or self.fast.samples)
                and self.fast.fits(len(req.prompt_ids), req.params.max_tokens,
                                   self.num_draft_tokens))
