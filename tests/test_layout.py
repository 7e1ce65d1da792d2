"""The layout's rules, checked on the source text (no imports, so it runs in a second).

Dependencies point one way: kv_layout.py (cells, blocks, formats) is the leaf; kernels and
gpu/ build on it; kv/ and the backends build on kernels; the engine on top. A kernel that
imported the cache would make the two a cycle that only import order holds together.
"""
import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "strata_nb"


def imports_of(path: Path) -> set[str]:
    """Every strata_nb module `path` imports, as a dotted name, relative imports resolved."""
    package = ["strata_nb", *path.relative_to(SRC).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in found if m.startswith("strata_nb")}


def files_under(*parts: str) -> list[Path]:
    return sorted((SRC.joinpath(*parts)).rglob("*.py"))


def test_kv_layout_is_a_leaf():
    assert imports_of(SRC / "kv_layout.py") == set()


def test_kernels_and_gpu_never_import_the_cache_backends_or_engine():
    allowed = ("strata_nb.kernels", "strata_nb.gpu", "strata_nb.kv_layout", "strata_nb.model.dequant",
               "strata_nb.errors")
    bad = [f"{path.relative_to(SRC)} imports {m}"
           for path in files_under("kernels") + files_under("gpu")
           for m in sorted(imports_of(path)) if not m.startswith(allowed) and m != "strata_nb"]
    assert not bad, "\n".join(bad)


def test_kernels_are_imported_not_looked_up_by_name():
    """A launcher is named where it is used (`be.op(kv_append_q8_ref, kv_append_q8)`), so
    go-to-definition finds it: no string lookup of a kernel, in the engine or in the tests
    and tools that drive it, and no `importlib` of a kernel module in the engine."""
    root = SRC.parents[1]
    callers = files_under() + [p for d in ("tests", "tools", "examples") for p in sorted((root / d).rglob("*.py"))
                               if p.name != "test_layout.py"]
    bad = [f"{path.relative_to(root)}:{i}" for path in callers
           for i, line in enumerate(path.read_text().splitlines(), 1)
           if 'op("' in line or path.is_relative_to(SRC) and "importlib" in line and "kernels" in line]
    assert not bad, "\n".join(bad)


def test_simulator_geometry_is_chosen_in_one_place():
    """Which sizes differ under the simulator is gpu/geometry.py's table; backend/ asks only
    whether a device is there at all."""
    users = sorted(str(p.relative_to(SRC)) for p in files_under() if "config.ENABLE_CUDASIM" in p.read_text())
    assert users == ["backend/__init__.py", "gpu/geometry.py"]


# ---- the two tiers: kernels/ is the plain tier a learner reads, fast/ is fenced apart ----
FAST_TIER_WORDS = ("wait_for_inputs", "let_next_start", "waits_for_inputs", "SIMULATED", "launch_bounds")
FAST_TIER_MODULES = ("strata_nb.fast", "strata_nb.fast.dependent_launch", "strata_nb.fast.fast_launch",
                     "strata_nb.fast.sm90", "strata_nb.fast.tensor_core")
PLAIN_FILE_LINES = 250


def test_the_plain_tier_says_nothing_of_the_fast_one():
    """No plain kernel file mentions dependent launches or the simulator, and none imports
    the fast tier: the simulator's differences live behind gpu/'s seam."""
    bad = [f"{path.relative_to(SRC)} says {word}" for path in files_under("kernels")
           for word in FAST_TIER_WORDS if word in path.read_text()]
    bad += [f"{path.relative_to(SRC)} imports {m}" for path in files_under("kernels")
            for m in sorted(imports_of(path)) if m.startswith(FAST_TIER_MODULES)]
    assert not bad, "\n".join(bad)


def test_each_plain_file_reads_in_one_sitting():
    long = [f"{path.relative_to(SRC)}: {n} lines" for path in files_under("kernels")
            if (n := len(path.read_text().splitlines())) > PLAIN_FILE_LINES]
    assert not long, "\n".join(long)


def test_each_fast_kernel_file_names_its_plain_twin():
    """A fast module with kernels opens by saying which plain kernel it must equal (or
    that it has none, and why)."""
    bad = [str(path.relative_to(SRC)) for path in files_under("fast")
           if re.search(r"^\s*@cuda\.jit", path.read_text(), re.MULTILINE)
           and "plain twin" not in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()]
    assert not bad, "no 'plain twin' in the module docstring of: " + ", ".join(bad)
