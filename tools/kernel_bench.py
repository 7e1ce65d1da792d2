"""Single kernels on the default model's shapes, timed by CUPTI (needs torch), on a GPU:

    STRATA_NB_GPU=1 python tools/kernel_bench.py                  # every section
    STRATA_NB_GPU=1 python tools/kernel_bench.py select matvec    # some of them

- attention for one decode query (one launch: the splits merge in it) at 48, 1,024 and
  8,192 cells of a 8,192-cell list, splits of 1, 2 and 4 blocks, fp16 and k8v4 (with
  the output rotated back), and a 256-query prompt chunk at 8K with 1, 4 and 16 queries per thread block;
- each matvec of a decode step (fused q|k|v with its norm, o with the add, gate|up with
  its norm, down with SwiGLU and the add, the Q8_0 head) at 2, 4 and 8 rows per block;
- QSA's two kernels of a streamed step, block_scores (from the key sketch) and
  select_blocks (a budget of 1,024 cells, a window of 16 blocks), for a query at 1,024,
  4,096 and 8,160 cells of a 512-block context.

The K/V and weights are random bytes: the times depend on the shapes only.
"""
import numpy as np
from numba import cuda

import strata_nb.fast.attention as at
import strata_nb.fast.matvec_fused as mvf
from strata_nb.bench.profile import kernel_times
from strata_nb.kv_layout import pool_arrays
from strata_nb.kv_layout import all_blocks_upto

rng = np.random.default_rng(0)
N_BLOCKS = 512  # 8,192 cells


def us(run, steps):
    run()
    cuda.synchronize()
    return {k: round(v[1], 1) for k, v in kernel_times(run, steps).items()}


def pool(fmt):
    out = {}
    for a in pool_arrays(fmt, 64):
        if a.dtype == np.float16:
            out[a.field] = cuda.to_device((rng.standard_normal((N_BLOCKS, 3, 16, a.per_head)) * 0.1).astype(np.float16))
        else:
            out[a.field] = cuda.to_device(rng.integers(0, 120, (N_BLOCKS, 3, 16, a.per_head)).astype(a.dtype))
    return out


def attention():
    page_table = cuda.to_device(np.arange(N_BLOCKS, dtype=np.int32))
    for fmt in ("fp16", "k8v4"):
        kv = pool(fmt)
        q = cuda.to_device(rng.standard_normal((1, 9, 64)).astype(np.float32))
        blocks = cuda.to_device(np.arange(N_BLOCKS, dtype=np.int32).reshape(1, N_BLOCKS))
        out = cuda.device_array((1, 9, 64), np.float32)
        for depth in (48, 1024, N_BLOCKS * 16):  # a replayed step lists every block: the rest are skipped
            q_pos = cuda.to_device(np.array([depth - 1], np.int32))
            for per_split in (1, 2, 4):
                t = us(lambda: at.attention(fmt, q, q_pos, blocks, page_table, kv, None, out,
                                            rotate_out=fmt == "k8v4", per_split=per_split), 30)
                print(f"{fmt} decode at {depth}, {per_split} blocks per split: {t}", flush=True)
        pos = np.arange(N_BLOCKS * 16 - 256, N_BLOCKS * 16, dtype=np.int32)
        q = cuda.to_device(rng.standard_normal((256, 9, 64)).astype(np.float32))
        out = cuda.device_array((256, 9, 64), np.float32)
        for tile in (1, 4, 16):
            t = us(lambda: at.attention(fmt, q, pos, all_blocks_upto(pos), page_table, kv, None, out, tile=tile), 3)
            print(f"{fmt} prompt chunk of 256 at 8K, {tile} queries per block: {t}", flush=True)


# A decode step's fused matvecs: (weight type, rows of W, row length, prologue/epilogue)
MATVEC_SHAPES = {"qkv": ("Q4_1", 960, 576, "normed"), "o": ("Q4_1", 576, 576, "add"),
                 "gate_up": ("Q4_1", 3072, 576, "normed"), "down": ("Q4_1", 576, 1536, "gated"),
                 "head": ("Q8_0", 49152, 576, "normed")}


def fused(kind, norm):
    """matvec's keyword arguments for a MATVEC_SHAPES kind; norm: the rmsnorm weight."""
    return {"normed": dict(norm=norm, eps=1e-5), "add": dict(add=True), "gated": dict(swiglu=True, add=True)}[kind]


def matvecs():
    weights = {k: cuda.to_device(rng.integers(0, 64, (o, mvf.row_bytes(q, i)), dtype=np.uint8))
               for k, (q, o, i, _) in MATVEC_SHAPES.items()}
    x = cuda.to_device(rng.standard_normal((1, 3072)).astype(np.float32))
    norm = cuda.to_device(np.ones(576, np.float32))
    default = mvf.ROWS
    for rows in (2, 4, 8):
        mvf.ROWS, mvf.MATVEC_KERNELS = rows, mvf.matvec_kernels(rows)
        times = []
        for name, (qtype, n_out, n_in, kind) in MATVEC_SHAPES.items():
            y = cuda.device_array((1, n_out), np.float32)
            xs = x[:, :2 * n_in] if kind == "gated" else x[:, :n_in]
            t = us(lambda: mvf.matvec_fused(xs, weights[name], qtype, y, **fused(kind, norm[:n_in])), 50)
            times.append(f"{name} {sum(t.values()):.1f}")
        print(f"matvec, {rows} rows of W per block (us): " + ", ".join(times), flush=True)
    mvf.ROWS, mvf.MATVEC_KERNELS = default, mvf.matvec_kernels(default)


def selection():
    from strata_nb.kernels.kv.quant_q4_0 import quantize_q4_0_ref
    from strata_nb.fast.block_scores import block_scores
    from strata_nb.fast.select_blocks import select_blocks

    sketch = cuda.to_device(quantize_q4_0_ref(rng.standard_normal((N_BLOCKS, 3, 16, 64)).astype(np.float32)))
    q = cuda.to_device(rng.standard_normal((1, 9, 64)).astype(np.float32))
    scores = cuda.device_array((1, N_BLOCKS), np.float32)
    page_table = cuda.to_device(np.where(np.arange(N_BLOCKS) == 0, 0, -1).astype(np.int32))
    chosen = cuda.device_array(N_BLOCKS, np.int32)
    out = cuda.device_array((1, 64), np.int32)
    counts = cuda.to_device(np.zeros(3, np.int64))
    for depth in (1024, 4096, N_BLOCKS * 16 - 32):
        pos = cuda.to_device(np.array([depth], np.int32))
        t = us(lambda: block_scores(q, sketch, pos, 16, scores), 30)
        t.update(us(lambda: select_blocks(scores, pos, page_table, 16, 1024, chosen, out, counts), 30))
        print(f"QSA at {depth}: {t}", flush=True)


SECTIONS = {"attention": attention, "matvec": matvecs, "select": selection}

if __name__ == "__main__":
    import sys

    unknown = [name for name in sys.argv[1:] if name not in SECTIONS]
    if unknown:
        sys.exit(f"kernel_bench: no section {', '.join(unknown)} (sections: {', '.join(SECTIONS)})")
    for name in sys.argv[1:] or list(SECTIONS):
        SECTIONS[name]()
