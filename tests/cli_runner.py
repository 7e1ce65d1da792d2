"""The CLI as a user meets it, inside a test: `main(argv)` with its exit code and output."""
import io

import pytest

from strata_nb.cli import main


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    """-> (exit code, stdout, stderr); stdin (with monkeypatch) is what the command reads."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err
