"""Write a recalibrated head back into the checkpoint it came from, in that checkpoint's own
layout and format (compressed-tensors with the head in BF16 and a matching ignore list, a
plain HF folder, or GGUF nextn layers), by grafting it through `mtpkit graft`."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..quant.formats import scan


def head_on_disk_names(model, ckpt) -> dict[str, torch.Tensor]:
    """The model's MTP parameters under the names the checkpoint stores them (float)."""
    params = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    plan = scan(ckpt)
    out: dict[str, torch.Tensor] = {}
    for name in ckpt.tensor_names():
        prefix = name.rpartition(".")[0]
        if prefix in plan.modules:  # a quantized head module comes back as a float weight
            name = prefix + ".weight"
        mapped = model.map_checkpoint_name(name)
        if mapped in params and name not in out:
            out[name] = params[mapped].detach().cpu()
    missing = set(params) - {model.map_checkpoint_name(n) for n in out}
    if missing:
        raise ValueError(
            "the recalibrated head has parameters the checkpoint does not store one-to-one "
            f"(e.g. {sorted(missing)[0]}: fused tensors?); wrote the head folder only"
        )
    return out


def write_with_head(model, model_path, out, draft_vocab: list[int] | None, force: bool = True):
    """Graft the model's (trained) head into a copy of ``model_path`` written at ``out``."""
    from ..checkpoint import open_checkpoint
    from ..doctor.graft import graft

    src = Path(model_path)
    ckpt = open_checkpoint(src)
    tensors = head_on_disk_names(model, ckpt)
    # The head goes in at the precision of the checkpoint's float tensors (BF16 for releases).
    float_dtype = next((ckpt.get_tensor(n).dtype for n in ckpt.tensor_names()
                        if "embed_tokens" in n), torch.bfloat16)
    if not float_dtype.is_floating_point or getattr(ckpt, "arch", None):
        float_dtype = torch.float32
    out = Path(out)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.head-", dir=out.parent))
    try:
        if getattr(ckpt, "arch", None):  # GGUF: a source folder in HF names
            config = dict(ckpt.hf_config())
        else:
            config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config", None)
        (stage / "config.json").write_text(json.dumps(config))
        save_file({n: t.to(float_dtype).contiguous() for n, t in tensors.items()},
                  stage / "model.safetensors", metadata={"format": "pt"})
        result = graft(stage, src, out, precision="keep", force=force)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if draft_vocab and out.is_dir():
        from .heads import write_draft_vocab

        write_draft_vocab(out, draft_vocab)
    return result
