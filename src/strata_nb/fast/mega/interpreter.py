"""The megakernel: one launch a decode step, every thread block walking the plan.

Plain twin: none as one kernel. The plain tier runs the same step as engine/forward.py's
launches, a plain kernel an op, and each item here runs those kernels' device bodies
(stages.py); a step must give the numpy backend's logits and picks (tests/test_megakernel.py).
What it buys is the launches' gaps: to be timed on a GPU, `strata-nb bench --kernels fast,mega`.

    for each item of the plan (plan.py):
        do this thread block's share of the item (stages.py)
        wait at the grid barrier until every thread block has done its share

The launch puts one thread block on each SM, and they all stay for the whole step: the
barrier needs every block of the grid running at once, or the first to wait would wait
for a block that never starts. No kernel boundary is left between two items, so none of
the fast tier's launch, ramp-up and tail costs remain: the price is the barriers.

The grid barrier (`grid_barrier`) is two counters in global memory, `sync` = [arrived,
generation]. A thread block's thread 0 reads the generation, makes the block's writes
visible to the grid (threadfence), and arrives (an atomic add). The last to arrive sets
`arrived` back to 0 and moves the generation on; the others spin until they see it move,
then fence again so that what they read next is what the other blocks wrote. It leaves
the counters ready for the next barrier and the next launch. A cooperative launch's
`cuda.cg.this_grid().sync()` does the same work; counters measured faster on an H100 at
every grid size tried (1.0-1.3 us a barrier against 1.5-2.7 us, 132-264 blocks of 256-512
threads; CHANGELOG.md).

A launch that is not the only one on the GPU could find an SM busy and wait forever: the
megakernel is never launched as dependent (fast/dependent_launch.py), so it starts when
the kernel before it has ended.

The kernel is built per KV format and per weight type of each kind of matrix (each kind
read by its plain dequantizer), like the plain kernels' factories.
"""
from __future__ import annotations

from numba import cuda, float32

from ...gpu.geometry import MEGA_JIT, SIMULATED
from ...kernels.attention.attention import FOLD_BLOCKS
from ...kernels.dense.embed import ROW_PARTS
from ...kernels.dense.matvec import ROW_SUMS
from ...kernels.dense.rmsnorm import norm_row
from ...kv_layout import BLOCK, rotates
from .plan import ATTEND, DOWN, EMBED, GATE_UP, HEAD, MAX_D, MAX_GROUP, MAX_HEAD_DIM, QKV, WO
from .stages import (append_fp16, append_k8v4, make_attend_stage, make_dot, make_embed_stage, make_gate_up_stage,
                     make_product, make_qkv_stage, make_wo_stage, pick_stage)

KINDS = ("embd", "wqkv", "wo", "wgate_up", "wdown", "output")  # the matrices, each read by its type's dequantizer


# --8<-- [start:grid_barrier]
@cuda.jit(device=True)
def grid_barrier(sync):  # (2,) int32: [arrived, generation]; [0, g] between barriers
    cuda.syncthreads()  # the thread block's share is written
    if cuda.threadIdx.x == 0:
        generation = cuda.atomic.add(sync, 1, 0)  # read before arriving: the last to arrive moves it
        cuda.threadfence()  # the block's writes reach the grid before the block counts as arrived
        if cuda.atomic.add(sync, 0, 1) == cuda.gridDim.x - 1:  # the last thread block in
            cuda.atomic.exch(sync, 0, 0)  # nobody touches `arrived` until the generation moves
            cuda.threadfence()
            cuda.atomic.add(sync, 1, 1)  # let every block go
        else:
            while cuda.atomic.add(sync, 1, 0) == generation:  # an atomic read: the value in L2
                pass
        cuda.threadfence()  # what the block reads next is what the others wrote
    cuda.syncthreads()
# --8<-- [end:grid_barrier]


# --8<-- [start:clock]
if SIMULATED:
    import time

    def global_ns():
        return time.perf_counter_ns()  # the simulator's clock: the host's
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def global_ns(typingctx):
        """%globaltimer: the GPU's clock in nanoseconds, the same on every SM."""
        def codegen(context, builder, signature, args):
            read = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l",
                                side_effect=True)
            return builder.call(read, [])
        return types.int64(), codegen
# --8<-- [end:clock]


# --8<-- [start:interpreter]
def make_interpreter(types: dict, fmt: str):
    """The kernel for one KV format and the weight types of KINDS (types: kind -> qtype);
    `interpreter` makes each once, on demand."""
    dot = {kind: make_dot(ROW_SUMS[types[kind]]) for kind in KINDS if kind != "embd"}
    embed_stage = make_embed_stage(ROW_PARTS[types["embd"]])
    qkv_stage = make_qkv_stage(dot["wqkv"])
    attend_stage = make_attend_stage(FOLD_BLOCKS[fmt], append_k8v4 if fmt == "k8v4" else append_fp16)
    wo_stage = make_wo_stage(dot["wo"], "v" in rotates(fmt))
    gate_up_stage = make_gate_up_stage(dot["wgate_up"])
    down_stage = make_product(dot["wdown"], add=True)  # x += h_ff @ Wdown.T
    head_stage = make_product(dot["output"], add=False)  # logits = rmsnorm(x) @ Wout.T

    @cuda.jit(cache=True, **MEGA_JIT)
    def mega_step_kernel(plan,       # (items, 2) int32: each item's op and layer (plan.py)
                         sync,       # (2,) int32: the grid barrier's counters
                         token,      # (1,) int32: the token going in; the pick is written over it
                         positions,  # (1,) int32: its position; the pick writes position + 1
                         chosen,     # (R,) int32 mapped: the host's copy of each pick
                         eps, scale,  # float32: the norms' epsilon, 1 / sqrt(head_dim)
                         embd_a, embd_b, out_a, out_b,  # views of the embedding table's and the head's rows
                         out_norm,   # (d,) float32
                         attn_norm, ffn_norm,  # (layers, d) float32
                         wqkv_a, wqkv_b, wo_a, wo_b, wgu_a, wgu_b, wdown_a, wdown_b,  # (layers, rows, *) views
                         cos, sin,   # (context, hd / 2) float32
                         page_table,  # (n_blocks,) int32: block -> slot, every layer's
                         ka, kb, va, vb,  # (layers, slots, n_kv, 16, *): K and V cells, as fold_block reads them
                         hka, hkb, hva, hvb,  # (0, n_kv, 16, *): no host copy (a resident cache)
                         x,          # (1, d) float32: the residual stream
                         q,          # (n_heads, hd) float32
                         k_new, v_new,  # (1, n_kv, hd) float32
                         part_m, part_l, part_acc,  # attention's shares: (n_heads, splits), (..., hd)
                         tickets,    # (n_kv,) int32, 0: the shares of each KV head done
                         attn,       # (n_heads, hd) float32: attention's output
                         h_ff,       # (1, ff) float32
                         logits,     # (1, vocab) float32
                         timeline):  # (items + 1,) int64: when block 0 set out on each item, and ended; or (0,)
        pos = positions[0]
        xs = cuda.shared.array((1, MAX_D), float32)  # a product's input row, the block's own copy
        q_s = cuda.shared.array((MAX_GROUP, MAX_HEAD_DIM), float32)  # attention's query rows
        k_s = cuda.shared.array((BLOCK, MAX_HEAD_DIM), float32)
        scores = cuda.shared.array((MAX_GROUP, BLOCK), float32)
        clocked = timeline.shape[0] > 0 and cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0
        for item in range(plan.shape[0]):
            if clocked:  # item i took timeline[i + 1] - timeline[i], its barrier's wait included
                timeline[item] = global_ns()
            op, L = plan[item, 0], plan[item, 1]
            d = x.shape[1]
            if op == QKV or op == GATE_UP or op == HEAD:  # the items that read rmsnorm(x): into xs
                norm = attn_norm[L] if op == QKV else ffn_norm[L] if op == GATE_UP else out_norm
                norm_row(x, 0, 0, d, norm, eps, xs)  # here, not in the stages (stages.py says why)
                cuda.syncthreads()
            if op == EMBED:
                embed_stage(token[0], embd_a, embd_b, x)
            elif op == QKV:
                qkv_stage(pos, d, wqkv_a[L], wqkv_b[L], cos, sin, q, k_new, v_new, xs)
            elif op == ATTEND:
                attend_stage(positions, q, scale, k_new, v_new, page_table, ka[L], kb[L], va[L], vb[L],
                             hka, hkb, hva, hvb, part_m, part_l, part_acc, tickets, attn, q_s, k_s, scores)
            elif op == WO:
                wo_stage(x, wo_a[L], wo_b[L], attn, xs)
            elif op == GATE_UP:
                gate_up_stage(d, wgu_a[L], wgu_b[L], h_ff, xs)
            elif op == DOWN:
                down_stage(x, wdown_a[L], wdown_b[L], h_ff, h_ff.shape[1])
            elif op == HEAD:
                head_stage(logits, out_a, out_b, xs, d)
            else:  # PICK, the last item
                pick_stage(pos, logits, token, positions, chosen)
            if item + 1 < plan.shape[0]:
                grid_barrier(sync)
        if clocked:
            timeline[plan.shape[0]] = global_ns()

    return mega_step_kernel
# --8<-- [end:interpreter]


_KERNELS: dict = {}  # made_from -> the kernel


def interpreter(types: dict, fmt: str):
    """make_interpreter's kernel, made once per format and types. Its `made_from` names
    them (fast/sm90.py's compile check remakes it from that, with `remake`)."""
    made_from = ",".join([fmt] + [f"{k}={types[k]}" for k in KINDS])
    if made_from not in _KERNELS:
        kernel = make_interpreter(types, fmt)
        (getattr(kernel, "py_func", None) or kernel.fn).made_from = made_from  # the simulator's kernels: .fn
        _KERNELS[made_from] = kernel
    return _KERNELS[made_from]


def remake(made_from: str):
    """The kernel `interpreter` made under this name."""
    fmt, *types = made_from.split(",")
    return interpreter(dict(t.split("=") for t in types), fmt)
