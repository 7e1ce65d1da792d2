"""The cuda backend, plain tier: device arrays, and one plain @cuda.jit kernel launch per op.

It is the numpy backend with each reference replaced by its kernel file's plain launcher
(`--kernels plain`): the forward pass's compound verbs are composed op by op as there
(composed.py), every op is one Numba launch, and the engine runs its host path (a decode
step's token and position come from the host; no CUDA graph). The fast tier's backend
(fast/backend.py) is this class with the verbs fused and the launches made fast.

The host copy lives in mapped pinned memory (`cuda.mapped_array`): page-locked, so copies
from it run at full PCIe/NVLink speed, and mapped into the device's address space, so a
kernel can read a block in place when no VRAM slot is free for it.

Weights stay in their GGUF form on the device (`DeviceMatrix`: raw rows + qtype) and are
dequantized inside the matvec/matmul/embed kernels, so a decode step reads each weight
once at its stored size. Each op returns a new device array, except `add_`, which adds
in place.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

from ..errors import StrataError
from ..kernels.attention.attention import MAX_HEAD_DIM
from ..kernels.dense import embed, geglu, gguf_rows, matmul, matvec, residual, rmsnorm, rope, swiglu
from ..kernels.experts.expert_down import expert_down
from ..kernels.experts.expert_gate_up import expert_gate_up
from ..kernels.experts.route import MAX_DIM, MAX_EXPERTS, MAX_USED, route
from ..kernels.step import block_scores
from ..gpu.launch import device_empty
from ..kv_layout import BLOCK
from ..model.dequant import dequantize
from .composed import ComposedOps


@dataclass(frozen=True, slots=True)
class DeviceMatrix:
    """A weight matrix on the device as GGUF stores it: W (out, in) once dequantized."""

    qtype: str  # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
    shape: tuple[int, int]  # (out, in)
    raw: object  # (out, bytes_per_row) uint8 device array: the GGUF rows


class CudaBackend(ComposedOps):
    name = "cuda"
    kernels = "plain"  # --kernels: which tier's kernels run each op
    qtypes = gguf_rows.QTYPES  # the weight types its kernels dequantize
    # Prompt tokens per forward pass unless --prefill-chunk says otherwise
    prefill_chunk = 2048
    device = "cuda"
    misses_cross_a_bus = True  # an expert cache's miss is read from pinned host memory (experts/cache.py)

    def __init__(self):
        self._rows_alone = False

    # ---- arrays -------------------------------------------------------------------------
    def zeros(self, shape, dtype):
        return cuda.to_device(np.zeros(shape, dtype))

    def empty(self, shape, dtype):
        """For outputs a kernel writes whole."""
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

    @contextlib.contextmanager
    def rows_alone(self, on: bool):
        """Within it (on): every product takes the matmul kernel, whatever its rows, so a
        prompt chunk of 3 rows computes each row as one of 300 does (engine/prompt_chunk.py
        says why that matters). Elsewhere a step's or window's rows (at most matvec.MAX_ROWS)
        take the matvec kernel."""
        before, self._rows_alone = self._rows_alone, self._rows_alone or on
        try:
            yield
        finally:
            self._rows_alone = before

    def deferred_frees(self):
        """One forward pass's scope: device memory its temporaries free is given back when it ends."""
        return cuda.defer_cleanup()

    def check_model(self, cfg, qsa: bool, max_context: int = 0):
        """A model whose shapes the kernels are not built for stops here, with the range,
        and not at its first launch."""
        if cfg.n_expert and (cfg.n_expert > MAX_EXPERTS or cfg.n_expert_used > MAX_USED or cfg.d_model > MAX_DIM):
            raise StrataError(f"the cuda backend's expert kernels take at most {MAX_EXPERTS} experts, {MAX_USED} a "
                              f"token and a model dim of {MAX_DIM}; this model has {cfg.n_expert}, "
                              f"{cfg.n_expert_used} and {cfg.d_model} (use --device cpu)")
        if not BLOCK <= cfg.head_dim <= MAX_HEAD_DIM:
            raise StrataError(f"the cuda backend's attention takes head_dim {BLOCK} .. {MAX_HEAD_DIM}; this model has "
                              f"{cfg.head_dim} (use --device cpu)")
        if qsa and (cfg.n_kv_heads > block_scores.MAX_KV or cfg.head_dim not in block_scores.HEAD_DIMS
                    or cfg.n_heads // cfg.n_kv_heads > block_scores.MAX_GROUP):
            raise StrataError(f"the cuda backend's QSA scores are built for at most {block_scores.MAX_KV} KV heads, "
                              f"{block_scores.MAX_GROUP} query heads each, head_dim in {block_scores.HEAD_DIMS}; "
                              f"this model has {cfg.n_kv_heads}, {cfg.n_heads // cfg.n_kv_heads} and {cfg.head_dim} "
                              "(run without --qsa-budget, or with --device cpu)")

    def dependent_launches(self) -> str:
        """Whether kernels launch as dependent (fast/dependent_launch.py): the fast tier's."""
        return "off: plain kernels"

    def prompt_kernels(self, head_dim: int) -> str:
        """What a prompt chunk's matmuls and attention run on."""
        return "plain"

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
        """For every (host, device) pair of arrays: host <- the device array's first
        len(host) rows (to_host), else those rows <- host. A snapshot's fields are the
        first blocks of each pool or host copy array (`device` may be mapped host memory)."""
        cuda.synchronize()  # the kernels that write or read these arrays are done
        for host, device in pairs:
            if isinstance(device, np.ndarray):  # a mapped host copy: on the host already
                if to_host:
                    host[...] = device[:len(host)]
                else:
                    device[:len(host)] = host
            elif to_host:
                device[:len(host)].copy_to_host(host)
            else:
                device[:len(host)].copy_to_device(host)

    def queue_copy(self, dst, src):
        """dst <- src, one a device array and the other host memory of the same bytes, after
        every launch before it (here: now, the host waits)."""
        if isinstance(dst, np.ndarray):
            src.copy_to_host(dst)
        else:
            dst.copy_to_device(src)

    def queue_mark(self):
        """An event after everything queued so far: its synchronize() returns once it has run."""
        mark = cuda.event()
        mark.record()
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
        """Which of a kernel file's two functions this backend runs: the plain launcher."""
        return launcher

    # ---- weights ------------------------------------------------------------------------
    def matrix(self, *qtensors) -> DeviceMatrix:
        """The tensors' GGUF rows stacked (fused q|k|v, gate|up) and copied to the device
        once; they stay quantized there."""
        qtypes = {t.qtype for t in qtensors}
        if len(qtypes) != 1:
            # A K-quant mix gives the tensors of one fused matrix different types (a Q4_K_M
            # file's q|k|v can be Q5_0, Q5_0 and Q8_0): their rows are stored as F32, each
            # weight its dequantized value exactly, so one kernel reads them all.
            raw = np.concatenate([dequantize(t.raw, t.qtype) for t in qtensors], axis=0).view(np.uint8)
            return DeviceMatrix("F32", (raw.shape[0], raw.shape[1] // 4), cuda.to_device(raw))
        qtype = qtypes.pop()
        if qtype not in self.qtypes:
            plain = " (--kernels plain reads it)" if qtype in gguf_rows.QTYPES else ""
            raise StrataError(f"{qtensors[0].name} is {qtype}; the cuda backend's {self.kernels} kernels read "
                              f"{', '.join(self.qtypes)}{plain}")
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

    # ---- ops: NumpyBackend's, one plain kernel each --------------------------------------
    # --8<-- [start:cuda_ops]
    def embed(self, table, ids):
        # table: a DeviceMatrix (vocab, d) or a (rows, d) float32 array; ids (n,) int32 -> (n, d)
        ids = self.asarray(ids, np.int32)
        out = device_empty((ids.shape[0], table.shape[1]), np.float32)
        gather = self.op(embed.embed_ref, embed.embed)  # the fast tier launches its twin
        if isinstance(table, DeviceMatrix):
            gather(table.raw, ids, out, table.qtype)
        else:
            gather(table, ids, out)
        return out

    def matmul(self, x, w: DeviceMatrix):
        # x (n, in) float32, w (out, in) -> (n, out): the matvec kernel for a step's or a
        # window's few rows, the matmul kernel for a prompt chunk's
        y = device_empty((x.shape[0], w.shape[0]), np.float32)
        if x.shape[0] <= matvec.MAX_ROWS and not self._rows_alone:
            matvec.matvec(x, w.raw, w.qtype, y)
        else:
            matmul.matmul(x, w.raw, w.qtype, y)
        return y

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

    def moe_ffn_add_(self, x, norm, eps: float, router: DeviceMatrix, experts, layer: int, ahead=None, last=None):
        # x += the FFN of an MoE layer, three launches: the router (with the norm) picks K
        # of E experts per token, their gate|up products with SwiGLU, their down products
        # weighted and added to x. Each expert is read from its VRAM slot, or from the
        # host copy in place when it has none (experts/cache.py); rows after `last`
        # (padding) are not counted as the cache's lookups.
        n, k, at = x.shape[0], experts.k, experts.at(layer)
        chosen, weights = device_empty((n, k), np.int32), device_empty((n, k), np.float32)
        slot_of = device_empty((n, k), np.int32)  # the router looks each chosen expert up once
        x_norm = device_empty(x.shape, np.float32)
        route(x, norm, eps, router.raw, router.qtype, x_norm, chosen, weights, slot_of, experts.res, at,
              experts.lookups, experts.hits, last=last)
        h = device_empty((n, k, experts.host_gate_up.shape[1] // 2), np.float32)  # (n, K, F)
        expert_gate_up(x_norm, chosen, slot_of, at, experts.slot_gate_up, experts.host_gate_up, experts.qtype, h)
        expert_down(h, chosen, weights, slot_of, at, experts.slot_down, experts.host_down, experts.qtype, x)
        return x

    def geglu(self, gate_up):
        out = device_empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        geglu.geglu(gate_up, out)
        return out

    def head_rmsnorm(self, qkv, q_norm, k_norm, eps: float, n_heads: int, n_kv: int):
        out = device_empty(qkv.shape, np.float32)
        rmsnorm.head_rmsnorm(qkv, q_norm, k_norm, eps, n_heads, n_kv, out)
        return out

    def scale_(self, x, s: float):
        residual.scale(x, s)
        return x
    # --8<-- [end:cuda_ops]
