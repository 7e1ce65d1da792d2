"""llama.cpp in the same run: its `llama-bench` on the same GGUF, depths and KV types, so a
ratio against llama.cpp comes from one command.

`strata-nb bench --llama-bench PATH` runs the binary twice per KV format: prompt
processing of `depth` tokens (`-p depth -n 0`: our prefill of the same prompt) and
`n_decode` generated tokens after `depth` tokens of context (`-p 0 -n N -d depth`: our
decode at that depth). Every layer on the GPU (`-ngl 99`) and flash attention on
(`-fa 1`: llama.cpp needs it for a quantized V cache). Rates are the medians of its
samples, as ours are.

The KV formats map onto llama.cpp's cache types: fp16 is f16/f16, int8 q8_0/q8_0, q4_0
q4_0/q4_0, and k8v4 (INT8 K, rotated Q4_0 V) q8_0 K with q4_0 V, the same bytes a cell
without the rotation. A build without the decode kernel for a pair says so on stderr and
converts the cache to f16; that row is an error, not a rate.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from ..errors import StrataError

KV_TYPES = {"fp16": ("f16", "f16"), "int8": ("q8_0", "q8_0"), "q4_0": ("q4_0", "q4_0"), "k8v4": ("q8_0", "q4_0")}
# A CUDA build compiles FlashAttention's decode kernel only for the K-V type pairs in
# GGML_CUDA_FA_QUANTS (f16-f16, q8_0-q8_0, q4_0-q4_0 and bf16-bf16 by default): for any
# other pair it warns once and converts K and V to f16 every step.
FA_QUANTS = ",".join(dict.fromkeys(f"{k}-{v}" for k, v in KV_TYPES.values()))
FALLBACK = "no FlashAttention vector kernel compiled"


def check_binary(path: str) -> str:
    """The path of an executable file, or a clear error."""
    p = Path(path)
    if not p.is_file():
        raise StrataError(f"--llama-bench: {path} is not a file (build llama-bench: docs/gpu/running.md)")
    if not os.access(p, os.X_OK):
        raise StrataError(f"--llama-bench: {path} is not executable")
    return str(p.resolve())


def command(binary: str, model: str, fmt: str, runs: int, tests: list[str]) -> list[str]:
    k, v = KV_TYPES[fmt]
    return [binary, "-m", model, "-ngl", "99", "-fa", "1", "-r", str(runs), "-o", "json", "-ctk", k, "-ctv", v,
            *tests]


def _tests(binary: str, model: str, fmt: str, runs: int, tests: list[str]) -> list[dict]:
    """One llama-bench run: its JSON list of tests, or a StrataError that says why not."""
    cmd = command(binary, model, fmt, runs, tests)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise StrataError(f"llama-bench did not start: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise StrataError(f"llama-bench exited {done.returncode}: {last}")
    if FALLBACK in done.stderr:  # its rate would be the conversion's, not the format's
        k, v = KV_TYPES[fmt]
        raise StrataError(f"this llama.cpp build has no FlashAttention kernel for K {k} V {v} and converts them "
                          f"to f16 (slow); build it with -DGGML_CUDA_FA_QUANTS={FA_QUANTS} (docs/gpu/running.md)")
    try:
        out = json.loads(done.stdout)
        return [t for t in out if isinstance(t, dict) and "avg_ts" in t]
    except ValueError:
        raise StrataError(f"llama-bench printed what is not JSON: {done.stdout[:120]!r}") from None


def _rate(test: dict) -> tuple[float, list]:
    samples = test.get("samples_ts") or [test["avg_ts"]]
    return statistics.median(samples), samples


# --8<-- [start:llama_rows]
def llama_rows(binary: str, model: str, formats: list[str], depths: list[int], runs: int, n_decode: int,
               log) -> list[dict]:
    """A row per (format, depth): llama.cpp's prefill of `depth` tokens and its decode
    after them, or the error that stopped it."""
    rows = []
    for fmt in formats:
        k, v = KV_TYPES[fmt]
        name = f"llama.cpp K {k} V {v}"
        listed = ",".join(map(str, depths))
        try:
            prefill = _tests(binary, model, fmt, runs, ["-p", listed, "-n", "0"])
            decode = _tests(binary, model, fmt, runs, ["-p", "0", "-n", str(n_decode), "-d", listed])
        except StrataError as e:
            log(f"{name}: {e}")
            rows.append({"peer": name, "fmt": fmt, "error": str(e)})
            continue
        build = next((f"{t['build_commit']} ({t.get('build_number', '?')})" for t in prefill + decode
                      if "build_commit" in t), "unknown build")
        for depth in depths:
            pp = next((t for t in prefill if t.get("n_prompt") == depth and not t.get("n_gen")), None)
            tg = next((t for t in decode if t.get("n_depth") == depth and t.get("n_gen") == n_decode), None)
            if pp is None or tg is None:
                rows.append({"peer": name, "fmt": fmt, "depth": depth, "error": "llama-bench reported no such test"})
                continue
            (p, p_runs), (d, d_runs) = _rate(pp), _rate(tg)
            log(f"{name} at {depth}: prefill {p:,.0f} tok/s, decode {d:,.1f} tok/s")
            rows.append({"peer": name, "fmt": fmt, "depth": depth, "build": build, "prefill_tok_s": p,
                         "decode_tok_s": d, "prefill_runs": p_runs, "decode_runs": d_runs})
    return rows
# --8<-- [end:llama_rows]


def ratios(result: dict) -> list[dict]:
    """Ours over llama.cpp's, per format and depth, for the resident rows (greedy, no
    speculation, every expert as benched) that have a llama.cpp row."""
    ours = {(r["fmt"], r["depth"]): r for r in result["rows"]
            if r["mode"] == "resident" and not r.get("spec") and not r.get("experts")}
    out = []
    for l in result.get("llama", []):
        r = ours.get((l["fmt"], l.get("depth")))
        if r is None or "error" in l:
            continue
        out.append({"fmt": l["fmt"], "depth": l["depth"], "peer": l["peer"],
                    "prefill": r["prefill_tok_s"] / l["prefill_tok_s"], "decode": r["decode_tok_s"] / l["decode_tok_s"]})
    return out
