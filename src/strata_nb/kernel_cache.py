"""Compiled kernels kept on disk, so that a process loads what an earlier one compiled.

Numba compiles a `@cuda.jit` kernel the first time a process launches it: on an H200 the
kernels of one run take many seconds, and every new process paid them again. Every
kernel of the package is declared `@cuda.jit(cache=True)` (tests/test_kernel_cache.py
checks), so Numba writes each one it compiles (the PTX and the cubin, per signature and
compute capability) under NUMBA_CACHE_DIR, and later processes load it instead.

Numba checks a cached kernel against its own source file (time stamp and size) and its
bytecode and closure, not against the files it imports from. A kernel takes
gpu/geometry.py's sizes and gpu/reduce.py's device functions into its machine code, so an
edit there would leave a stale kernel in the cache. The cache therefore lives in a folder
named by a hash of every source file of the package: change any file and the next run
compiles into a new folder. The newest KEEP folders are kept.

NUMBA_CACHE_DIR must be set before the kernels are defined (a dispatcher finds its cache
folder when it is made), so the package's __init__ calls `use_kernel_cache` before it
imports anything that imports a kernel. A NUMBA_CACHE_DIR the user set is left alone.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # src/strata_nb
KEEP = 3  # source versions whose kernels stay on disk: the current one and two before it


def source_key(package: Path = PACKAGE) -> str:
    """A hash of every .py file of the package, path and bytes: any edit gives a new key."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def kernel_cache_root() -> Path:
    """$STRATA_NB_HOME/kernels: one folder per source version."""
    from .model.fetch import cache_dir

    return cache_dir() / "kernels"


# --8<-- [start:use_kernel_cache]
def use_kernel_cache() -> str:
    """Point Numba's on-disk cache at this source version's folder (unless NUMBA_CACHE_DIR
    is set already) and return the folder in use. Numba reads the variable when it is first
    imported; if it was imported before this package, its config is set too."""
    if not os.environ.get("NUMBA_CACHE_DIR"):  # Numba reads "" as unset too
        root = kernel_cache_root()
        folder = root / source_key()
        if not folder.is_dir():  # a new source version: make room for it
            forget_older_versions(root, KEEP - 1)
        os.environ["NUMBA_CACHE_DIR"] = str(folder)
    if "numba" in sys.modules:
        from numba.core import config

        config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    return os.environ["NUMBA_CACHE_DIR"]
# --8<-- [end:use_kernel_cache]


def forget_older_versions(root: Path, keep: int):
    """Remove all but the `keep` newest folders under root: kernels of older sources."""
    if not root.is_dir():
        return
    folders = sorted((f for f in root.iterdir() if f.is_dir()), key=lambda f: f.stat().st_mtime, reverse=True)
    for folder in folders[keep:]:
        shutil.rmtree(folder, ignore_errors=True)


def package_kernels() -> list:
    """Every kernel dispatcher (not device function) the package's imported modules hold,
    as a global or in a dict of them: the kernels a factory makes are kept in dicts."""
    from numba.cuda.dispatcher import CUDADispatcher

    found = {}

    def walk(obj, depth):
        if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device"):
            found[id(obj)] = obj
        elif isinstance(obj, dict) and depth < 3:
            for value in obj.values():
                walk(value, depth + 1)

    for name, module in list(sys.modules.items()):
        if name.startswith("strata_nb.") and module is not None:
            for value in list(vars(module).values()):
                walk(value, 0)
    return list(found.values())


def kernel_counts(kernels: list) -> tuple[int, int]:
    """(compiled, loaded): the (kernel, signature) pairs that this process compiled, and
    those it loaded from the on-disk cache."""
    compiled = sum(len(k.stats.cache_misses) for k in kernels)
    loaded = sum(len(k.stats.cache_hits) for k in kernels)
    return compiled, loaded


class CompileProgress:
    """While the block runs, a bar on stderr counts the kernels compiled, shown from the
    first compile on (a run that only loads kernels from the cache prints nothing). A
    thread polls the counts: Numba has no hook for a kernel's compile."""

    def __init__(self, kernels: list, every: float = 0.25):
        self.kernels, self.every = kernels, every
        self.before = kernel_counts(kernels)
        self.compiled = self.loaded = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        compiled, loaded = kernel_counts(self.kernels)
        self.compiled, self.loaded = compiled - self.before[0], loaded - self.before[1]

    def _watch(self):
        from tqdm import tqdm

        bar = None
        while True:
            done = self._done.wait(self.every)
            n = kernel_counts(self.kernels)[0] - self.before[0]
            if n and bar is None:
                bar = tqdm(desc="compiling kernels, first run only", unit=" kernels", file=sys.stderr)
            if bar is not None:
                bar.update(n - bar.n)
            if done:
                break
        if bar is not None:
            bar.close()
