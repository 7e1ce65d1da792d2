"""The cuda backend, fast tier (`--kernels fast`, the default on a GPU): the plain backend
(backend/cuda_backend.py) with each of the forward pass's compound verbs fused into one
launch, and every op a kernel of the fast tier where it has one.

A decode step (<= 8 rows) runs the norm before a product, RoPE and the fp16 append after
q|k|v, the gate before down and the residual adds as one matvec launch each
(fast/matvec_fused.py), each reading the next product's weights into L2 ahead; a prompt
chunk's products run on tensor cores where the GPU has them. `op()` hands the engine's
other launches (attention, the appends, QSA) to their fast twins (twins.py). Copies to and
from the host are queued on the stream as driver copies, so the host does not wait.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import cuda

from ..backend.cuda_backend import CudaBackend, DeviceMatrix
from ..errors import StrataError
from ..kernels.dense.matvec import MAX_ROWS
from . import gguf_fetch, matmul_mma, matmul_tiled
from .expert_down import expert_down
from .expert_gate_up import expert_gate_up
from .fetch_misses import fetch_misses
from .matvec_fused import matvec, matvec_fused
from .route import route
from ..fast import dependent_launch, fast_launch, tensor_core
from ..gpu.geometry import SIMULATED
from ..gpu.launch import device_empty
from .twins import fast_or_plain, load_twins


def _rows(matrix: DeviceMatrix | None):
    return None if matrix is None else matrix.raw


class FastCudaBackend(CudaBackend):
    kernels = "fast"
    qtypes = gguf_fetch.QTYPES  # the types with two-step dequantizers; the plain tier reads the rest
    _mma: bool | None = None  # prompt matmuls on tensor cores: _tensor_cores() asks once

    def __init__(self):
        super().__init__()
        load_twins()  # every fast module imported: each registers its twins as it loads
        fast_launch.install()  # kernel[...] packs its arguments itself after its first launch (fast_launch.py)

    _tiled_from = MAX_ROWS + 1  # rows from which a product takes the tiled matmul

    def _tiled(self, x) -> bool:
        return x.shape[0] >= self._tiled_from

    @contextmanager
    def rows_alone(self, on: bool):  # the fast backend's switch: rows from which the tiled matmul runs
        """Within it (on): every product takes the tiled matmul and its separate norm, RoPE
        and append kernels, whatever its rows, so a prompt chunk of 3 rows computes each
        row as one of 300 does (engine/prompt_chunk.py says why that matters)."""
        before = self._tiled_from
        if on:
            self._tiled_from = 1
        try:
            yield
        finally:
            self._tiled_from = before

    def check_model(self, cfg, qsa: bool, max_context: int = 0):
        """The step kernels are compiled for a range of shapes (head_dim, query heads per KV
        head, and KV heads for QSA's scores), and a step's merge holds a bounded number of
        splits: a model or a context outside them stops here, with the range, and not at
        its first launch; so does a mixture of more experts than the router kernel holds."""
        from . import attention_step

        if cfg.arch != "llama":
            raise StrataError(f"the fast tier runs llama models; this one is {cfg.arch} (use --kernels plain)")
        super().check_model(cfg, qsa, max_context)
        group = cfg.n_heads // cfg.n_kv_heads
        if cfg.head_dim not in attention_step.HEAD_DIMS or group > attention_step.MAX_GROUP:
            raise StrataError(f"the cuda backend's attention is built for head_dim in {attention_step.HEAD_DIMS} "
                              f"and at most {attention_step.MAX_GROUP} query heads per KV head; this model has "
                              f"head_dim {cfg.head_dim} and {group} (use --device cpu)")
        most = attention_step.max_cells(cfg.head_dim, group)
        if max_context > most:
            raise StrataError(f"the cuda backend's step attention takes at most {most:,} cells for this model's heads "
                              f"({group} query heads per KV head of {cfg.head_dim}); --max-context is {max_context:,} "
                              f"(lower it, or use --device cpu)")

    def dependent_launches(self) -> str:
        """'on' when marked kernels launch as dependent (fast/dependent_launch.py), 'off' when
        dependent_launch.dependent_launches(False) turned them off, else 'unavailable: ' and why."""
        if not dependent_launch.enabled():
            return "off"
        if SIMULATED:
            return "unavailable: the simulator runs one launch after another"
        why = fast_launch.dependent_launch_support()
        return "on" if not why else f"unavailable: {why}"

    def prompt_kernels(self, head_dim: int) -> str:
        """What a prompt chunk's matmuls and attention run on: 'tensor cores'
        (matmul_mma.py, attention_prefill_mma.py; on a GPU of compute capability 8.0 and up),
        else 'plain' (matmul.py, attention_prefill.py), with why where a GPU has none."""
        from . import attention_prefill_mma

        if not tensor_core.enabled():
            return "plain"
        why = tensor_core.available()
        if why:
            return f"plain (no tensor cores: {why})"
        why = attention_prefill_mma.usable(head_dim)
        return f"tensor cores for the matmuls, plain attention ({why})" if why else "tensor cores"

    def copy_batch(self, pairs, to_host: bool):
        """For every (host, device) pair of arrays: host <- the device array's first host.nbytes
        bytes (to_host), else those bytes <- host. A snapshot's fields are the first blocks of
        each pool array (or host copy array: `device` may be mapped host memory), so this is
        how they cross.

        A Numba copy waits for itself, and a Numba slice (`a[:nb]`) is ~0.1 ms of Python: a
        parked conversation of the default model is 60 of each (30 layers x K and V), ~10
        ms where the bus needs 2 (94 MB of pinned memory at ~50 GB/s, H100). So on a GPU the
        copies are queued from the arrays' addresses on the legacy stream as asynchronous
        driver copies, and the batch waits once; the device is idle before and after, as it
        is around a plain copy."""
        if SIMULATED:  # every array is the simulator's, and the copies are Numba's own
            return super().copy_batch(pairs, to_host)
        from cuda.bindings import driver as cu

        from .cuda_graph import _check

        cuda.synchronize()  # the kernels that write or read these arrays are done
        for host, device in pairs:
            nbytes = host.nbytes
            assert host.flags["C_CONTIGUOUS"] and device.flags["C_CONTIGUOUS"] and device.nbytes >= nbytes
            if isinstance(device, np.ndarray):  # a mapped host copy: on the host already
                if to_host:
                    host[...] = device[:len(host)]
                else:
                    device[:len(host)] = host
                continue
            address = device.__cuda_array_interface__["data"][0]
            if to_host:
                _check(cu.cuMemcpyDtoHAsync(host.ctypes.data, address, nbytes, 0))
            else:
                _check(cu.cuMemcpyHtoDAsync(address, host.ctypes.data, nbytes, 0))
        cuda.synchronize()

    def queue_copy(self, dst, src):
        """dst <- src, one a device array and the other pinned host memory of the same
        bytes, queued on the legacy stream: after every launch queued before it and before
        every launch queued after (a step's, a graph's), and the host does not wait. The
        host array is read, or written, when the copy runs: leave it alone until a later
        `queue_mark` has fired."""
        if SIMULATED:  # the simulator's arrays, and every launch has run already
            return super().queue_copy(dst, src)
        from cuda.bindings import driver as cu

        from .cuda_graph import _check

        assert dst.nbytes == src.nbytes and dst.flags["C_CONTIGUOUS"] and src.flags["C_CONTIGUOUS"]
        if isinstance(dst, np.ndarray):
            _check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src.__cuda_array_interface__["data"][0], dst.nbytes, 0))
        else:
            _check(cu.cuMemcpyHtoDAsync(dst.__cuda_array_interface__["data"][0], src.ctypes.data, dst.nbytes, 0))

    def queue_mark(self):
        """An event on the legacy stream: its synchronize() returns once everything queued
        so far has run."""
        if SIMULATED:  # every launch has run already
            return super().queue_mark()
        mark = cuda.event(timing=False)
        mark.record(cuda.legacy_default_stream())
        return mark

    def op(self, ref, launcher):
        """Which of a kernel file's two functions this backend runs: the launcher's fast
        twin where the fast tier has one (twins.py), else the plain launcher."""
        return fast_or_plain(launcher)

    # ---- ops: the plain backend's, fused ----------------------------------------------
    # --8<-- [start:fast_ops]
    def matmul(self, x, w: DeviceMatrix):
        # x (n, in) float32, w (out, in) -> (n, out): matvec for a step or verify window,
        # the tiled matmul for a prompt chunk
        y = device_empty((x.shape[0], w.shape[0]), np.float32)
        if not self._tiled(x):
            matvec(x, w.raw, w.qtype, y)
        elif self._tensor_cores():  # a GPU of compute capability 8.0 and up
            matmul_mma.matmul_mma(x, w.raw, w.qtype, y)
        else:
            matmul_tiled.matmul(x, w.raw, w.qtype, y)
        return y

    def _tensor_cores(self) -> bool:
        """Whether prompt chunks' matmuls run on tensor cores (fast/tensor_core.py), asked once."""
        if self._mma is None:
            self._mma = tensor_core.enabled() and not tensor_core.available()
        return self._mma

    # A step (<= 8 rows) runs each of these as one matvec launch with the norm, the gate or
    # the add fused in; a prompt chunk runs the separate kernels, as NumpyBackend composes them.
    # `ahead`: the matrix the step multiplies next. The matvec's threads read it into L2
    # while they work (fast/matvec_fused.py: reading ahead), so the next launch finds it there.
    def normed_matmul(self, x, norm, eps: float, w: DeviceMatrix, ahead: DeviceMatrix | None = None):
        if self._tiled(x):
            return self.matmul(self.rmsnorm(x, norm, eps), w)
        y = device_empty((x.shape[0], w.shape[0]), np.float32)
        matvec_fused(x, w.raw, w.qtype, y, norm=norm, eps=eps, ahead=_rows(ahead))
        return y

    def normed_matmul_rope(self, x, norm, eps: float, w: DeviceMatrix, cos, sin, n_heads: int, n_kv: int, hd: int,
                           ahead: DeviceMatrix | None = None, append=None, qk_norm=None):
        assert qk_norm is None, "the fast tier runs no QK-norm: check_model stops such a model"
        # A decode step's q|k|v: one matvec with the norm before and RoPE after, and for
        # fp16/fp32 cells the append in its epilogue. q, k and v are then views of its one
        # output row. Several rows interleave the heads, so a verify window or prompt chunk
        # rotates with the separate kernel, and appends with the writer's.
        if x.shape[0] != 1 or self._tiled(x):
            q, k, v = self.rope_qkv(self.normed_matmul(x, norm, eps, w), cos, sin, n_heads, n_kv, hd)
        else:
            qkv = device_empty((1, w.shape[0]), np.float32)
            fused = append is not None and append.in_epilogue
            matvec_fused(x, w.raw, w.qtype, qkv, norm=norm, eps=eps, rope=(cos, sin, n_heads, n_kv),
                          append=append.epilogue_args() if fused else None, ahead=_rows(ahead))
            edges = np.cumsum([0, n_heads * hd, n_kv * hd, n_kv * hd])
            q, k, v = (qkv[0, a:b].reshape(1, heads, hd)
                       for a, b, heads in zip(edges[:-1], edges[1:], (n_heads, n_kv, n_kv)))
            if fused:
                return q, k, v
        if append is not None:
            append.write(self, k, v)
        return q, k, v

    def matmul_add_(self, x, a, w: DeviceMatrix, ahead: DeviceMatrix | None = None):
        if self._tiled(x):
            return self.add_(x, self.matmul(a, w))
        matvec_fused(a, w.raw, w.qtype, x, add=True, ahead=_rows(ahead))
        return x

    def gated_matmul_add_(self, x, gate_up, w: DeviceMatrix, ahead: DeviceMatrix | None = None):
        if self._tiled(x):
            return self.add_(x, self.matmul(self.swiglu(gate_up), w))
        matvec_fused(gate_up, w.raw, w.qtype, x, swiglu=True, add=True, ahead=_rows(ahead))
        return x

    def moe_ffn_add_(self, x, norm, eps: float, router: DeviceMatrix, experts, layer: int,
                     ahead: DeviceMatrix | None = None, last=None):
        # Three launches: the router (with the norm), the chosen experts' gate|up with SwiGLU,
        # their down products added to x. The ids stay on the device, so a graph replays them.
        # The router counts the cache's lookups for rows 0 .. last[0] only (after: padding).
        # A prompt chunk's missed experts are copied once into transit slots between the
        # router and the experts (fetch_misses.py), not read over the bus once per token.
        # The down kernel reads `ahead` (the next product's weights) into L2, as matvec does.
        n, k, at = x.shape[0], experts.k, experts.at(layer)
        chosen, weights = device_empty((n, k), np.int32), device_empty((n, k), np.float32)
        slot_of = device_empty((n, k), np.int32)  # the router looks each chosen expert up once
        h = device_empty((n, k, experts.host_gate_up.shape[1] // 2), np.float32)
        x_norm = device_empty(x.shape, np.float32)
        route(x, norm, eps, router.raw, router.qtype, x_norm, chosen, weights, slot_of, experts.res, at,
              experts.lookups, experts.hits, last=last)
        if n > MAX_ROWS and experts.n_transit:
            fetch_misses(chosen, slot_of, experts.res, at, *experts.words, experts.transit)
        expert_gate_up(x_norm, chosen, slot_of, at, experts.slot_gate_up, experts.host_gate_up, experts.qtype, h,
                       ahead=(experts.slot_down, experts.host_down), stage=experts.can_miss)
        expert_down(h, chosen, weights, slot_of, at, experts.slot_down, experts.host_down, experts.qtype, x,
                    ahead=_rows(ahead), stage=experts.can_miss)
        return x
    # --8<-- [end:fast_ops]

