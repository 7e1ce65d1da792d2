"""The Python API: `Engine.load(...)`, `tokenize`, `score`, `generate`.

Decode is a handful of verbs, in the manner of gpt-fast: `prefill` the prompt in chunks,
then `decode_one_token` and `sample` until a stop token or the token budget.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..backend import FAST_TIERS, get_backend
from ..errors import SettingError, StrataError
from ..gpu.geometry import SIMULATED
from ..kernel_cache import CompileProgress, package_kernels
from ..kernels.dense.matvec import MAX_ROWS
from ..kernels.step.select_rows import budget_note
from ..kernels.step.verify import verify, verify_ref
from ..kv.cache import KVCache
from ..kv_layout import BLOCK
from ..model.fetch import model_path
from ..model.gguf_file import GGUFModel
from ..model.weights import load_weights
from ..settings import SamplingSettings, Settings
from ..text.tokenizer import StreamDecoder, Tokenizer
from .decode_step import DeviceStep
from .draft import MIN_NGRAM, Drafter, WindowWidth
from .forward import forward
from .prompt_chunk import PromptChunks
from .prompt_chunk import enabled as device_prompt_enabled
from .sampling import sample
from .verify_window import VerifyWindow


FAST_ARCHS = ("llama",)  # the families the fast tier's kernels are built for; others run plain
REPETITION_STOP = 256  # a reply that repeats one token this many times in a row is stopped (as Strata's)
# Decode steps a run's stats time apart from the rest: on a GPU the first runs its kernels
# one by one and the second captures the CUDA graph the others replay.
WARM_STEPS = 2


def spec_counts() -> dict:
    """What `Engine.speculate` counts as it goes: verify passes, drafts offered, accepted."""
    return dict(passes=0, drafts_offered=0, drafts_accepted=0)


# --8<-- [start:run_stats]
@dataclass
class RunStats:
    """Where a run's time went, phase by phase. The decode rate is the steady one: the
    first WARM_STEPS steps (with --spec, passes) are counted as warm-up (when the run has
    more), as is making the kernels on their first use in the process (`Engine.warm_up`):
    compiling them, or loading them from the on-disk cache where an earlier run compiled
    them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cells were already in the cache (a conversation cache hit)
    generated_tokens: int = 0
    load_seconds: float = 0.0  # opening the model and building the engine (Engine.load)
    warmup_seconds: float = 0.0  # making kernels on first use, and the first WARM_STEPS decode steps
    kernels_compiled: int = 0  # kernels (one per signature) this run compiled: none were on disk
    kernels_loaded: int = 0  # kernels this run loaded from the on-disk cache (kernel_cache.py)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # the steady decode steps
    decode_steps: int = 0  # how many steps decode_seconds times
    finish_reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        ran = self.prompt_tokens - self.cached_tokens
        return ran / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0
# --8<-- [end:run_stats]


class Engine:
    def __init__(self, settings: Settings, model: GGUFModel, be, shared: "Engine | None" = None,
                 quiet: bool = False):
        self.settings, self.model, self.be = settings, model, be
        self.config = model.config
        if settings.max_context is None:
            settings.max_context = self.config.context_length
        if settings.prefill_chunk is None:
            settings.prefill_chunk = be.prefill_chunk
        if settings.max_context > self.config.context_length:
            raise SettingError("max_context", f"{settings.max_context} exceeds the model's trained context "
                                              f"of {self.config.context_length}")
        if be.name == "cuda" and be.kernels != settings.kernels:
            raise StrataError(f"the settings ask for --kernels {settings.kernels}, and the backend runs {be.kernels} kernels")
        be.check_model(self.config, qsa=settings.qsa_budget > 0, max_context=settings.max_context)
        if shared is not None:
            self.tokenizer, self.weights = shared.tokenizer, shared.weights
        else:
            self.tokenizer = Tokenizer(model)
            self.weights = load_weights(be, model)
        self.kv = KVCache(be, self.config, settings, rows_alone=be.kernels in FAST_TIERS and device_prompt_enabled())
        self.load_seconds = 0.0  # set by Engine.load
        if self.kv.streamed and not quiet:
            print(self.kv.describe(), file=sys.stderr)
        note = budget_note(settings.qsa_budget, settings.kv_window // BLOCK) if settings.qsa_budget else None
        if note and not quiet:
            print(f"strata-nb: {note}", file=sys.stderr)
        if self.config.n_expert:
            self._expert_cache(shared)
        elif settings.fault == "expert-early-resident":
            raise SettingError("fault", "'expert-early-resident' breaks the expert cache: it needs an MoE model")
        elif settings.expert_cache != "auto":
            raise SettingError("expert_cache", f"{settings.expert_cache} caches an MoE model's experts; this model is "
                                               "dense")
        self.last_stats = RunStats()
        self._spec_passes = None  # ({width: VerifyWindow}, DeviceStep) once speculation first runs on the GPU
        self._prompt_chunks = None  # PromptChunks once a prefill first runs on the GPU path
        self._reply_steps: dict = {}  # sampling kind -> the DeviceStep replies reuse (reply_step)
        self._mega_model = None  # --kernels mega: the weights stacked by layer, once a MegaStep needs them
        self.mega_note = None  # --kernels mega: how the last device step ran, and why when not as one launch

    def _expert_cache(self, shared: "Engine | None"):
        """An MoE model's expert cache, sized once the KV cache has taken its memory; a derived
        engine with the same expert settings shares its parent's."""
        from dataclasses import replace

        from ..experts.cache import ExpertCache, expert_slots_for

        s = self.settings
        keys = ("expert_cache", "adapt_every", "adapt_swaps", "vram_reserve_mib", "fault")
        if shared is not None and all(getattr(s, k) == getattr(shared.settings, k) for k in keys):
            return
        n = expert_slots_for(s.expert_cache, self.be, self.model, s.vram_reserve_mib)
        every = self.config.n_layers * self.config.n_expert
        if s.fault == "expert-early-resident" and n in (0, every):
            raise SettingError("fault", f"'expert-early-resident' breaks moving experts into slots: it needs "
                                        f"--expert-cache between 1 and {every - 1} (it is {n})")
        cache = ExpertCache(self.be, self.model, n, s.adapt_every, s.adapt_swaps, s.fault)
        self.weights = replace(self.weights, experts=cache)
        if n < every:
            print(cache.describe(), file=sys.stderr)

    @classmethod
    def load(cls, model: str | None = None, kv: str = "fp16", kv_resident: int = 0, device: str = "auto",
             max_context: int | None = None, **more) -> "Engine":
        """Open a GGUF (None = the default model, fetched on first use; a name such as
        gemma3-270m, once fetched) and build the engine."""
        settings = Settings(model=model, kv=kv, kv_resident=kv_resident, device=device,
                            max_context=max_context, **more)
        path = model_path(settings.model)
        t0 = time.perf_counter()
        model = GGUFModel(path)
        plain_only = model.config.arch not in FAST_ARCHS and settings.kernels in FAST_TIERS
        if plain_only:
            settings.kernels = "plain"
        be = get_backend(settings.device, settings.kernels)
        if plain_only and be.name == "cuda":
            print(f"strata-nb: the fast tier runs {', '.join(FAST_ARCHS)} models; this {model.config.arch} model runs "
                  "on the plain tier", file=sys.stderr)
        eng = cls(settings, model, be)
        eng.load_seconds = time.perf_counter() - t0
        return eng

    def derive(self, quiet: bool = False, **changes) -> "Engine":
        """A new engine with other KV settings (kv, kv_resident, qsa_budget, ...) or kernels
        that shares this one's model and weights (and backend, for the same kernels):
        comparisons without loading twice. quiet:
        it does not describe its caches on stderr."""
        from dataclasses import asdict

        settings = Settings(**(asdict(self.settings) | changes))
        if settings.device != self.settings.device or settings.model != self.settings.model:
            raise StrataError("derive() keeps the model and device; load a new Engine to change them")
        be = self.be
        if settings.kernels != self.settings.kernels and be.name == "cuda":  # the other tier: the same weights
            be = get_backend(settings.device, settings.kernels)
        return Engine(settings, self.model, be, shared=self, quiet=quiet)

    # --8<-- [start:warm_up]
    _warm: set = set()  # the settings whose kernels this process has made

    def warm_up(self, ids: list[int]) -> tuple[int, int]:
        """Make this engine's kernels before a run times anything, the first time these
        settings run in the process on a GPU: Numba makes each kernel on its first launch,
        loading it from the on-disk cache (kernel_cache.py) or, the first time on this
        machine, compiling it, so afterwards the run's prefill and decode are the kernels'
        time, not the compiler's. (Under the simulator nothing compiles.) Returns
        (kernels compiled, kernels loaded from the cache)."""
        key = repr(self.settings)
        if self.be.name != "cuda" or SIMULATED or key in Engine._warm:
            return 0, 0
        with CompileProgress(package_kernels()) as made:  # a bar on stderr once one compiles
            self.run_scratch(ids)
        Engine._warm.add(key)
        if made.compiled:
            print(f"compiled {made.compiled} kernels; later runs load them from {os.environ['NUMBA_CACHE_DIR']}",
                  file=sys.stderr, flush=True)
        return made.compiled, made.loaded

    def run_scratch(self, ids: list[int]):
        """Launch every kernel a run of these settings launches, on a scratch engine (the
        same weights, a small cache of its own, so this one's cache is not touched): a
        prompt chunk of a few of the prompt's tokens, then one decode step (or a few verify
        windows), launched one by one. A captured graph replays the launches an eager step
        makes, so the scratch engine captures none: its graph would be thrown away, and the
        run captures its own in its first WARM_STEPS steps, which it counts as warm-up."""
        s = self.settings
        warm = ids[: MAX_ROWS + 2]  # a chunk of more rows than a step or window has: the prompt kernels
        room = len(warm) + 2 * s.spec + WARM_STEPS + 2
        context = -(-max(room, s.kv_resident + 2 * BLOCK) // BLOCK) * BLOCK  # streamed stays streamed
        scratch = self.derive(quiet=True, max_context=min(s.max_context, context), graph=False)
        token = int(np.argmax(scratch.prefill(warm)))
        if s.spec:
            list(scratch.speculate(token, len(warm), WARM_STEPS + 1, warm, spec_counts()))
        else:
            list(scratch.tokens_after(token, len(warm), 1, SamplingSettings(), None, scratch.device_step()))
        self.be.synchronize()
    # --8<-- [end:warm_up]

    # ---- text ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text becomes its id; no BOS is added)."""
        return self.tokenizer.encode(text)

    # --8<-- [start:prompt_ids]
    def prompt_ids(self, prompt: str, chat: bool = True) -> list[int]:
        """A prompt's ids: in the model's chat template (chat), or as it is; BOS first where
        the model asks for one (Gemma)."""
        if not prompt.strip():
            raise StrataError("the prompt is empty")
        text = self.tokenizer.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
        ids = self.with_bos(self.tokenize(text))
        if len(ids) >= self.settings.max_context:
            raise SettingError("max_context", f"{self.settings.max_context} does not fit the prompt's {len(ids)} "
                                              "tokens (leave room for at least one new token)")
        return ids

    def with_bos(self, ids: list[int]) -> list[int]:
        """ids with the model's BOS in front, where its file asks for one and they lack it
        (a chat template may write it already)."""
        t = self.tokenizer
        return [t.bos_id] + ids if t.add_bos and t.bos_id is not None and ids[:1] != [t.bos_id] else ids
    # --8<-- [end:prompt_ids]

    # ---- the verbs ----------------------------------------------------------------------
    # --8<-- [start:verbs]
    def prefill(self, ids: list[int], all_logits: bool = False, on_chunk=None, start: int = 0):
        """Run the prompt through the model in chunks; logits of the last (or every) position
        from `start`. on_chunk(n) hears of each chunk's n tokens as it finishes (a progress
        bar). start > 0: the cells before it already hold ids[:start] (the conversation
        cache restored them), so only the rest runs."""
        if not 0 <= start < len(ids):
            raise StrataError(f"prefill needs at least one token after the {start} cached")
        outs = []
        for at, logits in self._in_chunks(ids, start, len(ids), self.settings.prefill_chunk, True, all_logits):
            outs.append(logits)
            if on_chunk:
                on_chunk(min(self.settings.prefill_chunk, len(ids) - at))
        return np.concatenate(outs) if all_logits else outs[-1][-1]

    def prompt_chunks(self) -> PromptChunks | None:
        """The replayable prompt chunks (prompt_chunk.py), where the backend and cache allow
        them: made once per engine, so each width's graph is captured once."""
        if not PromptChunks.supported(self.be, self.kv):
            return None
        if self._prompt_chunks is None:
            self._prompt_chunks = PromptChunks(self.be, self.weights, self.kv, self.settings.prefill_chunk,
                                               self.settings.graph)
        return self._prompt_chunks

    def decode_one_token(self, token: int, pos: int) -> np.ndarray:
        """One step: the token at `pos` goes through every layer -> logits (vocab,)."""
        return self._forward([token], pos, prompt=False, all_logits=False)[-1]

    def device_step(self, s: SamplingSettings | None = None, rng=None) -> DeviceStep | None:
        """The replayable decode step (decode_step.py), where the backend and cache allow one.
        Its draws use s.seed, or one seed taken from `rng`."""
        if not DeviceStep.supported(self.be, self.kv):
            return None
        return self._mega_step(s) or DeviceStep(self.be, self.weights, self.kv, self.settings.graph, s,
                                                self._step_seed(s, rng))

    def _mega_step(self, s: SamplingSettings | None):
        """--kernels mega: the step as one launch of the megakernel (fast/mega/) where it can
        run it, else None (the fast tier's step runs, and `mega_note` says why)."""
        if self.be.kernels != "mega":
            return None
        from ..fast.mega.step import MegaModel, MegaStep

        why = MegaStep.why_not(self.be, self.kv, self.weights, greedy=s is None or s.temperature == 0)
        self.mega_note = "one megakernel launch a step" if why is None else f"the fast tier's (the megakernel: {why})"
        if why is not None:
            return None
        if self._mega_model is None:
            self._mega_model = MegaModel(self.be, self.weights)
        return MegaStep(self.be, self.weights, self.kv, self.settings.graph, self._mega_model)

    @staticmethod
    def _step_seed(s: SamplingSettings | None, rng) -> int:
        return 0 if s is None else s.seed if s.seed is not None else int(rng.integers(2**31))

    def reply_step(self, s: SamplingSettings, rng) -> DeviceStep | None:
        """device_step(s, rng), kept from one reply to the next for the same kind of pick:
        greedy, drawn on the host (top-k), or drawn on the device with the same temperature,
        top-p and seed. Its graph, captured on a reply's second step, then serves the later
        replies (a server's), where a new step would launch its first step kernel by kernel
        and capture again. The last device-drawn kind is kept beside the other two."""
        if not DeviceStep.supported(self.be, self.kv):
            return None
        seed = self._step_seed(s, rng)
        key = "greedy" if s.temperature == 0 else "host" if s.top_k else (s.temperature, s.top_p, seed)
        step = self._reply_steps.get(key)
        if step is None:
            if isinstance(key, tuple):  # one device-drawn kind at a time
                self._reply_steps = {k: v for k, v in self._reply_steps.items() if not isinstance(k, tuple)}
            step = self._reply_steps[key] = self._mega_step(s) or DeviceStep(self.be, self.weights, self.kv,
                                                                             self.settings.graph, s, seed)
        step.forget_inputs()  # a prefill came since its last step: write this reply's inputs
        return step

    # --8<-- [start:next_token]
    def next_token(self, token: int, pos: int, s: SamplingSettings, rng, step: DeviceStep | None) -> int:
        """Decode `token` at `pos` and sample the next one: on the device step when there is one."""
        if step is None:
            return sample(self.decode_one_token(token, pos), s, rng)
        picked = step.run(token, pos)  # greedy (equal to the host's pick) or drawn on the device
        return picked if step.picks else sample(step.logits_on_host(), s, rng)

    def tokens_after(self, token: int, pos: int, n: int, s: SamplingSettings, rng, step: DeviceStep | None):
        """The n tokens after `token` at `pos`, one decode step each, as an iterator. When the
        device picks every token, the next step is queued while the host takes this one
        (DeviceStep.run_ahead); close the iterator to stop early."""
        if step is not None and step.picks:
            yield from step.run_ahead(token, pos, n)
            return
        for p in range(pos, pos + n):
            token = self.next_token(token, p, s, rng, step)
            yield token
    # --8<-- [end:next_token]

    # --8<-- [start:speculate]
    def verify(self, window: list[int], pos: int) -> tuple[np.ndarray, int]:
        """One batched pass over `window` at pos, pos + 1, ...: every position's greedy pick
        (len(window),) and how many of the drafts (window[1:]) the model agrees with. The
        cells are written; `kv.keep` closes the window."""
        self.kv.open_window()
        try:
            logits = self._forward(window, pos, prompt=False, all_logits=True)
        except BaseException:
            self.kv.keep(0)  # a pass cut short keeps none of its cells: no window stays open
            raise
        picks, kept = np.zeros(len(window), np.int32), np.zeros(1, np.int32)
        self.be.op(verify_ref, verify)(logits, np.asarray(window[1:], np.int32), picks, kept)
        return picks, int(kept[0])

    def speculate(self, token: int, pos: int, n: int, history: list[int], counts: dict):
        """The n greedy tokens after `token` at `pos`, as tokens_after gives them, verified
        in windows of up to T = --spec positions (WindowWidth sizes each from the last): the
        drafter guesses width - 1 tokens from `history` (the prompt and the output so far),
        one pass checks them all, and the longest prefix the model agrees with is kept,
        plus the model's own next token. A rejected draft's cells
        lie past the kept ones; the next window starts there and writes over them. When the
        drafter has nothing, the token takes a decode step. On a GPU both are replayed from
        graphs (verify_window.py, decode_step.py); elsewhere `verify` runs the window."""
        drafter = Drafter([*history, token], self.settings.suffix_draft, min(MIN_NGRAM, self.settings.suffix_draft))
        width = WindowWidth(self.settings.spec)
        windows, step = self.spec_passes()
        for window in windows.values():  # every graph captured before the first pass counts
            window.capture(token, pos)
        while windows and step.use_graph and step.graph is None and pos < self.settings.max_context:
            step.run(token, pos)
        made = 0
        while made < n:
            room = min(width.now, n - made, self.settings.max_context - pos)
            drafts = drafter.draft(room - 1)
            kept = 0
            if not drafts:  # nothing to verify: one decode step
                picks = [self.next_token(token, pos, SamplingSettings(), None, step)]
            else:
                window = windows.get(width.now)
                on_device = window is not None and window.fits(pos)
                if on_device:
                    picks = window.run([token, *drafts], pos)
                    while kept < len(drafts) and picks[kept] == drafts[kept]:
                        kept += 1
                else:
                    picks, kept = self.verify([token, *drafts], pos)
                self.kv.keep(kept + 1)  # the window's token and the drafts the model agreed with
                width.after(kept)
                counts["drafts_offered"] += len(drafts)
                counts["drafts_accepted"] += kept
            for window in windows.values():  # the next pass starts where this one's kept cells end
                window.kept(pos, kept + 1)
            counts["passes"] += 1
            made_now = [*drafts[:kept], int(picks[kept])]
            drafter.extend(made_now)
            for t in made_now:
                made += 1
                yield t
            token, pos = int(picks[kept]), pos + kept + 1

    def spec_passes(self) -> tuple[dict[int, VerifyWindow], DeviceStep | None]:
        """The replayable verify windows (one per width WindowWidth takes) and greedy decode
        step speculation runs on, made once per engine so their graphs are captured once:
        ({}, None) off the GPU path."""
        if not VerifyWindow.supported(self.be, self.kv):
            return {}, None
        if self._spec_passes is None:
            self._spec_passes = ({w: VerifyWindow(self.be, self.weights, self.kv, w, self.settings.graph)
                                  for w in WindowWidth(self.settings.spec).widths}, self.device_step())
        return self._spec_passes
    # --8<-- [end:speculate]

    def _forward(self, ids, start: int, prompt: bool, all_logits: bool) -> np.ndarray:
        """ids at positions start, start + 1, ... through every layer -> logits (n or 1, vocab)."""
        part = np.asarray(ids, np.int32)
        pos = np.arange(start, start + len(part), dtype=np.int32)
        with self.be.deferred_frees():
            logits = self.be.to_numpy(forward(self.be, self.weights, self.kv, part, pos, prompt, all_logits))
        if self.weights.experts is not None:
            self.weights.experts.after_pass(prompt)  # the expert cache adapts between passes
        return logits

    def _in_chunks(self, ids, begin: int, end: int, size: int, prompt: bool, all_logits: bool):
        """ids[begin:end] in runs of `size`: yields (start, logits). A prompt chunk that
        needs only its last row's logits goes through the replayable prompt chunks, where
        the backend and cache have them and its padding fits."""
        chunks = self.prompt_chunks() if prompt and not all_logits else None
        for s in range(begin, end, size):
            part = ids[s:min(s + size, end)]
            if chunks is not None and chunks.fits(s, len(part)):  # inputs in device memory: a graph replays it
                yield s, chunks.run(part, s)[None]
            else:
                yield s, self._forward(part, s, prompt, all_logits)
    # --8<-- [end:verbs]

    def score(self, ids) -> np.ndarray:
        """Teacher-forced logits (len(ids), vocab) float32: row p predicts token p + 1."""
        return np.concatenate([logits for _, logits in self.score_chunks(ids)])

    def score_chunks(self, ids, windows_from: int | None = None, window: int = 8):
        """Teacher-forced logits chunk by chunk: yields (start, logits (n, vocab)).

        Positions before `windows_from` go through prompt chunks (dense attention); later
        ones through decode windows of `window` tokens, the path that selects blocks (QSA)
        and resolves them, so its quality cost shows up in the logits."""
        ids = [int(i) for i in ids]
        if not ids:
            raise StrataError("score needs at least one token")
        if len(ids) > self.settings.max_context:
            raise SettingError("max_context", f"{self.settings.max_context} does not fit the {len(ids)} tokens to score")
        split = len(ids) if windows_from is None else min(max(windows_from, 1), len(ids))
        yield from self._in_chunks(ids, 0, split, self.settings.prefill_chunk, True, True)
        yield from self._in_chunks(ids, split, len(ids), window, False, True)

    def generate(self, prompt: str, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool = True) -> Iterator[str]:
        """Yield text pieces as tokens are decoded (never splitting a UTF-8 character)."""
        s = SamplingSettings(max_tokens, temperature, top_k, top_p, seed)
        ids = self.prompt_ids(prompt, chat)
        yield from self.generate_ids(ids, s)

    # --8<-- [start:generate_ids]
    def generate_ids(self, ids: list[int], s: SamplingSettings, on_token=None, on_prefill=None,
                     cached: int = 0) -> Iterator[str]:
        """Text pieces of the reply to prompt `ids`. cached: the cache's cells already hold
        ids[:cached] (serve/conversations.py), so the prefill starts there."""
        if self.settings.spec and s.temperature != 0:
            raise SettingError("spec", "verifies greedy picks: it needs --temperature 0")
        rng = np.random.default_rng(s.seed)
        stats = self.last_stats = RunStats(prompt_tokens=len(ids), cached_tokens=cached, load_seconds=self.load_seconds)
        t0 = time.perf_counter()
        stats.kernels_compiled, stats.kernels_loaded = self.warm_up(ids)
        stats.warmup_seconds = time.perf_counter() - t0
        experts = self.weights.experts
        experts_before = experts.stats() if experts is not None else None
        decoder = StreamDecoder(self.tokenizer)
        t0 = time.perf_counter()
        logits = self.prefill(ids, on_chunk=on_prefill, start=cached)
        stats.prefill_seconds = time.perf_counter() - t0
        t0, pos = time.perf_counter(), len(ids)
        token = sample(logits, s, rng)
        # a step decodes at each pos < max_context while fewer than max_tokens are out
        n = min(s.max_tokens - 1, self.settings.max_context - pos)
        if self.settings.spec:
            counts = stats.extra["spec"] = dict(window=self.settings.spec, **spec_counts())
            later = self.speculate(token, pos, n, ids, counts)
        else:
            later = self.tokens_after(token, pos, n, s, rng, self.reply_step(s, rng))
        run, last = 0, None  # the current run of one repeated token
        steady = None  # (when, tokens out) once the first WARM_STEPS steps (or verify passes) were done
        arrived = t0  # when the last token was out
        try:
            while True:
                if token in self.tokenizer.stop_ids:
                    stats.finish_reason = "stop"
                    break
                stats.generated_tokens += 1
                now = time.perf_counter()
                if steady is None and self.settings.spec and counts["passes"] > WARM_STEPS:
                    steady = (arrived, stats.generated_tokens - 1)  # the warm-up passes' last token was out
                elif steady is None and not self.settings.spec and stats.generated_tokens == 1 + WARM_STEPS:
                    steady = (now, stats.generated_tokens)  # the prefill's token and the warm-up steps' are out
                arrived = now
                if on_token:
                    on_token(token)
                piece = decoder.push(token)
                if piece:
                    yield piece
                run, last = (run + 1 if token == last else 1), token
                if run >= REPETITION_STOP:  # a degenerate reply: one token over and over
                    stats.finish_reason = "repetition"
                    break
                if stats.generated_tokens >= s.max_tokens or pos >= self.settings.max_context:
                    stats.finish_reason = "length"
                    break
                token = next(later)
                pos += 1
        finally:
            later.close()  # waits for a step queued past the stop
        end, steps = time.perf_counter(), max(stats.generated_tokens - 1, 0)
        if steady is not None and stats.generated_tokens > steady[1]:  # time the steady steps; the first are warm-up
            stats.warmup_seconds += steady[0] - t0
            stats.decode_seconds, stats.decode_steps = end - steady[0], stats.generated_tokens - steady[1]
        else:  # too short a run to have steady steps: all of them
            stats.decode_seconds, stats.decode_steps = end - t0, steps
        if experts is not None:
            stats.extra["experts"] = experts.stats().since(experts_before).as_dict()
        if self.settings.spec:
            c = stats.extra["spec"]
            c["acceptance_rate"] = c["drafts_accepted"] / c["drafts_offered"] if c["drafts_offered"] else 0.0
            c["tokens_per_pass"] = (stats.generated_tokens - 1) / c["passes"] if c["passes"] else 0.0
        tail = decoder.flush()
        if tail:
            yield tail
    # --8<-- [end:generate_ids]
