"""Temperature and top-p (nucleus) sampling on the device: the next token is drawn where
the logits are, so a graph-replayed step needs no host round trip to sample.

For logits l (vocab,), temperature T > 0, top_p in (0, 1]:

1. w_i = exp((l_i - max l) / T), in float32; the largest weight is 1.
2. The nucleus is the tokens with w_i >= tau, for the largest tau whose kept mass
   S(tau) = sum of w_i >= tau reaches top_p * sum of all w_i: the fewest most likely
   tokens holding top_p of the probability, as the host sampler's sort-and-cut keeps.
   S only falls as tau rises, so BISECT halvings of [0, 1] find tau with no sort.
3. u in [0, 1) is a hash of (seed, counter): the same bits on the host and the device,
   and a fresh draw per step because the counter is the step's position.
4. The token is the first, in vocabulary order, where the running nucleus mass passes
   u * S(tau): each token is drawn with probability w_i / S(tau).

The host sampler (engine/sampling.py) draws from the same distribution but with NumPy's
generator and in sorted order, so the two pick different tokens for one seed.

Kernel vs reference: both compute the same float32 weights (CUDA's expf and NumPy's
differ by at most 2 ulp) and add them in different orders, so a sum can differ in its
last bits. The pick differs only if u * S(tau) or a bisection midpoint lands within
those bits of a boundary: on random logits, about one draw in 10^6. The tests compare
picks on logits and seeds where that does not happen, and say so.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64

from strata_nb.gpu.launch import DeviceArgs, expect, stream
from strata_nb.gpu.geometry import SAMPLE_THREADS
from strata_nb.gpu.reduce import NEG_INF, block_max, block_sum

# Threads for the one block: 1024 on a GPU, 64 under the simulator (each a Python thread)
THREADS = SAMPLE_THREADS
MAX_THREADS = 1024  # the shared array of per-thread partial sums
BISECT = 30  # halvings of [0, 1] for tau: finer than float32 near 1
MASK = 0xFFFFFFFF


# --8<-- [start:sample_top_p_ref]
def uniform_ref(seed: int, counter: int) -> np.float32:
    """A float32 in [0, 1) from (seed, counter < 2^31): integer mixing, 24 bits kept.
    Every product stays below 2^63, so the device's int64 arithmetic never overflows."""
    x = ((seed & MASK) ^ (counter * 0x2545F491)) & MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & MASK
    x ^= x >> 16
    return np.float32((x >> 8) * (1.0 / (1 << 24)))


def sample_top_p_ref(logits,       # (vocab,) float32
                     inv_temperature,  # float32: 1 / T
                     top_p,        # float32 in (0, 1]
                     seed,         # int: the draw's seed
                     counter,      # (1,) int32: the step's position
                     out):         # (1,) int32, written: the token
    w = np.exp((logits - logits.max()) * np.float32(inv_temperature)).astype(np.float32)
    target = np.float32(top_p) * w.sum(dtype=np.float32)
    lo, hi = np.float32(0.0), np.float32(1.0)
    for _ in range(BISECT):
        mid = np.float32((lo + hi) * np.float32(0.5))
        if w[w >= mid].sum(dtype=np.float32) >= target:
            lo = mid
        else:
            hi = mid
    kept = np.where(w >= lo, w, np.float32(0.0))
    goal = uniform_ref(int(seed), int(counter[0])) * kept.sum(dtype=np.float32)
    running = np.cumsum(kept, dtype=np.float32)
    j = int(np.searchsorted(running, goal, side="right"))  # first token whose running mass > goal
    out[0] = min(j, int(np.flatnonzero(kept)[-1]))  # u * mass rounded up to the total: the last kept
# --8<-- [end:sample_top_p_ref]


# --8<-- [start:sample_top_p_kernel]
@cuda.jit(device=True)
def weight(logits, i, top, inv_temperature):
    """w_i of step 1, recomputed where it is needed (the same bits every time)."""
    return float32(math.exp((logits[i] - top) * inv_temperature))


@cuda.jit(device=True)
def kept_in(logits, first, last, top, inv_temperature, threshold):
    """The weights >= threshold among tokens [first, last), summed."""
    kept = float32(0.0)
    for i in range(first, last):
        w = weight(logits, i, top, inv_temperature)
        if w >= threshold:
            kept += w
    return kept


@cuda.jit(device=True)
def uniform(seed, counter):
    """uniform_ref on the device, in int64. The counter is widened first: the simulator
    runs this as NumPy, where an int32 counter times the constant would wrap in int32."""
    x = ((seed & MASK) ^ (int64(counter) * 0x2545F491)) & MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK
    x = ((x ^ (x >> 15)) * 0x68E31DA5) & MASK
    x ^= x >> 16
    return float32((x >> 8) * (1.0 / (1 << 24)))


@cuda.jit(cache=True)
def sample_top_p_kernel(logits, inv_temperature, top_p, seed, counter, out):  # as sample_top_p_ref
    # One block. Thread t owns the chunk [t * chunk, (t + 1) * chunk) of the vocabulary:
    # contiguous, so the walk in step 4 can skip whole chunks in vocabulary order.
    t, n = cuda.threadIdx.x, cuda.blockDim.x
    vocab = logits.shape[0]
    chunk = (vocab + n - 1) // n
    first, last = min(t * chunk, vocab), min((t + 1) * chunk, vocab)
    partial = cuda.shared.array(MAX_THREADS, float32)

    top = NEG_INF
    for i in range(first, last):
        top = max(top, logits[i])
    top = block_max(top)
    target = top_p * block_sum(kept_in(logits, first, last, top, inv_temperature, float32(0.0)))

    lo, hi = float32(0.0), float32(1.0)
    for _ in range(BISECT):  # every thread takes the same branch: block_sum returns one total
        mid = (lo + hi) * float32(0.5)
        if block_sum(kept_in(logits, first, last, top, inv_temperature, mid)) >= target:
            lo = mid
        else:
            hi = mid

    kept = kept_in(logits, first, last, top, inv_temperature, lo)
    partial[t] = kept
    mass = block_sum(kept)  # its barrier also publishes partial[]
    if t == 0:
        goal = uniform(seed, counter[0]) * mass
        running, pick = float32(0.0), -1
        for s in range(n):
            if running + partial[s] > goal:  # the goal falls in thread s's chunk: walk it
                for i in range(min(s * chunk, vocab), min((s + 1) * chunk, vocab)):
                    w = weight(logits, i, top, inv_temperature)
                    if w >= lo:
                        pick = i
                        running += w
                        if running > goal:
                            break
                break
            running += partial[s]
        if pick < 0:  # u * mass rounded up to the total: the last kept token
            for i in range(vocab - 1, -1, -1):
                if weight(logits, i, top, inv_temperature) >= lo:
                    pick = i
                    break
        out[0] = pick
# --8<-- [end:sample_top_p_kernel]


def sample_top_p(logits, inv_temperature, top_p, seed, counter, out):
    """Like sample_top_p_ref, on the device; NumPy arguments are moved (out written back)."""
    expect("logits", logits, np.float32, (None,))
    expect("counter", counter, np.int32, (1,))
    expect("out", out, np.int32, (1,))
    assert 0 < top_p <= 1 and inv_temperature > 0, f"top_p {top_p}, 1/T {inv_temperature}"
    with DeviceArgs() as dev:
        sample_top_p_kernel[1, THREADS, stream()](dev.read(logits), np.float32(inv_temperature),
                                                  np.float32(top_p), np.int64(seed), dev.read(counter),
                                                  dev.write(out))
