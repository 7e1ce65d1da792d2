"""What the thread blocks do for each kind of item in the plan (plan.py): device functions
the interpreter (interpreter.py) calls with every thread of the grid.

Plain twins: each stage runs plain kernels' device bodies over a share of the grid;
together they are the step engine/forward.py launches op by op. A product is the plain
matvec's `row_sums` and a warp_sum, RoPE `turn_pair`, the gate `silu_times`, attention the
plain kernel's `fold_block`, the cells the one writer's bodies (`store_cell`, the q8 and
q4 appends' warps), the pick argmax's `first_of_max`. What is new is how the work is
shared out, and that no launch ends between one item and the next.

Sharing out. A product's rows are warps' units: the grid's W warps take rows w, w + W,
w + 2W, ... Every thread runs the same number of rounds, and a warp whose row is past the
last redoes the last row and writes nothing: a warp's shuffles want all its lanes, and
under the simulator a warp reduction waits for the whole thread block. Attention's units
are thread blocks'.

Input rows. A product's input (rmsnorm(x), or attention's output) is copied by every
thread block into its own shared memory, `xs`: a few thousand values, which cost less to
make again than a barrier more would. The interpreter makes rmsnorm(x), not the stages:
Numba links rmsnorm's block_sum, with its shared array, into every device function that
calls it, and NVVM refuses a kernel whose shared symbol is defined twice.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from ...gpu.launch import last_to_arrive
from ...gpu.reduce import NEG_INF, WARP, warp_sum
from ...kernels.dense.gguf_rows import PART
from ...kernels.dense.rope import turn_pair
from ...kernels.dense.swiglu import silu_times
from ...kernels.kv.hadamard import N as HADAMARD_N
from ...kernels.kv.hadamard import fwht64_lanes
from ...kernels.kv.kv_append_fp16 import cell_home, store_cell
from ...kernels.kv.kv_append_q4 import append_q4_warp
from ...kernels.kv.kv_append_q8 import append_q8_warp
from ...kernels.step.argmax import first_of_max
from ...kv_layout import BLOCK, INT8_GROUP, Q4_GROUP


# --8<-- [start:rounds]
@cuda.jit(device=True)
def warp_rounds(n_units):
    """Rounds the grid's warps take to cover n_units, one unit a warp a round."""
    warps = cuda.gridDim.x * (cuda.blockDim.x // WARP)
    return (n_units + warps - 1) // warps


@cuda.jit(device=True)
def warp_unit(r, n_units):
    """This warp's unit in round r, and whether it is a real one (else the last, redone)."""
    warps = cuda.blockDim.x // WARP
    unit = (r * cuda.gridDim.x + cuda.blockIdx.x) * warps + cuda.threadIdx.x // WARP
    return min(unit, n_units - 1), unit < n_units


def make_dot(row_sums):
    """x[0] . W[o] for one weight type (its plain row_sums), in every lane of the warp."""

    @cuda.jit(device=True)
    def dot(x, n_in, a, b, o, lane):
        acc = cuda.local.array(1, float32)
        acc[0] = float32(0.0)
        row_sums(x, n_in, a, b, o, lane, acc)
        return warp_sum(acc[0])

    return dot


def make_product(dot, add):
    """out[0, o] = inputs[0] . W[o] (add: out[0, o] += ...) for each of out's rows o: a warp a row."""

    @cuda.jit(device=True)
    def product(out, a, b, inputs, n_in):
        lane = cuda.threadIdx.x % WARP
        rows = out.shape[1]
        for r in range(warp_rounds(rows)):
            o, writes = warp_unit(r, rows)
            y = dot(inputs, n_in, a, b, o, lane)
            if writes and lane == 0:
                out[0, o] = out[0, o] + y if add else y

    return product
# --8<-- [end:rounds]


def make_embed_stage(row_part):
    @cuda.jit(device=True)
    def embed_stage(token, a, b,  # the token id; views a, b of the embedding table's rows
                    x):           # (1, d) float32, written: the residual stream
        for q in range(cuda.grid(1), x.shape[1] // PART, cuda.gridDim.x * cuda.blockDim.x):
            row_part(a, b, token, q, x, 0)  # values 8q.. of the row, a thread each

    return embed_stage


# --8<-- [start:qkv_stage]
def make_qkv_stage(dot):
    @cuda.jit(device=True)
    def qkv_stage(pos, d,             # the position; the length of x
                  a, b,               # views of this layer's Wqkv rows: q heads, k heads, v heads
                  cos, sin,           # (context, hd / 2) float32 RoPE tables
                  q,                  # (n_heads, hd) float32, written
                  k_new, v_new,       # (1, n_kv, hd) float32, written: the step's k (roped) and v
                  xs):                # (1, >= d) float32 shared: rmsnorm(x), this block's copy
        n_heads, hd = q.shape
        n_kv = k_new.shape[1]
        lane = cuda.threadIdx.x % WARP
        pairs = (n_heads + 2 * n_kv) * hd // 2  # RoPE turns rows 2i and 2i + 1 together
        for r in range(warp_rounds(pairs)):
            unit, writes = warp_unit(r, pairs)
            x0 = dot(xs, d, a, b, 2 * unit, lane)
            x1 = dot(xs, d, a, b, 2 * unit + 1, lane)
            head, j = 2 * unit // hd, 2 * unit % hd
            if head < n_heads + n_kv:  # a q or k head: turned by the position's angle for pair j / 2
                x0, x1 = turn_pair(x0, x1, cos[pos, j // 2], sin[pos, j // 2])
            if writes and lane == 0:
                if head < n_heads:
                    q[head, j], q[head, j + 1] = x0, x1
                elif head < n_heads + n_kv:
                    k_new[0, head - n_heads, j], k_new[0, head - n_heads, j + 1] = x0, x1
                else:
                    v_new[0, head - n_heads - n_kv, j], v_new[0, head - n_heads - n_kv, j + 1] = x0, x1

    return qkv_stage
# --8<-- [end:qkv_stage]


# --8<-- [start:append_cells]
@cuda.jit(device=True)
def append_fp16(kv_h, positions, k_new, v_new, page_table, ka, kb, va, vb, hka, hkb, hva, hvb):
    """KV head kv_h's new cell, fp16: the one writer's body (kv_append_fp16's store_cell),
    a value a thread; the slot, and the host copy where there is one."""
    hd = k_new.shape[2]
    block, cell, slot = cell_home(positions[0], page_table)
    for e in range(cuda.threadIdx.x, 2 * hd, cuda.blockDim.x):
        side, j = e // hd, e % hd  # K values, then V values
        value = k_new[0, kv_h, j] if side == 0 else v_new[0, kv_h, j]
        store_cell(side, kv_h, j, value, block, cell, slot, ka, va, hka, hva)


@cuda.jit(device=True)
def append_k8v4(kv_h, positions, k_new, v_new, page_table, ka, kb, va, vb, hka, hkb, hva, hvb):
    """KV head kv_h's new cell, k8v4, as kv_append_k8v4 writes it: K through kv_append_q8's
    warp body (ka, kb: int8 codes, fp16 scales), V through kv_append_q4's, which rotates it
    (va, vb: q4_0 bytes, their fp16 view). Each half folded: only its K side runs, a warp a
    group; every warp of the block calls both (a unit from 2 * all writes nothing)."""
    n_kv, hd = k_new.shape[1], k_new.shape[2]
    warp, lane = cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP
    groups = hd // INT8_GROUP
    unit = kv_h * groups + warp if warp < groups else 2 * n_kv * groups
    append_q8_warp(unit, lane, k_new, k_new, positions, page_table, ka, kb, ka, kb, hka, hkb, hka, hkb)
    groups = hd // Q4_GROUP
    unit = kv_h * groups + warp if warp < groups else 2 * n_kv * groups
    append_q4_warp(unit, lane, v_new, v_new, positions, page_table, va, vb, va, vb, hva, hvb, hva, hvb, True)
# --8<-- [end:append_cells]


# --8<-- [start:attend_stage]
def make_attend_stage(fold_block, append_cells):
    """append_cells: append_fp16 or append_k8v4, by the KV format."""

    @cuda.jit(device=True)
    def attend_stage(positions, q, scale,  # positions (1,) int32: the step's; q (n_heads, hd) float32
                     k_new, v_new,         # (1, n_kv, hd) float32: the step's k and v
                     page_table, ka, kb, va, vb, hka, hkb, hva, hvb,  # the layer's cells (fold_block's)
                     part_m, part_l,  # (n_heads, >= splits) float32: each share's max and sum of weights
                     part_acc,        # (n_heads, >= splits, hd) float32: its weighted V sum
                     tickets,         # (n_kv,) int32, 0: the shares of each KV head done so far
                     attn,            # (n_heads, hd) float32, written: the shares merged
                     q_s, k_s, scores):  # shared: (groups, >= hd), (16, >= hd), (groups, 16)
        pos = positions[0]
        n_heads, hd = q.shape
        n_kv = ka.shape[1]
        group = n_heads // n_kv
        n_blocks = pos // BLOCK + 1
        # as many shares of a KV head's cells as fill the grid, at most a block of cells each
        splits = min(part_m.shape[1], max(1, cuda.gridDim.x // n_kv), n_blocks)
        per_split = (n_blocks + splits - 1) // splits
        t = cuda.threadIdx.x
        g, dim = min(t // hd, group - 1), t % hd  # threads past the group's redo its last head's dims
        writes = t < group * hd
        k_col = cuda.local.array(BLOCK, float32)
        v_col = cuda.local.array(BLOCK, float32)
        n_units = n_kv * splits
        for r in range((n_units + cuda.gridDim.x - 1) // cuda.gridDim.x):
            unit = r * cuda.gridDim.x + cuda.blockIdx.x
            real, unit = unit < n_units, min(unit, n_units - 1)
            kv_h, s = unit // splits, unit % splits
            if s == (n_blocks - 1) // per_split:  # the share that holds the position: its block, the one
                append_cells(kv_h, positions, k_new, v_new, page_table, ka, kb, va, vb, hka, hkb, hva, hvb)
                cuda.syncthreads()  # that reads the new cell, writes it first (same bytes if it redoes one)
            h = kv_h * group + g
            q_s[g, dim] = q[h, dim]
            m, l, acc = NEG_INF, float32(0.0), float32(0.0)
            for blk in range(s * per_split, min((s + 1) * per_split, n_blocks)):
                m, l, acc = fold_block(blk, 0, pos, kv_h, dim, scale, page_table, ka, kb, va, vb,
                                       hka, hkb, hva, hvb, q_s[g, :hd], k_s, scores[g], k_col, v_col, m, l, acc)
            if real and writes:
                part_acc[h, s, dim] = acc
                if dim == 0:
                    part_m[h, s], part_l[h, s] = m, l
            if real and last_to_arrive(tickets, kv_h, splits):  # the KV head's last share in merges them all
                cuda.threadfence()  # (reads after it see what the other blocks wrote, not an earlier layer's)
                if writes:
                    attn[h, dim] = merge_shares(part_m, part_l, part_acc, h, dim, splits)
            cuda.syncthreads()  # q_s is read before the next round writes it

    return attend_stage


@cuda.jit(device=True)
def merge_shares(part_m, part_l, part_acc, h, dim, splits):
    """Head h's shares, each rescaled to the largest max: value dim of its attention output."""
    top = NEG_INF
    for s in range(splits):
        if part_l[h, s] > 0:  # a share with no cell (past the position) holds nothing
            top = max(top, part_m[h, s])
    total, mixed = float32(0.0), float32(0.0)
    for s in range(splits):
        if part_l[h, s] > 0:
            w = math.exp(part_m[h, s] - top)
            total += part_l[h, s] * w
            mixed += part_acc[h, s, dim] * w
    return mixed / total  # the position's own cell is always seen: total > 0
# --8<-- [end:attend_stage]


# --8<-- [start:wo_stage]
def make_wo_stage(dot, rotated):
    """rotated: V's cells are Hadamard-rotated (k8v4), so the output is turned back (H = H^-1)."""
    product_add = make_product(dot, add=True)

    @cuda.jit(device=True)
    def wo_stage(x, a, b,  # x (1, d) float32, added to; views of this layer's Wo rows
                 attn,     # (n_heads, hd) float32: attention's output
                 xs):      # (1, >= n_heads hd) float32 shared
        n_heads, hd = attn.shape
        for e in range(cuda.threadIdx.x, n_heads * hd, cuda.blockDim.x):  # the block's own copy
            xs[0, e] = attn[e // hd, e % hd]
        cuda.syncthreads()
        if rotated:  # a warp a 64-value row: fwht64_lanes, fwht64's additions with the lanes at once
            warp, lane, warps = cuda.threadIdx.x // WARP, cuda.threadIdx.x % WARP, cuda.blockDim.x // WARP
            rows = n_heads * hd // HADAMARD_N
            for r in range((rows + warps - 1) // warps):  # every warp the same rounds (shuffles want all lanes)
                j = min(r * warps + warp, rows - 1) * HADAMARD_N  # past the last: redo it, write nothing
                lo, hi = fwht64_lanes(xs[0, j + lane], xs[0, j + lane + WARP], lane)  # (a, b: the weights)
                cuda.syncthreads()  # each row is read before it is written
                if r * warps + warp < rows:
                    xs[0, j + lane], xs[0, j + lane + WARP] = lo, hi
            cuda.syncthreads()
        product_add(x, a, b, xs, n_heads * hd)

    return wo_stage
# --8<-- [end:wo_stage]


# --8<-- [start:ffn_stages]
def make_gate_up_stage(dot):
    @cuda.jit(device=True)
    def gate_up_stage(d, a, b,  # the length of x; views of this layer's Wgate_up rows: gate rows, then up rows
                      h_ff,     # (1, ff) float32, written: silu(gate) * up
                      xs):      # (1, >= d) float32 shared: rmsnorm(x)
        ff = h_ff.shape[1]
        lane = cuda.threadIdx.x % WARP
        for r in range(warp_rounds(ff)):
            i, writes = warp_unit(r, ff)
            g = dot(xs, d, a, b, i, lane)
            u = dot(xs, d, a, b, ff + i, lane)
            if writes and lane == 0:
                h_ff[0, i] = silu_times(g, u)

    return gate_up_stage
# --8<-- [end:ffn_stages]


# --8<-- [start:head_stages]
@cuda.jit(device=True)
def pick_stage(pos, logits, token, positions, chosen):
    """Thread block 0 alone: the first index of the largest logit (argmax's rule) becomes
    the next step's token, at the next position, and the host's copy in the ring `chosen`
    (advance_step's rule: the step at p writes slot p % len(chosen))."""
    if cuda.blockIdx.x != 0:
        return
    vocab = logits.shape[1]
    best, best_j = NEG_INF, vocab  # vocab = "no value yet"
    for j in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        if logits[0, j] > best or best_j == vocab:
            best, best_j = logits[0, j], j
    top, first = first_of_max(best, best_j, vocab)
    if cuda.threadIdx.x == 0:
        token[0] = first
        chosen[pos % chosen.shape[0]] = first
        positions[0] = pos + 1
# --8<-- [end:head_stages]
