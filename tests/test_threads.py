"""Thread teams on a shared CPU: usable CPUs (affinity, cgroup quota), the governor that
sizes the team to what other processes leave free, --threads, and --compare's warmed-up
turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from mtpkit import threads
from mtpkit.bench.common import compare_in_turns
from mtpkit.cli import main


@pytest.fixture
def restore_threads():
    before, gov = torch.get_num_threads(), threads._governor
    yield
    torch.set_num_threads(before)
    threads._governor = gov


def test_usable_cpus_reads_affinity_and_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert threads.usable_cpus(tmp_path) == affinity  # no cgroup files: the mask alone
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert threads.usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{150000 * affinity} 100000\n")  # more than the mask
    assert threads.usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1: one CPU
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert threads.usable_cpus(tmp_path) == affinity


@pytest.mark.parametrize("others,limit,want", [
    (0.0, 2, 2), (0.3, 2, 2), (0.67, 2, 1), (1.0, 2, 1), (3.0, 2, 1), (0.0, 1, 1),
    (1.0, 8, 7), (2.6, 8, 5),
])
def test_team_for_leaves_the_cpus_others_use(others, limit, want):
    assert threads.team_for(others, limit) == want


def test_governor_follows_other_load(monkeypatch, restore_threads):
    clock, system, own = [0.0], [0.0], [0.0]
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(threads, "_system_busy_s", lambda: system[0])
    monkeypatch.setattr(threads, "_self_busy_s", lambda: own[0])
    gov = threads.Governor(limit=2, threads=2)

    def window(seconds, ours, others):
        clock[0] += seconds
        own[0] += ours * seconds
        system[0] += (ours + others) * seconds
        return gov.tick()

    assert gov.tick() == 2  # the first look only starts a window
    assert window(0.1, 2.0, 1.0) == 2  # shorter than a window: nothing read
    assert window(0.2, 2.0, 0.67) == 1  # another program took 2/3 of a CPU
    assert torch.get_num_threads() == 1
    assert window(0.3, 1.0, 1.0) == 1  # it keeps its CPU while we run one thread
    assert window(0.3, 1.0, 0.0) == 2  # it is gone: the whole team again
    assert torch.get_num_threads() == 2
    assert window(0.3, 2.0, 0.2) == 2  # a little other work does not halve the team
    fixed = threads.Governor(limit=2, adaptive=False, threads=2)
    clock[0] += 1
    system[0] += 2
    assert fixed.tick() == 2 and torch.get_num_threads() == 2  # --threads: never adapts


def test_governor_sees_a_real_busy_process(restore_threads):
    """Beside a process spinning one thread on a 2-CPU limit, the governor picks 1 thread;
    once it ends, 2 again. Reads the machine's real counters."""
    if threads._system_busy_s() is None or threads.usable_cpus() < 2:
        pytest.skip("needs /proc/stat and 2 usable CPUs")
    gov = threads.Governor(limit=2, threads=2)
    before = _others_cpus(0.5)
    if before > 0.3:
        pytest.skip(f"other work already keeps {before:.1f} CPUs busy here")

    def settle(want: int, seconds: float = 3.0) -> list[int]:
        seen, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(threads.WINDOW_S / 2)
            seen.append(gov.tick())
            if seen[-3:] == [want] * 3:
                break
        return seen

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        seen = settle(1)
        assert seen[-3:] == [1, 1, 1], seen
    finally:
        busy.kill()
        busy.wait()
    seen = settle(2)
    assert seen[-3:] == [2, 2, 2], seen


def _others_cpus(seconds: float) -> float:
    s0, o0, t0 = threads._system_busy_s(), threads._self_busy_s(), time.perf_counter()
    time.sleep(seconds)
    s1, o1, t1 = threads._system_busy_s(), threads._self_busy_s(), time.perf_counter()
    return ((s1 - s0) - (o1 - o0)) / (t1 - t0)


def test_configure_threads_is_fixed_and_checked(restore_threads):
    gov = threads.configure(1)
    assert gov.limit == 1 and not gov.adaptive and torch.get_num_threads() == 1
    assert threads.limit() == 1
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        threads.configure(0)


def test_compute_alone_is_one_thread_and_stays_so(restore_threads):
    out = {}

    def run():
        out["alone"] = threads.compute_alone()
        threads.configure()  # a governor that would size the team to every usable CPU
        threads.tick()
        out["n"] = torch.get_num_threads()
        x = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))
        out["y"] = x @ x

    caller = threading.Thread(target=run)
    caller.start()
    caller.join()
    assert out["alone"] and out["n"] == 1
    assert torch.get_num_threads() == threads.limit()  # the calling thread keeps its team
    x = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out["y"], x @ x)


def test_full_team_restores_the_count(restore_threads):
    threads._governor = threads.Governor(limit=2, threads=1)
    torch.set_num_threads(1)
    with threads.full_team():
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_compare_in_turns_warms_both_and_alternates():
    calls = []
    cold = {1: True, 0: True}

    def run(k, watched, warm):
        calls.append((k, watched, warm))
        # First-run costs: the first generation at each k is four times slower.
        rate = (100.0 if k else 80.0) / (4 if cold[k] else 1)
        cold[k] = False
        return rate

    at_k, at_0 = compare_in_turns(run, 1, turns=2)
    assert calls == [(1, False, True), (0, False, True), (1, True, False), (0, False, False),
                     (0, False, False), (1, False, False)]
    assert sum(at_k) / sum(at_0) == pytest.approx(1.25)  # the warm ratio, not the cold one


def test_generate_threads_and_compare(model_dir, capsys, restore_threads):
    code = main(["generate", "hello", "--model", str(model_dir), "--max-tokens", "6",
                 "--compare", "--json", "--threads", "1", "-k", "2"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    report = json.loads(cap.out)
    assert report["identical_to_baseline"] is True
    assert report["speedup"] == pytest.approx(
        report["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert threads.limit() == 1 and not threads.governor().adaptive
    code = main(["generate", "hello", "--model", str(model_dir), "--threads", "0"])
    assert code == 2 and "--threads must be >= 1" in capsys.readouterr().err


def test_bench_contention_writes_every_cell(model_dir, tmp_path, capsys, restore_threads):
    out = tmp_path / "res"
    code = main(["bench", "contention", "--model", str(model_dir), "--compile", "off",
                 "--num-prompts", "2", "--max-tokens", "6", "--rounds", "1", "--out", str(out)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    res = json.loads((out / "results.json").read_text())
    (row,) = res["rows"]
    assert row["identical"] is True and row["k"] == 1
    for key in ("quiet_mtp", "quiet_plain", "busy_mtp", "busy_plain"):
        assert row[key] > 0, key
    assert row["kept_mtp"] == pytest.approx(row["busy_mtp"] / row["quiet_mtp"])
    assert row["mtp_over_plain_busy"] == pytest.approx(row["busy_mtp"] / row["busy_plain"])
    assert "| quiet: MTP / no MTP tok/s |" in cap.out and (out / "summary.csv").exists()
    assert main(["bench", "contention", "--compile", "maybe", "--rounds", "x"]) == 2
    assert "--rounds: invalid int value: 'x'" in capsys.readouterr().err
    assert main(["bench", "contention", "--compile", "maybe"]) == 2
    assert "--compile: 'maybe'" in capsys.readouterr().err


def test_measure_path_reports_changed_outputs():
    """A path whose tokens change beside the busy thread is flagged, not averaged over."""
    from contextlib import nullcontext

    from mtpkit.bench.contention import measure_path

    class Flaky:
        busy = False

        def generate(self, ids, params, k, result):
            toks = [1, 2, 3] if not self.busy else [1, 2, 4]
            result.tokens.extend(toks)
            yield from toks

    eng = Flaky()

    def busy(on):
        eng.busy = on
        return nullcontext()

    row = measure_path(eng, [[5, 6]], 1, 3, 1, busy=busy)
    assert row["identical"] is False


@pytest.mark.parametrize("rows", [1, 3])
def test_cpu_step_attention_is_the_same_at_any_thread_count(rows, restore_threads):
    """A decode (1 row) or verification (3 rows) step's attention gives the same bits at 1,
    2 and 3 threads (torch's CPU SDPA does not: it splits a row's keys by thread), each
    verified row the bits of a one-row step at its position, all close to SDPA."""
    from mtpkit.models.attention import Attention, sdpa
    from mtpkit.models.cache import KVCache
    from mtpkit.quant.kernels import int8_mm_available

    if not int8_mm_available():
        pytest.skip("mtpkit's CPU kernels cannot build here")
    g = torch.Generator().manual_seed(0)
    past = 300
    k0, v0 = torch.randn(2, 1, 3, past, 64, generator=g)
    q, k, v = (torch.randn(1, h, rows, 64, generator=g) for h in (9, 3, 3))

    def step(q, k, v, start):
        cache = KVCache(1, 3, past + 8, 64, torch.float32, "cpu")
        cache.update(k0[:, :, :start], v0[:, :, :start])
        return Attention._attend(q, k, v, cache)

    outs = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        outs.append(step(q, k, v, past))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    keys, values = torch.cat([k0, k], 2), torch.cat([v0, v], 2)
    for j in range(rows):
        ref = sdpa(q[:, :, j : j + 1], keys[:, :, : past + j + 1], values[:, :, : past + j + 1],
                   None)
        torch.testing.assert_close(outs[0][:, :, j : j + 1], ref, rtol=1e-5, atol=1e-5)
        if rows > 1:  # row j as the one-row step at its position computes it
            k_j = torch.cat([k0, k[:, :, :j]], 2)
            v_j = torch.cat([v0, v[:, :, :j]], 2)
            cache = KVCache(1, 3, past + 8, 64, torch.float32, "cpu")
            cache.update(k_j, v_j)
            one = Attention._attend(q[:, :, j : j + 1], k[:, :, j : j + 1], v[:, :, j : j + 1],
                                    cache)
            assert torch.equal(outs[0][:, :, j : j + 1], one)
