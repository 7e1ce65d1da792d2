"""Test setup. Numba picks the CUDA simulator or a real GPU when it is first imported,
so the choice is made here, before any test module imports numba.

STRATA_NB_GPU=1 runs the same kernel tests on a real GPU (larger shapes); otherwise the
simulator runs them on the CPU with small shapes.
"""
import os
import sys

ON_GPU = os.environ.get("STRATA_NB_GPU") == "1"
if not ON_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # The simulator runs each CUDA thread as a Python thread; switching often makes it
    # about 7x faster on small grids.
    sys.setswitchinterval(1e-4)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF, fetched into the cache (STRATA_NB_HOME) on first use."""
    from strata_nb.model.fetch import ensure_default_model

    return str(ensure_default_model(progress=False))


_engines: dict = {}


@pytest.fixture(scope="session")
def engine_for(default_model_path):
    """engine_for(kv="fp16", **settings) -> a cached Engine on the numpy backend."""
    from strata_nb import Engine

    def make(kv="fp16", **kw):
        key = (kv, tuple(sorted(kw.items())))
        if key not in _engines:
            _engines[key] = Engine.load(model=default_model_path, kv=kv, device="cpu", **kw)
        return _engines[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random-weight llama GGUF (byte-level vocab): fast CLI and error tests."""
    from strata_nb.model.synthetic import write_synthetic_gguf

    return str(write_synthetic_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))
