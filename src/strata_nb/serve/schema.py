"""The request bodies the server takes, checked field by field (pydantic), and the
OpenAI-style error object a bad one gets back.

A field the server does not know is an error, not silently ignored: a client that sends
`presence_penalty` expecting it to act should hear that it does not. Numbers and switches
take JSON numbers and booleans only (`strict`; a float field takes an integer too):
`"max_tokens": true`, `"temperature": "0.5"` or `"stream": "yes"` is a mistake to report,
not a value to guess.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Strict):
    include_usage: bool = Field(False, strict=True)


class Sampling(Strict):
    """The fields chat and text completions share."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, strict=True)  # None: up to the end of the context
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(0, ge=0, strict=True)  # 0 = off (llama.cpp's extension; OpenAI has none)
    seed: int | None = Field(None, ge=0, strict=True)  # numpy seeds are non-negative
    stop: str | list[str] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one engine, one reply per request
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 stop strings, none empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)  # OpenAI's newer name for max_tokens


class CompletionRequest(Sampling):
    prompt: str = Field(min_length=1)


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors -> one message and the first field it names."""
    parts, param = [], None
    for e in errors:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or where or None
        kind = e.get("type", "")
        if kind == "extra_forbidden":
            parts.append(f"unknown field '{where}'")
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    return "; ".join(parts) or "invalid request", param
