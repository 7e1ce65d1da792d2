"""The on-disk kernel cache (src/strata_nb/kernel_cache.py), without a GPU: every kernel is declared
cacheable, the cache folder reaches Numba however the imports are ordered, the folder
changes with the source, the counts see every kernel, and the first run's bar shows only
when a kernel compiles. That a second process on a GPU loads instead of compiling is
measured there (`strata-nb run --stats` twice; docs/gpu/running.md)."""
import ast
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from strata_nb.kernel_cache import CompileProgress, forget_older_versions, kernel_counts, source_key

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "strata_nb"


def uncached_kernels(source: str) -> list[str]:
    """The kernels in `source` that `cuda.jit` makes without cache=True: as a decorator
    (bare or called) or called on a function. Device functions are left out: they are
    compiled into the kernels that call them, and cached with those."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = [(d, node.name) for d in node.decorator_list]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Call):  # cuda.jit(...)(fn)
            decorators = [(node.func, ast.unparse(node.args[0]) if node.args else "?")]
        else:
            continue
        for d, name in decorators:
            call = d if isinstance(d, ast.Call) else None
            if ast.unparse(call.func if call else d) != "cuda.jit":
                continue
            options = {k.arg: ast.unparse(k.value) for k in (call.keywords if call else [])}
            if options.get("device") != "True" and options.get("cache") != "True":
                found.append(name)
    return found


def test_every_kernel_of_the_package_is_cacheable():
    kernels = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        assert not uncached_kernels(source), f"{path.relative_to(ROOT)}: use @cuda.jit(cache=True)"
        kernels += source.count("@cuda.jit(cache=True)")
    assert kernels >= 30


def test_the_check_finds_a_kernel_without_the_cache():
    """The negative control: each way of making a kernel without cache=True is caught."""
    source = textwrap.dedent("""
        @cuda.jit
        def bare(x): pass
        @cuda.jit(fastmath=True)
        def called(x): pass
        @cuda.jit(cache=True)
        def cached(x): pass
        @cuda.jit(device=True)
        def helper(x): pass
        wrapped = cuda.jit(lambda x: None)
        on_device = cuda.jit(device=True)(helper)
    """)
    assert uncached_kernels(source) == ["bare", "called"]
    assert uncached_kernels("k = cuda.jit(fastmath=True)(body)") == ["body"]


def numba_cache_dir(code: str, home: Path, **env) -> str:
    """What Numba's config and a kernel's cache say in a fresh process without the
    simulator (no GPU is needed to make a kernel's dispatcher), after `code`."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    child_env.update(STRATA_NB_HOME=str(home), **env)
    script = code + textwrap.dedent("""
        from numba.core import config
        from strata_nb.kernels.dense.residual import residual_kernel
        assert residual_kernel._cache.cache_path.startswith(config.CACHE_DIR), residual_kernel._cache.cache_path
        print(config.CACHE_DIR)
    """)
    run = subprocess.run([sys.executable, "-c", script], env=child_env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


def test_the_cache_folder_is_set_before_numba_is_imported(tmp_path):
    """Importing strata_nb first: the folder is in the environment when Numba is first
    imported (an import hook notes it then), so Numba reads it itself."""
    code = textwrap.dedent("""
        import os, sys
        at_numba_import = []
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == "numba" and not at_numba_import:
                    at_numba_import.append(os.environ.get("NUMBA_CACHE_DIR"))
        sys.meta_path.insert(0, Watch())
        import strata_nb
        assert at_numba_import == [os.environ["NUMBA_CACHE_DIR"]], at_numba_import
    """)
    assert numba_cache_dir(code, tmp_path) == str(tmp_path / "kernels" / source_key())


def test_the_cache_folder_reaches_numba_imported_first(tmp_path):
    """Importing numba first (as tests and notebooks do): the package sets its config."""
    code = "import numba.cuda\nimport strata_nb\n"
    assert numba_cache_dir(code, tmp_path) == str(tmp_path / "kernels" / source_key())


def test_a_numba_cache_dir_of_the_users_wins(tmp_path):
    assert numba_cache_dir("import strata_nb\n", tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "mine")) == \
        str(tmp_path / "mine")


def test_the_folder_changes_with_any_source_file(tmp_path):
    """Numba checks only the kernel's own file; a kernel also compiles in sizes and device
    functions from others (gpu/geometry.py, gpu/reduce.py), so the folder is named by all."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "kernel.py").write_text("from .gpu.geometry import TILE\n")
    (tmp_path / "gpu" / "geometry.py").write_text("TILE = 64\n")
    before = source_key(tmp_path)
    assert source_key(tmp_path) == before
    (tmp_path / "gpu" / "geometry.py").write_text("TILE = 32\n")
    assert source_key(tmp_path) != before
    assert len(source_key()) == 16


def test_older_versions_are_forgotten(tmp_path):
    for age, name in enumerate(["newest", "newer", "older", "oldest"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    forget_older_versions(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer", "newest"]
    forget_older_versions(tmp_path / "absent", keep=2)  # no cache yet: nothing to do


def test_the_counts_see_every_kernel():
    """package_kernels finds every kernel the package defines, those a factory makes
    included: the counts --stats prints are over all of them. In a process without the
    simulator, where the kernels are Numba's dispatchers."""
    from test_docs import kernel_names

    script = textwrap.dedent("""
        import importlib, pkgutil
        import strata_nb.kernels
        from strata_nb.kernel_cache import kernel_counts, package_kernels
        for m in pkgutil.walk_packages(strata_nb.kernels.__path__, "strata_nb.kernels."):
            importlib.import_module(m.name)
        kernels = package_kernels()
        assert kernel_counts(kernels) == (0, 0)  # nothing launched
        print(" ".join(sorted({k.py_func.__name__ for k in kernels})))
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    found = set(run.stdout.split())
    assert set(kernel_names()) <= found, set(kernel_names()) - found


def stand_in_kernel():
    """What the counts read of a dispatcher: its cache's hits and misses by signature."""
    return SimpleNamespace(stats=SimpleNamespace(cache_hits=Counter(), cache_misses=Counter()))


def test_a_run_that_loads_every_kernel_says_nothing(capsys):
    kernels = [stand_in_kernel(), stand_in_kernel()]
    kernels[0].stats.cache_hits["(float32[::1],)"] += 1  # made before: not this run's
    with CompileProgress(kernels) as made:
        for k in kernels:
            k.stats.cache_hits["(int32[::1],)"] += 1
    assert (made.compiled, made.loaded) == (0, 2)
    assert capsys.readouterr().err == ""


def test_a_run_that_compiles_shows_its_count(capsys):
    kernels = [stand_in_kernel(), stand_in_kernel()]
    with CompileProgress(kernels, every=0.01) as made:
        kernels[0].stats.cache_misses["(float32[::1],)"] += 1
        kernels[1].stats.cache_hits["(float32[::1],)"] += 1
        kernels[1].stats.cache_misses["(int32[::1],)"] += 1
    assert (made.compiled, made.loaded) == (2, 1) == kernel_counts(kernels)
    err = capsys.readouterr().err
    assert "compiling kernels, first run only" in err and "2 kernels" in err
