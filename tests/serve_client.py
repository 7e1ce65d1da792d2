"""A small OpenAI-style client for the server tests: a whole reply, or a streamed one."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def connect(url: str, timeout: float = 120) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def post(url: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    """-> (status, the JSON body)."""
    conn = connect(url)
    try:
        conn.request("POST", path, raw if raw is not None else json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def get(url: str, path: str) -> tuple[int, str]:
    conn = connect(url)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def events(url: str, path: str, body):
    """The streamed reply's events, one parsed `data:` object at a time (then "[DONE]")."""
    conn = connect(url)
    try:
        conn.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        while line := r.readline():
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                yield data if data == "[DONE]" else json.loads(data)
    finally:
        conn.close()


def chat(url: str, body) -> dict:
    """A chat reply's content, finish reason and usage, streamed or not as body says."""
    if not body.get("stream"):
        status, out = post(url, "/v1/chat/completions", body)
        assert status == 200, out
        c = out["choices"][0]
        return dict(content=c["message"]["content"], finish_reason=c["finish_reason"], usage=out["usage"])
    text, finish, usage = [], None, None
    for e in events(url, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}):
        if e == "[DONE]":
            break
        assert "error" not in e, e
        for c in e["choices"]:
            text.append(c["delta"].get("content", ""))
            finish = c["finish_reason"] or finish
        usage = e.get("usage") or usage
    return dict(content="".join(text), finish_reason=finish, usage=usage)
