"""Where a decode step's time goes, on a GPU: the fast tier's graph-replayed step against the
megakernel's (docs/gpu/megakernel.md's timeline). Writes a JSON file that
tools/docs_tables.py turns into the page's table and figure.

    python tools/mega_timeline.py MODEL.gguf docs/measured/mega/timeline.json

For each depth and KV format:
- fast: each kernel's GPU time in a graph-replayed step (CUPTI, bench/profile.py), their
  sum, and the step's wall time run ahead (what `generate` and the bench see); the wall
  less the kernels' time is the gaps between them;
- mega: a clocked step's time on each item of the plan as thread block 0 saw it (the item
  and the barrier after it, so the wait for the slowest block too), summed by kind of item,
  and the unclocked step's wall time run ahead.
And the barriers alone: a launch of the megakernel's grid doing nothing but as many
`grid_barrier`s as the plan has, timed by the host.
"""
import json
import sys
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

import numpy as np
from numba import cuda

from strata_nb import Engine
from strata_nb.bench.profile import STEPS, ahead_wall_us, profile_decode
from strata_nb.bench.run import prompt_of
from strata_nb.fast.mega.interpreter import grid_barrier
from strata_nb.fast.mega.plan import OPS
from strata_nb.fast.mega.step import MegaModel, MegaStep
from strata_nb.gpu.geometry import MEGA_THREADS, multiprocessors

DEPTHS = (1, 8000)


@cuda.jit
def barriers_only(sync, n):
    for _ in range(n):
        grid_barrier(sync)


def barrier_us(n: int, repeats: int = 20) -> float:
    """One grid barrier's cost: a launch of n barriers over the megakernel's grid, less an empty one."""
    sync = cuda.to_device(np.zeros(2, np.int32))

    def launch_us(k):
        barriers_only[multiprocessors(), MEGA_THREADS](sync, k)
        cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            barriers_only[multiprocessors(), MEGA_THREADS](sync, k)
        cuda.synchronize()
        return (time.perf_counter() - t) / repeats * 1e6

    return (launch_us(n) - launch_us(0)) / n


def mega_row(base, kv: str, prompt: list[int]) -> dict:
    eng = base.derive(kv=kv, kernels="mega", quiet=True)
    logits = eng.prefill(prompt)
    step = MegaStep(eng.be, eng.weights, eng.kv, True, MegaModel(eng.be, eng.weights), clocked=True)
    token, pos = int(np.argmax(logits)), len(prompt)
    by_op = defaultdict(float)
    for _ in range(3):  # the first compiles; the last is kept
        token = step.run(token, pos)
        pos += 1
    for (op, _), ns in zip(step.plan, step.item_ns()):
        by_op[OPS[op]] += ns / 1e3
    plain = MegaStep(eng.be, eng.weights, eng.kv, True, MegaModel(eng.be, eng.weights))
    plain.run(token, pos)
    plain.seek(token, pos)
    return dict(items_us=dict(by_op), clocked_us=sum(by_op.values()), barriers=len(step.plan) - 1,
                ahead_wall_us=ahead_wall_us(plain, STEPS, cuda.synchronize))


def main(path: str, out: str) -> None:
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    base = Engine.load(model=path, device="cuda", kernels="fast", max_context=8192 + 512)
    rows = []
    for depth in DEPTHS:
        prompt = prompt_of(base, text, depth)
        for kv in ("fp16", "k8v4"):
            prof = profile_decode(base.derive(kv=kv, quiet=True), prompt)
            fast = dict(kernels_us={name: us for name, (_, us) in prof["kernels"].items()}, gpu_us=prof["gpu_us"],
                        ahead_wall_us=prof["ahead_wall_us"], launches=prof["launches"])
            rows.append(dict(depth=len(prompt), kv=kv, fast=fast, mega=mega_row(base, kv, prompt)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "fast"}))
    n = rows[0]["mega"]["barriers"]
    name = cuda.get_current_device().name
    result = dict(device=name.decode() if isinstance(name, bytes) else name, model=Path(path).name,
                  blocks=multiprocessors(), threads=MEGA_THREADS, barrier_us=barrier_us(n), rows=rows,
                  command="python tools/mega_timeline.py " + " ".join(sys.argv[1:]))
    print("barrier_us", result["barrier_us"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
