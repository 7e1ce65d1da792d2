"""numpy backend vs cuda backend on a GPU: greedy tokens and logits, every format, resident
and streamed, on a random-weight model with the default model's layer shapes.

    STRATA_NB_GPU=1 python tools/gpu_parity.py [n_tokens] [model.gguf]

With a GGUF path it runs that model (the default model, say) on 700 tokens of the bundled
document instead.

Prints one row per configuration: the first step's max |logit difference| and how many of
the greedy tokens agree before the first difference (with the top-2 margin there, so a
near tie can be told from a bug). Run on the device machine; CI does not run it.
"""
from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.engine import Engine
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.synthetic import write_synthetic_gguf
from strata_nb.settings import Settings


def greedy(eng, ids, n):
    """n greedy tokens the way the engine decodes them (the cuda backend's resident, dense
    steps replay a CUDA graph), and the top-2 margin of the logits each was picked from."""
    def margin(logits):
        top2 = np.sort(logits)[-2:]
        return float(top2[1] - top2[0])

    logits = eng.prefill(ids)
    first, out, margins = logits.copy(), [int(np.argmax(logits))], [margin(logits)]
    step = eng.device_step()
    for i in range(n - 1):
        if step is None:
            logits = eng.decode_one_token(out[-1], len(ids) + i)
            out.append(int(np.argmax(logits)))
        else:
            out.append(step.run(out[-1], len(ids) + i))
            logits = step.logits_on_host()
        margins.append(margin(logits))
    return first, out, margins


def main(n_tokens: int = 64, path: str | None = None):
    synthetic = path is None
    if synthetic:
        path = write_synthetic_gguf(tempfile.mkdtemp() + "/shapes.gguf", n_layers=30, d_model=576, d_ff=1536,
                                    n_heads=9, n_kv_heads=3, context=4096, seed=1)
        ids = [int(i) for i in np.random.default_rng(0).integers(3, 200, size=700)]
    model = GGUFModel(path)
    if not synthetic:
        from importlib import resources

        from strata_nb.text.tokenizer import Tokenizer
        text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
        ids = Tokenizer(model).encode(text)[:700]
    print(f"{'config':<22} {'max|dlogit|':>11} {'agree':>7} {'margin at split':>15} {'cuda tok/s':>10}")
    for fmt in ("fp16", "int8", "q4_0", "k8v4"):
        for resident in (0, 96 + 64):
            s = dict(model=str(path), kv=fmt, kv_resident=resident, kv_window=96, max_context=1024)
            ref = Engine(Settings(device="cpu", **s), model, NumpyBackend())
            gpu = Engine(Settings(device="cuda", **s), model, FastCudaBackend())
            a, ta, ma = greedy(ref, ids, n_tokens)
            t0 = time.perf_counter()
            b, tb, _ = greedy(gpu, ids, n_tokens)
            rate = n_tokens / (time.perf_counter() - t0)
            split = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), n_tokens)
            margin = f"{ma[split]:.4f}" if split < n_tokens else "-"
            name = f"{fmt} {'resident' if resident == 0 else 'streamed 160'}"
            print(f"{name:<22} {np.abs(a - b).max():>11.2e} {split:>4}/{n_tokens} {margin:>15} {rate:>10.1f}")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
