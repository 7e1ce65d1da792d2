"""Where a GPU prefill's time goes: tok/s, GPU time per kernel (CUPTI, needs torch) and
the host's Python time, on random weights of the default model's shapes (k8v4 cache).

    python tools/prefill_profile.py [chunk]     # on a GPU; chunk defaults to the backend's 2,048

Prints prefill tok/s for 1,024- and 4,096-token prompts (median of 3), then for the 1,024-token prompt
the GPU time of each kernel, and cProfile's top 25 host functions. Wall time far above
the GPU's sum means the host waits, or launches slower than the GPU runs.
"""
import cProfile
import pstats
import sys
import tempfile
import time

import numpy as np
from numba import cuda

from strata_nb.bench.profile import kernel_times
from strata_nb.engine.engine import Engine
from strata_nb.model.synthetic import write_default_shapes_gguf


def main(chunk: int | None = None):
    path = write_default_shapes_gguf(tempfile.mkdtemp() + "/shapes.gguf")
    base = Engine.load(model=str(path), kv="k8v4", device="cuda", max_context=8192, prefill_chunk=chunk)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 49152, 4096)]
    base.prefill(ids[:2 * base.settings.prefill_chunk])  # compile every kernel first
    cuda.synchronize()
    for n in (1024, 4096):
        rates = []
        for _ in range(3):
            eng = base.derive()
            cuda.synchronize()
            t = time.perf_counter()
            eng.prefill(ids[:n])
            cuda.synchronize()
            rates.append(n / (time.perf_counter() - t))
        print(f"prefill {n} tokens, chunk {base.settings.prefill_chunk}: {sorted(rates)[1]:,.0f} tok/s "
              f"(median of 3: {', '.join(f'{r:,.0f}' for r in rates)})")
    eng = base.derive()
    times = kernel_times(lambda: eng.prefill(ids[:1024]), 1)
    print(f"GPU time for 1,024 tokens: {sum(v[1] for v in times.values()):,.0f} us")
    for name, (launches, us) in sorted(times.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {name}: {launches:.0f} launches, {us:,.0f} us")
    eng = base.derive()
    prof = cProfile.Profile()
    prof.enable()
    eng.prefill(ids[:1024])
    cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
