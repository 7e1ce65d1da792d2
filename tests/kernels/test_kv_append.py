"""Each append kernel against its reference, byte for byte, in the pool and the host copy:
windows of 1..8 cells straddling block boundaries, non-resident blocks (pool untouched,
host written), and an absent host copy (host untouched)."""
import numpy as np
import pytest

from strata_nb.kernels.kv.kv_append_fp16 import kv_append_fp16, kv_append_fp16_ref
from strata_nb.kernels.kv.kv_append_q4 import kv_append_q4, kv_append_q4_ref
from strata_nb.kernels.kv.kv_append_q8 import kv_append_q8, kv_append_q8_ref
from strata_nb.kv_layout import BLOCK, pool_arrays

N_KV, HEAD_DIM = 2, 64  # two KV heads: a head's bytes in the other's place show
N_BLOCKS, N_SLOTS = 5, 3
PAGE_TABLE = np.array([1, -1, 0, -1, 2], np.int32)  # blocks 1 and 3 are not resident

# format -> (reference, kernel, the pool fields in the order the writer takes them)
WRITERS = {
    "fp32": (kv_append_fp16_ref, kv_append_fp16, ("k", "v")),
    "fp16": (kv_append_fp16_ref, kv_append_fp16, ("k", "v")),
    "int8": (kv_append_q8_ref, kv_append_q8, ("k_q", "k_s", "v_q", "v_s")),
    "q4_0": (kv_append_q4_ref, kv_append_q4, ("k_q4", "v_q4")),
}
# (first position, cells): each window crosses a block boundary, and every kind of block:
# resident -> not (15, 16), not -> resident (30..32), resident -> not (44..51), and 8
# cells from a non-resident block into the last resident one (60..67).
WINDOWS = [(15, 2), (30, 3), (44, 8), (60, 8), (37, 1)]


def random_bytes(rng, fmt, n_rows):
    """Arrays of every field filled with random bytes, so an untouched byte is visible."""
    return {a.field: rng.integers(0, 256, (n_rows, N_KV, BLOCK, a.per_head * a.dtype.itemsize),
                                  dtype=np.uint8).view(a.dtype)
            for a in pool_arrays(fmt, HEAD_DIM)}


def copies(arrays):
    return {f: a.copy() for f, a in arrays.items()}


def run_writer(writer, fields, k, v, positions, pool, host_k, host_v):
    """Call a writer; the host copy's K-side fields come from host_k, V-side from host_v."""
    side = lambda f: host_k if f.startswith("k") else host_v
    writer(k, v, positions, PAGE_TABLE, *(pool[f] for f in fields), *(side(f)[f] for f in fields))


def assert_same_bytes(a, b, what):
    for f in a:
        assert a[f].tobytes() == b[f].tobytes(), f"{what} {f} differs"


def window(rng, first, n):
    k = rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)
    v = rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)
    return k, v, np.arange(first, first + n, dtype=np.int32)


@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize("first, n", WINDOWS)
def test_kernel_matches_ref_in_pool_and_host(fmt, first, n):
    rng = np.random.default_rng(first * 10 + n)
    ref, kernel, fields = WRITERS[fmt]
    k, v, positions = window(rng, first, n)
    pool0, host0 = random_bytes(rng, fmt, N_SLOTS), random_bytes(rng, fmt, N_BLOCKS)
    pool_ref, host_ref = copies(pool0), copies(host0)
    pool_gpu, host_gpu = copies(pool0), copies(host0)
    run_writer(ref, fields, k, v, positions, pool_ref, host_ref, host_ref)
    run_writer(kernel, fields, k, v, positions, pool_gpu, host_gpu, host_gpu)
    assert_same_bytes(pool_ref, pool_gpu, "pool")
    assert_same_bytes(host_ref, host_gpu, "host copy")

    blocks = set(positions // BLOCK)
    for f in fields:
        for b in range(N_BLOCKS):  # the host copy changes exactly in the window's blocks
            assert (host_gpu[f][b].tobytes() != host0[f][b].tobytes()) == (b in blocks)
        for slot in range(N_SLOTS):  # a slot changes only if a window block lives there
            owner = int(np.flatnonzero(PAGE_TABLE == slot)[0])
            assert (pool_gpu[f][slot].tobytes() != pool0[f][slot].tobytes()) == (owner in blocks)


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_host_absent_leaves_host_untouched_and_still_writes_the_pool(fmt):
    """Absent = a size-0 K-side host array. The V side is a real array here, and still
    untouched: presence is tested on the K side only (the rule k8v4's folding is for)."""
    rng = np.random.default_rng(7)
    ref, kernel, fields = WRITERS[fmt]
    k, v, positions = window(rng, 14, 5)
    absent = {f: np.empty((0,), a.dtype) for f, a in random_bytes(rng, fmt, 0).items()}
    pool0, host0 = random_bytes(rng, fmt, N_SLOTS), random_bytes(rng, fmt, N_BLOCKS)
    results = []
    for writer in (ref, kernel):
        pool, host_v = copies(pool0), copies(host0)
        run_writer(writer, fields, k, v, positions, pool, absent, host_v)
        assert_same_bytes(host_v, host0, "host copy")
        results.append(pool)
    assert_same_bytes(*results, "pool")
    assert results[1][fields[0]][1].tobytes() != pool0[fields[0]][1].tobytes()  # block 0 -> slot 1 written


@pytest.mark.parametrize("fmt", ["int8", "q4_0"])
def test_values_that_are_not_ordinary_byte_for_byte(fmt):
    """The quantizing writers run their own device code (a warp per group, its max a
    warp_max): NaN, +-inf, values past fp16, tiny values, an all-zero head, zeros led by
    -0.0, ties for the largest |x| and exact halves between codes give the reference's
    bytes. (fp16 stores NaN as it is, and a
    GPU's NaN need not have NumPy's bits.)"""
    rng = np.random.default_rng(9)
    ref, kernel, fields = WRITERS[fmt]
    k, v, positions = window(rng, 30, 3)
    k[0, 0, :6] = [np.nan, np.inf, -np.inf, 1e30, -3e-39, 2.0 ** -125]
    v[1, 0] = 0.0  # a whole head of zeros: scale 0, codes 0
    v[2, 1, :4] = [127.0, 63.5, -0.5, 1.5]  # max 127 -> scale 1: halves round to even
    v[0, 1] = 0.0
    v[0, 1, 0] = -0.0  # a block of zeros led by -0.0: q4_0's big keeps its sign, so d = +0.0
    k[2, 1, :34] = 2.0
    k[2, 1, 5] = -2.0  # ties for the largest |x|: q4_0's big is the first of them (+2)
    k[2, 1, 32] = -2.0  # ... and in the second block a -2 before a +2
    pool0, host0 = random_bytes(rng, fmt, N_SLOTS), random_bytes(rng, fmt, N_BLOCKS)
    results = []
    for writer in (ref, kernel):
        pool, host = copies(pool0), copies(host0)
        run_writer(writer, fields, k, v, positions, pool, host, host)
        results.append((pool, host))
    assert_same_bytes(results[0][0], results[1][0], "pool")
    assert_same_bytes(results[0][1], results[1][1], "host copy")
