"""A decode step whose inputs live in device memory, so it can be replayed from a graph.

The host path (`Engine.decode_one_token`) hands each step its token and position as NumPy
arrays, which every launch copies over. Here they stay on the device:

    token (1,) int32   the id going in; the step's argmax writes the greedy pick over it
    pos   (1,) int32   its position; the step's last launch adds 1
    the block list     what attention reads: every block of a resident cache (the kernel
                       skips those after the query), or the step's own selection
                       (kv/step_blocks.py: StepBlocks)

so one step's launches are the same every token and can be captured once into a CUDA graph
(fast/cuda_graph.py) and replayed. Early in a resident cache the list is narrower: only
its first blocks, so few that the step attention runs its build for two thread blocks an
SM (fast/attention_step.py). So the step keeps a graph per list width, two
at most, and replays the one for the position. Greedy decode, and temperature / top-p sampling
(drawn on the device from a seed and the position), then never wait on the host between
steps: `run_ahead` queues the next step before it reads this one's 4-byte pick from mapped
memory. Top-k sampling reads the logits back and writes its token over `token`, one
step at a time (`run`).

A streamed or QSA cache makes its per-step decisions on the device too: the ring follows
the position (fast/map_ring.py), the step selects its blocks
(fast/select_blocks.py), and a selected block that is not in VRAM is read in
place from the host copy instead of being copied into a slot first. The host maps the
first step's block before the first replay, and takes the maps and counters back before
its next decision (KVCache.before_device_steps, KVCache.sync_from_device). Without a GPU
(the simulator) or with `--no-graph`, `run` launches the same kernels one by one: the
tests check that path against the host path.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..backend import FAST_TIERS, gpu_present
from ..errors import StrataError
from ..gpu.launch import stream
from ..fast.advance_step import advance_step, advance_step_ref
from ..kernels.step.argmax import argmax, argmax_ref
from ..kernels.step.sample_top_p import sample_top_p, sample_top_p_ref
from ..kv_layout import BLOCK
from .forward import forward

PICK_RING = 4  # slots of the mapped pick ring: run_ahead has at most two steps in flight


# --8<-- [start:device_step]
class DeviceStep:
    def __init__(self, be, weights, kv, use_graph: bool, sampling=None, seed: int = 0):
        """sampling: None or temperature 0 = greedy; temperature > 0 without top-k = drawn
        on the device (kernels/step/sample_top_p.py, with `seed` and the position); with top-k
        the host samples from `logits_on_host()` and `picks` is False."""
        self.be, self.weights, self.kv = be, weights, kv
        greedy = sampling is None or sampling.temperature == 0
        self.draw = None if greedy or sampling.top_k else (
            np.float32(1 / sampling.temperature), np.float32(sampling.top_p), seed & 0xFFFFFFFF)
        self.picks = greedy or self.draw is not None  # is run()'s token the one to use?
        self.token = be.asarray(np.zeros(1, np.int32))
        self.pos = be.asarray(np.zeros(1, np.int32))
        self.chosen = be.host_array((PICK_RING,), np.int32)  # mapped: step p's pick at p % PICK_RING
        self.use_graph = use_graph and gpu_present()
        # a graph per list width (kv/step_blocks.py: width_for), each captured on the second
        # step at that width: the first compiles every kernel it launches
        self.graphs = {}
        self.graph = None  # the last queued step's graph, None while its width has none
        self.widths_launched = set()  # the list widths a step has been launched at, kernel by kernel
        self.logits = None  # (1, vocab) device array the step writes
        self._next = None  # (token, pos) the device buffers hold now

    @staticmethod
    def supported(be, kv) -> bool:
        return be.kernels in FAST_TIERS and kv.step is not None

    def launch(self):
        """The step's launches: the forward pass, the pick (greedy or drawn), advance."""
        logits = forward(self.be, self.weights, self.kv, self.token, self.pos, prompt=False)
        if self.draw is None:
            self.be.op(argmax_ref, argmax)(logits, self.token)
        else:
            inv_temperature, top_p, seed = self.draw
            self.be.op(sample_top_p_ref, sample_top_p)(logits[0], inv_temperature, top_p, seed, self.pos, self.token)
        self.be.op(advance_step_ref, advance_step)(self.token, self.pos, self.chosen)
        return logits

    def run(self, token: int, pos: int) -> int:
        """Decode `token` at `pos`; returns the step's pick (logits in `self.logits`)."""
        self._write_inputs(token, pos)
        return self._pick(pos, self._queue(pos))

    # --8<-- [start:run_ahead]
    def run_ahead(self, token: int, pos: int, n: int):
        """Decode `token` at `pos`, then each pick at the next position: n steps, whose picks
        are yielded one at a time (usable when `picks`: the device chose every token).

        Step k + 1 is queued before step k's pick is read, so the GPU goes from one step
        straight to the next while the host reads, detokenizes and checks for a stop.
        Closing the generator early (a stop token) leaves one step run past the last pick
        read: its cells lie after the sequence's end, to be written over by whatever comes
        next at that position, and the device buffers then hold its output (`next_input`
        says so). `self.logits` is the last queued step's."""
        if n <= 0:
            return
        self._check_position(pos + n - 1)  # before anything runs
        self._write_inputs(token, pos)
        queued = [(pos, self._queue(pos))]
        try:
            for k in range(n):
                if k + 1 < n:
                    queued.append((pos + k + 1, self._queue(pos + k + 1)))
                at, done = queued.pop(0)
                yield self._pick(at, done)
        finally:
            for at, done in queued:  # the step queued past the last pick read
                self._pick(at, done)
    # --8<-- [end:run_ahead]

    def seek(self, token: int, pos: int):
        """Make `token` at `pos` the next step's input: the next `run(*next_input)` or
        `run_ahead(*next_input, n)` decodes from there (the profile measures every way of
        running from one position)."""
        self._write_inputs(token, pos)
        self._next = (token, pos)

    def forget_inputs(self):
        """The next run writes its token and position (and lets the cache prepare for
        device steps) even where the buffers hold them: a prefill ran since the last step."""
        self._next = None

    def _check_position(self, pos: int):
        if not 0 <= pos < self.kv.n_blocks * BLOCK:  # the kernels do not bounds-check positions
            raise StrataError(f"position {pos} is outside the KV cache's {self.kv.n_blocks * BLOCK} cells")

    def _write_inputs(self, token: int, pos: int):
        self._check_position(pos)
        if self._next != (token, pos):  # a sampled token, or the first step: write the inputs
            self.be.copy_into(self.token, np.array([token], np.int32))
            self.be.copy_into(self.pos, np.array([pos], np.int32))
            self.kv.before_device_steps(pos)

    def _queue(self, pos: int):
        """The launches of the step at `pos`, queued: replayed from the graph of its list
        width once there is one (captured on the second step at that width: the first
        compiles every kernel). Returns an event that fires when the step is done."""
        if self.weights.experts is not None:
            self.weights.experts.after_pass()  # the expert cache adapts between steps, not inside one
        blocks = self.kv.step
        width = blocks.width_for(pos)
        if width not in self.graphs and self.use_graph and width in self.widths_launched:
            from ..fast.cuda_graph import StepGraph

            self.be.synchronize()
            with blocks.narrowed(width):
                self.graphs[width] = StepGraph(self.launch)  # records the launches; runs nothing
        self.graph = self.graphs.get(width)
        if self.graph is not None:
            self.logits = self.graph.result
            self.graph.replay()
            on = self.graph.stream
        else:
            with blocks.narrowed(width):
                self.logits = self.launch()
            self.widths_launched.add(width)
            on = stream()
        self.kv.device_pass_queued()
        done = cuda.event()
        done.record(on)
        return done

    def _pick(self, pos: int, done) -> int:
        """Wait for the step at `pos`, then read its pick from the mapped ring."""
        done.synchronize()
        picked = int(self.chosen[pos % len(self.chosen)])
        self._next = (picked, pos + 1)
        return picked

    @property
    def next_input(self) -> tuple[int, int]:
        """(token, pos) the device buffers hold: the last pick at the next position."""
        return self._next

    def logits_on_host(self) -> np.ndarray:
        return self.be.to_numpy(self.logits)[-1]
# --8<-- [end:device_step]
