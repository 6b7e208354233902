"""The Python API (mtpkit.load, Model.generate, mtpkit.doctor, Model.evaluate) on the tiny
Llama checkpoint with a character tokenizer.

Expected outputs come from direct ``Engine.generate`` runs on the same checkpoint (the eager
engine, no fast path) and from the ``mtpkit`` command, never from hard-coded text.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings

import pytest

import mtpkit
from mtpkit.cli import main

PROMPTS = ["def f(x):", "Hello, world", "abc"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Compiled programs of compile="auto" looked up in an empty cache of the test's own."""
    old = os.environ.get("MTPKIT_COMPILE_CACHE")
    os.environ["MTPKIT_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("compiled"))
    yield
    if old is None:
        os.environ.pop("MTPKIT_COMPILE_CACHE", None)
    else:
        os.environ["MTPKIT_COMPILE_CACHE"] = old


def _load(path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtpkit.load(path, **options)


@pytest.fixture(scope="module")
def models(model_dir, compile_cache) -> dict:
    """compile mode -> Model: "auto" (the default: the fast path) and "off" (eager engine)."""
    return {"auto": _load(model_dir), "off": _load(model_dir, compile="off")}


# -- loading -----------------------------------------------------------------------------------

def test_load_exposes_tokenizer_name_and_head(models, model_dir, ref):
    auto, off = models["auto"], models["off"]
    assert auto.engine.fast is not None  # the default takes the fast path on tiny Llama
    assert off.engine.fast is None
    for m in (auto, off):
        assert m.has_mtp is True and m.name == str(model_dir)
        assert m.tokenizer.encode("abc") == ref.tok.encode("abc")
        assert m.encode("abc", chat=True) == ref.ids("abc", chat=True)


def test_unknown_option_is_a_type_error_naming_it(model_dir):
    with pytest.raises(TypeError, match="bogus_option") as e:
        mtpkit.load(model_dir, bogus_option=1, compile="off")
    assert "draft_p_min" in str(e.value)  # it lists the options load takes
    with pytest.raises(TypeError, match="warp"):
        mtpkit.evaluate(model_dir, model=model_dir, warp=9)


@pytest.mark.parametrize("options,message", [
    ({"compile": "fast"}, "compile='fast' is not one of auto, off"),
    ({"compile": "off", "draft_p_min": 0.5}, "draft_p_min needs the fast path"),
    ({"draft_p_min": 1.5}, r"draft_p_min must be a number in \[0, 1\)"),
    ({"draft_vocab_size": 0}, "draft_vocab_size must be >= 1"),
    ({"draft_vocab_size": 8}, "draft_vocab_size needs a head with a draft vocabulary"),
    ({"dtype": "float99"}, "dtype='float99' is not one of"),
    ({"device": "gpu9"}, "device='gpu9' is not a device"),
    ({"threads": 0}, "threads must be >= 1"),
])
def test_bad_options_raise_value_errors_in_python_terms(model_dir, options, message):
    with pytest.raises(ValueError, match=message) as e:
        _load(model_dir, **options)
    assert "--" not in str(e.value)  # no command-line flags in a Python caller's error


def test_missing_or_wrong_paths_name_the_path(model_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mtpkit.load(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mtpkit.load(model_dir, head=missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mtpkit.doctor(missing)
    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("hello")
    with pytest.raises(ValueError, match=str(not_a_checkpoint)) as e:
        mtpkit.load(not_a_checkpoint)
    assert isinstance(e.value, mtpkit.LoadError)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        mtpkit.load(empty)


def test_cli_flags_are_reworded():
    from mtpkit.api import python_message

    assert python_message("--draft-p-min needs the fast path: drop --compile off") == \
        "draft_p_min needs the fast path: load with compile='auto' (not 'off')"
    assert python_message("--device cuda was asked for; use --device cpu") == \
        "device='cuda' was asked for; use device='cpu'"
    assert "--" not in python_message("the compiled cache holds 2048 (raise --max-model-len)")
    assert python_message("use -k 1 or less") == "use k=1 or less"


# -- generate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "off"])
def test_greedy_text_equals_a_direct_engine_run_at_every_k(models, ref, mode):
    model = models[mode]
    for prompt in PROMPTS:
        want, res = ref.run(ref.ids(prompt), 20, 0, ignore_eos=True)
        for k in (0, 1, 3):
            out = model.generate(prompt, max_tokens=20, k=k, ignore_eos=True)
            assert isinstance(out, mtpkit.Generation)
            assert out.text == want and out.token_ids == res.tokens, (mode, prompt, k)
            assert out.finish_reason == "length" and out.num_draft_tokens == k


def test_default_k_is_one_and_metrics_are_consistent(models, ref):
    model = models["auto"]
    out = model.generate("def f(x):", max_tokens=16, ignore_eos=True)
    assert out.num_draft_tokens == 1
    for k in (1, 3):
        out = model.generate("def f(x):", max_tokens=16, k=k, ignore_eos=True)
        m = out.metrics
        assert m.generated_tokens == len(out.token_ids) == 16
        assert m.prompt_tokens == len(ref.ids("def f(x):"))
        assert m.num_drafts > 0 and m.num_draft_tokens >= m.num_accepted_tokens >= 0
        assert len(m.per_position_rate) == len(m.accepted_per_pos) == k
        assert all(0.0 <= r <= 1.0 for r in m.per_position_rate)
        assert m.acceptance_rate == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
        assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
        # Every step emits its accepted drafts plus one token (the first came from prefill).
        assert m.steps + m.num_accepted_tokens >= m.generated_tokens - 1
        d = out.as_dict()
        assert d["text"] == out.text and d["metrics"]["num_draft_tokens"] == m.num_draft_tokens
    plain = model.generate("def f(x):", max_tokens=16, k=0, ignore_eos=True)
    assert plain.metrics.num_draft_tokens == 0 and plain.metrics.per_position_rate == []


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_stream_pieces_join_to_the_text_and_hold_back_stop_strings(models, ref, mode):
    model = models[mode]
    want, _ = ref.run(ref.ids("Hello, world"), 24, 0, ignore_eos=True)
    stream = model.generate("Hello, world", max_tokens=24, k=3, ignore_eos=True, stream=True)
    assert stream.result is None
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == want
    assert stream.done and stream.result.text == want and stream.result.metrics.num_drafts > 0
    # A stop string taken from the middle of the reference text: output ends before it.
    stop = want[8:10]
    cut = want[: want.find(stop)]
    out = model.generate("Hello, world", max_tokens=24, k=3, stop=[stop, "\x7f"],
                         ignore_eos=True)
    assert out.text == cut and out.finish_reason == "stop"
    stream = model.generate("Hello, world", max_tokens=24, k=3, stop=stop, ignore_eos=True,
                            stream=True)
    pieces = list(stream)
    assert "".join(pieces) == cut and stream.result.text == cut
    assert stream.result.finish_reason == "stop" and stream.result.token_ids == out.token_ids


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_chat_and_token_id_prompts(models, ref, mode):
    model = models[mode]
    ids = ref.ids("abc", chat=True)
    assert ids != ref.ids("abc")
    want, _ = ref.run(ids, 12, 0, ignore_eos=True)
    assert model.generate("abc", max_tokens=12, chat=True, ignore_eos=True).text == want
    assert model.generate(ids, max_tokens=12, ignore_eos=True).text == want
    assert model.generate(tuple(ids), max_tokens=12, k=3, ignore_eos=True).text == want


def test_seeded_sampling_is_reproducible(models, ref):
    model = models["auto"]  # sampling runs on the eager engine whatever the compile mode
    kw = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}
    first = model.generate("The cat", max_tokens=20, k=3, ignore_eos=True, **kw)
    again = model.generate("The cat", max_tokens=20, k=3, ignore_eos=True, **kw)
    assert first.text == again.text and first.token_ids == again.token_ids
    want, _ = ref.run(ref.ids("The cat"), 20, 3, ignore_eos=True, **kw)
    assert first.text == want
    off = models["off"].generate("The cat", max_tokens=20, k=3, ignore_eos=True, **kw)
    assert off.text == want


def test_nothing_leaks_between_requests(models):
    for model in models.values():
        a = model.generate("def f(x):", max_tokens=20, k=3, ignore_eos=True)
        model.generate("Hello, world, hello again", max_tokens=30, k=1, ignore_eos=True)
        b = model.generate("def f(x):", max_tokens=20, k=3, ignore_eos=True)
        assert a.text == b.text and a.token_ids == b.token_ids
        # A stream left half read ends when the next request starts; the next is unharmed.
        stream = model.generate("Hello, world", max_tokens=20, k=3, ignore_eos=True,
                                stream=True)
        next(stream)
        c = model.generate("def f(x):", max_tokens=20, k=3, ignore_eos=True)
        assert c.text == a.text
        with pytest.raises(RuntimeError, match="ended by a later request"):
            next(stream)
        assert stream.result is None


def test_every_computation_runs_on_one_thread_whichever_thread_calls(models, model_dir,
                                                                      monkeypatch):
    # Two threads' OpenMP teams make each other's workers sleep between parallel regions
    # (several times slower), so loading and every step run on the one compute thread.
    seen: list[str] = []

    def spied(real):
        def generate(*args, **kwargs):
            gen = real(*args, **kwargs)
            while True:
                seen.append(threading.current_thread().name)
                try:
                    token = next(gen)
                except StopIteration as done:
                    return done.value
                yield token
        return generate

    real_load = mtpkit.api.Session.load.__func__

    def load(cls, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(mtpkit.api.Session, "load", classmethod(load))
    fresh = _load(model_dir, compile="off")
    for model in [fresh, *models.values()]:
        monkeypatch.setattr(model.engine, "generate", spied(model.engine.generate))
        out = {}

        def run(tag, model=model, out=out):
            out[tag] = model.generate("def f(x):", max_tokens=12, k=2, ignore_eos=True).text
            out[tag + " stream"] = "".join(model.generate("def f(x):", max_tokens=12, k=2,
                                                          ignore_eos=True, stream=True))

        run("main")
        caller = threading.Thread(target=run, args=("thread",))
        caller.start()
        caller.join()
        assert out["thread"] == out["main"] == out["thread stream"] == out["main stream"]
    assert len(seen) > 4 * 12 and set(seen) == {seen[0]}
    assert seen[0].startswith("mtpkit-compute") and seen[0] != threading.current_thread().name


def test_bad_requests_raise_clear_errors(models):
    model = models["auto"]
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate("")
    with pytest.raises(ValueError, match="chat=True needs the prompt as text"):
        model.generate([1, 2, 3], chat=True)
    with pytest.raises(ValueError, match="token id 96 is outside the vocabulary"):
        model.generate([1, 96])
    with pytest.raises(TypeError, match="prompt must be a str or a list of token ids"):
        model.generate(3.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate("abc", temperature=-1)
    with pytest.raises(ValueError, match="k must be >= 0"):
        model.generate("abc", k=-1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        model.generate("abc", max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the model's context") as e:
        model.generate("abc", max_tokens=10_000)
    assert "--" not in str(e.value)
    # Still serving after every refusal.
    assert model.generate("abc", max_tokens=4).metrics.generated_tokens >= 1


# -- doctor and evaluate -----------------------------------------------------------------------

def test_doctor_returns_the_findings_the_cli_prints(model_dir, tmp_path, capsys):
    healthy = mtpkit.doctor(model_dir)  # mtpkit.doctor is the subpackage too, callable
    assert mtpkit.doctor.diagnose(model_dir).as_dict() == healthy.as_dict()
    assert healthy.verdict == "healthy" and healthy.exit_code == 0
    assert healthy.facts["mtp_layers_stored"] == 1
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (broken / "config.json").write_text(json.dumps(cfg))
    report = mtpkit.doctor(broken)
    assert "mtp-config-missing" in report.codes() and report.verdict != "healthy"
    assert all(f.what and f.fix for f in report.findings)
    assert main(["doctor", str(broken), "--json"]) == report.exit_code
    assert json.loads(capsys.readouterr().out) == json.loads(report.to_json())
    only = mtpkit.doctor(broken, engines="vllm")
    assert only.engines == ["vllm"]
    with pytest.raises(ValueError, match="engines: 'nope' is not one of vllm"):
        mtpkit.doctor(broken, engines=["nope"])
    with pytest.raises(ValueError, match="measure=True"):
        mtpkit.doctor(broken, reference=model_dir)


def test_doctor_measure_adds_the_measured_acceptance(model_dir):
    report = mtpkit.doctor(model_dir, measure=True)
    assert report.codes() & {"mtp-acceptance-ok", "mtp-acceptance-zero"}
    assert len(report.facts["measured"]["acceptance_per_position"]) == 2


def test_evaluate_reports_what_the_cli_reports(models, model_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    got = models["off"].evaluate(data, k=2, max_tokens=600)
    assert main(["eval", "--model", str(model_dir), "--data", str(data), "-k", "2",
                 "--max-tokens", "600", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    for key in ("positions", "per_position_acceptance_rate", "perplexity", "perplexity_tokens"):
        assert got[key] == pytest.approx(want[key]), key
    assert len(got["per_position_acceptance_rate"]) == 2 and got["perplexity"] > 1
    gen = models["auto"].evaluate([data], k=2, mode="generate", max_tokens=8, prompts=2)
    assert gen["identical_to_no_mtp"] is True and gen["generated_tokens"] == 16
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        models["off"].evaluate(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="k must be >= 1"):
        models["off"].evaluate(data, k=0)
