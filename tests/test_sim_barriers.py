"""The tests' changes to the simulator, against the simulator's own. tests/sim_barriers.py
(barriers woken instead of polled, Python threads kept in a pool): the same values through
several barriers and syncthreads_count/and/or, threads that returned left out of later
barriers, a thread's exception failing the launch with the same message, and a pooled
thread's per-CUDA-thread state (gpu/reduce.py's exchange) fresh in each launch.
tests/sim_device_calls.py (device calls, casts and array elements made cheap): the same
values, and every module's `cuda` put back after a launch."""
import time
import warnings

import numpy as np
import pytest
from numba import cuda, int64

from strata_nb.gpu.geometry import SIMULATED

if not SIMULATED:
    pytest.skip("tests the CUDA simulator's barriers", allow_module_level=True)

import sim_barriers  # noqa: E402
import sim_device_calls  # noqa: E402
from numba import float32  # noqa: E402
from numba.cuda.simulator import kernel as sim  # noqa: E402

from strata_nb.gpu import reduce  # noqa: E402
from strata_nb.gpu.reduce import warp_sum  # noqa: E402

BLOCKS, N, ROUNDS = 3, 48, 4  # N threads a block: not a multiple of 32
EARLY = 40  # threads from this one on return before the last two barriers
MANAGERS = {"woken": sim_barriers.WokenBlockManager, "plain": sim_barriers.PLAIN}


@cuda.jit
def barriers_kernel(out, late, counts):
    """out: (BLOCKS, N, ROUNDS) int64, each round a neighbour's value read across a barrier;
    late: (BLOCKS, N) int64, the same after threads EARLY.. returned (theirs untouched);
    counts: (BLOCKS, 3) int64, syncthreads_count / _and / _or."""
    shared = cuda.shared.array(N, int64)
    t, b = cuda.threadIdx.x, cuda.blockIdx.x
    for r in range(ROUNDS):
        if t == N - 1:
            time.sleep(0.01)  # the last thread comes late: a barrier that lets any pass shows
        shared[t] = r * N + t
        cuda.syncthreads()
        out[b, t, r] = shared[(t + 1) % N]
        cuda.syncthreads()  # every thread has read before the next round overwrites
    count = cuda.syncthreads_count(t % 3 == 0)
    all_ = cuda.syncthreads_and(t < N)
    any_ = cuda.syncthreads_or(t == 7)
    if t == 0:
        counts[b, 0], counts[b, 1], counts[b, 2] = count, all_, any_
    if t >= EARLY:
        return
    if t == EARLY - 1:
        time.sleep(0.01)
    shared[t] = 1000 + t
    cuda.syncthreads()  # met by the EARLY threads left
    late[b, t] = shared[(t + 1) % EARLY]
    cuda.syncthreads()


def barriers_ref():
    t = np.arange(N)
    out = np.broadcast_to(np.arange(ROUNDS) * N + ((t + 1) % N)[:, None], (BLOCKS, N, ROUNDS))
    late = np.full((BLOCKS, N), -1)
    late[:, :EARLY] = 1000 + (t[:EARLY] + 1) % EARLY
    counts = np.broadcast_to([(N + 2) // 3, 1, 1], (BLOCKS, 3))
    return out, late, counts


def run_barriers():
    out = np.zeros((BLOCKS, N, ROUNDS), np.int64)
    late = np.full((BLOCKS, N), -1, np.int64)
    counts = np.zeros((BLOCKS, 3), np.int64)
    barriers_kernel[BLOCKS, N](out, late, counts)
    return out, late, counts


@cuda.jit
def failing_kernel(out):
    """out: (N,) int64. Thread 5 of block 1 raises between two barriers."""
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5 and cuda.blockIdx.x == 1:
        raise ValueError("thread 5 fails")
    cuda.syncthreads()
    out[t] = t


@pytest.mark.parametrize("manager", MANAGERS)
def test_barriers_hold_every_thread(manager, monkeypatch):
    monkeypatch.setattr(sim, "BlockManager", MANAGERS[manager])
    for got, want in zip(run_barriers(), barriers_ref()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("manager", MANAGERS)
def test_a_thread_that_raises_fails_the_launch(manager, monkeypatch):
    monkeypatch.setattr(sim, "BlockManager", MANAGERS[manager])
    with pytest.raises(ValueError, match=r"^tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]: thread 5 fails$"):
        failing_kernel[2, N](np.zeros(N, np.int64))
    for got, want in zip(run_barriers(), barriers_ref()):  # the next launch is not disturbed
        np.testing.assert_array_equal(got, want)


def test_a_barrier_that_holds_no_one_fails(monkeypatch):
    """Negative control: with syncthreads a no-op, the late thread's value is missed."""
    monkeypatch.setattr(sim, "BlockManager", sim_barriers.WokenBlockManager)
    monkeypatch.setattr(sim_barriers.WokenThread, "syncthreads", lambda self: None)
    out, _, _ = run_barriers()
    assert not np.array_equal(out, barriers_ref()[0])


def test_another_simulator_is_left_alone(monkeypatch):
    monkeypatch.setattr(sim, "BlockManager", sim_barriers.PLAIN)
    monkeypatch.delenv("STRATA_NB_SIM_BARRIERS", raising=False)
    monkeypatch.setattr(sim_barriers, "WRITTEN_AGAINST", "0" * 64)
    with pytest.warns(UserWarning, match="keeps its own"):
        assert not sim_barriers.install()
    assert sim.BlockManager is sim_barriers.PLAIN
    monkeypatch.setenv("STRATA_NB_SIM_BARRIERS", "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sim_barriers.install()


@cuda.jit
def warp_sums_kernel(x, out):
    """out[i] = the sum of x over thread i's warp, by gpu/reduce.py's warp_sum (a device
    function of another module, trading values through a thread-local scratch; one
    exchange, so a count carried over from another CUDA thread shows), plus a cast and a
    slice's length (1)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    out[i] = warp_sum(x[i]) + float32(len(x[i:i + 1]))


def test_device_calls_from_pooled_threads_give_the_simulator_s_values(monkeypatch):
    """Launches of 64, 48 and 2 x 64 threads in a row: in the last, the warp of threads
    32-63 is played by threads of the pool that played a CUDA thread once (48-63) and
    twice (32-47) before. Each value as numba-cuda's own simulator gives it, and each
    warp's sum; reduce.py's `cuda` is numba.cuda again after each launch."""
    monkeypatch.setattr(sim_barriers, "IDLE", [])  # a pool of its own, with no history
    rng = np.random.default_rng(7)
    for blocks, threads in ((1, 64), (1, 48), (2, 64)):
        x = rng.standard_normal(blocks * threads).astype(np.float32)
        got = np.zeros_like(x)
        warp_sums_kernel[blocks, threads](x, got)
        assert reduce.cuda is cuda
    with monkeypatch.context() as plain:
        plain.setattr(sim, "BlockManager", sim_barriers.PLAIN)
        plain.setattr(sim.FakeCUDAKernel, "__call__", sim_device_calls.ORIGINAL["call"])
        plain.setattr(sim, "_push_kernel_context", sim_device_calls.ORIGINAL["push"])
        want = np.zeros_like(x)
        warp_sums_kernel[blocks, threads](x, want)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_allclose(got, np.repeat(x.reshape(-1, 32).sum(1), 32) + 1, rtol=1e-5, atol=1e-5)
