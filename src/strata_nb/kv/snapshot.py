"""Snapshots of the KV cache: its bytes taken to host arrays, and written back.

A restore rewrites the host copy wholesale (or the resident pool), so it resets the slot
table and refills the ring from the host copy: nothing in VRAM can be stale after it.
A sliding-window layer's ring (kv/cache.py) is taken and put back whole: it holds the
last blocks, the only ones the layer reads again.
"""
from __future__ import annotations

import numpy as np

from ..errors import StrataError
from ..kernels.kv.copy_runs import as_words
from ..kernels.kv.ring_restore import ring_restore, ring_restore_ref
from ..kv_layout import BLOCK


# --8<-- [start:snapshot_restore]
def snapshot(cache, end: int, layers: list[int] | None = None, into: np.ndarray | None = None) -> dict:
    """The K/V bytes (and QSA's key sketch) of cells [0, end), as host arrays: every layer, or
    the listed ones (the bench's output check compares layer 0). into: a uint8 host buffer
    of snapshot_nbytes(cache, end) bytes to hold them (the conversation cache's pinned
    range, serve/host_arena.py); None: new arrays."""
    nb = -(-end // BLOCK)
    cache.sync_from_device()
    taken = cache.layers if layers is None else [cache.layers[i] for i in layers]
    sources, rows = [fields(cache, L) for L in taken], [kept_blocks(L, nb) for L in taken]
    if into is None:
        saved = [{f: blocks_on_host(cache.be, a, n) for f, a in src.items()} for src, n in zip(sources, rows)]
    else:
        places = iter(carve(into, [((n,) + a.shape[1:], a.dtype) for src, n in zip(sources, rows)
                                   for a in src.values()]))
        saved = [{f: next(places) for f in src} for src in sources]
        cache.be.copy_batch([(saved_layer[f], a) for src, saved_layer in zip(sources, saved)
                             for f, a in src.items()], to_host=True)  # each a's first nb blocks
    return {"fmt": cache.fmt, "end": end, "layers": saved}


def fields(cache, L) -> dict:
    """A layer's arrays a snapshot takes: the host copy's (or the resident pool's) and the sketch."""
    src = dict(L.host if cache.streamed and not L.ring else L.pool)
    if L.sketch is not None:
        src["sketch"] = L.sketch
    return src


def kept_blocks(L, nb: int) -> int:
    """The rows of a layer's arrays a snapshot of nb blocks takes: nb, or a ring's slots."""
    return min(nb, L.ring) if L.ring else nb


def snapshot_nbytes(cache, end: int) -> int:
    """The bytes of a buffer that snapshot(cache, end, into=...) fills."""
    nb = -(-end // BLOCK)
    return sum(aligned(kept_blocks(L, nb) * (a.nbytes // a.shape[0]))
               for L in cache.layers for a in fields(cache, L).values())


def blocks_on_host(be, a, nb: int) -> np.ndarray:
    """a's first nb blocks as a host array of their own: only those cross from the device."""
    x = be.to_numpy(a[:nb])
    return x.copy() if x.base is not None else x  # a view of a host array (the numpy backend's)


ALIGN = 256  # every field of a snapshot's buffer starts on a multiple of this


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def carve(buffer: np.ndarray, shapes: list) -> list[np.ndarray]:
    """Arrays of the given (shape, dtype)s laid one after another in `buffer` (uint8), each
    at an ALIGN boundary."""
    out, at = [], 0
    for shape, dtype in shapes:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out.append(buffer[at:at + n].view(dtype).reshape(shape))
        at += aligned(n)
    assert at <= buffer.nbytes, f"a snapshot of {at} bytes does not fit a buffer of {buffer.nbytes}"
    return out


def restore(cache, snap: dict):
    """Rewrite the host copy (or the resident pool) from a snapshot; reset the slot table
    and refill the ring, so nothing in VRAM can be stale."""
    if snap["fmt"] != cache.fmt or len(snap["layers"]) != len(cache.layers):
        raise StrataError("snapshot does not match this cache's format or layer count")
    cache.sync_from_device()
    end_block = -(-snap["end"] // BLOCK)
    if end_block > cache.n_blocks:
        raise StrataError(f"snapshot of {snap['end']} cells does not fit {cache.n_blocks * BLOCK}")
    # The saved blocks go back to where a snapshot took them from, the host copy or the
    # resident pool (slot b holds block b there), one copy an array, all in one batch
    to_store = []
    for L, saved in zip(cache.layers, snap["layers"]):
        to_store += [(saved[f], a) for f, a in fields(cache, L).items()]
    cache.be.copy_batch(to_store, to_host=False)
    if cache.streamed:  # the ring, from the host copy just written
        for L in (L for L in cache.layers if not L.ring):
            for f in L.pool:
                cache.be.op(ring_restore_ref, ring_restore)(as_words(L.host[f]), as_words(L.pool[f]), end_block, cache.plan.n_ring)
            L.slots.reset_to_ring(end_block)
            cache.upload_table(L)
# --8<-- [end:snapshot_restore]
