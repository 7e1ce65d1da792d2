"""Is a configuration's output right? Its first greedy tokens against the numpy backend.

Greedy tokens from two backends need not be identical: their logits differ by float
rounding, and with a quantized KV cache a rounding difference can flip a stored code. So
the check is teacher-forced: the numpy backend, with the same settings, scores the
configuration's own tokens, and each token must be numpy's top pick or within `GAP_TOL`
logits of it, a near tie. A broken kernel picks tokens the reference puts far down (a
garbled cache, a dropped mirror), and the row is marked broken.

Some configurations are chaotic: with a q4_0 cache 8K tokens deep, one code flipped by
rounding changes later tokens' K and V, which flips more codes in later layers. The numpy
backend against itself, with prefill chunks of 2,048 and 256 (nothing changed but the
order of float sums), differs in 71% of layer 29's V bytes (`tools/kv_divergence.py`
measures it). There a correct run can land more than GAP_TOL below the reference. So when
a token is further than GAP_TOL, the reference runs again with two other prefill chunks,
and its **spread** is measured: how far its own gap for the same tokens moves. The row is
broken when a gap exceeds GAP_TOL + spread. For fp16 or int8 the spread is near 0 and
the check keeps its resolution; where it is large, the table shows it beside the gap,
and the check can say no more than that.

A second, sharp test does not depend on tokens at all: layer 0's K/V bytes for the
prompt. They come from the embedding, one norm, one matrix product and RoPE, so rounding
changes a byte only where a value sits on a rounding boundary, which is rare. A writer
that drops the host copy's bytes, or garbles a block, changes a whole field there. More
than `LAYER0_TOL` of any field's bytes differing marks the row broken, however chaotic
its tokens are.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

GAP_TOL = 1.0  # logits below numpy's top that a token may be and still count as a near tie
# Prefill chunks of the references run when a gap exceeds GAP_TOL: the first two that the
# check's own reference does not use
ALT_CHUNKS = (1024, 256, 2048, 512)
LAYER0_TOL = 0.01  # fraction of a field's layer-0 prompt bytes that may differ (rounding ties)


@dataclass
class Check:
    tokens: int  # how many were checked
    exact: int  # tokens that are numpy's top pick
    max_gap: float  # the largest (numpy's top logit - numpy's logit of our token)
    broken: bool
    spread: float | None = None  # the reference's own spread, measured when a gap exceeds GAP_TOL
    layer0: float | None = None  # the largest fraction of a field's layer-0 prompt bytes that differ

    def as_dict(self) -> dict:
        return asdict(self)


# --8<-- [start:check_tokens]
def gaps_of(ref_logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """For each token: the reference's top logit minus its logit for that token."""
    rows = np.asarray(ref_logits, np.float32)[: len(tokens)]
    return rows.max(axis=1) - rows[np.arange(len(tokens)), tokens]


def check_tokens(ref_logits: np.ndarray, tokens: list[int], spread: float | None = None) -> Check:
    """ref_logits[i]: the numpy backend's logits for the position token i was picked at."""
    gaps = gaps_of(ref_logits, tokens)
    tolerance = GAP_TOL + (spread or 0.0)
    return Check(len(tokens), int((gaps == 0).sum()), float(gaps.max()), bool((gaps > tolerance).any()), spread)


def cells_of(a: np.ndarray, end: int) -> np.ndarray:
    """(n_blocks, n_kv, BLOCK, per_head) -> (end, n_kv, per_head): cells in position order."""
    return a.transpose(0, 2, 1, 3).reshape(-1, a.shape[1], a.shape[3])[:end]


def byte_differences(mine: dict, ref: dict, end: int) -> dict:
    """{field: fraction of differing bytes} in cells [0, end), over the K/V fields of one
    layer of two snapshots (KVCache.snapshot); the QSA key sketch is not K/V bytes."""
    return {f: float((cells_of(mine[f], end).view(np.uint8) != cells_of(ref[f], end).view(np.uint8)).mean())
            for f in ref if f not in ("sketch",)}


def layer0_difference(mine: dict, ref: dict, end: int) -> float:
    """The largest fraction of differing bytes over the K/V fields of two layer-0 snapshots."""
    return max(byte_differences(mine, ref, end).values())


def reference_spread(ref_logits: np.ndarray, alt_logits: np.ndarray, tokens: list[int]) -> float:
    """How far the reference's gap for the same tokens moves between two references that
    differ only in rounding (another prefill chunk): the largest |gap - alt gap|."""
    return float(np.abs(gaps_of(ref_logits, tokens) - gaps_of(alt_logits, tokens)).max())


def reference_logits(ref_engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The numpy engine's logits for each of `tokens`, teacher-forced: the prompt's last
    row, then each earlier token through a decode step (block selection included)."""
    rows = [ref_engine.prefill(prompt)]
    for i, token in enumerate(tokens[:-1]):
        rows.append(ref_engine.decode_one_token(token, len(prompt) + i))
    return np.stack(rows)
# --8<-- [end:check_tokens]


# ---- checks run in worker processes, beside the GPU timing -----------------------------
# The reference is the numpy backend on the CPU: seconds per check at 8K tokens. Worker
# processes run the checks while the main process times the GPU, each with a share of
# the CPU's cores for its BLAS.
_ENGINE = None  # this worker's numpy engine, built on its first job


def check_job(base_settings: dict, changes: dict, prompt: list[int], tokens: list[int],
              layer0: dict | None = None) -> dict:
    """The check of one row: its tokens against the reference, and its layer-0 prompt bytes
    (KVCache.snapshot(len(prompt), [0])'s layer) against the reference's, when given."""
    global _ENGINE
    from ..backend.numpy_backend import NumpyBackend
    from ..engine.engine import Engine
    from ..model.gguf_file import GGUFModel
    from ..settings import Settings

    if _ENGINE is None:
        settings = Settings(**(base_settings | {"device": "cpu"}))
        _ENGINE = Engine(settings, GGUFModel(settings.model), NumpyBackend())
    ref = _ENGINE.derive(**changes)
    rows = reference_logits(ref, prompt, tokens)
    check = check_tokens(rows, tokens)
    if check.broken:  # a chaotic configuration, or a broken one: how far does the reference itself move?
        chunks = [c for c in ALT_CHUNKS if c != ref.settings.prefill_chunk][:2]
        spread = max(reference_spread(rows, reference_logits(_ENGINE.derive(**changes, prefill_chunk=c), prompt,
                                                             tokens), tokens) for c in chunks)
        check = check_tokens(rows, tokens, spread)
    if layer0 is not None:  # the decode steps above wrote only cells after the prompt
        check.layer0 = layer0_difference(layer0, ref.kv.snapshot(len(prompt), [0])["layers"][0], len(prompt))
        check.broken = check.broken or check.layer0 > LAYER0_TOL
    return check.as_dict()


def check_pool(workers: int):
    """A process pool for check_job; BLAS threads are split between the workers."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    threads = str(max(1, (os.cpu_count() or 2) // (workers + 1)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads  # read by the workers' NumPy when it loads
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
