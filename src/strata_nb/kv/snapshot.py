"""Snapshots of the KV cache: its bytes taken to host arrays, and written back.

A restore rewrites the host copy wholesale (or the resident pool), so it resets the slot
table and refills the ring from the host copy: nothing in VRAM can be stale after it.
"""
from __future__ import annotations

import numpy as np

from ..errors import StrataError
from ..kernels.kv.copy_runs import as_words, copy_runs, copy_runs_ref
from ..kernels.kv.ring_restore import ring_restore, ring_restore_ref
from ..kv_layout import BLOCK


# --8<-- [start:snapshot_restore]
def snapshot(cache, end: int, layers: list[int] | None = None) -> dict:
    """The K/V bytes (and QSA's key sketch) of cells [0, end), as host arrays: every layer, or
    the listed ones (the bench's output check compares layer 0)."""
    nb = -(-end // BLOCK)
    cache.sync_from_device()
    saved = []
    for L in (cache.layers if layers is None else [cache.layers[i] for i in layers]):
        src = L.host if cache.streamed else L.pool
        saved.append({f: blocks_on_host(cache.be, a, nb) for f, a in src.items()} |
                     ({"sketch": blocks_on_host(cache.be, L.sketch, nb)} if L.sketch is not None else {}))
    return {"fmt": cache.fmt, "end": end, "layers": saved}


def blocks_on_host(be, a, nb: int) -> np.ndarray:
    """a's first nb blocks as a host array of their own: only those cross from the device."""
    x = be.to_numpy(a[:nb])
    return x.copy() if x.base is not None else x  # a view of a host array (the numpy backend's)


def restore(cache, snap: dict):
    """Rewrite the host copy (or the resident pool) from a snapshot; reset the slot table
    and refill the ring, so nothing in VRAM can be stale."""
    if snap["fmt"] != cache.fmt or len(snap["layers"]) != len(cache.layers):
        raise StrataError("snapshot does not match this cache's format or layer count")
    cache.sync_from_device()
    end_block = -(-snap["end"] // BLOCK)
    if end_block > cache.n_blocks:
        raise StrataError(f"snapshot of {snap['end']} cells does not fit {cache.n_blocks * BLOCK}")
    index = cache.be.asarray(np.arange(end_block, dtype=np.int32))
    for L, saved in zip(cache.layers, snap["layers"]):
        dst = L.host if cache.streamed else L.pool
        for f in dst:
            cache.be.op(copy_runs_ref, copy_runs)(as_words(saved[f]), as_words(dst[f]), index, index)
        if L.sketch is not None:
            cache.be.copy_into(L.sketch[:end_block], saved["sketch"])
        if cache.streamed:
            for f in L.pool:
                cache.be.op(ring_restore_ref, ring_restore)(as_words(L.host[f]), as_words(L.pool[f]), end_block, cache.plan.n_ring)
            L.slots.reset_to_ring(end_block)
            cache.upload_table(L)
# --8<-- [end:snapshot_restore]
