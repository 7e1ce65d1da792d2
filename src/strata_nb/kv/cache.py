"""The KV cache: every layer's pool, page table and, when streaming, host copy and slots.

Fully resident (`--kv-resident 0`): a layer's pool has a slot for every block of the
context and its page table is the identity. A sliding-window layer (Gemma 3's local
layers) reads only its last `window` positions, so its pool is a ring of a few more
blocks than the window, block b in slot b % ring, resident whatever `--kv-resident` says:
streaming and QSA are for the layers that see the whole context. Streaming (`--kv-resident N`): the host copy
holds every block and is authoritative; the pool holds the ring (recent window) and the
slot pool (older blocks, CLOCK); a prompt chunk attends over a staging pool. The engine
above only calls `append` and `attend`; both modes run the same kernels on the same bytes,
so their attention outputs are bitwise equal.

A decode step replayed from a CUDA graph passes its position in device memory. Then the
ring moves and the blocks are selected on the device (`StepBlocks`), misses are read in
place from the host copy, and the host takes the maps back before its next decision.
"""
from __future__ import annotations

import numpy as np

from ..backend import FAST_TIERS
from ..kernels.attention.attention import attention, attention_ref
from ..kernels.kv.copy_runs import as_words, copy_runs, copy_runs_ref
from ..kernels.kv.hadamard import hadamard, hadamard_ref
from ..kernels.kv.key_sketch import sketch_shape
from ..kernels.step.block_scores import block_scores, block_scores_ref
from ..fast.map_ring import map_ring, map_ring_ref
from ..kernels.step.select_rows import select_rows, select_rows_ref, select_width
from ..kv_layout import (BLOCK, all_blocks_upto, blocks_in_window, kv_block_bytes, pool_arrays, ring_blocks, rotates,
                         shared_blocks_upto)
from . import snapshot
from .plan import StreamPlan
from .slots import SlotTable, StreamCounters
from .step_blocks import StepBlocks
from .writer import Append, KVDest


class LayerKV(KVDest):
    """One layer: the pool ("VRAM", by slot), its page table, the host copy (by block)."""

    def __init__(self, be, fmt, n_kv, head_dim, n_blocks, plan: StreamPlan | None, qsa: bool, maps=None,
                 window: int = 0, ring: int = 0, pool: dict | None = None):
        """maps: streaming, this layer's rows of the cache's device maps (page table, slot ->
        block), as SlotTable starts them: nothing mapped. window: a sliding-window layer's
        (its queries see their last `window` positions), else 0; ring: its slots, block b
        in slot b % ring (0: a slot for every block), with neither plan nor QSA. pool: the
        layer's pool arrays when the cache holds them (KVCache.stacked), else made here."""
        assert not ring or (plan is None and not qsa), "a ring layer neither streams nor selects"
        self.window, self.ring = window, ring
        arrays = pool_arrays(fmt, head_dim)
        # --8<-- [start:ring_pool]
        n_slots = ring or (n_blocks if plan is None else plan.n_ring + plan.n_pool)
        pool = pool or {a.field: be.zeros((n_slots, n_kv, BLOCK, a.per_head), a.dtype) for a in arrays}
        host = None if plan is None else {
            a.field: be.host_array((n_blocks, n_kv, BLOCK, a.per_head), a.dtype) for a in arrays}
        self.slots = None if plan is None else SlotTable(n_blocks, plan.n_ring, plan.n_pool)
        # slot -> block, the page table's inverse, in device memory too: a replayed step
        # moves the ring there (fast/map_ring.py)
        table, self.slot_block = (be.asarray(np.arange(n_blocks, dtype=np.int32) % n_slots), None) if plan is None \
            else maps
        # --8<-- [end:ring_pool]
        super().__init__(pool, table, host)
        # QSA's key sketch: every cell's K in q4_0, in VRAM for the whole context
        self.sketch = be.zeros(sketch_shape(n_blocks, n_kv, head_dim), np.uint8) if qsa else None


class KVCache:
    def __init__(self, be, cfg, settings, rows_alone: bool = False):
        """rows_alone: prompt attention gives each query the bits it gets in any chunk
        (fast/attention_prefill.py: attention_prompt), as the forward pass's
        other prompt ops then do (engine/prompt_chunk.py says why)."""
        self.be, self.cfg, self.fmt = be, cfg, settings.kv
        self.rows_alone = rows_alone
        self.fault, self.qsa_budget = settings.fault, settings.qsa_budget
        self.window_blocks = settings.kv_window // BLOCK
        self.n_blocks = -(-settings.max_context // BLOCK)
        self.plan = StreamPlan.from_settings(settings, self.n_blocks)
        self.block_bytes = kv_block_bytes(self.fmt, cfg.n_kv_heads, cfg.head_dim)
        # Streaming: every layer's maps are rows of one device array each, so a replayed step
        # moves all the rings in one launch (fast/map_ring.py)
        self.maps = None if self.plan is None else tuple(
            be.asarray(np.full((cfg.n_layers, n), -1, np.int32))
            for n in (self.n_blocks, self.plan.n_ring + self.plan.n_pool))
        # --8<-- [start:rings]
        # a sliding-window layer's ring, where it is smaller than the context
        ring = ring_blocks(cfg.window, max(settings.prefill_chunk or 256, settings.spec + 1)) if cfg.window else 0
        ring = ring if ring < self.n_blocks else 0
        # Fully resident without rings, every layer's pool is one row of an array per field:
        # the megakernel's step (fast/mega/) reaches every layer's cells through one argument
        self.stacked = None if self.plan is not None or ring else {
            a.field: be.zeros((cfg.n_layers, self.n_blocks, cfg.n_kv_heads, BLOCK, a.per_head), a.dtype)
            for a in pool_arrays(self.fmt, cfg.head_dim)}
        self.layers = [LayerKV(be, self.fmt, cfg.n_kv_heads, cfg.head_dim, self.n_blocks,
                               None if cfg.local(i) and ring else self.plan,
                               qsa=self.qsa_budget > 0 and not (cfg.local(i) and ring),
                               maps=None if self.maps is None else (self.maps[0][i], self.maps[1][i]),
                               window=cfg.window if cfg.local(i) else 0, ring=ring if cfg.local(i) else 0,
                               pool=None if self.stacked is None else {f: a[i] for f, a in self.stacked.items()})
                       for i in range(cfg.n_layers)]
        # --8<-- [end:rings]
        identity = be.asarray(np.arange(self.n_blocks, dtype=np.int32))
        self.stage = None if self.plan is None else KVDest(
            {f: be.zeros((self.n_blocks,) + tuple(a.shape[1:]), a.dtype)
             for f, a in self.layers[0].pool.items()}, identity, None)
        self._counters = StreamCounters()
        self.step = StepBlocks(be, self) if be.kernels in FAST_TIERS else None  # the fast tier's replayed steps
        self._device_newer = False  # a replayed step moved the ring or counted lookups on the device
        self._hadamard = be.op(hadamard_ref, hadamard)
        self._attention = be.op(attention_ref, attention)
        self._block_row = be.asarray(np.arange(self.n_blocks, dtype=np.int32).reshape(1, -1))  # (1, n_blocks)
        self._positions = (None, None)  # (NumPy positions, their device copy): _on_device's one entry
        self._window = False  # a verify window is open (open_window)

    def _on_device(self, positions):
        """positions on the backend, uploaded once per forward pass: every layer's append and
        attend get the same NumPy array, and each upload from pageable memory waits for the
        GPU's queue to drain. A device array (a replayed step's) is returned as it is."""
        if not isinstance(positions, np.ndarray):
            return positions
        if self._positions[0] is not positions:
            self._positions = (positions, self.be.asarray(positions))
        return self._positions[1]

    @property
    def streamed(self) -> bool:
        return self.plan is not None

    @property
    def counters(self) -> StreamCounters:
        """The streaming counters, with what replayed steps counted on the device."""
        self.sync_from_device()
        return self._counters

    def describe(self) -> str:
        rings = [L for L in self.layers if L.ring]
        local = f"; {len(rings)} sliding-window layers keep a ring of {rings[0].ring * BLOCK} cells" if rings else ""
        if not self.streamed:
            return f"KV fully resident: {self.n_blocks * BLOCK} cells per layer in VRAM{local}"
        host_bytes = self.block_bytes * self.n_blocks * (len(self.layers) - len(rings))
        return (f"KV streaming: {self.plan.resident_cells} of {self.n_blocks * BLOCK} cells per layer in VRAM, "
                f"the K/V in {host_bytes / 2**30:.2f} GiB of pinned RAM{local}")

    # ---- the two verbs the forward pass calls -------------------------------------------
    # --8<-- [start:append]
    def append_to(self, layer: int, positions, prompt: bool) -> Append:
        """Make room for cells at `positions` (n,) and say where they go: the forward pass
        hands this to the q|k|v product, which writes its k and v there (kv/writer.py).

        positions: NumPy int32, or a device array in a replayed decode step (DeviceStep)."""
        L = self.layers[layer]
        pos = self._on_device(positions)
        on_device = not isinstance(positions, np.ndarray)  # a replayed decode step
        stage = None
        if self.streamed and on_device:
            if layer == 0:  # the pass's first append moves every layer's ring, on the device, onto
                # its last cell's block: a window of T <= BLOCK cells enters a new block at its first cell
                self.be.op(map_ring_ref, map_ring)(pos[len(pos) - 1:], *self.maps, self.plan.n_ring)
        elif self.streamed and not L.ring:
            self.sync_from_device()
            first, last = int(positions[0]), int(positions[-1])
            refill = L.slots.map_ring(first, last)  # the ring follows the writes
            self._move(L.host, L.pool, refill)
            self._counters.refills += len(refill)
            self.upload_table(L)
            if prompt:  # the stage receives the blocks before the chunk from the host copy
                before = -(-first // BLOCK)
                self._move(L.host, self.stage.pool, [(b, b) for b in range(before)])
                self._counters.staged_blocks += before
                stage = self.stage
        # host copy always, slot if resident; QSA's key sketch with them
        return Append(self.fmt, L, pos, stage, self.fault, L.sketch, self._window and not prompt)

    # --8<-- [start:window]
    def open_window(self):
        """The next forward pass is a verify window: its cells are written as every
        writer's are (host copy always, slot if resident, the key sketch). A rejected cell
        is simply written over by the next window, its sketch with it."""
        self._window = True

    def keep(self, n: int):
        """Close the window, keeping its first n cells: the rest lie past the next
        window's first position, which writes over them."""
        self._window = False
    # --8<-- [end:window]

    def append(self, layer: int, positions, k, v, prompt: bool):
        """k, v (n, n_kv, hd) float32 after RoPE, at `positions` (n,) -> the cache (the
        writer rotates them where the format rotates)."""
        self.append_to(layer, positions, prompt).write(self.be, k, v)
    # --8<-- [end:append]

    # --8<-- [start:attend]
    def attend(self, layer: int, q, positions, prompt: bool):
        """q (n, n_heads, hd) float32 at `positions` -> attention output (n, n_heads, hd)."""
        if "q" in rotates(self.fmt):
            q = self._hadamard(q)  # <Hq, Hk> = <q, k>: the rotation cancels in the scores
        L = self.layers[layer]
        on_device = not isinstance(positions, np.ndarray)  # positions in device memory: a replayable pass
        if on_device and prompt:  # a prompt chunk (engine/prompt_chunk.py): the whole row of blocks, cut
            assert not self.streamed, "a prompt chunk in device memory is for a resident cache"  # by the positions
            blocks, src = self._block_row, L
        elif on_device:  # a decode step or a verify window
            assert self.step is not None, "device positions are for the cuda backend"
            blocks, src = self.step.select(L, q, positions), L  # misses are read in place
        elif prompt:  # a prompt chunk reads every earlier cell: the pool, or the stage when streaming
            # blocks 0..last as one row every query shares, a view of a device array made once;
            # a sliding-window layer's from its first query's window on (a ring holds no more)
            blocks = shared_blocks_upto(positions, self._block_row)
            if L.window:
                blocks = blocks[:, max(int(positions[0]) - L.window + 1, 0) // BLOCK:]
            src = self.stage if self.streamed and not L.ring else L
        else:
            blocks, src = self.select(L, q, positions), L
            if self.streamed and not L.ring:
                self.sync_from_device()
                copies = L.slots.resolve(blocks, self._counters)
                self._move(L.host, L.pool, copies)
                self._counters.copies += len(copies)
                self.upload_table(L)
        out = self.be.empty(q.shape, np.float32)
        # blocks go as they are (NumPy, or the step's device list): the cuda launcher
        # looks at a NumPy selection to put queries that share it in one thread block
        # rotate_out: attention mixed rotated V rows, so H (= H^-1) brings the output back,
        # applied by the kernel that writes it
        # ordered: a step's device list ascends, -1 padded at the end, as NumPy ones do
        # rows_alone: a prompt cell's bytes do not depend on the chunk that computed it
        # window: a sliding-window layer's queries see only their last `window` positions
        self._attention(self.fmt, q, self._on_device(positions), blocks, src.page_table, src.pool, src.host, out,
                        rotate_out="v" in rotates(self.fmt), ordered=True, rows_alone=prompt and self.rows_alone,
                        window=L.window)
        return out
    # --8<-- [end:attend]

    # --8<-- [start:select]
    def select(self, L, q, positions) -> np.ndarray:
        """(n_q, max_sel) int32, -1 padded: every block up to each query (in a sliding-window
        layer, those of its window), or QSA's picks from the blocks' scores (select_rows_ref,
        the host policy)."""
        if L.window:
            return blocks_in_window(positions, L.window)
        if self.qsa_budget == 0:
            return all_blocks_upto(positions)
        positions = np.asarray(positions, np.int32)
        scores = self.be.empty((q.shape[0], self.n_blocks), np.float32)
        self.be.op(block_scores_ref, block_scores)(q, L.sketch, positions, self.window_blocks, scores)
        rows = np.empty((q.shape[0], select_width(self.n_blocks, self.window_blocks, self.qsa_budget)), np.int32)
        self.be.op(select_rows_ref, select_rows)(scores, positions, self.window_blocks, self.qsa_budget, rows)
        return np.ascontiguousarray(rows[:, :int((rows >= 0).sum(axis=1).max())])  # as wide as select_rows_ref's
    # --8<-- [end:select]

    # ---- movers: every one copies the format's runs, none knows a format ----------------
    # --8<-- [start:move]
    def _move(self, src: dict, dst: dict, pairs):
        """Copy blocks from src's arrays into dst's: pairs [(src block, dst block), ...]."""
        if not pairs:
            return
        src_index = self.be.asarray(np.array([s for s, _ in pairs], np.int32))
        dst_index = self.be.asarray(np.array([d for _, d in pairs], np.int32))
        for field in dst:
            self.be.op(copy_runs_ref, copy_runs)(as_words(src[field]), as_words(dst[field]), src_index, dst_index)
        self._counters.bytes_moved += len(pairs) * self.block_bytes
    # --8<-- [end:move]

    def upload_table(self, L):
        self.be.copy_into(L.page_table, L.slots.page_table)
        self.be.copy_into(L.slot_block, L.slots.slot_block)

    # ---- replayed decode steps: the host hands over, then takes back ----------------------
    # --8<-- [start:device_steps]
    def before_device_steps(self, pos: int):
        """Before replayed steps start at `pos`: the host maps the ring onto pos's block,
        refilling it if the ring had left it, so every replayed step after enters its
        blocks at their first cell (fast/map_ring.py)."""
        if not self.streamed:
            return
        self.sync_from_device()
        for L in self.layers:
            if L.ring:
                continue
            refill = L.slots.map_ring(pos, pos)
            self._move(L.host, L.pool, refill)
            self._counters.refills += len(refill)
            self.upload_table(L)

    def device_pass_queued(self):
        """Told by whoever queues a pass with device positions (a decode step, a verify
        window), launched or replayed from a graph: it may move the ring and count lookups
        on the device, so the next host decision syncs first. A replay runs no Python, so
        the launches themselves cannot say so."""
        if not self.step.dense_resident:
            self._device_newer = True

    def sync_from_device(self):
        """After replayed steps: the host's maps take the device's (the ring moved there) and
        the counters take the device's counts. Every host decision starts here, so none is
        made on stale maps, the kind of drift that leaves a slot read as another block."""
        if not self._device_newer:
            return
        self._device_newer = False
        if self.streamed:  # every layer's maps in one copy each: they are rows of self.maps
            page_tables, slot_blocks = (self.be.to_numpy(m) for m in self.maps)
            for L, page_table, slot_block in zip(self.layers, page_tables, slot_blocks):
                if L.ring:
                    continue
                L.slots.page_table[:] = page_table
                L.slots.slot_block[:] = slot_block
            looked, missing, selections = (int(c) for c in self.be.to_numpy(self.step.counts))
            self._counters.lookups += looked
            self._counters.misses += missing
            self._counters.in_place += missing  # a replayed step reads every miss in place
            self._counters.steps += selections
        self.be.copy_into(self.step.counts, np.zeros(3, np.int64))
    # --8<-- [end:device_steps]

    # ---- snapshots: kv/snapshot.py ------------------------------------------------------
    def snapshot(self, end: int, layers: list[int] | None = None, into=None) -> dict:
        return snapshot.snapshot(self, end, layers, into)

    def snapshot_nbytes(self, end: int) -> int:
        return snapshot.snapshot_nbytes(self, end)

    def parking_memory(self, nbytes: int):
        """Host memory for parked snapshots: pinned on a GPU (serve/host_arena.py)."""
        return self.be.pinned_bytes(nbytes)

    def restore(self, snap: dict):
        snapshot.restore(self, snap)
