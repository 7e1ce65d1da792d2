"""The cuda backend: device arrays and the @cuda.jit kernels (or Numba's simulator of them).

The host copy lives in mapped pinned memory (`cuda.mapped_array`): page-locked, so copies
from it run at full PCIe/NVLink speed, and mapped into the device's address space, so a
kernel can read a block in place when no VRAM slot is free for it.

Weights stay in their GGUF form on the device (`DeviceMatrix`: raw rows + qtype) and are
dequantized inside the matvec/matmul/embed kernels, so a decode step reads each weight
once at its stored size. The model ops below mirror NumpyBackend's one for one; each
returns a new device array, except `add_`, which adds in place.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

from ..errors import StrataError
from ..kernels.dense import embed, gguf_rows, matmul, matmul_mma, matvec, residual, rmsnorm, rope, swiglu
from ..kernels.experts.expert_down import expert_down
from ..kernels.experts.expert_gate_up import expert_gate_up
from ..kernels.experts.fetch_misses import fetch_misses
from ..kernels.experts.route import MAX_DIM, MAX_EXPERTS, MAX_USED, route
from ..gpu import dependent_launch, fast_launch, tensor_core
from ..gpu.geometry import SIMULATED
from ..gpu.launch import device_empty
from ..model.dequant import dequantize


@dataclass(frozen=True, slots=True)
class DeviceMatrix:
    """A weight matrix on the device as GGUF stores it: W (out, in) once dequantized."""

    qtype: str  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
    shape: tuple[int, int]  # (out, in)
    raw: object  # (out, bytes_per_row) uint8 device array: the GGUF rows


def _rows(matrix: DeviceMatrix | None):
    return None if matrix is None else matrix.raw


class CudaBackend:
    name = "cuda"
    # Prompt tokens per forward pass unless --prefill-chunk says otherwise: each launch
    # costs ~0.2 ms of Python, and a chunk is ~400 launches, so chunks are long here
    prefill_chunk = 2048
    device = "cuda"
    _mma: bool | None = None  # prompt matmuls on tensor cores: _tensor_cores() asks once
    misses_cross_a_bus = True  # an expert cache's miss is read from pinned host memory (experts/cache.py)

    def zeros(self, shape, dtype):
        return cuda.to_device(np.zeros(shape, dtype))

    def empty(self, shape, dtype):
        """For outputs a kernel writes whole: no host copy, so it may be captured in a graph."""
        return device_empty(shape, dtype)

    def asarray(self, a, dtype=None):
        if isinstance(a, np.ndarray) or not hasattr(a, "copy_to_host"):
            return cuda.to_device(np.ascontiguousarray(a, dtype=dtype))
        return a

    def to_numpy(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):  # NumPy or mapped host memory: wait for the kernels that write it
            cuda.synchronize()
            return np.array(a)
        return a.copy_to_host()

    def synchronize(self):
        cuda.synchronize()

    _tiled_from = matvec.MAX_ROWS + 1  # rows from which a product takes the tiled matmul

    def _tiled(self, x) -> bool:
        return x.shape[0] >= self._tiled_from

    @contextmanager
    def rows_alone(self, on: bool):
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

    def deferred_frees(self):
        """One forward pass's scope: device memory its temporaries free is given back when it
        ends, not during it. Numba frees in batches as arrays die, and each cuMemFree waits
        for the GPU to finish its queue, so mid-pass frees keep the host from running ahead."""
        return cuda.defer_cleanup()

    def check_model(self, cfg, qsa: bool, max_context: int = 0):
        """The step kernels are compiled for a range of shapes (head_dim, query heads per KV
        head, and KV heads for QSA's scores), and a step's merge holds a bounded number of
        splits: a model or a context outside them stops here, with the range, and not at
        its first launch; so does a mixture of more experts than the router kernel holds."""
        from ..kernels.attention import attention_step
        from ..kernels.step import block_scores

        if cfg.n_expert and (cfg.n_expert > MAX_EXPERTS or cfg.n_expert_used > MAX_USED or cfg.d_model > MAX_DIM):
            raise StrataError(f"the cuda backend's expert kernels take at most {MAX_EXPERTS} experts, {MAX_USED} a "
                              f"token and a model dim of {MAX_DIM}; this model has {cfg.n_expert}, "
                              f"{cfg.n_expert_used} and {cfg.d_model} (use --device cpu)")
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
        if qsa and cfg.n_kv_heads > block_scores.MAX_KV:
            raise StrataError(f"the cuda backend's QSA scores are built for at most {block_scores.MAX_KV} KV heads; "
                              f"this model has {cfg.n_kv_heads} (run without --qsa-budget, or with --device cpu)")

    def dependent_launches(self) -> str:
        """'on' when marked kernels launch as dependent (gpu/dependent_launch.py), 'off' when
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
        from ..kernels.attention import attention_prefill_mma

        if not tensor_core.enabled():
            return "plain"
        why = tensor_core.available()
        if why:
            return f"plain (no tensor cores: {why})"
        why = attention_prefill_mma.usable(head_dim)
        return f"tensor cores for the matmuls, plain attention ({why})" if why else "tensor cores"

    def pinned_bytes(self, nbytes: int) -> np.ndarray:
        """(nbytes,) uint8 of pinned host memory, for copies to and from the device at the
        bus's speed (the conversation cache's arena); pageable, with a warning, where the
        system will not pin that much."""
        try:
            return cuda.pinned_array(nbytes, np.uint8)
        except CudaAPIError as err:
            print(f"strata-nb: could not pin {nbytes / 2**20:,.0f} MiB of host memory ({err}); parked "
                  "conversations stay in pageable memory, and restore slower", file=sys.stderr)
            return np.empty(nbytes, np.uint8)

    def host_array(self, shape, dtype):
        """Pinned, device-mapped host memory: the authoritative host copy."""
        a = cuda.mapped_array(shape, dtype)
        a[...] = 0
        return a

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
            for host, device in pairs:
                if to_host:
                    device[:len(host)].copy_to_host(host)
                else:
                    device[:len(host)].copy_to_device(host)
            return
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
            if isinstance(dst, np.ndarray):
                src.copy_to_host(dst)
            else:
                dst.copy_to_device(src)
            return
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
            return cuda.event()
        mark = cuda.event(timing=False)
        mark.record(cuda.legacy_default_stream())
        return mark

    def copy_into(self, dst, src):
        """dst (device) <- src (host table or array)."""
        if dst is src:
            return
        if hasattr(dst, "copy_to_device"):
            dst.copy_to_device(np.ascontiguousarray(src))
        else:
            dst[...] = src

    def op(self, ref, launcher):
        """Which of a kernel file's two functions this backend runs: the launcher."""
        return launcher

    # ---- weights ------------------------------------------------------------------------
    def matrix(self, *qtensors) -> DeviceMatrix:
        """The tensors' GGUF rows stacked (fused q|k|v, gate|up) and copied to the device
        once; they stay quantized there."""
        qtypes = {t.qtype for t in qtensors}
        if len(qtypes) != 1:
            raise StrataError("tensors fused into one matrix must share a type: "
                              + ", ".join(f"{t.name} is {t.qtype}" for t in qtensors))
        qtype = qtypes.pop()
        if qtype not in gguf_rows.QTYPES:
            raise StrataError(f"{qtensors[0].name} is {qtype}; the cuda backend reads {', '.join(gguf_rows.QTYPES)}")
        raw = np.concatenate([np.ascontiguousarray(t.raw) for t in qtensors], axis=0)
        return DeviceMatrix(qtype, (raw.shape[0], gguf_rows.row_values(qtype, raw.shape[1])), cuda.to_device(raw))

    def vector(self, qtensor):
        return cuda.to_device(np.ascontiguousarray(dequantize(qtensor.raw, qtensor.qtype).reshape(-1)))

    # ---- the expert cache's memory (experts/cache.py) -----------------------------------
    def expert_host_copy(self, raw, qtype):
        """(n, rows, bytes) uint8 GGUF rows of n expert matrices, in pinned device-mapped
        memory: kernels read it in place over the bus (the expert kernels a missing
        expert's rows, the copy kernel a slot's fill)."""
        host = cuda.mapped_array(raw.shape, np.uint8)
        host[...] = raw
        return host

    def expert_slots(self, n: int, host):
        """n VRAM slots shaped as one of the host copy's matrices, zeroed: a slot read before
        anything was copied in reads zeros, never an earlier engine's experts (freed device
        memory is reused)."""
        return cuda.to_device(np.zeros((n, *host.shape[1:]), np.uint8))

    def free_memory(self) -> int:
        free, _ = cuda.current_context().get_memory_info()
        return free

    # ---- ops: NumpyBackend's, on the device ---------------------------------------------
    # --8<-- [start:cuda_ops]
    def embed(self, table, ids):
        # table: a DeviceMatrix (vocab, d) or a (rows, d) float32 array; ids (n,) int32 -> (n, d)
        ids = self.asarray(ids, np.int32)
        out = device_empty((ids.shape[0], table.shape[1]), np.float32)
        if isinstance(table, DeviceMatrix):
            embed.embed(table.raw, ids, out, table.qtype)
        else:
            embed.embed(table, ids, out)
        return out

    def matmul(self, x, w: DeviceMatrix):
        # x (n, in) float32, w (out, in) -> (n, out): matvec for a step or verify window,
        # the tiled matmul for a prompt chunk
        y = device_empty((x.shape[0], w.shape[0]), np.float32)
        if not self._tiled(x):
            matvec.matvec(x, w.raw, w.qtype, y)
        elif self._tensor_cores():  # a GPU of compute capability 8.0 and up
            matmul_mma.matmul_mma(x, w.raw, w.qtype, y)
        else:
            matmul.matmul(x, w.raw, w.qtype, y)
        return y

    def _tensor_cores(self) -> bool:
        """Whether prompt chunks' matmuls run on tensor cores (gpu/tensor_core.py), asked once."""
        if self._mma is None:
            self._mma = tensor_core.enabled() and not tensor_core.available()
        return self._mma

    def rmsnorm(self, x, w, eps: float):
        out = device_empty(x.shape, np.float32)
        rmsnorm.rmsnorm(x, w, eps, out)
        return out

    def rope_qkv(self, qkv, cos, sin, n_heads: int, n_kv: int, hd: int):
        n = qkv.shape[0]
        q = device_empty((n, n_heads, hd), np.float32)
        k = device_empty((n, n_kv, hd), np.float32)
        v = device_empty((n, n_kv, hd), np.float32)
        rope.rope_qkv(qkv, cos, sin, q, k, v)
        return q, k, v

    def swiglu(self, gate_up):
        out = device_empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        swiglu.swiglu(gate_up, out)
        return out

    def add_(self, x, y):
        residual.residual(x, y)
        return x

    # A step (<= 8 rows) runs each of these as one matvec launch with the norm, the gate or
    # the add fused in; a prompt chunk runs the separate kernels, as NumpyBackend composes them.
    # `ahead`: the matrix the step multiplies next. The matvec's threads read it into L2
    # while they work (kernels/dense/matvec_fused.py: reading ahead), so the next launch finds it there.
    def normed_matmul(self, x, norm, eps: float, w: DeviceMatrix, ahead: DeviceMatrix | None = None):
        if self._tiled(x):
            return self.matmul(self.rmsnorm(x, norm, eps), w)
        y = device_empty((x.shape[0], w.shape[0]), np.float32)
        matvec.matvec(x, w.raw, w.qtype, y, norm=norm, eps=eps, ahead=_rows(ahead))
        return y

    def normed_matmul_rope(self, x, norm, eps: float, w: DeviceMatrix, cos, sin, n_heads: int, n_kv: int, hd: int,
                           ahead: DeviceMatrix | None = None, append=None):
        # A decode step's q|k|v: one matvec with the norm before and RoPE after, and for
        # fp16/fp32 cells the append in its epilogue. q, k and v are then views of its one
        # output row. Several rows interleave the heads, so a verify window or prompt chunk
        # rotates with the separate kernel, and appends with the writer's.
        if x.shape[0] != 1 or self._tiled(x):
            q, k, v = self.rope_qkv(self.normed_matmul(x, norm, eps, w), cos, sin, n_heads, n_kv, hd)
        else:
            qkv = device_empty((1, w.shape[0]), np.float32)
            fused = append is not None and append.in_epilogue
            matvec.matvec(x, w.raw, w.qtype, qkv, norm=norm, eps=eps, rope=(cos, sin, n_heads, n_kv),
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
        matvec.matvec(a, w.raw, w.qtype, x, add=True, ahead=_rows(ahead))
        return x

    def gated_matmul_add_(self, x, gate_up, w: DeviceMatrix, ahead: DeviceMatrix | None = None):
        if self._tiled(x):
            return self.add_(x, self.matmul(self.swiglu(gate_up), w))
        matvec.matvec(gate_up, w.raw, w.qtype, x, swiglu=True, add=True, ahead=_rows(ahead))
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
        if n > matvec.MAX_ROWS and experts.n_transit:
            fetch_misses(chosen, slot_of, experts.res, at, *experts.words, experts.transit)
        expert_gate_up(x_norm, chosen, slot_of, at, experts.slot_gate_up, experts.host_gate_up, experts.qtype, h,
                       ahead=(experts.slot_down, experts.host_down), stage=experts.can_miss)
        expert_down(h, chosen, weights, slot_of, at, experts.slot_down, experts.host_down, experts.qtype, x,
                    ahead=_rows(ahead), stage=experts.can_miss)
        return x
    # --8<-- [end:cuda_ops]

