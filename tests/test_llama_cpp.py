"""mtpkit's GGUF output in llama.cpp's own server: it loads, drafts with the nextn head, stays
lossless, and agrees with mtpkit token for token and draft for draft.

The server tests run when MTPKIT_LLAMA_SERVER names a llama-server binary, the comparison
with llama.cpp's own converter when MTPKIT_LLAMA_CONVERTER names its convert_hf_to_gguf.py
(each skipped otherwise); the metadata checks always run. The model is
a tiny Qwen3.5 (hybrid Gated-DeltaNet, partial rotary, an `mtp.*` head) whose vocab_size
(512) is larger than its tokenizer (padded in the GGUF, as real releases are).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiny
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtpkit.checkpoint.gguf import open_gguf
from mtpkit.checkpoint.tokenizer import Tokenizer
from mtpkit.engine.generate import Engine, Result
from mtpkit.engine.loader import load_model
from mtpkit.engine.sampling import SamplingParams

SERVER = os.environ.get("MTPKIT_LLAMA_SERVER")
BUILD = ("pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36, unpack, then "
         "cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DLLAMA_CURL=OFF && "
         "cmake --build build --target llama-server -j2 (about 10 minutes)")
needs_server = pytest.mark.skipif(
    not SERVER, reason=f"set MTPKIT_LLAMA_SERVER to a llama-server binary; build one: {BUILD}")

CONVERTER = os.environ.get("MTPKIT_LLAMA_CONVERTER")
needs_converter = pytest.mark.skipif(
    not CONVERTER, reason="set MTPKIT_LLAMA_CONVERTER to llama.cpp's convert_hf_to_gguf.py, "
    "with its gguf-py beside it (the llama.cpp sources that build llama-server have both)")

VOCAB = 512
PROMPTS = ["def f(x):\n    return", "The quick brown fox", "import os\nimport sys\n"]


def _bpe_tokenizer(out: Path, special: tuple[str, ...] = ("<|endoftext|>",)) -> None:
    """A byte-level BPE of about 360 tokens (fewer than the model's 512 ids), ``special``
    first (the first is its eos)."""
    import inspect

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(inspect.getsource(json).splitlines(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@dataclass(frozen=True)
class QwenCase:
    name: str
    fam: tiny.Family
    arch: str
    rope_dim: int  # head_dim (16) x partial_rotary_factor
    # llama.cpp drafts and accepts as mtpkit does at k = 1 (same drafts, same counts); see
    # test_llama_server_runs_mtpkits_gguf_with_mtp for the others.
    exact_counts: bool = False
    # llama.cpp's qwen3next drafts only every other round after a rejection (it re-decodes
    # the recurrent state first), so its counts are not comparable with mtpkit's.
    comparable_counts: bool = True


QWEN_CASES = [
    QwenCase("qwen3_5", tiny.Family("qwen3_5", lambda: tiny._qwen3_5(VOCAB),
                                    mtp_config_key="mtp_num_hidden_layers"),
             "qwen35", 4, exact_counts=True),
    QwenCase("qwen3_5_moe", tiny.Family("qwen3_5_moe", lambda: tiny._qwen3_5_moe(VOCAB),
                                        mtp_config_key="mtp_num_hidden_layers"),
             "qwen35moe", 4),
    QwenCase("qwen3_next", tiny.Family("qwen3_next", lambda: tiny._qwen3_next(True, VOCAB)),
             "qwen3next", 8, comparable_counts=False),
]


@pytest.fixture(scope="module", params=QWEN_CASES, ids=[c.name for c in QWEN_CASES])
def qwen(request, tmp_path_factory) -> tuple[QwenCase, Path]:
    case: QwenCase = request.param
    out = tmp_path_factory.mktemp(case.name) / "m"
    tiny.write_checkpoint(case.fam, out)
    cfg = json.loads((out / "config.json").read_text())
    if case.arch != "qwen3next":
        # Text positions are the same in every M-RoPE section, so the sections change
        # nothing here; but llama.cpp asserts they fit the rotated pairs (2 here), and both
        # converters write the release's [11, 11, 10] when the config has none.
        cfg["rope_parameters"]["mrope_section"] = [1, 1, 0]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tiny.add_mtp_head(out, case.fam)
    _bpe_tokenizer(out)
    return case, out


def _gguf(model: Path, qtype: str) -> Path:
    from mtpkit.quant.quantize import quantize_gguf

    return quantize_gguf(model, model.parent / f"m-{qtype}.gguf", qtype, force=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on loopback."""

    def __init__(self, gguf: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = gguf.parent / f"llama-server-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [SERVER, "-m", str(gguf), "--port", str(self.port), "-t", "1", "-c", "512",
                 "-np", "1", *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"llama-server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"llama-server not ready:\n{self.log.read_text()[-3000:]}")

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "return_tokens": True, "cache_prompt": False}
        r = httpx.post(self.url + "/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _mtpkit_run(model: Path, ids: list[int], n: int, k: int) -> tuple[list[int], Result]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(model)
    res = Result()
    # Both stop at the end-of-text token (llama.cpp's ignore_eos bans it rather than going
    # past it, so it cannot be compared with mtpkit's); llama.cpp returns it, mtpkit not.
    out = list(Engine(loaded.model, loaded.tokenizer).generate(
        ids, SamplingParams(max_tokens=n), k, result=res))
    return out, res


def _tokens(reply: dict, eos: set[int]) -> list[int]:
    t = reply["tokens"]
    return t[:-1] if t and t[-1] in eos else t


def test_metadata_matches_what_llama_cpp_expects(qwen):
    case, model = qwen
    path = _gguf(model, "F32")
    tok = Tokenizer.from_hf_dir(model)
    with open_gguf(path) as g:
        md = g.metadata
        tokens = md["tokenizer.ggml.tokens"]
        # The token list has one entry per embedding row: the tokenizer's, then fillers.
        assert len(tokens) == VOCAB > tok.vocab_size
        assert tokens[tok.vocab_size] == f"[PAD{tok.vocab_size}]"
        # Partial rotary: a quarter (Qwen3.5) or half (Qwen3-Next) of each 16-wide head
        # (transformers 5 writes the factor into rope_parameters).
        assert md[f"{case.arch}.rope.dimension_count"] == case.rope_dim
        assert md[f"{case.arch}.nextn_predict_layers"] == 1


@needs_server
@pytest.mark.parametrize("k", [1, 2])
def test_llama_server_runs_mtpkits_gguf_with_mtp(qwen, k):
    """llama.cpp loads the file, decodes it as mtpkit does and drafts with its nextn head
    losslessly. Its acceptance is close to mtpkit's; equal draft for draft only for the
    dense Qwen3.5 at k = 1 (llama.cpp feeds its MTP context the verify batch's rows,
    rejected drafts included, and a few of its drafts differ from mtpkit's)."""
    case, model = qwen
    _against_llama_server(model, k, exact=k == 1 and case.exact_counts,
                          counts=case.comparable_counts)


def _against_llama_server(model: Path, k: int, exact: bool = False, counts: bool = True) -> None:
    """llama-server with and without draft-mtp (k drafts) on the F32 GGUF of ``model``:
    mtpkit's greedy tokens both ways, the nextn head drafting; its accepted drafts summed
    over the prompts close to mtpkit's (``counts``), or every prompt's drafted and accepted
    counts equal to mtpkit's (``exact``)."""
    path = _gguf(model, "F32")
    tok = Tokenizer.from_hf_dir(model)
    plain, draft = LlamaServer(path), LlamaServer(
        path, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0")
    ours = theirs = 0
    try:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            want, res = _mtpkit_run(model, ids, 32, k)
            a, b = plain.complete(ids, 32), draft.complete(ids, 32)
            assert _tokens(a, tok.eos_token_ids) == want  # llama.cpp's decoding is mtpkit's
            assert _tokens(b, tok.eos_token_ids) == want  # and MTP keeps it lossless
            timings = b["timings"]
            assert timings.get("draft_n", 0) > 0, timings  # the nextn head drafted
            ours += res.metrics.num_accepted_tokens
            theirs += timings["draft_n_accepted"]
            if exact:
                assert (timings["draft_n"], timings["draft_n_accepted"]) == (
                    res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)
    finally:
        plain.stop()
        draft.stop()
    if counts:
        assert ours > 0 and abs(theirs - ours) <= max(3, ours // 4), (theirs, ours)


# Where mtpkit's file may differ from the converter's, and why: nothing llama.cpp's qwen35
# loader reads differently (src/models/qwen35.cpp, llama-vocab.cpp).
CONVERTER_ONLY = {
    "general.name", "general.size_label",  # labels from the folder name and parameter count
}
MTPKIT_ONLY = {
    "qwen35.vocab_size",  # the embedding's rows; llama.cpp counts the token list, as long
    "tokenizer.ggml.add_bos_token",  # the tokenizer's own setting (False), left out there
}
# The converter writes the config's interval or 4 where the config has none; mtpkit that of
# layer_types (2 here), which loaders older than the per-layer list read, and which that
# list (written by both, read first) makes moot for current ones.
DIFFERENT = {"qwen35.full_attention_interval"}


def _gguf_contents(path: Path) -> tuple[dict, dict]:
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(path)
    fields = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name,
                        np.asarray(t.data).tobytes()) for t in r.tensors}
    return fields, tensors


def _run_converter(model: Path, ref: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on ``model``, F32, into ``ref``."""
    import sys

    conv = Path(CONVERTER).resolve()
    # The converter names a BPE pre-tokenizer by hashing how known releases' tokenizers
    # split a test text; the tiny tokenizer is none of them, so the run is told what mtpkit
    # writes for a byte-level BPE (gpt-2) instead of stopping there.
    script = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(conv.parent)!r}, {str(conv.parent / 'gguf-py')!r}]\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        f"sys.argv = [{str(conv)!r}, {str(model)!r}, '--outfile', {str(ref)!r}, "
        "'--outtype', 'f32']\n"
        f"runpy.run_path({str(conv)!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return ref


@needs_converter
def test_metadata_and_tensors_equal_llama_cpps_converter(qwen, tmp_path):
    """mtpkit's F32 GGUF of the tiny Qwen3.5 (MTP head included) holds the keys and values
    llama.cpp's convert_hf_to_gguf.py writes for the same folder, save the listed ones, and
    byte-identical tensors under the same names, shapes and types."""
    case, model = qwen
    theirs, their_tensors = _gguf_contents(_run_converter(model, tmp_path / "ref.gguf"))
    ours, our_tensors = _gguf_contents(_gguf(model, "F32"))
    a = case.arch
    assert set(theirs) - set(ours) == CONVERTER_ONLY
    assert set(ours) - set(theirs) == {k.replace("qwen35.", f"{a}.") for k in MTPKIT_ONLY}
    differ = {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]}
    assert differ == {k.replace("qwen35.", f"{a}.") for k in DIFFERENT}, {
        k: (ours[k], theirs[k]) for k in differ}
    assert ours[f"{a}.attention.recurrent_layers"] == [True, False, True, False, False]
    assert our_tensors.keys() == their_tensors.keys()
    assert [n for n in our_tensors if our_tensors[n] != their_tensors[n]] == []


def test_hybrid_layout_without_an_interval_round_trips(tmp_path):
    """A Qwen3.5 whose layer_types repeat no fixed interval goes to GGUF as llama.cpp's
    per-layer list (the interval left out) and comes back as the same layer types; its
    logits through the GGUF equal those of the folder, and llama-server (where given)
    decodes it as mtpkit does."""

    out = tmp_path / "m"
    types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    fam = tiny.Family("qwen3_5", lambda: tiny._qwen3_5(VOCAB, types),
                      mtp_config_key="mtp_num_hidden_layers")
    tiny.write_checkpoint(fam, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == types and cfg.get("full_attention_interval") is None
    cfg["rope_parameters"]["mrope_section"] = [1, 1, 0]  # as the module fixture, for llama.cpp
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _bpe_tokenizer(out)
    path = _gguf(out, "F32")
    with open_gguf(path) as g:
        assert "qwen35.full_attention_interval" not in g.metadata
        assert list(g.metadata["qwen35.attention.recurrent_layers"]) == [
            t == "linear_attention" for t in types]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(out).model, load_model(path).model
    assert b.config.layer_types == a.config.layer_types == types
    ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-5)
    if SERVER:  # llama.cpp reads the list: its greedy tokens are mtpkit's
        tok = Tokenizer.from_hf_dir(out)
        server = LlamaServer(path)
        try:
            for prompt in PROMPTS:
                ids = tok.encode(prompt)
                want, _ = _mtpkit_run(out, ids, 24, 0)
                assert _tokens(server.complete(ids, 24), tok.eos_token_ids) == want
        finally:
            server.stop()


# ---------------------------------------------------------------------------------------------
# DeepSeek-style MoE families: GLM-4.5 (glm4moe) and MLA models (deepseek2).


# GLM's tokenizer: its eos, then what its converter writes as bos, eot and eom; a GLM reply
# ends at any of the three ends (its generation_config lists them all).
GLM_SPECIAL = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")
GLM_EOS = [0, 2, 3]
# tiny's models as llama.cpp takes them: token ids for the BPE tokenizer here, GLM's ends,
# and YaRN's mscale equal to mscale_all_dim, as in the releases (llama.cpp assumes it).
_GLM = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": GLM_EOS}
_DEEPSEEK = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
_YARN_EQUAL = {**tiny.DEEPSEEK_YARN, "mscale": 0.8, "mscale_all_dim": 0.8}


@dataclass(frozen=True)
class MoeCase:
    name: str
    build: Callable[[], Any]
    arch: str
    glm: bool = False  # GLM's special tokens in the tokenizer
    # The converter of this llama.cpp skips DeepSeek-V3's MTP layer (and block_count
    # counts the trunk only); it keeps GLM's.
    converter_keeps_mtp: bool = True
    # The leading_dense_block_count the converter writes where it misreads the config.
    converter_leading_dense: int | None = None


MOE_CASES = [
    MoeCase("glm4_moe", lambda: tiny._glm4_moe(**_GLM), "glm4moe", glm=True),
    # q LoRA, interleaved rope rows, YaRN: as the DeepSeek-V3 release.
    MoeCase("deepseek_v3",
            lambda: tiny._deepseek_v3(True, rope_parameters=_YARN_EQUAL, **_DEEPSEEK),
            "deepseek2", converter_keeps_mtp=False),
    # Half-split rope rows (rope_interleave false): mtpkit interleaves them on the way.
    MoeCase("deepseek_v3_half_split",
            lambda: tiny._deepseek_v3(True, rope_interleave=False, rope_parameters=None,
                                      **_DEEPSEEK),
            "deepseek2", converter_keeps_mtp=False),
    # GLM-4.7-Flash: MLA with GLM's tokenizer, dense layers leading only (llama.cpp's
    # form); its config says mlp_layer_types, not first_k_dense_replace, which this
    # converter does not read (it writes 0).
    MoeCase("glm4_moe_lite",
            lambda: tiny._glm4_moe_lite(mlp_layer_types=["dense", "sparse", "sparse"], **_GLM),
            "deepseek2", glm=True, converter_leading_dense=0),
]


@pytest.fixture(scope="module", params=MOE_CASES, ids=[c.name for c in MOE_CASES])
def moe(request, tmp_path_factory) -> tuple[MoeCase, Path]:
    case: MoeCase = request.param
    out = tmp_path_factory.mktemp(case.name) / "m"
    fam = tiny.Family(case.name, case.build, mtp_layout="deepseek",
                      adjust=None if case.arch == "glm4moe" else tiny._soften_mla_queries)
    tiny.write_checkpoint(fam, out)
    tiny.add_mtp_head(out, fam)
    _bpe_tokenizer(out, *([GLM_SPECIAL] if case.glm else []))
    return case, out


def test_moe_metadata_matches_what_llama_cpp_expects(moe):
    """The keys llama.cpp's glm4moe / deepseek2 loaders read, from the config."""
    case, model = moe
    cfg = json.loads((model / "config.json").read_text())
    with open_gguf(_gguf(model, "F32")) as g:
        md, names = g.metadata, set(g._tensors)
    a = case.arch
    assert md[f"{a}.block_count"] == 4 and md[f"{a}.nextn_predict_layers"] == 1
    assert md[f"{a}.leading_dense_block_count"] == 1
    assert md[f"{a}.expert_gating_func"] == 2  # sigmoid, whatever the config says
    assert md[f"{a}.expert_count"] == 8 and md[f"{a}.expert_group_used_count"] == 2
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.ffn_gate_exps.weight",
            "blk.3.exp_probs_b.bias"} <= names
    if a == "deepseek2":
        # Absorbed MLA: one KV head as wide as the latent plus the rope part.
        assert md["deepseek2.attention.head_count_kv"] == 1
        assert md["deepseek2.attention.key_length"] == 32 + 8
        assert md["deepseek2.attention.key_length_mla"] == 16 + 8
        assert {"blk.0.attn_k_b.weight", "blk.3.attn_v_b.weight"} <= names
        assert not any("kv_b" in n for n in names)
    else:
        assert md["glm4moe.rope.dimension_count"] == cfg["head_dim"] // 2
    if case.glm:
        assert (md["tokenizer.ggml.eot_token_id"], md["tokenizer.ggml.eom_token_id"]) == (2, 3)


def test_moe_gguf_runs_in_mtpkit_as_its_checkpoint(moe):
    """mtpkit reads its own glm4moe / deepseek2 files back (kv_b merged again, the rope rows
    left interleaved and the config saying so): the logits equal the folder's, and greedy
    decoding with MTP gives the folder's tokens and draft counts."""
    case, model = moe
    path = _gguf(model, "F32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(model).model, load_model(path).model
    assert b.mtp is not None
    ids = torch.tensor([list(range(3, 43))])  # past YaRN's original 32 positions
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-4)
    tok = Tokenizer.from_hf_dir(model)
    for prompt in PROMPTS[:2]:
        want, res = _mtpkit_run(model, tok.encode(prompt), 24, 2)
        got, res_gguf = _mtpkit_run(path, tok.encode(prompt), 24, 2)
        assert got == want
        assert (res_gguf.metrics.num_draft_tokens, res_gguf.metrics.num_accepted_tokens) == (
            res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "mscale": 1.0, "mscale_all_dim": 0.707,
                          "original_max_position_embeddings": 32}}, "mscale_all_dim"),
    ({"q_lora_rank": None}, "q_lora_rank is null"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "dense layers only before"),
    ({"num_nextn_predict_layers": 2}, "runs one (nextn) layer"),
])
def test_moe_configs_llama_cpp_cannot_run_are_refused(change, message, tmp_path):
    """Checkpoints whose GGUF llama.cpp would not load, or would decode otherwise than the
    checkpoint, get an error naming the reason instead of a file."""
    from mtpkit.checkpoint.gguf import write_gguf

    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 4,
           "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 32,
           "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16, "n_routed_experts": 8, "first_k_dense_replace": 1, **change}
    n_mtp = cfg.pop("num_nextn_predict_layers", 1)
    tensors = {f"model.layers.{3 + i}.enorm.weight": torch.ones(64) for i in range(n_mtp)}
    with pytest.raises(ValueError, match=re.escape(message)):
        write_gguf(tmp_path / "never.gguf", "deepseek2", cfg, tensors)
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


@needs_server
@pytest.mark.parametrize("k", [1, 3])
def test_llama_server_runs_mtpkits_moe_gguf_with_mtp(moe, k):
    """llama.cpp loads the file, decodes it as mtpkit does, and drafts with its nextn head
    losslessly at an acceptance close to mtpkit's own. (The counts are not compared draft
    for draft: llama.cpp feeds its MTP context the verify batch's rows, rejected drafts
    included, and a few of its drafts differ from mtpkit's; equal where they agree.)"""
    _against_llama_server(moe[1], k)


MOE_MTPKIT_ONLY = {"tokenizer.ggml.add_bos_token"}


@needs_converter
def test_moe_metadata_and_tensors_equal_llama_cpps_converter(moe, tmp_path):
    """mtpkit's F32 GGUF holds the keys and byte-identical tensors llama.cpp's converter
    writes for the same folder, save where the converter drops something (DeepSeek-V3's MTP
    layer; GLM's per-layer copies of the embedding and head, which llama.cpp falls back to
    the trunk's for) or misreads the config (say which)."""
    case, model = moe
    theirs, their_tensors = _gguf_contents(_run_converter(model, tmp_path / "ref.gguf"))
    ours, our_tensors = _gguf_contents(_gguf(model, "F32"))
    a = case.arch
    mtpkit_only = set(MOE_MTPKIT_ONLY)
    if a == "deepseek2":
        mtpkit_only.add("deepseek2.expert_gating_func")  # the converter leaves it to the
        # config's scoring_func, which transformers' configs drop: llama.cpp then routes by
        # softmax
    if a == "glm4moe":
        mtpkit_only.add("glm4moe.vocab_size")
    differ = set()
    if not case.converter_keeps_mtp:
        mtpkit_only.add(f"{a}.nextn_predict_layers")
        differ.add(f"{a}.block_count")
    if case.converter_leading_dense is not None:
        differ.add(f"{a}.leading_dense_block_count")
        assert theirs[f"{a}.leading_dense_block_count"] == case.converter_leading_dense
    # The converter takes a bos id from config.json where the tokenizer names none (mtpkit
    # writes the tokenizer's, with add_bos_token false either way).
    bos = set() if case.glm else {"tokenizer.ggml.bos_token_id"}
    assert set(theirs) - set(ours) == CONVERTER_ONLY | bos
    assert set(ours) - set(theirs) == mtpkit_only
    assert {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]} == differ
    copies = {"blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight"}
    if case.converter_keeps_mtp:
        assert set(their_tensors) - set(our_tensors) == copies
        assert set(our_tensors) <= set(their_tensors)
    else:
        assert set(their_tensors) <= set(our_tensors)
        assert all(n.startswith("blk.3.") for n in set(our_tensors) - set(their_tensors))
    # With half-split rope rows the converter copies them as they are, though llama.cpp's
    # deepseek2 rotates adjacent pairs: mtpkit interleaves them (and llama-server then
    # decodes as transformers does, above).
    rope_rows = ({f"blk.{i}.{t}.weight" for i in range(3) for t in ("attn_q_b", "attn_kv_a_mqa")}
                 if case.name.endswith("half_split") else set())
    assert {n for n in set(our_tensors) & set(their_tensors)
            if our_tensors[n] != their_tensors[n]} == rope_rows


@needs_server
@pytest.mark.parametrize("qtype, mtp, head_type", [
    ("F16", "same", "F16"), ("Q8_0", "keep", "F32"), ("Q4_0", "w8a16", "Q8_0")])
def test_llama_server_runs_quantized_moe_gguf_losslessly(moe, qtype, mtp, head_type):
    """Quantized files load too, MTP drafts and stays lossless in llama.cpp (its output is
    the quantized model's, so it is compared with itself), and the head is stored as asked."""
    from mtpkit.quant.quantize import quantize_gguf

    _, model = moe
    path = quantize_gguf(model, model.parent / f"m-{qtype}-{mtp}.gguf", qtype, force=True,
                         mtp=mtp)
    with open_gguf(path) as g:
        assert g._tensors["blk.3.nextn.eh_proj.weight"].tensor_type.name == head_type
        assert g._tensors["blk.0.attn_output.weight"].tensor_type.name == qtype
    tok = Tokenizer.from_hf_dir(model)
    plain, draft = LlamaServer(path), LlamaServer(
        path, "--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "--spec-draft-n-min", "0")
    try:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            a, b = plain.complete(ids, 32), draft.complete(ids, 32)
            assert a["tokens"] == b["tokens"]
            assert b["timings"].get("draft_n", 0) > 0, b["timings"]
    finally:
        plain.stop()
        draft.stop()
