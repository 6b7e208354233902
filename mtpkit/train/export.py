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

from ..models.eagle3 import is_eagle3
from ..quant.formats import scan


def head_on_disk_names(model, ckpt) -> dict[str, torch.Tensor]:
    """The model's MTP parameters under the names the checkpoint stores them (float), with
    the MTP layers' copies of the trunk's lm_head / embedding the model shares (unchanged)."""
    from ..doctor.layout import is_mtp_tensor

    params = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    plan = scan(ckpt)
    out: dict[str, torch.Tensor] = {}
    for name in ckpt.tensor_names():
        prefix = name.rpartition(".")[0]
        if prefix in plan.modules:  # a quantized head module comes back as a float weight
            name = prefix + ".weight"
        if name in out:
            continue
        mapped = model.map_checkpoint_name(name)
        if mapped in params:
            out[name] = params[mapped].detach().cpu()
        elif (mapped is None or mapped.startswith("mtp.heads.")) and is_mtp_tensor(
                name, model.config.num_hidden_layers):
            # Frozen in training, and the graft replaces every MTP tensor: engines that read
            # them (vLLM's Step draft heads) must find them in the output as in the input.
            out[name] = model._read_float(plan, ckpt, name)
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


# vLLM serves MTP heads only for the families that shipped them. A Llama-family trunk with an
# mtpkit head is, weight for weight, a MiMo checkpoint (MiMo is Qwen2 with one MTP layer of
# exactly our head's shape: two input norms, a projection of [hidden, embedding], one decoder
# layer, a final norm), once q/k/v get zero biases (Qwen2 has them, Llama not). vLLM's
# EAGLE-1 Llama draft cannot hold this head: its first layer drops input_layernorm and it has
# no final norm, so an "eagle" export would compute something else.
MIMO_HEAD_NAMES = {
    "pre_fc_norm_embedding": "token_layernorm",
    "pre_fc_norm_hidden": "hidden_layernorm",
    "fc": "input_proj",
    "norm": "final_layernorm",
}
EXPORT_FORMATS = ("mimo",)


def mimo_tensors(model) -> dict[str, torch.Tensor]:
    """Trunk + head parameters under MiMo's checkpoint names (q/k/v biases added as zeros)."""
    cfg = model.config
    if cfg.model_type not in ("llama", "qwen2", "mimo") or model.mtp is None:
        raise ValueError(
            f"export-head --format mimo takes a Llama or Qwen2 trunk with an MTP head "
            f"(got model_type {cfg.model_type!r}{'' if model.mtp is not None else ', no head'})"
        )
    if getattr(cfg, "qk_norm", False) or getattr(cfg, "mlp_bias", False) or (
        getattr(cfg, "attention_bias", False) and cfg.model_type == "llama"
    ):
        raise ValueError("export-head --format mimo: this trunk has q/k norms or biases that "
                         "Qwen2's layer (MiMo's) cannot hold")
    out: dict[str, torch.Tensor] = {}
    d = cfg.hidden_size
    for name, p in model.state_dict().items():
        t = p.detach().float().cpu()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("mtp."):
            rest = name[4:]
            module = rest.rsplit(".", 1)[0]
            if module in MIMO_HEAD_NAMES:
                if module == "fc" and model.mtp.spec.emb_first:
                    t = torch.cat([t[:, d:], t[:, :d]], dim=1)  # [emb, hidden] -> [hidden, emb]
                name = f"model.mtp_layers.0.{MIMO_HEAD_NAMES[module]}.weight"
            else:  # mtp.layers.0.<block> -> model.mtp_layers.0.<block>
                name = "model.mtp_layers.0." + rest.split(".", 2)[2]
        out[name] = t
    for name in list(out):
        for proj in ("q_proj", "k_proj", "v_proj"):
            if name.endswith(f"self_attn.{proj}.weight"):
                bias = name[: -len("weight")] + "bias"
                out.setdefault(bias, torch.zeros(out[name].shape[0]))
    return out


def export_head(model_path, head, out, fmt: str = "mimo", dtype: str = "bfloat16") -> Path:
    """Write trunk + head as one checkpoint another engine loads with MTP (see formats)."""
    from ..engine.loader import hf_config_of, load_model
    from ..outputs import publish
    from .heads import write_draft_vocab

    if fmt not in EXPORT_FORMATS:
        why = ""
        if fmt == "eagle":
            why = (" vLLM's EAGLE-1 Llama draft has no input norm on its first layer and no "
                   "final norm, so it cannot hold an mtpkit head exactly; use --format mimo, "
                   "which vLLM serves as an MTP model")
        raise ValueError(f"export-head: unknown --format {fmt!r}.{why}")
    cast = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in cast:
        raise ValueError(f"export-head: --dtype must be one of {', '.join(cast)}, got {dtype!r}")
    dst = Path(out).resolve()
    for option, path in (("--model", model_path), ("--head", head)):
        src = None if path is None else Path(path).resolve()
        if src is not None and (dst == src or src in dst.parents or dst in src.parents):
            raise ValueError(f"--out {dst} overlaps the input {option} {src}; mtpkit never "
                             "writes over its input: choose another folder")
    loaded = load_model(str(model_path), head=None if head is None else str(head),
                        dtype="float32", tokenizer=False)
    model = loaded.model
    if is_eagle3(model.mtp):
        raise ValueError("export-head: this is an EAGLE-3 head, which MiMo's layout cannot "
                         "hold; use --format eagle3")
    tensors = mimo_tensors(model)
    src = Path(model_path)
    config = dict(hf_config_of(loaded.checkpoint))
    for key in ("quantization_config", "mtp_num_hidden_layers", "attention_bias", "mlp_bias",
                "head_dim", "pretraining_tp"):
        config.pop(key, None)
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"],
                  num_nextn_predict_layers=1, use_sliding_window=False,
                  max_window_layers=model.config.num_hidden_layers, torch_dtype=dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({n: t.to(cast[dtype]).contiguous() for n, t in tensors.items()},
                  stage / "model.safetensors", metadata={"format": "pt"})
        (stage / "config.json").write_text(json.dumps(config, indent=2))
        if src.is_dir():
            for f in src.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "generation_config",
                                      "chat_template", "vocab", "merges")):
                    shutil.copy2(f, stage / f.name)
        vocab = getattr(loaded, "draft_vocab", None)
        if vocab is not None:
            write_draft_vocab(stage, [int(t) for t in vocab])
        publish(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out
