"""`mtpkit bench offline | serve | compare`. Heavy imports happen inside the handlers."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..builtin import MODEL_HELP


def add_parser(sub) -> None:
    """Register ``bench`` and its subcommands on the top-level subparsers."""
    p = sub.add_parser("bench", help="benchmarks: k-sweep, serving, comparison with peers",
                       description="Measure mtpkit: pick a draft length (offline), load-test a "
                                   "server (serve), or compare with other engines (compare).")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from ..cli import threads_arg

    o = bsub.add_parser("offline", help="sweep draft lengths k in one process",
                        description="Greedy decoding of a prompt set at every k: tokens/s, "
                                    "TTFT, acceptance, speed-up over k=0, best k; table, "
                                    "CSV, JSON and PNG plots. With --compile auto (the "
                                    "default), programs `mtpkit warmup` has not built are "
                                    "built first, so that every k is timed compiled.")
    o.add_argument("--model", help=MODEL_HELP)
    o.add_argument("--head", help="MTP head folder to lay over the model")
    o.add_argument("--k", default="0,1,2,3,4,5",
                   help="comma-separated draft lengths (default 0,1,2,3,4,5; 0 is always run)")
    o.add_argument("--prompts", default="builtin", help="builtin (default) or a prompt file "
                   "(.jsonl with 'prompt'/'text' and optional 'chat', .json list, or .txt "
                   "with one prompt a line)")
    o.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    o.add_argument("--repeat", type=int, default=1, help="passes over the prompts (default 1)")
    o.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens")
    o.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary, not the head's token subset")
    o.add_argument("--device", default="cpu")
    o.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    o.add_argument("--out", help="results folder (default mtpkit-bench/offline-<time>)")
    o.add_argument("--no-bandwidth", action="store_true",
                   help="skip the memory-bandwidth measurement (and the bound column)")
    from ..cli import _compile_args

    _compile_args(o)
    threads_arg(o)
    o.set_defaults(func=cmd_offline)

    st = bsub.add_parser("steps", help="per-step costs: decode, verify k+1, draft, round",
                         description="Median milliseconds of one decode step, one "
                                     "verification of k+1 tokens, one MTP draft step and one "
                                     "speculative round, per backend, with the bandwidth "
                                     "bound of a decode step. The programs are timed in "
                                     "turns, and each ratio is the median of its per-turn "
                                     "ratios (their range is printed below the table).")
    st.add_argument("--model", help=MODEL_HELP)
    st.add_argument("--head", help="MTP head folder to lay over the model")
    st.add_argument("--k", type=int, default=3, help="draft length (default 3)")
    st.add_argument("--backends", default="eager,aoti",
                    help="comma-separated: eager, aoti, inductor (default eager,aoti)")
    st.add_argument("--context", type=int, default=128, help="cache positions filled (128)")
    st.add_argument("--repeats", type=int, default=20,
                    help="timed calls per program in each turn (20)")
    st.add_argument("--turns", type=int, default=5,
                    help="turns over all programs, each with its own bandwidth measurement; "
                         "ratios are taken within a turn (5)")
    st.add_argument("--full-draft-vocab", action="store_true",
                    help="draft over the whole vocabulary, not the head's draft vocabulary")
    from ..cli import draft_vocab_size_arg

    draft_vocab_size_arg(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    threads_arg(st)
    st.set_defaults(func=cmd_steps)

    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)",
                        description="Streaming requests at each concurrency: TTFT, TPOT, ITL, "
                                    "latency, throughput, failures and, from vLLM-style "
                                    "/metrics counters, spec-decode acceptance.")
    s.add_argument("--url", help="server root or .../v1, e.g. http://127.0.0.1:8000")
    s.add_argument("--llama-server", metavar="PATH",
                   help="also (or instead of --url) start llama.cpp's llama-server binary with "
                        "--gguf, one slot per request of the highest concurrency, measure it "
                        "the same way (with --url: each level on both servers in turn), and "
                        "stop it")
    s.add_argument("--gguf", help="the model llama-server serves (default: the built-in "
                                  "model's packaged Q4_1 GGUF)")
    s.add_argument("--llama-threads", type=int, default=None,
                   help="llama-server's -t (default: the CPUs this process may use)")
    s.add_argument("--model", help="model name to request (default: the first in /v1/models)")
    s.add_argument("--concurrency", default="1,4,8",
                   help="comma-separated concurrency levels (default 1,4,8)")
    s.add_argument("--num-prompts", type=int, default=32, help="requests per level (default 32)")
    s.add_argument("--dataset", default="builtin", help="builtin (default) or a prompt file")
    s.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")
    from ..envs import get

    s.add_argument("--api-key", default=get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--max-tokens", type=int, default=128, help="per request (default 128)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (a vLLM/mtpkit extension): fixed-length outputs")
    s.add_argument("--timeout", type=float, default=600, help="seconds per request")
    s.add_argument("--save", help="write the summary and every request's record (JSON)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=cmd_serve)

    c = bsub.add_parser("compare", help="mtpkit against transformers and llama.cpp",
                        description="Same prompts, same model, same machine, one run: mtpkit "
                                    "with and without MTP, transformers generate (fp32, bf16, "
                                    "prompt lookup) and llama.cpp when installed.")
    c.add_argument("--model", help="HF checkpoint folder (default: the built-in SmolLM2)")
    c.add_argument("--head", help="MTP head folder to lay over the model")
    c.add_argument("--k", type=int, default=1, help="mtpkit draft length (default 1, as "
                                                     "`mtpkit generate`)")
    c.add_argument("--prompts", default="builtin", help="builtin (default) or a prompt file")
    c.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    c.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="transformers prompt_lookup_num_tokens (default 10)")
    c.add_argument("--skip", default="", help="comma-separated engines to leave out: "
                   f"{', '.join(SKIPPABLE)}")
    c.add_argument("--out", help="results folder (default mtpkit-bench/compare-<time>)")
    c.add_argument("--compile", choices=["auto", "off", "aoti", "inductor"], default="auto",
                   help="the path mtpkit runs: auto (the default, what `mtpkit generate` "
                        "runs: programs `mtpkit warmup` built, else the same uncompiled), "
                        "off (the eager engine), aoti or inductor (build now)")
    c.add_argument("--gguf", action="append", default=[], metavar="FILE",
                   help="also run llama.cpp on this GGUF (repeatable), e.g. the packaged "
                        "Q4_1 beside a quantized --model")
    threads_arg(c)
    c.set_defaults(func=cmd_compare)

    b = bsub.add_parser("contention", help="speed on a quiet CPU against beside a busy thread",
                        description="Each path (every --model with every --compile) decodes "
                                    "the prompts with and without MTP, on a quiet CPU and "
                                    "beside one other busy thread (a process spinning "
                                    "`while True: pass`), the phases in turns; prints and "
                                    "writes tokens/s and the ratios: busy over quiet, MTP "
                                    "over no MTP.")
    b.add_argument("--model", action="append", default=None,
                   help="checkpoint folder or .gguf, repeatable; builtin names the built-in "
                        "model (default: builtin)")
    b.add_argument("--compile", default="off,aoti",
                   help="comma-separated: off (the eager engine), aoti, inductor (default "
                        "off,aoti)")
    b.add_argument("--k", type=int, default=1, help="draft length with MTP (default 1)")
    b.add_argument("--prompts", default="builtin", help="builtin (default) or a prompt file")
    b.add_argument("--num-prompts", type=int, default=4,
                   help="the first N prompts (default 4)")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    b.add_argument("--rounds", type=int, default=2,
                   help="rounds of quiet and busy phases in turn (default 2)")
    b.add_argument("--out", help="results folder (default mtpkit-bench/contention-<time>)")
    threads_arg(b)
    b.set_defaults(func=cmd_contention)


SKIPPABLE = ("transformers", "transformers-bf16", "prompt-lookup", "llama.cpp")


# -- shared ----------------------------------------------------------------------------------
def torch_threads() -> int:
    """Threads mtpkit decodes with on a quiet machine (and gives the peers)."""
    from .. import threads

    return threads.limit()


def _environment() -> dict:
    import torch

    return {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch_threads(), "python": platform.python_version(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _encode(session, prompts) -> list[list[int]]:
    has_template = bool(getattr(session.tokenizer, "chat_template", None))
    if any(p.chat for p in prompts) and not has_template:
        print("note: the model has no chat template; chat prompts are sent as plain text",
              file=sys.stderr)
    return [session.encode_prompt(p.text, p.chat and has_template) for p in prompts]


def _load_warning(con, env: dict) -> None:
    # A busy machine slows every engine unevenly; say so next to the numbers.
    from .common import busy_cpu

    note = busy_cpu(env.get("load_average"), env.get("cpu_count"))
    if note:
        con.print(f"[yellow]warning: when the run started, {note}[/yellow]")


def require_extra(command: str, *modules: str) -> None:
    """Refuse to start ``command`` (before any work) when a module of the bench extra is
    missing: one ``error:`` line naming it and the install command, exit 2."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"mtpkit bench {command} needs {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: "
                         'pip install "mtpkit[bench]"')


def _positive(value: int, option: str) -> int:
    if value < 1:
        raise ValueError(f"{option} must be >= 1, got {value}")
    return value


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _console():
    from rich.console import Console

    return Console(stderr=False, width=max(100, min(160, _columns())))


def _columns() -> int:
    import shutil

    return shutil.get_terminal_size((120, 40)).columns


# -- offline ---------------------------------------------------------------------------------
def cmd_contention(a) -> int:
    """Every path quiet and beside a busy thread; table, JSON and CSV; 1 if outputs differ."""
    from ..engine.session import Session
    from .common import write_csv, write_json
    from .contention import measure_path
    from .prompts import load_prompts

    for v, opt in ((a.num_prompts, "--num-prompts"), (a.max_tokens, "--max-tokens"),
                   (a.rounds, "--rounds"), (a.k, "--k")):
        _positive(v, opt)
    modes = [m.strip() for m in a.compile.split(",") if m.strip()]
    for m in modes:
        if m not in ("off", "aoti", "inductor"):
            raise ValueError(f"--compile: {m!r} is not one of off, aoti, inductor")
    prompts = load_prompts(a.prompts)[: a.num_prompts]
    out = Path(a.out) if a.out else _default_out("contention")
    env = _environment()
    rows = []
    for model in a.model or ["builtin"]:
        for mode in modes:
            session = Session.load(None if model == "builtin" else model, compile=mode)
            fast = session.engine.fast
            k = a.k if session.engine.has_mtp else 0
            if fast is not None:
                k = fast.served_k(k) if k else 0
                for kk in {k, 0}:
                    fast.warmup(kk)
            label = f"{Path(session.name).name}, {'eager' if mode == 'off' else mode}"
            print(f"{label}: quiet and busy phases in turns ...", file=sys.stderr)
            ids = _encode(session, prompts)
            row = measure_path(session.engine, ids, k, a.max_tokens, a.rounds)
            row["path"] = label
            rows.append(row)
            del session, fast
    result = {"command": "contention", "environment": env, "max_tokens": a.max_tokens,
              "prompts": len(prompts), "rounds": a.rounds, "rows": rows}
    fields = ["path", "k", "quiet_mtp", "quiet_plain", "busy_mtp", "busy_plain", "kept_mtp",
              "kept_plain", "mtp_over_plain_quiet", "mtp_over_plain_busy", "identical"]
    write_json(out / "results.json", result)
    write_csv(out / "summary.csv", rows, fields)
    print_contention(rows, out)
    return 0 if all(r["identical"] for r in rows) else 1


def print_contention(rows: list[dict], out: Path) -> None:
    """The contention table as Markdown (pasteable into docs)."""
    def f(x, pat="{:.1f}"):
        return "-" if x is None else pat.format(x)

    print("| path | quiet: MTP / no MTP tok/s | busy: MTP / no MTP tok/s | busy/quiet MTP, "
          "no MTP | MTP/no MTP quiet, busy | identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']}, k={r['k']} | {f(r['quiet_mtp'])} / {f(r['quiet_plain'])} | "
              f"{f(r['busy_mtp'])} / {f(r['busy_plain'])} | {f(r['kept_mtp'], '{:.2f}')}, "
              f"{f(r['kept_plain'], '{:.2f}')} | {f(r['mtp_over_plain_quiet'], '{:.2f}')}, "
              f"{f(r['mtp_over_plain_busy'], '{:.2f}')} | {'yes' if r['identical'] else 'NO'} |")
    print(f"results: {out}")


def cmd_offline(a) -> int:
    """Run the k-sweep, print the table, write CSV/JSON/PNG; 1 if outputs differ across k."""
    from .common import parse_int_list
    from .prompts import load_prompts

    require_extra("offline", "matplotlib")  # the plots, written after the sweep
    ks = parse_int_list(a.k, "--k", 0, 16)
    _positive(a.max_tokens, "--max-tokens")
    _positive(a.repeat, "--repeat")
    prompts = load_prompts(a.prompts)
    out = Path(a.out) if a.out else _default_out("offline")

    from ..engine.session import Session

    session = Session.load(a.model, head=a.head, device=a.device, dtype=a.dtype,
                           full_draft_vocab=a.full_draft_vocab, compile=a.compile,
                           draft_p_min=a.draft_p_min, draft_vocab_size=a.draft_vocab_size)
    fast = session.engine.fast
    if fast is not None:
        for k in ks:  # every k is checked before minutes go into building programs
            fast.check_draft(k)
        for k in ks:  # build or load every program before anything is timed
            fast.warmup(k)
        if fast.pending:
            # The sweep picks the draft length for the path `generate` runs once `mtpkit
            # warmup` has built it: a k timed uncompiled (several times slower) while the
            # others run compiled is no choice at all.
            n = len(fast.pending)
            print(f"note: building the {n} compiled program{'s' if n > 1 else ''} the sweep "
                  "needs (first run only, 1.5-4 min each on 2 cores), as `mtpkit warmup -k K` "
                  "would", file=sys.stderr)
            fast.build_pending()
    if any(ks) and not session.engine.has_mtp:
        raise ValueError(f"{session.name} has no MTP head, so only k=0 can be measured; "
                         "pass --head DIR (a head from `mtpkit calibrate`)")
    ids = _encode(session, prompts)
    result = offline_report(session, ids, ks, a.max_tokens, a.repeat, a.ignore_eos,
                            bandwidth=not a.no_bandwidth, progress=True)
    result["model"] = session.name
    result["title"] = f"({Path(session.name).name}, {_threads(torch_threads())})"
    result["head"] = a.head
    result["prompts"] = [{"name": p.name, "chat": p.chat, "prompt_tokens": len(i)}
                         for p, i in zip(prompts, ids, strict=True)]
    result["prompt_source"] = a.prompts
    result["outputs_k0"] = [session.tokenizer.decode(r["tokens"]) for r in result["runs"]
                            if r["k"] == 0 and r["repeat"] == 0]
    write_offline(result, out)
    print_offline(result, out)
    return 0 if result["identical_across_k"] else 1


def cmd_steps(a) -> int:
    """Print (or dump as JSON) the per-step cost table."""
    from ..engine.program_cache import BACKENDS
    from ..engine.programs import unsupported_reason
    from ..engine.session import Session
    from .steps import steps_report

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise ValueError(f"--backends {a.backends!r}: each must be one of {', '.join(BACKENDS)}")
    _positive(a.k, "--k")
    _positive(a.repeats, "--repeats")
    _positive(a.context, "--context")
    _positive(a.turns, "--turns")
    session = Session.load(a.model, head=a.head, full_draft_vocab=a.full_draft_vocab,
                           draft_vocab_size=a.draft_vocab_size)
    reason = unsupported_reason(session.engine.model)
    if reason is not None:
        raise ValueError(f"{session.name}: the fast path cannot run this model: {reason}")
    result = steps_report(session.engine, backends, a.k, a.context, a.repeats, a.turns)
    result["model"] = session.name
    result["threads"] = torch_threads()
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{Path(session.name).name}, {_threads(result['threads'])}, k={a.k}, context "
          f"{a.context}; bandwidth {result['bandwidth_gbs']:.1f} GB/s, trunk "
          f"{result['trunk_bytes'] / 1e6:.0f} MB -> decode bound "
          f"{result['decode_bound_ms']:.2f} ms; draft vocabulary "
          f"{result['draft_vocab_rows'] or 'full'}")
    head = f"{'backend':<9}{'decode':>9}{'verify':>9}{'draft':>9}{'round':>9}" \
           f"{'v/d':>7}{'dr/d':>7}{'r/d':>7}{'d/bound':>9}"
    print(head + "   (ms; ratios to decode)")
    nan = {"median": float("nan")}
    for r in result["rows"]:
        print(f"{r['backend']:<9}{r['decode_ms']:>9.2f}{r['verify_ms']:>9.2f}"
              f"{r.get('draft_ms', float('nan')):>9.2f}{r.get('round_ms', float('nan')):>9.2f}"
              f"{r['verify_over_decode']['median']:>7.2f}"
              f"{r.get('draft_over_decode', nan)['median']:>7.2f}"
              f"{r.get('round_over_decode', nan)['median']:>7.2f}"
              f"{r['decode_over_bound']['median']:>9.2f}")
    print(f"medians over {result['turns']} turns of {result['repeats']} calls a program; "
          "per-turn ranges:")
    for r in result["rows"]:
        ranges = [f"{label} {r[key]['min']:.2f}-{r[key]['max']:.2f}"
                  for label, key in (("v/d", "verify_over_decode"), ("r/d", "round_over_decode"),
                                     ("d/bound", "decode_over_bound")) if key in r]
        print(f"  {r['backend']}: " + ", ".join(ranges))
    return 0


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def _default_out(kind: str) -> Path:
    from .common import default_out_dir

    return default_out_dir(kind)


def offline_report(session, ids, ks, max_tokens, repeat=1, ignore_eos=False,
                   bandwidth=True, progress=False, bandwidth_mb: int = 256) -> dict:
    """Measure bandwidth and the sweep; everything as plain data (what results.json holds)."""
    from .common import measure_bandwidth, weight_bytes
    from .offline import bound_tokens_per_s, sweep

    engine = session.engine
    bw = measure_bandwidth(bandwidth_mb) if bandwidth else None
    wb = weight_bytes(engine.model)
    rows = None
    if engine.drafter is not None and engine.drafter.vocab is not None:
        rows = int(len(engine.drafter.vocab))
    env = _environment()  # before the runs: the load average says what they competed with
    total = len(ids) * repeat * len(set(ks) | {0})
    bar = _progress(total, "offline sweep") if progress else None
    try:
        res = sweep(engine, ids, ks, max_tokens, repeat, ignore_eos,
                    on_run=(lambda run: bar.advance()) if bar else None)
    finally:
        if bar:
            bar.stop()
    for s in res.summaries.values():
        if bw:
            s.bound_tokens_per_s = bound_tokens_per_s(
                wb, s.k, s.metrics.mean_acceptance_length, bw, rows)
    env["load_average_after"] = _environment()["load_average"]
    return {
        "command": "offline", "environment": env, "device": str(engine.device),
        "dtype": str(engine.model.lm_head.weight.dtype).replace("torch.", ""),
        "max_tokens": max_tokens, "repeat": repeat, "ignore_eos": ignore_eos,
        "bandwidth_gbs": bw, "weight_bytes": wb, "draft_vocab_rows": rows,
        "per_k": [res.summaries[k].as_dict() for k in res.ks],
        "identical_across_k": res.identical,
        "recommended_k": res.recommended_k, "recommendation": res.note,
        "runs": [dict(r.record(), tokens=r.tokens) for r in res.runs],
        "title": f"({_threads(env['torch_threads'])})",
    }


class _Bar:
    """A rich progress bar on stderr (plain when not a terminal)."""

    def __init__(self, total: int, what: str) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.p = Progress(console=Console(stderr=True), transient=True)
        self.task = self.p.add_task(what, total=total)
        self.p.start()

    def advance(self) -> None:
        self.p.advance(self.task)

    def stop(self) -> None:
        self.p.stop()


class _Lines:
    """Progress as a line on stderr every tenth of the work (logs, pipes)."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.done, self.t0 = total, what, 0, time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        if self.done == self.total or self.done % max(1, self.total // 10) == 0:
            print(f"{self.what}: {self.done}/{self.total} runs, "
                  f"{time.perf_counter() - self.t0:.0f} s", file=sys.stderr, flush=True)

    def stop(self) -> None:
        pass


def _progress(total: int, what: str) -> _Bar | _Lines:
    return _Bar(total, what) if sys.stderr.isatty() else _Lines(total, what)


def write_offline(result: dict, out: Path) -> None:
    """results.json, summary.csv, runs.csv and the three plots into ``out``."""
    from .common import write_csv, write_json
    from .plots import offline_plots

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    fields = ["k", "tokens_per_s", "speedup", "bound_tokens_per_s", "fraction_of_bound",
              "ttft_s_mean", "ttft_s_median", "mean_acceptance_length", "acceptance_rate",
              "per_position_acceptance_rate", "num_drafts", "num_draft_tokens",
              "num_accepted_tokens", "generated_tokens", "decode_s", "identical_to_k0"]
    write_csv(out / "summary.csv", result["per_k"], fields)
    write_csv(out / "runs.csv", result["runs"],
              ["k", "prompt", "repeat", "prompt_tokens", "generated_tokens", "ttft_s",
               "elapsed_s", "tokens_per_s", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens"])
    offline_plots(result, out)


def print_offline(result: dict, out: Path) -> None:
    """The sweep as a rich table plus the recommendation."""
    from rich.table import Table

    bw = result["bandwidth_gbs"]
    t = Table(title=f"mtpkit bench offline: {Path(result.get('model', '')).name} "
                    f"({result['dtype']}, {_threads(result['environment']['torch_threads'])}, "
                    f"{result['max_tokens']} tokens x {len(result.get('prompts', []))} prompts "
                    f"x {result['repeat']})")
    for col in ("k", "tok/s", "speed-up", "bound tok/s", "TTFT ms (median)", "mean acc. len",
                "acceptance", "per-position acceptance", "identical"):
        t.add_column(col, justify="right")
    for r in result["per_k"]:
        bound = "-" if r["bound_tokens_per_s"] is None else (
            f"{r['bound_tokens_per_s']:.0f} ({100 * r['fraction_of_bound']:.0f}%)")
        t.add_row(
            str(r["k"]), f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x" if r["speedup"] else "-", bound,
            _ms(r["ttft_s_median"]),
            "-" if not r["k"] else f"{r['mean_acceptance_length']:.2f}",
            "-" if not r["k"] else _pct(r["acceptance_rate"]),
            " ".join(f"{100 * x:.0f}%" for x in r["per_position_acceptance_rate"]) or "-",
            "yes" if r["identical_to_k0"] else "[red]NO[/red]",
        )
    con = _console()
    con.print(t)
    _load_warning(con, result["environment"])
    if bw:
        con.print(f"memory read bandwidth (torch sum): {bw:.1f} GB/s; bound = "
                  f"tokens per step x bandwidth / weight bytes read per step")
    same = ("identical across k" if result["identical_across_k"]
            else "[red]DIFFERENT across k (a bug: greedy MTP must be lossless)[/red]")
    con.print(f"greedy outputs: {same}")
    con.print(f"recommended k: [bold]{result['recommended_k']}[/bold] "
              f"({result['recommendation']})")
    con.print(f"results: {out}/ (results.json, summary.csv, runs.csv, speedup.png, "
              "acceptance.png, tokens_per_s.png)")


# -- serve -----------------------------------------------------------------------------------
def cmd_serve(a) -> int:
    """Benchmark a server at each concurrency; 1 when every request of a level failed."""
    import asyncio
    import json

    from .common import parse_int_list, write_json
    from .prompts import load_prompts

    require_extra("serve", "aiohttp")  # before any request
    from .serve import ServeBench

    levels = parse_int_list(a.concurrency, "--concurrency", 1, 4096)
    _positive(a.num_prompts, "--num-prompts")
    if a.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {a.timeout}")
    if not a.url and not a.llama_server:
        raise ValueError("give the server to measure: --url URL, or --llama-server PATH to "
                         "start llama.cpp's server (or both, measured level by level in turn)")
    prompts = load_prompts(a.dataset)

    def progress(url: str, level: dict) -> None:
        print(f"{url} concurrency {level['concurrency']}: {level['completed']}/"
              f"{level['requests']} ok in {level['duration_s']:.1f} s", file=sys.stderr)

    def measure(servers: list[tuple[str, str | None]]) -> list[dict]:
        # Each level on every server before the next level, the order reversed from one
        # level to the next (A B, B A, A B, ...): the machine's speed drifts over a run
        # (shared CPUs), and servers measured one after the other would each get a
        # different stretch of it.
        benches = [ServeBench(url, model, prompts, a.max_tokens, endpoint=a.endpoint,
                              api_key=a.api_key, timeout_s=a.timeout,
                              temperature=a.temperature, ignore_eos=a.ignore_eos)
                   for url, model in servers]
        runs: list[list[dict]] = [[] for _ in benches]  # a server's one-level runs
        for i, c in enumerate(levels):
            order = range(len(benches)) if i % 2 == 0 else reversed(range(len(benches)))
            for b in order:
                runs[b].append(asyncio.run(benches[b].run(
                    [c], a.num_prompts, on_level=lambda lv, b=b: progress(benches[b].root, lv))))
        return [{**got[0], "levels": [lv for run in got for lv in run["levels"]],
                 "environment": _environment(), "dataset": a.dataset} for got in runs]

    servers = [(a.url, a.model)] if a.url else []
    if a.llama_server:
        from .peers import llama_server

        with llama_server(a.llama_server, a.gguf, max(levels), a.llama_threads) as url:
            results = measure([*servers, (url, None)])
    else:
        results = measure(servers)
    if a.save:
        write_json(Path(a.save), results[0] if len(results) == 1 else results)
    summaries = [{**r, "levels": [{k: v for k, v in lv.items() if k != "records"}
                                  for lv in r["levels"]]} for r in results]
    if a.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2))
    else:
        for summary in summaries:
            print_serve(summary)
        if a.save:
            print(f"per-request records: {a.save}")
    return 1 if any(lv["completed"] == 0 for r in results for lv in r["levels"]) else 0


def print_serve(result: dict) -> None:
    """One column per concurrency level, one row per figure."""
    from rich.table import Table

    levels = result["levels"]
    t = Table(title=f"mtpkit bench serve: {result['model']} at {result['url']} "
                    f"({result['endpoint']}, max {result['max_tokens']} tokens)")
    t.add_column("")
    for lv in levels:
        t.add_column(f"c={lv['concurrency']}", justify="right")

    def row(name, fn):
        t.add_row(name, *[fn(lv) for lv in levels])

    row("requests ok / failed", lambda lv: f"{lv['completed']} / {lv['failures']}")
    row("duration s", lambda lv: f"{lv['duration_s']:.2f}")
    row("requests/s", lambda lv: f"{lv['requests_per_s']:.2f}")
    row("output tokens/s", lambda lv: f"{lv['output_tokens_per_s']:.1f}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                       ("e2e_latency_s", "E2E latency")):
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{label} {stat} ms", lambda lv, key=key, stat=stat: _ms(lv[key][stat]))
    if any(lv["spec_decode"] for lv in levels):
        def spec(fn):
            return lambda lv: "-" if not lv["spec_decode"] else fn(lv["spec_decode"])

        row("spec: drafts", spec(lambda s: f"{s['num_drafts']:.0f}"))
        row("spec: acceptance rate", spec(lambda s: _pct(s["acceptance_rate"])))
        row("spec: mean acceptance length", spec(
            lambda s: "-" if s["mean_acceptance_length"] is None
            else f"{s['mean_acceptance_length']:.2f}"))
        row("spec: per-position", spec(
            lambda s: " ".join(f"{100 * x:.0f}%" for x in s["per_position_acceptance_rate"])
            or "-"))
    con = _console()
    con.print(t)
    if not any(lv["spec_decode"] for lv in levels):
        con.print("no spec-decode counters on /metrics (vllm:spec_decode_*): acceptance "
                  "not reported")
    for lv in levels:
        for err in lv["errors"][:3]:
            con.print(f"[red]c={lv['concurrency']} failure:[/red] {err}", markup=True,
                      highlight=False)


# -- compare ---------------------------------------------------------------------------------
def cmd_compare(a) -> int:
    """Run every engine; 1 when mtpkit with and without MTP disagree (a bug)."""
    from .prompts import load_prompts

    require_extra("compare", "matplotlib")  # the plot, written after every engine ran
    _positive(a.max_tokens, "--max-tokens")
    _positive(a.k, "--k")
    _positive(a.prompt_lookup_tokens, "--prompt-lookup-tokens")
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    bad = skip - set(SKIPPABLE)
    if bad:
        raise ValueError(f"--skip: unknown engine(s) {', '.join(sorted(bad))}; "
                         f"choose from {', '.join(SKIPPABLE)}")
    prompts = load_prompts(a.prompts)
    for g in a.gguf:
        if not Path(g).is_file():
            raise ValueError(f"--gguf {g}: no such file")
    out = Path(a.out) if a.out else _default_out("compare")
    result = compare_report(a.model, a.head, prompts, a.max_tokens, a.k,
                            a.prompt_lookup_tokens, skip, progress=True, compile=a.compile,
                            ggufs=[Path(g) for g in a.gguf])
    write_compare(result, out)
    print_compare(result, out)
    return 0 if result["mtpkit_lossless"] else 1


def _precision(model) -> str:
    """How the trunk's weights run: fp32/bf16, or the quantized scheme of its Linears."""
    import torch

    from ..quant.linear import QuantLinear

    kinds = set()
    for m in model.model.modules():
        if isinstance(m, QuantLinear):
            w = "fp8" if m.kind == "fp8" else f"w{m.bits}"
            kinds.add(w + ("a8" if m.act_quant else "a16" if m.kind == "int" else ""))
    if kinds:
        return "+".join(sorted(kinds))
    from ..quant.linear import RowExactLinear

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    half = {m.weight.dtype for m in model.model.modules()
            if isinstance(m, RowExactLinear) and m.weight.dtype != torch.float32}
    if half:  # 16-bit weights, float32 arithmetic
        return f"{names.get(half.pop(), 'half')} weights"
    dtype = next(model.parameters()).dtype
    return names.get(dtype, str(dtype).replace("torch.", ""))


def compare_report(model, head, prompts, max_tokens: int, k: int, lookup: int = 10,
                   skip=frozenset(), progress: bool = False, bandwidth_mb: int = 256,
                   compile: str | None = "auto", ggufs=()) -> dict:
    """Every engine on the same prompt ids; ratios, agreement and bounds as plain data."""
    from ..engine.session import Session
    from .common import measure_bandwidth, weight_bytes
    from .compare import (
        agreement,
        distinct_ggufs,
        gguf_weight_bytes,
        interleave,
        llama_cpp_available,
        llama_cpp_runner,
        mtpkit_runners,
        run_transformers,
        write_q8_0,
    )
    from .offline import bound_tokens_per_s

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr)


    builtin = model is None
    if builtin:
        from ..builtin import builtin_trunk

        model = builtin_trunk()
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: compare needs a Hugging Face checkpoint folder (with "
                         "config.json) that transformers can load too")
    session = Session.load(None if builtin else folder, head=head, compile=compile)
    if not session.engine.has_mtp:
        raise ValueError(f"{session.name} has no MTP head to compare with; pass --head DIR")
    ids = _encode(session, prompts)
    eos = set(session.tokenizer.eos_token_ids)
    env = _environment()
    bw = measure_bandwidth(bandwidth_mb)
    wb = weight_bytes(session.engine.model)
    drafter = session.engine.drafter
    rows = int(len(drafter.vocab)) if drafter.vocab is not None else None
    notes: list[str] = []

    # mtpkit (the path `compile` names: by default what `mtpkit generate` runs) and
    # llama.cpp run in turns, prompt by prompt (interleave): the machine's drift must not
    # decide their ratios. transformers runs after them, one model at a time.
    prec = _precision(session.engine.model)
    fast = session.engine.fast
    way = " eager" if fast is None else ""
    if fast is not None and compile in ("aoti", "inductor"):
        say(f"mtpkit compiled ({compile}): the first run builds the programs ...")
    runners = mtpkit_runners(session, [0, k], [f"mtpkit {prec}{way} (no MTP)",
                                               f"mtpkit {prec}{way} MTP k={k}"], fast=fast)
    n_mtpkit = len(runners)
    extra = [(f"llama.cpp {g.stem}", g) for g in ggufs]
    if "llama.cpp" not in skip:
        if not llama_cpp_available():
            notes.append("llama.cpp skipped: llama-cpp-python is not installed "
                         "(pip install llama-cpp-python; it builds from source in ~7 min)")
        else:
            from ..builtin import cache_dir, smollm2_gguf

            ggufs = []
            try:
                q8 = cache_dir() / f"bench-{folder.name}-Q8_0.gguf"
                ggufs.append(("llama.cpp Q8_0 (written by mtpkit)",
                              write_q8_0(folder, session_tokenizer(folder), q8)))
            except (ValueError, KeyError, OSError) as e:
                notes.append(f"no Q8_0 GGUF for llama.cpp: {e}")
            if builtin:
                ggufs.append(("llama.cpp Q4_1 (packaged)", smollm2_gguf()))
            ggufs, repeats = distinct_ggufs(ggufs + extra)
            notes += repeats
            threads = torch_threads()
            for name, path in ggufs:
                r = llama_cpp_runner(name, path, ids, max_tokens, eos, threads)
                if not r.run.skipped:
                    r.run.bound_tokens_per_s = bw * 1e9 / gguf_weight_bytes(path)
                runners.append(r)
    say(", ".join(r.run.engine for r in runners if r.gen is not None)
        + ": in turns, prompt by prompt ...")
    schedule = interleave(runners, ids, max_tokens)
    if fast is not None and fast.pending:
        from ..cli import warmup_command

        build = warmup_command(None if builtin else folder, head, k)
        notes.append("mtpkit ran uncompiled (several times slower), as `mtpkit generate` does "
                     f"until `{build}` has built its programs (--compile aoti builds them now)")
    runs = [r.run for r in runners[:n_mtpkit]]
    peers = [r.run for r in runners[n_mtpkit:]]  # listed after transformers, as before
    base, mtp = runs[0], runs[1]
    base.bound_tokens_per_s = bound_tokens_per_s(wb, 0, 1.0, bw, rows)
    mtp.bound_tokens_per_s = bound_tokens_per_s(wb, k, mtp.mean_acceptance_length, bw, rows)
    pairs = [(runs[i], runs[i + 1]) for i in range(0, n_mtpkit, 2)]
    for b, m in pairs[1:]:
        b.bound_tokens_per_s, m.bound_tokens_per_s = (base.bound_tokens_per_s,
                                                      mtp.bound_tokens_per_s)
    session.engine.fast = None
    del session, runners  # and the compiled programs: transformers runs alone
    variants = []
    if "transformers" not in skip:
        variants.append(("transformers fp32", "float32", None))
    if "transformers-bf16" not in skip:
        variants.append(("transformers bf16", "bfloat16", None))
    if "prompt-lookup" not in skip:
        variants.append((f"transformers fp32 prompt lookup ({lookup})", "float32", lookup))
    if variants:
        say("transformers ...")
        for r in run_transformers(folder, ids, max_tokens, eos, variants):
            if "prompt lookup" not in r.engine:
                scale = 0.5 if "bf16" in r.engine else 1.0
                r.bound_tokens_per_s = bw * 1e9 / (wb["trunk"] * scale)
            runs.append(r)
    runs += peers
    table = []
    for r in runs:
        row = {"engine": r.engine, "skipped": r.skipped, "tokens_per_s": r.tokens_per_s,
               "ttft_s_median": _median(r.ttft_s), "bound_tokens_per_s": r.bound_tokens_per_s,
               "mean_acceptance_length": r.mean_acceptance_length,
               "generated_tokens": sum(len(t) for t in r.tokens)}
        for key, ref in (("vs_mtpkit_no_mtp", base), ("vs_mtpkit_mtp", mtp)):
            row[key] = (r.tokens_per_s / ref.tokens_per_s
                        if r.tokens_per_s and ref.tokens_per_s else None)
        if not r.skipped and r is not base:
            row["agreement_with_mtpkit_fp32"] = agreement(r, base)
        if r.skipped:
            notes.append(f"{r.engine} skipped: {r.skipped}")
        table.append(row)
    lossless = all(a == b for b0, m0 in pairs for a, b in zip(m0.tokens, b0.tokens, strict=True))
    env["load_average_after"] = _environment()["load_average"]
    return {"command": "compare", "environment": env, "model": str(folder),
            "head": head, "k": k, "max_tokens": max_tokens, "bandwidth_gbs": bw,
            "weight_bytes": wb, "draft_vocab_rows": rows,
            "prompts": [{"name": p.name, "chat": p.chat, "prompt_tokens": len(i)}
                        for p, i in zip(prompts, ids, strict=True)],
            "engines": table, "mtpkit_lossless": lossless, "notes": notes,
            "in_turns": schedule,
            "tokens": {r.engine: r.tokens for r in runs}}


def session_tokenizer(folder: Path):
    """mtpkit's tokenizer of an HF folder (for the GGUF it writes)."""
    from ..checkpoint.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(folder)


def _median(xs):
    from .common import summarize

    return summarize(xs)["median"]


def write_compare(result: dict, out: Path) -> None:
    """results.json, compare.csv and compare.png into ``out``."""
    from .common import write_csv, write_json
    from .plots import compare_plot

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    rows = []
    for r in result["engines"]:
        ag = r.get("agreement_with_mtpkit_fp32") or {}
        rows.append({**r, "identical_prompts": ag.get("identical_prompts"),
                     "earliest_divergence": ag.get("earliest_divergence")})
    write_csv(out / "compare.csv", rows,
              ["engine", "tokens_per_s", "vs_mtpkit_no_mtp", "vs_mtpkit_mtp",
               "bound_tokens_per_s", "ttft_s_median", "mean_acceptance_length",
               "generated_tokens", "identical_prompts", "earliest_divergence", "skipped"])
    ran = [r for r in result["engines"] if not r["skipped"]]
    if ran:
        compare_plot(ran, out)


def print_compare(result: dict, out: Path) -> None:
    """The comparison as a rich table plus the agreement checks."""
    from rich.table import Table

    t = Table(title=f"mtpkit bench compare: {Path(result['model']).name}, "
                    f"{len(result['prompts'])} prompts x {result['max_tokens']} tokens, "
                    f"{_threads(result['environment']['torch_threads'])}")
    for col in ("engine", "tok/s", "vs mtpkit no MTP", "vs mtpkit MTP", "bound tok/s",
                "TTFT ms", f"same text as {result['engines'][0]['engine']}"):
        t.add_column(col, justify="right" if col != "engine" else "left")
    for r in result["engines"]:
        if r["skipped"]:
            continue
        ag = r.get("agreement_with_mtpkit_fp32")
        same = "(reference)" if ag is None else (
            f"{ag['identical_prompts']}/{ag['prompts']} prompts"
            + ("" if ag["earliest_divergence"] is None
               else f"; first divergence at token {ag['earliest_divergence']}"))
        t.add_row(r["engine"], f"{r['tokens_per_s'] or 0:.1f}",
                  f"{r['vs_mtpkit_no_mtp']:.2f}x" if r["vs_mtpkit_no_mtp"] else "-",
                  f"{r['vs_mtpkit_mtp']:.2f}x" if r["vs_mtpkit_mtp"] else "-",
                  "-" if not r["bound_tokens_per_s"] else f"{r['bound_tokens_per_s']:.0f}",
                  _ms(r["ttft_s_median"]), same)
    con = _console()
    con.print(t)
    _load_warning(con, result["environment"])
    con.print(f"memory read bandwidth (torch sum): {result['bandwidth_gbs']:.1f} GB/s")
    if result["mtpkit_lossless"]:
        con.print("mtpkit with and without MTP: identical greedy outputs")
    else:
        con.print("[red]mtpkit with and without MTP DIFFER (a bug: MTP must be lossless)[/red]")
    for n in result["notes"]:
        con.print(f"note: {n}", highlight=False)
    con.print(f"results: {out}/ (results.json, compare.csv, compare.png)")
