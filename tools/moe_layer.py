"""One layer's FFN for one token on a GPU: the dense pair of matvecs against the expert
path (route, expert_gate_up, expert_down) at moefy's shapes from the default model, every
expert resident, and each expert kernel alone. Each case is captured into a CUDA graph
and replayed (the GPU's time, not the host's launch work), timed with CUDA events over
many replays. The weights stay in the GPU's L2 cache between replays, so this is the
kernels' latency, not HBM's.

    STRATA_NB_GPU=1 python tools/moe_layer.py

Shapes: D 576, Q4_1 weights, F32 router. split: E 8 of F 192, K = 8 (the same bytes as
the dense FFN's F 1,536: the bench's goal compares these two); copies: E 8 of F 1,536,
K = 2. Random bytes: the time depends on the shapes only.
"""
import os
import sys

import numpy as np

os.environ.setdefault("STRATA_NB_GPU", "1")
from numba import cuda  # noqa: E402

from strata_nb.fast import expert_down as fast_down, expert_gate_up as fast_gate_up, route as fast_route  # noqa: E402
from strata_nb.fast.matvec_fused import matvec_fused  # noqa: E402
from strata_nb.kernels.experts import expert_down as plain_down, expert_gate_up as plain_gate_up  # noqa: E402
from strata_nb.kernels.experts import route as plain_route  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from expert_miss import replayed  # noqa: E402

D, QTYPE, ROW = 576, "Q4_1", 20  # bytes per 32 values


def q41(rng, n, rows, cols):
    """(n, rows, bytes) random Q4_1 rows with small finite fp16 scales."""
    a = rng.integers(0, 256, (n, rows, cols // 32 * ROW), np.uint8)
    halves = a.view(np.float16)
    halves[..., ::10], halves[..., 1::10] = np.float16(0.01), np.float16(0.0)
    return a


def main():
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    norm = cuda.to_device(np.ones(D, np.float32))
    dense_gu, dense_down = cuda.to_device(q41(rng, 1, 2 * 1536, D)[0]), cuda.to_device(q41(rng, 1, D, 1536)[0])
    gu_out = cuda.device_array((1, 2 * 1536), np.float32)

    def dense():
        matvec_fused(x, dense_gu, QTYPE, gu_out, norm=norm, eps=1e-5)
        matvec_fused(gu_out, dense_down, QTYPE, x, swiglu=True, add=True)

    print(f"dense FFN (F 1536), two matvecs:  {replayed(dense):7.1f} us")
    for name, e, f, k in (("split", 8, 192, 8), ("copies", 8, 1536, 2)):
        gu, dn = cuda.to_device(q41(rng, e, 2 * f, D)), cuda.to_device(q41(rng, e, D, f))
        router = cuda.to_device((0.1 * rng.standard_normal((e, D))).astype(np.float32).view(np.uint8))
        res = cuda.to_device(np.arange(e, dtype=np.int32))
        slot_of = cuda.to_device(np.zeros((1, k), np.int32))
        counts = [cuda.to_device(np.zeros(e, np.int32)) for _ in range(2)]
        x_norm = cuda.device_array((1, D), np.float32)
        chosen, weights = cuda.device_array((1, k), np.int32), cuda.device_array((1, k), np.float32)
        h = cuda.device_array((1, k, f), np.float32)

        tiers = {False: (fast_route, fast_gate_up, fast_down), True: (plain_route, plain_gate_up, plain_down)}

        def route_only(plain_kernel=False):
            tiers[plain_kernel][0].route(x, norm, 1e-5, router, "F32", x_norm, chosen, weights, slot_of, res, 0,
                                         *counts)

        def gate_up_only(plain_kernel=False):
            tiers[plain_kernel][1].expert_gate_up(x_norm, chosen, slot_of, 0, gu, gu, QTYPE, h)

        def down_only(plain_kernel=False):
            tiers[plain_kernel][2].expert_down(h, chosen, weights, slot_of, 0, dn, dn, QTYPE, x)

        def fast_tier():  # the three kernels as the fast engine runs them
            route_only(), gate_up_only(), down_only()

        def plain_tier():
            route_only(True), gate_up_only(True), down_only(True)

        tag = f"{name} E{e} K{k} F{f}"
        print(f"{tag}: route, gate|up, down  {replayed(fast_tier):7.1f} us (the plain kernels: "
              f"{replayed(plain_tier):.1f})   alone: route {replayed(route_only):.1f} "
              f"(plain {replayed(lambda: route_only(True)):.1f}), gate|up {replayed(gate_up_only):.1f} "
              f"(plain {replayed(lambda: gate_up_only(True)):.1f}), "
              f"down {replayed(down_only):.1f} (plain {replayed(lambda: down_only(True)):.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
