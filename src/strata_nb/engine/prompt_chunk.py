"""Prompt chunks whose inputs live in device memory, so they can be replayed from graphs,
and prompt cells whose bytes do not depend on the chunk that computed them.

A prompt chunk launched from the host costs about 400 launches and as many device
arrays, tens of milliseconds of Python whatever the chunk's size: on a GPU the host, not
the GPU, sets the pace of a prefill, and of a follow-up turn whose few new tokens are one
short chunk. As `DeviceStep` does for a decode step (decode_step.py), a chunk here keeps
what changes from chunk to chunk in device memory that the kernels read:

    tokens     (W,) int32  the chunk's ids, padded with its last one
    positions  (W,) int32  start, start + 1, ..., start + W - 1
    last       (1,) int32  the chunk's last real row, whose logits the pass makes

and attention reads the whole cache's row of blocks, each query cut at its position. So
every chunk of width W makes the same launches, captured once into a CUDA graph
(fast/cuda_graph.py) and replayed.

Widths: a chunk has `--prefill-chunk` tokens but the last, and the last is padded up to
the next width of a short ladder (16, 32, 64, ... below the chunk size), so a handful of
graphs serve every prompt. The padded rows come after the real ones, so no real row sees
them; their cells lie past the prompt's end, to be written over by whatever comes next
at those positions, as a rejected draft's are. A chunk whose padding would pass the
cache's end runs from the host (`fits`), as does every chunk of a streamed cache (its
chunks first stage the blocks before them from the host copy, a host decision).

Rows alone. Padding, and a conversation cache that resumes a prompt anywhere, both need
a prompt row to come out the same whatever chunk it is in. On this path it does
(`KVCache.rows_alone`): every product takes the tiled matmul, even for 3 rows
(`CudaBackend.rows_alone`), and prompt attention splits each query's cells at fixed
blocks from block 0 (attention_prefill.py: `attention_prompt`). The numpy backend's
BLAS makes no such promise, so its conversation cache resumes at whole chunks
(serve/conversations.py).

Without a GPU (the simulator) or with --no-graph, the same launches run one by one; the
tests check them against the host path and the numpy backend.
On a GPU this path is the default for a resident cache; under the simulator the engine
takes the host path unless a test sets `_ON` (a simulated row alone is slow to compute).
"""
from __future__ import annotations

import numpy as np

from ..backend import FAST_TIERS, gpu_present
from ..gpu.geometry import SIMULATED
from ..kv_layout import BLOCK
from .forward import forward

MIN_WIDTH = 16  # the narrowest width: one graph for every tail of up to 16 tokens


# One value a process: a cache's prompt rows computed alone and in a chunk's company
# differ in their last bits, so an engine keeps the value it was made with.
_ON = not SIMULATED


def enabled() -> bool:
    """Whether a cuda engine's resident cache computes prompt rows alone and replays its
    prompt chunks (on a GPU; under the simulator where a test asks)."""
    return _ON


# --8<-- [start:widths]
def width_for(n: int, chunk: int) -> int:
    """The rows a chunk of n tokens runs as: the chunk size for a full chunk, else the
    smallest power of two >= n (at least MIN_WIDTH), else the chunk size."""
    if n >= chunk:
        return chunk
    width = MIN_WIDTH
    while width < n:
        width *= 2
    return min(width, chunk)


def ladder(chunk: int) -> list[int]:
    """Every width a chunk may run as."""
    return sorted({width_for(n, chunk) for n in range(1, chunk + 1)})
# --8<-- [end:widths]


class ChunkPass:
    """One width's device inputs, and its graph once captured."""

    def __init__(self, be, width: int):
        self.width = width
        self.tokens = be.asarray(np.zeros(width, np.int32))
        self.positions = be.asarray(np.zeros(width, np.int32))
        self.last = be.asarray(np.zeros(1, np.int32))
        self.graph = None
        self.logits = None  # (1, vocab) device array the pass writes


# --8<-- [start:prompt_chunks]
class PromptChunks:
    # (width, weights, format, QSA, experts) whose launches this process has made one by
    # one: their kernels are compiled, so a chunk of that kind can be captured at once, by
    # any engine sharing the weights (a graph must not compile: the bench's runs are new
    # engines). Each key's weights are kept alive with it, so their id is never reused.
    _launched: dict = {}

    def __init__(self, be, weights, kv, chunk: int, use_graph: bool):
        self.be, self.weights, self.kv, self.chunk = be, weights, kv, chunk
        self.use_graph = use_graph and gpu_present()
        self.passes: dict[int, ChunkPass] = {}
        self._stream = None  # every width's graph replays on one stream, in launch order
        self._kind = (id(weights.token_embd), kv.fmt, kv.qsa_budget > 0, weights.experts is not None)

    @staticmethod
    def supported(be, kv) -> bool:
        return be.kernels in FAST_TIERS and kv.rows_alone and not kv.streamed

    def fits(self, start: int, n: int) -> bool:
        """Do the padded chunk's cells fit the cache? (The kernels do not bounds-check positions.)"""
        return 0 <= start and start + width_for(n, self.chunk) <= self.kv.n_blocks * BLOCK

    def run(self, ids, start: int) -> np.ndarray:
        """ids (n <= chunk) at start, start + 1, ... through every layer: the last one's
        logits (vocab,). Their cells are written, and the padding's after them."""
        n = len(ids)
        assert 1 <= n <= self.chunk and self.fits(start, n), (n, start)
        width = width_for(n, self.chunk)
        p = self._pass(width)
        padded = np.full(width, ids[-1], np.int32)
        padded[:n] = ids
        self.be.copy_into(p.tokens, padded)  # from pageable memory: waits for the passes before
        self.be.copy_into(p.positions, np.arange(start, start + width, dtype=np.int32))
        self.be.copy_into(p.last, np.array([n - 1], np.int32))
        self._capture(p)
        if p.graph is not None:
            p.graph.replay()
            p.graph.synchronize()
        else:
            with self.be.deferred_frees():
                p.logits = self.launch(p)
            PromptChunks._launched[(width, *self._kind)] = self.weights.token_embd
        logits = self.be.to_numpy(p.logits)[0]
        if self.weights.experts is not None:
            self.weights.experts.after_pass(prompt=True)  # the expert cache adapts between passes
        return logits

    def prepare(self, n: int, start: int = 0):
        """Capture now the graphs a prefill of n tokens from `start` will replay, where this
        process has launched their kind already: a timed prefill then pays for none (the
        bench's, as its decode steps are timed after the step's graph is captured).
        Capturing runs nothing."""
        for at in range(start, start + n, self.chunk):
            m = min(self.chunk, start + n - at)
            if self.fits(at, m):
                self._capture(self._pass(width_for(m, self.chunk)))

    def warm(self, token: int):
        """Launch, capture and replay every width of the ladder that fits the cache, from
        position 0, so that a server's first requests replay too (`strata-nb serve`, at
        start). The cells are written over by the first prompt."""
        for width in ladder(self.chunk):
            if self.fits(0, width):
                for _ in range(2):  # launched one by one, then captured and replayed
                    self.run([token] * width, 0)

    def _pass(self, width: int) -> ChunkPass:
        if width not in self.passes:
            self.passes[width] = ChunkPass(self.be, width)
        return self.passes[width]

    def _capture(self, p: ChunkPass):
        """Capture p's graph if there is none yet and its kind's kernels are made."""
        if p.graph is not None or not self.use_graph or (p.width, *self._kind) not in PromptChunks._launched:
            return
        from numba import cuda

        from ..fast.cuda_graph import StepGraph

        if self._stream is None:
            self._stream = cuda.stream()
        self.be.synchronize()
        p.graph = StepGraph(lambda: self.launch(p), self._stream)  # records the launches; runs nothing
        p.logits = p.graph.result

    def launch(self, p: ChunkPass):
        return forward(self.be, self.weights, self.kv, p.tokens, p.positions, prompt=True, last=p.last)
# --8<-- [end:prompt_chunks]
