"""How attention (kernels/attention/) reads one side (K or V) of the selected KV blocks,
for each format: "float" (fp32/fp16 values), "int8" (codes and one fp16 scale per 64
values) or "q4_0" (ggml blocks). The reference gathers and dequantizes whole blocks; a
kernel reads value j of a block's 16 rows at a time, and Numba compiles one kernel per
(K reader, V reader) pair; its launcher passes each side as two device arrays."""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from strata_nb.gpu.launch import view_bytes
from strata_nb.kernels.kv.quant_int8 import dequantize_int8_column, dequantize_int8_ref
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_column, dequantize_q4_0_ref

# How each format stores its (K, V) sides
SIDES = {"fp32": ("float", "float"), "fp16": ("float", "float"), "int8": ("int8", "int8"),
         "q4_0": ("q4_0", "q4_0"), "k8v4": ("int8", "q4_0")}


def side_fields(kind: str, side: str) -> tuple[str, ...]:
    """The pool fields one side ("k" or "v") of a format is stored in."""
    return {"float": (side,), "int8": (f"{side}_q", f"{side}_s"), "q4_0": (f"{side}_q4",)}[kind]


def gather_blocks(field, sel, page_table, pool, host):
    """Blocks `sel` of one field, each from its slot if resident, else from the host copy."""
    slots = page_table[sel]
    resident = slots >= 0
    out = np.empty((len(sel), *pool[field].shape[1:]), pool[field].dtype)  # (U, n_kv, 16, per_head)
    out[resident] = pool[field][slots[resident]]
    if not resident.all():
        assert host is not None, "a selected block is not resident and there is no host copy"
        out[~resident] = host[field][sel[~resident]]
    return out


def dequantize_side(kind, side, sel, page_table, pool, host):
    """(n_kv, C, D) float32: one side of the selected blocks, cells in block order."""
    raw = [gather_blocks(f, sel, page_table, pool, host) for f in side_fields(kind, side)]
    values = {"float": lambda: raw[0].astype(np.float32),
              "int8": lambda: dequantize_int8_ref(*raw),
              "q4_0": lambda: dequantize_q4_0_ref(raw[0])}[kind]()  # (U, n_kv, 16, D)
    return values.transpose(1, 0, 2, 3).reshape(values.shape[1], -1, values.shape[3])


# --8<-- [start:attention_readers]
# How the kernel reads value j of the 16 rows of block (or slot) r, KV head h, for each
# way a side is stored. All take (array_a, array_b, r, h, j, out), so one kernel body
# serves every format: (values, unused), (int8 codes, fp16 scales) or (q4_0 bytes, the
# same bytes as float16). One call loads all 16 values into registers, with no store
# to memory in between, so the loads are in flight together.
@cuda.jit(device=True)
def read_float_column(values, unused, r, h, j, out):
    for c in range(out.shape[0]):
        out[c] = float32(values[r, h, c, j])


READERS = {"float": read_float_column, "int8": dequantize_int8_column, "q4_0": dequantize_q4_0_column}
# --8<-- [end:attention_readers]


def side_arrays(kind, side, arrays, dev=None):
    """The two device arrays a kernel reads one side through (the readers' first two), moved
    by `dev` (a DeviceArgs; None: arrays already on the device)."""
    read = (lambda a: a) if dev is None else dev.read
    if kind == "float":
        a = read(arrays[side])
        return a, a  # the second is unused; passing it keeps one kernel signature
    if kind == "int8":
        return read(arrays[f"{side}_q"]), read(arrays[f"{side}_s"])
    a = read(arrays[f"{side}_q4"])
    return a, view_bytes(a, np.float16)  # d of block g at [9 * g]
