"""Plain twins: kernels/dense/embed.py embed_rows_kernel and embed_kernel, launched as
dependent (fast/dependent_launch.py): the plain code after the wait for the kernel before
it, so a decode step's first launch overlaps the end of the step before. `embed` is the
plain launcher launching them (twins.py: relaunch); the bits are the plain kernels'.
"""
from __future__ import annotations

from numba import cuda

from strata_nb.fast.gguf_fetch import QTYPES
from strata_nb.fast.twins import inline_body, relaunch, twin_of
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs
from strata_nb.kernels.dense import embed as plain

_rows_body = inline_body(plain.embed_rows_kernel)


@waits_for_inputs
@cuda.jit(cache=True)
def embed_rows_kernel(table, ids, out):  # shapes as plain.embed_rows_kernel
    """Plain twin: kernels/dense/embed.py embed_rows_kernel, launched as dependent."""
    wait_for_inputs()
    let_next_start()
    _rows_body(table, ids, out)


def make_embed_kernel(part, nibbles):
    body = inline_body(plain.make_embed_kernel(plain.make_row_part(part, nibbles)))  # the plain code over gguf_fetch's part

    @cuda.jit(cache=True)
    def embed_kernel(a, b, ids, out):  # shapes as plain.make_embed_kernel's embed_kernel
        """Plain twin: kernels/dense/embed.py embed_kernel, launched as dependent."""
        wait_for_inputs()
        let_next_start()
        body(a, b, ids, out)

    return waits_for_inputs(embed_kernel)


EMBED_KERNELS = {qtype: make_embed_kernel(part, nibbles) for qtype, (part, _, _, nibbles) in QTYPES.items()}

embed = twin_of(plain.embed)(relaunch(plain.embed, embed_rows_kernel=embed_rows_kernel, EMBED_KERNELS=EMBED_KERNELS))
