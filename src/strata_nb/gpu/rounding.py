"""A float32 multiply the compiler never fuses into an add.

The GPU compiler fuses `x * y + z` into one fma, which rounds once where NumPy rounds
twice, so a result at a rounding boundary can differ from the reference (q4_0's codes:
on an H200, 7 of 2,097,152 blocks of normal data did). `mul_rn` is __nv_fmul_rn on a GPU,
a multiply NVVM leaves alone; the simulator is plain Python and never fuses.
"""
from numba import cuda

from strata_nb.gpu.geometry import SIMULATED

if SIMULATED:
    @cuda.jit(device=True)
    def mul_rn(a, b):
        return a * b
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def mul_rn(a, b):
        return libdevice.fmul_rn(a, b)
