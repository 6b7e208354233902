"""`mtpkit quantize`."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    """Register `quantize`."""
    p = sub.add_parser(
        "quantize",
        help="write a quantized copy of a checkpoint with its MTP head intact",
        description="Round-to-nearest weight-only quantization to compressed-tensors (vLLM) "
                    "or GGUF (llama.cpp), keeping the MTP head loadable by both.",
    )
    p.add_argument("--model",
                   help="HF checkpoint folder (default: the built-in model's float16 weights)")
    p.add_argument("--head", help="an MTP head folder (mtpkit calibrate) to merge in as mtp.*")
    p.add_argument("--scheme", choices=["w4a16", "w4a8", "w8a16", "w8a8", "fp8"],
                   default="w4a16",
                   help="weight-only int4/int8/fp8, or w8a8 / w4a8: int8 / int4 weights and "
                        "int8 activations quantized per token at run time (fastest on CPU)")
    p.add_argument("--group-size", type=int, default=None,
                   help="w4a16: 32/64/128/256 (default: 128, or per layer the largest of "
                        "64, 32 that divides its input size); w4a8: the same (default 32); "
                        "w8a16: default per channel; 0 = per channel. A size that does not "
                        "divide a layer's input size is refused")
    p.add_argument("--asymmetric", action="store_true", help="int schemes: with zero points")
    p.add_argument("--mtp", choices=["keep", "same", "w8a16"], default="keep",
                   help="MTP head precision: keep as stored (default; BF16 heads keep their "
                        "acceptance), same as the trunk, or int8")
    p.add_argument("--lm-head", choices=["keep", "same", "w8a16"], default="keep",
                   help="lm_head precision: keep as stored (default, what llm-compressor "
                        "writes), same as the trunk (int schemes), or int8 weights with "
                        "float activations (w8a16: near-lossless); a tied lm_head is untied "
                        "from the embedding. The lm_head is a fifth of a small model's "
                        "weights; quantized it decodes faster and lets the compiled path run "
                        "one-row steps")
    p.add_argument("--smooth", metavar="ALPHA",
                   help="w8a8/w4a8: move activation outliers into the weights first "
                        "(SmoothQuant), fitted on --calib-data; the per-token int8 "
                        "activations then lose far less. ALPHA: a strength in (0, 1), or "
                        "auto: each layer's best of 0.3-0.8 on the calibration text")
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn",
                   help="rtn: round to nearest (default); gptq: error-compensated rounding "
                        "fitted on --calib-data")
    p.add_argument("--calib-data", nargs="+",
                   help="--method gptq or --smooth: text files, folders or JSONL")
    p.add_argument("--calib-tokens", type=int, default=8192,
                   help="--method gptq or --smooth: calibration tokens (default 8192)")
    p.add_argument("--format", choices=["compressed-tensors", "gguf", "mlx"],
                   default="compressed-tensors",
                   help="mlx: MLX affine quantization as mlx-lm writes it, the MTP head where "
                        "vllm-mlx loads it (docs/mlx.md)")
    p.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=4,
                   help="--format mlx: bits per weight (default 4)")
    p.add_argument("--gguf-type", choices=["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0",
                                           "Q4_1", "Q4_0"], default="Q8_0",
                   help="--format gguf: tensor type (default Q8_0; --mtp sets the head's)")
    p.add_argument("--out", required=True, help="output folder (or .gguf file)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)


def run(a) -> int:
    """Run `mtpkit quantize`."""
    from .pack import Scheme
    from .quantize import quantize_checkpoint, quantize_gguf

    if a.format == "mlx":
        return _run_mlx(a)
    model = a.model
    from ..builtin import builtin_name

    if builtin_name(model) is not None:
        from ..builtin import builtin_head, source_trunk

        model = str(source_trunk(model))
        # A GGUF keeps only heads llama.cpp can load as nextn layers; the built-in head is
        # a Llama-trunk head, which llama.cpp has no MTP loader for.
        if a.head is None and a.format != "gguf":
            a.head = builtin_head()
    if a.format == "gguf":
        if a.head is not None:
            raise ValueError("--head with --format gguf is not supported yet; GGUF output "
                             "takes checkpoints whose MTP layers are their own")
        if a.lm_head != "keep":
            raise ValueError("--lm-head applies to compressed-tensors output; drop it for "
                             "--format gguf, whose writer decides the lm_head's type")
        path = quantize_gguf(model, a.out, a.gguf_type, force=a.force, mtp=a.mtp)
        print(f"wrote {path} ({a.gguf_type})", file=sys.stderr)
        return 0
    smooth = a.smooth
    if smooth is not None and smooth != "auto":
        try:
            smooth = float(smooth)
        except ValueError:
            raise ValueError(f"--smooth takes a number in (0, 1) or auto, got {smooth!r}") from None
    group = a.group_size
    if group is None:
        group = {"w4a16": 128, "w4a8": 32}.get(a.scheme, 0)
    scheme = Scheme(a.scheme, group or None, symmetric=not a.asymmetric)
    rep = quantize_checkpoint(model, a.out, scheme, mtp=a.mtp, head=a.head, force=a.force,
                              method=a.method, calib_data=a.calib_data,
                              calib_tokens=a.calib_tokens, lm_head=a.lm_head, smooth=smooth,
                              fit_groups=a.group_size is None,
                              log=lambda s: print(s, file=sys.stderr)
                              if s.startswith(("GPTQ", "SmoothQuant")) else None)
    print(f"wrote {rep.out}: {len(rep.quantized)} modules {a.scheme}"
          f"{f' g{group}' if group else ''}, {len(rep.kept)} kept unquantized "
          f"({len(rep.ignore)} ignore entries); {rep.bytes_in / 1e6:.1f} MB -> "
          f"{rep.bytes_out / 1e6:.1f} MB", file=sys.stderr)
    by_group: dict[int, set[int]] = {}
    for g, k in rep.regrouped.values():
        by_group.setdefault(g, set()).add(k)
    for g, sizes in sorted(by_group.items(), reverse=True):
        n = sum(1 for gg, _ in rep.regrouped.values() if gg == g)
        print(f"note: group size {g} for {n} layers whose input size "
              f"({', '.join(map(str, sorted(sizes)))}) {group} does not divide", file=sys.stderr)
    if a.lm_head != "keep" and "lm_head" not in rep.quantized:
        print(f"note: the lm_head was kept unquantized: its shape does not fit "
              f"{a.scheme if a.lm_head == 'same' else a.lm_head}"
              f"{f' g{group}' if group else ''}", file=sys.stderr)
    return 0


def _run_mlx(a) -> int:
    from .mlx import quantize_mlx

    if a.model is None or a.head is not None:
        raise ValueError("--format mlx converts a Qwen3.5 / Qwen3-Next HF folder with its own "
                         "head: pass --model, without --head")
    other = [flag for flag, given in (
        ("--scheme", a.scheme != "w4a16"), ("--method", a.method != "rtn"),
        ("--lm-head", a.lm_head != "keep"), ("--smooth", a.smooth is not None),
        ("--asymmetric", a.asymmetric), ("--calib-data", bool(a.calib_data)),
        ("--gguf-type", a.gguf_type != "Q8_0")) if given]
    if other:
        raise ValueError(f"--format mlx quantizes as mlx-lm does (--bits, --group-size; the "
                         f"lm_head too): drop {', '.join(other)}")
    mtp = {"keep": "bf16", "same": "same"}.get(a.mtp)
    if mtp is None:
        raise ValueError("--format mlx: --mtp keep (BF16, default) or same (the trunk's bits; "
                         "vllm-mlx dequantizes the head with them)")
    rep = quantize_mlx(a.model, a.out, bits=a.bits, group_size=a.group_size or 64, mtp=mtp,
                       force=a.force)
    head = f", MTP head in {rep.head} ({rep.head_precision})" if rep.head else ""
    print(f"wrote {rep.out}: {rep.quantized} modules {a.bits}-bit g{a.group_size or 64}, "
          f"{rep.kept} kept float{head}", file=sys.stderr)
    for note in rep.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
