"""Write a mixture-of-experts GGUF from a dense llama GGUF (`strata-nb moefy`).

No MoE weights small enough to run here are published, so this makes them from the
dense model, in llama.cpp's MoE layout for the llama architecture:

    blk.N.ffn_gate_inp.weight    F32        numpy (E, d)        ggml ne [d, E]: the router
    blk.N.ffn_gate_exps.weight   as dense   numpy (E, ff_e, d)  ne [d, ff_e, E]
    blk.N.ffn_up_exps.weight     as dense   numpy (E, ff_e, d)  ne [d, ff_e, E]
    blk.N.ffn_down_exps.weight   as dense   numpy (E, d, ff_e)  ne [ff_e, d, E]

with llama.expert_count = E, llama.expert_used_count = K and llama.feed_forward_length =
ff_e, one expert's width. Every other tensor and metadata key is copied. Expert weights
are the dense rows' bytes, never requantized:

- split: expert e owns FFN columns [e ff_e, (e+1) ff_e), ff_e = ff / E: its gate and up
  rows are those rows of the dense gate and up, its down is that slice of each dense down
  row, a run of whole quantization blocks (so ff_e must be a multiple of the block, 32).
  The down slice is scaled by E: with K = E and a zero router every expert weighs 1/E,
  so the weighted sum is the dense FFN, and the file is an exact oracle for the MoE path.
  Scaling a block's fp16 scale fields (d, and Q4_1's m) by a power of two is exact, so E
  must be one. With K < E and a random router it checks the routing itself.
- copies: every expert is the whole dense FFN, so any routing whose K weights sum to 1
  gives the dense output: exact for any router, and the experts' load is as skewed as
  the random router makes it (the expert cache's workload).

A truly sparse upcycle (split with K < E) is not a good model: without training, its
perplexity is far worse than the dense model's. These files test machinery, not quality.
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from ..errors import SettingError, StrataError
from .gguf_file import GGUFModel

KINDS = ("split", "copies")
ROUTERS = ("zero", "random")
# the fp16 fields that scale a block's weights: byte offsets inside the block (dequant.py's table)
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,)}
FFN = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")


def moefy(src: str | Path, dst: str | Path | None = None, kind: str = "split", experts: int = 8,
          used: int | None = None, router: str | None = None, seed: int = 0) -> Path:
    """Write the MoE file `dst` (default: <src stem>-<kind>-e<E>k<K>.gguf in the current
    folder) from the dense GGUF `src`; returns its path.

    used (K) defaults to E for split (the exact oracle) and to 2 for copies; router to
    zero when K = E, random otherwise (seeded by `seed`)."""
    model = GGUFModel(src)
    cfg = model.config
    if cfg.n_expert:
        raise StrataError(f"{model.path.name} is already a mixture of {cfg.n_expert} experts")
    used, router = _check(kind, experts, used, router, seed, cfg.d_ff, model.tensor("blk.0.ffn_down.weight").qtype)
    dst = Path(dst if dst is not None else f"{model.path.stem}-{kind}-e{experts}k{used}.gguf")
    if dst.resolve() == model.path.resolve():
        raise SettingError("out", "is the model being read; write the MoE file elsewhere")
    if not dst.parent.is_dir():
        raise SettingError("out", f"names a folder that does not exist: {dst.parent}")
    ff_e = cfg.d_ff // experts if kind == "split" else cfg.d_ff
    rng = np.random.default_rng(seed)

    # written beside its name and renamed when whole: a write that fails (a full disk) or
    # is stopped (Ctrl-C) leaves whatever was at dst, and no half file
    part = dst.with_name(dst.name + ".part")
    try:
        _write(model, part, kind, experts, used, router, ff_e, rng)
        part.replace(dst)
    except OSError as e:
        raise StrataError(f"could not write {dst}: {e.strerror or e}") from None
    finally:
        part.unlink(missing_ok=True)
    return dst


def _write(model: GGUFModel, dst: Path, kind: str, experts: int, used: int, router: str, ff_e: int,
           rng: np.random.Generator):
    cfg = model.config
    arch = model.metadata("general.architecture")
    w = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(model, w, {
        "general.name": (f"{cfg.name} MoE {kind} E{experts} K{used}", gguf.GGUFValueType.STRING),
        f"{arch}.feed_forward_length": (ff_e, gguf.GGUFValueType.UINT32),
        f"{arch}.expert_count": (experts, gguf.GGUFValueType.UINT32),
        f"{arch}.expert_used_count": (used, gguf.GGUFValueType.UINT32),
    })
    tensors = []  # (name, array to write) in file order: a dense FFN tensor becomes its expert tensors
    for t in model.reader.tensors:
        match = FFN.fullmatch(t.name)
        if match is None:
            tensors.append((t.name, t.data, t.tensor_type))
            continue
        layer, which = match.groups()
        raw = model.tensor(t.name).raw  # (rows, bytes_per_row) uint8
        if which == "gate":
            tensors.append((f"blk.{layer}.ffn_gate_inp.weight", _router(router, experts, cfg.d_model, rng),
                            gguf.GGMLQuantizationType.F32))
        tensors.append((f"blk.{layer}.ffn_{which}_exps.weight", _expert_rows(raw, t.tensor_type.name, which, kind,
                                                                            experts), t.tensor_type))
    for name, data, qtype in tensors:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, data, _ in tensors:
            w.write_tensor_data(np.ascontiguousarray(data))
    finally:
        w.close()  # a write that failed closes the file too, before moefy removes it


def _check(kind: str, experts: int, used: int | None, router: str | None, seed: int, d_ff: int, qtype: str):
    """Every setting the file needs, checked before writing: -> (used, router)."""
    if seed < 0:
        raise SettingError("seed", f"must be >= 0, got {seed}")
    if kind not in KINDS:
        raise SettingError("kind", f"{kind!r} is not one of {', '.join(KINDS)}")
    if experts < 2:
        raise SettingError("experts", f"must be at least 2, got {experts}")
    used = (experts if kind == "split" else 2) if used is None else used
    if not 1 <= used <= experts:
        raise SettingError("used", f"must be 1 .. the number of experts ({experts}), got {used}")
    router = ("zero" if used == experts else "random") if router is None else router
    if router not in ROUTERS:
        raise SettingError("router", f"{router!r} is not one of {', '.join(ROUTERS)}")
    if router == "zero" and used < experts:
        raise SettingError("router", f"zero ties every expert, so which {used} of {experts} a token takes "
                                     "is undefined; use random (or use every expert)")
    if kind == "split":
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
        if d_ff % experts or (d_ff // experts) % block:
            fits = [e for e in range(2, d_ff // block + 1) if d_ff % (e * block) == 0 and not e & (e - 1)]
            raise SettingError("experts", f"{experts} does not split the FFN's {d_ff} columns into whole "
                                          f"{qtype} blocks of {block} (the down projection is sliced along its "
                                          f"rows' blocks, so ff / E must be a multiple of {block}); "
                                          f"these do: {', '.join(map(str, fits)) or 'none'}")
        if experts & (experts - 1):
            raise SettingError("experts", f"{experts} is not a power of two: split scales each expert's down "
                                          "projection by E, which is exact (the oracle) only for a power of two")
        if qtype not in SCALE_FIELDS and qtype not in ("F32", "F16"):
            raise StrataError(f"the FFN's down projection is {qtype}; split scales only F32, F16, "
                              f"{', '.join(SCALE_FIELDS)} rows exactly")
    return used, router


def _copy_metadata(model: GGUFModel, w: gguf.GGUFWriter, changed: dict):
    """Every key of the source but the writer's own (GGUF.*, general.architecture), with
    `changed` {key: (value, type)} replacing or adding keys."""
    changed = dict(changed)
    for field in model.reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in changed:
            w.add_key_value(field.name, *changed.pop(field.name))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in changed.items():
        w.add_key_value(key, value, vtype)


def _router(router: str, experts: int, d: int, rng) -> np.ndarray:
    # (E, d) float32. Random: N(0, 1/d) entries, so a logit's spread is about the normed
    # input's RMS and the top few experts stand out by a margin
    if router == "zero":
        return np.zeros((experts, d), np.float32)
    return (rng.standard_normal((experts, d)) / np.sqrt(d)).astype(np.float32)


# --8<-- [start:expert_rows]
def _expert_rows(raw: np.ndarray, qtype: str, which: str, kind: str, experts: int) -> np.ndarray:
    """One dense FFN matrix's GGUF rows (rows, bytes_per_row) uint8 -> the expert tensor's
    rows (E, rows_e, bytes_e) uint8, sliced byte for byte."""
    rows, row_bytes = raw.shape
    if kind == "copies":
        return np.broadcast_to(raw, (experts, rows, row_bytes))
    if which in ("gate", "up"):  # (ff, b) -> (E, ff_e, b): expert e's rows are the next ff_e
        return raw.reshape(experts, rows // experts, row_bytes)
    # down (d, B), each row ff values in blocks -> (E, d, B / E): expert e's run of blocks in every row
    slices = raw.reshape(rows, experts, row_bytes // experts).transpose(1, 0, 2)
    return _scaled(slices, qtype, experts)
# --8<-- [end:expert_rows]


def _scaled(raw: np.ndarray, qtype: str, factor: int) -> np.ndarray:
    """GGUF rows (..., bytes) whose every weight is `factor` (a power of two) times raw's:
    the fp16 scale fields of each block (or the values themselves) times factor, which is
    exact unless one overflows fp16, and then this refuses."""
    out = np.array(raw)  # a copy: raw is a view of the source's memory map
    if qtype in ("F32", "F16"):
        values = out.view(np.float32 if qtype == "F32" else np.float16)
        fields = [(values, values.copy())]
    else:
        block = out.reshape(*out.shape[:-1], -1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
        fields = [(f, f.copy()) for f in (block[..., at:at + 2].view(np.float16) for at in SCALE_FIELDS[qtype])]
    for field, before in fields:
        field *= field.dtype.type(factor)
        if not np.isfinite(field[np.isfinite(before)]).all():
            raise StrataError(f"scaling the down projection's {qtype} rows by {factor} overflows "
                              f"{field.dtype.name}: this model cannot be split exactly into {factor} experts")
    return out
