"""How many threads a decode step takes: the CPUs this process may use, a user's cap, and
how many of them other work leaves free right now.

A 2-thread step whose second thread shares its core with another program waits at every
parallel region for a thread the OS has descheduled: beside one busy thread, multi-row
steps ran several times slower, where one thread alone keeps most of its speed (its core
is its own). So the engine calls ``tick()`` between steps; every quarter second or so that reads
how much CPU time other processes took (``/proc/stat`` less this process's own) and sizes
the team to what is left: all usable CPUs on a quiet machine, fewer beside other work.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 0.25  # shortest interval the CPU counters are read over (they tick at 100 Hz)


def _cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, v1 CFS), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpus(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def team_for(others_cpus: float, limit: int) -> int:
    """Threads to run when other processes keep ``others_cpus`` CPUs busy (of ``limit``)."""
    # Rounding: a thread is added back once at least half of its core is free. Beside one
    # busy thread on 2 CPUs the other program takes 2/3 of a CPU while we run 2 threads and
    # a whole one while we run 1, so either way this picks 1: no flapping.
    return max(1, min(limit, round(limit - others_cpus)))


def _system_busy_s() -> float | None:
    """Seconds of CPU time all processes took since boot (everything but idle and iowait)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:8]]  # user nice system idle iowait irq softirq
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _self_busy_s() -> float:
    t = os.times()
    return t.user + t.system


Mark = tuple[float, float, float]  # wall clock, all processes' CPU s, this process's CPU s


def mark() -> Mark | None:
    """Now, for ``others_since``; None where the CPU counters cannot be read."""
    sys_busy = _system_busy_s()
    return None if sys_busy is None else (time.perf_counter(), sys_busy, _self_busy_s())


def _others(start: Mark, end: Mark) -> float:
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def others_since(start: Mark | None) -> float | None:
    """CPUs other processes kept busy on average since ``start`` (None where unknown)."""
    end = mark()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return _others(start, end)


@dataclass
class Governor:
    """Sizes torch's thread team between steps from the CPU other processes use."""

    limit: int  # most threads: usable CPUs, or the user's --threads
    adaptive: bool = True
    threads: int = 0  # in force now
    _last: Mark | None = None

    def tick(self) -> int:
        """Re-size the team if a window has passed; the thread count in force."""
        if self.adaptive and (self._last is None
                              or time.perf_counter() - self._last[0] >= WINDOW_S):
            self._measure()
        self._apply()
        return self.threads

    def _measure(self) -> None:
        here = mark()
        if here is None:  # no /proc/stat: keep the limit
            self.adaptive = False
            return
        if self._last is not None:
            self.threads = team_for(_others(self._last, here), self.limit)
        self._last = here

    def _apply(self) -> None:
        # torch keeps the count per thread (OpenMP's per-thread setting): set it in every
        # thread that computes, here as it ticks.
        import torch

        if getattr(_local, "alone", False):
            return  # a thread made to compute alone (compute_alone) stays so
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


_governor: Governor | None = None
_torch_threads: list[int] = []


def _torch_default() -> int:
    import torch

    if not _torch_threads:
        _torch_threads.append(torch.get_num_threads())
    return _torch_threads[0]


def configure(threads: int | None = None) -> Governor:
    """Set the team's limit (``threads``, else every usable CPU) and start adapting to load.

    ``threads`` given by the user is a fixed size: no adapting."""
    global _governor
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    # torch's own default (physical cores, or OMP_NUM_THREADS) within what affinity and a
    # cgroup quota allow; read once, before any governor changed it.
    limit = threads or min(_torch_default(), usable_cpus())
    gov = Governor(limit=limit, adaptive=threads is None, threads=limit)
    gov._apply()
    _governor = gov
    return gov


def governor() -> Governor:
    """The process's governor (configured with defaults on first use)."""
    return _governor if _governor is not None else configure()


@contextlib.contextmanager
def full_team():
    """Run the block with the team at its limit (compiling programs built for that size)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(limit())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tick() -> int:
    """Between steps: let the governor re-size the team; the thread count in force."""
    return governor().tick()


def limit() -> int:
    """The most threads a step may take here: what compiled programs are built for."""
    return governor().limit


# -- the one thread that computes --------------------------------------------------------------
#
# Why one thread: torch's CPU parallelism is OpenMP (libgomp), which keeps a team of worker
# threads per thread that has opened a parallel region, for as long as that thread lives.
# Once two such teams exist and together hold more threads than there are CPUs, libgomp
# makes every worker sleep after a hundred spins instead of waiting for the next region, so
# each of the hundreds of regions a decode step opens pays a wake-up: a Model loaded on the
# main thread and called from another ran several times slower. The Python API therefore
# runs every computation on one thread of its own, whichever thread calls it.

_local = threading.local()
_compute: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a fork gets its own
_compute_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _compute
    with _compute_lock:
        if _compute is None or _compute[0] != os.getpid():
            _compute = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="mtpkit-compute"))
        return _compute[1]


def on_compute_thread() -> bool:
    """True in the thread that ``compute`` runs its calls on."""
    return threading.current_thread().name.startswith("mtpkit-compute")


def compute(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` on the process's compute thread; its result or exception."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _executor().submit(fn, *args, **kwargs).result()


@functools.cache
def _openmp():
    """The OpenMP runtime torch loaded (ctypes handle), or None where none can be found."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"):
        try:  # only a library already in the process: a second copy would be a second runtime
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def compute_alone() -> bool:
    """Make the calling thread run its parallel operations on itself alone, with no OpenMP
    team of its own; False where the runtime cannot be reached (nothing changed).

    For threads that compute only a little beside the one that computes most (the server's
    request threads beside its engine thread): a team of their own would make the main
    team's workers sleep between regions (see above)."""
    import torch

    # torch's per-thread set-up first, or it resets the count at the first parallel
    # operation (mtpkit's kernels split work without it: csrc/team.h).
    torch.get_num_threads()
    omp = _openmp()
    if omp is None:
        return False
    # Why ctypes: torch.set_num_threads also sets the process-wide count (and MKL's) that
    # the engine thread computes with; OpenMP's own call changes this thread's alone.
    omp.omp_set_num_threads(1)
    _local.alone = True
    return True
