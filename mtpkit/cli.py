"""The ``mtpkit`` command. Subcommands import their machinery only when called."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
import time
import warnings

from .builtin import MODEL_HELP


def _generate_args(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with MTP speculative decoding",
        description="Generate text from PROMPT; text streams to stdout, metrics to stderr.",
    )
    p.add_argument("prompt", help="the prompt text (or a user message with --chat)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--head", help="an MTP head folder (from `mtpkit calibrate`) to use")
    # One: every supported release has one MTP layer, and chaining it further was accepted
    # too rarely to pay in every configuration measured (docs/benchmarks.md).
    p.add_argument("--num-draft-tokens", "-k", type=int, default=1,
                   help="draft tokens per step (default 1; 0 = no speculation)")
    p.add_argument("--no-mtp", action="store_true", help="decode without speculation")
    p.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary, not the head's frequent-token subset")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens (benchmarks)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--compare", action="store_true",
                   help="also decode without MTP, check the texts agree, report the speed-up")
    _compile_args(p)
    threads_arg(p)
    p.set_defaults(func=_cmd_generate)


def busy_warning(others: float | None) -> str | None:
    """A warning when other programs kept a share of the CPU busy while speeds were timed."""
    if others is None or others < 0.3:
        return None
    return (f"other programs kept {others:.1f} CPUs busy while this ran (mtpkit left them "
            "their share), so these speeds are not those of a quiet machine")


def threads_arg(p) -> None:
    """The --threads option of every command that decodes."""
    p.add_argument("--threads", type=int, default=None,
                   help="decode with exactly N CPU threads (default: the CPUs this process "
                        "may use, fewer while other programs keep some of them busy)")


def _compile_args(p) -> None:
    p.add_argument("--compile", choices=["auto", "off", "aoti", "inductor", "eager"],
                   default="auto",
                   help="how requests run their fixed-shape programs (auto, the "
                        "default: compiled where `mtpkit warmup` built them, else uncompiled, "
                        "so nothing waits on a build; aoti: build any missing now, about 1.5 "
                        "min each, then load them from the cache; inductor: torch.compile in "
                        "process; eager: never compiled; off: the plain eager engine)")
    draft_vocab_size_arg(p)
    p.add_argument("--draft-p-min", type=float, default=None,
                   help="with --compile: verify only the drafts before the first whose head "
                        "probability is below this (adaptive draft length)")


def draft_vocab_size_arg(p) -> None:
    """The --draft-vocab-size option of every command that drafts."""
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft from only the N most frequent tokens of the head's draft "
                        "vocabulary (cheaper drafts; output unchanged)")


def warmup_command(model, head, k: int) -> str:
    """The `mtpkit warmup` command that builds what a run of this model (None: the built-in
    one), head and draft length runs."""
    return " ".join(["mtpkit warmup"]
                    + [f"{flag} {shlex.quote(str(v))}" for flag, v in
                       (("--model", model), ("--head", head)) if v]
                    + ([f"-k {k}"] if k > 1 else []))


def _cmd_generate(a) -> int:
    from .engine.sampling import SamplingParams
    from .engine.session import Session

    params = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
        stop=a.stop, seed=a.seed, ignore_eos=a.ignore_eos,
    )
    params.validate()
    if a.num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {a.num_draft_tokens}")
    t0 = time.perf_counter()
    session = Session.load(a.model, head=a.head, device=a.device, dtype=a.dtype,
                           full_draft_vocab=a.full_draft_vocab, compile=a.compile,
                           draft_p_min=a.draft_p_min, draft_vocab_size=a.draft_vocab_size)
    k = 0 if a.no_mtp else a.num_draft_tokens
    if k and not session.engine.has_mtp:
        print(f"note: {session.name} has no MTP head; decoding without speculation",
              file=sys.stderr)
        k = 0
    fast = session.engine.fast
    if fast is not None:
        if not session.engine.fast_takes(params):
            if a.compile != "auto":
                print("note: --compile serves greedy requests here; sampling runs eagerly",
                      file=sys.stderr)
        else:
            fast.warmup_for(params, k)
            if params.greedy and a.compare and k:
                fast.warmup(0)
            st = fast.stats
            if st.loaded or st.compiled or a.compile != "auto":
                print(f"compiled programs: {st.loaded} loaded, {st.compiled} built; ready "
                      f"{time.perf_counter() - t0:.1f} s after start", file=sys.stderr)
            if fast.pending:
                print("note: running the fast path uncompiled (several times slower): "
                      f"`{warmup_command(a.model, a.head, k)}` compiles it once",
                      file=sys.stderr)
    stream = not a.json

    def run(kk: int, watched: bool, warm: bool = False):
        show = (lambda s: print(s, end="", flush=True)) if stream and watched else None
        p = dataclasses.replace(params, max_tokens=min(8, params.max_tokens)) if warm else params
        return session.complete(a.prompt, p, kk, chat=a.chat, on_text=show)

    if a.compare and k:
        from . import threads
        from .bench.common import compare_in_turns

        start = threads.mark()
        outs, bases = compare_in_turns(run, k)
        others = threads.others_since(start)
        out = outs[0]
    else:
        out = run(k, True)
    if stream:
        print()
    report = {"text": out.text, "finish_reason": out.finish_reason,
              "num_draft_tokens": k, "metrics": out.metrics.as_dict()}
    if a.compare and k:
        mtp_rate = sum(o.metrics.tokens_per_s for o in outs) / len(outs)
        base_rate = sum(b.metrics.tokens_per_s for b in bases) / len(bases)
        report["tokens_per_s"] = mtp_rate
        report["baseline_tokens_per_s"] = base_rate
        report["speedup"] = mtp_rate / base_rate if base_rate else None
        report["identical_to_baseline"] = all(r.token_ids == out.token_ids
                                              for r in outs + bases)
        report["other_programs_cpus"] = others
        report["busy_cpu_warning"] = busy_warning(others)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        m = out.metrics
        if k:
            print(m.vllm_line(), file=sys.stderr)
        print(f"{m.generated_tokens} tokens, {m.tokens_per_s:.1f} tok/s, "
              f"TTFT {m.ttft_s * 1000:.0f} ms, finish: {out.finish_reason}", file=sys.stderr)
        if "speedup" in report:
            same = "identical" if report["identical_to_baseline"] else "DIFFERENT"
            print(f"in turns, both warmed up: with MTP {report['tokens_per_s']:.1f} tok/s, "
                  f"without MTP {report['baseline_tokens_per_s']:.1f} tok/s; speed-up "
                  f"{report['speedup']:.2f}x; output {same}", file=sys.stderr)
            if report["busy_cpu_warning"]:
                print(f"warning: {report['busy_cpu_warning']}", file=sys.stderr)
    return 0


def _warmup_args(sub) -> None:
    p = sub.add_parser(
        "warmup",
        help="build the compiled programs that generate and serve then load (once per model)",
        description="Build the compiled programs of a model's fast path (with and without "
                    "MTP) into the compile cache. `mtpkit generate` and `mtpkit serve` load "
                    "them from then on; until they exist, both run the same programs "
                    "uncompiled. Run it in the background on a fresh machine.",
    )
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--head", help="an MTP head folder (from `mtpkit calibrate`) to use")
    p.add_argument("--num-draft-tokens", "-k", default="1",
                   help="the draft length to build for (default 1, as generate and serve), "
                        "or several, comma-separated (1,2,3)")
    p.add_argument("--full-draft-vocab", action="store_true",
                   help="build for drafting over the whole vocabulary")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    threads_arg(p)
    p.set_defaults(func=_cmd_warmup)


def _cmd_warmup(a) -> int:
    from .bench.common import parse_int_list
    from .engine.programs import unsupported_reason
    from .engine.session import Session

    ks = parse_int_list(a.num_draft_tokens, "--num-draft-tokens", 0, 31)
    # Stopped (a server's background build ends with the server), it ends as on an error:
    # the unwinding removes its partial program file.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    session = Session.load(a.model, head=a.head, device=a.device, dtype=a.dtype,
                           full_draft_vocab=a.full_draft_vocab, compile="aoti")
    fast = session.engine.fast
    if fast is None:
        reason = unsupported_reason(session.engine.model)
        print(f"nothing to build: {session.name} runs on the eager engine ({reason})",
              file=sys.stderr)
        return 0
    for k in sorted({k if fast.has_mtp else 0 for k in ks} | {0}, reverse=True):
        fast.warmup(k)  # every k asked for, and no MTP (generate --no-mtp, serve -k 0)
    fast.warmup_pooled()  # what `mtpkit serve` runs for several requests at once
    st = fast.stats
    print(f"compiled programs for {session.name}: {st.compiled} built, {st.loaded} already "
          f"there, in {fast.cache.dir} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


def _calibrate_args(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="train an MTP head against a frozen trunk (self-distillation)",
        description="Train (or recalibrate) an MTP head on the trunk's own predictions.",
    )
    p.add_argument("--model",
                   help="trunk checkpoint (default: the built-in model's float16 weights)")
    p.add_argument("--data", nargs="+", required=True, help="text files, folders or JSONL")
    p.add_argument("--out", required=True, help="output head folder (written atomically)")
    p.add_argument("--init", choices=["scratch", "head"], default="scratch",
                   help="scratch: new head from the trunk's last layer; head: existing head")
    p.add_argument("--head", help="head folder to start from")
    p.add_argument("--draft-depth", type=int,
                   help="chained depths to train; depth d trains MTP layer (d-1) %% layers "
                        "(default: the head's MTP layer count, so every layer trains)")
    p.add_argument("--tokens", type=int, help="training tokens (default 1M)")
    p.add_argument("--steps", type=int, help="optimiser steps (instead of --tokens)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step and process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between saves")
    p.add_argument("--resume", action="store_true", help="continue from the last save")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft from the N most frequent training tokens, the loss scoring "
                        "only those (0: the whole vocabulary, scored whole; a head written "
                        "back into its checkpoint is always scored whole)")
    p.add_argument("--features", metavar="DIR",
                   help="cache the frozen trunk's outputs for --tokens tokens in DIR (built "
                        "once, reused), then train --epochs passes at head cost only")
    p.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the data (the feature cache, or the files without one)")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop training after this long and write the head (the learning "
                        "rate decays over the time left; 0: no limit)")
    p.add_argument("--teacher-top-k", type=int, default=32,
                   help="trunk probabilities the loss keeps per position (over the draft "
                        "vocabulary)")
    p.add_argument("--head-type", choices=["mtp", "eagle3"], default="mtp",
                   help="mtp: fc over [embedding, final state], the trunk's lm_head; eagle3: "
                        "fc over three trunk states, its own lm_head over --draft-vocab tokens "
                        "(Llama-family trunks; export-head --format eagle3)")
    p.add_argument("--aux-layers", type=int, nargs=3, metavar="L",
                   help="eagle3: the trunk layers whose input states the head reads (default "
                        "vLLM's: 2, n/2, n-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(a) -> int:
    from .train.calibrate import CalibrateConfig, run

    if a.init == "head" and a.head is None and _is_builtin(a.model):
        a.head = _builtin_head_or_none()
    model = str(_source_trunk(a.model))
    from .envs import get

    distributed = get("WORLD_SIZE") > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if a.device.startswith("cuda") else "gloo")
    try:
        cfg = CalibrateConfig(
            model=model, data=a.data, out=a.out, init=a.init, head=a.head,
            draft_depth=a.draft_depth, tokens=a.tokens, steps=a.steps, seed=a.seed,
            device=a.device, seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr,
            heldout_fraction=a.heldout_fraction, checkpoint_every=a.checkpoint_every,
            resume=a.resume, draft_vocab=a.draft_vocab, features=a.features,
            epochs=a.epochs, minutes=a.minutes, top_k=a.teacher_top_k,
            head_type=a.head_type, aux_layers=a.aux_layers,
        )
        run(cfg, progress="bar" if sys.stderr.isatty() else "lines")
        if distributed:
            # Ranks leave together: a rank tearing gloo down while rank 0 still writes the
            # head aborts the process ("terminate called without an active exception").
            dist.barrier()
    finally:
        if distributed:
            # The DDP wrapper sits in reference cycles; freeing it at interpreter exit, after
            # the group is gone, lets a gloo thread die joinable and abort the process.
            import gc

            gc.collect()
            dist.destroy_process_group()
    if not distributed or get("RANK") == 0:
        print(f"head written to {a.out}", file=sys.stderr)
    return 0


def _distill_args(sub) -> None:
    p = sub.add_parser(
        "distill-data",
        help="write the trunk's own answers to chat and code prompts (calibrate's data)",
        description="Answer templated chat prompts and prompts about standard-library "
                    "functions with the trunk, as JSONL shards for `mtpkit calibrate --data`. "
                    "Resumable: run the same command again to continue a stopped run.",
    )
    p.add_argument("--model", help="the trunk to answer with (default: the built-in model, "
                   "as generate runs it); its head, if any, only speeds the answers up")
    p.add_argument("--head", help="a head folder to draft with while answering")
    p.add_argument("--out", required=True, help="output folder (a stopped run's to resume)")
    p.add_argument("--prompts", type=int, default=2000, help="templated chat prompts")
    p.add_argument("--code-prompts", type=int, default=0,
                   help="prompts about functions of this Python's standard library")
    p.add_argument("--sampled", type=float, default=0.0,
                   help="share of prompts answered by sampling, not greedily (0 to 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled answers")
    p.add_argument("--top-p", type=float, default=0.95, help="for the sampled answers")
    p.add_argument("--max-tokens", type=int, default=192, help="longest answer")
    p.add_argument("--shards", type=int, default=20, help="JSONL files (calibrate holds out "
                   "whole files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this long (resume later with the same command)")
    p.set_defaults(func=_cmd_distill)


def _cmd_distill(a) -> int:
    from .engine.session import Session
    from .train.distill import DistillConfig, run

    cfg = DistillConfig(
        model=str(a.model or "builtin"), out=a.out, prompts=a.prompts,
        code_prompts=a.code_prompts, sampled=a.sampled, temperature=a.temperature,
        top_p=a.top_p, max_tokens=a.max_tokens, shards=a.shards, seed=a.seed,
        minutes=a.minutes)
    cfg.validate()
    session = Session.load(a.model, head=a.head)
    record = run(cfg, session, log=lambda m: print(m, file=sys.stderr))
    state = "done" if record["finished"] else "stopped (run the same command to go on)"
    print(f"{a.out}: {record['done']}/{record['prompts_total']} prompts, "
          f"{record['answer_tokens']} answer tokens, {state}", file=sys.stderr)
    return 0


def _export_head_args(sub) -> None:
    p = sub.add_parser(
        "export-head",
        help="write trunk + MTP head as one checkpoint vLLM serves with MTP",
        description="Write a Llama/Qwen2 trunk and its mtpkit head as a MiMo-layout checkpoint "
                    "(Qwen2 layers + one MTP layer), which vLLM serves with "
                    "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'.",
    )
    p.add_argument("--model",
                   help="trunk checkpoint folder (default: the built-in model's float16 weights)")
    p.add_argument("--head", help="head folder (default: the built-in head with the built-in "
                                  "model; none: the checkpoint's own head)")
    p.add_argument("--format", default="mimo",
                   help="mimo (trunk + MTP head; see --help) or eagle3 (an EAGLE-3 head alone, "
                        "as vLLM's Eagle3LlamaForCausalLM)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.set_defaults(func=_cmd_export_head)


def _cmd_export_head(a) -> int:
    from .train.export import export_head

    head = a.head
    if _is_builtin(a.model) and head is None:
        head = _builtin_head_or_none()
    model = str(_source_trunk(a.model))
    if a.format == "eagle3":
        from .train.export_eagle3 import export_eagle3

        if head is None:
            raise SystemExit("error: --format eagle3 needs --head: an EAGLE-3 head folder "
                             "from `mtpkit calibrate --head-type eagle3`")
        out = export_eagle3(model, head, a.out, a.dtype)
        print(f"wrote {out} (Eagle3LlamaForCausalLM). Serve it with vLLM:\n"
              f"  vllm serve {model} --speculative-config "
              f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", "
              "\"num_speculative_tokens\": 3}'")
        return 0
    out = export_head(model, head, a.out, a.format, a.dtype)
    print(f"wrote {out} (model_type mimo, one MTP layer). Serve it with vLLM:\n"
          f"  vllm serve {out} --speculative-config "
          "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'")
    return 0


def _source_trunk(model):
    from .builtin import source_trunk

    return source_trunk(model)


def _is_builtin(model) -> bool:
    from .builtin import builtin_name

    return builtin_name(model) is not None


def _builtin_head_or_none():
    from .builtin import builtin_head

    return builtin_head()


def _eval_args(sub) -> None:
    p = sub.add_parser("eval", help="measure MTP acceptance offline",
                       description="Per-position acceptance of a model's MTP head on a corpus "
                                   "and, in teacher mode, the trunk's perplexity on it.")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--head", help="head folder to lay over the model")
    p.add_argument("--data", nargs="+", required=True, help="text files, folders or JSONL")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=3)
    p.add_argument("--mode", choices=["teacher", "generate"], default="teacher")
    p.add_argument("--max-tokens", type=int, default=20000,
                   help="teacher: corpus positions; generate: tokens per prompt (default 64)")
    p.add_argument("--prompts", type=int, default=8, help="generate mode: number of prompts")
    p.add_argument("--full-draft-vocab", action="store_true",
                   help="draft over the whole vocabulary, not the head's frequent-token subset")
    draft_vocab_size_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None,
                   help="float32 (CPU default) or bfloat16 (CUDA default); acceptance "
                        "measured on a bf16 trunk differs from the fp32 trunk's")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(a) -> int:
    from .engine.session import Session
    from .train.data import list_files
    from .train.evaluate import generate_eval, teacher_eval

    if a.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {a.num_draft_tokens}")
    files = [str(f) for f in list_files(a.data)]
    session = Session.load(a.model, head=a.head, device=a.device, dtype=a.dtype,
                           full_draft_vocab=a.full_draft_vocab,
                           draft_vocab_size=a.draft_vocab_size)
    if not session.engine.has_mtp:
        raise ValueError(f"{session.name} has no MTP head to evaluate; pass --head DIR")
    k = a.num_draft_tokens
    if a.mode == "teacher":
        drafter = session.engine.drafter
        rep = teacher_eval(session.engine.model, session.tokenizer, files, k, a.max_tokens,
                           draft_vocab=drafter.vocab)
        result = rep.as_dict()
    else:
        max_tokens = 64 if a.max_tokens == 20000 else a.max_tokens
        result = generate_eval(session.engine, session.tokenizer, files, k, a.prompts,
                               max_tokens=max_tokens)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MTP acceptance ({a.mode} mode, k={k})")
    table.add_column("draft position")
    table.add_column("acceptance rate (chained)")
    table.add_column("mean acceptance length at k = position")
    mal = 1.0
    for i, r in enumerate(result["per_position_acceptance_rate"], 1):
        # Chained rates: drafting only the first i positions accepts 1 + their sum per step.
        mal += r
        table.add_row(str(i), f"{100 * r:.1f}%", f"{mal:.2f}")
    Console().print(table)
    print(f"mean acceptance length: {result['mean_acceptance_length']:.2f}")
    if result.get("perplexity") is not None:
        print(f"trunk perplexity: {result['perplexity']:.4f} over "
              f"{result['perplexity_tokens']} tokens")
    if a.mode == "generate":
        m = result
        print(f"tokens/s with MTP: {m['tokens_per_s']:.1f}; speed-up over no MTP: "
              f"{m['speedup']:.2f}x; output identical: {m['identical_to_no_mtp']}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (exit 2), like every other
    mistake; subcommand parsers are of the same class."""

    def error(self, message: str):
        """Print the mistake as one line and exit 2."""
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from . import __version__

    parser = _Parser(
        prog="mtpkit", description="Multi-Token-Prediction speculative decoding toolkit."
    )
    parser.add_argument("--version", action="version", version=f"mtpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_args(sub)
    _warmup_args(sub)
    _calibrate_args(sub)
    _distill_args(sub)
    _export_head_args(sub)
    _eval_args(sub)
    # Larger tools own their subcommands: each module has add_parser(sub), which registers
    # its parser and sets func; the module must import nothing heavy at import time.
    import importlib

    for name in _TOOL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not e.name or not name.startswith(e.name):
                raise  # the tool exists but one of its imports is missing
            continue
        mod.add_parser(sub)
    return parser


_TOOL_MODULES = [
    "mtpkit.quant.cli",  # quantize
    "mtpkit.doctor.cli",  # doctor, graft, fix-config
    "mtpkit.serve.cli",  # serve
    "mtpkit.bench.cli",  # bench
    "mtpkit.cachecmd",  # cache
]


def main(argv: list[str] | None = None) -> int:
    """Entry point: user mistakes print one clear line and exit 2, never a traceback."""
    from .checkpoint.errors import CheckpointError
    from .engine.sampling import SamplingError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else 0
    try:
        if getattr(args, "threads", None) is not None:
            from . import threads

            threads.configure(args.threads)
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
            return args.func(args)
    except (CheckpointError, SamplingError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
