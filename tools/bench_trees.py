"""Source trees benched side by side on one machine: the way to time a change whose effect
shows only in a whole decode step (a kernel's occupancy, when the next kernel may start),
where `kernel_ab.py`, which times one kernel alone, cannot see it.

Here, with git: each tree is a revision's `src/`, with files swapped in from other
revisions or from files on disk, written to .cache/trees/NAME/src.

    python tools/bench_trees.py prepare head=HEAD old=3215a5c \\
        'oldmerge=HEAD+src/strata_nb/kernels/attention/attention_step.py@3215a5c' \\
        'try=HEAD+src/strata_nb/kernels/attention/attention_step.py=path/to/variant.py'

There (a GPU machine, no git needed; carry .cache/trees): each tree's `strata-nb bench` in
turn, the trees alternated for --rounds rounds, then one table of decode tok/s (and
prefill tok/s) per bench row, a column per (tree, round).

    python tools/bench_trees.py run head old oldmerge --rounds 2 -- \\
        --model shapes.gguf --formats fp16,k8v4 --streamed-formats= --depths 1024,8192 \\
        --runs 3 --decode-tokens 64 --check-tokens 0 --no-peer --no-profile

Each tree runs in its own process with its `src` first on PYTHONPATH, so it compiles its
own kernels (the kernel cache is keyed on the package's sources). The bench folders are
left in --out (default /tmp/bench_trees), one per (tree, round).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ROOT / ".cache" / "trees"


def parse_spec(spec: str) -> tuple[str, str, list[tuple[str, str, str]]]:
    """'name=REV[+PATH@REV2][+PATH=FILE]...' -> (name, rev, [(path, 'rev' or 'file', source)])."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"bench_trees: {spec!r} is not NAME=REV[+PATH@REV][+PATH=FILE]")
    rev, *swaps = rest.split("+")
    out = []
    for swap in swaps:
        if "=" in swap:
            path, _, source = swap.partition("=")
            out.append((path, "file", source))
        elif "@" in swap:
            path, _, source = swap.partition("@")
            out.append((path, "rev", source))
        else:
            raise SystemExit(f"bench_trees: swap {swap!r} in {spec!r} is not PATH@REV or PATH=FILE")
    return name, rev, out


def git(*args: str) -> bytes:
    run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
    if run.returncode:
        raise SystemExit(f"bench_trees: git {' '.join(args)}: {run.stderr.decode().strip()}")
    return run.stdout


def prepare(specs: list[str], trees: Path = TREES) -> list[Path]:
    """Write each spec's tree under trees/NAME/src; return the tree folders."""
    made = []
    for spec in specs:
        name, rev, swaps = parse_spec(spec)
        tree = trees / name
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = git("archive", rev, "src")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for path, kind, source in swaps:
            if not (tree / path).is_file():
                raise SystemExit(f"bench_trees: {path} is not a file of {rev}'s tree")
            if kind == "file" and not Path(source).is_file():
                raise SystemExit(f"bench_trees: {source} (to swap in for {path}) is not a file")
            data = git("show", f"{source}:{path}") if kind == "rev" else Path(source).read_bytes()
            (tree / path).write_bytes(data)
        made.append(tree)
        print(f"{name}: {rev}" + "".join(f", {p} from {s}" for p, _, s in swaps) + f" -> {tree}")
    return made


def rows_of(bench_json: Path) -> dict:
    """{(configuration, depth): (prefill tok/s, decode tok/s)} from a bench.json."""
    data = json.loads(bench_json.read_text())
    out = {}
    for r in data["rows"]:  # the mode names the streaming, expert cache and verify window
        out[(f"{r['fmt']} {r['mode']}", r["depth"])] = (r["prefill_tok_s"], r["decode_tok_s"])
    return out


def table(results: dict) -> str:
    """Markdown: a row per (configuration, depth), a decode column per (tree, round), then
    the prefill columns. results: {column label: rows_of(...)}."""
    keys = []
    for rows in results.values():
        keys += [k for k in rows if k not in keys]
    labels = list(results)
    head = "| configuration | depth | " + " | ".join(f"decode {c}" for c in labels) + " | " + \
        " | ".join(f"prefill {c}" for c in labels) + " |"
    lines = [head, "| --- | ---: |" + " ---: |" * (2 * len(labels))]
    for k in keys:
        dec = [f"{results[c][k][1]:,.0f}" if k in results[c] else "-" for c in labels]
        pre = [f"{results[c][k][0]:,.0f}" if k in results[c] else "-" for c in labels]
        lines.append(f"| {k[0]} | {k[1]:,} | " + " | ".join(dec + pre) + " |")
    return "\n".join(lines)


def run(names: list[str], rounds: int, bench_args: list[str], out: Path, trees: Path = TREES,
        python: str = sys.executable) -> str:
    """Each tree's bench in turn, rounds times; returns the table (also printed)."""
    missing = [n for n in names if not (trees / n / "src").is_dir()]
    if missing:
        raise SystemExit(f"bench_trees: no tree {', '.join(missing)} under {trees} (prepare it, and carry .cache/trees)")
    results = {}
    for r in range(1, rounds + 1):
        for name in names:
            folder = out / f"{name}_{r}"
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(trees / name / "src")] +
                                                [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            cmd = [python, "-m", "strata_nb.cli", "bench", *bench_args, "--out", str(folder)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}_{r}.log").write_text(done.stdout + done.stderr)
            if done.returncode:
                print(f"{name}, round {r}: the bench failed (exit {done.returncode}); see {out}/{name}_{r}.log",
                      file=sys.stderr)
                continue
            label = f"{name}" if rounds == 1 else f"{name} ({r})"
            results[label] = rows_of(folder / "bench.json")
            print(f"{label}: done", flush=True)
    text = table(results)
    print(text)
    return text


def main(argv: list[str]) -> int:
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="write .cache/trees/NAME/src for each NAME=REV[+PATH@REV][+PATH=FILE]")
    p.add_argument("specs", nargs="+")
    r = sub.add_parser("run", help="bench each tree in turn (bench arguments after --)")
    r.add_argument("names", nargs="+")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--out", type=Path, default=Path("/tmp/bench_trees"))
    args = ap.parse_args(argv)
    if args.verb == "prepare":
        prepare(args.specs)
    else:
        if args.rounds < 1:
            raise SystemExit("bench_trees: --rounds must be at least 1")
        run(args.names, args.rounds, bench_args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
