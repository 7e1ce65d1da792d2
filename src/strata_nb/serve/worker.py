"""One engine, one request at a time: the worker thread that owns the engine, and the
jobs the HTTP handlers queue for it.

The engine is not shared between threads: the handlers tokenize and check a request,
queue a `Job`, and read its events (text pieces, then one `done`) from an asyncio queue
the worker feeds. A job whose client has gone (`cancel`) stops at its next token, so
the engine moves on to the next request.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..settings import SamplingSettings
from .conversations import ConversationCache


class StopText:
    """Text as it streams, cut at the first stop string. A piece that may be the start
    of a stop string is held back until the next piece says whether it is."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string ended the reply)."""
        text = self.held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.held = ""
            return text[:min(cuts)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclass
class Job:
    ids: list[int]  # the prompt's tokens
    sampling: SamplingSettings
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text", str) ... then ("done", dict)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self):
        self.cancelled.set()


@dataclass
class Totals:
    """What /metrics reports, updated by the worker after each job."""
    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    last_decode_tok_s: float = 0.0
    last_ttft_seconds: float = 0.0
    kv_lookups: int = 0
    kv_hit_rate: float = 1.0
    expert_lookups: int = 0
    expert_hit_rate: float = 1.0
    conversations: dict = field(default_factory=dict)


# --8<-- [start:worker]
class EngineWorker(threading.Thread):
    def __init__(self, engine, conversations: ConversationCache):
        super().__init__(name="strata-nb engine", daemon=True)
        self.engine, self.conversations = engine, conversations
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.totals = Totals(conversations=conversations.stats())
        self.busy = False

    @property
    def depth(self) -> int:
        """Requests queued or running."""
        return self.jobs.qsize() + self.busy

    def submit(self, job: Job):
        self.jobs.put(job)

    def stop(self):
        self.jobs.put(None)

    def run(self):
        while (job := self.jobs.get()) is not None:
            self.busy = True
            try:
                final = self.serve(job)
            except Exception as e:  # a bug, not a bad request: the handlers checked those
                traceback.print_exc(file=sys.stderr)
                self.totals.failed += 1
                final = ("error", f"{type(e).__name__}: {e}")
            self.busy = False  # before the last event: a client that hears it sees the engine free
            if final is not None:
                job.emit(*final)

    def serve(self, job: Job) -> tuple | None:
        """Run one job: resume from the conversation cache, generate, park. Returns the
        job's last event, ("done", finish reason and usage)."""
        if job.cancelled.is_set():  # the client left while it waited
            self.totals.cancelled += 1
            return None
        eng = self.engine
        cached = self.conversations.resume(job.ids)
        cut, finish, first = StopText(job.stops), None, None
        pieces = eng.generate_ids(job.ids, job.sampling, cached=cached)
        try:
            for piece in pieces:
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                text, stopped = cut.push(piece)
                if text:
                    first = first or time.perf_counter()
                    job.emit("text", text)
                if stopped:
                    finish = "stop"
                    break
        finally:
            pieces.close()
        self.conversations.park(job.ids)
        tail = cut.flush() if finish is None else ""
        if tail:
            job.emit("text", tail)
        s = eng.last_stats
        finish = finish or s.finish_reason or "length"
        self._count(s, finish, (first or time.perf_counter()) - job.queued_at)
        return "done", dict(finish_reason=finish, prompt_tokens=len(job.ids), cached_tokens=cached,
                            completion_tokens=s.generated_tokens)
    # --8<-- [end:worker]

    def _count(self, s, finish: str, ttft: float):
        t = self.totals
        t.requests += 1
        t.cancelled += finish == "cancelled"
        t.prompt_tokens += s.prompt_tokens
        t.cached_tokens += s.cached_tokens
        t.generated_tokens += s.generated_tokens
        t.prefill_seconds += s.prefill_seconds
        t.decode_seconds += s.decode_seconds
        t.decode_steps += s.decode_steps
        t.last_decode_tok_s = s.decode_tok_s or t.last_decode_tok_s
        t.last_ttft_seconds = ttft
        kv = self.engine.kv
        if kv.streamed:
            c = kv.counters
            t.kv_lookups, t.kv_hit_rate = c.lookups, c.hit_rate
        experts = self.engine.weights.experts
        if experts is not None:
            e = experts.stats()
            t.expert_lookups, t.expert_hit_rate = e.lookups, e.hit_rate
        t.conversations = self.conversations.stats()
