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
