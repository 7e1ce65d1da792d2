"""How the attention kernels (kernels/attention/) read one side (K or V) of a KV block,
for each format: "float" (fp32/fp16 values), "int8" (codes and one fp16 scale per 64
values) or "q4_0" (ggml blocks). Numba compiles one kernel per (K reader, V reader) pair."""
from __future__ import annotations

from numba import cuda, float32

from strata_nb.kernels.kv.quant_int8 import dequantize_int8_column
from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_column

# How each format stores its (K, V) sides
SIDES = {"fp32": ("float", "float"), "fp16": ("float", "float"), "int8": ("int8", "int8"),
         "q4_0": ("q4_0", "q4_0"), "k8v4": ("int8", "q4_0")}


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
