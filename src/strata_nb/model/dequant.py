"""Dequantization of GGUF weight tensors, written out in NumPy.

These are the references the GPU matrix-vector kernels must match: each takes the raw
bytes of a tensor as (rows, bytes_per_row) uint8 and returns (rows, cols) float32, the
same values `gguf.quants.dequantize` returns (tests/test_dequant.py checks it).

ggml block formats (32 weights a block, little-endian fp16 fields first):

| type | bytes | layout                                | value of weight j          |
| ---- | ----- | ------------------------------------- | -------------------------- |
| Q4_0 | 18    | d:f16, qs[16]                         | (nibble_j - 8) * d         |
| Q4_1 | 20    | d:f16, m:f16, qs[16]                  | nibble_j * d + m           |
| Q8_0 | 34    | d:f16, qs[32] int8                    | qs[j] * d                  |

nibble_j is the low nibble of qs[j] for j < 16 and the high nibble of qs[j - 16] after.
"""
from __future__ import annotations

import numpy as np

QK = 32  # weights per quantization block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
SUPPORTED = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")


def _blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    # (rows, bytes_per_row) -> (rows, blocks_per_row, block_bytes)
    rows = raw.shape[0]
    return raw.reshape(rows, -1, BLOCK_BYTES[qtype])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # qs (..., 16) uint8 -> (..., 32) uint8: the low nibbles are weights 0..15, the high 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    # (..., 2) uint8 -> (..., 1) float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


# --8<-- [start:dequant_refs]
def dequant_q4_0_ref(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q4_0")  # (rows, nb, 18)
    d = _f16(b[..., 0:2])  # (rows, nb, 1)
    q = _nibbles(b[..., 2:]).astype(np.int8) - np.int8(8)  # (rows, nb, 32)
    return (d * q.astype(np.float32)).reshape(raw.shape[0], -1)


def dequant_q4_1_ref(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q4_1")  # (rows, nb, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (rows, nb, 1) each
    q = _nibbles(b[..., 4:]).astype(np.float32)  # (rows, nb, 32)
    return (d * q + m).reshape(raw.shape[0], -1)


def dequant_q8_0_ref(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q8_0")  # (rows, nb, 34)
    d = _f16(b[..., 0:2])  # (rows, nb, 1)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32)  # (rows, nb, 32)
    return (q * d).reshape(raw.shape[0], -1)
# --8<-- [end:dequant_refs]


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Raw tensor bytes (rows, bytes_per_row) uint8 -> (rows, cols) float32."""
    raw = np.ascontiguousarray(raw)
    if qtype == "F32":
        return raw.view(np.float32).reshape(raw.shape[0], -1)
    if qtype == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(raw.shape[0], -1)
    return {"Q4_0": dequant_q4_0_ref, "Q4_1": dequant_q4_1_ref, "Q8_0": dequant_q8_0_ref}[qtype](raw)
