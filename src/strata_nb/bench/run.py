"""Time the engine: prefill and decode tok/s per (format, mode, depth), with what they read.

One configuration is a KV format, a mode (fully resident, or streamed at the minimum
resident size with QSA) and a depth (prompt tokens before decode). First an untimed
warm-up on a short prompt compiles the format's kernels. Then each run builds a fresh
cache, prefills the prompt (timed; where prompt chunks replay from graphs,
engine/prompt_chunk.py, the graphs are captured first, untimed), decodes WARMUP steps
untimed (the first captures the step's graph), then times `n_decode` steps. The reported
rate is the median of runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..engine.engine import spec_counts
from ..errors import StrataError
from ..kv.plan import StreamPlan
from ..kv_layout import BLOCK, token_bytes
from ..probes import DEGENERATE, loop_score, repetition_score
from ..settings import SamplingSettings
from .profile import STEPS, profile_decode

WARMUP = 2  # untimed decode steps per run: kernel compilation, graph capture
QSA_BUDGET = 1024  # the streamed mode's block-selection budget, in cells


# --8<-- [start:bench_config]
@dataclass(frozen=True)
class Config:
    fmt: str
    streamed: bool
    depth: int  # prompt tokens before the first decode step
    experts: tuple[int, int] | None = None  # MoE: (VRAM slots, experts in all); None = every expert resident
    spec: int = 0  # speculative decoding's verify window (--spec); 0 = one token a step
    kernels: str = "fast"  # --kernels: the cuda backend's tier

    @property
    def mode(self) -> str:
        mode = f"streamed (min resident, QSA {QSA_BUDGET})" if self.streamed else "resident"
        if self.experts is not None:
            slots, every = self.experts
            mode += f", experts {slots}/{every} cached"
        if self.spec:
            mode += f", spec {self.spec}"
        if self.kernels != "fast":
            mode += f", {self.kernels} kernels"
        return mode

    def settings(self, kv_window: int) -> dict:
        extra = dict(spec=self.spec, kernels=self.kernels) | (
            {} if self.experts is None else dict(expert_cache=self.experts[0]))
        if not self.streamed:
            return dict(kv=self.fmt, kv_resident=0, qsa_budget=0) | extra
        return dict(kv=self.fmt, kv_resident=StreamPlan.minimum_cells(kv_window), qsa_budget=QSA_BUDGET) | extra
# --8<-- [end:bench_config]


@dataclass
class Row:
    fmt: str
    mode: str
    depth: int
    prefill_tok_s: float
    decode_tok_s: float
    prefill_runs: list[float]
    decode_runs: list[float]
    graph: bool  # decode replayed from a CUDA graph
    kv_bytes: int  # the cache's K/V at this depth, all layers
    bytes_per_token: int  # weights + K/V a decode step reads
    gb_s: float  # bytes_per_token * decode tok/s
    hit_rate: float | None  # streamed: VRAM hits / block lookups
    tokens: list[int]  # the first greedy tokens (the prefill's pick first)
    experts: dict | None = None  # MoE: the expert cache over the timed steps (ExpertStats.as_dict, slots)
    spec: dict | None = None  # --spec rows: passes, drafts offered and accepted over the timed steps
    repetition: float = 0.0  # repetition_score of `tokens` (probes.py)
    loop: float = 0.0  # loop_score of `tokens`: above DEGENERATE, a degenerate run
    check: dict | None = None


def weight_bytes(weights) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms, the final
    norm and the output head (the embedding table itself: one row)."""
    def nbytes(a):
        return a.raw.nbytes if hasattr(a, "raw") else a.nbytes

    total = sum(nbytes(getattr(L, f)) for L in weights.layers
                for f in ("attn_norm", "wqkv", "wo", "ffn_norm", "wgate_up", "wdown", "router")
                if getattr(L, f) is not None)
    if weights.experts is not None:  # an MoE layer reads its K chosen experts
        total += len(weights.layers) * weights.experts.k * weights.experts.expert_bytes
    return total + nbytes(weights.output) + nbytes(weights.output_norm)


def kv_bytes_read(eng, depth: int) -> int:
    """K/V bytes one decode step at `depth` reads: every cell, or the QSA budget."""
    cells = depth if eng.settings.qsa_budget == 0 else min(depth, eng.settings.qsa_budget)
    return cells * token_bytes(eng.settings.kv, eng.config)


# --8<-- [start:bench_one]
GREEDY = SamplingSettings()


def decode(eng, step, tokens: list[int], pos: int, n: int, prompt: list[int], counts: dict) -> int:
    """Append n greedy tokens to `tokens`, the first decoded at `pos`; returns the next pos.
    The engine's own loops: on the device step each next step is queued while the host
    reads the last pick; with --spec, verify windows drafted from the prompt and tokens."""
    if eng.settings.spec:
        tokens.extend(eng.speculate(tokens[-1], pos, n, prompt + tokens[:-1], counts))
    else:
        tokens.extend(eng.tokens_after(tokens[-1], pos, n, GREEDY, None, step))
    return pos + n


def run_config(base, cfg: Config, prompt: list[int], runs: int, n_decode: int) -> tuple[Row, dict]:
    """The row, and layer 0 of the first run's cache right after its prefill (the check's
    byte test)."""
    changes = cfg.settings(base.settings.kv_window)
    warm = base.derive(**changes)  # compile this format's kernels, untimed
    short = prompt[: base.settings.prefill_chunk + 1]  # a full chunk (tiled matmul) and a short one
    decode(warm, warm.device_step(), [int(np.argmax(warm.prefill(short)))], len(short), WARMUP, short, spec_counts())
    prefill_rates, decode_rates, tokens, layer0, expert_runs, spec_runs = [], [], None, None, [], []
    for _ in range(runs):
        eng = base.derive(**changes)
        chunks = eng.prompt_chunks()
        if chunks is not None:  # graphs the prefill replays, captured untimed as the decode step's
            chunks.prepare(len(prompt))
        t0 = time.perf_counter()
        logits = eng.prefill(prompt)  # returns host logits: the prefill has finished
        prefill_rates.append(len(prompt) / (time.perf_counter() - t0))
        if layer0 is None:  # untimed, between the prefill and the decode steps
            layer0 = eng.kv.snapshot(len(prompt), [0])["layers"][0]
        step = None if cfg.spec else eng.device_step()
        run_tokens = [int(np.argmax(logits))]
        pos = decode(eng, step, run_tokens, len(prompt), WARMUP, prompt, spec_counts())
        experts = eng.weights.experts
        before = experts.stats() if experts is not None else None
        counts = spec_counts()
        t0 = time.perf_counter()
        decode(eng, step, run_tokens, pos, n_decode, prompt, counts)
        decode_rates.append(n_decode / (time.perf_counter() - t0))
        if experts is not None:
            expert_runs.append(experts.stats().since(before).as_dict() | {"slots": experts.n_slots})
        if cfg.spec:
            spec_runs.append(counts | dict(window=cfg.spec, acceptance_rate=counts["drafts_accepted"] / max(
                1, counts["drafts_offered"]), tokens_per_pass=n_decode / max(1, counts["passes"])))
        if tokens is None:
            tokens = run_tokens
        elif run_tokens != tokens:  # the same prompt must give the same tokens every run
            raise RuntimeError(f"{cfg}: run tokens differ from the first run's: nondeterministic decode")
    rate = statistics.median(decode_rates)
    replayed = eng.spec_passes()[0].get(cfg.spec) if cfg.spec else step  # what the timed tokens ran on
    per_token = weight_bytes(base.weights) + kv_bytes_read(eng, cfg.depth)
    mode = cfg.mode
    if cfg.kernels == "mega" and type(step).__name__ != "MegaStep":  # the fast tier's step ran: say why
        mode += f" ({eng.mega_note})"
    return Row(cfg.fmt, mode, cfg.depth, statistics.median(prefill_rates), rate, prefill_rates, decode_rates,
               bool(replayed is not None and replayed.use_graph), cfg.depth * token_bytes(cfg.fmt, base.config), per_token,
               per_token * rate / 1e9, eng.kv.counters.hit_rate if eng.kv.streamed else None, tokens,
               _median_run(expert_runs, decode_rates), _median_run(spec_runs, decode_rates),
               repetition_score(tokens), loop_score(tokens)), layer0


def _median_run(runs: list[dict], rates: list[float]) -> dict | None:
    """The figures (the expert cache's, speculation's) of the run whose decode rate is the median."""
    if not runs:
        return None
    return runs[sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]]
# --8<-- [end:bench_one]


def prompt_of(eng, text: str, depth: int) -> list[int]:
    """`depth` tokens of `text`, repeated as often as needed."""
    ids = eng.tokenize(text)
    return (ids * (depth // len(ids) + 1))[:depth]


def copy_bandwidth(be, n_bytes: int = 1 << 30, runs: int = 5) -> float | None:
    """GB/s of a device-to-device copy (bytes read + written): the ceiling a bandwidth-bound
    kernel can approach. None on the numpy backend."""
    if be.name != "cuda":
        return None
    from numba import cuda

    src = cuda.device_array(n_bytes // 4, np.float32)
    dst = cuda.device_array(n_bytes // 4, np.float32)
    rates = []
    for _ in range(runs + 1):
        cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_to_device(src)
        cuda.synchronize()
        rates.append(2 * n_bytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates[1:])


# --8<-- [start:bench]
def profile_depth(depth: int) -> int:
    """The prompt the profile decodes after: the last benched depth less room for the
    profiled steps (4 * STEPS positions), and at least one token (a bench at depth 1)."""
    return max(1, depth - 4 * STEPS)


def bench(base, text: str, formats: list[str], streamed_formats: list[str], depths: list[int], runs: int,
          n_decode: int, check_n: int, peer: bool, profile: bool, log, progress=None,
          expert_shares: list[float] | None = None, spec_windows: list[int] | None = None,
          llama_bench: str | None = None, kernels: tuple[str, ...] = ("fast",)) -> dict:
    """Every configuration, the output check, the peer and the profile, as one dict.
    expert_shares: an MoE model's resident rows again with this share of its experts in VRAM
    slots each (0.25, 0.5, 1.0), the rest read from host memory.
    spec_windows: the resident rows again with speculative decoding at each verify window;
    a spec row's tokens must be its --spec 0 row's (greedy identity), checked here.
    check_n: how many of each configuration's first greedy tokens the numpy backend checks.
    llama_bench: a llama-bench binary to run on the same file, depths and formats (llama.py).
    kernels: the tiers whose rows to time (--kernels): the fast tier's rows, and the plain
    tier's resident and streamed rows beside them (the same formats).
    progress(result): called with the dict so far after each row, the peer and the
    profile (rows not yet checked have no "check"), so a run cut short keeps its rows."""
    from dataclasses import asdict

    from . import check as checking
    from . import peer as peers

    progress = progress or (lambda result: None)

    ctx = base.settings.max_context
    if min(depths) + n_decode + WARMUP + 1 > ctx:
        raise StrataError(f"depth {min(depths)} + {n_decode} decode tokens do not fit --max-context {ctx}")
    minimum = StreamPlan.minimum_cells(base.settings.kv_window)
    if streamed_formats and base.kv.n_blocks * BLOCK <= minimum:
        raise StrataError(f"streamed rows need --max-context above the minimum resident size ({minimum} cells); "
                          "raise it or pass --streamed-formats ''")
    check_n = min(check_n, n_decode + WARMUP + 1)  # the tokens a run has
    chunks = base.prompt_chunks()
    result = {"rows": [], "peer": [], "runs": runs, "decode_tokens": n_decode,
              "copy_gb_s": copy_bandwidth(base.be),
              # resident rows' prompt chunks replayed from graphs (engine/prompt_chunk.py)
              "prompt_replayed": bool(chunks is not None and chunks.use_graph),
              # marked kernels launched while the one before runs (fast/dependent_launch.py)
              "dependent_launches": base.be.dependent_launches(),
              # prompt chunks' matmuls and attention: plain or on tensor cores (fast/tensor_core.py)
              "prompt_kernels": base.be.prompt_kernels(base.config.head_dim)}
    if result["dependent_launches"] not in ("off", "no GPU"):
        log(f"dependent launches: {result['dependent_launches']}")
    if result["prompt_kernels"] not in ("plain", "reference"):
        log(f"prompt kernels: {result['prompt_kernels']}")
    if result["copy_gb_s"]:
        log(f"device copy bandwidth: {result['copy_gb_s']:,.0f} GB/s (read + write)")
    pool = checking.check_pool(workers=3) if check_n else None
    checks, measured_depths = [], []
    for depth in depths:
        depth = min(depth, ctx - n_decode - WARMUP - 1)  # room for the decoded tokens
        measured_depths.append(depth)
        prompt = prompt_of(base, text, depth)
        configs = [Config(f, False, depth, kernels=k) for k in kernels for f in formats]
        configs += [Config(f, True, depth, kernels=k) for k in kernels for f in streamed_formats]
        if expert_shares and base.config.n_expert:
            every = base.config.n_layers * base.config.n_expert
            configs += [Config(f, False, depth, (round(share * every), every)) for f in formats for share in expert_shares]
        configs += [Config(f, False, depth, spec=t) for f in formats for t in spec_windows or []]
        one_token = {}  # fmt -> the --spec 0 row's tokens at this depth
        for cfg in configs:
            row, layer0 = run_config(base, cfg, prompt, runs, n_decode)
            if not cfg.spec and cfg.experts is None and not cfg.streamed and cfg.kernels == "fast":
                one_token[cfg.fmt] = row.tokens
            if cfg.spec and cfg.fmt in one_token:
                row.spec["identical"] = row.tokens == one_token[cfg.fmt]
            log(f"{cfg.fmt} {cfg.mode} at {depth}: prefill {row.prefill_tok_s:,.0f} tok/s, "
                f"decode {row.decode_tok_s:,.1f} tok/s"
                + (f", expert hit rate {row.experts['hit_rate']:.3f}" if row.experts else "")
                + (f", {row.spec['drafts_accepted']} of {row.spec['drafts_offered']} drafts accepted, "
                   f"{row.spec['tokens_per_pass']:.2f} tokens a pass"
                   + ("" if row.spec.get("identical", True) else ", NOT the --spec 0 tokens") if row.spec else "")
                + (f", DEGENERATE (loop score {row.loop:.2f})" if row.loop > DEGENERATE else ""))
            if pool:
                checks.append(pool.submit(checking.check_job, asdict(base.settings) | {"model": str(base.model.path)},
                                          cfg.settings(base.settings.kv_window),
                                          prompt, row.tokens[:check_n], layer0))
            result["rows"].append(row.__dict__)
            progress(result)
    if peer:
        result["peer"] = peers.peer_rows(base.config, measured_depths, runs, n_decode, log)
        progress(result)
    if llama_bench:
        from .llama import llama_rows

        result["llama"] = llama_rows(llama_bench, str(base.model.path), formats, measured_depths, runs, n_decode, log)
        progress(result)
    if profile and base.be.name == "cuda":  # one resident step and, with streamed rows, one streamed step
        depth = profile_depth(measured_depths[-1])
        def profiled_format(fmts):  # k8v4 where benched
            return "k8v4" if "k8v4" in fmts or not fmts else fmts[0]
        profiled = [("profile", Config(profiled_format(formats), False, depth))]
        if streamed_formats:
            profiled.append(("profile_streamed", Config(profiled_format(streamed_formats), True, depth)))
        try:
            for key, cfg in profiled:
                eng = base.derive(**cfg.settings(base.settings.kv_window))
                result[key] = profile_decode(eng, prompt_of(base, text, depth)) | {
                    "config": f"{cfg.fmt} {cfg.mode} at {depth}"}
        except ImportError:
            log("profile: torch is not importable; no per-kernel breakdown")
        progress(result)
    for row, future in zip(result["rows"], checks):
        row["check"] = future.result()
        log(f"check {row['fmt']} {row['mode']} at {row['depth']}: {row['check']}")
    if pool:
        pool.shutdown()
    return result
# --8<-- [end:bench]
