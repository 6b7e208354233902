"""Server counters and the /metrics text, with vLLM's metric names.

The Prometheus text exposition format is a few lines per metric, so it is written here by hand
rather than through ``prometheus_client``: that keeps the server to its declared dependencies
and lets one lock cover a consistent snapshot of every counter. Counters follow
``prometheus_client``'s convention (and so vLLM's output): the family ``vllm:x`` is exposed
as the sample ``vllm:x_total``, so ``vllm bench serve`` and existing dashboards read ours.
vLLM has no per-MTP-layer figure: those counters are mtpkit's own
(``mtpkit:spec_decode_num_{draft,accepted}_tokens_per_layer``).
"""

from __future__ import annotations

import math
import threading
import time
import weakref

# Bucket bounds (seconds or tokens); chosen for CPU-to-GPU latencies and small-to-long prompts.
_LATENCY = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
_ITL = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5, 5.0, 10.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Cumulative-bucket histogram as Prometheus exposes it."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one value."""
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value
        self.count += 1


class ServeStats:
    """Every counter of the server; updated by the engine thread, read by /metrics."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        # Per MTP layer (draft position p runs layer p % layers): drafts and acceptances.
        self.drafts_per_layer: list[int] = []
        self.accepted_per_layer: list[int] = []
        # worker -> its per-layer counters when last accounted (dropped with the worker).
        self._layer_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected: dict[str, int] = {}
        self.ttft = Histogram(_LATENCY)
        self.itl = Histogram(_ITL)
        self.e2e = Histogram(_LATENCY)
        self.queue = Histogram(_LATENCY)
        self.prompt_hist = Histogram(_TOKENS)
        self.gen_hist = Histogram(_TOKENS)

    # -- engine thread ----------------------------------------------------------------------
    def admitted(self, req) -> None:
        """A request took a slot: its prompt will be prefilled now."""
        with self.lock:
            self.prompt_tokens += len(req.prompt_ids)
            self.queue.observe(req.admitted_at - req.arrival)

    def turn(self, worker) -> None:
        """Count what one turn of one request produced (deltas of its engine counters)."""
        m, seen, now = worker.result.metrics, worker.seen, time.monotonic()
        with self.lock:
            self.num_drafts += m.num_drafts - seen.drafts
            self.num_draft_tokens += m.num_draft_tokens - seen.draft_tokens
            self.num_accepted_tokens += m.num_accepted_tokens - seen.accepted
            while len(self.accepted_per_pos) < len(m.accepted_per_pos):
                self.accepted_per_pos.append(0)
            while len(seen.per_pos) < len(m.accepted_per_pos):
                seen.per_pos.append(0)
            for i, v in enumerate(m.accepted_per_pos):
                self.accepted_per_pos[i] += v - seen.per_pos[i]
                seen.per_pos[i] = v
            was = self._layer_seen.setdefault(worker, ([], []))
            for mine, theirs, last in ((self.drafts_per_layer, m.drafts_per_layer, was[0]),
                                       (self.accepted_per_layer, m.accepted_per_layer, was[1])):
                for lst in (mine, last):
                    lst.extend([0] * (len(theirs) - len(lst)))
                for i, v in enumerate(theirs):
                    mine[i] += v - last[i]
                    last[i] = v
            new = worker.req.completion_tokens - seen.generated
            self.generation_tokens += new
            if new:
                if worker.last_emit is not None:
                    self.itl.observe(now - worker.last_emit)
                worker.last_emit = now
        seen.drafts, seen.draft_tokens = m.num_drafts, m.num_draft_tokens
        seen.accepted, seen.generated = m.num_accepted_tokens, worker.req.completion_tokens

    def finished(self, req) -> None:
        """A request left (any reason, queue included)."""
        with self.lock:
            self.finished_by_reason[req.finish_reason or "abort"] += 1
            end = req.finished_at or time.monotonic()
            self.e2e.observe(end - req.arrival)
            if req.admitted_at is not None:
                self.prompt_hist.observe(len(req.prompt_ids))
                self.gen_hist.observe(req.completion_tokens)
            if req.first_token_at is not None:
                self.ttft.observe(req.first_token_at - req.arrival)

    # -- event loop -------------------------------------------------------------------------
    def rejected_request(self, reason: str) -> None:
        """A request refused before it reached the engine (bad input, auth, queue full)."""
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def render(self, running: int, waiting: int, turns: int, engine_idle_s: float,
               loaded: bool) -> str:
        """The /metrics page."""
        lab = {"model_name": self.model_name}
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        def sample(name: str, value: float, extra: dict | None = None) -> None:
            out.append(f"{name}{_labels({**lab, **(extra or {})})} {_num(value)}")

        def counter(name: str, help_: str, value: float) -> None:
            family(name, "counter", help_)
            sample(f"{name}_total", value)

        def gauge(name: str, help_: str, value: float) -> None:
            family(name, "gauge", help_)
            sample(name, value)

        def histogram(name: str, help_: str, h: Histogram) -> None:
            family(name, "histogram", help_)
            acc = 0
            for bound, c in zip([*h.bounds, math.inf], h.counts, strict=True):
                acc += c
                sample(f"{name}_bucket", acc, {"le": _num(bound)})
            sample(f"{name}_sum", h.sum)
            sample(f"{name}_count", h.count)

        with self.lock:
            gauge("vllm:num_requests_running", "Requests holding an engine slot.", running)
            gauge("vllm:num_requests_waiting", "Requests queued for a slot.", waiting)
            counter("vllm:prompt_tokens", "Prefill tokens processed.", self.prompt_tokens)
            counter("vllm:generation_tokens", "Generation tokens processed.",
                    self.generation_tokens)
            family("vllm:request_success", "counter", "Finished requests by finish reason.")
            for reason, n in self.finished_by_reason.items():
                sample("vllm:request_success_total", n, {"finished_reason": reason})
            counter("vllm:spec_decode_num_drafts", "Verification steps that carried drafts.",
                    self.num_drafts)
            counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                    self.num_draft_tokens)
            counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                    self.num_accepted_tokens)
            family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                   "Accepted draft tokens at each draft position (0-based).")
            for i, n in enumerate(self.accepted_per_pos):
                sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", n,
                       {"position": str(i)})
            family("mtpkit:spec_decode_num_draft_tokens_per_layer", "counter",
                   "Draft tokens proposed by each MTP layer (0-based; draft position p runs "
                   "layer p % layers).")
            for i, n in enumerate(self.drafts_per_layer):
                sample("mtpkit:spec_decode_num_draft_tokens_per_layer_total", n,
                       {"layer": str(i)})
            family("mtpkit:spec_decode_num_accepted_tokens_per_layer", "counter",
                   "Accepted draft tokens proposed by each MTP layer (0-based).")
            for i, n in enumerate(self.accepted_per_layer):
                sample("mtpkit:spec_decode_num_accepted_tokens_per_layer_total", n,
                       {"layer": str(i)})
            histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", self.ttft)
            histogram("vllm:inter_token_latency_seconds",
                      "Time between a request's successive token batches.", self.itl)
            histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", self.e2e)
            histogram("vllm:request_queue_time_seconds", "Arrival to slot.", self.queue)
            histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                      self.prompt_hist)
            histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                      self.gen_hist)
            family("mtpkit:requests_rejected", "counter",
                   "Requests refused before reaching the engine, by reason.")
            for reason, n in sorted(self.rejected.items()):
                sample("mtpkit:requests_rejected_total", n, {"reason": reason})
            counter("mtpkit:engine_turns", "Scheduling turns (one draft+verify step or one "
                    "prefill chunk of one request).", turns)
            gauge("mtpkit:engine_busy_without_progress_seconds",
                  "Seconds since the engine last finished a turn while it had work.",
                  engine_idle_s)
            gauge("mtpkit:model_loaded", "1 once the model is loaded.", int(loaded))
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict) -> str:
    def esc(s: str) -> str:
        return str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"
