"""Write the tables the README and the GPU pages show, from measured data files, so no
figure is typed by hand (tests/test_docs.py checks both are up to date):

- README.md, between its bench-table markers: decode tok/s at each depth and prefill
  tok/s at the deepest, per format and mode, from docs/measured/bench/bench.json
  (the latest `strata-nb bench` run);
- docs/measured/lessons/<id>.md: each "How it got fast" section's before/after figure,
  and docs/measured/lessons/all.md, every figure in one table, from
  docs/measured/lessons.json.

    python tools/docs_tables.py           # rewrite them
    python tools/docs_tables.py --check   # exit 1 if any is out of date
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_JSON = ROOT / "docs" / "measured" / "bench" / "bench.json"
LESSONS_JSON = ROOT / "docs" / "measured" / "lessons.json"
LESSONS_DIR = ROOT / "docs" / "measured" / "lessons"
README = ROOT / "README.md"
START = "<!-- bench-table: written by python tools/docs_tables.py from docs/measured/bench/bench.json -->"
END = "<!-- /bench-table -->"


def rate(x: float) -> str:
    """The bench's own rounding (bench/report.py): whole numbers from 100 up."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def readme_table(bench: dict) -> str:
    """One row per format and mode (then each peer): decode tok/s at every depth, prefill
    tok/s at the deepest."""
    rows = [(f"{r['fmt']} {r['mode']}", r) for r in bench["rows"]]
    rows += [(p["peer"], p) for p in bench.get("peer", []) if "error" not in p]
    depths = sorted({r["depth"] for _, r in rows})
    names = list(dict.fromkeys(name for name, _ in rows))
    by = {(name, r["depth"]): r for name, r in rows}
    deepest = depths[-1]
    head = ["configuration"] + [f"decode tok/s at {d:,}" for d in depths] + [f"prefill tok/s at {deepest:,}"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in names:
        cells = [rate(by[name, d]["decode_tok_s"]) if (name, d) in by else "-" for d in depths]
        cells.append(rate(by[name, deepest]["prefill_tok_s"]) if (name, deepest) in by else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    caption = (f"{bench['model']} on {bench['device']}, medians of {bench['runs']} runs, "
               f"{bench['decode_tokens']} decode tokens a run: `{bench['command']}`")
    return "\n".join([START, "", caption, "", *lines, "", END])


def figure(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def lesson_table(lesson: dict) -> str:
    return "\n".join([
        f"| {lesson['measure']} | {lesson['unit']} |",
        "| --- | ---: |",
        f"| before: {lesson['before_label']} | {figure(lesson['before'])} |",
        f"| after: {lesson['after_label']} | **{figure(lesson['after'])}** |",
        "",
        f"Measured with {lesson['source']}.",
    ]) + "\n"


def all_lessons_table(lessons: list[dict]) -> str:
    lines = ["| section | measure | before | after | unit |", "| --- | --- | ---: | ---: | --- |"]
    for ls in lessons:
        lines.append(f"| [{ls['title']}](#{ls['anchor']}) | {ls['measure']} | "
                     f"{figure(ls['before'])} | {figure(ls['after'])} | {ls['unit']} |")
    return "\n".join(lines) + "\n"


def outputs() -> dict[Path, str]:
    """Every generated file's path and the text it must hold."""
    lessons = json.loads(LESSONS_JSON.read_text())["lessons"]
    out = {LESSONS_DIR / f"{ls['id']}.md": lesson_table(ls) for ls in lessons}
    out[LESSONS_DIR / "all.md"] = all_lessons_table(lessons)
    readme = README.read_text()
    table = readme_table(json.loads(BENCH_JSON.read_text()))
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    assert pattern.search(readme), f"README.md has no {START} ... {END} block"
    out[README] = pattern.sub(lambda _: table, readme)
    return out


def main(argv: list[str]) -> int:
    stale = [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run python tools/docs_tables.py)")
        return 1 if stale else 0
    LESSONS_DIR.mkdir(parents=True, exist_ok=True)
    for p, text in outputs().items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
