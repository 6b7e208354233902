"""The ``doctor``, ``graft`` and ``fix-config`` subcommands (registered by mtpkit.cli)."""

from __future__ import annotations

import sys

ENGINE_CHOICES = ["vllm", "sglang", "llama.cpp", "mtpkit", "vllm-mlx", "mlx-lm", "all"]


def add_parser(sub) -> None:
    """Register doctor, graft and fix-config on the ``mtpkit`` subparsers."""
    p = sub.add_parser(
        "doctor", help="find out why MTP is broken in a checkpoint",
        description="Static checks of a checkpoint folder or .gguf file: each finding says "
                    "what is wrong, why an engine misbehaves and the exact fix. Exit status "
                    "0 healthy, 1 warnings, 2 errors.")
    p.add_argument("path", help="checkpoint folder or .gguf file")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="all",
                   help="apply this engine's loading rules (default: all)")
    p.add_argument("--vllm-version", metavar="X",
                   help="apply the ignore-list rules of this vLLM release (e.g. 0.28; "
                        "default: the latest read, 0.33); the report's facts list them")
    p.add_argument("--measure", action="store_true",
                   help="also load it in mtpkit and measure teacher-mode acceptance on a "
                        "built-in sample")
    p.add_argument("--reference", help="with --measure: measure this checkpoint (e.g. the "
                                       "BF16 release) the same way and compare")
    p.add_argument("--device", default="cpu", help="--measure device (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_doctor)

    g = sub.add_parser(
        "graft", help="copy an MTP head into a checkpoint that lost it",
        description="Copy the MTP head from SRC into DST (HF folders or .gguf files), fix the "
                    "config, index and ignore list, write OUT atomically, then run doctor on "
                    "OUT. Inputs are never modified.")
    g.add_argument("--from", dest="src", help="checkpoint that has the head (BF16 release)")
    g.add_argument("--into", dest="dst", required=True, help="checkpoint that lost it")
    g.add_argument("--out", required=True, help="output folder or .gguf file")
    g.add_argument("--mtp-precision", choices=["keep", "match"], default="keep",
                   help="keep: the head as stored in SRC (BF16; recommended); match: quantize "
                        "it like DST")
    g.add_argument("--engine", choices=ENGINE_CHOICES, default="all",
                   help="engines whose ignore-list naming to write (default: all)")
    g.add_argument("--config-only", action="store_true",
                   help="repair config, index and ignore list only (same as fix-config)")
    g.add_argument("--force", action="store_true", help="replace OUT if it exists")
    g.add_argument("--json", action="store_true", help="print the doctor report as JSON")
    g.set_defaults(func=_cmd_graft)

    f = sub.add_parser(
        "fix-config", help="repair MTP config fields, index and ignore list",
        description="Write a copy of PATH with the MTP config field, the safetensors index "
                    "and the quantization ignore list (or the GGUF block_count / nextn key) "
                    "made consistent with the tensors, then run doctor on it.")
    f.add_argument("path", help="checkpoint folder or .gguf file")
    f.add_argument("--out", required=True, help="output folder or .gguf file")
    f.add_argument("--engine", choices=ENGINE_CHOICES, default="all")
    f.add_argument("--force", action="store_true", help="replace OUT if it exists")
    f.add_argument("--json", action="store_true", help="print the doctor report as JSON")
    f.set_defaults(func=_cmd_fix_config)


def _engines(choice: str) -> list[str] | None:
    return None if choice == "all" else [choice]


def _print(report, as_json: bool) -> None:
    if as_json:
        print(report.to_json())
    else:
        report.print_rich()


def _cmd_doctor(a) -> int:
    from .checks import diagnose

    report = diagnose(a.path, _engines(a.engine), vllm_version=a.vllm_version)
    if a.reference and not a.measure:
        raise ValueError("--reference compares measured acceptance: add --measure")
    if a.measure:
        from .measure import judge, measure

        try:
            m = measure(a.path, device=a.device)
        except Exception as e:  # a load failure is a finding, not a crash of doctor
            from ..checkpoint.errors import CheckpointError
            from .findings import Finding

            if not isinstance(e, (CheckpointError, ValueError, RuntimeError)):
                raise
            report.add(Finding("measure-failed", "error", f"mtpkit cannot load {a.path}: {e}",
                               "the checkpoint does not load as its config describes it",
                               "see the static findings", ["mtpkit"], "load"))
        else:
            ref = measure(a.reference, device=a.device) if a.reference else None
            judge(report, m, ref)
    _print(report, a.json)
    return report.exit_code


def _cmd_graft(a) -> int:
    from .graft import fix_config, graft

    if a.config_only:
        if a.src:
            raise ValueError("--config-only repairs DST alone; drop --from")
        result = fix_config(a.dst, a.out, engines=_engines(a.engine), force=a.force)
    else:
        if not a.src:
            raise ValueError("graft needs --from SRC (the checkpoint that has the head)")
        result = graft(a.src, a.dst, a.out, precision=a.mtp_precision,
                       engines=_engines(a.engine), force=a.force)
    return _report_result(result, a.json)


def _cmd_fix_config(a) -> int:
    from .graft import fix_config

    result = fix_config(a.path, a.out, engines=_engines(a.engine), force=a.force)
    return _report_result(result, a.json)


def _report_result(result, as_json: bool) -> int:
    for line in result.changes:
        print(f"- {line}", file=sys.stderr)
    print(f"wrote {result.out}", file=sys.stderr)
    _print(result.report, as_json)
    return result.report.exit_code
