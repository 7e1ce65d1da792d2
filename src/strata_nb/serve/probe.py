"""`strata-nb probe`: checks any OpenAI-compatible chat server (ours, llama.cpp's
llama-server, vLLM) from the outside, through POST /v1/chat/completions at temperature 0
with a fixed seed. Each check catches what one request and a glance at its reply miss:

- stream: the same request with stream false and with stream true. Catches a streaming
  path that renders the text differently (a detokenizer that drops the space at a
  piece's edge, a lost last piece), stops for another reason, or never sends
  `data: [DONE]`.
- repeat: the same request twice in a row. Catches replies that are not a function of
  the request at temperature 0 (a sampler that ignores it, sums whose order changes
  from call to call).
- repeat after others: conversation A, other conversations (some two-turn), then A
  again. Catches state leaking between requests: a conversation cache that parks a
  conversation's KV and restores it wrong or not at all, a slot or ring that keeps
  another request's cells. The conversations are long (--parked-words) because a cache
  parks whole blocks or chunks only: ours parks whole prefill chunks (2048 tokens on a GPU),
  or whole prompts where a prompt row's cells do not depend on its chunk.
- needle: a fact planted mid-way in filler, asked for at the end. Catches a prompt cut
  short without a word (a context limit that truncates) or attention that loses the middle.
- repetition: free generation, scored by `probes.loop_score` over the reply's words.
  Catches the collapse into a loop that a corrupted cache shows a few hundred tokens on.
- ttft (only with --ttft): time to the first token of a follow-up turn, whose prompt
  starts with the turn before, beside a twin that shares no prefix with anything sent.
  A measurement, no verdict: the ratio says whether the server reuses the earlier turn's
  cache, `cached_tokens` (when the server reports it) how much of it.
- rate (only with --rate): a long streamed reply's pieces a second at the client. A
  measurement too; against a server whose /metrics reports its engine's own steady
  decode rate (ours), it says what the server adds to each token.

Only the standard library speaks HTTP: the probe times the first streamed token and reads
the server-sent events itself. A server that cannot be reached, answers an HTTP error, or
answers what is not a chat completion is a StrataError: one line, exit 2.
"""
from __future__ import annotations

import http.client
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

import numpy as np

from ..errors import SettingError, StrataError
from ..needle import SEP
from ..needle_text import fact, filler, sentences
from ..probes import DEGENERATE, loop_score, repetition_score

STREAM_PROMPT = "Describe a harbour town at dawn in a few sentences."
REPEAT_PROMPT = "Explain in a few sentences how a lighthouse guides ships at night."
FREE_PROMPT = "Write a long story about a ferryman who carries letters across a wide river."
SUMMARY_QUESTION = "What happens in the text above? Answer in two sentences."
FOLLOW_UP = "Thank you. Now say it again in one short sentence."
INCLUDE_USAGE = {"stream_options": {"include_usage": True}}  # OpenAI servers then end the stream with usage
# Each check draws its text from its own stream of the seed, so the words of one check
# do not change when another check's settings do.
NEEDLE, PARKED, TTFT = range(3)
# The rate check times the pieces after the first RATE_SKIP: a server's first decode steps
# can be slower than the rest (ours runs the first eagerly and captures the second into a
# CUDA graph), and its own steady rate leaves the same steps out.
RATE_SKIP = 3


@dataclass(slots=True)
class ProbeSettings:
    """The checks' settings; the CLI's flags map onto them one to one."""
    model: str | None = None  # the request's model field; None: the first id of GET /v1/models
    seed: int = 0  # sent with every request, and the seed of the filler and the facts
    max_tokens: int = 32  # reply tokens of the short checks
    parked: bool = True  # run the repeat-after-others check
    others: int = 3  # conversations between A and A again
    parked_words: int = 2000  # filler words in each conversation of that check
    needle_words: int = 600  # filler words around the fact (a remote tokenizer is unknown: words, not tokens)
    free_tokens: int = 200  # max_tokens of the free generation
    ttft: int | None = None  # filler words of the ttft check's first turn; None: no ttft check
    ttft_runs: int = 3  # timings of each kind; the table shows medians
    rate: int | None = None  # max_tokens of the rate check's streamed reply; None: no rate check

    def __post_init__(self):
        for name in ("max_tokens", "others", "parked_words", "needle_words", "free_tokens", "ttft_runs"):
            if getattr(self, name) < 1:
                raise SettingError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.ttft is not None and self.ttft < 1:
            raise SettingError("ttft", f"must be at least 1 word, got {self.ttft}")
        if self.rate is not None and self.rate <= RATE_SKIP + 1:
            raise SettingError("rate", f"must be more than {RATE_SKIP + 1} tokens, got {self.rate}")
        if self.seed < 0:  # llama-server reads seed -1 as "draw one at random"
            raise SettingError("seed", f"must be >= 0, got {self.seed}")

    def request(self, messages: list[dict], max_tokens: int) -> dict:
        return {"model": self.model, "messages": messages, "temperature": 0, "seed": self.seed,
                "max_tokens": max_tokens}


@dataclass(frozen=True)
class Reply:
    content: str
    finish_reason: str | None
    usage: dict | None  # as the server sent it; a stream has it only with INCLUDE_USAGE
    first_token_s: float | None = None  # streamed: seconds from sending to the first content piece
    pieces: int = 1  # streamed: content deltas
    piece_s: tuple = ()  # streamed: seconds from sending to each content piece
    done: bool = True  # streamed: ended with data: [DONE]


class NoAnswer(StrataError):
    """The server could not be reached, or the connection broke off mid-answer."""


class Server:
    """An OpenAI-compatible server at a base URL. Each request goes on a connection of its
    own, so the client carries no state from one request to the next either."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0):
        parts = urlsplit(url.strip())
        try:
            port = parts.port  # None: the scheme's
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # a port that is not a number from 0 to 65535
            valid = False
        if not valid:
            raise SettingError("url", f"must be http://host:port or https://host, got {url!r}")
        if not timeout > 0:
            raise SettingError("timeout", f"must be > 0 seconds, got {timeout}")
        # OpenAI clients take the base URL with /v1 on the end; the probe takes it either way
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.url = f"{parts.scheme}://{parts.netloc}{self.prefix}"
        self.host, self.port, self.timeout = parts.hostname, port, timeout
        self.connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def models(self) -> list[str]:
        """The ids GET /v1/models lists; [] when its JSON is not a list of models."""
        listed = self._exchange("GET", "/v1/models", None, lambda response, started, where: _json(response.read(), where))
        try:
            return [str(m["id"]) for m in listed["data"]]
        except (KeyError, TypeError):
            return []

    def metric(self, name: str) -> float | None:
        """One unlabelled sample of GET /metrics (Prometheus text); None when there is none."""
        try:
            text = self._exchange("GET", "/metrics", None, lambda response, started, where: response.read().decode())
        except StrataError:
            return None
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return float(parts[1])
        return None

    def chat(self, body: dict, stream: bool = False) -> Reply:
        return self._exchange("POST", "/v1/chat/completions", body | {"stream": stream},
                              _streamed if stream else _completion)

    def _exchange(self, method: str, path: str, body: dict | None, read):
        """Sends one request; returns read(response, started, where), `started` the
        perf_counter reading once the connection is open, just before the request goes
        out: a time to first token then times the server, not the connect."""
        where = f"{method} {self.url}{path}"
        conn = self.connection(self.host, self.port, timeout=self.timeout)
        try:
            conn.connect()
        except OSError as err:
            raise NoAnswer(f"cannot reach {self.url}: {_why(err)}") from None
        try:
            started = time.perf_counter()
            conn.request(method, self.prefix + path, body=None if body is None else json.dumps(body),
                         headers=self.headers)
            response = conn.getresponse()
            if response.status >= 400:
                raise StrataError(f"{where} answered HTTP {response.status} {response.reason}: "
                                  f"{_error_message(response.read())}")
            return read(response, started, where)
        except (OSError, http.client.HTTPException) as err:
            raise NoAnswer(f"{where} broke off: {_why(err)}") from None
        finally:
            conn.close()


def _why(err: Exception) -> str:
    """ConnectionRefusedError -> "Connection refused"; a timeout -> "timed out"."""
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _start(raw: bytes) -> str:
    """The start of a body, for a message that must stay one line."""
    text = " ".join(raw.decode("utf-8", "replace").split())
    if not text:
        return "an empty body"
    return repr(text[:120] + ("..." if len(text) > 120 else ""))


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body, {"error": {"message": ...}}; else the body's start."""
    try:
        error = json.loads(raw)["error"]
        message = error["message"] if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        return _start(raw)
    return " ".join(str(message).split())  # a traceback in the message would break the one line


def _json(raw: bytes, where: str):
    try:
        return json.loads(raw)
    except ValueError:  # a JSONDecodeError, or bytes that are not UTF-8
        raise StrataError(f"{where} answered what is not JSON: {_start(raw)}") from None


def _completion(response, started: float, where: str) -> Reply:
    body = _json(response.read(), where)
    try:
        choice = body["choices"][0]
        return Reply(choice["message"]["content"] or "", choice.get("finish_reason"), body.get("usage"))
    except (KeyError, IndexError, TypeError, AttributeError):
        shown = _start(json.dumps(body).encode())
        raise StrataError(f"{where} answered JSON that is not a chat completion: {shown}") from None


def _streamed(response, started: float, where: str) -> Reply:
    """The server-sent events of a streamed chat completion, read as they arrive."""
    pieces, finish_reason, usage, first_token_s, done, times = [], None, None, None, False, []
    for raw in response:  # one line at a time, returned as soon as its newline arrives
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # the blank line after each event, ": keep-alive" comments, "event:" names
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            done = True
            break
        chunk = _json(data.encode(), where)
        try:
            if "error" in chunk:  # an error after the 200 went out can only come as an event
                raise StrataError(f"{where} sent an error in its stream: {_error_message(data.encode())}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():  # the usage chunk has none
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    times.append(time.perf_counter() - started)
                    first_token_s = times[0]
                    pieces.append(piece)
                finish_reason = choice.get("finish_reason") or finish_reason
        except (TypeError, AttributeError):
            shown = _start(data.encode())
            raise StrataError(f"{where} streamed an event that is not a chat completion chunk: {shown}") from None
    if first_token_s is None:  # an empty reply: the server had nothing to say until the end
        first_token_s = time.perf_counter() - started
    return Reply("".join(pieces), finish_reason, usage, first_token_s, len(pieces), piece_s=tuple(times), done=done)


def default_model(server: Server) -> str:
    """The first model GET /v1/models lists; "default" for a server without that endpoint
    (it answers an error, or JSON of another shape). A server that does not answer at all
    is said here already, not after a second wait on the first chat request."""
    try:
        listed = server.models()
    except NoAnswer:
        raise
    except StrataError:
        listed = []
    return listed[0] if listed else "default"


@dataclass
class Row:
    check: str
    passed: bool | None  # None: a measurement, no verdict
    detail: str
    figure: str | None = None  # shown in the result column instead of pass or fail
    measured: dict = field(default_factory=dict)  # figures and replies, for the JSON

    def as_json(self) -> dict:
        shown = self.figure or ("pass" if self.passed else "fail")
        return {"check": self.check, "result": shown, "passed": self.passed, "detail": self.detail} | self.measured


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def first_difference(a: str, b: str) -> str:
    """Where two replies part: the character and a few characters of each from there."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differ from character {at}: {a[at:at + 24]!r} vs {b[at:at + 24]!r}"


def filler_paragraphs(rng: np.random.Generator, n_words: int) -> list[str]:
    """Filler of at most n_words words: the last paragraph drawn runs past the count, so
    only its sentences that fit are kept."""
    words = lambda text: len(text.split())
    *whole, last = filler(rng, n_words, words)
    room, kept = n_words - sum(map(words, whole)), []
    for sentence in sentences(last):
        room -= words(sentence)
        if room < 0:
            break
        kept.append(sentence)
    return whole + ([" ".join(kept)] if kept else [])


def stream_check(server: Server, s: ProbeSettings) -> Row:
    body = s.request([user(STREAM_PROMPT)], s.max_tokens)
    whole, streamed = server.chat(body), server.chat(body, stream=True)
    problems = []
    if streamed.content != whole.content:
        problems.append("streamed and whole replies " + first_difference(streamed.content, whole.content))
    if streamed.finish_reason != whole.finish_reason:
        problems.append(f"finish_reason {streamed.finish_reason!r} streamed, {whole.finish_reason!r} whole")
    if not streamed.done:
        problems.append("the stream ended without data: [DONE]")
    detail = "; ".join(problems) or (f"{len(whole.content)} characters in {streamed.pieces} pieces, "
                                     f"finish_reason {whole.finish_reason}")
    return Row("stream", not problems, detail, measured={"replies": [whole.content, streamed.content]})


def repeat_check(server: Server, s: ProbeSettings) -> Row:
    body = s.request([user(REPEAT_PROMPT)], s.max_tokens)
    first, second = server.chat(body).content, server.chat(body).content
    same = first == second
    detail = f"{len(first)} characters, twice the same" if same else "the two replies " + first_difference(first, second)
    return Row("repeat", same, detail, measured={"replies": [first, second]})


def parked_check(server: Server, s: ProbeSettings) -> Row:
    def opening(i: int) -> list[dict]:  # conversation i's first turn; A is 0
        rng = np.random.default_rng([s.seed, PARKED, i])
        return [user(SEP.join(filler_paragraphs(rng, s.parked_words) + [SUMMARY_QUESTION]))]

    a = s.request(opening(0), s.max_tokens)
    first = server.chat(a).content
    turns = {i: opening(i) for i in range(1, s.others + 1)}
    replies = {i: server.chat(s.request(turn, s.max_tokens)).content for i, turn in turns.items()}
    # every other conversation comes back for a second turn once all have run, so a
    # conversation cache parks it, then restores it over another conversation's cells
    two_turn = list(turns)[::2]
    for i in two_turn:
        server.chat(s.request(turns[i] + [assistant(replies[i]), user(FOLLOW_UP)], s.max_tokens))
    again = server.chat(a).content
    others = f"{s.others} other conversation{'s' if s.others > 1 else ''} ({len(two_turn)} two-turn)"
    detail = (f"{s.parked_words}-word conversation the same after {others}" if first == again
              else f"the replies before and after {others} " + first_difference(first, again))
    return Row("repeat after others", first == again, detail, measured={"replies": [first, again]})


def needle_check(server: Server, s: ProbeSettings) -> Row:
    rng = np.random.default_rng([s.seed, NEEDLE])
    planted = fact(rng)
    paragraphs = filler_paragraphs(rng, s.needle_words)
    middle = len(paragraphs) // 2
    prompt = SEP.join(paragraphs[:middle] + [planted.text] + paragraphs[middle:] + [planted.question])
    reply = server.chat(s.request([user(prompt)], s.max_tokens)).content
    found = planted.found(reply)
    detail = (f"{planted.answer!r} found, planted in the middle of {s.needle_words} words" if found
              else f"the reply {reply[:60]!r} lacks {planted.answer!r} ({planted.text!r} was planted "
                   f"in the middle of {s.needle_words} words)")
    return Row("needle", found, detail, measured={"fact": planted.text, "answer": planted.answer, "reply": reply})


def repetition_check(server: Server, s: ProbeSettings) -> Row:
    reply = server.chat(s.request([user(FREE_PROMPT)], s.free_tokens)).content
    words = reply.split()  # a remote server's tokens are unknown; its words are not
    repetition, loop = repetition_score(words), loop_score(words)
    healthy = loop <= DEGENERATE
    detail = f"repetition_score {repetition:.2f}, loop_score {loop:.2f} over {len(words)} words"
    if not healthy:
        detail += f"; degenerate: loop_score above {DEGENERATE}"
    return Row("repetition", healthy, detail,
               measured={"repetition_score": repetition, "loop_score": loop, "words": len(words), "reply": reply})


def ttft_check(server: Server, s: ProbeSettings) -> Row:
    rng = np.random.default_rng([s.seed, TTFT])
    opening = SEP.join(filler_paragraphs(rng, s.ttft) + [SUMMARY_QUESTION])
    reply = server.chat(s.request([user(opening)], s.max_tokens)).content
    follow_up = [user(opening), assistant(reply), user(FOLLOW_UP)]
    cached, uncached, usage = [], [], None
    for run in range(s.ttft_runs):
        timed = server.chat(s.request(follow_up, s.max_tokens) | INCLUDE_USAGE, stream=True)
        cached.append(timed.first_token_s)
        usage = usage or timed.usage  # the first follow-up's: the one a real client's second turn is
        # a first word of its own each run: a twin sent before would be cached by now
        twin = [user(f"Twin{run + 1} " + opening.split(" ", 1)[1])] + follow_up[1:]
        uncached.append(server.chat(s.request(twin, s.max_tokens) | INCLUDE_USAGE, stream=True).first_token_s)
    median_cached, median_uncached = statistics.median(cached), statistics.median(uncached)
    ratio = median_uncached / median_cached
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached_tokens, prompt_tokens = details.get("cached_tokens"), (usage or {}).get("prompt_tokens")
    detail = (f"follow-up {1e3 * median_cached:.0f} ms, its uncached twin {1e3 * median_uncached:.0f} ms "
              f"(medians of {s.ttft_runs}, after a {s.ttft}-word turn); "
              + (f"cached_tokens {cached_tokens} of {prompt_tokens}" if cached_tokens is not None
                 else "the server reports no cached_tokens"))
    return Row("ttft", None, detail, figure=f"{ratio:.1f}x",
               measured={"ttft_cached_s": cached, "ttft_uncached_s": uncached, "median_cached_s": median_cached,
                         "median_uncached_s": median_uncached, "ratio": ratio, "cached_tokens": cached_tokens,
                         "prompt_tokens": prompt_tokens})


def rate_check(server: Server, s: ProbeSettings) -> Row:
    """The streamed pieces' rate as the client receives them. Against a server whose
    /metrics reports its engine's own steady decode rate (ours), the difference is the
    server's cost per token: HTTP, the event loop and the queue between them."""
    reply = server.chat(s.request([user(FREE_PROMPT)], s.rate), stream=True)
    times = reply.piece_s[RATE_SKIP - 1:]
    if len(times) < 2:
        return Row("rate", False, f"only {reply.pieces} pieces came: too few to time")
    client = (len(times) - 1) / (times[-1] - times[0])
    measured = {"client_pieces_per_s": client, "pieces": reply.pieces}
    detail = f"{reply.pieces} pieces, {client:.1f} a second at the client after the first {RATE_SKIP}"
    engine = server.metric("strata_nb_last_decode_tokens_per_second")
    if engine:
        overhead = engine / client - 1  # the share of the engine's time a token spends on top of it
        measured |= {"engine_tokens_per_s": engine, "overhead": overhead}
        detail += f"; the engine's steady rate {engine:.1f} tokens a second: {100 * overhead:+.1f}% a token"
    return Row("rate", None, detail, figure=f"{client:.1f}/s", measured=measured)


def run(server: Server, s: ProbeSettings) -> dict:
    """Every check that `s` asks for, in order; passed: no check failed."""
    s = replace(s, model=s.model or default_model(server))
    rows = [stream_check(server, s), repeat_check(server, s)]
    if s.parked:
        rows.append(parked_check(server, s))
    rows += [needle_check(server, s), repetition_check(server, s)]
    if s.ttft is not None:
        rows.append(ttft_check(server, s))
    if s.rate is not None:
        rows.append(rate_check(server, s))
    return {"url": server.url, "model": s.model, "settings": asdict(s),
            "passed": all(r.passed is not False for r in rows), "checks": [r.as_json() for r in rows]}


def table(result: dict) -> str:
    checks = result["checks"]
    failed = [c["check"] for c in checks if c["passed"] is False]
    judged = sum(c["passed"] is not None for c in checks)
    lines = [f"{result['url']}, model {result['model']}, temperature 0, seed {result['settings']['seed']}", "",
             "| check | result | detail |", "| --- | --- | --- |"]
    cell = lambda text: text.replace("|", "\\|")  # a reply quoted in a detail may hold the column bar
    lines += [f"| {c['check']} | {c['result']} | {cell(c['detail'])} |" for c in checks]
    lines += ["", f"{len(failed)} of {judged} checks failed: {', '.join(failed)}" if failed
              else f"all {judged} checks passed"]
    return "\n".join(lines)
