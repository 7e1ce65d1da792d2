"""tools/bench_trees.py: trees made from revisions with files swapped in, benched in
alternating rounds, and one table of their rows. The bench itself is a stand-in here: a
script that writes the bench.json the real one would, from the tree it was run in."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_trees", ROOT / "tools" / "bench_trees.py")
bench_trees = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_trees)

def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository of two commits, src/a.py "one" then "two", beside src/b.py."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    git(repo, "init", "-q")
    for text in ("one", "two"):
        (repo / "src" / "a.py").write_text(text)
        (repo / "src" / "b.py").write_text("b")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", text)
    monkeypatch.setattr(bench_trees, "ROOT", repo)
    return repo


def test_a_tree_is_a_revision_with_files_swapped_in(repo, tmp_path):
    variant = tmp_path / "variant.py"
    variant.write_text("a variant")
    trees = bench_trees.prepare(["head=HEAD", "old=HEAD~1", "back=HEAD+src/a.py@HEAD~1",
                                 f"try=HEAD+src/a.py={variant}"], trees=tmp_path / "trees")
    assert [(t / "src" / "a.py").read_text() for t in trees] == ["two", "one", "one", "a variant"]
    assert all((t / "src" / "b.py").read_text() == "b" for t in trees)


@pytest.mark.parametrize("bad", ["noequals", "x=", "x=HEAD+nothing"])
def test_a_spec_that_says_nothing_clear_is_refused(bad):
    with pytest.raises(SystemExit, match="bench_trees"):
        bench_trees.parse_spec(bad)


def test_a_swapped_path_must_be_a_file_of_the_tree(repo, tmp_path):
    with pytest.raises(SystemExit, match="not a file"):
        bench_trees.prepare(["x=HEAD+src/c.py@HEAD"], trees=tmp_path / "trees")
    with pytest.raises(SystemExit, match="missing.py .to swap in for src/a.py. is not a file"):
        bench_trees.prepare([f"x=HEAD+src/a.py={tmp_path / 'missing.py'}"], trees=tmp_path / "trees")
    with pytest.raises(SystemExit, match="git archive nope"):
        bench_trees.prepare(["x=nope"], trees=tmp_path / "trees")


STAND_IN = """
import json, os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
tree = os.environ["PYTHONPATH"].split(os.pathsep)[0]
rate = float(Path(tree, "rate.txt").read_text())
with open(Path(out).parent / "order.txt", "a") as f:
    f.write(Path(tree).parent.name + "\\n")
rows = [dict(fmt="fp16", mode="resident", depth=d, prefill_tok_s=10.0 * d, decode_tok_s=rate - d) for d in (1, 1024)]
json.dump(dict(rows=rows), open(out / "bench.json", "w"))
"""


def test_the_trees_run_in_alternating_rounds_into_one_table(tmp_path):
    trees = tmp_path / "trees"
    for name, rate in (("old", 900), ("new", 1000)):
        (trees / name / "src").mkdir(parents=True)
        (trees / name / "src" / "rate.txt").write_text(str(rate))
    # run as `PYTHON -m strata_nb.cli bench ARGS`: the stand-in drops "-m strata_nb.cli bench"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nshift 3\nexec {sys.executable} {tmp_path / 'stand_in.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    out = tmp_path / "out"
    text = bench_trees.run(["old", "new"], 2, ["--depths", "1,1024"], out, trees=trees, python=str(fake))
    assert (out / "order.txt").read_text().split() == ["old", "new", "old", "new"]
    lines = text.splitlines()
    assert lines[0].startswith("| configuration | depth | decode old (1) | decode new (1) | decode old (2)")
    assert lines[2] == "| fp16 resident | 1 | 899 | 999 | 899 | 999 | 10 | 10 | 10 | 10 |"
    assert lines[3] == "| fp16 resident | 1,024 | -124 | -24 | -124 | -24 | 10,240 | 10,240 | 10,240 | 10,240 |"


def test_a_tree_not_prepared_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no tree gone"):
        bench_trees.run(["gone"], 1, [], tmp_path / "out", trees=tmp_path / "trees")


def test_a_bench_that_fails_is_said_and_left_out(tmp_path, capsys):
    (tmp_path / "trees" / "bad" / "src").mkdir(parents=True)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    text = bench_trees.run(["bad"], 1, [], tmp_path / "out", trees=tmp_path / "trees", python=str(fake))
    assert "the bench failed (exit 3)" in capsys.readouterr().err
    assert "broken" in (tmp_path / "out" / "bad_1.log").read_text()
    assert len(text.splitlines()) == 2  # the header only
