"""What an expert-cache miss costs on a GPU, served the ways it can be: read from pinned
host memory by the expert kernels themselves, staged through shared memory (what the
engine does when its cache can miss) or read in place part by part (the unstaged build),
or copied into a VRAM slot first and then read there. Against the cost of a hit (the
slot already holds it).

    STRATA_NB_GPU=1 python tools/expert_miss.py

One layer's expert FFN for one token (T = 1) on the shapes of moefy's copies file from
the default model (D 576, F 1,536, Q4_1, K = 2 of E = 8: 1.58 MiB an expert), random
bytes (the time depends on the shapes only). Each case runs `expert_gate_up` then
`expert_down`, captured into a CUDA graph and replayed (so the time is the GPU's, not the
host's launch work), timed with CUDA events over many replays. The "down read ahead" cases
run expert_gate_up as the engine does, reading the chosen experts' down matrices ahead
(those in slots: a miss's is not read ahead). The copy case is the two
experts' copies (cuMemcpyHtoDAsync from the pinned host copy, timed the same way) plus
the hit case's kernels; the engine's way of copying, the KV movers' copy kernel reading
the mapped host copy on the compute stream (`copy_experts`), is timed the same way.
Prints microseconds per layer and the bus rate a miss reaches.
"""
import os
import sys
import time

import numpy as np

os.environ.setdefault("STRATA_NB_GPU", "1")
from numba import cuda  # noqa: E402

from strata_nb.fast.expert_down import expert_down  # noqa: E402
from strata_nb.fast.expert_gate_up import expert_gate_up  # noqa: E402

D, F, E, K, QTYPE, ROW_D, ROW_F = 576, 1536, 8, 2, "Q4_1", 576 // 32 * 20, 1536 // 32 * 20
REPS = 200


def timed(run, on) -> float:
    """Microseconds per call of run(), which queues work on stream `on`: the median of 5
    batches of REPS."""
    run()
    cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = cuda.event(), cuda.event()
        start.record(on)
        for _ in range(REPS):
            run()
        end.record(on)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) * 1000 / REPS)
    return float(np.median(times))


def replayed(launch):
    """us per replay of the launches launch() makes, captured into a CUDA graph."""
    from strata_nb.fast.cuda_graph import StepGraph

    launch()  # compile first: capture records launches, it does not compile
    cuda.synchronize()
    graph = StepGraph(launch)
    return timed(graph.replay, graph.stream)


def main():
    rng = np.random.default_rng(0)
    host_gu = cuda.mapped_array((E, 2 * F, ROW_D), np.uint8)
    host_down = cuda.mapped_array((E, D, ROW_F), np.uint8)
    host_gu[...] = rng.integers(0, 256, host_gu.shape, np.uint8)
    host_down[...] = rng.integers(0, 256, host_down.shape, np.uint8)
    for a in (host_gu, host_down):  # finite fp16 scales: the kernels' time does not depend on them
        halves = np.asarray(a).view(np.float16)
        halves[..., ::10], halves[..., 1::10] = np.float16(0.01), np.float16(0.0)
    slots_gu = cuda.to_device(np.array(host_gu[:K]))
    slots_down = cuda.to_device(np.array(host_down[:K]))
    chosen = cuda.to_device(np.array([[3, 6]], np.int32))
    weights = cuda.to_device(np.array([[0.6, 0.4]], np.float32))
    resident = cuda.to_device(np.array([[0, 1]], np.int32))  # the chosen experts' slots (route's slot_of)
    missing = cuda.to_device(np.full((1, K), -1, np.int32))
    x_norm = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    h = cuda.device_array((1, K, F), np.float32)
    x = cuda.to_device(np.zeros((1, D), np.float32))

    def experts(slot_of, stage=True, ahead=False):
        expert_gate_up(x_norm, chosen, slot_of, 0, slots_gu, host_gu, QTYPE, h, stage=stage,
                       ahead=(slots_down, host_down) if ahead else None)
        expert_down(h, chosen, weights, slot_of, 0, slots_down, host_down, QTYPE, x, stage=stage)

    copies = cuda.stream()

    def copy_both():
        for slot, e in enumerate((3, 6)):
            slots_gu[slot].copy_to_device(np.asarray(host_gu)[e], stream=copies)
            slots_down[slot].copy_to_device(np.asarray(host_down)[e], stream=copies)

    from strata_nb.kernels.kv.copy_runs import as_words, copy_runs

    runs = [(as_words(host_gu), as_words(slots_gu)), (as_words(host_down), as_words(slots_down))]
    experts_at, slots_at = np.array([3, 6], np.int32), np.array([0, 1], np.int32)
    experts_dev, slots_dev = cuda.to_device(experts_at), cuda.to_device(slots_at)

    def fill_both():  # as ExpertCache._copy: NumPy indices, moved by the launcher
        for host, slot_pool in runs:
            copy_runs(host, slot_pool, experts_at, slots_at)

    def fill_kernels():  # the kernels alone, for the graph
        for host, slot_pool in runs:
            copy_runs(host, slot_pool, experts_dev, slots_dev)

    hit, staged = replayed(lambda: experts(resident)), replayed(lambda: experts(missing))
    in_place = replayed(lambda: experts(missing, stage=False))
    hit_ahead, staged_ahead = replayed(lambda: experts(resident, ahead=True)), replayed(lambda: experts(missing, ahead=True))
    copied = timed(copy_both, copies) + hit
    filled = replayed(fill_kernels) + hit
    fill_both()
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fill_both()
    host_us = (time.perf_counter() - t0) / REPS * 1e6
    cuda.synchronize()
    miss_bytes = K * (host_gu[0].nbytes + host_down[0].nbytes)
    print(f"one layer, T = 1, K = {K} experts of {miss_bytes / K / 2**20:.2f} MiB ({QTYPE}, D {D}, F {F})")
    print(f"  both hits (VRAM slots):          {hit:8.1f} us")
    print(f"  both hits, down read ahead:      {hit_ahead:8.1f} us")
    for name, us in (("both misses, staged", staged), ("staged, down read ahead", staged_ahead),
                     ("both misses, read in place", in_place),
                     ("both misses, DMA copy then read", copied),
                     ("both misses, copy kernel then read", filled)):
        print(f"  {name + ':':32s} {us:8.1f} us  ({miss_bytes / (us - hit) / 1e3:.1f} GB/s over the bus for the misses)")
    print(f"  (the copy kernel's launches cost the host {host_us:.1f} us for both experts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
