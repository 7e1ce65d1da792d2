"""The default model requantized by llama.cpp's own quantizer to the K-quant files people
download (Q4_K_M, Q5_K_M, Q6_K): made once into the model cache, never kept in git.

llama.cpp's quantizer is `llama_model_quantize`, reached through llama-cpp-python (which
builds llama.cpp from source, as tools/make_llama_fixtures.py's reference runs do). The
files are what `llama-quantize --allow-requantize <Q4_1 file> <out> Q4_K_M` writes: each
tensor dequantized from Q4_1 and quantized again. tests/fixtures/llama_k_quants_meta.json
records each file's SHA-256 as the fixtures' llama.cpp made it; a file made by another
llama.cpp that differs is refused, naming both.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
META = FIXTURES / "llama_k_quants_meta.json"
LOGITS = FIXTURES / "llama_k_quants_logits.npz"
# llama.cpp's llama_ftype for each file: LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q5_K_M, _Q6_K
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
INSTALL = "pip install llama-cpp-python==0.3.36 (it builds llama.cpp from source: minutes)"


def quantize(source: str | Path, out: Path, kind: str, threads: int = 2) -> None:
    """llama.cpp's quantizer: source (any GGUF) -> out in `kind`. Needs llama-cpp-python."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = FTYPES[kind], threads, True
    part = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(part).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {kind}) returned {rc}")
    part.replace(out)


def k_quant_file(kind: str, source: str | Path) -> Path:
    """The default model in `kind`, made once into STRATA_NB_HOME/k-quants/ (a missing
    llama-cpp-python is an ImportError naming the install; a file unlike the fixtures' a
    ValueError)."""
    from strata_nb.model.fetch import cache_dir, sha256

    folder = Path(cache_dir()) / "k-quants"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"SmolLM2-135M-Instruct.{kind}.gguf"
    want = json.loads(META.read_text())["files"][kind]["sha256"] if META.exists() else None
    if not path.exists():
        try:
            quantize(source, path, kind, threads=os.cpu_count() or 2)
        except ImportError:
            raise ImportError(f"the {kind} file is made by llama.cpp's quantizer: {INSTALL}") from None
    got = sha256(path)
    if want is not None and got != want:
        raise ValueError(f"{path} has SHA-256 {got}; the fixtures' llama.cpp made {want} "
                         f"({META.name}): another llama.cpp quantizes differently")
    return path
