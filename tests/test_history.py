"""The docs, the README and the source say what the engine is, not how it got there: no
commit hash, no run date, no "tried and not kept", no path of the machine a figure was
measured on, no script that main does not have. History lives in git and in the commit
messages; CHANGELOG.md is release notes (tests/test_changelog.py).

tools/ holds the product's scripts only: at most six, each run by a test or named by a
page. The lab bench that measured the fast tier's lessons is the `lab-bench` branch, and a
line that names one of its scripts says so."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")  # the pattern
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
HISTORY = re.compile(r"tried and (not kept|dropped)|\blab notebook\b|\bthe notebook\b", re.I)
MACHINE_PATH = re.compile(r"(?<![\w.])/(tmp|root|home)/")
TOOL = re.compile(r"\btools/(\w+\.py)\b")


def read_files() -> list[Path]:
    """Every .md and .py a user reads: the README, docs/ and src/."""
    return [ROOT / "README.md"] + sorted(p for d in ("docs", "src") for p in (ROOT / d).rglob("*")
                                         if p.suffix in (".md", ".py") and p.is_file())


def found(pattern: re.Pattern, text: str) -> list[str]:
    return [f"{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def offenders(pattern: re.Pattern) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{hit}" for p in read_files() for hit in found(pattern, p.read_text())]


def test_the_patterns_catch_what_they_are_for():
    """The negative control: each pattern finds the history it is written against."""
    assert found(HASH, "Measured at commit 7ae7589 on an H100") and not found(HASH, "a 4096-cell cache, dead beef")
    assert found(DATE, "(CHANGELOG.md, 2026-12-03 evening)") and not found(DATE, "256-512 cells")
    assert found(HISTORY, "a DMA copy, tried and not kept") and found(HISTORY, "see the lab notebook")
    assert found(MACHINE_PATH, "--model /tmp/home/x.gguf --out /root/out") and not found(MACHINE_PATH, "a/tmp/b")


def test_no_commit_hash_in_what_a_user_reads():
    bad = offenders(HASH)
    assert not bad, "commit hashes (history belongs in git):\n" + "\n".join(bad)


def test_no_run_date_in_what_a_user_reads():
    bad = offenders(DATE)
    assert not bad, "run dates (history belongs in git):\n" + "\n".join(bad)


def test_no_tried_and_not_kept_in_what_a_user_reads():
    bad = offenders(HISTORY)
    assert not bad, "history in the docs (say it in the commit message):\n" + "\n".join(bad)


def test_no_machine_path_in_what_a_user_reads():
    bad = [hit for hit in offenders(MACHINE_PATH) if not hit.startswith("src/")
           or "'/tmp/" not in hit]  # src may name a path it uses on purpose, quoted
    assert not bad, "a machine's paths (write the command as a reader pastes it):\n" + "\n".join(bad)


def test_every_script_named_is_on_main_or_said_to_be_the_lab_bench_s():
    bad = []
    for p in read_files():
        for n, line in enumerate(p.read_text().splitlines(), 1):
            for script in TOOL.findall(line):
                if not (ROOT / "tools" / script).is_file() and "lab-bench" not in line:
                    bad.append(f"{p.relative_to(ROOT)}:{n}: tools/{script}")
    assert not bad, "scripts main does not have (name the lab-bench branch, or drop them):\n" + "\n".join(bad)


def test_tools_holds_at_most_six_scripts_each_used_by_a_test_or_a_page():
    scripts = sorted(p.name for p in (ROOT / "tools").iterdir() if p.is_file())
    assert len(scripts) <= 6, scripts
    users = [p for p in sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "docs").rglob("*.md"))
             if p.name != "reading-the-code.md" and p != Path(__file__)]  # that page lists them all
    unused = [s for s in scripts if not any(f"tools/{s}" in p.read_text() for p in users)]
    assert not unused, f"scripts no test runs and no page names: {unused}"
