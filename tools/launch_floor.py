"""What the boundary between two steps of work costs on a GPU: a kernel boundary, plain or
dependent, against a barrier inside one kernel. A decode step is ~150 kernels a token,
each a few microseconds of work, so this cost, paid at every boundary, sets how fast a
step can be; the answer says whether a layer run as one kernel with barriers between its
ops could beat a layer run as one kernel per op.

    STRATA_NB_GPU=1 python tools/launch_floor.py                  # 64 phases, 132 and 264 blocks
    STRATA_NB_GPU=1 python tools/launch_floor.py --phases 128 --blocks 144

Every variant runs PHASES phases of the same small work: each thread reads the value a
thread of the next thread block wrote in the phase before, adds 1 and writes it, so no
phase may start before the one before it has ended everywhere. The variants:

- plain       one kernel a phase, captured into a CUDA graph and replayed;
- dependent   the same kernels launched as dependent (fast/dependent_launch.py: each
              waits for the one before at its first instruction), captured and replayed;
- grid sync   one cooperative kernel, its phases separated by `cuda.cg.this_grid().sync()`
              (the grid may hold only as many blocks as the GPU runs at once);
- barrier     one ordinary kernel, its phases separated by a barrier of its own: a count
              per phase in device memory that every block adds 1 to and waits on (every
              block must be resident, as for grid sync).

It prints the microseconds a phase for each (CUDA events over many replays or launches),
and checks that every variant left each value at PHASES (a barrier that let a block run
ahead would leave less). A variant the GPU or this Numba cannot run prints why.
"""
import argparse
import os
import sys

import numpy as np

os.environ.setdefault("STRATA_NB_GPU", "1")
from numba import cuda, int32  # noqa: E402

from strata_nb.fast.cuda_graph import StepGraph  # noqa: E402
from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs, waits_for_inputs  # noqa: E402
from strata_nb.gpu.launch import stream  # noqa: E402  (importing it installs the fast launch path)

sys.path.insert(0, os.path.dirname(__file__))
from expert_miss import timed  # noqa: E402  (us a call: CUDA events, the median of 5 batches)

THREADS = 128


# --8<-- [start:phase_kernels]
@cuda.jit(device=True)
def phase(values, p, b, t):
    """Phase p: values[dst, b, t] = what the next block wrote in phase p - 1, plus 1."""
    src, dst = p % 2, (p + 1) % 2
    values[dst, b, t] = values[src, (b + 1) % cuda.gridDim.x, t] + 1


@cuda.jit
def phase_kernel(values, p):
    """One phase a launch."""
    phase(values, p, cuda.blockIdx.x, cuda.threadIdx.x)


@cuda.jit
def dependent_phase_kernel(values, p):
    """One phase a launch, launched as dependent: it waits for the launch before it."""
    wait_for_inputs()
    let_next_start()
    phase(values, p, cuda.blockIdx.x, cuda.threadIdx.x)


waits_for_inputs(dependent_phase_kernel)


@cuda.jit
def grid_sync_kernel(values, n_phases):
    """Every phase in one cooperative launch, a grid-wide sync after each."""
    grid = cuda.cg.this_grid()
    for p in range(n_phases):
        phase(values, p, cuda.blockIdx.x, cuda.threadIdx.x)
        grid.sync()


@cuda.jit
def barrier_kernel(values, arrived, n_phases, before):
    """Every phase in one launch, each followed by a barrier of its own: thread 0 of each
    block makes the block's writes visible, adds 1 to the phase's count and spins until
    every block has; then the block reads on. arrived (n_phases,) int32 keeps counting
    across passes, so nothing resets it between them: this pass waits for `before` (what
    the passes before it left in each count) plus one arrival a block."""
    b, t = cuda.blockIdx.x, cuda.threadIdx.x
    for p in range(n_phases):
        phase(values, p, b, t)
        cuda.threadfence()  # this thread's write reaches the whole GPU before the count
        cuda.syncthreads()
        if t == 0:
            cuda.atomic.add(arrived, p, int32(1))
            while cuda.atomic.add(arrived, p, int32(0)) < before + cuda.gridDim.x:  # an atomic read: never stale
                pass
            cuda.threadfence()  # what the other blocks wrote before their count is visible here
        cuda.syncthreads()
# --8<-- [end:phase_kernels]


def result_ok(values, n_phases: int) -> bool:
    """After n_phases phases from zeros, every value is n_phases (in the array phase
    n_phases - 1 wrote)."""
    return bool((values.copy_to_host()[n_phases % 2] == n_phases).all())


def run_variant(name, blocks, n_phases, launch, stream_of, reset):
    """Time launch() (one pass of all phases); check one fresh pass's values."""
    try:
        per_pass = timed(launch, stream_of())
        reset()
        launch()
        cuda.synchronize()
        ok = result_ok(VALUES[blocks], n_phases)
    except Exception as err:  # a variant this GPU or Numba cannot run: say why, go on
        print(f"  {name:10s} not run: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return
    print(f"  {name:10s} {per_pass / n_phases:6.2f} us a phase   ({per_pass:7.1f} us a pass)"
          f"   values {'ok' if ok else 'WRONG: a phase ran ahead'}")


VALUES = {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=64)
    ap.add_argument("--blocks", default="132,264", help="thread blocks, comma-separated")
    args = ap.parse_args()
    n = args.phases
    dev = cuda.get_current_device()
    print(f"{dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, {dev.MULTIPROCESSOR_COUNT} SMs, "
          f"{THREADS} threads a block, {n} phases")
    for blocks in (int(b) for b in args.blocks.split(",")):
        values = VALUES[blocks] = cuda.to_device(np.zeros((2, blocks, THREADS), np.int32))
        arrived = cuda.to_device(np.zeros(n, np.int32))

        def reset():
            values.copy_to_device(np.zeros((2, blocks, THREADS), np.int32))
            arrived.copy_to_device(np.zeros(n, np.int32))

        print(f"{blocks} blocks:")
        for name, kernel in (("plain", phase_kernel), ("dependent", dependent_phase_kernel)):
            def launch_all(kernel=kernel):
                for p in range(n):
                    kernel[blocks, THREADS, stream()](values, np.int32(p))

            launch_all()  # compile before the capture
            cuda.synchronize()
            graph = StepGraph(launch_all)
            run_variant(name, blocks, n, graph.replay, lambda g=graph: g.stream, reset)

        most = resident_most(grid_sync_kernel, "grid sync", np.int32(1))  # None: no grid sync here
        s = cuda.stream()
        if most is not None and blocks > most:
            print(f"  grid sync  not run: {blocks} blocks, and a cooperative grid holds at most {most}")
        elif most is not None:
            run_variant("grid sync", blocks, n, lambda: grid_sync_kernel[blocks, THREADS, s](values, np.int32(n)),
                        lambda: s, reset)
        # a block that is not resident would never reach the barrier the others spin in
        most = resident_most(barrier_kernel, "barrier", cuda.to_device(np.zeros(1, np.int32)), np.int32(1),
                             np.int32(0))
        if most is None:
            continue
        if blocks > most:
            print(f"  barrier    not run: {blocks} blocks cannot all be resident at once (at most {most})")
            continue
        # the counts go on from pass to pass, so a timed pass is the kernel alone: nothing
        # is copied to zero them between passes
        passes = [0]

        def barrier_pass():
            barrier_kernel[blocks, THREADS, s](values, arrived, np.int32(n), np.int32(passes[0] * blocks))
            passes[0] += 1

        def barrier_reset():
            reset()
            passes[0] = 0

        run_variant("barrier", blocks, n, barrier_pass, lambda: s, barrier_reset)


def resident_most(kernel, name, *args):
    """How many blocks of THREADS of `kernel` the GPU holds at once (its occupancy times the
    SMs: the most a cooperative launch may have), after one launch of a single block with
    `args` after `values` compiles it; None, said why, where it does not compile or run."""
    try:
        kernel[1, THREADS](cuda.to_device(np.zeros((2, 1, THREADS), np.int32)), *args)
        cuda.synchronize()
        return next(iter(kernel.overloads.values())).max_cooperative_grid_blocks(THREADS)
    except Exception as err:
        print(f"  {name:10s} not run: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return None


if __name__ == "__main__":
    main()
