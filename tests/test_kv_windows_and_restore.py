"""Verify-window appends equal step-by-step appends (with a rejected tail rewritten), in the
pools and the host copies; a snapshot restore rewrites the host copy and the ring restore
makes streamed reads identical to resident ones again."""
import numpy as np
import pytest

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kv_layout import BLOCK, FORMATS
from stream_harness import HD, N_HEADS, N_KV, assert_bitwise_equal, make_cache, synthetic_decode

BE = NumpyBackend()
STREAMED = dict(kv_resident=128, kv_window=64)


def kv_bytes(cache):
    L = cache.layers[0]
    return {("pool", f): a.tobytes() for f, a in L.pool.items()} | \
           {("host", f): a.tobytes() for f, a in (L.host or {}).items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_window_equals_steps_with_rejected_tail(fmt):
    rng = np.random.default_rng(7)
    k, v = rng.standard_normal((2, 40, N_KV, HD), np.float32)
    k_bad, v_bad = rng.standard_normal((2, 40, N_KV, HD), np.float32)
    one_by_one, windowed = make_cache(BE, fmt, 256, **STREAMED), make_cache(BE, fmt, 256, **STREAMED)
    for p in range(26, 36):  # straddles the block boundary at 32
        one_by_one.append(0, np.array([p], np.int32), k[[p]], v[[p]], prompt=False)
    # a window of 8 at 26..33, all wrong values, then the accepted 26..28 and a rewrite of 29..35
    windowed.append(0, np.arange(26, 34, dtype=np.int32), k_bad[26:34], v_bad[26:34], prompt=False)
    windowed.append(0, np.arange(26, 29, dtype=np.int32), k[26:29], v[26:29], prompt=False)
    windowed.append(0, np.arange(29, 36, dtype=np.int32), k[29:36], v[29:36], prompt=False)
    assert kv_bytes(windowed) == kv_bytes(one_by_one)


@pytest.mark.parametrize("fmt", ["fp16", "k8v4", "q4_0"])
def test_restore_then_ring_restore_reads_identical(fmt):
    size = dict(n_cells=600, prompt_cells=512, chunk=128)
    res_outs, resident = synthetic_decode(BE, fmt, kv_window=64, **size)
    str_outs, streamed = synthetic_decode(BE, fmt, **STREAMED, **size)
    assert_bitwise_equal(res_outs, str_outs)
    end = 590
    snaps = resident.snapshot(end), streamed.snapshot(end)
    # scribble over both caches (another conversation), then restore
    rng = np.random.default_rng(9)
    for cache in (resident, streamed):
        pos = np.arange(300, 600, dtype=np.int32)
        cache.append(0, pos, rng.standard_normal((300, N_KV, HD), np.float32),
                     rng.standard_normal((300, N_KV, HD), np.float32), prompt=True)
    resident.restore(snaps[0])
    streamed.restore(snaps[1])
    L = streamed.layers[0]
    end_block = -(-end // BLOCK)
    for b in range(end_block - 4, end_block):  # the ring holds exactly the host copy's bytes
        assert L.page_table[b] == b % 4
        for f in L.pool:
            assert L.pool[f][b % 4].tobytes() == L.host[f][b].tobytes()
    assert (L.page_table[: end_block - 4] == -1).all()
    q = rng.standard_normal((3, N_HEADS, HD), np.float32)
    pos = np.arange(end - 3, end, dtype=np.int32)
    a = resident.attend(0, q, pos, prompt=False)
    b = streamed.attend(0, q, pos, prompt=False)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cuda", marks=pytest.mark.sim_engine)])
@pytest.mark.parametrize("settings", [{}, dict(STREAMED, qsa_budget=128)], ids=["resident", "streamed-qsa"])
def test_a_snapshot_into_parking_memory_restores_the_same_bytes(backend, settings):
    """snapshot(end, into=...) (the conversation cache's range of pinned memory) holds the
    bytes of a plain snapshot, in snapshot_nbytes(end) bytes; restoring it after another
    conversation wrote the cells gives every pool, host copy and sketch byte back."""
    from strata_nb.fast.backend import FastCudaBackend

    be = BE if backend == "numpy" else FastCudaBackend()
    cache = make_cache(be, "k8v4" if backend == "numpy" else "fp16", 256, **settings)  # fp16: the simulator's fastest
    end = 40

    def write(seed):
        r = np.random.default_rng(seed)
        pos = np.arange(0, end, dtype=np.int32)
        cache.append(0, pos, be.asarray(r.standard_normal((end, N_KV, HD), np.float32)),
                     be.asarray(r.standard_normal((end, N_KV, HD), np.float32)), prompt=True)

    def cells():
        L, nb = cache.layers[0], -(-end // BLOCK)
        src = dict(L.host if cache.streamed else L.pool) | ({"sketch": L.sketch} if L.sketch is not None else {})
        return {f: be.to_numpy(a)[:nb].tobytes() for f, a in src.items()}

    write(1)
    want = cells()
    memory = cache.parking_memory(cache.snapshot_nbytes(end) + 512)[256:]  # an arena range: not at its start
    parked = cache.snapshot(end, into=memory[:cache.snapshot_nbytes(end)])
    plain = cache.snapshot(end)
    assert all(parked["layers"][0][f].tobytes() == plain["layers"][0][f].tobytes() for f in plain["layers"][0])
    write(2)
    assert cells() != want
    cache.restore(parked)
    assert cells() == want
