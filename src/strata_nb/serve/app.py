"""`strata-nb serve`: OpenAI-style chat and text completions over one engine.

The request path: a handler checks the body (schema.py), renders and tokenizes the
prompt, checks it fits the context, and queues a `Job` (worker.py). The worker runs jobs
one at a time: it asks the conversation cache (conversations.py) for the cells the prompt
shares with a parked conversation, generates, and parks the prompt's cells. Text pieces
come back through the job's queue, to a streamed (SSE) or a whole response.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..errors import StrataError
from ..settings import SamplingSettings
from .conversations import ConversationCache
from .metrics import prometheus
from .schema import ChatRequest, CompletionRequest, describe_validation, error_body
from .worker import EngineWorker, Job


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def create_app(engine, model_id: str, conversation_cache_mib: float = 0, conversation_fault: str = "none") -> FastAPI:
    # cells are reused in whole prompt chunks, or from any token where a prompt row's bytes
    # do not depend on its chunk (engine/prompt_chunk.py: rows alone)
    granule = 1 if engine.kv.rows_alone else engine.settings.prefill_chunk
    if conversation_cache_mib and any(L.ring for L in engine.kv.layers):
        # a sliding-window layer keeps only its ring, the cells of the latest positions: a
        # parked prefix's window is gone by the time a request would resume it
        print("strata-nb: the conversation cache is off: this model's sliding-window layers keep only their last "
              "cells, not a prefix's", file=sys.stderr)
        conversation_cache_mib = 0
    conversations = ConversationCache(engine.kv, granule, int(conversation_cache_mib * 2**20), conversation_fault)
    worker = EngineWorker(engine, conversations)
    served: dict = {}  # (endpoint, status) -> requests
    ids = itertools.count(1)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="strata-nb", lifespan=lifespan)
    app.state.worker = worker

    def count(endpoint: str, status: int):
        served[(endpoint, status)] = served.get((endpoint, status), 0) + 1

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        count(request.url.path, exc.status)
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

    def job_for(body, text: str) -> Job:
        """Tokenize, check the request against the model and the context, queue the job."""
        if body.model not in (None, model_id):
            raise BadRequest(404, f"the model '{body.model}' is not served here; this server serves '{model_id}'",
                             "model", "model_not_found")
        if engine.settings.spec and body.temperature != 0:
            raise BadRequest(400, "this server verifies drafts (--spec): it needs temperature 0", "temperature")
        prompt = engine.with_bos(engine.tokenize(text))
        context = engine.settings.max_context
        if len(prompt) >= context:
            raise BadRequest(400, f"the prompt is {len(prompt)} tokens; the context holds {context}, and at least one "
                                  "must be left for the reply", "messages", "context_length_exceeded")
        wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
        room = context - len(prompt)
        sampling = SamplingSettings(min(wanted or room, room), body.temperature, body.top_k, body.top_p, body.seed)
        job = Job(prompt, sampling, body.stop or [], asyncio.get_running_loop())
        worker.submit(job)
        return job

    def usage(done: dict) -> dict:
        return dict(prompt_tokens=done["prompt_tokens"], completion_tokens=done["completion_tokens"],
                    total_tokens=done["prompt_tokens"] + done["completion_tokens"],
                    prompt_tokens_details=dict(cached_tokens=done["cached_tokens"]))

    async def reply(job: Job, body, endpoint: str, chat: bool):
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish, first: bool = False) -> dict:
            if not chat:
                return dict(index=0, text=text or "", logprobs=None, finish_reason=finish)
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
            return dict(index=0, delta=delta, logprobs=None, finish_reason=finish)

        if body.stream:
            async def events():
                head = dict(id=rid, object=obj + ".chunk" if chat else obj, created=created, model=model_id)
                try:
                    if chat:
                        yield sse(head | dict(choices=[choice("", None, first=True)]))
                    while True:
                        kind, payload = await job.events.get()
                        if kind == "text":
                            yield sse(head | dict(choices=[choice(payload, None)]))
                        elif kind == "error":
                            yield sse(error_body(payload, kind="server_error"))
                            break
                        else:
                            yield sse(head | dict(choices=[choice(None, payload["finish_reason"])]))
                            if body.include_usage:
                                yield sse(head | dict(choices=[], usage=usage(payload)))
                            yield "data: [DONE]\n\n"
                            break
                finally:
                    job.cancel()  # the client left mid-stream (or the reply ended): free the engine

            count(endpoint, 200)
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text = []
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    text.append(payload)
                elif kind == "error":
                    count(endpoint, 500)
                    return JSONResponse(error_body(payload, kind="server_error"), status_code=500)
                else:
                    break
        finally:
            job.cancel()
        count(endpoint, 200)
        whole = "".join(text)
        c = (dict(index=0, message=dict(role="assistant", content=whole), logprobs=None,
                  finish_reason=payload["finish_reason"]) if chat else choice(whole, payload["finish_reason"]))
        return dict(id=rid, object=obj, created=created, model=model_id, choices=[c], usage=usage(payload))

    async def parse(request: Request, schema):
        """The body as `schema`, whatever its Content-Type says (curl -d sends a form type)."""
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise BadRequest(400, "the body must be a JSON object")
        try:
            return schema.model_validate(obj)
        except ValidationError as e:
            message, param = describe_validation(e.errors())
            raise BadRequest(400, message, param) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        if not engine.tokenizer.chat_template:
            raise BadRequest(400, f"the model '{model_id}' has no chat template (a base model): it serves "
                                  "/v1/completions, not chat", "messages", "model_not_chat")
        try:
            text = engine.tokenizer.render_chat([dict(role=m.role, content=m.text()) for m in body.messages])
        except StrataError as e:
            raise BadRequest(400, str(e), "messages") from None
        return await reply(job_for(body, text), body, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        return await reply(job_for(body, body.prompt), body, "/v1/completions", chat=False)

    @app.get("/v1/models")
    async def models():
        return dict(object="list", data=[dict(id=model_id, object="model", created=0, owned_by="strata-nb")])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(worker.totals, worker.depth, served),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        return dict(status="ok", queue_depth=worker.depth)

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: any free port), or a clear error."""
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except (OSError, OverflowError) as e:  # taken, not this machine's address, out of range
        raise StrataError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    return sock


def _server(app):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))


def serve_forever(app, sock: socket.socket):
    _server(app).run(sockets=[sock])


class Running:
    """A server on a thread of this process (the tests' and examples'): `url`, `stop()`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        sock = listen(host, port)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = _server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise StrataError("the server did not start")
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
