"""The KV append in the q|k|v matvec's epilogue (fast/matvec_fused.py, "Appending in the
epilogue"): a decode step's fp16/fp32 cells written by the product that makes them,
through the one writer's device body (kv_append_fp16.store_cell).

Against the unfused pair of launches, byte for byte, with a negative control: a writer
body that drops V's host write must be caught. test_append_epilogue_engine.py takes the
same two writer bodies through the engine's replayed steps.
"""
import numpy as np
import pytest
from numba import cuda

from conftest import ON_GPU
from strata_nb.fast import matvec_fused
from strata_nb.fast.matvec_fused import matvec_fused_ref
from strata_nb.kernels.kv.kv_append_fp16 import kv_append_fp16, store_cell
from strata_nb.kv_layout import BLOCK
from test_dense_kernels import quantized


@cuda.jit(device=True)
def store_cell_v_host_dropped(side, h, j, value, block, cell, slot, k, v, host_k, host_v):
    """store_cell with the k8v4 fault's mistake: the V side tests presence on its own
    (here: never present), so a V value reaches the pool but not the host copy."""
    if side == 0:
        store_cell(side, h, j, value, block, cell, slot, k, v, host_k, host_v)
    else:
        store_cell(side, h, j, value, block, cell, slot, k, v, host_k[:0], host_v)


# (format, warps per block, the cell's position, host copy present): a resident block with
# its host copy, a block that is not resident (host only), fp32 without a host copy (pool
# only), and three warps (the shared-memory path a GPU takes for 576-value rows).
CASES = [("fp16", None, 21, True), ("fp16", None, 40, True), ("fp32", None, 21, False)] + \
    ([("fp16", 3, 21, True)] if not ON_GPU else [])


@pytest.mark.parametrize("fmt, warps, position, with_host", CASES)
def test_append_epilogue_writes_what_kv_append_fp16_writes(monkeypatch, fmt, warps, position, with_host):
    """A decode step's fp16/fp32 cell written by the q|k|v matvec's epilogue: y the rope
    epilogue's bits, and the pool and host copy byte for byte what kv_append_fp16 writes
    from that y. Negative control: the same kernel over a writer body that drops V's host
    write must be caught by these comparisons."""
    rng = np.random.default_rng(17)
    n_heads, n_kv, hd = (9, 3, 64) if ON_GPU else (1, 1, 64)  # pools take head_dim 64
    n_in, n_out = (576 if ON_GPU else 96), (n_heads + 2 * n_kv) * hd
    raw = quantized(rng, "Q4_1", (n_out, n_in))
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    angles = rng.uniform(0, 100, (1, hd // 2))
    rope = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), n_heads, n_kv)
    positions = np.array([position], np.int32)
    page_table = np.array([2, 0, -1, 1], np.int32)  # block 1 (cell 21) in slot 0; block 2 (40) not resident
    dtype = np.dtype(fmt.replace("fp", "float"))

    def cache(n_rows):
        return [rng.standard_normal((n_rows, n_kv, BLOCK, hd)).astype(dtype) for _ in range(2)]

    pool0, host0 = cache(3), (cache(4) if with_host else [np.zeros((0, n_kv, BLOCK, hd), dtype)] * 2)
    y = np.full((1, n_out), np.nan, np.float32)  # the unfused pair: rope epilogue, then the append kernel
    matvec_fused.matvec_fused(x, raw, "Q4_1", y, norm=norm, eps=1e-5, rope=rope, warps=warps)
    pool, host = [a.copy() for a in pool0], [a.copy() for a in host0]
    k_new, v_new = (np.ascontiguousarray(y[:, a:a + n_kv * hd].reshape(1, n_kv, hd))
                    for a in (n_heads * hd, (n_heads + n_kv) * hd))
    kv_append_fp16(k_new, v_new, positions, page_table, *pool, *host)
    resident = page_table[position // BLOCK] >= 0
    assert (pool[1].tobytes() != pool0[1].tobytes()) == resident
    assert not with_host or host[1].tobytes() != host0[1].tobytes()

    def fused():
        got_y = np.full((1, n_out), np.nan, np.float32)
        got_pool, got_host = [a.copy() for a in pool0], [a.copy() for a in host0]
        matvec_fused.matvec_fused(x, raw, "Q4_1", got_y, norm=norm, eps=1e-5, rope=rope, warps=warps,
                                  append=(positions, page_table, *got_pool, *got_host))
        return got_y, got_pool, got_host

    got_y, got_pool, got_host = fused()
    assert got_y.tobytes() == y.tobytes()
    for side in range(2):
        assert got_pool[side].tobytes() == pool[side].tobytes()
        assert got_host[side].tobytes() == host[side].tobytes()
    ref_pool, ref_host = [a.copy() for a in pool0], [a.copy() for a in host0]
    ref_y = np.zeros((1, n_out), np.float32)
    matvec_fused_ref(x, raw, "Q4_1", ref_y, norm=norm, eps=1e-5, rope=rope,
                     append=(positions, page_table, *ref_pool, *ref_host))
    ref_v = ref_y[:, (n_heads + n_kv) * hd:].reshape(n_kv, hd)
    if with_host:  # the reference appends its own y's k and v
        assert ref_host[1][position // BLOCK, :, position % BLOCK].tobytes() == ref_v.astype(dtype).tobytes()
    if resident:
        assert ref_pool[1][0, :, position % BLOCK].tobytes() == ref_v.astype(dtype).tobytes()

    if with_host:  # negative control: V's host cell is lost, and the comparisons above see it
        monkeypatch.setattr(matvec_fused, "MATVEC_KERNELS",
                            matvec_fused.matvec_kernels(matvec_fused.ROWS, store=store_cell_v_host_dropped))
        bad_y, bad_pool, bad_host = fused()
        assert bad_y.tobytes() == y.tobytes() and bad_pool[1].tobytes() == pool[1].tobytes()
        assert bad_host[0].tobytes() == host[0].tobytes()
        assert bad_host[1].tobytes() != host[1].tobytes()
