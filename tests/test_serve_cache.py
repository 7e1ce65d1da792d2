"""The conversation cache: a reply served from parked cells equals the reply a cold server
gives, byte for byte, and so do the cells themselves; every KV format, resident and
streamed (the minimum resident size, with and without QSA).

Conversation A's first turn is parked, B runs in between (the engine's KV then holds
B's cells), and A's follow-up restores A's cells and runs only the rest of its prompt.
A cold server (no conversation cache) serves the same follow-up from nothing. The
negative controls: skipping the restore (`--conversation-fault skip-restore`), and
reusing cells that are not whole prefill chunks (chunk 1: the prompt's partial last
chunk and the reply's decode-step cells), each make the cells differ from the cold ones.
"""
from importlib import resources

import numpy as np
import pytest

from strata_nb import Engine
from strata_nb.kv.plan import StreamPlan
from strata_nb.serve.app import Running, create_app
from serve_client import chat

CHUNK = 64  # prefill chunk: parked cells are whole chunks of it
STREAMED = dict(kv_resident=StreamPlan.minimum_cells(64), kv_window=64)


@pytest.fixture(scope="module")
def document():
    return resources.files("strata_nb.data").joinpath("default_document.txt").read_text()


def conversation(document):
    """A's first turn, B, and A's follow-up (given A's first reply)."""
    paragraphs = document.split("\n\n")
    a1 = [{"role": "user", "content": "\n\n".join(paragraphs[:3]) + "\n\nSay in one sentence what this is about."}]
    b = [{"role": "user", "content": "\n\n".join(paragraphs[3:6]) + "\n\nWhat is the main point?"}]

    def a2(reply):
        return a1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Name one detail it gives."}]
    return a1, b, a2


@pytest.fixture(scope="module")
def base(default_model_path):
    return Engine.load(model=default_model_path, device="cpu", max_context=1024, prefill_chunk=CHUNK)


def serve(base, cache_mib, fault="none", **settings):
    eng = base.derive(quiet=True, **settings)  # the same weights, a KV cache of its own
    return eng, Running(create_app(eng, "m", cache_mib, fault))


def request(messages, stream=False):
    return dict(messages=messages, max_tokens=12, temperature=0, stream=stream)


def cells(eng, n) -> list[np.ndarray]:
    snap = eng.kv.snapshot(n)
    return [a.view(np.uint8).ravel()[: a.nbytes] for layer in snap["layers"] for a in layer.values()]


def follow_up(base, document, fault="none", chunk=None, **settings):
    """A's follow-up served after A and B with the cache, and cold: replies, usage, cells."""
    a1, b, a2 = conversation(document)
    eng, server = serve(base, 64, fault, **settings)
    try:
        if chunk is not None:
            server.server.config.app.state.worker.conversations.chunk = chunk
        first = chat(server.url, request(a1))
        chat(server.url, request(b, stream=True))
        warm = chat(server.url, request(a2(first["content"]), stream=True))
        stats = server.server.config.app.state.worker.conversations.stats()
    finally:
        server.stop()
    cold_eng, cold = serve(base, 0, **settings)
    try:
        want = chat(cold.url, request(a2(first["content"])))
    finally:
        cold.stop()
    n = warm["usage"]["prompt_tokens"]
    return warm, want, stats, cells(eng, n), cells(cold_eng, n)


CONFIGS = [
    pytest.param("fp16", {}, id="fp16"),
    pytest.param("k8v4", STREAMED | dict(qsa_budget=128), id="k8v4-streamed-qsa"),
    pytest.param("int8", {}, id="int8", marks=pytest.mark.slow),
    pytest.param("q4_0", {}, id="q4_0", marks=pytest.mark.slow),
    pytest.param("k8v4", {}, id="k8v4", marks=pytest.mark.slow),
    pytest.param("k8v4", STREAMED, id="k8v4-streamed", marks=pytest.mark.slow),
    pytest.param("fp16", STREAMED, id="fp16-streamed", marks=pytest.mark.slow),
    pytest.param("q4_0", STREAMED | dict(qsa_budget=128), id="q4_0-streamed-qsa", marks=pytest.mark.slow),
]


@pytest.mark.model
@pytest.mark.parametrize("kv, settings", CONFIGS)
def test_a_restored_conversation_replies_as_a_cold_server(kv, settings, base, document):
    warm, want, stats, got_cells, want_cells = follow_up(base, document, kv=kv, **settings)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % CHUNK == 0 and stats["restores"] == 1  # A's cells came back after B's
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["content"] == want["content"] and warm["finish_reason"] == want["finish_reason"]
    assert all(np.array_equal(g, w) for g, w in zip(got_cells, want_cells))  # bit for bit


@pytest.mark.model
def test_negative_control_skipping_the_restore_leaves_another_conversation_s_cells(base, document):
    warm, _, stats, got_cells, want_cells = follow_up(base, document, fault="skip-restore")
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and stats["restores"] == 0
    assert not all(np.array_equal(g, w) for g, w in zip(got_cells, want_cells))


@pytest.mark.model
def test_negative_control_reusing_cells_that_are_not_whole_chunks_changes_them(base, document):
    """Chunk 1: the cache reuses the partial last chunk of A's prompt and the cells of A's
    reply, written by other products than a cold prefill's: their roundings differ."""
    warm, _, _, got_cells, want_cells = follow_up(base, document, chunk=1)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] % CHUNK != 0
    assert not all(np.array_equal(g, w) for g, w in zip(got_cells, want_cells))
