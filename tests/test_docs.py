"""The docs build with `mkdocs build --strict`: every included source region exists
(snippets' check_paths) and every link and anchor resolves."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").exists()
