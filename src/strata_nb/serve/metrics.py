"""`GET /metrics`: the server's counters in Prometheus' text format."""
from __future__ import annotations

from .worker import Totals


def prometheus(t: Totals, queue_depth: int, requests_by_status: dict) -> str:
    c = t.conversations
    rows = [
        ("requests_total", "counter", "HTTP requests to the completion endpoints, by endpoint and status",
         [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(requests_by_status.items())] or [("", 0)]),
        ("requests_served_total", "counter", "requests the engine ran (cancelled ones included)", [("", t.requests)]),
        ("requests_cancelled_total", "counter", "requests whose client left before the reply ended",
         [("", t.cancelled)]),
        ("requests_failed_total", "counter", "requests the engine failed on (a bug: the reply is a server error)",
         [("", t.failed)]),
        ("prompt_tokens_total", "counter", "prompt tokens of the requests served", [("", t.prompt_tokens)]),
        ("cached_tokens_total", "counter", "prompt tokens restored from the conversation cache, not run",
         [("", t.cached_tokens)]),
        ("generated_tokens_total", "counter", "tokens generated", [("", t.generated_tokens)]),
        ("prefill_seconds_total", "counter", "time spent running prompts", [("", t.prefill_seconds)]),
        ("decode_tokens_per_second", "gauge", "steady decode rate of all requests so far",
         [("", t.decode_steps / t.decode_seconds if t.decode_seconds else 0.0)]),
        ("last_decode_tokens_per_second", "gauge", "steady decode rate of the last request with one",
         [("", t.last_decode_tok_s)]),
        ("last_time_to_first_token_seconds", "gauge", "the last request's time from queued to first text",
         [("", t.last_ttft_seconds)]),
        ("queue_depth", "gauge", "requests queued or running", [("", queue_depth)]),
        ("kv_block_lookups_total", "counter", "streamed KV: blocks decode queries looked up", [("", t.kv_lookups)]),
        ("kv_block_hit_rate", "gauge", "streamed KV: share of lookups found in VRAM (1 when fully resident)",
         [("", t.kv_hit_rate)]),
        ("expert_lookups_total", "counter", "MoE: experts chosen by tokens", [("", t.expert_lookups)]),
        ("expert_hit_rate", "gauge", "MoE: share of expert lookups found in a VRAM slot (1 for a dense model)",
         [("", t.expert_hit_rate)]),
        ("conversation_cache_bytes", "gauge", "host bytes of the parked conversations", [("", c["bytes"])]),
        ("conversation_cache_budget_bytes", "gauge", "the cache's budget", [("", c["budget_bytes"])]),
        ("conversation_cache_conversations", "gauge", "conversations parked", [("", c["conversations"])]),
        ("conversation_cache_hits_total", "counter", "requests that reused parked cells", [("", c["hits"])]),
        ("conversation_cache_misses_total", "counter", "requests that ran their whole prompt", [("", c["misses"])]),
        ("conversation_cache_restores_total", "counter", "parked cells written back into the KV",
         [("", c["restores"])]),
        ("conversation_cache_evictions_total", "counter", "conversations dropped to stay in budget",
         [("", c["evictions"])]),
    ]
    out = []
    for name, kind, help_text, samples in rows:
        out += [f"# HELP strata_nb_{name} {help_text}", f"# TYPE strata_nb_{name} {kind}"]
        out += [f"strata_nb_{name}{labels} {value:g}" if isinstance(value, float) else f"strata_nb_{name}{labels} {value}"
                for labels, value in samples]
    return "\n".join(out) + "\n"
