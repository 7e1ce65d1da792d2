"""A decode step's kernel launches, captured once into a CUDA graph and replayed per token.

From Python every Numba launch costs tens of microseconds of host work (argument checks,
marshalling, the driver call); a decode step of the default model is about 400 launches,
so the host, not the GPU, would set the pace. Stream capture records the launches instead
of running them; the instantiated graph then replays all of them with one driver call.

The graph has every argument baked in: array addresses, shapes, scalars. So what changes
per token must live in device memory that the kernels read (the token id, its position,
engine/decode_step.py), and every array allocated during capture must outlive the graph
(`gpu.launch.capturing` collects them in `keep`).
"""
from __future__ import annotations

from numba import cuda

from ..errors import StrataError
from ..gpu.launch import capturing


def _check(result):
    """cuda.bindings calls return (CUresult, *values): raise on an error, return the values."""
    from cuda.bindings import driver as cu

    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise StrataError(f"CUDA graph call failed: {cu.cuGetErrorName(err)[1].decode()}")
    return values[0] if len(values) == 1 else values


# --8<-- [start:step_graph]
class StepGraph:
    """`StepGraph(launch_step)` captures the launches `launch_step()` makes; `replay()`
    runs them again, on the same memory, with one driver call."""

    def __init__(self, launch_step, stream=None):
        """stream: where it replays (capture needs one other than the legacy default);
        None = a new one. Graphs that share a stream replay in the order they are launched."""
        from cuda.bindings import driver as cu

        self._cu = cu
        self.stream = cuda.stream() if stream is None else stream
        self._handle = cu.CUstream(int(self.stream))
        self.keep: list = []  # device arrays the graph reads or writes
        _check(cu.cuStreamBeginCapture(self._handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            # no frees while capturing: a freed temporary's address may be in the graph
            with cuda.defer_cleanup(), capturing(self.stream, self.keep):
                self.result = launch_step()
        finally:
            graph = _check(cu.cuStreamEndCapture(self._handle))
        self._exec = _check(cu.cuGraphInstantiate(graph, 0))

    def replay(self):
        _check(self._cu.cuGraphLaunch(self._exec, self._handle))

    def synchronize(self):
        self.stream.synchronize()
# --8<-- [end:step_graph]
