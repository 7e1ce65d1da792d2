"""The docs build with `mkdocs build --strict`: every included source region exists
(snippets' check_paths) and every link and anchor resolves. The built search index finds
every @cuda.jit kernel by name; "Reading the code" names every file of the package, the
tests, the tools and the examples; and every example is shown on a page."""
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_mkdocs_build_strict(site):
    assert (site / "index.html").exists()


def kernel_names() -> list[str]:
    """Every @cuda.jit kernel (not device function) defined in src/strata_nb/kernels/."""
    names = []
    for f in sorted((ROOT / "src" / "strata_nb" / "kernels").glob("*.py")):
        names += re.findall(r"@cuda\.jit\s*\n\s*def (\w+)", f.read_text())
    return names


def test_search_finds_every_kernel_by_name(site):
    """The search box splits text with the index's own separator; a kernel name must come
    out whole, as one term (kv_append_q8_kernel, not kv / append / q8 / kernel)."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    separator = re.compile(index["config"]["separator"])
    terms = set()
    for doc in index["docs"]:
        text = html.unescape(re.sub(r"<[^>]+>", " ", doc["text"]))
        terms.update(t for t in separator.split(text) if t)
    names = kernel_names()
    assert "kv_append_q8_kernel" in names
    missing = [n for n in names if n not in terms]
    assert not missing, f"kernels no page shows (include their region on their stop's page): {missing}"


def repo_files() -> list[str]:
    files = []
    for top in ("src/strata_nb", "tests", "tools", "examples"):
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                files.append(p.relative_to(ROOT).as_posix())
    return files


def test_reading_the_code_names_every_file():
    page = (DOCS / "reading-the-code.md").read_text()
    missing = [f for f in repo_files() if f"`{f}`" not in page]
    assert not missing, f"docs/reading-the-code.md does not map: {missing}"


def test_every_example_is_shown_on_a_page():
    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md") if p.name != "reading-the-code.md")
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f'--8<-- "examples/{script.name}"' in pages, f"no page includes examples/{script.name}"
