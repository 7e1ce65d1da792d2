"""Produce the measured tables the docs include (docs/measured/*.md), by running the CLI.

    python tools/measure_docs.py compare      # compare-kv on the bundled document (~3 min on 2 cores)
    python tools/measure_docs.py stream       # streaming counters, ~6,000-token prompt (~10 min)
    python tools/measure_docs.py fault        # the missing-mirror lab's outputs (~2 min)
    python tools/measure_docs.py verify       # the verify-window lab: --fault verify-no-mirror (~8 min)
    python tools/measure_docs.py examples     # what the model-free examples print (seconds)
    python tools/measure_docs.py qsa-ranks    # where QSA's scores rank a planted fact's block (~3 min)
    python tools/measure_docs.py serve        # strata-nb probe against strata-nb serve, and the fault (~15 min)
    python tools/measure_docs.py mega-timeline  # on a GPU: where a decode step's time goes, fast tier and megakernel (~2 min)

Every page shows the command that produced its numbers; nothing here is typed by hand.
CI does not run this (it takes minutes); the docs build only includes its output.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "measured"
# Examples whose output needs no model and no clock: the pages show what they print, and
# tests/test_examples.py checks that the captured output is still what they print.
CAPTURED_EXAMPLES = ("quantize_one_cell", "stream_blocks", "ring_restore")
DOC = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "strata_nb.cli"] + args
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")
    return done


def machine() -> str:
    return f"{platform.machine()}, {platform.processor() or 'cpu'}, numpy backend"


def compare():
    from strata_nb.engine.compare import format_table

    parts = []
    for args in (["compare-kv", "--json"], ["compare-kv", "--kv", "k8v4,q4_0", "--qsa-budget", "0,1024", "--json"]):
        result = json.loads(run(args).stdout)
        parts.append(f"```text\n$ strata-nb {' '.join(a for a in args if a != '--json')}\n"
                     f"{format_table(result)}\n```\n")
    (OUT / "compare_kv.md").write_text(
        f"Measured with `python tools/measure_docs.py compare` ({machine()}).\n\n" + "\n".join(parts))


def long_prompt(tokens_wanted: int = 6000) -> str:
    reps = DOC + "\n\n" + DOC + "\n\n" + DOC  # ~8,400 tokens; cut by characters to ~6,000
    return reps[: int(len(reps) * tokens_wanted / 8440)] + "\n\nSummarize the text above in two sentences."


def stream():
    prompt = long_prompt()
    blocks = []
    for budget in ("0", "1024"):
        args = ["run", "--kv", "k8v4", "--kv-resident", "320", "--qsa-budget", budget, "--max-tokens", "200",
                "--stats", "--temperature", "0"]
        done = run(args, stdin=prompt)
        stats = [line for line in done.stderr.splitlines() if line.startswith(("prompt tokens", "KV streaming"))]
        blocks.append(f"```text\n$ strata-nb {' '.join(args)} < long_prompt.txt\n" + "\n".join(stats) + "\n```\n")
    (OUT / "stream_counters.md").write_text(
        f"Measured with `python tools/measure_docs.py stream` ({machine()}); the prompt is the bundled "
        f"document repeated, cut to about 6,000 tokens. Counters are per layer-step summed over the "
        f"30 layers; prompt chunks are staged, not looked up.\n\n" + "\n".join(blocks))


def fault():
    prompt = DOC[:6200] + "\n\nSummarize the text above in two sentences."
    rows = []
    for label, extra in (("fully resident", []), ("streamed, 320 cells", ["--kv-resident", "320"]),
                         ("streamed + --fault drop-v-mirror", ["--kv-resident", "320", "--fault", "drop-v-mirror"])):
        args = ["run", "--kv", "k8v4", "--max-tokens", "60"] + extra
        out = run(args, stdin=prompt).stdout.strip()
        rows.append(f"**{label}** (`strata-nb {' '.join(args)}`):\n\n```text\n{out}\n```\n")
    (OUT / "fault_lab.md").write_text(f"Measured with `python tools/measure_docs.py fault` ({machine()}).\n\n"
                                      + "\n".join(rows))


# The verify-window lab (docs/labs/verify-window.md): free generation, a needle, the mirror
VERIFY_PROMPTS = ("Write a long story about a lighthouse keeper and his daughter.",
                  "Explain how a steam engine works, step by step, in detail.",
                  "Describe a walk through a busy market town on a summer morning.")
VERIFY_TOKENS = 320
NEEDLE = "The keeper's secret word is marigold."
NEEDLE_QUESTION = "What is the keeper's secret word? Answer with the word only."


def verify_fault():
    from strata_nb import Engine
    from strata_nb.kv.plan import StreamPlan
    from strata_nb.probes import DEGENERATE, LOOP, loop_score, mirror_mismatches, repetition_score
    from strata_nb.settings import SamplingSettings

    window = 64
    settings = dict(device="cpu", kv="k8v4", kv_window=window, kv_resident=StreamPlan.minimum_cells(window), spec=5)
    flags = (f"--kv k8v4 --kv-resident {settings['kv_resident']} --kv-window {window} --spec 5 "
             f"--max-tokens {VERIFY_TOKENS}")
    engines = {f: Engine.load(fault=f, **settings) for f in ("none", "verify-no-mirror")}

    def generate(eng, prompt, max_tokens):
        ids, tokens = eng.prompt_ids(prompt), []
        text = "".join(eng.generate_ids(ids, SamplingSettings(max_tokens=max_tokens), on_token=tokens.append))
        stats = eng.last_stats
        return dict(text=text, tokens=tokens, finish=stats.finish_reason, spec=stats.extra["spec"],
                    mirror=mirror_mismatches(eng.kv, len(ids) + len(tokens) - 1))

    runs = {(p, f): generate(eng, p, VERIFY_TOKENS) for p in VERIFY_PROMPTS for f, eng in engines.items()}
    cut = len(DOC[:5000]) // 2
    needle_prompt = DOC[:cut] + " " + NEEDLE + " " + DOC[cut:5000] + "\n\n" + NEEDLE_QUESTION
    needles = {f: generate(eng, needle_prompt, 16) for f, eng in engines.items()}
    table = ["| prompt | fault | tokens | finish | first token unlike the fault-free reply | repeated 4-grams "
             f"| repeated within {LOOP} tokens (loop score) | degenerate | blocks whose VRAM and host copy differ "
             "| drafts accepted |", "| --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for (p, f), r in runs.items():
        clean = runs[p, "none"]["tokens"]
        differ = next((i for i, (a, b) in enumerate(zip(r["tokens"], clean)) if a != b), None)
        loop = loop_score(r["tokens"])
        table.append(f"| {p} | {f} | {len(r['tokens'])} | {r['finish']} | {'-' if differ is None else differ} | "
                     f"{repetition_score(r['tokens']):.2f} | {loop:.2f} | {'yes' if loop > DEGENERATE else 'no'} | "
                     f"{r['mirror']} | {r['spec']['drafts_accepted']} of {r['spec']['drafts_offered']} |")
    needle_rows = ["| fault | answer | found | blocks whose VRAM and host copy differ |", "| --- | --- | --- | ---: |"]
    for f, r in needles.items():
        answer = r["text"].strip().replace("\n", " ").replace("|", "/")
        needle_rows.append(f"| {f} | {answer} | {'yes' if 'marigold' in answer.lower() else 'no'} | {r['mirror']} |")
    texts = [f"**{p}**, {f}:\n\n```text\n{r['text'].strip()}\n```\n" for (p, f), r in runs.items()]
    (OUT / "verify_fault.md").write_text(
        f"Measured with `python tools/measure_docs.py verify` ({machine()}): greedy, the default model, "
        f"`strata-nb run {flags}` with and without `--fault verify-no-mirror`. Repeated 4-grams: the share "
        f"of the reply's 4-grams (of tokens) that occurred earlier in it (`strata_nb.probes.repetition_score`); the "
        f"loop score counts only those seen within the last {LOOP} tokens (`loop_score`), and above {DEGENERATE} "
        f"counts as degenerate.\n\n" + "\n".join(table)
        + f"\n\nThe needle: \"{NEEDLE}\" in the middle of the first 5,000 characters of the bundled document "
        f"({len(engines['none'].prompt_ids(needle_prompt))} tokens with the question), then \"{NEEDLE_QUESTION}\", "
        f"16 tokens.\n\n" + "\n".join(needle_rows) + "\n\nThe replies:\n\n" + "\n".join(texts))


# Why QSA scores from a key sketch (docs/walkthrough/select.md): for the heads that attend to a
# planted fact, where each score ranks the fact's block among the blocks selection ranks
RANK_CASES = ((4096, 0.25, 1), (4096, 0.5, 2), (4096, 0.75, 3))  # (prompt tokens, depth, seed)
RANK_HEAD_MASS = 0.1  # a head counts when this share of its attention is on the fact's blocks


def qsa_ranks():
    import numpy as np

    from strata_nb import Engine
    from strata_nb.kernels.kv.quant_q4_0 import dequantize_q4_0_ref
    from strata_nb.kv import cache as kv_cache
    from strata_nb.kv_layout import BLOCK
    from strata_nb.needle import build_case
    from strata_nb.settings import SamplingSettings

    budget = 1024
    eng = Engine.load(device="cpu", kv="fp16", qsa_budget=budget)
    window = eng.kv.window_blocks
    free = budget // BLOCK - 1 - window  # the blocks a query's budget leaves after block 0 and the window
    heads, tokens = [], []  # per (step, layer, head): ranks; per (step, layer): the token-level ranks
    select = kv_cache.KVCache.select

    def ranks(scores, fact, cand):  # (heads, blocks) -> each head's rank of block `fact` among `cand`
        return (scores[:, cand] > scores[:, [fact]]).sum(axis=1)

    def hook(self, L, q, positions):
        pos = int(positions[0])
        nb, last = pos // BLOCK + 1, pos // BLOCK
        cand = np.arange(1, max(1, last - window + 1))  # what selection ranks: not block 0, not the window
        fact_blocks = [b for b in case_blocks if b in cand]
        if fact_blocks:
            G = q.shape[1] // L.sketch.shape[1]
            K = L.pool["k"][:nb].astype(np.float32).repeat(G, axis=1)  # (blocks, heads, cells, hd)
            live = (np.arange(nb * BLOCK) <= pos).reshape(nb, BLOCK)
            dots = np.where(live[:, None], np.einsum("hd,bhcd->bhc", q[0], K), -np.inf)  # (blocks, heads, cells)
            p = np.exp(dots / 8 - (dots / 8).max(axis=(0, 2), keepdims=True))
            mass = (p / p.sum(axis=(0, 2), keepdims=True)).sum(axis=2).T  # (heads, blocks)
            exact = dots.max(axis=2).T
            sketch = np.einsum("hd,bhcd->bhc", q[0], dequantize_q4_0_ref(L.sketch[:nb]).repeat(G, axis=1)).max(axis=2).T
            kmin, kmax = np.where(live[:, None, :, None], K, np.inf).min(2), np.where(live[:, None, :, None], K, -np.inf).max(2)
            bound = np.maximum(q[0] * kmin, q[0] * kmax).sum(-1).T  # Quest's: (heads, blocks)
            on_fact = mass[:, fact_blocks].sum(axis=1)
            for h in np.flatnonzero(on_fact >= RANK_HEAD_MASS):
                f = fact_blocks[int(np.argmax(mass[h, fact_blocks]))]
                heads.append([int(ranks(s, f, cand)[h]) for s in (exact, sketch, bound)]
                             + [int(ranks(s.max(0, keepdims=True), f, cand)[0]) for s in (sketch, bound)])
        return select(self, L, q, positions)

    kv_cache.KVCache.select = hook
    try:
        for length, depth, seed in RANK_CASES:
            ids, fact = build_case(eng, length, depth, seed)
            words = eng.tokenize(" " + fact.text)[1:-1]
            start = next(i for i in range(len(ids)) if ids[i:i + len(words)] == words)
            case_blocks = list(range(start // BLOCK, (start + len(words) - 1) // BLOCK + 1))
            list(eng.generate_ids(ids, SamplingSettings(max_tokens=12)))
    finally:
        kv_cache.KVCache.select = select
    r = np.array(heads)
    names = ("exact keys, the head alone", "key sketch (q4_0), the head alone", "Quest's bound, the head alone",
             "**key sketch, max over heads (what selection ranks)**", "Quest's bound, max over heads (what it ranked)")
    rows = [f"| {n} | {np.median(r[:, i]):.0f} | {r[:, i].max()} | {(r[:, i] < free).mean():.1%} |"
            for i, n in enumerate(names)]
    (OUT / "qsa_ranks.md").write_text(
        f"Measured with `python tools/measure_docs.py qsa-ranks` ({machine()}): the default model, fp16, "
        f"{len(RANK_CASES)} prompts of about {RANK_CASES[0][0]:,} tokens with a planted fact at depths "
        f"{', '.join(str(d) for _, d, _ in RANK_CASES)} (`strata_nb.needle.build_case`), 12 greedy tokens each. "
        f"For every decode step, layer and head that puts at least {RANK_HEAD_MASS:.0%} of its attention on the "
        f"fact's blocks ({len(r)} of them), the rank of the fact's most-attended block among the "
        f"blocks selection ranks (about {RANK_CASES[0][0] // BLOCK - window - 1}; 0 = first). At `--qsa-budget {budget}` a query takes block 0, the {window} window blocks and the best "
        f"{free} others.\n\n| score | median rank | worst rank | ranked in the best {free} |\n"
        f"| --- | ---: | ---: | ---: |\n" + "\n".join(rows) + "\n")


SERVE_PROBE = ["--ttft", "3400", "--rate", "256"]  # a first turn of ~4,100 tokens: the goal's 4K conversation


def serve():
    """`strata-nb probe` against `strata-nb serve` on the CPU, then against the same server
    with --conversation-fault skip-restore; the probe runs in a process of its own."""
    from strata_nb import Engine
    from strata_nb.serve.app import Running, create_app

    base = Engine.load(device="cpu")
    parts = []
    for fault, probe_args in (("none", SERVE_PROBE), ("skip-restore", [])):
        server = Running(create_app(base.derive(quiet=True), "SmolLM2-135M-Instruct.Q4_1", 1024, fault))
        try:
            cmd = [sys.executable, "-m", "strata_nb.cli", "probe", "--url", server.url, *probe_args]
            done = subprocess.run(cmd, capture_output=True, text=True)
        finally:
            server.stop()
        if done.returncode not in (0, 1):
            sys.exit(f"the probe failed:\n{done.stderr}")
        flag = "" if fault == "none" else f" --conversation-fault {fault}"
        parts.append(f"```text\n$ strata-nb serve --device cpu{flag} &\n$ strata-nb probe --url {server.url} "
                     f"{' '.join(probe_args)}\n{done.stdout.rstrip()}\n```\n")
    (OUT / "serve").mkdir(exist_ok=True)
    (OUT / "serve" / "probe.md").write_text(
        f"Measured with `python tools/measure_docs.py serve` ({machine()}; the server on a thread of that "
        "process, the probe in a process of its own).\n\n" + "\n".join(parts))


def examples():
    for name in CAPTURED_EXAMPLES:
        done = subprocess.run([sys.executable, f"examples/{name}.py"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"examples/{name}.py failed:\n{done.stderr}")
        (OUT / f"example_{name}.md").write_text(
            f"Printed by `python examples/{name}.py` (captured with `python tools/measure_docs.py examples`):\n\n"
            f"```text\n{done.stdout.rstrip()}\n```\n")


MEGA_DEPTHS = (1, 8000)  # the timeline's


def barrier_us(n: int, repeats: int = 20) -> float:
    """One grid barrier's cost: a launch of n barriers over the megakernel's grid, less an empty one."""
    import numpy as np
    from numba import cuda

    from strata_nb.fast.mega.interpreter import grid_barrier
    from strata_nb.gpu.geometry import MEGA_THREADS, multiprocessors

    @cuda.jit
    def barriers_only(sync, n):
        for _ in range(n):
            grid_barrier(sync)

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
    """The megakernel's step: a clocked step's items by kind, and its run-ahead wall time."""
    from collections import defaultdict

    import numpy as np
    from numba import cuda

    from strata_nb.bench.profile import STEPS, ahead_wall_us
    from strata_nb.fast.mega.plan import OPS
    from strata_nb.fast.mega.step import MegaModel, MegaStep

    eng = base.derive(kv=kv, kernels="mega", quiet=True)
    logits = eng.prefill(prompt)
    model = MegaModel(eng.be, eng.weights)  # one device copy of the stacked weights for both steps
    step = MegaStep(eng.be, eng.weights, eng.kv, True, model, clocked=True)
    token, pos = int(np.argmax(logits)), len(prompt)
    by_op = defaultdict(float)
    for _ in range(3):  # the first compiles; the last is kept
        token = step.run(token, pos)
        pos += 1
    for (op, _), ns in zip(step.plan, step.item_ns()):
        by_op[OPS[op]] += ns / 1e3
    plain = MegaStep(eng.be, eng.weights, eng.kv, True, model)
    plain.run(token, pos)
    plain.seek(token, pos)
    return dict(items_us=dict(by_op), clocked_us=sum(by_op.values()), barriers=len(step.plan) - 1,
                ahead_wall_us=ahead_wall_us(plain, STEPS, cuda.synchronize))


def mega_timeline(path: str = ""):
    """Where a decode step's time goes on a GPU, fast tier against megakernel: mega/timeline.json
    (tools/docs_tables.py makes the page's table and figure of it). path: a model file
    (`mega-timeline=PATH`; the default model without one)."""
    from numba import cuda

    from strata_nb import Engine
    from strata_nb.bench.profile import profile_decode
    from strata_nb.bench.run import prompt_of
    from strata_nb.gpu.geometry import MEGA_THREADS, multiprocessors

    from strata_nb.model.fetch import default_model_path

    given, path = bool(path), path or str(default_model_path())
    base = Engine.load(model=path, device="cuda", kernels="fast", max_context=8192)
    rows = []
    for depth in MEGA_DEPTHS:
        prompt = prompt_of(base, DOC, depth)
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
                  command="python tools/measure_docs.py mega-timeline" + (f"={Path(path).name}" if given else ""))
    print("barrier_us", result["barrier_us"])
    (OUT / "mega").mkdir(exist_ok=True)
    (OUT / "mega" / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for what in sys.argv[1:] or ["compare", "stream", "fault", "verify", "examples"]:
        what, _, arg = what.partition("=")
        {"compare": compare, "stream": stream, "fault": fault, "verify": verify_fault, "examples": examples,
         "qsa-ranks": qsa_ranks, "serve": serve, "mega-timeline": mega_timeline}[what](*[arg] if arg else [])
