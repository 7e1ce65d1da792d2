"""kv_hybrid_parity: k8v4's two folded halves, kernels against references, byte for byte
in the VRAM pool and in the host copy; and a negative control that unfolds the V half
and must be caught."""
import numpy as np
import pytest
from numba import cuda

from strata_nb.kernels.kv.key_sketch import key_sketch_ref, sketch_shape
from strata_nb.kernels.kv.kv_append_k8v4 import kv_append_k8v4, kv_append_k8v4_ref
from strata_nb.kv_layout import BLOCK, pool_arrays

# Each test takes seconds under the simulator. The default tier keeps the kernel against its
# reference and the negative control (the #1188 class: an unfolded V half loses the host
# copy of V); the slow tier adds the device-pool, key-sketch and absent-host cases.

N_KV, HEAD_DIM = 2, 64  # two KV heads: a head's bytes in the other's place show
N_BLOCKS, N_SLOTS = 4, 2
PAGE_TABLE = np.array([0, -1, 1, -1], np.int32)  # blocks 1 and 3 are streamed out
WINDOWS = [(12, 8), (30, 3), (47, 1), (50, 6)]  # straddling, and landing in every block


def empty_arrays(n_rows):
    return {a.field: np.zeros((n_rows, N_KV, BLOCK, a.per_head), a.dtype)
            for a in pool_arrays("k8v4", HEAD_DIM)}


def mapped_zeros(a):
    """Pinned host memory the GPU reads and writes in place, as the cuda backend's host copy."""
    m = cuda.mapped_array(a.shape, a.dtype)
    m[...] = 0
    return m


def host_bytes(a):
    """A NumPy copy of a mapped array (on a GPU a NumPy array itself, whose copy_to_host()
    numba-cuda 0.30 cannot run; under the simulator a device array)."""
    return np.array(a) if isinstance(a, np.ndarray) else a.copy_to_host()


def append_windows(append, with_host=True, on_device=False, windows=WINDOWS, **kwargs):
    """Run the writer over every window; -> (pool, host or None, written positions).
    on_device: the pool as device arrays and the host copy mapped, as the cuda backend
    holds them (returned as NumPy copies)."""
    rng = np.random.default_rng(0)
    pool, host = empty_arrays(N_SLOTS), empty_arrays(N_BLOCKS) if with_host else None
    if on_device:
        pool = {f: cuda.to_device(a) for f, a in pool.items()}
        host = {f: mapped_zeros(a) for f, a in host.items()}
    written = []
    for first, n in windows:
        positions = np.arange(first, first + n, dtype=np.int32)
        k = rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)
        v = rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)  # unrotated: the V half rotates it
        append(k, v, positions, PAGE_TABLE, pool, host, **kwargs)
        written.extend(positions)
    if on_device:
        cuda.synchronize()  # kernels run asynchronously; mapped memory is read directly
        pool = {f: a.copy_to_host() for f, a in pool.items()}
        host = {f: host_bytes(a) for f, a in host.items()}
    return pool, host, np.array(written)


# --8<-- [start:kv_hybrid_parity]
def assert_parity(pool_a, host_a, pool_b, host_b):
    """Two cache states are the same bytes, field by field, in the pool and the host copy."""
    for f in pool_a:
        assert pool_a[f].tobytes() == pool_b[f].tobytes(), f"pool {f} differs"
        assert host_a[f].tobytes() == host_b[f].tobytes(), f"host copy {f} differs"


def assert_host_mirrors_pool(pool, host):
    """The one-writer invariant: every resident block's slot equals its host-copy block."""
    for b in np.flatnonzero(PAGE_TABLE >= 0):
        for f in pool:
            assert pool[f][PAGE_TABLE[b]].tobytes() == host[f][b].tobytes(), \
                f"block {b}: slot {PAGE_TABLE[b]} {f} is not in the host copy"


def test_folded_halves_kernel_matches_ref():
    pool_ref, host_ref, _ = append_windows(kv_append_k8v4_ref)
    pool_gpu, host_gpu, written = append_windows(kv_append_k8v4)
    assert_parity(pool_ref, host_ref, pool_gpu, host_gpu)
    assert_host_mirrors_pool(pool_gpu, host_gpu)
    for p in written:  # every written cell reached the host copy, K and V
        b, c = divmod(p, BLOCK)
        assert host_gpu["k_s"][b, :, c].all() and host_gpu["v_q4"][b, :, c].any()


@pytest.mark.slow
def test_folded_halves_on_device_pool_and_mapped_host():
    pool_ref, host_ref, _ = append_windows(kv_append_k8v4_ref)
    assert_parity(pool_ref, host_ref, *append_windows(kv_append_k8v4, on_device=True)[:2])


def test_unfolded_v_half_loses_the_host_copy_of_v():
    """Negative control: only the V-side host array for the V half. The K-side presence
    test finds no host copy, and V never reaches it: the checks above must fail."""
    pool_ref, host_ref, _ = append_windows(kv_append_k8v4_ref)
    pool_bad, host_bad, written = append_windows(kv_append_k8v4, fold_v_half=False)

    assert not host_bad["v_q4"].any()  # no V byte reached the host copy...
    resident = [p for p in written if PAGE_TABLE[p // BLOCK] >= 0]
    for p in resident:  # ...while the pool holds V for the resident cells
        b, c = divmod(p, BLOCK)
        assert pool_bad["v_q4"][PAGE_TABLE[b], :, c].any()
    assert host_bad["k_q"].tobytes() == host_ref["k_q"].tobytes()  # K, folded, is fine

    with pytest.raises(AssertionError, match="host copy v_q4 differs"):
        assert_parity(pool_ref, host_ref, pool_bad, host_bad)
    with pytest.raises(AssertionError, match="v_q4 is not in the host copy"):
        assert_host_mirrors_pool(pool_bad, host_bad)
# --8<-- [end:kv_hybrid_parity]


@pytest.mark.slow
def test_key_sketch_in_the_append_launch():
    """With QSA the launch also writes K's key sketch: the same bytes as key_sketch_ref
    after the append, and the append's own bytes unchanged."""
    want, got = (np.zeros(sketch_shape(N_BLOCKS, N_KV, HEAD_DIM), np.uint8) for _ in range(2))
    pool_ref, host_ref, _ = append_windows(kv_append_k8v4_ref, sketch=want)
    assert_parity(pool_ref, host_ref, *append_windows(kv_append_k8v4, sketch=got)[:2])
    assert want.tobytes() == got.tobytes()
    rng, alone = np.random.default_rng(0), np.zeros_like(want)  # the same K, through key_sketch_ref alone
    for first, n in WINDOWS:
        k = rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)
        rng.standard_normal((n, N_KV, HEAD_DIM), np.float32)  # v
        key_sketch_ref(k, np.arange(first, first + n, dtype=np.int32), alone)
    assert alone.tobytes() == got.tobytes() and got.any()


@pytest.mark.slow
def test_ref_reproduces_the_unfolded_fault():
    """The numpy backend runs the references, so they must lose V the same way."""
    assert_parity(*append_windows(kv_append_k8v4_ref, fold_v_half=False)[:2],
                  *append_windows(kv_append_k8v4, fold_v_half=False)[:2])


@pytest.mark.slow
def test_absent_host_writes_only_the_pool():
    pool_with_host, _, _ = append_windows(kv_append_k8v4_ref)
    for append in (kv_append_k8v4_ref, kv_append_k8v4):
        pool, host, _ = append_windows(append, with_host=False)
        assert host is None
        for f in pool:
            assert pool[f].tobytes() == pool_with_host[f].tobytes(), f"pool {f} differs"


def test_the_fast_twin_is_the_one_writer():
    """The fast tier's k8v4 append (fast/kv_append.py: the plain kernel's code launched as
    dependent) writes the plain kernel's bytes, the key sketch's too, and with the V half
    unfolded it loses V from the host copy as the plain kernel does: the same writer. Two
    windows (a straddling one, and one in a streamed-out block) keep it to seconds."""
    from strata_nb.fast.kv_append import kv_append_k8v4 as fast_append

    windows = [(12, 8), (30, 3)]
    want, got = (np.zeros(sketch_shape(N_BLOCKS, N_KV, HEAD_DIM), np.uint8) for _ in range(2))
    assert_parity(*append_windows(kv_append_k8v4, windows=windows, sketch=want)[:2],
                  *append_windows(fast_append, windows=windows, sketch=got)[:2])
    assert want.tobytes() == got.tobytes() and got.any()
    pool_bad, host_bad, _ = append_windows(fast_append, windows=windows[1:], fold_v_half=False)
    assert_parity(*append_windows(kv_append_k8v4, windows=windows[1:], fold_v_half=False)[:2], pool_bad, host_bad)
    assert not host_bad["v_q4"].any()
