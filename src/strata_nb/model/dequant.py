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
Q5_0 (22 bytes: d:f16, qh:u32, qs[16]) adds a fifth bit, bit j of qh: (nibble_j + 16 *
bit_j - 16) * d; Q5_1 (24 bytes: d, m:f16, qh:u32, qs[16]) adds it to Q4_1: (nibble_j +
16 * bit_j) * d + m.

The K-quants pack 256 weights in a *super-block*, cut into 8 sub-blocks of 32 that
each have their own scale (and min): a 6-bit integer times the super-block's fp16 d
(and dmin). A sub-block of 32 is the unit the references below work in, as the
kernels do (kernels/dense/gguf_rows.py).

| type | bytes | layout                                            | value of weight i of sub-block j |
| ---- | ----- | ------------------------------------------------- | -------------------------------- |
| Q4_K | 144   | d, dmin:f16, scales[12], qs[128]                  | d*sc_j * q - dmin*m_j, q 4 bits  |
| Q5_K | 176   | d, dmin:f16, scales[12], qh[32], qs[128]          | the same, q 5 bits (qh: bit j)   |
| Q6_K | 210   | ql[128], qh[64], scales[16] int8, d:f16           | d*scales[2j + i/16] * (q - 32)   |

Q4_K/Q5_K: sub-blocks 2c and 2c + 1 share the 32 bytes qs[32c:32c + 32], the low
nibbles for 2c, the high for 2c + 1; sc_j and m_j are 6-bit, packed in 12 bytes
(`scale_min_k4`). Q6_K: two halves of 128 weights; in half h, sub-block r (0..3) takes
the low (r < 2) or high nibble of ql[64h + 32(r % 2) + i] and bits 2r, 2r + 1 of
qh[32h + i] as its top two bits; its scales are signed bytes, one per 16 weights.
"""
from __future__ import annotations

import numpy as np

QK = 32  # weights per quantization block
QK_K = 256  # weights per K-quant super-block: 8 sub-blocks of QK
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# where each K-quant's super-block keeps its fp16 d (and dmin)
K_QUANT_F16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# What the engine loads: the numpy backend and both tiers read them all (the fast tier's
# two-step dequantizers, fast/gguf_fetch.py, take Q5_0, Q5_1 and the K-quants whole).
SUPPORTED = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


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


def dequant_q5_0_ref(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q5_0")  # (rows, nb, 22)
    d = _f16(b[..., 0:2])  # (rows, nb, 1)
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # (rows, nb, 1): bit j is weight j's fifth
    fifth = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)  # (rows, nb, 32)
    q = (_nibbles(b[..., 6:]) | (fifth << 4)).astype(np.int8) - np.int8(16)
    return (d * q.astype(np.float32)).reshape(raw.shape[0], -1)


def dequant_q5_1_ref(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q5_1")  # (rows, nb, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (rows, nb, 1) each
    qh = np.ascontiguousarray(b[..., 4:8]).view(np.uint32)  # (rows, nb, 1): bit j is weight j's fifth
    fifth = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)  # (rows, nb, 32)
    q = (_nibbles(b[..., 8:]) | (fifth << 4)).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


# --8<-- [start:k_quant_refs]
def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 scales and 8 mins, 6 bits each (..., 8) uint8. Sub-blocks
    0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7
    keep their low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top
    2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, low4 = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([first & 63, (low4 & 15) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 63, (low4 >> 4) | ((second >> 6) << 4)], axis=-1)
    return sc, m


def _super_blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    # (rows, bytes_per_row) -> (rows, super_blocks_per_row, super_block_bytes)
    return raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])


def _sub_block_nibbles(qs: np.ndarray) -> np.ndarray:
    """qs (..., 128) -> (..., 8, 32): sub-blocks 2c and 2c + 1 are the low and the high
    nibbles of qs[32c:32c + 32]."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((chunks >> np.array([0, 4], np.uint8)[:, None]) & 15).reshape(*qs.shape[:-1], 8, 32)


def dequant_q4_k_ref(raw: np.ndarray) -> np.ndarray:
    b = _super_blocks(raw, "Q4_K")  # (rows, ns, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (rows, ns, 1)
    sc, m = scale_min_k4(b[..., 4:16])  # (rows, ns, 8)
    q = _sub_block_nibbles(b[..., 16:144]).astype(np.float32)  # (rows, ns, 8, 32)
    scale = (d * sc.astype(np.float32))[..., None]  # one multiply per sub-block, then one per weight
    low = (dmin * m.astype(np.float32))[..., None]
    return (scale * q - low).reshape(raw.shape[0], -1)


def dequant_q5_k_ref(raw: np.ndarray) -> np.ndarray:
    b = _super_blocks(raw, "Q5_K")  # (rows, ns, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = scale_min_k4(b[..., 4:16])
    qh = b[..., 16:48]  # (rows, ns, 32): bit j of byte i is weight i of sub-block j's fifth bit
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (rows, ns, 8, 32)
    q = (_sub_block_nibbles(b[..., 48:176]) | (fifth << 4)).astype(np.float32)
    scale = (d * sc.astype(np.float32))[..., None]
    low = (dmin * m.astype(np.float32))[..., None]
    return (scale * q - low).reshape(raw.shape[0], -1)


def dequant_q6_k_ref(raw: np.ndarray) -> np.ndarray:
    b = _super_blocks(raw, "Q6_K")  # (rows, ns, 210)
    rows, ns = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, ns, 2, 1, 2, 32)  # (half, nibble, which 32 of the 64, i)
    low4 = ((ql >> np.array([0, 4], np.uint8)[:, None, None]) & 15).reshape(rows, ns, 2, 4, 32)
    qh = b[..., 128:192].reshape(rows, ns, 2, 1, 32)  # (half, r, i): bits 2r, 2r + 1
    top2 = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # (rows, ns, 2, 4, 32)
    q = ((low4 | (top2 << 4)).astype(np.int8) - np.int8(32)).reshape(rows, ns, 16, 16)
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # (rows, ns, 16)
    d = _f16(b[..., 208:210])  # (rows, ns, 1)
    return ((d * scales)[..., None] * q.astype(np.float32)).reshape(rows, -1)
# --8<-- [end:k_quant_refs]


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Raw tensor bytes (rows, bytes_per_row) uint8 -> (rows, cols) float32."""
    raw = np.ascontiguousarray(raw)
    if qtype == "F32":
        return raw.view(np.float32).reshape(raw.shape[0], -1)
    if qtype == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(raw.shape[0], -1)
    return {"Q4_0": dequant_q4_0_ref, "Q4_1": dequant_q4_1_ref, "Q8_0": dequant_q8_0_ref, "Q5_0": dequant_q5_0_ref, "Q5_1": dequant_q5_1_ref,
            "Q4_K": dequant_q4_k_ref, "Q5_K": dequant_q5_k_ref, "Q6_K": dequant_q6_k_ref}[qtype](raw)
