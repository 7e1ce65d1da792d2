"""The docs build with `mkdocs build --strict`: every included source region exists
(snippets' check_paths) and every link and anchor resolves. The built search index finds
every @cuda.jit kernel by name; "Reading the code" names every file of the package, the
tests, the tools and the examples; and every example is shown on a page.

What the README and the pages say must hold too: no measured figure is typed by hand
(they come from generated or included files; history is in CHANGELOG.md), the tables
tools/docs_tables.py writes are up to date, every file a shown command reads exists, and
"Strata #1188" is explained where it is cited."""
import html
import importlib.util
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
    # No -q: mkdocs counts warnings for --strict only when they are logged, so a quiet
    # build would pass with broken links and anchors.
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_mkdocs_build_strict(site):
    assert (site / "index.html").exists()


def kernel_names() -> list[str]:
    """Every @cuda.jit kernel (not device function) defined in src/strata_nb/kernels/:
    declared `@cuda.jit(cache=True)` (tests/test_kernel_cache.py), or bare."""
    names = []
    for f in sorted((ROOT / "src" / "strata_nb" / "kernels").rglob("*.py")):
        names += re.findall(r"@cuda\.jit(?:\(cache=True\))?\s*\n\s*def (\w+)", f.read_text())
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


PLAIN_TIER = re.compile(r"the plain tier in reading order: \*\*(\d+) files, ([\d,]+) lines\*\*")


def test_reading_the_code_lists_the_plain_tier_in_reading_order():
    """Every file of the plain tier (src/strata_nb/kernels/, less the empty package files)
    is a row of the reading-order table, and the page's count of its files and lines is
    today's."""
    page = (DOCS / "reading-the-code.md").read_text()
    found = PLAIN_TIER.search(page)
    assert found, "docs/reading-the-code.md does not state the plain tier's files and lines"
    table = page[found.end():].split("\n## ")[0]
    files = [f for f in sorted((ROOT / "src" / "strata_nb" / "kernels").rglob("*.py")) if f.name != "__init__.py"]
    listed = re.findall(r"^\| \d+ \| `src/strata_nb/kernels/([\w/]+\.py)`", table, re.MULTILINE)
    assert sorted(listed) == sorted(str(f.relative_to(ROOT / "src/strata_nb/kernels")) for f in files)
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert (int(found[1]), int(found[2].replace(",", ""))) == (len(files), lines)


def test_every_example_is_shown_on_a_page():
    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md") if p.name != "reading-the-code.md")
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f'--8<-- "examples/{script.name}"' in pages, f"no page includes examples/{script.name}"



# ---- what the pages say -------------------------------------------------------------

def prose_files() -> list[Path]:
    """README.md and every docs page, not docs/measured/ (what commands wrote)."""
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if "measured" not in p.relative_to(DOCS).parts)


# A measured figure is a number followed by a unit only a measurement has: a rate (tok/s,
# GB/s, MB/s, TB/s), a time (us, µs, ms, microseconds, milliseconds), a share of a whole
# ("93% of"), or a speedup ("2.5x faster", "3 times slower"). Sizes and counts of the design
# ("16 cells", "64 values", "9 query heads", "71.7 MiB at 8192 cells", "at most 25%") are
# not measurements and do not match.
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
    r"(?:\s?(?:tok/s|GB/s|MB/s|TB/s|us|µs|ms|microseconds?|milliseconds?)\b"
    r"|\s?%\s+of\b"
    r"|\s?(?:x|×|times)\s+(?:faster|slower|speedup|quicker)\b)")
BENCH_TABLE = re.compile(r"<!-- bench-table:.*?<!-- /bench-table -->", re.S)


def typed_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) for each measured figure typed in `text`. Snippet lines (`--8<--`)
    and the README's generated bench table are not typed by hand."""
    text = BENCH_TABLE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("--8<--"):
            continue
        found += [(n, m.group(0)) for m in MEASURED.finditer(line)]
    return found


def test_the_figure_rule_tells_measurements_from_design():
    assert [f for _, f in typed_figures("decode 1,059 tok/s; 4.9 us; 93% of resident; 2.5x faster")] == \
        ["1,059 tok/s", "4.9 us", "93% of", "2.5x faster"]
    assert typed_figures("16 cells a block, 64 values, 9 query heads, 71.7 MiB, at most 25% is wasted, 3 x 64") == []
    readme_like = "<!-- bench-table: x -->\n| fp16 | 930 tok/s |\n<!-- /bench-table -->\n12 ms"
    assert typed_figures(readme_like) == [(4, "12 ms")]


def test_no_measured_figure_typed_by_hand():
    """Figures live in files a command wrote (docs/measured/, the README's generated table)
    or in CHANGELOG.md, never typed into README.md or a page."""
    typed = [f"{p.relative_to(ROOT)}:{n}: {fig}" for p in prose_files() for n, fig in typed_figures(p.read_text())]
    assert not typed, "measured figures typed by hand (move them to a generated file or CHANGELOG.md):\n" + "\n".join(typed)


def docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "tools" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_up_to_date():
    """README's bench table equals what tools/docs_tables.py makes from
    docs/measured/bench/bench.json, and each lesson table what it makes from lessons.json."""
    stale = [str(p.relative_to(ROOT)) for p, text in docs_tables().outputs().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"run python tools/docs_tables.py: {stale} are out of date"


def test_the_two_models_table_is_up_to_date():
    """docs/measured/models/two_models.md equals what tools/docs_tables.py makes from the
    default model's file and Gemma 3 270M's. Gemma 3 is fetched only when asked (CI lacks
    it), so where either file is absent there is nothing to make the table from."""
    tables = docs_tables()
    absent = tables.absent_models()
    if absent:
        pytest.skip(f"the two-models table reads model files not fetched here: {', '.join(absent)}")
    stale = [str(p.relative_to(ROOT)) for p, text in tables.model_outputs().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"run python tools/docs_tables.py: {stale} are out of date"


def test_readme_table_comes_from_the_bench_json():
    tables = docs_tables()
    bench = json.loads(tables.BENCH_JSON.read_text())
    table = tables.readme_table(bench)
    assert table in (ROOT / "README.md").read_text()
    row = next(r for r in bench["rows"] if r["depth"] == max(x["depth"] for x in bench["rows"]))
    assert f"| {row['fmt']} {row['mode']} |" in table and tables.rate(row["decode_tok_s"]) in table
    bench["rows"][0]["decode_tok_s"] += 1000  # a changed run changes the table
    assert tables.readme_table(bench) != table


def shell_blocks(page: str) -> list[str]:
    """The text of each ```bash (or sh, console) fenced block of a page."""
    blocks, lang, lines = [], None, []
    for line in page.splitlines():
        if line.strip().startswith("```"):
            if lang is None:
                lang, lines = (line.strip()[3:].split() or ["text"])[0], []
            else:
                if lang in ("bash", "sh", "console"):
                    blocks.append("\n".join(lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


READS = re.compile(r"(?:\$\(cat\s+|(?<![<\w-])<\s*|--text\s+|python\s+)([\w./-]+)")


def files_read(command_text: str) -> list[str]:
    """Files a shell command reads: `$(cat F)`, `< F`, `--text F`, `python F`."""
    return [f for f in READS.findall(command_text) if f != "-m"]


def test_the_command_rule_finds_what_a_command_reads():
    assert files_read('strata-nb run --stats "$(cat long.txt)"') == ["long.txt"]
    assert files_read("strata-nb run --stats < docs/a.txt") == ["docs/a.txt"]
    assert files_read("python tools/x.py --check") == ["tools/x.py"]
    assert files_read("python -m pytest -q") == []


def test_every_shown_command_reads_files_that_exist():
    """The README's and the pages' commands run as written from the repository's root:
    a long-prompt example reads the bundled document, not a long.txt nobody has."""
    missing = []
    for p in prose_files():
        for block in shell_blocks(p.read_text()):
            missing += [f"{p.relative_to(ROOT)}: {f}" for f in files_read(block) if not (ROOT / f).exists()]
    assert not missing, f"commands read files that do not exist: {missing}"


STRATA_1188 = ("verify-window", "host mirror", "k8v4", "non-resident", "repetition", "needle")


def explains_1188(page: str) -> bool:
    """The paragraph of a page's first "Strata #1188" says what that bug was."""
    paragraph = next(par for par in re.split(r"\n\s*\n", page) if "#1188" in par)
    flat = " ".join(paragraph.split())
    return all(word in flat for word in STRATA_1188)


def test_the_1188_rule_needs_the_explanation():
    assert not explains_1188("Generation degenerates (Strata #1188).\n")
    assert explains_1188("That was Strata #1188: in Strata's verify-window batched KV append the host\n"
                         "mirror was skipped for k8v4, cells written to non-resident blocks were lost, and\n"
                         "free generation degenerated into repetition while needle retrieval still passed.\n")


def test_strata_1188_is_explained_where_cited():
    bare = [str(p.relative_to(ROOT)) for p in prose_files() if "#1188" in p.read_text() and not explains_1188(p.read_text())]
    assert not bare, f"Strata #1188 cited without saying what it was: {bare}"
