"""`strata-nb serve` against clients on 127.0.0.1, on the 2-layer random-weight model
(fast): the endpoints' shapes, stop strings, a load of concurrent clients whose replies
each equal the same request served alone, a client that leaves mid-stream, the
conversation cache's budget, and a clear 4xx for each kind of bad request."""
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from strata_nb import Engine
from strata_nb.serve.app import Running, create_app
from strata_nb.serve.worker import StopText
from cli_runner import run_cli
from serve_client import chat, events, get, post

CHUNK = 16
BUDGET_MIB = 0.2  # about 400 cells of the tiny model's fp16 KV (512 bytes a cell): a few conversations


@pytest.fixture(scope="module")
def base(tiny_model):
    return Engine.load(model=tiny_model, device="cpu", prefill_chunk=CHUNK)


def start(base, cache_mib=BUDGET_MIB, **settings) -> Running:
    return Running(create_app(base.derive(quiet=True, **settings), "tiny", cache_mib))


@pytest.fixture
def server(base):
    s = start(base)
    yield s
    s.stop()


def metric(url: str, name: str) -> float:
    _, text = get(url, "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"strata_nb_{name}"))


# ---- the endpoints --------------------------------------------------------------------
def test_chat_completion_and_its_stream_agree(server):
    body = dict(messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0)
    whole, streamed = chat(server.url, body), chat(server.url, body | {"stream": True})
    assert whole["content"] == streamed["content"] and whole["finish_reason"] == streamed["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12 and whole["usage"]["prompt_tokens"] == 30
    assert streamed["usage"]["prompt_tokens_details"]["cached_tokens"] == CHUNK  # the same prompt again: its whole chunk
    status, models = get(server.url, "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "tiny"


def test_text_completion_streams_the_same_text(server):
    body = dict(prompt="once upon a time", max_tokens=10, temperature=0)
    status, out = post(server.url, "/v1/completions", body)
    assert status == 200 and out["object"] == "text_completion"
    pieces = [e["choices"][0]["text"] for e in events(server.url, "/v1/completions", body) if e != "[DONE]"]
    assert "".join(pieces) == out["choices"][0]["text"]


def test_a_stop_string_ends_the_reply_before_it(server):
    body = dict(messages=[{"role": "user", "content": "count"}], max_tokens=40, temperature=0)
    full = chat(server.url, body)["content"]
    stop = full[5:7]  # two characters from inside the reply (the byte-level model's text)
    cut = chat(server.url, body | {"stop": [stop], "stream": True})
    assert cut["content"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def test_stop_text_holds_back_what_may_start_a_stop_string():
    cut = StopText(["END", "##"])
    assert cut.push("abc E") == ("abc ", False)  # "E" may start END
    assert cut.push("N") == ("", False)
    assert cut.push("Dx") == ("", True)  # "END" found: nothing of it is sent
    cut = StopText(["END"])
    assert cut.push("E") == ("", False) and cut.push("ast") == ("East", False) and cut.flush() == ""


# ---- load -----------------------------------------------------------------------------
def requests_mixed() -> list[dict]:
    """Conversations of 40 to 250 tokens (bytes: the tiny model's vocabulary), follow-ups
    extending some of them, greedy and seeded draws."""
    rng = random.Random(0)
    words = "the of harbour mill apple river lantern quiet seven blue morning market".split()
    out = []
    for i in range(6):
        first = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(8 + 8 * i))}]
        out.append(dict(messages=first, max_tokens=6 + i, temperature=0))
        follow = first + [{"role": "assistant", "content": "a reply"}, {"role": "user", "content": f"and {i}?"}]
        out.append(dict(messages=follow, max_tokens=8, temperature=0.8, seed=i))
    return out


ROUNDS = 8  # requests a client sends, one after another: 256 in all, over 12 conversations


def test_32_clients_each_get_the_reply_the_request_gets_alone(base, server):
    bodies = requests_mixed()
    alone = start(base, cache_mib=0)
    try:
        want = [chat(alone.url, b) for b in bodies]
    finally:
        alone.stop()

    def client(c: int) -> list[str]:
        rng, wrong = random.Random(c), []
        for _ in range(ROUNDS):
            i = rng.randrange(len(bodies))
            got = chat(server.url, bodies[i] | {"stream": rng.random() < 0.5})
            if (got["content"], got["finish_reason"]) != (want[i]["content"], want[i]["finish_reason"]):
                wrong.append(f"request {i}: {got['content']!r} != {want[i]['content']!r}")
        return wrong

    with ThreadPoolExecutor(32) as pool:
        wrong = [w for ws in pool.map(client, range(32)) for w in ws]
    assert wrong == []
    assert metric(server.url, 'requests_total{endpoint="/v1/chat/completions",status="200"}') == 32 * ROUNDS
    assert metric(server.url, "cached_tokens_total") > 0  # follow-ups resumed parked conversations
    assert metric(server.url, "conversation_cache_evictions_total") > 0  # more than the budget holds came by
    assert 0 < metric(server.url, "conversation_cache_bytes") <= BUDGET_MIB * 2**20
    assert metric(server.url, "queue_depth") == 0


def test_a_client_that_leaves_mid_stream_frees_the_engine(server):
    body = dict(messages=[{"role": "user", "content": "go on"}], max_tokens=400, temperature=1.0, seed=1,
                stream=True)
    stream = events(server.url, "/v1/chat/completions", body)
    for _ in range(3):
        next(stream)
    stream.close()  # closes the connection
    deadline = time.time() + 20
    while metric(server.url, "requests_cancelled_total") < 1:
        assert time.time() < deadline, "the server did not notice the client leave"
        time.sleep(0.05)
    assert metric(server.url, "generated_tokens_total") < 400
    assert chat(server.url, dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3))["finish_reason"]
    assert metric(server.url, "queue_depth") == 0


# ---- bad requests ---------------------------------------------------------------------
HELLO = [{"role": "user", "content": "hello"}]
BAD = [
    pytest.param(b"{not json", 400, "not valid JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", 400, "JSON object", id="not-an-object"),
    pytest.param(dict(messages=HELLO, presence_penalty=1), 400, "unknown field 'presence_penalty'", id="unknown-field"),
    pytest.param(dict(messages=HELLO, max_tokens=-3), 400, "max_tokens", id="negative-max-tokens"),
    pytest.param(dict(messages=HELLO, temperature="hot"), 400, "temperature", id="temperature-not-a-number"),
    pytest.param(dict(messages=HELLO, n=2), 400, "n", id="n-2"),
    pytest.param(dict(messages=HELLO, seed=-1), 400, "seed", id="negative-seed"),
    pytest.param(dict(messages=HELLO, max_tokens=True), 400, "max_tokens", id="max-tokens-true"),
    pytest.param(dict(messages=HELLO, stream="yes"), 400, "stream", id="stream-yes"),
    pytest.param(dict(messages=HELLO, temperature="0.5"), 400, "temperature", id="temperature-a-string"),
    pytest.param(dict(messages=[]), 400, "messages", id="no-messages"),
    pytest.param(dict(messages=[{"role": "robot", "content": "x"}]), 400, "role", id="unknown-role"),
    pytest.param(dict(messages=HELLO, stop=["a", "b", "c", "d", "e"]), 400, "stop", id="five-stops"),
    pytest.param(dict(messages=[{"role": "user", "content": "word " * 200}]), 400, "context", id="over-the-context"),
    pytest.param(dict(messages=HELLO, model="gpt-4"), 404, "not served here", id="unknown-model"),
]


@pytest.mark.parametrize("body, status, says", BAD)
def test_a_bad_request_gets_a_clear_4xx_and_the_server_goes_on(server, body, status, says):
    got, out = post(server.url, "/v1/chat/completions", None if isinstance(body, bytes) else body,
                    raw=body if isinstance(body, bytes) else None)
    assert got == status and says in out["error"]["message"] and out["error"]["type"] == "invalid_request_error"
    assert chat(server.url, dict(messages=HELLO, max_tokens=2))["usage"]["completion_tokens"] == 2


def test_serve_flags_are_checked(tiny_model, capsys):
    def run(argv):
        code, _, err = run_cli(["serve", "--model", tiny_model, "--device", "cpu", *argv], capsys)
        return code, err

    code, err = run(["--port", "70000"])
    assert code == 2 and "not a port number" in err
    code, err = run(["--conversation-cache-mib", "-1"])
    assert code == 2 and "--conversation-cache-mib" in err
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        code, err = run(["--port", str(taken.getsockname()[1])])
        assert code == 2 and "cannot listen" in err and "Traceback" not in err
    finally:
        taken.close()
