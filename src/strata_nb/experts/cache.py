"""The expert cache: every expert's weights in the host copy, the hot ones in VRAM slots.

    host copy   every expert of every layer, (L * E, rows, bytes) per matrix: pinned,
                device-mapped memory on the cuda backend, so a kernel reads a missing
                expert's rows in place over the bus (kernels/experts/expert_rows.py)
    slot pool   N slots in VRAM, each one expert's gate|up and down matrices; where the
                cache can miss on the cuda backend, E transit slots after them, which a
                prompt chunk's missed experts are copied into once (never in res)
    res         the residency table, (L * E,) int32 in device memory: expert
                layer * E + e's slot, or -1; the kernels look each chosen expert up there
    lookups,    (L * E,) int32 in device memory: the router kernel counts each token's
    hits        choice of an expert, and whether it was resident (only ever growing)

Every `adapt_every` passes (a decode step, a verify window), and after every prompt chunk,
`after_pass` reads the counters, asks the policy (policy.py) which experts to move, and
moves them in an order that keeps every step right: first the evicted experts' entries
become -1 (their slots are read by no later step), then the weights are copied into the
slots, then the new entries point at them. A copy counts as resident only after it lands.
On the cuda backend all three are queued on the legacy stream, which orders them after the
steps already queued and before any step queued later; on the numpy backend they happen in
that order. The kernels read the same bytes from a slot as from the host copy, so output
does not depend on the cache.

The host does not wait for the GPU to adapt between decode steps: the counters it plans
from were read back at the previous adapt (a copy queued then, landed by now), so a decode
step is queued while the one before still runs, as without a cache. The policy sees the
lookups of all but the last `adapt_every` passes. After a prompt chunk it reads them
now (the host waits for the chunk), so the reply's first steps find the prompt's experts.

`fault="expert-early-resident"` is the teaching switch for the race the order prevents:
the entries point at the slots before the copies are made, and the copies land only after
the next pass has read the slots.

On the numpy backend the host copy and slots hold the dequantized float32 matrices (the
form its ops take); the bytes counted as moved are the GGUF bytes either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SettingError
from ..gpu.launch import view_bytes
from ..kernels.kv.copy_runs import as_words, copy_runs, copy_runs_ref
from ..model.gguf_file import GGUFModel
from .policy import DECAY, plan_moves


@dataclass(slots=True)
class ExpertStats:
    lookups: int = 0  # expert lookups: a token choosing an expert, in a layer
    hits: int = 0  # lookups of an expert that was in a slot
    bytes_moved: int = 0  # GGUF bytes copied into slots
    copies: int = 0  # experts copied into slots (into an empty slot, or a swap)
    swaps: int = 0  # copies that evicted another expert

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def since(self, before: "ExpertStats") -> "ExpertStats":
        return ExpertStats(*(getattr(self, f) - getattr(before, f) for f in self.__slots__))

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__} | {"hit_rate": self.hit_rate}


# --8<-- [start:expert_cache]
class ExpertCache:
    def __init__(self, be, model: GGUFModel, n_slots: int, adapt_every: int = 4, adapt_swaps: int = 96,
                 fault: str = "none"):
        cfg = model.config
        self.be, self.fault = be, fault
        self.n_layers, self.n_expert, self.k = cfg.n_layers, cfg.n_expert, cfg.n_expert_used
        self.adapt_every, self.adapt_swaps = adapt_every, adapt_swaps
        n = self.n_layers * self.n_expert
        self.n_slots = min(n_slots, n)
        gate_up, down, self.qtype = _stacked(model)  # (L * E, 2F, bytes), (L * E, D, bytes) uint8
        self.expert_bytes = gate_up[0].nbytes + down[0].nbytes
        self.host_gate_up, self.host_down = be.expert_host_copy(gate_up, self.qtype), be.expert_host_copy(down, self.qtype)
        # Where a miss crosses a bus (the cuda backend), a prompt chunk copies each expert it
        # misses once into one of E transit slots after the N (fast/fetch_misses.py)
        self.transit = self.n_slots  # the first transit slot
        self.n_transit = self.n_expert if be.misses_cross_a_bus and self.n_slots < n else 0
        self.slot_gate_up = be.expert_slots(self.n_slots + self.n_transit, self.host_gate_up)  # (N + transit, 2F, *)
        self.slot_down = be.expert_slots(self.n_slots + self.n_transit, self.host_down)  # (N + transit, D, *)
        # each matrix as rows of 4-byte words, host copy and slot pool: what a move copies
        # (copy_runs.py) and a prompt chunk's misses are fetched from and into
        self.words = (as_words(self.host_gate_up), as_words(self.host_down), as_words(self.slot_gate_up),
                      as_words(self.slot_down)) if self.n_slots + self.n_transit else ()
        self._runs = [(self.words[0], self.words[2]), (self.words[1], self.words[3])] if self.n_slots else []
        # the moves' (expert, slot) lists, in mapped memory the copy kernel reads in place
        self._moves = be.host_array((2, max(1, self.n_slots)), np.int32)
        self._moves_index = view_bytes(self._moves, np.int32)  # the same memory, as the kernel takes it
        self.res_host = np.full(n, -1, np.int32)  # the host's view of res, which it alone changes
        self.res = be.asarray(self.res_host.copy())  # (L * E,) int32: slot or -1
        # res as a move's two copies write it (evicted, then filled), and the counters read
        # back, in pinned memory the queued copies read and write when they run
        self._tables = [be.pinned_bytes(4 * n).view(np.int32) for _ in range(2)]
        self._counts = be.pinned_bytes(4 * n).view(np.int32)
        self._counted = None  # the mark after the last read back of the counters (and the moves before it)
        self.lookups = be.zeros((n,), np.int32)
        self.hits = be.zeros((n,), np.int32)
        self.usage = np.zeros(n)  # decayed lookups (policy.py)
        self._seen = np.zeros(n, np.int64)  # lookups at the last adapt
        self._passes = 0
        self._late: list = []  # the fault's copies, made after the next pass
        self.moved = ExpertStats()  # bytes_moved, copies, swaps so far (lookups/hits: read from the device)
        if self.n_slots == n:  # every expert fits: all resident from the start, nothing to adapt
            self._move([(i, i, -1) for i in range(n)])

    @property
    def can_miss(self) -> bool:
        """Fewer slots than experts: a lookup can miss (the expert kernels then stage a
        miss's rows; with every expert in a slot they are built without that code)."""
        return self.n_slots < len(self.res_host)

    def at(self, layer: int) -> int:
        """Layer `layer`'s first entry in res and the counters."""
        return layer * self.n_expert

    def after_pass(self, prompt: bool = False):
        """Called once per forward pass, before the next is queued: adapt when one is due,
        every `adapt_every` passes and after every prompt chunk. A chunk's lookups are many
        tokens' choices, the best guess of what the reply will choose, so the reply's first
        steps find its experts in their slots."""
        if self._late:
            self._settled()  # the moves lists are free to write
            self._copy(self._late)
            self._late = []
        self._passes += 1
        if self.n_slots and self.n_slots < len(self.res_host) and (prompt or self._passes % self.adapt_every == 0):
            self.adapt(now=prompt)

    def adapt(self, now: bool = True):
        """Move experts by the counters read back at the last adapt, or (now, or at the
        first adapt) by the counters as they are now: the host waits for the passes queued."""
        if now or self._counted is None:
            self._read_back()
        self._settled()  # the last adapt's moves have run, and the counters read then have landed
        lookups = self._counts.astype(np.int64)
        self.usage += lookups - self._seen
        self._seen = lookups
        self._move(plan_moves(self.usage, self.res_host, self.n_slots, self.adapt_swaps))
        self.usage *= DECAY
        self._read_back()  # for the next adapt, queued after this one's moves

    def _read_back(self):
        self.be.queue_copy(self._counts, self.lookups)
        self._counted = self.be.queue_mark()

    def _settled(self):
        """Wait for the last read back's mark: then every move queued before it has run, and
        its pinned tables and moves lists may be written again."""
        if self._counted is not None:
            self._counted.synchronize()

    # --8<-- [start:move]
    def _move(self, moves):
        """Copy each (expert, slot, evicted) in; the order is what makes it safe (module docstring)."""
        if not moves:
            return
        evicted_table, filled_table = self._tables
        for _, _, evicted in moves:
            if evicted >= 0:
                self.res_host[evicted] = -1
        evicted_table[...] = self.res_host
        self.be.queue_copy(self.res, evicted_table)  # 1. no step reads an evicted expert's slot
        if self.fault == "expert-early-resident":
            self._late = moves  # the copies land after the next pass has read the slots
        else:
            self._copy(moves)  # 2. the weights land in the slots
        for expert, slot, _ in moves:
            self.res_host[expert] = slot
        filled_table[...] = self.res_host
        self.be.queue_copy(self.res, filled_table)  # 3. only then do the entries point at them
        self.moved.copies += len(moves)
        self.moved.swaps += sum(evicted >= 0 for _, _, evicted in moves)
        self.moved.bytes_moved += len(moves) * self.expert_bytes
    # --8<-- [end:move]

    # --8<-- [start:copy]
    def _copy(self, moves):
        """The moves' weights into their slots: per matrix, one launch of the KV movers'
        copy kernel (kernels/kv/copy_runs.py), its threads reading the mapped host copy
        over the bus, queued behind the steps already queued; the host does not wait.
        The (expert, slot) lists go through mapped memory too, with no copy of their own:
        no earlier fill still reads them, because every adapt first waits for the mark
        queued after the last one's moves (`_settled`)."""
        n = len(moves)
        self._moves[:, :n] = np.array(moves, np.int32)[:, :2].T
        for host, slot_pool in self._runs:
            self.be.op(copy_runs_ref, copy_runs)(host, slot_pool, self._moves_index[0, :n], self._moves_index[1, :n])
    # --8<-- [end:copy]

    def stats(self) -> ExpertStats:
        lookups, hits = (int(self.be.to_numpy(a).astype(np.int64).sum()) for a in (self.lookups, self.hits))
        return ExpertStats(lookups, hits, self.moved.bytes_moved, self.moved.copies, self.moved.swaps)

    def describe(self) -> str:
        n = len(self.res_host)
        return (f"expert cache: {self.n_slots} of {n} experts in VRAM slots ({self.n_layers} layers x {self.n_expert}, "
                f"{self.expert_bytes / 2**20:.2f} MiB each); the rest read from pinned host memory")
# --8<-- [end:expert_cache]


def _stacked(model: GGUFModel):
    """Every layer's experts as two uint8 stacks of GGUF rows, layer-major: entry
    layer * E + e is expert e of that layer. -> (gate_up (L * E, 2F, bytes),
    down (L * E, D, bytes), qtype)."""
    cfg = model.config
    e, d, ff = cfg.n_expert, cfg.d_model, cfg.d_ff
    gate_up, down, qtypes = [], [], set()
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        gates = model.experts(p + "ffn_gate_exps.weight", e, ff, d)
        ups = model.experts(p + "ffn_up_exps.weight", e, ff, d)
        downs = model.experts(p + "ffn_down_exps.weight", e, d, ff)
        for g, u, dn in zip(gates, ups, downs):
            qtypes |= {g.qtype, u.qtype, dn.qtype}
            gate_up.append(np.concatenate([g.raw, u.raw]))
            down.append(dn.raw)
    if len(qtypes) != 1:
        raise SettingError("model", f"the expert tensors mix types ({', '.join(sorted(qtypes))}); the expert cache "
                                    "holds one type")
    return np.stack(gate_up), np.stack(down), qtypes.pop()


def expert_slots_for(setting, be, model: GGUFModel, reserve_mib: int) -> int:
    """--expert-cache: an int N, or "auto": every expert on the numpy backend, and on the
    cuda backend as many as the free VRAM holds after reserve_mib."""
    cfg = model.config
    n = cfg.n_layers * cfg.n_expert
    if setting != "auto":
        return int(setting)
    free = be.free_memory()
    if free is None:
        return n
    g, dn = (model.experts(f"blk.0.ffn_{m}_exps.weight", cfg.n_expert, r, c)[0]
             for m, r, c in (("gate", cfg.d_ff, cfg.d_model), ("down", cfg.d_model, cfg.d_ff)))
    per_expert = 2 * g.raw.nbytes + dn.raw.nbytes
    fits = (free - reserve_mib * 2**20) // per_expert
    if fits < n and be.misses_cross_a_bus:  # the cache can miss: E transit slots come out of it
        fits -= cfg.n_expert
    return max(0, min(n, fits))
