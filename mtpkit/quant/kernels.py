"""The hand-written CPU kernels (``csrc/``): built on first use, cached.

``int8_mm_available()`` builds the extension once per source version with the C++ compiler
torch's inductor also needs (into ``<mtpkit cache>/ext``) and registers
``torch.ops.mtpkit.int8_mm``, ``int8_a8_mm``, ``f32_mm`` (the compiled fp32 path's
row-exact GEMM), ``int4_a8_mm`` (W4A8), ``w8a8_pre`` and ``w8a8_post`` (a W8A8
layer's GEMMs with its norms, SiLU and residuals in one OpenMP region each), ``attend_rows`` (a
step's query rows' attention, each row as its own one-row computation, for the compiled
path's row-wise steps), ``w8a8_attn_post`` (that attention and ``w8a8_post`` in one region),
``w8a8_layer`` (a whole W8A8 layer, rotary and cache writes included, in one region)
and ``argmax_rows`` (the compiled steps' greedy pick). On CPUs with AMX (Intel Sapphire
Rapids and later) ``int8_a8_mm`` and ``int8_a16_mm`` take several rows on AMX tiles
(``csrc/amx.h``), with the same bits as the VNNI loop. Where it cannot (no
compiler, no AVX2, or ``MTPKIT_INT8_KERNEL=library``) it says why once and callers use
torch's own kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "int8_mm.cpp", _CSRC / "int8_a8_mm.cpp", _CSRC / "int4_a8_mm.cpp",
            _CSRC / "w8a8_block.cpp", _CSRC / "attend_rows.cpp", _CSRC / "argmax_rows.cpp")
# Included by the sources above.
_HEADERS = (_CSRC / "simd.h", _CSRC / "int8_a8.h", _CSRC / "amx.h", _CSRC / "attend.h",
            _CSRC / "aoti_shim.h", _CSRC / "team.h")
_state: dict = {}  # "ok": bool, "why": str, once per process; "lib": the global handle


def source_digest() -> str:
    """A digest of the kernel sources (compiled programs that call them key on it)."""
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def _unsupported() -> str | None:
    from ..envs import get

    if get("MTPKIT_INT8_KERNEL") == "library":
        return "MTPKIT_INT8_KERNEL=library"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} CPU (the kernel is AVX2)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "a CPU without AVX2"
    return None


# AVX-512 VNNI (Zen 4/5, Ice Lake and later): the W8A8 and W4A8 kernels' 512-bit vpdpbusd
# forms (csrc/int8_a8_mm.cpp, csrc/int4_a8_mm.cpp), chosen at build time by the host's
# flags since the extension is built where it runs. MTPKIT_KERNEL_ISA=avx2 keeps the AVX2
# forms (to compare the two on one machine).
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
# 256-bit vectors where gcc vectorizes on its own: 512-bit forms of the one-column loops ran
# slower inside the compiled steps on Zen 5 (csrc/int8_mm.cpp's header); the blocked W8A8
# and W4A8 loops use 512-bit intrinsics explicitly.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                 "-mprefer-vector-width=256"]


def kernel_isa() -> str:
    """``avx512`` or ``avx2``: which instruction set the kernels are built for here."""
    from ..envs import get

    if get("MTPKIT_KERNEL_ISA") == "avx2":
        return "avx2"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the AVX2 paths, which every supported CPU runs
        return "avx2"
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return "avx512" if all(f in flags for f in _AVX512) else "avx2"


def build_folder(isa: str) -> tuple[str, Path]:
    """The kernels' library name and the folder they are built in for this copy of mtpkit."""
    from ..builtin import cache_dir

    # Named apart from the folders of mtpkit versions before ``builder_lock``: a process of
    # such a version builds without the flock, and a newer one would take its live lock for
    # a stale one (two ninjas in one folder corrupt its deps log: every later load rebuilds).
    name = f"mtpkit_kernels_{source_digest()}_{isa}"
    # One folder per copy of the sources as well: cpp_extension's build.ninja names them by
    # absolute path, so two installs of one version (a venv and a checkout, a clone that
    # runs the tests) sharing a folder rebuilt it in the first command after the other had
    # built last, relinking a library that the other install's processes may have mapped.
    where = hashlib.sha256(str(_CSRC).encode()).hexdigest()[:8]
    return name, cache_dir() / "ext" / f"{name}_{where}"


def _build() -> None:
    from torch.utils.cpp_extension import load

    isa = kernel_isa()
    name, folder = build_folder(isa)
    folder.mkdir(parents=True, exist_ok=True)
    # Said at a terminal only: a first command's error output must stay its one line.
    if not (folder / f"{name}.so").exists() and sys.stderr.isatty():
        print(f"note: building mtpkit's CPU kernels into {folder} (first use of this version "
              "and copy of mtpkit, 20-60 s on 2 cores)", file=sys.stderr)
    with builder_lock(folder):
        lib = load(name, [str(src) for src in _SOURCES], build_directory=str(folder),
                   is_python_module=False,
                   extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
                   + (_AVX512_FLAGS if isa == "avx512" else []),
                   extra_ldflags=["-fopenmp"], verbose=False)
    if isinstance(lib, str):  # older torch returns the path instead of loading it
        torch.ops.load_library(lib)
    # Compiled programs call the kernels' C entry points (aoti_c_shims) by name; the loader
    # resolves a program's undefined symbols in the global scope only, and torch loaded the
    # library privately (RTLD_LOCAL). Reopening it global makes its symbols visible.
    _state["lib"] = ctypes.CDLL(str(folder / f"{name}.so"),
                                mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD | os.RTLD_NOW)

    for op in ("int8_mm", "int8_a8_mm", "int8_a16_mm", "f32_mm", "int4_a8_mm"):
        torch.library.register_fake(f"mtpkit::{op}")(_fake_gemm)
    torch.library.register_fake("mtpkit::w8a8_pre")(_fake_pre)
    torch.library.register_fake("mtpkit::w8a8_post")(_fake_post)
    torch.library.register_fake("mtpkit::w8a8_attn_post")(_fake_attn_post)
    torch.library.register_fake("mtpkit::w8a8_layer")(_fake_layer)
    torch.library.register_fake("mtpkit::w8a8_trunk")(_fake_layer)
    torch.library.register_fake("mtpkit::w8a8_trunk_kv")(_fake_layer)
    torch.library.register_fake("mtpkit::attend_rows")(_fake_attend)
    torch.library.register_fake("mtpkit::attend_pool")(_fake_attend_pool)
    torch.library.register_fake("mtpkit::argmax_rows")(_fake_argmax)


@contextlib.contextmanager
def builder_lock(folder: Path):
    """Hold the build folder for this process; clear a lock file left by a killed builder."""
    # cpp_extension marks a build with a bare ``lock`` file and waits, forever, for it to go.
    # A builder killed mid-build never removes it, so every later process would hang. An
    # flock on a file beside it is released by the kernel when its holder dies: whoever holds
    # it is the only live builder, so a ``lock`` it finds was left by a dead one.
    try:
        import fcntl
    except ImportError:  # not POSIX: cpp_extension's own lock only
        yield
        return
    with open(folder.parent / f"{folder.name}.builder", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"note: waiting for another process that is building mtpkit's CPU kernels "
                  f"into {folder}", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                print(f"note: removing {stale}, left by a kernel build that was stopped "
                      "midway", file=sys.stderr)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fake_gemm(x, w, *_):
    # Every GEMM op: x [M, K] against weights with one row per output column -> [M, N].
    return x.new_empty(x.shape[0], w.shape[0])


def _fake_pre(x, ln, eps, w, *_):
    return x.new_empty(x.shape[0], w.shape[0])


def _fake_post(a, x, *_):
    return x.new_empty(x.shape)


def _fake_attn_post(q, k, v, pos, rows, x, *_):
    return x.new_empty(x.shape)


def _fake_layer(x, *_):
    return x.new_empty(x.shape)


def _fake_attend(q, k, v, pos, rows):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2])


def _fake_attend_pool(q, *_):
    return q.new_empty(q.shape)


def _fake_argmax(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


# mtpkit's ops, each with a C entry point (csrc/aoti_shim.h) taking its schema's arguments
# in order, then the output.
_OPS = ("int8_mm", "int8_a8_mm", "int8_a16_mm", "f32_mm", "int4_a8_mm", "w8a8_pre", "w8a8_post",
        "w8a8_attn_post", "w8a8_layer", "w8a8_trunk", "w8a8_trunk_kv", "attend_rows",
        "attend_pool", "argmax_rows")
# A Tensor[] argument comes as an array of handles and its length (AOTInductor's convention).
_C_TYPES = {"Tensor": "AtenTensorHandle {}", "int": "int64_t {}", "SymInt": "int64_t {}",
            "float": "double {}", "List[Tensor]": "const AtenTensorHandle* {0}, int64_t {0}_len_"}


def aoti_c_shims() -> dict:
    """``aot_inductor.custom_ops_to_c_shims`` for mtpkit's ops (empty where they are off)."""
    if not int8_mm_available():
        return {}
    shims = {}
    for name in _OPS:
        op = getattr(torch.ops.mtpkit, name).default
        params = "".join(_C_TYPES[str(a.type)].format(a.name) + ", "
                         for a in op._schema.arguments)
        shims[op] = [f"AOTITorchError aoti_torch_cpu_{name}({params}AtenTensorHandle* ret0)"]
    return shims


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits [T, V], -1) -> [T], by mtpkit's kernel where it runs (CPU fp32)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and int8_mm_available():
        return torch.ops.mtpkit.argmax_rows(logits)
    return logits.argmax(-1)


def int8_mm_available() -> bool:
    """Whether ``torch.ops.mtpkit.int8_mm`` can run here (builds it on the first call)."""
    if "ok" not in _state:
        why = _unsupported()
        if why is None:
            kernel_isa()  # a malformed MTPKIT_KERNEL_ISA is an error, not a failed build
            try:
                _build()
            except Exception as exc:  # a missing compiler or ninja, a failed build
                why = f"its build failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
        _state["ok"], _state["why"] = why is None, why
        if why is not None and why != "MTPKIT_INT8_KERNEL=library":
            print(f"note: mtpkit's int8 CPU kernel is off ({why}); int8 layers use torch's "
                  "bf16-activation kernel instead", file=sys.stderr)
    return _state["ok"]


def kernel_choice() -> str:
    """``hand`` or ``library``: which int8 CPU kernel this process uses."""
    return "hand" if int8_mm_available() else "library"
