"""Plain twin: kernels/attention/attention.py attention. The fast tier's attention
launcher: the same arrays, checked by the same checks, sent to the kernel that suits the
pass instead of one thread block per (query, head).

    a decode step, a verify window   attention_step.py: a split of the selection per
    (one query per thread block)     thread block, merged in the same launch
    a prompt chunk                   attention_prefill.py: a tile of queries per thread
                                     block, then a combine kernel; on tensor cores,
                                     attention_prefill_mma.py

Tolerance against the plain kernel and the reference: attention.py's ATOL and RTOL. All
three compute in float32 on the same dequantized values and differ only in the order of
their sums (split by split, tile by tile, the merge) and in exp.
"""
from __future__ import annotations

import numpy as np

from strata_nb.fast import attention_prefill_mma as mma_prompt
from strata_nb.fast.attention_prefill import attention_prompt, most_queries, tile_for
from strata_nb.fast.attention_step import attention_step
from strata_nb.fast.twins import twin_of
from strata_nb.fast import tensor_core
from strata_nb.gpu.geometry import COMBINE_GROUPS
from strata_nb.gpu.launch import DeviceArgs
from strata_nb.kernels.attention import attention as plain
from strata_nb.kernels.kv.kv_readers import SIDES, side_arrays


def ordered_rows(blocks: np.ndarray) -> bool:
    """Does every row of a selection ascend, with its -1 padding at the end? all_blocks_upto's
    and select_blocks' lists do; attention_ref reads any order, as a set."""
    before, after = blocks[:, :-1], blocks[:, 1:]
    return bool(np.all((after < 0) | ((before >= 0) & (after >= before))))


@twin_of(plain.attention)
def attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out: bool = False,
              ordered: bool | None = None, rows_alone: bool = False, window: int = 0, *, per_split: int | None = None,
              combine_groups: int = COMBINE_GROUPS, tile: int | None = None, mma: bool | None = None):
    """Like attention_ref, on the device; NumPy arguments are moved (out written back).

    One query per thread block (a decode step, a verify window, queries whose selections
    differ) runs attention_step_kernel (attention_step.py); a prompt chunk's tiles run
    attention_prefill.py's kernel and the combine.

    ordered: every row of `blocks` ascends with its padding at the end, which lets the
    step kernel skip the merge for a query whose cells all lie in its first split. None:
    a NumPy list is looked at, a device one taken as unordered; True for a device list is
    the caller's word (a step's list); False turns the shortcut off. rows_alone: a prompt
    chunk's query gets the same bits whatever chunk it comes in, and however far the
    shared row of blocks reaches (attention_prompt says how).

    Tuning: per_split, selected blocks per thread block (each kernel has its own default);
    combine_groups, thread rows merging the prompt kernel's splits; tile, queries per
    thread block (default tile_for's choice); tests set them to get many splits, several
    rows and tiles under the simulator. mma: a prompt chunk's tiles run the tensor-core
    kernel (attention_prefill_mma.py) instead; None = where tensor_core.enabled() and it
    can run, True = it must."""
    assert window == 0, "the fast tier's attention has no sliding window: check_model stops such a model"
    n_kv, host = plain.check_attention(fmt, q, q_pos, blocks, page_table, pool, host, out, rotate_out)
    n_q, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    if mma is None:
        mma = tensor_core.enabled() and not mma_prompt.usable(head_dim)
    assert not mma or not mma_prompt.usable(head_dim), f"no tensor-core prompt kernel: {mma_prompt.usable(head_dim)}"
    most = mma_prompt.most_queries(group) if mma else most_queries(group, head_dim)
    assert most >= 1, f"{group} query heads of {head_dim} per KV head do not fit the shared rows"
    tile = tile_for(blocks, group, head_dim, n_q, most) if tile is None else tile
    assert 1 <= tile <= most, f"tile {tile} too large: a thread block takes {most} queries"
    if n_q == 0:
        return
    assert not rows_alone or blocks.shape[0] == 1, "rows_alone is for a prompt chunk's shared row"
    kind_k, kind_v = SIDES[fmt]
    step_kernel = tile == 1 and not rows_alone  # one query per thread block (rows_alone: the prompt kernel's bits)
    if step_kernel and blocks.shape[0] != n_q:  # the step kernel reads a row per query
        assert isinstance(blocks, np.ndarray), "a shared selection in device memory is for one query"
        blocks = np.ascontiguousarray(np.broadcast_to(blocks, (n_q, blocks.shape[1])))
    with DeviceArgs() as dev:
        sides = (*side_arrays(kind_k, "k", pool, dev), *side_arrays(kind_v, "v", pool, dev),
                 *side_arrays(kind_k, "k", host, dev), *side_arrays(kind_v, "v", host, dev))
        args = (dev.read(q), dev.read(q_pos), dev.read(blocks), dev.read(page_table), plain.score_scale(head_dim))
        if step_kernel:
            if isinstance(blocks, np.ndarray):  # looked at: None = as found, True = it must be
                found = ordered_rows(blocks)
                assert found or not ordered, "ordered=True, but a row of blocks does not ascend with its padding last"
                ordered = found if ordered is None else ordered
            attention_step(fmt, n_kv, args, sides, dev.write(out), rotate_out, per_split, bool(ordered))
            return
        # the tensor-core kernel by keyword only: without it attention_prompt runs its own
        kernel = {"kernel": mma_prompt.MMA_KERNELS[fmt, head_dim], "threads": mma_prompt.MMA_THREADS} if mma else {}
        attention_prompt(fmt, n_kv, args, sides, dev.write(out), rotate_out, per_split, combine_groups, tile,
                         rows_alone, **kernel)
