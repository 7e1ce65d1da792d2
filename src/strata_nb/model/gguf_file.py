"""Open a GGUF file, check it is a model strata-nb can run, and read its facts and tensors.

Parsing is gguf-py's (`gguf.GGUFReader`, a memory map), but for the metadata's arrays;
this module turns the fields into a `ModelConfig` and every failure a user can cause into
one clear `StrataError`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..errors import StrataError
from .dequant import SUPPORTED

ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The hyperparameters the forward pass needs, read from GGUF metadata."""

    name: str
    n_layers: int  # transformer blocks
    d_model: int  # hidden size (576 for the default model)
    d_ff: int  # SwiGLU inner size (1536)
    n_heads: int  # query heads (9)
    n_kv_heads: int  # K/V heads (3): GQA groups of n_heads // n_kv_heads
    head_dim: int  # 64
    rope_base: float  # 100000
    rms_eps: float
    vocab_size: int
    context_length: int  # trained context (8192)
    n_expert: int = 0  # experts per FFN (llama.expert_count); 0 = a dense FFN
    n_expert_used: int = 0  # experts each token is routed to, k (llama.expert_used_count)
    # --8<-- [start:family]
    # What a second family (Gemma 3) changes; a llama model keeps every default.
    arch: str = "llama"
    embed_scale: float = 1.0  # the embedding rows times this (Gemma: sqrt(d_model))
    qk_norm: bool = False  # each q and k head RMS-normed before RoPE (attn_q_norm, attn_k_norm)
    post_norms: bool = False  # attention's and the FFN's outputs RMS-normed before their residual adds
    gate: str = "silu"  # the FFN's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    rope_halves: bool = False  # RoPE turns (i, i + hd/2) (NeoX); llama's converter made llama's (2i, 2i+1)
    window: int = 0  # a local layer's keys: the last `window` positions (Gemma 3: 512); 0 = none
    global_every: int = 0  # with a window, every global_every-th layer sees every cell (Gemma 3: 6)
    rope_base_local: float = 0.0  # a local layer's RoPE base (Gemma 3: 10000)

    def local(self, layer: int) -> bool:
        """Does `layer` see only the last `window` positions (a sliding-window layer)?"""
        return self.window > 0 and (layer + 1) % self.global_every != 0
    # --8<-- [end:family]

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise StrataError(f"{self.n_heads} query heads do not split into {self.n_kv_heads} KV groups")
        if self.head_dim % 64:
            raise StrataError(f"head_dim {self.head_dim} is not a multiple of 64 (the rotation width)")
        if self.n_expert and not 1 <= self.n_expert_used <= self.n_expert:
            raise StrataError(f"the model routes each token to {self.n_expert_used} of {self.n_expert} experts "
                              "(llama.expert_used_count must be 1 .. llama.expert_count)")
        if not self.n_expert and self.n_expert_used:
            raise StrataError(f"the model sets llama.expert_used_count to {self.n_expert_used} "
                              "but has no llama.expert_count")


@dataclass(frozen=True, slots=True)
class QTensor:
    """A weight tensor as stored: raw bytes per row plus its ggml type."""

    name: str
    qtype: str  # "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, int]  # (out, in) rows x cols, so y = x @ W.T
    raw: np.ndarray  # (out, bytes_per_row) uint8, a view into the memory map


def _field(reader, key: str, default=None, required=True):
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise StrataError(f"GGUF metadata lacks {key!r}")
        return default
    return f.contents()


class _ArrayField(gguf.ReaderField):
    """A metadata array read in one pass: parts[-1] holds its values, a list of str or one
    (n,) ndarray view of the memory map. contents() answers as gguf-py's ReaderField does."""

    def contents(self, index_or_slice: int | slice = slice(None)):
        picked = self.parts[-1][index_or_slice]
        return picked.tolist() if isinstance(picked, (np.ndarray, np.generic)) else picked


class _Reader(gguf.GGUFReader):
    """gguf-py's reader, changed in three ways. It reads through a plain ndarray view of
    the memory map: slicing an np.memmap runs Python code for each slice. It reads a
    metadata array in one pass (`_flat_array`): gguf-py makes a few numpy views for every
    element, and the vocabulary and merges are ~100,000 strings, most of a model's load
    time. And it checks that every tensor's bytes lie inside the file before numpy slices
    them: a download cut short would otherwise end in numpy's reshape error."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:  # (file bytes,) uint8, still backed by the memory map
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap):  # gguf-py's __init__ sets it first
        self._mapped = mapped.view(np.ndarray)

    def _build_fields(self, offs: int, count: int) -> int:
        """gguf-py's loop over the key/value pairs, with arrays of strings or numbers read
        by _flat_array; scalars, strings and arrays of arrays go through gguf-py's parts."""
        for _ in range(count):
            start = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head = [klen, kdata, raw_type]
            name = str(bytes(kdata), encoding="utf-8")
            if raw_type[0] == gguf.GGUFValueType.ARRAY and self._get(offs, np.uint32)[0] != gguf.GGUFValueType.ARRAY:
                size, parts, types = self._flat_array(offs)
                field = _ArrayField(start, name, head + parts, [len(head) + len(parts) - 1], types)
            else:
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                field = gguf.ReaderField(start, name, head + parts, [i + len(head) for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    # --8<-- [start:flat_array]
    def _flat_array(self, offs: int) -> tuple[int, list, list]:
        """The array at offs: (its size in bytes, [item type, count, values], its types).
        Numbers are one view of the memory map; strings (each a u64 length, then its UTF-8
        bytes) are walked once with struct, one decode each. A file cut short inside the
        array raises IndexError or ValueError, as gguf-py's own reads do."""
        item_type, count = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        kind, n, at = gguf.GGUFValueType(int(item_type[0])), int(count[0]), offs + 12
        if kind == gguf.GGUFValueType.STRING:
            mapped = memoryview(self.data)
            length = struct.Struct("<Q" if self.endianess == gguf.GGUFEndian.LITTLE else ">Q").unpack_from
            values = []
            try:
                for _ in range(n):
                    (size,) = length(mapped, at)
                    values.append(str(mapped[at + 8:at + 8 + size], "utf-8"))
                    at += 8 + size
            except struct.error:  # a length past the end of the file
                at = len(mapped) + 1
        else:  # one of gguf-py's scalar types (arrays of arrays do not come here)
            values = self._get(at, self.gguf_scalar_to_np[kind], n)
            at += n * values.itemsize
        if at > len(self.data):
            raise ValueError(f"the array at byte {offs} runs past the end of the file")
        return at - offs, [item_type, count, values], [gguf.GGUFValueType.ARRAY, kind]
    # --8<-- [end:flat_array]

    def _build_tensors(self, start_offs, fields):
        size, past = len(self.data), []  # the memory map holds the whole file
        for field in fields:
            _, name, _, dims, ggml_type, offset = field.parts  # the tensor info, as gguf-py lays it out
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(ggml_type[0]))]
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_bytes // block
            if end > size:
                past.append((end, bytes(name).decode("utf-8", "replace")))
        if past:
            cut = min(past)[1]  # the tensor the file ends inside
            missing = max(past)[0] - size
            raise StrataError(f"{self.path} is truncated: tensor {cut} runs past the end of the file, "
                              f"which lacks {missing:,} of its {size + missing:,} bytes")
        super()._build_tensors(start_offs, fields)


class GGUFModel:
    """A validated GGUF model file: `config`, `metadata(key)`, `tensor(name)`."""

    # --8<-- [start:open_checks]
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise StrataError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise StrataError(f"model path is not a file: {self.path}")
        with open(self.path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise StrataError(f"{self.path} is not a GGUF file (its first bytes are not 'GGUF')")
        try:
            self.reader = _Reader(self.path)
        except (ValueError, IndexError, OSError) as err:
            raise StrataError(f"{self.path} is truncated or corrupt: its header does not read ({err})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._read_config()
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED:
                raise StrataError(
                    f"tensor {t.name} has type {t.tensor_type.name}, which strata-nb does not load "
                    f"(supported: {', '.join(SUPPORTED)})")
    # --8<-- [end:open_checks]

    def metadata(self, key: str, default=None):
        return _field(self.reader, key, default, required=False)

    def _read_config(self) -> ModelConfig:
        arch = _field(self.reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise StrataError(f"unsupported architecture {arch!r}: strata-nb runs {', '.join(ARCHITECTURES)}")
        a = lambda key, default=None: _field(self.reader, f"{arch}.{key}", default)
        n_heads = int(a("attention.head_count"))
        d_model = int(a("embedding_length"))
        tokens = self.metadata("tokenizer.ggml.tokens")
        vocab = int(a("vocab_size", len(tokens) if tokens is not None else None))
        head_dim = int(a("attention.key_length", a("rope.dimension_count", d_model // n_heads)))
        family = {}
        if arch == "gemma3":  # what llama.cpp's gemma3 graph does beyond llama's (docs: two-models.md)
            family = dict(arch=arch, embed_scale=float(np.sqrt(np.float32(d_model))), qk_norm=True, post_norms=True,
                          gate="gelu_tanh", rope_halves=True, window=int(a("attention.sliding_window")),
                          global_every=6, rope_base_local=10000.0)
        return ModelConfig(
            name=str(self.metadata("general.name", self.path.stem)),
            n_layers=int(a("block_count")),
            d_model=d_model,
            d_ff=int(a("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_base=float(a("rope.freq_base", 10000.0)),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
            vocab_size=vocab,
            context_length=int(a("context_length", 2048)),
            n_expert=int(a("expert_count", 0)),
            n_expert_used=int(a("expert_used_count", 0)),
            **family,
        )

    def tensor(self, name: str, shape: tuple[int, int] | None = None) -> QTensor:
        """A 1-D or 2-D tensor as (out, in) rows; `shape`, when given, is the one it must have."""
        t = self._info(name)
        got = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml ne is (in, out)
        if len(got) == 1:
            got = (1, got[0])
        if shape is not None and got != tuple(shape):
            raise StrataError(f"tensor {name} has shape {got}; this model needs {tuple(shape)}")
        raw = np.asarray(t.data).view(np.uint8).reshape(got[0], -1)
        return QTensor(name, t.tensor_type.name, got, raw)

    # --8<-- [start:experts]
    def experts(self, name: str, n_expert: int, rows: int, cols: int) -> list[QTensor]:
        """A 3-D expert tensor, ggml ne (cols, rows, n_expert) as llama.cpp lays it out, as
        n_expert QTensors of (rows, cols): expert e's matrix, a view of the memory map."""
        t = self._info(name)
        got = tuple(int(n) for n in reversed(t.shape.tolist()))  # (n_expert, rows, cols)
        if got != (n_expert, rows, cols):
            raise StrataError(f"tensor {name} has shape {got}; this model's experts need "
                              f"(experts, rows, cols) = {(n_expert, rows, cols)}")
        raw = np.asarray(t.data).view(np.uint8).reshape(n_expert, rows, -1)  # (E, rows, bytes_per_row)
        return [QTensor(f"{name}[{e}]", t.tensor_type.name, (rows, cols), raw[e]) for e in range(n_expert)]
    # --8<-- [end:experts]

    def _info(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise StrataError(f"{self.path.name} lacks tensor {name!r}")
        return t

    def has(self, name: str) -> bool:
        return name in self.tensors
