"""The ``mtpkit`` command. Subcommands import their machinery only when called."""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def _generate_args(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with MTP speculative decoding",
        description="Generate text from PROMPT; text streams to stdout, metrics to stderr.",
    )
    p.add_argument("prompt", help="the prompt text (or a user message with --chat)")
    p.add_argument("--model", help="checkpoint folder or .gguf file (default: the built-in model)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=3,
                   help="draft tokens per step (default 3; 0 = no speculation)")
    p.add_argument("--no-mtp", action="store_true", help="decode without speculation")
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
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(a) -> int:
    from .engine.sampling import SamplingParams
    from .engine.session import Session, default_model_path

    params = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
        stop=a.stop, seed=a.seed, ignore_eos=a.ignore_eos,
    )
    params.validate()
    if a.num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {a.num_draft_tokens}")
    session = Session.load(a.model or default_model_path(), device=a.device, dtype=a.dtype)
    k = 0 if a.no_mtp else a.num_draft_tokens
    if k and not session.engine.has_mtp:
        print(f"note: {session.name} has no MTP head; decoding without speculation",
              file=sys.stderr)
        k = 0
    stream = not a.json
    out = session.complete(a.prompt, params, k, chat=a.chat,
                           on_text=(lambda s: print(s, end="", flush=True)) if stream else None)
    if stream:
        print()
    report = {"text": out.text, "finish_reason": out.finish_reason,
              "num_draft_tokens": k, "metrics": out.metrics.as_dict()}
    if a.compare and k:
        base = session.complete(a.prompt, params, 0, chat=a.chat)
        report["baseline_tokens_per_s"] = base.metrics.tokens_per_s
        report["speedup"] = (out.metrics.tokens_per_s / base.metrics.tokens_per_s
                             if base.metrics.tokens_per_s else None)
        report["identical_to_baseline"] = base.token_ids == out.token_ids
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
            print(f"without MTP: {report['baseline_tokens_per_s']:.1f} tok/s; speed-up "
                  f"{report['speedup']:.2f}x; output {same}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="mtpkit", description="Multi-Token-Prediction speculative decoding toolkit."
    )
    parser.add_argument("--version", action="version", version=f"mtpkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: user mistakes print one clear line and exit 2, never a traceback."""
    from .checkpoint.errors import CheckpointError
    from .engine.sampling import SamplingError

    args = build_parser().parse_args(argv)
    try:
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
