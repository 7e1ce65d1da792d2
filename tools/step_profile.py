"""Where a decode step's time goes, per kernel (CUPTI, needs torch), resident and streamed,
on random weights of the default model's shapes: the bench's own profile
(`bench/profile.py: profile_decode`), for the configurations it does not profile.

    python tools/step_profile.py                   # on a GPU: every configuration below
    python tools/step_profile.py "k8v4 streamed 8000"

A configuration is "<format> <resident|streamed> <depth>"; streamed is the bench's
streamed mode (the minimum resident size, QSA budget 1,024). Each prints the step's
GPU time, its wall time replayed from a graph and launched one by one, and the table of
kernels the bench writes.
"""
import sys
import tempfile

import numpy as np

from strata_nb.bench.profile import profile_decode
from strata_nb.bench.report import profile_table
from strata_nb.bench.run import Config
from strata_nb.engine.engine import Engine
from strata_nb.model.synthetic import write_default_shapes_gguf

CONFIGS = ["fp16 resident 48", "k8v4 resident 1024", "k8v4 streamed 1024", "k8v4 resident 8000",
           "k8v4 streamed 8000"]


def main(configs: list[str]):
    path = write_default_shapes_gguf(tempfile.mkdtemp() + "/shapes.gguf")
    base = Engine.load(model=str(path), kv="k8v4", device="cuda", max_context=8192)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, base.config.vocab_size, 8192)]
    for text in configs:
        fmt, mode, depth = text.split()
        cfg = Config(fmt, mode == "streamed", int(depth))
        eng = base.derive(**cfg.settings(base.settings.kv_window))
        print(f"## {fmt} {cfg.mode} at {depth}\n\n{profile_table(profile_decode(eng, ids[:cfg.depth]))}\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or CONFIGS)
