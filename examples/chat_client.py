"""A chat client for `strata-nb serve` (or any OpenAI-compatible server), standard library only.

It streams a first turn, then sends a follow-up that extends the conversation: the
server's conversation cache restores the first turn's cells, and the reply's usage says
how many prompt tokens it did not run again (`cached_tokens`). Without --url it starts
a server in this process on the default model (the numpy backend, a 2,048-token context).

    python examples/chat_client.py [--url http://127.0.0.1:8000] [--max-tokens 24]
"""
import argparse
import http.client
import json
import time
from importlib import resources
from urllib.parse import urlsplit

ap = argparse.ArgumentParser()
ap.add_argument("--url", default=None, help="a running server; default: start one here")
ap.add_argument("--max-tokens", type=int, default=24)
args = ap.parse_args()

server = None
if args.url is None:
    from strata_nb import Engine
    from strata_nb.serve.app import Running, create_app

    eng = Engine.load(device="cpu", max_context=2048, prefill_chunk=64)
    server = Running(create_app(eng, "default", conversation_cache_mib=256))
    args.url = server.url


def chat(messages: list[dict]) -> tuple[str, dict, float]:
    """Stream one reply: its text, its usage, and the time to its first text."""
    u = urlsplit(args.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = dict(messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
                stream_options=dict(include_usage=True))
    t0, first, text, usage = time.perf_counter(), None, [], None
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise SystemExit(f"the server answered {reply.status}: {json.loads(reply.read())['error']['message']}")
    for line in reply:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        for choice in event["choices"]:
            piece = choice["delta"].get("content", "")
            if piece:
                first = first or time.perf_counter()
                print(piece, end="", flush=True)
                text.append(piece)
        usage = event.get("usage") or usage
    conn.close()
    print()
    return "".join(text), usage, (first or time.perf_counter()) - t0


document = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
turn = [{"role": "user", "content": document[:2500] + "\n\nWhat is this text about?"}]
answer, usage, ttft = chat(turn)
print(f"turn 1: {usage['prompt_tokens']} prompt tokens, "
      f"{usage['prompt_tokens_details']['cached_tokens']} cached, first text after {ttft:.2f} s\n")

turn += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Name one detail from it."}]
answer, usage, ttft = chat(turn)
print(f"turn 2: {usage['prompt_tokens']} prompt tokens, "
      f"{usage['prompt_tokens_details']['cached_tokens']} cached, first text after {ttft:.2f} s")

u = urlsplit(args.url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
conn.request("GET", "/metrics")
for line in conn.getresponse().read().decode().splitlines():
    if line.startswith(("strata_nb_cached_tokens_total", "strata_nb_conversation_cache_conversations")):
        print(line)
if server is not None:
    server.stop()
