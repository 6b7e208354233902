"""The compile cache of the fast path's programs (engine/programs.py): each program exported
and compiled ahead of time, kept on disk by a key of everything it was built from, loaded by
later processes in seconds, pruned to a cap (cachecmd).

Backends: ``aoti`` exports each program and compiles it ahead of time with inductor
(weights prepacked or taken from the model, GEMMs autotuned, C++ wrapper) into a package
under ``~/.cache/mtpkit/compiled``, keyed by the model's weights, the shapes, the traced
sources and the torch build; ``auto`` (the default) loads such a package where one exists
and runs the program uncompiled until `mtpkit warmup` builds it; ``inductor`` uses
``torch.compile`` in process (nothing survives the process); ``eager`` runs the programs
as plain PyTorch (the reference the compiled ones are tested against). Either way the
shapes are fixed per decoder, so a generation never compiles anything.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import threads
from ..quant.kernels import aoti_c_shims, kernel_choice
from ..quant.kernels import source_digest as kernel_source_digest
from ..quant.linear import FORM_PREFIX, QuantLinear
from ..quant.w8a8_layer import W8A8Forms
from .programs import POOL_KINDS, POOL_MAX_ROWS, SPAN_STEP, Programs, StepModule

BACKENDS = ("auto", "aoti", "inductor", "eager")
ADOPT_EVERY_S = 2.0  # how often uncompiled programs look for their built file (ProgramCache)
log = logging.getLogger("mtpkit.fast")


def default_cache_dir() -> Path:
    """Where compiled programs persist: $MTPKIT_COMPILE_CACHE, else ~/.cache/mtpkit/compiled."""
    from ..envs import get

    own = get("MTPKIT_COMPILE_CACHE")
    if own is not None:
        return own
    from ..builtin import cache_dir

    return cache_dir() / "compiled"


def model_fingerprint(programs: Programs) -> str:
    """A digest of every weight (shape, dtype, float64 sum, a strided sample) and the config:
    compiled programs embed the weights, so a different model must never reuse them."""
    h = hashlib.sha256()
    h.update(json.dumps(programs.model.config.__dict__, sort_keys=True, default=str).encode())
    for name, t in list(programs.named_parameters()) + list(programs.named_buffers()):
        if name.rsplit(".", 1)[-1].startswith(FORM_PREFIX):
            continue  # a kernel's form of weights counted already (built lazily, or not)
        flat = t.detach().reshape(-1)
        if flat.is_floating_point():
            summary = [float(flat.sum(dtype=torch.float64))]
        else:
            summary = [int(flat.sum(dtype=torch.int64))]
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{summary}".encode())
        h.update(sample)
    # How a quantized layer computes is not all in its tensors: W8A8 and W8A16 copies of a
    # model hold the same int8 codes and scales, and must not share programs.
    for name, mod in programs.named_modules():
        if isinstance(mod, QuantLinear):
            h.update(f"{name}|{mod.extra_repr()}|{mod.dtype}|{mod.block}".encode())
    return h.hexdigest()[:24]


CONSTANTS_KEY = "mtpkit_constants"  # package metadata: "model" where it holds no weights

# Ops a weight passes through on its way to a GEMM without ceasing to be that weight.
_WEIGHT_VIEWS = {"t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze",
                 "squeeze", "_to_copy", "to", "clone", "contiguous", "detach", "alias",
                 "slice", "select", "type_as"}
_ATEN_GEMMS = {"mm", "addmm", "linear", "bmm", "baddbmm", "matmul", "_weight_int8pack_mm",
               "_weight_int4pack_mm_for_cpu"}


def _step_tensors(programs: Programs) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of programs by the path an exported StepModule names it by
    (StepModule.programs, then the module's own; shared ones under each name)."""
    named = dict(programs.named_parameters(prefix="programs", remove_duplicate=False))
    named.update(programs.named_buffers(prefix="programs", remove_duplicate=False))
    return named


def _runs_on_model_tensors(ep, programs: Programs) -> bool:
    """Whether an exported program can be built without its weights: every tensor it
    holds is a parameter or buffer of the model under the same name, and no aten GEMM
    takes one (inductor's CPU GEMMs want the prepacked copies freezing makes)."""
    named = _step_tensors(programs)
    if any(n not in named for n in (*ep.state_dict, *ep.constants)):
        return False
    weights = {spec.arg.name for spec in ep.graph_signature.input_specs
               if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")}
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        op = getattr(node.target, "_opname", None)
        takes = [a for a in node.args if isinstance(a, torch.fx.Node) and a.name in weights]
        if op in _ATEN_GEMMS and takes:
            return False
        if op in _WEIGHT_VIEWS and takes:
            weights.add(node.name)
    return True


def traced_sources(model) -> list[Path]:
    """The files a program of ``model`` is traced from: the step functions (programs.py),
    the quantized linear, and the model modules (``mtpkit/models``) save the families this
    model is not built from (another family's file changes nothing it runs)."""
    from ..models.registry import FAMILIES

    here = Path(__file__).resolve().parent
    root = here.parent
    families = {module for module, _ in FAMILIES.values()}
    own = {c.__module__.rsplit(".", 1)[-1] for cls in (type(model), type(model.config))
           for c in cls.__mro__}
    models = [f for f in sorted((root / "models").glob("*.py"))
              if f.stem not in families or f.stem in own]
    return [here / "programs.py", root / "quant" / "linear.py",
            root / "quant" / "w8a8_layer.py", *models]


def _source_digest(model) -> str:
    """A digest of the code a program is traced from (traced_sources) and the hand-written
    kernels; a change to any of them must not reuse a program built from the old code."""
    h = hashlib.sha256(kernel_source_digest().encode())
    for f in traced_sources(model):
        h.update(f.name.encode())
        h.update(_code_of(f.read_bytes()))
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _code_of(src: bytes) -> bytes:
    # A Python file's syntax tree without comments and layout, which change nothing a
    # program runs: an edit to a comment must not cost every user a rebuild (minutes).
    # Strings, docstrings included, stay in it. A file that does not parse is taken whole.
    # Cached by content: a program load asks for every traced file.
    import ast

    try:
        return hashlib.sha256(ast.dump(ast.parse(src)).encode()).digest()
    except (SyntaxError, ValueError):
        return src


def _build_key(fingerprint: str, kind: str, shapes: str, k: int, mode: str,
               forms: W8A8Forms, model) -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    parts = [
        fingerprint, kind, shapes, str(k), mode, forms.key(),
        torch.__version__, str(pick_vec_isa()),
        # GEMM templates are generated for the thread count in force at compile time.
        str(threads.limit()),
        _source_digest(model),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _inductor_configs(mode: str, rowwise: bool = False, low_precision: bool = False) -> dict:
    # Freezing folds the weights into the program; prepacking lays them out for inductor's
    # own CPU GEMM templates, which max-autotune measures against the library GEMMs.
    cfg = {"freezing": True, "cpp.weight_prepack": True,
           # Autotuning reports every choice on stderr; users see a progress note instead.
           "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    if low_precision and hasattr(torch._inductor.config, "emulate_precision_casts"):
        # bf16/fp16 models: inductor keeps a fused chain of ops in fp32 and rounds only
        # where a kernel ends, and where kernels end differs between the decode and round
        # programs (the round's head catch-up reads more of the trunk's values), so the
        # same row rounded differently in each and greedy MTP output left plain decoding's
        # (seen on a GPU with SmolLM2 in bf16, library GEMMs too). Rounding after every op,
        # as eager PyTorch does, makes them equal (identical across k) at no visible cost.
        cfg["emulate_precision_casts"] = True
    if mode == "max-autotune":
        cfg["max_autotune"] = True
    if rowwise:
        # Every trunk step has QUANT_ROWS rows (Programs.rows), and each GEMM takes the CPU
        # template when one applies (its blocking follows from the shape alone), else the
        # library kernel: no benchmark-driven choice, so a GEMM of the same shape is the
        # same kernel in every program. Autotuning between the two could pick differently
        # per program and break exactness (SmolLM2 w8a16, k=3, rows 2 and 4 mixed: 8/12
        # prompts identical; one row count with these settings: 12/12).
        cfg["max_autotune_gemm_backends"] = "CPP"
        cfg["autotune_fallback_to_aten"] = True
    return cfg


@dataclass
class CompileStats:
    """What building the programs cost so far."""

    seconds: float = 0.0  # wall time spent compiling or loading programs
    compiled: int = 0  # programs compiled in this process
    loaded: int = 0  # programs loaded from the cache


def dynamo_graphs() -> int:
    """Graphs torch.compile has produced in this process (each one a compilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])



class ProgramCache:
    """The callables of one ``Programs``' steps by (kind, rows T, draft depth k): loaded from
    the compile cache, built into it, or the step uncompiled (backend auto, until its file
    exists). A decoder and its forks share one. ``example(kind, t)`` gives a step's example
    arguments (the decoder's caches) for export; ``max_len`` is the decoder's cache length."""

    def __init__(self, programs: Programs, backend: str, mode: str,
                 cache_dir: str | Path | None, max_len: int, dtype: torch.dtype,
                 example: Callable[[str, int], tuple]) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.programs = programs
        self.backend, self.mode = backend, mode
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.max_len, self.dtype = max_len, dtype
        self._example = example
        self.stats = CompileStats()
        self.fns: dict[tuple, object] = {}
        # backend auto: programs running uncompiled because their file was not built yet
        # (key -> file), looked for again now and then (_adopt).
        self._pending: dict[tuple, Path] = {}
        self._looked = 0.0
        self._fingerprint: str | None = None
        self._used: set[Path] = set()  # program files loaded or built (kept by pruning)

    def get(self, kind: str, t: int = 1, k: int = 0):
        """The callable of one program (built, loaded or traced on first use)."""
        key = (kind, t, k)
        fn = self.fns.get(key)
        if self._pending and key in self._pending:
            fn = self._adopt(key) or fn
        if fn is None:
            t0 = time.perf_counter()
            with torch.inference_mode(False), torch.no_grad():
                fn = self._make(kind, t, k)
            self.stats.seconds += time.perf_counter() - t0
            self.fns[key] = fn
            # The model's and torch's ~300K objects live as long as the process; Python's
            # full collections, triggered by the few objects each step allocates, scanned
            # them all every few hundred steps, a measurable share of a small model's
            # step. Frozen, they are left out of every collection, as
            # serving engines do after loading (vLLM calls gc.freeze too).
            gc.freeze()
        return fn

    @property
    def pending(self) -> list[Path]:
        """Program files run uncompiled until they are built (backend auto)."""
        return list(self._pending.values())

    def build_pending(self) -> int:
        """Build the programs that run uncompiled for want of their file (backend auto), as
        `mtpkit warmup` builds them, and run the built ones from then on; how many were
        built (files that appeared meanwhile are only loaded)."""
        built = 0
        for key in list(self._pending):
            kind, t, k = key
            before = self.stats.compiled
            with torch.inference_mode(False), torch.no_grad():
                self.fns[key] = self._aoti_for_team(StepModule(self.programs, kind, k), kind,
                                                    t, k)
            built += self.stats.compiled - before
            del self._pending[key]
        return built

    def _adopt(self, key: tuple):
        # Load the programs built since the last look (by `mtpkit warmup`, e.g. the server's
        # background build), at most every ADOPT_EVERY_S: the look is a file-system call
        # per pending program, and a step is milliseconds.
        now = time.monotonic()
        if now - self._looked < ADOPT_EVERY_S:
            return None
        self._looked = now
        for kkey, path in list(self._pending.items()):
            if path.exists():
                try:
                    fn = self._load(path)
                except Exception as e:  # a corrupt file: keep the uncompiled program
                    log.warning("could not load %s (%s); running it uncompiled", path, e)
                else:
                    self.fns[kkey] = fn
                    log.info("loaded the compiled %s program (T=%d) built meanwhile",
                             kkey[0], kkey[1])
                del self._pending[kkey]
        return self.fns.get(key) if key not in self._pending else None

    def _make(self, kind: str, t: int, k: int):
        step = StepModule(self.programs, kind, k)
        if self.backend == "auto":
            # The compiled program where `mtpkit warmup` (or an earlier --compile aoti run)
            # built it, else the same program uncompiled: no request waits on a build.
            path = self.path(kind, t, k)
            if path.exists():
                return self._load(path)
            self._pending[(kind, t, k)] = path
            return step
        if self.backend == "eager":
            return step
        if self.backend == "inductor":
            with threads.full_team():  # as _aoti_for_team
                return self._torch_compile(step, kind, t)
        return self._aoti_for_team(step, kind, t, k)

    def _aoti_for_team(self, step, kind: str, t: int, k: int):
        # Built for the whole team (its key says so), whatever the load made it just now.
        with threads.full_team():
            return self._aoti(step, kind, t, k, self._example(kind, t))

    def _configs(self) -> dict:
        low = self.dtype in (torch.bfloat16, torch.float16)
        return _inductor_configs(self.mode, self.programs.rowwise, low)

    def _torch_compile(self, step, kind: str, t: int):
        from torch._inductor import config as inductor_config

        fn = torch.compile(step, dynamic=False, fullgraph=True)
        before = dynamo_graphs()
        # Dynamo reads the freezing flag while tracing, so it is set around the first call
        # (which compiles) rather than passed as a per-compile option. Generation runs in
        # inference mode, and guards compare dispatch keys: the first call must too. Every
        # program is one more cache entry of the same code object (StepModule.forward), which
        # dynamo counts as a recompilation: a process that builds several decoders or
        # draft lengths passed its limit of 8 and failed (fullgraph). These are distinct
        # programs by design, so the limit is lifted for the compiling call only.
        with (inductor_config.patch(self._configs()),
              torch._dynamo.config.patch(recompile_limit=1 << 16),
              torch.inference_mode()):
            example = self._example(kind, t)
            torch._dynamo.mark_dynamic(example[-1], 0, min=2 * SPAN_STEP, max=self.max_len)
            fn(*example)
        self.stats.compiled += dynamo_graphs() - before
        return fn

    def path(self, kind: str, t: int, k: int) -> Path:
        """Where the AOTInductor package of a program lives (its key in the name)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.programs)
        # Which kernels the program calls (mtpkit's, through their C entry points, or
        # torch's); choosing also loads mtpkit's, which a program that calls them needs
        # before it is loaded.
        shapes = f"T={t},L={self.max_len},dtype={self.dtype},int8={kernel_choice()}"
        key = _build_key(self._fingerprint, kind, shapes, k, self.mode, self.programs.forms,
                         self.programs.model)
        return self.dir / f"{kind}-{key}.pt2"

    def _load(self, path: Path):
        # A built program from the cache.
        try:
            os.utime(path)  # its mtime is its last use, which the cache cap prunes by
        except OSError:
            pass  # a read-only cache is still usable; it only loses that ordering
        self._used.add(path)
        self.stats.loaded += 1
        return self._open(path)

    def _open(self, path: Path):
        # A program file as a callable: where it was built without its weights (_aoti),
        # given the model's own tensors, kept alive by the program (user_managed: used in
        # place, not copied).
        compiled = torch._inductor.aoti_load_package(str(path))
        held = None
        if compiled.get_metadata().get(CONSTANTS_KEY) == "model":
            named = _step_tensors(self.programs)
            want = compiled.get_constant_fqns()
            missing = [n for n in want if n not in named]
            if missing:
                raise RuntimeError(f"{path.name} needs {missing[0]}, which this model does "
                                   "not hold; remove it (mtpkit cache clear) and rebuild")
            held = {n: named[n] for n in want}
            compiled.load_constants(held, check_full_update=True, user_managed=True)
        return _Loaded(compiled, held)

    def _dynamic_shapes(self, example: tuple, kind: str = "") -> dict:
        if kind in POOL_KINDS:
            # Rows, sequences and pool slots all dynamic: one program for every batch, a
            # lone sequence's one-row step and a decoder's own caches (one slot) included.
            n = torch.export.Dim("rows", min=1, max=POOL_MAX_ROWS)
            b = torch.export.Dim("seqs", min=1, max=POOL_MAX_ROWS)
            sl = torch.export.Dim("slots", min=1, max=4096)
            if kind == "head_pool":  # ids, states, pos, slots, sizes, hk, hv
                return {"args": ({1: n}, {1: n}, {0: n}, {0: b}, {0: b}, {0: sl}, {0: sl})}
            layers = len(example[4])  # ids, pos, slots, sizes, kpools, vpools, out
            m = torch.export.Dim("out", min=1, max=POOL_MAX_ROWS)
            return {"args": ({1: n}, {0: n}, {0: b}, {0: b}, [{0: sl}] * layers,
                             [{0: sl}] * layers, {0: m})}
        # Everything static but the span's length, a multiple of SPAN_STEP.
        blocks = torch.export.Dim("span_blocks", min=2, max=self.max_len // SPAN_STEP)
        spec = []
        for a in example:
            if isinstance(a, list):
                spec.append([None] * len(a))
            else:
                spec.append(None)
        spec[-1] = {0: SPAN_STEP * blocks}
        return {"args": tuple(spec)}  # StepModule.forward takes *args

    def _aoti(self, step, kind: str, t: int, k: int, example):
        path = self.path(kind, t, k)
        if not path.exists():
            import sys

            from ..cachecmd import compiled_cap_bytes, prune_compiled

            cap = compiled_cap_bytes()  # a malformed setting fails before the build
            print(f"note: compiling the {kind} program (T={t}, first run only, 1.5-4 min "
                  f"on 2 cores) into {path.parent}", file=sys.stderr)
            path.parent.mkdir(parents=True, exist_ok=True)
            ep = torch.export.export(step, example, strict=False,
                                     dynamic_shapes=self._dynamic_shapes(example, kind))
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:
                configs = self._configs()
                configs["aot_inductor.custom_ops_to_c_shims"] = aoti_c_shims()
                if _runs_on_model_tensors(ep, self.programs):
                    # The package holds no weights: _load gives it the model's. Freezing
                    # would fold them into constants of its own, and buys nothing where
                    # mtpkit's kernels take them as they are.
                    configs.update({"freezing": False,
                                    "aot_inductor.package_constants_in_so": False,
                                    "aot_inductor.metadata": {CONSTANTS_KEY: "model"}})
                torch._inductor.aoti_compile_and_package(ep, package_path=tmp,
                                                         inductor_configs=configs)
                os.replace(tmp, path)  # atomic: a concurrent run sees all or nothing
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self.stats.compiled += 1
            self._used.add(path)
            prune_compiled(path.parent, cap, keep=self._used)
            return self._open(path)
        return self._load(path)


class _Loaded:
    """An AOTInductor program called with its tensors flattened by hand: torch's wrapper
    (AOTICompiledModel) parses its call spec and flattens and unflattens every call with
    pytree (63 tensors a SmolLM2 step), a cost this avoids on every step."""

    def __init__(self, compiled, held: dict | None = None) -> None:
        from torch.utils import _pytree as pytree

        self.compiled = compiled
        self.held = held  # the model's tensors the program runs on (kept alive with it)
        self._run = compiled.loader.boxed_run
        self._out = pytree.treespec_loads(compiled.loader.get_call_spec()[1])
        self._unflatten = pytree.tree_unflatten

    def __call__(self, *args):
        """The program's outputs for tensors and lists of tensors, in the exported order."""
        flat: list[torch.Tensor] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                flat.append(a)
            else:
                flat.extend(a)
        return self._unflatten(self._run(flat), self._out)


