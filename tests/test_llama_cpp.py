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


def _run_converter(model: Path, ref: Path, raw_config: bool = False,
                   args: tuple[str, ...] = ()) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on ``model``, F32, into ``ref`` (``args`` added to
    its command line); with ``raw_config`` it reads config.json as written rather than
    through transformers' AutoConfig."""
    import sys

    conv = Path(CONVERTER).resolve()
    # The converter names a BPE pre-tokenizer by hashing how known releases' tokenizers
    # split a test text; the tiny tokenizer is none of them, so the run is told what mtpkit
    # writes for a byte-level BPE (gpt-2) instead of stopping there.
    # Step's converter reads the release's own key names (num_attention_groups,
    # moe_num_experts...), which it gets from config.json where transformers has no step3p5
    # class; transformers 5.23 has one and renames them, so ``raw_config`` bypasses it (the
    # converter falls back to config.json when AutoConfig fails).
    bypass = "base.AutoConfig = None\n" if raw_config else ""
    script = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(conv.parent)!r}, {str(conv.parent / 'gguf-py')!r}]\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        f"{bypass}"
        f"sys.argv = [{str(conv)!r}, {str(model)!r}, '--outfile', {str(ref)!r}, "
        f"'--outtype', 'f32', *{list(args)!r}]\n"
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
    # GLM-5: GLM-4.7-Flash's trunk with DSA indexers (a full, a shared and a full layer),
    # index_topk (12) below the prompts' lengths so that the sparse selection decides what
    # the trunk attends; indexer heads 64 wide (llama.cpp's smallest Hadamard rotation of
    # them), 16 of them (with 8 this seed's greedy text has a near tie, 4e-4 between the top
    # two logits, which llama.cpp's float16 caches flip); dense layers leading only, as
    # llama.cpp's glm-dsa takes them. The
    # converter writes the config's first_k_dense_replace (transformers' default of 3,
    # saved beside mlp_layer_types), not the leading dense layers mlp_layer_types lists.
    MoeCase("glm_moe_dsa",
            lambda: tiny._glm_moe_dsa(num_hidden_layers=3,
                                      mlp_layer_types=["dense", "sparse", "sparse"],
                                      indexer_types=["full", "shared", "full"],
                                      index_head_dim=64, index_n_heads=16, **_GLM),
            "glm-dsa", glm=True, converter_leading_dense=3),
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
    if a in ("deepseek2", "glm-dsa"):
        # Absorbed MLA: one KV head as wide as the latent plus the rope part.
        assert md[f"{a}.attention.head_count_kv"] == 1
        assert md[f"{a}.attention.key_length"] == 32 + 8
        assert md[f"{a}.attention.key_length_mla"] == 16 + 8
        assert {"blk.0.attn_k_b.weight", "blk.3.attn_v_b.weight"} <= names
        assert not any("kv_b" in n for n in names)
    if a == "glm-dsa":
        # The indexers' sizes and schedule (true: a layer with its own indexer), the MTP
        # block's own indexer, and none in the shared layer.
        assert [md[f"glm-dsa.attention.indexer.{k}"] for k in ("head_count", "key_length",
                                                               "top_k")] == [
            cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]]
        assert md["glm-dsa.attention.indexer.types"] == [True, False, True]
        assert {f"blk.{i}.indexer.{t}.weight" for i in (0, 2, 3)
                for t in ("attn_q_b", "attn_k", "k_norm", "proj")} <= names
        assert not any(n.startswith("blk.1.indexer.") for n in names)
    elif a == "glm4moe":
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


@pytest.mark.parametrize("change, message", [
    ({"index_head_dim": 32}, "not a multiple of 64"),
    ({"q_lora_rank": None}, "requires the query LoRA"),
])
def test_glm_dsa_configs_llama_cpp_cannot_run_are_refused(change, message, tmp_path):
    """GLM-5 checkpoints llama.cpp's glm-dsa cannot run get an error naming the reason."""
    from mtpkit.checkpoint.gguf import write_gguf

    cfg = {"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "num_attention_heads": 4,
           "hidden_size": 64, "intermediate_size": 128, "q_lora_rank": 32,
           "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16, "n_routed_experts": 8, "first_k_dense_replace": 1,
           "index_head_dim": 64, "index_n_heads": 4, "index_topk": 8, **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        write_gguf(tmp_path / "never.gguf", "glm-dsa", cfg,
                   {"model.layers.3.enorm.weight": torch.ones(64)})
    assert list(tmp_path.iterdir()) == []


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
    if a in ("deepseek2", "glm-dsa"):
        mtpkit_only.add(f"{a}.expert_gating_func")  # the converter leaves it to the
        # config's scoring_func, which transformers' configs drop: llama.cpp's deepseek2
        # then routes by softmax (its glm-dsa by sigmoid, which mtpkit writes anyway)
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
    _quantized_lossless(moe[1], qtype, mtp, head_type, ["blk.3.nextn.eh_proj.weight"], 2)


def _quantized_lossless(model: Path, qtype: str, mtp: str, head_type: str,
                        head_tensors: list[str], k: int) -> None:
    from mtpkit.quant.quantize import quantize_gguf

    path = quantize_gguf(model, model.parent / f"m-{qtype}-{mtp}.gguf", qtype, force=True,
                         mtp=mtp)
    with open_gguf(path) as g:
        assert {g._tensors[n].tensor_type.name for n in head_tensors} == {head_type}
        assert g._tensors["blk.0.attn_output.weight"].tensor_type.name == qtype
    tok = Tokenizer.from_hf_dir(model)
    plain, draft = LlamaServer(path), LlamaServer(
        path, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0")
    try:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            a, b = plain.complete(ids, 32), draft.complete(ids, 32)
            assert a["tokens"] == b["tokens"]
            assert b["timings"].get("draft_n", 0) > 0, b["timings"]
    finally:
        plain.stop()
        draft.stop()


# ---------------------------------------------------------------------------------------------
# Step-3.5 / 3.7-Flash (step35): hybrid sliding / full attention with per-head gates, MoE with
# a shared expert and SwiGLU clamps, and three MTP layers, all written as nextn blocks.

STEP_MTP = tiny.STEP_MTP_LAYERS


def _step_text_only(out: Path) -> None:
    """A Step-3.5-Flash folder: the tiny Step-3.7's text model, its config in the release's
    spelling (what llama.cpp's converter reads), the vision tower dropped."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps(tiny.step_release_config(cfg["text_config"]), indent=2))
    tensors = load_file(out / "model.safetensors")
    text = {k: v.contiguous() for k, v in tensors.items()
            if not k.startswith(("model.vision_model.", "model.vit_large_projector."))}
    save_file(text, out / "model.safetensors", metadata={"format": "pt"})


@dataclass(frozen=True)
class StepCase:
    name: str
    vlm: bool  # the Step-3.7 VLM wrapper (text_config); else a text-only Step-3.5 folder


STEP_CASES = [StepCase("step3p5", False), StepCase("step3p7", True)]


@pytest.fixture(scope="module", params=STEP_CASES, ids=[c.name for c in STEP_CASES])
def step(request, tmp_path_factory) -> tuple[StepCase, Path]:
    case: StepCase = request.param
    out = tmp_path_factory.mktemp(case.name) / "m"
    # tiny's model with llama.cpp's attention scale (head_dim ** -0.5: see the refusals).
    fam = tiny.Family(case.name, lambda: tiny._step3p7(vocab_size=VOCAB, query_pre_attn_scalar=16),
                      mtp_layout="step3p7", mtp_layers=STEP_MTP,
                      rewrite=tiny._step_release_layout if case.vlm else _step_text_only)
    tiny.write_checkpoint(fam, out)
    tiny.add_mtp_head(out, fam, layers=STEP_MTP)
    _bpe_tokenizer(out)
    return case, out


def test_step_metadata_matches_what_llama_cpp_expects(step):
    """The keys and tensors llama.cpp's step35 loader reads, from the release's config:
    per-layer heads and sliding pattern over all 7 blocks, a theta per layer type, the
    release's rotary (half on full layers, whole on sliding ones: llama.cpp's defaults, so
    no dimension_count), clamps, sigmoid routing, three nextn blocks, norms stored as w + 1."""
    from safetensors.torch import load_file

    _, model = step
    with open_gguf(_gguf(model, "F32")) as g:
        md, names = g.metadata, set(g._tensors)
        attn_norm = g._load("blk.0.attn_norm.weight", None)
        enorm = g._load("blk.6.nextn.enorm.weight", None)
        gate = g._load("blk.4.attn_gate.weight", None)
    s = "step35"
    assert md["general.architecture"] == s
    assert md[f"{s}.block_count"] == 4 + STEP_MTP and md[f"{s}.nextn_predict_layers"] == STEP_MTP
    assert md[f"{s}.attention.head_count"] == [4, 6, 6, 4, 6, 6, 6]
    assert md[f"{s}.attention.head_count_kv"] == [2] * 7
    assert md[f"{s}.attention.sliding_window"] == 6
    assert md[f"{s}.attention.sliding_window_pattern"] == [False, True, True, False] + [True] * 3
    assert (md[f"{s}.rope.freq_base"], md[f"{s}.rope.freq_base_swa"]) == (50000.0, 10000.0)
    assert f"{s}.rope.dimension_count" not in md and f"{s}.rope.dimension_count_swa" not in md
    assert md[f"{s}.attention.key_length"] == md[f"{s}.attention.value_length"] == 16
    assert [round(x, 4) for x in md[f"{s}.swiglu_clamp_exp"]] == [0, 0, 0, 0.6, 0, 0, 0]
    assert [round(x, 4) for x in md[f"{s}.swiglu_clamp_shexp"]] == [0.8, 0, 0, 0.5, 0, 0, 0]
    assert md[f"{s}.expert_gating_func"] == 2 and md[f"{s}.expert_count"] == 8
    assert md[f"{s}.expert_shared_feed_forward_length"] == 48
    assert md[f"{s}.expert_weights_scale"] == 2.0 and md[f"{s}.leading_dense_block_count"] == 1
    for i in range(4, 4 + STEP_MTP):
        assert {f"blk.{i}.nextn.{k}.weight" for k in (
            "eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
        assert {f"blk.{i}.attn_gate.weight", f"blk.{i}.ffn_up.weight"} <= names
    assert {"blk.1.ffn_gate_exps.weight", "blk.3.exp_probs_b.bias",
            "blk.3.ffn_down_shexp.weight"} <= names
    # The per-layer copies of the trunk's head are left out: llama.cpp falls back to it.
    assert not any("shared_head_head" in n or "embed_tokens" in n for n in names)
    assert gate.shape == (6, 64)  # one logit per head of the sliding MTP block
    folder = load_file(model / "model.safetensors")
    mtp = load_file(model / "model_mtp.safetensors")
    key = next(k for k in folder if k.endswith("layers.0.input_layernorm.weight"))
    torch.testing.assert_close(attn_norm, folder[key] + 1, rtol=0, atol=0)
    torch.testing.assert_close(enorm, mtp["model.layers.6.enorm.weight"] + 1, rtol=0, atol=0)


def test_step_gguf_runs_in_mtpkit_as_its_checkpoint(step):
    """mtpkit reads its step35 file back (norms less 1, experts stacked as released, the
    config rebuilt per layer type): logits equal the folder's, and greedy decoding with the
    three MTP layers gives the folder's tokens and draft counts."""
    _, model = step
    path = _gguf(model, "F32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(model).model, load_model(path).model
    assert b.mtp is not None and len(b.mtp.layers) == STEP_MTP
    assert [s.__dict__ for s in b.config.layers + b.config.mtp] == [
        s.__dict__ for s in a.config.layers + a.config.mtp]
    ids = torch.tensor([list(range(3, 43))])  # past the sliding window
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-5)
    tok = Tokenizer.from_hf_dir(model)
    for prompt in PROMPTS[:2]:
        want, res = _mtpkit_run(model, tok.encode(prompt), 24, STEP_MTP)
        got, res_gguf = _mtpkit_run(path, tok.encode(prompt), 24, STEP_MTP)
        assert got == want
        assert (res_gguf.metrics.num_draft_tokens, res_gguf.metrics.num_accepted_tokens) == (
            res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)


# Step-3.5 with Llama-3 RoPE scaling on its full-attention layers (the release's scaled layer
# type), over an original context of 16 so that it slows every full layer's slower channels
# within the tests' lengths.
STEP_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


# A small Step-3.5 config in the release's spelling: a full and two sliding layers, three
# sliding MTP layers, the release's rotary (half on full layers, whole on sliding ones).
_STEP_SMALL = {
    "model_type": "step3p5", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_attention_groups": 2,
    "head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16,
    "layer_types": ["full_attention"] + ["sliding_attention"] * 5,
    "rope_theta": [5e4, 1e4, 1e4, 1e4, 1e4, 1e4],
    "partial_rotary_factors": [0.5, 1, 1, 1, 1, 1],
    "moe_layers_enum": "", "num_nextn_predict_layers": 3,
}


@pytest.mark.parametrize("change, message", [
    ({"use_head_wise_attn_gate": "elementwise"}, "elementwise"),
    ({"attention_bias": True}, "no o_proj bias"),
    ({"query_pre_attn_scalar": 24}, "scales attention scores by head_dim ** -0.5"),
    ({"rope_theta": [5e4, 1e4, 2e4, 1e4, 1e4, 1e4]},
     "sliding_attention layers differ in rope_theta"),
    ({"partial_rotary_factors": [0.5, 1, 0.5, 1, 1, 1]},
     "sliding_attention layers differ in rotary width"),
    ({"partial_rotary_factors": [1] * 6}, "rotates half of rope.dimension_count"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                       "original_max_position_embeddings": 64}}, "rope scaling yarn"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling linear"),
    ({"rope_scaling": STEP_LLAMA3, "yarn_only_types": ["full_attention", "sliding_attention"]},
     "rope scaling on sliding-attention layers"),
])
def test_step_configs_llama_cpp_cannot_run_are_refused(change, message, tmp_path):
    """Step checkpoints whose step35 GGUF llama.cpp would not load, or would decode otherwise
    than the checkpoint, get an error naming the reason instead of a file."""
    from mtpkit.checkpoint.gguf import write_gguf

    cfg = {**_STEP_SMALL, **change}
    tensors = {f"mtp.layers.{i}.input_layernorm.weight": torch.zeros(64) for i in range(3)}
    with pytest.raises(ValueError, match=re.escape(message)):
        write_gguf(tmp_path / "never.gguf", "step35", cfg, tensors)
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


def test_step_config_llama_cpp_runs_otherwise_is_written(tmp_path):
    """The other side of the refusals: a rotary arrangement that is not the release's but
    that llama.cpp's per-type keys hold (a quarter of the head on full layers, half on
    sliding ones) is written with rope.dimension_count(_swa), and read back as it was."""
    from mtpkit.checkpoint.gguf import write_gguf

    cfg = {**_STEP_SMALL, "partial_rotary_factors": [0.25] + [0.5] * 5}
    tensors = {f"mtp.layers.{i}.input_layernorm.weight": torch.zeros(64) for i in range(3)}
    write_gguf(tmp_path / "m.gguf", "step35", cfg, tensors)
    with open_gguf(tmp_path / "m.gguf") as g:
        # Full layers rotate half of dimension_count: 2 x 4 = 8; sliding ones 8 too.
        assert g.metadata["step35.rope.dimension_count"] == 8
        assert "step35.rope.dimension_count_swa" not in g.metadata
        rope = g.config["rope_parameters"]
    assert (rope["full_attention"]["partial_rotary_factor"],
            rope["sliding_attention"]["partial_rotary_factor"]) == (0.25, 0.5)


@needs_server
@pytest.mark.parametrize("k", [1, 3])
def test_llama_server_runs_mtpkits_step_gguf_with_all_mtp_layers(step, k):
    """llama.cpp loads the file with its three nextn blocks, decodes it as mtpkit does, and
    drafts losslessly, draft step i with MTP layer i as mtpkit does (both chain the state
    before each norm, as vLLM's Step3p5MTP). At k = 1 (layer 0 only) its drafts and counts
    are mtpkit's, prompt for prompt. At k = 3 a few drafts differ: llama.cpp catches every
    MTP layer up on every accepted position with the trunk's states and rebuilds each
    deeper layer's draft positions, where mtpkit's deeper layers attend only over the
    positions they drafted at; the accepted counts stay close."""
    _against_llama_server(step[1], k, exact=k == 1)


# Where mtpkit's step35 file may differ from the converter's, and why.
STEP_CONVERTER_ONLY = CONVERTER_ONLY | {
    # The config's moe_every_n_layer (1), read by no step35 code of this llama.cpp: it takes
    # dense or MoE per layer from the tensors a block holds, as mtpkit's reader does.
    "step35.moe_every_n_layers",
}
STEP_MTPKIT_ONLY = {
    "step35.vocab_size",  # the embedding's rows; llama.cpp counts the token list, as long
    "tokenizer.ggml.add_bos_token",  # the tokenizer's own setting (False), left out there
}


@needs_converter
def test_step_metadata_and_tensors_equal_llama_cpps_converter(step, tmp_path):
    """mtpkit's F32 step35 file of the tiny Step-3.5 / 3.7 (three MTP layers) holds the keys
    and values llama.cpp's converter writes for the same folder, save the listed ones, and
    byte-identical tensors, save the converter's per-MTP-layer copies of the lm_head
    (the release's shared_head.output), which llama.cpp falls back to the trunk's for; and
    mtpkit runs the converter's file as the folder."""
    _, model = step
    ref = _run_converter(model, tmp_path / "ref.gguf", raw_config=True)
    theirs, their_tensors = _gguf_contents(ref)
    ours, our_tensors = _gguf_contents(_gguf(model, "F32"))
    assert set(theirs) - set(ours) == STEP_CONVERTER_ONLY
    assert set(ours) - set(theirs) == STEP_MTPKIT_ONLY
    assert {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]} == set()
    copies = {f"blk.{4 + i}.nextn.shared_head_head.weight" for i in range(STEP_MTP)}
    assert set(their_tensors) - set(our_tensors) == copies
    assert set(our_tensors) <= set(their_tensors)
    assert [n for n in our_tensors if our_tensors[n] != their_tensors[n]] == []
    # mtpkit reads the converter's file as well (the lm_head copies skipped).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(model).model, load_model(ref).model
    assert len(b.mtp.layers) == STEP_MTP
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-5)


@needs_server
@pytest.mark.parametrize("qtype, mtp, head_type", [("F16", "same", "F16"),
                                                   ("Q4_0", "w8a16", "Q8_0")])
def test_llama_server_runs_quantized_step_gguf_losslessly(step, qtype, mtp, head_type):
    """Quantized step35 files load, all three MTP layers stored as --mtp asks, and draft
    losslessly at k = 3 in llama.cpp (compared with its own plain decoding)."""
    heads = [f"blk.{4 + i}.{t}.weight" for i in range(STEP_MTP)
             for t in ("nextn.eh_proj", "attn_q", "ffn_down")]
    _quantized_lossless(step[1], qtype, mtp, head_type, heads, STEP_MTP)


def _step_llama3(out: Path) -> None:
    _step_text_only(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_scaling"] = dict(STEP_LLAMA3)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def step_llama3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("step_llama3") / "m"
    fam = tiny.Family("step3p5", lambda: tiny._step3p7(vocab_size=VOCAB, query_pre_attn_scalar=16),
                      mtp_layout="step3p7", mtp_layers=STEP_MTP, rewrite=_step_llama3)
    tiny.write_checkpoint(fam, out)
    tiny.add_mtp_head(out, fam, layers=STEP_MTP)  # trained on the scaled trunk
    _bpe_tokenizer(out)
    return out


def test_step_llama3_scaling_is_written_as_rope_freqs(step_llama3, tmp_path):
    """The scaling is one rope_freqs tensor (the full layers' frequency divisors, as mtpkit's
    rotary computes them; 1 for the rest of half the widest rotary width) and no
    rope.scaling key, which llama.cpp would apply to every layer. mtpkit reads the file back
    to the folder's logits, which the scaling moves at these positions."""
    import shutil

    from mtpkit.models.layers import rope_inv_freq

    model = step_llama3
    path = _gguf(model, "F32")
    with open_gguf(path) as g:
        md = g.metadata
        freqs = g._load("rope_freqs.weight", None)
    assert not any(k.startswith("step35.rope.scaling.") and "llama3" not in k for k in md)
    # Full layers rotate 8 channels at theta 5e4, sliding ones 16: 8 divisors, 4 of them
    # the full layers' own.
    plain = rope_inv_freq(8, 50000.0, None)
    scaled = rope_inv_freq(8, 50000.0, STEP_LLAMA3)
    assert freqs.shape == (8,)
    torch.testing.assert_close(freqs[:4], plain / scaled, rtol=1e-6, atol=0)
    assert freqs[0] > 1 and freqs[3] == 8.0 and freqs[4:].eq(1).all()
    unscaled = tmp_path / "unscaled"
    shutil.copytree(model, unscaled)
    cfg = json.loads((unscaled / "config.json").read_text())
    del cfg["rope_scaling"]
    (unscaled / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b, c = (load_model(p).model for p in (model, path, unscaled))
    assert [x.rope_scaling for x in b.config.layers + b.config.mtp] == [
        x.rope_scaling and {**x.rope_scaling, "rope_theta": 50000.0,
                            "partial_rotary_factor": 0.5}
        for x in a.config.layers + a.config.mtp]
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        want = a.logits(a(ids).hidden)
        torch.testing.assert_close(b.logits(b(ids).hidden), want, rtol=0, atol=1e-5)
        assert (c.logits(c(ids).hidden) - want).abs().max() > 0.1


@needs_server
@pytest.mark.parametrize("k", [1, 3])
def test_llama_server_runs_step_gguf_with_llama3_scaling(step_llama3, k):
    """llama.cpp decodes the scaled file as mtpkit does (the scaling on the full layers
    only, the sliding and MTP layers unscaled) and drafts with its three MTP layers
    losslessly; at k = 1 draft for draft as for the unscaled model."""
    _against_llama_server(step_llama3, k, exact=k == 1)


@needs_converter
def test_step_llama3_scaling_equals_llama_cpps_converter(step_llama3, tmp_path):
    """The converter writes the same rope_freqs (to float32 rounding: it computes the
    frequencies in float32, mtpkit's rotary in float64) and no scaling key; mtpkit adds the
    scaling's parameters, and refuses the converter's file, which lacks them, by name."""
    from mtpkit.checkpoint.errors import CheckpointError

    ref = _run_converter(step_llama3, tmp_path / "ref.gguf", raw_config=True)
    theirs, their_tensors = _gguf_contents(ref)
    ours, our_tensors = _gguf_contents(_gguf(step_llama3, "F32"))
    llama3 = {f"step35.rope.scaling.llama3.{k}" for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_context_length")}
    assert set(theirs) - set(ours) == STEP_CONVERTER_ONLY
    assert set(ours) - set(theirs) == STEP_MTPKIT_ONLY | llama3
    assert {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]} == set()
    assert "rope_freqs.weight" in set(our_tensors) & set(their_tensors)
    assert [n for n in our_tensors if n != "rope_freqs.weight"
            and our_tensors[n] != their_tensors[n]] == []
    with open_gguf(ref) as g:
        theirs_freqs = g._load("rope_freqs.weight", None)
        with pytest.raises(CheckpointError, match="rope.scaling.llama3"):
            g.hf_config()
    with open_gguf(_gguf(step_llama3, "F32")) as g:
        torch.testing.assert_close(g._load("rope_freqs.weight", None), theirs_freqs,
                                   rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# MiMo-V2-Flash (mimo2): hybrid sliding / full attention with sinks and scaled values, MoE
# with group-limited sigmoid routing, three MTP layers, in the release's config spelling.


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mimo_v2_flash") / "m"
    # tiny's model with routed weights unscaled (llama.cpp's mimo2 reads no scale: refused).
    fam = tiny.Family("mimo_v2_flash", lambda: tiny._mimo_v2_flash(
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, routed_scaling_factor=1.0),
        mtp_layout="mimo_v2", mtp_layers=3, rewrite=tiny._mimo_release_layout)
    tiny.write_checkpoint(fam, out)
    tiny.add_mtp_head(out, fam, layers=3)
    _bpe_tokenizer(out)
    return out


def test_mimo_metadata_matches_what_llama_cpp_expects(mimo):
    """The keys and tensors llama.cpp's mimo2 loader and MTP graph read: KV heads per block
    (sliding ones twice the full ones', MTP blocks sliding), q/k and v widths, one rotary
    width, a theta per layer type, value scale, group-limited sigmoid routing, and each MTP
    block's q, k and v fused into attn_qkv (the trunk's stay apart, as the converter
    writes them)."""
    with open_gguf(_gguf(mimo, "F32")) as g:
        md, names = g.metadata, set(g._tensors)
        qkv = g._load("blk.5.attn_qkv.weight", None)
    a = "mimo2"
    assert md[f"{a}.block_count"] == 7 and md[f"{a}.nextn_predict_layers"] == 3
    assert md[f"{a}.attention.head_count"] == 4
    assert md[f"{a}.attention.head_count_kv"] == [1, 2, 2, 1, 2, 2, 2]
    assert md[f"{a}.attention.sliding_window_pattern"] == [0, 1, 1, 0, 1, 1, 1]
    assert (md[f"{a}.attention.key_length"], md[f"{a}.attention.value_length"]) == (24, 16)
    assert md[f"{a}.rope.dimension_count"] == 8  # int(24 x 0.334)
    assert (md[f"{a}.rope.freq_base"], md[f"{a}.rope.freq_base_swa"]) == (50000.0, 10000.0)
    assert md[f"{a}.attention.value_scale"] == 0.707
    assert (md[f"{a}.expert_group_count"], md[f"{a}.expert_group_used_count"]) == (2, 1)
    assert md[f"{a}.expert_gating_func"] == 2
    for i in range(4, 7):
        assert {f"blk.{i}.nextn.{k}.weight" for k in ("eh_proj", "enorm", "hnorm")} <= names
        assert {f"blk.{i}.attn_qkv.weight", f"blk.{i}.layer_output_norm.weight",
                f"blk.{i}.attn_sinks.weight", f"blk.{i}.ffn_up.weight"} <= names
        assert f"blk.{i}.attn_q.weight" not in names
    assert "blk.1.attn_q.weight" in names and "blk.1.attn_qkv.weight" not in names
    assert "blk.1.attn_sinks.weight" in names and "blk.0.attn_sinks.weight" not in names
    assert qkv.shape == (4 * 24 + 2 * 24 + 2 * 16, 64)


def test_mimo_gguf_runs_in_mtpkit_as_its_checkpoint(mimo):
    """mtpkit reads its mimo2 file back (attn_qkv split again, the release's names): logits
    equal the folder's, and greedy decoding with the three MTP layers gives its tokens and
    draft counts."""
    path = _gguf(mimo, "F32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(mimo).model, load_model(path).model
    assert b.mtp is not None and len(b.mtp.layers) == 3
    assert (b.config.full, b.config.sliding) == (a.config.full, a.config.sliding)
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-5)
    tok = Tokenizer.from_hf_dir(mimo)
    for prompt in PROMPTS[:2]:
        want, res = _mtpkit_run(mimo, tok.encode(prompt), 24, 3)
        got, res_gguf = _mtpkit_run(path, tok.encode(prompt), 24, 3)
        assert got == want
        assert (res_gguf.metrics.num_draft_tokens, res_gguf.metrics.num_accepted_tokens) == (
            res.metrics.num_draft_tokens, res.metrics.num_accepted_tokens)


_MIMO_SMALL = {
    "model_type": "mimo_v2_flash", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 24, "v_head_dim": 16, "sliding_window": 6,
    "hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 0], "partial_rotary_factor": 0.334,
    "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 3,
}


@pytest.mark.parametrize("change, message", [
    ({"routed_scaling_factor": 2.5}, "reads no expert weights scale"),
    ({"norm_topk_prob": False}, "always renormalises"),
    ({"swa_head_dim": 32}, "differ in head_dim"),
    ({"swa_v_head_dim": 24}, "differ in v_head_dim"),
    ({"rope_parameters": {"sliding_attention": {"partial_rotary_factor": 0.5}}},
     "differ in rotary width"),
    ({"attention_bias": True}, "adds no q/k/v biases"),
])
def test_mimo_configs_llama_cpp_cannot_run_are_refused(change, message, tmp_path):
    """MiMo checkpoints whose mimo2 GGUF llama.cpp would not load, or would decode otherwise
    than the checkpoint, get an error naming the reason instead of a file."""
    from mtpkit.checkpoint.gguf import write_gguf

    cfg = {**_MIMO_SMALL, **change}
    tensors = {f"mtp.layers.{i}.input_layernorm.weight": torch.ones(64) for i in range(3)}
    with pytest.raises(ValueError, match=re.escape(message)):
        write_gguf(tmp_path / "never.gguf", "mimo2", cfg, tensors)
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


@needs_server
@pytest.mark.parametrize("k", [1, 3])
def test_llama_server_runs_mtpkits_mimo_gguf_with_all_mtp_layers(mimo, k):
    """llama.cpp loads the file (its MTP graph needs the fused attn_qkv), decodes it as
    mtpkit does, and drafts losslessly with the MTP layers. Counts are not compared:
    llama.cpp feeds the MTP layers the trunk's state before its final norm and chains each
    layer's output before final_layernorm, where mtpkit (as vLLM) feeds and chains the normed
    states, so its drafts are its own."""
    _against_llama_server(mimo, k, counts=False)


# The converter takes a bos id from config.json where the tokenizer names none (mtpkit
# writes the tokenizer's, with add_bos_token false either way).
MIMO_CONVERTER_ONLY = CONVERTER_ONLY | {"tokenizer.ggml.bos_token_id"}
MIMO_MTPKIT_ONLY = {"mimo2.vocab_size", "tokenizer.ggml.add_bos_token"}


@needs_converter
def test_mimo_metadata_and_tensors_equal_llama_cpps_converter(mimo, tmp_path):
    """mtpkit's F32 mimo2 file holds the keys and byte-identical tensors llama.cpp's
    converter writes for the same folder, save: the MTP blocks' attention, fused into
    attn_qkv by mtpkit where the converter copies q/k/v apart (a tiny checkpoint stores them
    apart; llama.cpp's MTP graph asserts the fused one, so the converter's file would stop
    at the first draft); and mtpkit runs the converter's file as the folder."""
    ref = _run_converter(mimo, tmp_path / "ref.gguf", raw_config=True)
    theirs, their_tensors = _gguf_contents(ref)
    ours, our_tensors = _gguf_contents(_gguf(mimo, "F32"))
    assert set(theirs) - set(ours) == MIMO_CONVERTER_ONLY
    assert set(ours) - set(theirs) == MIMO_MTPKIT_ONLY
    assert {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]} == set()
    fused = {f"blk.{i}.attn_qkv.weight" for i in range(4, 7)}
    apart = {f"blk.{i}.attn_{p}.weight" for i in range(4, 7) for p in "qkv"}
    assert set(our_tensors) - set(their_tensors) == fused
    assert set(their_tensors) - set(our_tensors) == apart
    assert [n for n in set(our_tensors) - fused if our_tensors[n] != their_tensors[n]] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = load_model(mimo).model, load_model(ref).model
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        torch.testing.assert_close(b.logits(b(ids).hidden), a.logits(a(ids).hidden),
                                   rtol=0, atol=1e-5)
    # The MTP blocks too: the fused rows are the converter's q, k and v, stacked.
    for i in range(4, 7):
        with open_gguf(ref) as g:
            parts = [g._load(f"blk.{i}.attn_{p}.weight", None) for p in "qkv"]
        with open_gguf(_gguf(mimo, "F32")) as g:
            torch.testing.assert_close(g._load(f"blk.{i}.attn_qkv.weight", None),
                                       torch.cat(parts), rtol=0, atol=0)


@needs_server
def test_llama_server_runs_quantized_mimo_gguf_losslessly(mimo):
    """A Q4_0 mimo2 file with its three MTP blocks in Q8_0 (w8a16) loads and drafts
    losslessly at k = 3 in llama.cpp (compared with its own plain decoding)."""
    heads = [f"blk.{i}.{t}.weight" for i in range(4, 7) for t in ("nextn.eh_proj", "attn_qkv")]
    _quantized_lossless(mimo, "Q4_0", "w8a16", "Q8_0", heads, 3)
