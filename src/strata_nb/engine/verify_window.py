"""A verify window whose inputs live in device memory, so it can be replayed from a graph.

`Engine.verify` runs a window's positions as one forward pass launched from the host:
about 400 launches of tens of microseconds each, far longer than the GPU takes to run
them. As `DeviceStep` does for one token (decode_step.py), the window keeps what changes
from pass to pass in device memory that the kernels read:

    tokens     (T,) int32  the window: the token at pos, then the drafts
    positions  (T,) int32  pos, pos + 1, ..., pos + T - 1
    last       (1,) int32  the window's last real row: the rows after it are padding
    picks      (T,) int32  mapped host memory: each position's greedy pick (its argmax)

so every window's launches are the same, captured once into a CUDA graph
(fast/cuda_graph.py) and replayed. A pass always has T = --spec rows: a window with
fewer drafts is padded with its last token, and the padded positions are computed and
written like rejected drafts' cells, to be written over by the next pass. The expert
cache counts the real rows only (`last`), as a decode step would count them.

What a window reads is decided on the device, per query, as a decode step decides it
(kv/step_blocks.py): every block of a resident cache, or each query's own selection
(QSA, or every block up to it when streamed), with blocks not in VRAM read in place from
the host copy. The pass's first append points each layer's ring at the window's last
block (fast/map_ring.py); a window of T <= 16 cells enters a new block at its first
cell, so there is nothing older in that block to refill. Before a window that does not
follow the cache's last device pass, the host maps the ring onto pos's block itself
(KVCache.before_device_steps), as before a decode step.

Without a GPU (the simulator) or with --no-graph, `run` launches the same kernels one by
one; the tests check that path against the one-token path.
"""
from __future__ import annotations

import numpy as np

from ..backend import FAST_TIERS, gpu_present
from ..kernels.step.argmax import argmax, argmax_ref
from ..kv_layout import BLOCK
from .forward import forward


# --8<-- [start:verify_window]
class VerifyWindow:
    def __init__(self, be, weights, kv, width: int, use_graph: bool):
        self.be, self.weights, self.kv, self.width = be, weights, kv, width
        self.tokens = be.asarray(np.zeros(width, np.int32))
        self.positions = be.asarray(np.zeros(width, np.int32))
        self.last = be.asarray(np.zeros(1, np.int32))
        self.picks = be.host_array((width,), np.int32)  # mapped: the pass writes its picks here
        self.use_graph = use_graph and gpu_present()
        self.graph = None  # captured on the second pass: the first compiles every kernel
        self.launched = False
        self.next_pos = None  # where a window that follows this one's last pass starts

    @staticmethod
    def supported(be, kv) -> bool:
        return be.kernels in FAST_TIERS and kv.step is not None

    def fits(self, pos: int) -> bool:
        """Do T cells from pos fit the cache? (The kernels do not bounds-check positions.)"""
        return 0 <= pos and pos + self.width <= self.kv.n_blocks * BLOCK

    def launch(self):
        """The pass's launches: the forward pass over T rows, each row's argmax."""
        logits = forward(self.be, self.weights, self.kv, self.tokens, self.positions, prompt=False, all_logits=True,
                         last=self.last)
        self.be.op(argmax_ref, argmax)(logits, self.picks)

    def run(self, window: list[int], pos: int) -> np.ndarray:
        """One pass over `window` (the token at pos, then at most T - 1 drafts) at pos,
        pos + 1, ...: every position's greedy pick (len(window),). The cells are written;
        the caller closes the window with kv.keep and starts the next pass at the first
        position it did not keep."""
        assert 1 <= len(window) <= self.width and self.fits(pos), (len(window), pos)
        padded = np.array(window + [window[-1]] * (self.width - len(window)), np.int32)
        self.be.copy_into(self.tokens, padded)
        self.be.copy_into(self.positions, np.arange(pos, pos + self.width, dtype=np.int32))
        self.be.copy_into(self.last, np.array([len(window) - 1], np.int32))
        if pos != self.next_pos:  # the last device pass was not this window's predecessor
            self.kv.before_device_steps(pos)
        if self.weights.experts is not None:
            self.weights.experts.after_pass()  # the expert cache adapts between passes, not inside one
        self.kv.open_window()  # a verify window's appends (captured so: the graph replays them as such)
        if self.graph is None and self.use_graph and self.launched:
            from ..fast.cuda_graph import StepGraph

            self.be.synchronize()
            self.graph = StepGraph(self.launch)  # records the launches; runs nothing
        if self.graph is not None:
            self.graph.replay()
            self.graph.synchronize()
        else:
            self.launch()
            self.launched = True
            self.be.synchronize()
        self.kv.device_pass_queued()
        self.next_pos = None  # until the caller says how many it kept (kept)
        return np.array(self.picks[:len(window)])

    def capture(self, token: int, pos: int):
        """Capture the graph now (a pass to compile, a pass captured), so no timed pass pays
        for it: both passes run `token` at pos and write cells from pos, which the first
        real pass at pos writes over, as it would a rejected draft's."""
        while self.use_graph and self.graph is None and self.fits(pos):
            self.run([token], pos)

    def kept(self, pos: int, n: int):
        """The window at pos kept its first n cells: the next pass starts at pos + n."""
        self.next_pos = pos + n
# --8<-- [end:verify_window]
