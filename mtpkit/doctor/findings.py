"""Findings: one cause each, with why an engine misbehaves and the exact fix."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SEVERITIES = ("error", "warning", "info")

# Every code doctor emits, with a one-line summary (docs/doctor.md explains each).
CODES = {
    "not-a-checkpoint": "the path is not an HF checkpoint folder or a GGUF file",
    "mtp-missing": "the family or config expects an MTP head but no MTP tensors are present",
    "mtp-none": "no MTP head (the family has none); train one with mtpkit calibrate",
    "mtp-incomplete": "some MTP tensors are present, others the head needs are missing",
    "mtp-file-unindexed": "a safetensors file with MTP tensors is not listed in the index",
    "mtp-config-missing": "MTP tensors are present but the config field enabling them is "
                          "missing or zero",
    "mtp-config-mismatch": "the config declares a different number of MTP layers than stored",
    "mtp-dedicated-embeddings": "mtp_use_dedicated_embeddings disagrees with the tensors",
    "shared-embedding-missing": "the embedding or lm_head the MTP head shares is missing",
    "shape-mismatch": "a tensor's shape disagrees with the config",
    "dtype-unexpected": "a tensor's dtype is not what its format stores",
    "unknown-model-type": "mtpkit does not know this model_type; MTP checks are limited",
    "mtp-unquantized-not-ignored": "an MTP module is stored unquantized but the engine builds "
                                   "it quantized",
    "unquantized-not-ignored": "a trunk module is stored unquantized but the engine builds it "
                               "quantized",
    "ignore-shard-conflict": "the ignore list covers some shards of a fused module but not all",
    "ignore-shards-not-fused": "the ignore list names every shard but the engine only honours "
                               "the fused name",
    "ignore-matches-nothing": "an ignore entry names no module the engine builds",
    "ignore-regex-no-match": "a re: ignore pattern matches no module the engine builds",
    "ignore-regex-invalid": "a re: ignore pattern is not a valid regular expression",
    "ignore-class-name": "a class-name ignore entry, which vLLM does not apply",
    "ignore-experts-module-name": "experts stored unquantized are ignored by the experts "
                                  "module's name, which vLLM never consults (experts.0.*)",
    "ignore-fused-regex-old-vllm": "a fused module is ignored only by a pattern on its fused "
                                   "name, which vLLM before 0.30.0 does not apply",
    "ignore-regex-renamed-prefix": "a re: ignore pattern is written for a prefix vLLM renames "
                                   "(patterns are never renamed)",
    "mtp-experts-stacked-unloadable": "the DeepSeek/GLM MTP layer's experts are stored stacked, "
                                      "which vLLM's MTP loader cannot read",
    "quantized-head-not-targeted": "a head stored quantized is built unquantized: no target "
                                   "names its runtime name",
    "engine-no-mtp-class": "MTP tensors stored for a model_type vLLM builds no MTP draft for",
    "sglang-one-mtp-layer": "SGLang builds one MiMo-V2 MTP layer and loads every stored one "
                            "into it",
    "vllm-one-mtp-layer": "vLLM drafts every step with MTP layer 0 of a several-layer head; "
                          "mtpkit drafts step i with layer i",
    "dsa-mtp-index-share": "vLLM reuses a GLM-5 MTP layer's first key selection; mtpkit does not",
    "vllm-version-range": "the quantization config loads as stored in some vLLM releases only",
    "quantized-tensors-missing": "a module stored quantized lacks tensors its format needs",
    "quantized-but-ignored": "a module stored quantized is left unquantized by the engine",
    "quantized-lm-head": "the lm_head is stored quantized: engines load it only in recent versions",
    "int4-mtp-head": "the MTP head is stored at 4 bits or less",
    "gguf-nextn-key-missing": "GGUF nextn tensors are present but {arch}.nextn_predict_layers "
                              "is missing or zero",
    "gguf-block-count": "GGUF block_count does not count the MTP layers as llama.cpp expects",
    "gguf-nextn-tensors-missing": "the GGUF declares nextn layers but lacks their tensors",
    "gguf-tokenizer-missing": "the GGUF file has no tokenizer",
    "mtp-acceptance-zero": "measured acceptance is about zero: the head is broken or mis-loaded",
    "mtp-acceptance-drift": "measured acceptance is clearly below the reference checkpoint's",
    "mtp-acceptance-ok": "measured acceptance",
    "measure-failed": "the model could not be loaded or measured in mtpkit",
    # MLX checkpoints (mtpkit/doctor/mlx.py, docs/mlx.md)
    "mlx-lm-no-mtp": "mlx-lm runs no MTP head; vllm-mlx does",
    "mlx-lm-mtp-file-breaks-load": "a Qwen3-Next model-mtp.safetensors that mlx_lm.load "
                                   "refuses",
    "mlx-no-mtp-family": "vllm-mlx injects no MTP head into this model_type",
    "mlx-mtp-file-missing": "no head file where vllm-mlx looks (mtp/weights.safetensors, "
                            "model-mtp.safetensors)",
    "mlx-mtp-prefix": "the head file's tensors are under a prefix vllm-mlx does not read",
    "mlx-mtp-config-missing": "a head file but no MTP layer count in the config",
    "mlx-mtp-experts-unloadable": "MTP experts stored per expert; vllm-mlx reads stacked ones",
    "mlx-mtp-bits-mismatch": "head triplets quantized unlike the trunk (vllm-mlx dequantizes "
                             "them with the trunk's bits)",
    "mlx-mtp-low-bits": "an MTP head stored at 4 bits or less",
    "mlx-mtp-norm-convention": "MTP norm weights in the convention vllm-mlx does not expect",
    "mlx-hidden-state-mode": "mtp_hidden_state_mode missing or invalid",
    "mlx-qwen3-next-head": "vllm-mlx feeds Qwen3-Next's head other inputs than it was trained on",
}


@dataclass
class Finding:
    """One problem (or fact): what is wrong, why the engine misbehaves, the exact fix."""

    code: str
    severity: str  # error | warning | info
    what: str
    why: str = ""
    fix: str = ""
    engines: list[str] = field(default_factory=list)  # the engines it applies to (empty: all)
    subject: str = ""  # the module / file / key it is about

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} is not one of {SEVERITIES}")
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}")


@dataclass
class Report:
    """Every finding for one checkpoint, plus what was measured."""

    path: str
    kind: str = ""  # "hf" | "gguf"
    model_type: str | None = None
    engines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # MTP layers, quant method, measured rates...

    def add(self, finding: Finding) -> None:
        """Add a finding, merging one with the same code, subject and text across engines."""
        for f in self.findings:
            if (f.code, f.subject, f.what, f.severity) == (
                finding.code, finding.subject, finding.what, finding.severity
            ):
                f.engines = sorted(set(f.engines) | set(finding.engines))
                return
        self.findings.append(finding)

    def codes(self) -> set[str]:
        """The codes of every finding (handy for tests and scripts)."""
        return {f.code for f in self.findings}

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 warnings, 2 errors."""
        sev = {f.severity for f in self.findings}
        return 2 if "error" in sev else 1 if "warning" in sev else 0

    @property
    def verdict(self) -> str:
        """One word for the whole checkpoint."""
        return {0: "healthy", 1: "warnings", 2: "broken"}[self.exit_code]

    def as_dict(self) -> dict:
        """Plain data for --json."""
        order = {s: i for i, s in enumerate(SEVERITIES)}
        return {
            "path": self.path,
            "kind": self.kind,
            "model_type": self.model_type,
            "engines": self.engines,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "facts": self.facts,
            "findings": [asdict(f) for f in sorted(self.findings,
                                                    key=lambda f: order[f.severity])],
        }

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.as_dict(), indent=2, default=str)

    def print_rich(self, console=None) -> None:
        """A table for humans (rich)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        facts = ", ".join(f"{k}: {v}" for k, v in self.facts.items() if not isinstance(v, dict))
        console.print(f"[bold]{self.path}[/bold] ({self.kind}, {self.model_type or '?'})")
        if facts:
            console.print(facts)
        if not self.findings:
            console.print("[green]no findings[/green]")
        else:
            table = Table(show_lines=True)
            table.add_column("severity")
            table.add_column("code")
            table.add_column("what is wrong")
            table.add_column("why")
            table.add_column("fix")
            style = {"error": "red", "warning": "yellow", "info": "cyan"}
            order = {s: i for i, s in enumerate(SEVERITIES)}
            for f in sorted(self.findings, key=lambda f: order[f.severity]):
                eng = f" [{', '.join(f.engines)}]" if f.engines else ""
                table.add_row(f"[{style[f.severity]}]{f.severity}[/]", f.code + eng, f.what,
                              f.why, f.fix)
            console.print(table)
        color = {"healthy": "green", "warnings": "yellow", "broken": "red"}[self.verdict]
        console.print(f"verdict: [{color}]{self.verdict}[/] (exit status {self.exit_code})")
