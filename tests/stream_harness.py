"""A synthetic decode through one layer's KV cache: a prompt in chunks, then decode steps and
verify windows of 1..8 cells, some of them rejected and rewritten. It returns every
attention output, so a resident run and a streamed run can be compared bit for bit."""
from __future__ import annotations

import numpy as np

from strata_nb.kv.cache import KVCache
from strata_nb.model.gguf_file import ModelConfig
from strata_nb.settings import Settings

N_HEADS, N_KV, HD = 9, 3, 64
WINDOWS = [1, 3, 8, 2, 5, 1, 7, 4, 6, 1]  # decode steps (1) and verify windows (2..8)


def make_cache(be, fmt, max_context, n_heads=N_HEADS, n_kv=N_KV, **settings):
    cfg = ModelConfig("synthetic", 1, n_heads * HD, 4 * HD, n_heads, n_kv, HD, 1e4, 1e-5, 100, max_context)
    return KVCache(be, cfg, Settings(kv=fmt, max_context=max_context, **settings))


def synthetic_decode(be, fmt, *, n_cells, prompt_cells, chunk, seed=0, check=None, n_heads=N_HEADS, n_kv=N_KV,
                     **settings):
    """-> (list of attention outputs as NumPy arrays, the cache)."""
    rng = np.random.default_rng(seed)
    shape = (n_cells + 8, n_kv, HD)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    k_rejected, v_rejected = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    q = rng.standard_normal((n_cells + 8, n_heads, HD), np.float32)
    cache = make_cache(be, fmt, n_cells + 8, n_heads, n_kv, **settings)
    outs = []

    def step(pos, kk, vv, prompt):
        cache.append(0, pos, be.asarray(kk[pos]), be.asarray(vv[pos]), prompt)
        outs.append(be.to_numpy(cache.attend(0, be.asarray(q[pos]), pos, prompt)))
        if check:
            check(cache)

    for s in range(0, prompt_cells, chunk):
        step(np.arange(s, min(s + chunk, prompt_cells), dtype=np.int32), k, v, True)
    p, i = prompt_cells, 0
    while p < n_cells:
        t = min(WINDOWS[i % len(WINDOWS)], n_cells - p)
        pos = np.arange(p, p + t, dtype=np.int32)
        if i % 3 == 2 and t > 1:
            # a verify window whose tail is rejected: its cells hold other values until the
            # next window writes over them (no rollback, the writer just overwrites)
            step(pos, k_rejected, v_rejected, False)
            p += t // 2
        else:
            step(pos, k, v, False)
            p += t
        i += 1
    return outs, cache


def assert_bitwise_equal(outs_a, outs_b):
    assert len(outs_a) == len(outs_b)
    for n, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert a.tobytes() == b.tobytes(), f"attention output {n} differs (max |diff| {np.abs(a - b).max()})"


def check_stream_state(be):
    """After every step: the maps stay inverse, the device table mirrors the host's, and the
    counters add up (every miss was copied or read in place)."""
    def check(cache):
        for L in cache.layers:
            if L.slots is not None:
                L.slots.check_inverse()
                assert (be.to_numpy(L.page_table) == L.slots.page_table).all()
        c = cache.counters
        assert c.copies + c.in_place == c.misses <= c.lookups
    return check
