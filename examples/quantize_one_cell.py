"""Quantize one KV cell in every format and print its bytes, run by run.

A cell is one token of one layer: K and V for each of 3 KV heads of 64 values. This
script writes one cell through the one writer (kv/writer.py) on the numpy backend, so
every byte comes from the kernels' NumPy references. It prints each run's bytes, the
first bytes of head 0, and how far the stored values are from the input.

    python examples/quantize_one_cell.py
"""
import numpy as np

from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.kernels.kv.hadamard import hadamard_ref
from strata_nb.kernels.kv.quant_int8 import dequantize_int8_ref
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_ref, quantize_q4_0_ref
from strata_nb.kv_layout import BLOCK, USER_FORMATS, pool_arrays, rotates
from strata_nb.kv.writer import KVDest, append_cells

N_KV, HD = 3, 64  # the default model's KV heads and head_dim
be = NumpyBackend()
rng = np.random.default_rng(0)
k, v = rng.standard_normal((2, 1, N_KV, HD), np.float32)  # one cell: (n=1, n_kv, hd) each
k[0, 0, 5] = 9.0  # one outlier in head 0 of K, as real K rows have

for fmt in USER_FORMATS:
    pool = {a.field: np.zeros((1, N_KV, BLOCK, a.per_head), a.dtype) for a in pool_arrays(fmt, HD)}
    dest = KVDest(pool, np.zeros(1, np.int32), None)  # one block, resident in slot 0, no host copy
    append_cells(be, fmt, dest, np.array([0], np.int32), k, v)  # position 0: block 0, cell 0; rotated inside

    total = 0
    print(f"{fmt}:")
    for a in pool_arrays(fmt, HD):
        cell = pool[a.field][0, :, 0]  # (n_kv, per_head): this cell's bytes of one run
        total += cell.nbytes
        head0 = cell[0].view(np.uint8)[:8]
        print(f"  {a.run:<9} {cell.nbytes:4d} B   head 0 starts {' '.join(f'{b:02x}' for b in head0)}")

    def stored(side, x):  # read the cell back the way attention does, then undo the rotation
        if fmt == "fp16":
            y = pool[side][0, :, 0].astype(np.float32)
        elif side + "_q" in pool:
            y = dequantize_int8_ref(pool[side + "_q"][0, :, 0], pool[side + "_s"][0, :, 0])
        else:
            y = dequantize_q4_0_ref(pool[side + "_q4"][0, :, 0])
        y = hadamard_ref(y) if side in rotates(fmt) else y  # H is its own inverse
        return np.abs(y - x[0]).max()

    print(f"  cell      {total:4d} B   max |error|: K {stored('k', k):.4f}, V {stored('v', v):.4f}")

plain = np.abs(dequantize_q4_0_ref(quantize_q4_0_ref(k)) - k).max()
print(f"q4_0 K without the Hadamard rotation: max |error| {plain:.4f} (the outlier sets its block's d)")
