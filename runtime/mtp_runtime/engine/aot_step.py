"""Graph mode's one-call decode step compiled ahead of time (AOTInductor): no dynamo on the call path.

`GreedyDecodeStep` compiled by `torch.compile` runs its kernels from C++, but every call still
goes through dynamo's frame (its transformed bytecode fetches the ~125 weights as attribute chains),
AOT autograd's wrapper and inductor's argument list: about 340 us of Python per step on the bench
model, a quarter of a batch-1 step (hack/profile_engine_step.py). Here the same step is exported
(`torch.export`, batch size and block-table width dynamic) and compiled by AOTInductor into a
package: a shared library whose one C++ entry takes the step's plan and the caches and runs every
kernel; a call is one pybind call.

- The package holds code only. The tensors the step reads (weights, fused and packed copies) are
  the live modules' own, handed to it at load by their module paths without a copy
  (`user_managed`), so a package does not depend on the weights' values and the model's memory
  does not double. During the export every plain tensor attribute of the modules is a named buffer
  (`_tensors_as_buffers`), so each has a path the package can name.
- Packages are cached on disk (`aot_cache_dir`, default ~/.cache/mtp-operator/aot), keyed by what
  the compiled code depends on: torch's version, this package's code, the model configs, the
  names, shapes and dtypes of every tensor the step reads, the caches' shapes past their block
  count, k, the block size,
  the thread count (inductor writes it into the kernels) and the CPU's instruction set. An entry is
  built in a temporary directory and renamed into place, so a crash leaves no half entry; one that
  fails to load is built again.
- One package per thread count a step of this k runs on (`ModelRunner.threads_for`): any batch size,
  table width and number of cache blocks, since the graph is exported with all three dynamic. A graph that would depend on the
  batch size (a path chosen by the number of tokens, as on CPUs without the packed kernels) is not
  exported (`AotUnavailable`), and the runner keeps the dynamo-compiled step.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import mtp_runtime
from mtp_runtime.engine.graph_step import GreedyDecodeStep

log = logging.getLogger("mtp_runtime.engine")

AOT_ENV = "MTP_AOT_STEP"  # the default of engines that leave aot_step unset: true, false or auto
AOT_CACHE_ENV = "MTP_AOT_CACHE_DIR"
FORMAT = 1  # of a cache entry; part of the key
PACKAGE = "step.pt2"
MANIFEST = "manifest.json"
# Largest batch size and block-table width the exported graph is declared for (the graph has no
# branch on either: export fails where it would).
MAX_BATCH = 1 << 14
MAX_WIDTH = 1 << 16
MAX_BLOCKS = 1 << 30  # KV cache blocks (dynamic too: a KV budget's block count varies from start to start)


class AotUnavailable(RuntimeError):
    """The step cannot be compiled ahead of time here (export or compile failed); the reason says why."""


def aot_cache_dir() -> Path:
    """$MTP_AOT_CACHE_DIR, else $MTP_CACHE_DIR/aot, else ~/.cache/mtp-operator/aot."""
    if os.environ.get(AOT_CACHE_ENV):
        return Path(os.environ[AOT_CACHE_ENV])
    root = Path(os.environ.get("MTP_CACHE_DIR") or Path.home() / ".cache" / "mtp-operator")
    return root / "aot"


def resolve_aot(requested: bool | None) -> bool | None:
    """The engine's aot_step setting: True or False as given, else $MTP_AOT_STEP (true, false or
    auto); None means auto (ahead of time where it works, else the dynamo-compiled step)."""
    if requested is not None:
        return requested
    env = os.environ.get(AOT_ENV, "auto").strip().lower()
    if env not in ("true", "false", "auto"):
        raise ValueError(f"${AOT_ENV}={env!r} is invalid: expected true, false or auto")
    return None if env == "auto" else env == "true"


_code_digest: str | None = None


# The sources a decode step is traced from (and the kernels it calls), relative to the package.
TRACED_SOURCES = ("models", "layers", "kernels", "config.py", "distributed.py", "engine/graph_step.py",
                  "engine/aot_step.py", "engine/sampler.py")


def code_digest() -> str:
    """sha256 over the sources the step is traced from (TRACED_SOURCES): a change to any of them makes
    a new key; a change elsewhere (the server, the scheduler) reuses the packages."""
    global _code_digest
    if _code_digest is None:
        root = Path(mtp_runtime.__file__).parent
        files = []
        for name in TRACED_SOURCES:
            path = root / name
            files += [p for p in path.rglob("*") if p.suffix in (".py", ".cpp")] if path.is_dir() else [path]
        h = hashlib.sha256()
        for path in sorted(files):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _code_digest = h.hexdigest()
    return _code_digest


class _StepProgram(nn.Module):
    """GreedyDecodeStep._step as a module: forward(plan, *caches), the caches flat in `layout` order."""

    def __init__(self, step: GreedyDecodeStep, layout: tuple[list[list[str]], list[list[str]]]):
        super().__init__()
        self.main = step.main
        if step.draft is not None:
            self.draft = step.draft
        self.step_fn = step._step
        self.layout = layout

    def forward(self, plan: torch.Tensor, *caches: torch.Tensor):
        main_names, draft_names = self.layout
        flat = iter(caches)
        main = [{name: next(flat) for name in names} for names in main_names]
        draft = [{name: next(flat) for name in names} for names in draft_names]
        return tuple(out for out in self.step_fn(plan, main, draft) if out is not None)


@contextlib.contextmanager
def _tensors_as_buffers(root: nn.Module):
    """Every plain tensor attribute of every module under `root` (fused and packed weights) is a
    non-persistent buffer for the duration, so export names it by its module path; put back after."""
    moved = []
    try:
        for module in root.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    if hasattr(type(module), name):  # the class attribute would hide the buffer
                        raise AotUnavailable(f"{type(module).__name__}.{name} is also a class attribute")
                    del module.__dict__[name]
                    module._buffers[name] = value
                    module._non_persistent_buffers_set.add(name)
                    moved.append((module, name))
        yield
    finally:
        for module, name in moved:
            value = module._buffers.pop(name)
            module._non_persistent_buffers_set.discard(name)
            module.__dict__[name] = value


def _resolve(root: nn.Module, path: str) -> torch.Tensor:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise AotUnavailable(f"the package names {path!r}, which is not a tensor of the model")
    return obj


_LOAD_LOCK = threading.Lock()


def _load_package(path: Path):
    """torch's loader unpacks a package's library into a directory of its own under the temporary
    directory and leaves it there when the process ends (15-20 MB a package, every start of an
    engine). Once loaded, the library is mapped and the directory is not read again, so the loader
    is pointed at a scratch directory of ours (its C++ side takes the temporary directory from
    TMPDIR, set only while it loads) that is removed as soon as it returns."""
    scratch = tempfile.mkdtemp(prefix="mtp-aot-load-")  # (Python's own temp directory is fixed by now)
    try:
        with _LOAD_LOCK, _environment(TMPDIR=scratch), warnings.catch_warnings():
            # torch's own loader still uses a pytree class it deprecated
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            return torch._inductor.aoti_load_package(str(path))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _environment(**values: str):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _names_a_tensor(root: nn.Module, path: str) -> bool:
    try:
        _resolve(root, path)
    except (AttributeError, AotUnavailable):
        return False
    return True


class AotDecodeStep(GreedyDecodeStep):
    """GreedyDecodeStep whose calls run an AOTInductor package (module docstring)."""

    def __init__(self, main, draft, k: int, block_size: int, keep_hidden: bool = False,
                 cache_dir: Path | None = None):
        super().__init__(main, draft, k, block_size, compile_graph=False, keep_hidden=keep_hidden)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else aot_cache_dir()
        self._runners: dict[int, object] = {}  # thread count -> the package's loader
        self._inputs: list[torch.Tensor] | None = None  # [plan slot, *caches]
        self._caches: tuple[list, list] | None = None  # the cache lists _inputs was flattened from
        self.built = 0  # packages compiled by this step (the rest came from the disk cache)
        self.loaded = 0
        self._program: _StepProgram | None = None
        self._shape: tuple[int, torch.device] | None = None  # num_blocks and device, from warm_up
        self._constants: dict[int, dict[str, torch.Tensor]] = {}  # per package: the tensors it points at
        self._packages: dict[int, object] = {}  # thread count -> the loaded package (AOTICompiledModel)

    # the call ---------------------------------------------------------------------

    def __call__(self, plan: torch.Tensor, main_caches: list, draft_caches: list):
        runner = self._runners.get(torch.get_num_threads())
        if runner is None:
            runner = self._late_package(main_caches, draft_caches)
        caches = self._caches
        if caches is None or caches[0] is not main_caches or caches[1] is not draft_caches:
            # the engine passes the same cache lists every step: flatten them once (held, so the
            # identity test cannot meet a new list at a freed one's address)
            self._inputs = [plan, *self._flat(main_caches, draft_caches)]
            self._caches = (main_caches, draft_caches)
        inputs = self._inputs
        inputs[0] = plan
        out = runner.run(inputs)
        if not self.k:
            return out[0], None, None
        return out[0], out[1], out[2]

    def _late_package(self, main_caches: list, draft_caches: list):
        """A call on a thread count the warm-up did not build for (a caller that changed torch's count):
        its package now, as the torch.compile step compiles a graph for an unwarmed shape."""
        threads = torch.get_num_threads()
        if self._shape is None:
            raise RuntimeError(f"AotDecodeStep(k={self.k}) was called before its warm_up")
        log.warning("aot step k=%d: no package from the warm-up runs on %d thread(s) (it built %s); building "
                    "it now", self.k, threads, sorted(self._runners))
        self._runners[threads] = runner = self._load_or_build(threads, main_caches, draft_caches, *self._shape)
        return runner

    @staticmethod
    def _flat(main_caches: list, draft_caches: list) -> list[torch.Tensor]:
        return [t for layer in main_caches for t in layer.values()] + \
            [t for layer in draft_caches for t in layer.values()]

    # building and loading -----------------------------------------------------------

    def warm_up(self, batch_sizes: list[int], num_blocks: int, main_caches: list, draft_caches: list,
                device: torch.device, threads_for=None) -> float:
        """Load (or build) the package of every thread count the batch sizes run on, then run each
        batch size once, as GreedyDecodeStep.warm_up does; returns the seconds it took. Raises
        AotUnavailable where the step cannot be compiled ahead of time."""
        start = time.perf_counter()
        self._shape = (num_blocks, device)
        own = torch.get_num_threads()
        counts = sorted({threads_for(b * (self.k + 1)) if threads_for else own for b in batch_sizes})
        try:
            for threads in counts:
                torch.set_num_threads(threads)
                self._runners[threads] = self._load_or_build(threads, main_caches, draft_caches, num_blocks, device)
        finally:
            torch.set_num_threads(own)
        self._warm = True
        super_start = time.perf_counter()
        GreedyDecodeStep.warm_up(self, batch_sizes, num_blocks, main_caches, draft_caches, device, threads_for)
        log.debug("aot step k=%d: first calls took %.2fs", self.k, time.perf_counter() - super_start)
        return time.perf_counter() - start

    def key(self, threads: int, main_caches: list, draft_caches: list) -> str:
        """The cache key (module docstring) of this step's package at `threads` threads."""
        program = self._program_for(main_caches, draft_caches)
        tensors, aliases = [], {}
        with _tensors_as_buffers(program):
            for name, t in [*program.named_buffers(remove_duplicate=False),
                            *program.named_parameters(remove_duplicate=False)]:
                tensors.append((name, list(t.shape), list(t.stride()), str(t.dtype)))
                # which names are one tensor (the draft's head and embedding may be the main model's)
                aliases.setdefault(id(t), []).append(name)
        spec = {
            "format": FORMAT,
            "torch": torch.__version__,
            "code": code_digest(),
            "isa": torch.backends.cpu.get_cpu_capability(),
            "main": self.main.config.to_dict(),
            "draft": self.draft.config.to_dict() if self.draft is not None else None,
            "k": self.k, "keep_hidden": self.keep_hidden, "block_size": self.block_size, "threads": threads,
            "tensors": sorted(tensors),
            "aliases": sorted(sorted(names) for names in aliases.values() if len(names) > 1),
            # per cache: its shape past the block count (dynamic: a KV budget's block count varies by start)
            "caches": [(list(t.shape[1:]), str(t.dtype)) for t in self._flat(main_caches, draft_caches)],
        }
        return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def _program_for(self, main_caches: list, draft_caches: list) -> _StepProgram:
        if self._program is None:
            layout = ([list(layer) for layer in main_caches], [list(layer) for layer in draft_caches])
            self._program = _StepProgram(self, layout).eval()
        return self._program

    def _load_or_build(self, threads: int, main_caches: list, draft_caches: list, num_blocks: int,
                       device: torch.device):
        entry = self.cache_dir / self.key(threads, main_caches, draft_caches)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Engines starting together (replicas on one machine, a benchmark's) build a package once:
        # the others wait for it here, then load it.
        with open(self.cache_dir / f"{entry.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (entry / MANIFEST).is_file():
                try:
                    runner = self._load(entry)
                    self.loaded += 1
                    return runner
                except Exception as exc:  # a damaged entry (a disk error, another torch build's file): rebuild
                    log.warning("aot step: the cached package %s did not load (%s: %s); building it again",
                                entry, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    shutil.rmtree(entry, ignore_errors=True)
            self._build(entry, main_caches, draft_caches, num_blocks, device)
            self.built += 1
            return self._load(entry)

    def _load(self, entry: Path):
        manifest = json.loads((entry / MANIFEST).read_text())
        package = _load_package(entry / PACKAGE)
        program = self._program
        if program is None:
            raise RuntimeError("AotDecodeStep._load: no module to take the tensors from")
        names = package.get_constant_fqns()
        if sorted(names) != sorted(manifest["constants"]):
            raise AotUnavailable(f"the package reads {len(names)} tensors, its manifest lists "
                                 f"{len(manifest['constants'])}")
        self._packages[manifest["threads"]] = package
        self._hand_over(manifest["threads"])
        return package.loader

    def _hand_over(self, threads: int) -> None:
        """Point the package of `threads` threads at the live modules' tensors (no copy)."""
        package = self._packages[threads]
        with _tensors_as_buffers(self._program):
            constants = {name: _resolve(self._program, name) for name in package.get_constant_fqns()}
        package.load_constants(constants, check_full_update=True, user_managed=True)
        self._constants[threads] = constants  # the package holds their pointers: keep them alive

    def swap_draft(self, draft, main_caches: list, draft_caches: list) -> None:
        """Run the step with another draft module of the same structure (names, shapes, dtypes, config):
        its tensors are handed to the loaded packages; nothing is compiled."""
        threads = sorted(self._runners)
        before = [self.key(t, main_caches, draft_caches) for t in threads]
        old_draft, old_program = self.draft, self._program
        self.draft, self._program = draft, None
        if [self.key(t, main_caches, draft_caches) for t in threads] != before:
            self.draft, self._program = old_draft, old_program
            raise ValueError("swap_draft: the new draft differs from the old one in its tensors or config; the "
                             "compiled step does not fit it (start a new engine)")
        for t in threads:
            self._hand_over(t)

    def _build(self, entry: Path, main_caches: list, draft_caches: list, num_blocks: int,
               device: torch.device) -> None:
        """Export the step and compile it into `entry` (written beside it, then renamed into place)."""
        program = self._program_for(main_caches, draft_caches)
        flat = self._flat(main_caches, draft_caches)
        width = 2
        rows = [self.plan(8 + i, [1] * (self.k + 1), [(i * width + j) % num_blocks for j in range(width)], width)
                for i in range(2)]
        plan = torch.tensor(rows, dtype=torch.long, device=device)
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        plan_width = torch.export.Dim("plan_width", min=self.k + 3, max=MAX_WIDTH)
        blocks = torch.export.Dim("blocks", min=1, max=MAX_BLOCKS)
        dynamic = ({0: batch, 1: plan_width}, tuple({0: blocks} for _ in flat))
        start = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=self.cache_dir))
        oblivious = torch.fx.experimental._config.backed_size_oblivious
        try:
            torch.fx.experimental._config.backed_size_oblivious = True  # a size of 1 is no special case
            with _tensors_as_buffers(program), torch.no_grad():  # traced on fake tensors: no cache is written
                exported = torch.export.export(program, (plan, *flat), dynamic_shapes=dynamic, strict=False)
            exported_s = time.perf_counter() - start
            with _tensors_as_buffers(program):
                unnamed = sorted(name for name in exported.constants if not _names_a_tensor(program, name))
            if unnamed:  # a tensor the modules hold in a container: no path to hand it over by at load
                raise AotUnavailable(f"the step reads tensors that no module path names: {unnamed}")
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(staging / PACKAGE),
                inductor_configs={"aot_inductor.package_constants_in_so": False})
            names = _load_package(staging / PACKAGE).get_constant_fqns()
            (staging / MANIFEST).write_text(json.dumps({
                "k": self.k, "threads": torch.get_num_threads(), "constants": sorted(names),
                "export_s": round(exported_s, 2), "compile_s": round(time.perf_counter() - start - exported_s, 2),
                "torch": torch.__version__}, indent=1))
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(staging, entry)
        except AotUnavailable:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise AotUnavailable(f"{type(exc).__name__}: {first}") from exc
        finally:
            torch.fx.experimental._config.backed_size_oblivious = oblivious
            shutil.rmtree(staging, ignore_errors=True)
        log.info("aot step k=%d, %d thread(s): compiled in %.1fs into %s", self.k, torch.get_num_threads(),
                 time.perf_counter() - start, entry)
