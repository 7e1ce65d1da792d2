"""The attention tests' cache and queries: a pool and host copy of garbage written
through the one writer, the selections, and a runner that starts from NaN."""
import numpy as np
import pytest
from numba import config, cuda

from strata_nb.kernels.attention.attention import ATOL, RTOL, attention_ref
from strata_nb.kernels.kv.hadamard import hadamard_ref
from strata_nb.kernels.kv.kv_append_fp16 import kv_append_fp16_ref
from strata_nb.kernels.kv.kv_append_k8v4 import kv_append_k8v4_ref
from strata_nb.kernels.kv.kv_append_q4 import kv_append_q4_ref
from strata_nb.kernels.kv.kv_append_q8 import kv_append_q8_ref
from strata_nb.kv_layout import BLOCK, pool_arrays
from strata_nb.kv_layout import all_blocks_upto

# The simulator runs every CUDA thread as a Python thread: 4 query heads on 2 KV heads
# there (still GQA), the default model's 9 on 3 on a GPU.
N_HEADS, N_KV = (4, 2) if config.ENABLE_CUDASIM else (9, 3)
HEAD_DIM = 64
N_BLOCKS = 6
PAGE_TABLE = np.array([2, -1, 0, 3, -1, 1], np.int32)  # blocks 1 and 4 are read from the host copy
WRITTEN = 91  # cells 0..90 are written; 91..95 of block 5 hold garbage no query may read

# n queries -> (q_pos, selected blocks with -1 padding). Every query's own block is
# selected and cut inside by its position; 83..90 is a verify window of 8.
QUERIES = {
    1: ([90], [[0, 5, -1, 4]]),
    3: ([37, 77, 90], [[2, -1, 0], [4, 1, -1], [5, 3, 1]]),
    8: (list(range(83, 91)), [[5, b, -1] for b in (0, 1, 3, 4, 0, 1, 3, 4)]),
}


# The kernels read whole blocks, the unwritten cells after a query included (never
# weighted), and these pools hold random bytes there: an inf or NaN scale times a code.
# Under the simulator the readers' arithmetic is NumPy's, which warns on 0 * inf; a GPU
# makes the same NaN silently. Each attention test module sets `pytestmark = GARBAGE_READS`.
GARBAGE_READS = pytest.mark.filterwarnings("ignore:invalid value encountered in scalar multiply:RuntimeWarning")


def garbage(rng, n_rows, fmt):
    """Random bytes in every field: NaN and inf included, for unwritten cells to hide."""
    return {a.field: rng.integers(0, 256, (n_rows, N_KV, BLOCK, a.per_head * a.dtype.itemsize),
                                  dtype=np.uint8).view(a.dtype)
            for a in pool_arrays(fmt, HEAD_DIM)}


def append_ref(fmt, k, v, positions, page_table, pool, host):
    if fmt in ("fp32", "fp16"):
        kv_append_fp16_ref(k, v, positions, page_table, pool["k"], pool["v"], host["k"], host["v"])
    elif fmt == "int8":
        kv_append_q8_ref(k, v, positions, page_table, *(pool[f] for f in ("k_q", "k_s", "v_q", "v_s")),
                         *(host[f] for f in ("k_q", "k_s", "v_q", "v_s")))
    elif fmt == "q4_0":
        kv_append_q4_ref(k, v, positions, page_table, pool["k_q4"], pool["v_q4"], host["k_q4"], host["v_q4"])
    else:
        kv_append_k8v4_ref(k, v, positions, page_table, pool, host)


def filled_cache(fmt, page_table, n_slots, seed=0):
    """A pool and host copy of garbage, then cells 0..WRITTEN-1 through the one writer."""
    rng = np.random.default_rng(seed)
    pool, host = garbage(rng, n_slots, fmt), garbage(rng, N_BLOCKS, fmt)
    k = rng.standard_normal((WRITTEN, N_KV, HEAD_DIM), np.float32)
    v = rng.standard_normal((WRITTEN, N_KV, HEAD_DIM), np.float32)
    append_ref(fmt, k, v, np.arange(WRITTEN, dtype=np.int32), page_table, pool, host)
    return pool, host


def queries(n, seed=1):
    q_pos, blocks = QUERIES[n]
    q = np.random.default_rng(seed).standard_normal((n, N_HEADS, HEAD_DIM), np.float32)
    return q, np.array(q_pos, np.int32), np.array(blocks, np.int32)


def run(attend, fmt, q, q_pos, blocks, page_table, pool, host):
    out = np.full(q.shape, np.nan, np.float32)
    attend(fmt, q, q_pos, blocks, page_table, pool, host, out)
    return out


def mapped_copy(a):
    m = cuda.mapped_array(a.shape, a.dtype)
    m[...] = a
    return m


def check_rotate_out(attend, q_pos=np.arange(WRITTEN - 5, WRITTEN, dtype=np.int32)):
    """rotate_out applies H where the output is written (the plain kernel's launcher, the
    step kernel's merging block, or after the prompt kernel's combine): the same bits as
    hadamard_ref on the output, and the reference agrees within the tolerance. attend: a
    launcher with attention's arguments."""
    blocks = all_blocks_upto(q_pos)
    q = np.random.default_rng(4).standard_normal((len(q_pos), N_HEADS, HEAD_DIM), np.float32)
    pool, host = filled_cache("k8v4", PAGE_TABLE, n_slots=4)
    args = ("k8v4", q, q_pos, blocks, PAGE_TABLE, pool, host)
    plain = run(attend, *args)
    rotated = run(lambda *a: attend(*a, rotate_out=True), *args)
    np.testing.assert_array_equal(rotated, hadamard_ref(plain))
    want = run(lambda *a: attention_ref(*a, rotate_out=True), *args)
    np.testing.assert_allclose(rotated, want, atol=ATOL, rtol=RTOL)
