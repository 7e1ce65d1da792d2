#!/usr/bin/env python3
"""Write an all-F32 copy of a GGUF file.

Usage: python tools/write_f32_gguf.py IN.gguf OUT.gguf

Every metadata key/value is copied with its original GGUF value type (arrays
included, e.g. tokenizer.ggml.tokens / token_type / merges; string values are
copied as raw bytes so nothing is re-encoded).  Every tensor is dequantized
with ``gguf.quants.dequantize`` and written as float32 under the same name and
the same logical (ggml ``ne``) shape.  ``general.file_type`` is set to
ALL_F32 (0), and added if the source lacks it.

Mixture-of-experts files (``strata-nb moefy``, llama.cpp's layout) copy the same
way: the router ``blk.N.ffn_gate_inp`` is already F32 (ne [d, E]), and the 3-D
expert tensors ``ffn_gate_exps`` / ``ffn_up_exps`` (ne [d, ff, E]) and
``ffn_down_exps`` (ne [ff, d, E]) dequantize row by row like any matrix, since
every row of every expert is a whole run of quantization blocks.
tests/test_llama_agreement.py checks a copy weight for weight.

Shape note: ``GGUFReader`` reports ``tensor.shape`` in ggml order (ne0 first,
ne0 = contiguous/row length) while ``tensor.data`` is a numpy array in the
reversed (row-major) order.  ``dequantize`` returns the row-major numpy array
(…, ne0), and ``GGUFWriter.add_tensor`` reverses the numpy shape again to get
ne, so we reshape to ``reversed(tensor.shape)`` and hand that over.

Needs only numpy + gguf (pip install gguf).
"""
from __future__ import annotations

import sys

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGUFValueType, GGMLQuantizationType

# Keys that GGUFReader synthesises from the header or that the writer sets itself.
_SKIP_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _field_value(field: gguf.ReaderField):
    """Return (value, vtype, sub_type) suitable for GGUFWriter.add_key_value."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"nested arrays not supported: {field.name}")
        sub = field.types[1]
        if sub == GGUFValueType.STRING:
            val = [bytes(field.parts[i]) for i in field.data]
        else:
            # each element is its own 1-element numpy part
            val = [field.parts[i][0].item() for i in field.data]
        return val, vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.parts[field.data[0]][0].item(), vtype, None


def convert(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)

    for name, field in reader.fields.items():
        if name in _SKIP_KEYS:
            continue
        val, vtype, sub = _field_value(field)
        if name == "general.file_type":
            val = int(gguf.LlamaFileType.ALL_F32)
        if name == "general.alignment":
            writer.data_alignment = int(val)
        writer.add_key_value(name, val, vtype, sub)
    if "general.file_type" not in reader.fields:  # a file may leave it out; the copy says what it is
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))

    for t in reader.tensors:
        ne = [int(x) for x in t.shape]            # ggml order
        np_shape = tuple(reversed(ne))            # numpy row-major order
        if t.tensor_type == GGMLQuantizationType.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = np.ascontiguousarray(arr.reshape(np_shape))
        writer.add_tensor(t.name, arr)
        print(f"{t.name:40s} {t.tensor_type.name:6s} ne={ne} -> F32", file=sys.stderr)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    convert(argv[1], argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
