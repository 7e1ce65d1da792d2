"""`strata-nb probe` against a fake OpenAI-compatible server in a thread: the honest fake
passes every check, each misbehaviour fails exactly the check that guards it (the negative
controls), and a server that cannot be reached or answers an error is one line and exit 2."""
import json
import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from strata_nb.cli import main

# The fake's words: no digit and no name from needle_text, so a planted answer is only in
# a reply that gives it
VOCAB = ("amber", "brook", "cinder", "dune", "ember", "fern", "glade", "hollow", "ivy", "jetty", "kelp", "lark",
         "moss", "nettle", "oak", "pebble", "quill", "reed", "slate", "thistle", "umber", "vale", "willow", "yarrow",
         "acorn", "bramble", "clover", "dew", "flint", "gorse", "heath", "inlet")
ANSWER = re.compile(r"locker is (\d+)\.|is called (\w+)\.")  # the two kinds of needle_text.fact
UNCACHED_S = 1e-4  # seconds per prompt word the fake's prefix cache lacks: a cold long prompt starts late
SMALL = ["--parked-words", "120", "--needle-words", "200"]  # the fake needs no length to show its faults


class FakeChat:
    """A reply is a function of the messages: words drawn from a hash of them, the planted
    fact's answer first when the last message holds one; unless a misbehaviour is on:

    stream-differs: a streamed reply loses the space before its third word.
    leaks-after-others: a conversation sent again after others ran in between ends with
        the previous reply's words (a conversation cache restoring the wrong cells).
    loops: every reply falls into a four-word loop after its first four words.
    forgets-needle: the planted answer is never given.
    varies: the last word changes with every request.
    http-500, not-json: every chat request is answered with that.
    """

    def __init__(self, misbehaviour=None, api_key=None, lists_models=True):
        self.misbehaviour, self.api_key, self.lists_models = misbehaviour, api_key, lists_models
        self.prompts = []  # every prompt's words, in order: what the prefix cache holds
        self.conversations, self.replies, self.models_sent = [], {}, []
        self.last_key, self.last_words = None, []

    def answer(self, messages, max_tokens):
        """The reply's words and its usage, after the delay of the prompt's uncached words."""
        key = json.dumps(messages)
        rng = random.Random(key)
        words = [rng.choice(VOCAB) for _ in range(max_tokens)]
        planted = ANSWER.search(messages[-1]["content"])
        if planted and self.misbehaviour != "forgets-needle":
            words[0] = planted.group(1) or planted.group(2)
        if self.misbehaviour == "loops":
            words[4:] = (["round", "and", "round", "again"] * max_tokens)[:max_tokens - 4]
        if self.misbehaviour == "varies":
            words[-1] = VOCAB[len(self.conversations) % len(VOCAB)]
        if self.misbehaviour == "leaks-after-others" and key in self.replies and key != self.last_key:
            half = len(words) // 2
            words[half:] = self.last_words[half:len(words)]
        prompt = " ".join(m["content"] for m in messages).split()
        cached = max((shared(prompt, earlier) for earlier in self.prompts), default=0)
        time.sleep(UNCACHED_S * (len(prompt) - cached))
        self.prompts.append(prompt)
        self.conversations.append(messages)
        self.replies[key], self.last_key, self.last_words = " ".join(words), key, words
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(words), "total_tokens": len(prompt) + len(words),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        return words, usage


def shared(a, b) -> int:
    """How many leading words a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # streams go out chunked, as llama-server's and vLLM's do

    def log_message(self, *args):  # quiet: pytest shows stderr of failing tests
        pass

    def do_GET(self):
        if self.path == "/v1/models" and self.server.fake.lists_models:
            self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
            return self.send_json(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
        if fake.misbehaviour == "http-500":
            return self.send_json(500, {"error": {"message": "CUDA error: out of memory\n  at decode step 3"}})
        if fake.misbehaviour == "not-json":
            return self.send_bytes(200, "text/html", b"<html><body>Bad gateway</body></html>")
        fake.models_sent.append(body["model"])
        words, usage = fake.answer(body["messages"], body["max_tokens"])
        if not body["stream"]:
            message = {"role": "assistant", "content": " ".join(words)}
            return self.send_json(200, {"object": "chat.completion", "usage": usage,
                                        "choices": [{"index": 0, "message": message, "finish_reason": "length"}]})
        pieces = [words[0]] + [" " + w for w in words[1:]]
        if fake.misbehaviour == "stream-differs":
            pieces[2] = words[2]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deltas = [({"role": "assistant"}, None)] + [({"content": p}, None) for p in pieces] + [({}, "length")]
        for delta, finish_reason in deltas:
            self.send_event({"object": "chat.completion.chunk",
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
        if body.get("stream_options", {}).get("include_usage"):
            self.send_event({"object": "chat.completion.chunk", "choices": [], "usage": usage})
        self.send_chunk(b"data: [DONE]\n\n")
        self.send_chunk(b"")  # the chunked body's end

    def send_json(self, status, body):
        self.send_bytes(status, "application/json", json.dumps(body).encode())

    def send_bytes(self, status, content_type, raw):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def send_event(self, chunk):
        self.send_chunk(f"data: {json.dumps(chunk)}\n\n".encode())

    def send_chunk(self, raw):
        self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")


@pytest.fixture
def serve():
    """serve(misbehaviour, ...) -> (base URL, the FakeChat): a fake server on a free port."""
    servers = []

    def start(misbehaviour=None, **fake_kw):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.fake = FakeChat(misbehaviour, **fake_kw)
        # a short poll: shutdown() waits for the loop to look, 0.5 s by default
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_port}", httpd.fake

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def probe(*args):
    """`strata-nb probe ARGS` through main(), the entry point that turns a StrataError into
    one line and exit 2 (CliRunner invoking the click group would leave it an exception).
    Returns (exit code, stdout, stderr)."""
    with CliRunner().isolation() as (out, err, _):
        try:
            main(["probe", *args])
        except SystemExit as exit_:
            return exit_.code, out.getvalue().decode(), err.getvalue().decode()


def test_the_honest_server_passes_every_check(serve):
    url, fake = serve()
    code, out, err = probe("--url", url, "--json", "--ttft", "1000", "--ttft-runs", "2", *SMALL)
    result = json.loads(out)
    checks = {c["check"]: c for c in result["checks"]}
    assert code == 0 and err == "" and result["passed"]
    assert list(checks) == ["stream", "repeat", "repeat after others", "needle", "repetition", "ttft"]
    assert all(c["passed"] for c in result["checks"][:-1]) and checks["ttft"]["passed"] is None
    assert set(fake.models_sent) == {"fake-model"}  # the first id GET /v1/models lists
    # the follow-ups extend the turn they follow with the reply it got: 2 of the 3 other
    # conversations of the parked check, and each of the ttft check's 2 timed follow-ups
    alone = {json.dumps(m[0]): fake.replies[json.dumps(m)] for m in fake.conversations if len(m) == 1}
    resumed = [m for m in fake.conversations if len(m) == 3 and json.dumps(m[0]) in alone]
    assert len(resumed) == 2 + 2 and all(m[1]["content"] == alone[json.dumps(m[0])] for m in resumed)
    ttft = checks["ttft"]
    # the fake starts a reply UNCACHED_S a word late: ~0.1 s for the twin's 1000 cold words,
    # a few ms for the follow-up's new ones
    assert ttft["ratio"] > 3 and ttft["result"] == f"{ttft['ratio']:.1f}x"
    assert 1000 <= ttft["cached_tokens"] < ttft["prompt_tokens"]


def test_the_table_and_the_out_file(serve, tmp_path):
    url, _ = serve()
    code, out, _ = probe("--url", url + "/v1/", "--no-parked", "--out", str(tmp_path / "probe.json"), *SMALL)
    assert code == 0
    assert "| check | result | detail |" in out and "| stream | pass | " in out and "| needle | pass | " in out
    assert "repeat after others" not in out and out.strip().endswith("all 4 checks passed")
    written = json.loads((tmp_path / "probe.json").read_text())
    assert written["url"] == url and [c["check"] for c in written["checks"]] == ["stream", "repeat", "needle",
                                                                                 "repetition"]


@pytest.mark.parametrize("misbehaviour, fails, detail", [
    ("stream-differs", {"stream"}, "streamed and whole replies differ from character"),
    ("leaks-after-others", {"repeat after others"}, "the replies before and after 3 other conversations"),
    ("loops", {"repetition"}, "degenerate: loop_score above 0.5"),
    ("forgets-needle", {"needle"}, "lacks"),
    # a reply that changes from call to call shows wherever two replies are compared
    ("varies", {"stream", "repeat", "repeat after others"}, "differ from character"),
])
def test_each_misbehaviour_fails_the_check_that_guards_it(misbehaviour, fails, detail, serve):
    url, _ = serve(misbehaviour)
    code, out, _ = probe("--url", url, "--json", *SMALL)
    result = json.loads(out)
    failed = {c["check"]: c for c in result["checks"] if not c["passed"]}
    assert code == 1 and not result["passed"]
    assert set(failed) == fails and all(c["result"] == "fail" for c in failed.values())
    assert all(detail in c["detail"] for c in failed.values()), failed


@pytest.mark.parametrize("misbehaviour, message", [
    ("http-500", "/v1/chat/completions answered HTTP 500 Internal Server Error: CUDA error: out of memory at decode "
                 "step 3"),
    ("not-json", "/v1/chat/completions answered what is not JSON: '<html><body>Bad gateway</body></html>'"),
])
def test_a_server_error_is_one_line_and_exit_2(misbehaviour, message, serve):
    url, _ = serve(misbehaviour)
    code, out, err = probe("--url", url)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"strata-nb: error: POST {url}{message}"]


def test_an_unreachable_server_is_one_line_and_exit_2():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = probe("--url", f"http://127.0.0.1:{port}")
    assert code == 2 and out == ""
    assert err.splitlines() == [f"strata-nb: error: cannot reach http://127.0.0.1:{port}: Connection refused"]


def test_the_api_key_is_sent_as_a_bearer_token(serve):
    url, fake = serve(api_key="sesame")
    code, _, err = probe("--url", url, "--no-parked", *SMALL)
    assert code == 2 and err.splitlines() == [f"strata-nb: error: POST {url}/v1/chat/completions answered HTTP 401 "
                                              "Unauthorized: invalid api key"]
    code, _, _ = probe("--url", url, "--no-parked", "--api-key", "sesame", *SMALL)
    assert code == 0 and set(fake.models_sent) == {"fake-model"}


@pytest.mark.parametrize("flags, sent", [([], "default"), (["--model", "mine"], "mine")])
def test_the_model_field_without_a_models_endpoint(flags, sent, serve):
    url, fake = serve(lists_models=False)
    code, _, _ = probe("--url", url, "--no-parked", *flags, *SMALL)
    assert code == 0 and set(fake.models_sent) == {sent}


@pytest.mark.parametrize("flags, message", [
    (["--url", "localhost:8080"], "--url must be http://host:port or https://host, got 'localhost:8080'"),
    (["--url", "http://127.0.0.1:9", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--url", "http://127.0.0.1:9", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--url", "http://127.0.0.1:9", "--ttft", "0"], "--ttft must be at least 1 word, got 0"),
    (["--url", "http://127.0.0.1:9", "--out", "/no/such/folder/probe.json"],
     "--out /no/such/folder/probe.json: the folder /no/such/folder does not exist"),
])
def test_bad_flags_are_said_before_the_server_is_asked(flags, message):
    code, _, err = probe(*flags)
    assert code == 2 and err.splitlines() == [f"strata-nb: error: {message}"]


# ---- against strata-nb serve ------------------------------------------------------------
@pytest.mark.model
@pytest.mark.slow
def test_the_probe_passes_strata_nb_serve_and_catches_its_skip_restore_fault(default_model_path):
    """Our server on the default model (CPU, chunks of 64 tokens, so the probe's 300-word
    conversations park several): every check passes; with --conversation-fault
    skip-restore the repeat-after-others check fails."""
    from strata_nb import Engine
    from strata_nb.serve import probe
    from strata_nb.serve.app import Running, create_app

    base = Engine.load(model=default_model_path, device="cpu", max_context=2048, prefill_chunk=64)
    settings = probe.ProbeSettings(max_tokens=12, others=2, parked_words=300, needle_words=200, free_tokens=48,
                                   rate=24)
    server = Running(create_app(base.derive(quiet=True), "smol", 64))
    try:
        result = probe.run(probe.Server(server.url), settings)
    finally:
        server.stop()
    assert result["passed"], probe.table(result)
    assert result["model"] == "smol"
    rate = result["checks"][-1]
    assert rate["check"] == "rate" and rate["engine_tokens_per_s"] > 0 and rate["client_pieces_per_s"] > 0
    server = Running(create_app(base.derive(quiet=True), "smol", 64, "skip-restore"))
    try:
        row = probe.parked_check(probe.Server(server.url), probe.ProbeSettings(model="smol", **{
            k: getattr(settings, k) for k in ("max_tokens", "others", "parked_words")}))
    finally:
        server.stop()
    assert row.passed is False, row.detail
