"""Tensor cores from Numba: one warp-wide matrix product, D = A B + C on a 16 x 8 tile, in
float32. No plain twin: the plain kernels multiply with one FMA a product
(kernels/dense/matmul.py); the fast kernels built on this one are held to them.

A tensor core multiplies small matrices held in the registers of a whole warp. Numba has
no function for it, so this module emits the PTX instruction itself (as
fast/dependent_launch.py does for its two), `mma.sync.aligned.m16n8k8` on TF32 values:

    D (16 x 8) = A (16 x 8) @ B (8 x 8) + C (16 x 8), every value float32

No lane holds a whole matrix: each of the 32 lanes holds a few values of each, its
*fragment*, at places the PTX manual fixes. With g = lane // 4 (the lane's group) and
t = lane % 4 (its place in the group):

    A   a0 = A[g, t]      a1 = A[g + 8, t]      a2 = A[g, t + 4]      a3 = A[g + 8, t + 4]
    B   b0 = B[t, g]      b1 = B[t + 4, g]
    C   c0 = C[g, 2t]     c1 = C[g, 2t + 1]     c2 = C[g + 8, 2t]     c3 = C[g + 8, 2t + 1]

and D comes back in C's places. So a row of C or D lies in the 4 lanes of one group, 2
values each: a row's max or sum is a reduction over those 4 (gpu/reduce.py: quad_max,
quad_sum). `fragment_places` is the same table as code, for the simulator and the tests.

TF32 is float32 cut to 10 bits of mantissa (float16's precision, float32's range). One
TF32 product would move attention's scores by ~1e-3 of their size, far outside the
kernels' float32 tolerance (kernels/attention/attention.py). So `mma_f32` makes each
product from three: x = hi + lo with hi = x rounded to TF32 and lo = the rest rounded to
TF32, then

    a b ~= a_hi b_hi + a_hi b_lo + a_lo b_hi

(a_lo b_lo is below float32's precision). That keeps float32's accuracy at three times
the tensor work, which is still far less time than the CUDA cores' fused multiply-adds.

The contract, as the warp reductions': all 32 lanes of every warp of the block call it at
the same point (`.sync.aligned`: the warp executes it together). Under Numba's CUDA
simulator, which has no tensor cores and no warp intrinsics, the lanes trade their
fragments through shared memory behind a block-wide barrier and each lane works out its
part of D from the warp's whole A, B and C in float64, summed in a fixed order (so a
row's result never depends on the other rows): the products of two float32 values are
exact there, so the simulated D is the exact one rounded once. The GPU's three TF32
products agree with it to float32's precision, not bit for bit.

Needs compute capability 8.0 (`available`); the kernels that use it check first. Prompt
chunks use them (the matmul, fast/matmul_mma.py; the attention,
fast/attention_prefill_mma.py) on every GPU that has them (`enabled`).
Under the simulator, whose emulation above is slow, the plain kernels run unless a test
turns them on (`_ON`).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.geometry import SIMULATED
from strata_nb.gpu.reduce import MAX_THREADS, WARP

TILE_M, TILE_N, TILE_K = 16, 8, 8  # D is TILE_M x TILE_N; A's rows and B's columns are TILE_K long
MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: mma.sync on TF32, and cvt.rna.tf32.f32


# --8<-- [start:fragment_places]
def fragment_places(lane: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """Where lane's registers sit in A, B and C (or D): (row, column) per register."""
    g, t = lane // 4, lane % 4
    return {"a": ((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)),
            "b": ((t, g), (t + 4, g)),
            "c": ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))}
# --8<-- [end:fragment_places]


PLACES = [fragment_places(lane) for lane in range(WARP)]
# (32, registers) row and column indices of every lane's registers, per matrix
_INDEX = {m: tuple(np.array([[place[i] for place in p[m]] for p in PLACES]) for i in (0, 1)) for m in "abc"}


def mma_ref(fragments: np.ndarray) -> np.ndarray:
    """(32, 10) float32: each lane's a0..a3, b0, b1, c0..c3 -> (32, 4) float32, each lane's
    d0..d3 of D = A @ B + C. Products and sums in float64, k in order, rounded once."""
    f = np.asarray(fragments, np.float64)
    a, b, d = np.zeros((TILE_M, TILE_K)), np.zeros((TILE_K, TILE_N)), np.zeros((TILE_M, TILE_N))
    a[_INDEX["a"]], b[_INDEX["b"]], d[_INDEX["c"]] = f[:, 0:4], f[:, 4:6], f[:, 6:10]
    for k in range(TILE_K):  # elementwise, one k at a time: each value of D summed the same way
        d += a[:, k, None] * b[None, k, :]
    return d[_INDEX["c"]].astype(np.float32)


# One value a process: cells computed on tensor cores and on the CUDA cores differ in
# their last bits, so a process must not switch between them mid-cache.
_ON = not SIMULATED


def enabled() -> bool:
    """Whether prompt chunks run their matmuls and attention on tensor cores where they
    can (on a GPU; under the simulator where a test asks)."""
    return _ON


def available(device=None) -> str:
    """'' when the tensor-core kernels can run on the current device (or under the
    simulator), else why not."""
    if SIMULATED:
        return ""
    cc = (device or cuda.get_current_device()).compute_capability
    if tuple(cc) < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {cc[0]}.{cc[1]} has no TF32 tensor cores (8.0 and up)"
    return ""


if not SIMULATED:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    # --8<-- [start:mma_instructions]
    @intrinsic
    def to_tf32(typingctx, x):
        """cvt.rna.tf32.f32: x rounded to TF32 (nearest, ties away from zero), as a float32
        whose low 13 mantissa bits are zero."""
        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            cvt = ir.InlineAsm(ir.FunctionType(i32, [ir.FloatType()]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.bitcast(builder.call(cvt, [args[0]], attrs=("readnone", "nounwind")), ir.FloatType())
        return types.float32(types.float32), codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: this lane's (d0, d1, d2, d3).
        The a and b values are TF32 (to_tf32's), passed as the 32-bit registers they are."""
        f32, i32 = ir.FloatType(), ir.IntType(32)
        out = ir.LiteralStructType([f32] * 4)
        asm = ir.InlineAsm(ir.FunctionType(out, [i32] * 6 + [f32] * 4),
                           "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")

        def codegen(context, builder, signature, args):
            bits = [builder.bitcast(v, i32) for v in args[:6]]
            # convergent: the whole warp runs it together, so no pass may move it under a branch
            d = builder.call(asm, bits + list(args[6:]), attrs=("convergent", "nounwind"))
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(d, i) for i in range(4)])
        return types.UniTuple(types.float32, 4)(*([types.float32] * 10)), codegen
    # --8<-- [end:mma_instructions]

    # --8<-- [start:mma_f32]
    @cuda.jit(device=True)
    def split_tf32(x):
        """x = hi + lo, both TF32: hi keeps x's top 11 bits, lo the next 11."""
        hi = to_tf32(x)
        return hi, to_tf32(x - hi)

    @cuda.jit(device=True)
    def mma_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """This lane's (d0, d1, d2, d3) of D = A B + C, from its fragments (the table at the
        top), to float32's precision: three TF32 products, the small ones first."""
        a0h, a0l = split_tf32(a0)
        a1h, a1l = split_tf32(a1)
        a2h, a2l = split_tf32(a2)
        a3h, a3l = split_tf32(a3)
        b0h, b0l = split_tf32(b0)
        b1h, b1l = split_tf32(b1)
        d0, d1, d2, d3 = mma_tf32(a0l, a1l, a2l, a3l, b0h, b1h, c0, c1, c2, c3)
        d0, d1, d2, d3 = mma_tf32(a0h, a1h, a2h, a3h, b0l, b1l, d0, d1, d2, d3)
        return mma_tf32(a0h, a1h, a2h, a3h, b0h, b1h, d0, d1, d2, d3)
    # --8<-- [end:mma_f32]
else:
    # Under the simulator: plain Python run by each simulated thread, trading fragments as
    # gpu/reduce.py's exchange trades values (a thread-local scratch, two rows taken in
    # turn, one barrier).
    from strata_nb.gpu.reduce import first_ask

    _lanes = threading.local()  # .scratch: the block's shared array; .count: products so far

    @cuda.jit(device=True)
    def mma_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if getattr(_lanes, "owner", None) is not cuda.threadIdx:  # this CUDA thread's first (gpu/reduce.py)
            with first_ask:  # one array for the block (gpu/reduce.py says why)
                _lanes.scratch = cuda.shared.array((2, MAX_THREADS, 10), float32)
            _lanes.count, _lanes.owner = 0, cuda.threadIdx
        t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        row = _lanes.count % 2
        _lanes.count += 1
        _lanes.scratch[row, t] = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        cuda.syncthreads()  # the warp's fragments are all written
        first = t - t % WARP
        d = mma_ref(_lanes.scratch[row, first:first + WARP])[t % WARP]
        return float32(d[0]), float32(d[1]), float32(d[2]), float32(d[3])
