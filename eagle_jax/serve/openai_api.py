"""The OpenAI wire format: request validation and response/chunk bodies.

`parse_chat` and `parse_completion` turn a decoded JSON body into a `GenRequest` or raise
`APIError` (HTTP status + OpenAI-shaped `{"error": {"message", "type", "param", "code"}}` naming the
field). Nothing here touches the model: token counts and context checks happen in `server.py`,
which knows the tokenizer and the cache.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any, Optional

MAX_STOP = 4
ROLES = ("system", "user", "assistant", "developer")
# Fields that would change the output distribution in ways we do not implement: refuse, never ignore.
UNSUPPORTED_NONZERO = ("presence_penalty", "frequency_penalty")
UNSUPPORTED_TRUTHY = ("logprobs", "top_logprobs", "echo", "best_of", "tools", "functions", "logit_bias",
                      "response_format", "suffix")
# ... except for the values that are OpenAI's own defaults, which change nothing: accepted.
NOOP_VALUES = {"best_of": 1, "response_format": {"type": "text"}}
MAX_TOP_K = 2 ** 31 - 1  # the device takes top_k as an int32


class APIError(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    model: Optional[str]
    messages: Optional[list] = None  # chat
    prompt: Optional[str | list[int]] = None  # completion: text or token ids
    max_tokens: Optional[int] = None
    max_tokens_param: str = "max_tokens"  # the field the client used (chat may say max_completion_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def decode_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, is_type, type_name: str, in_range, range_text: str):
    """body[name] (None when absent) after a type check and a range check, each naming the field."""
    v = body.get(name)
    if v is None:
        return None
    if not is_type(v):
        raise APIError(f"'{name}' must be {type_name}, got {json.dumps(v)}", name)
    if not in_range(v):
        raise APIError(f"'{name}' must be {range_text}, got {v}", name)
    return v


def _common(body: dict, kind: str) -> GenRequest:
    req = GenRequest(kind=kind, model=body.get("model"))
    if req.model is not None and not isinstance(req.model, str):
        raise APIError("'model' must be a string", "model")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise APIError(f"only n=1 is supported, got n={n!r}", "n")
    for f in UNSUPPORTED_NONZERO:
        v = body.get(f)
        if v is not None and (not _is_num(v) or v != 0):
            raise APIError(f"'{f}' is not supported (it would change the target's distribution); omit it or send 0", f)
    for f in UNSUPPORTED_TRUTHY:
        v = body.get(f)
        if f in NOOP_VALUES and type(v) is type(NOOP_VALUES[f]) and v == NOOP_VALUES[f]:
            continue
        if v not in (None, False, [], {}, "") and not (f == "logprobs" and v == 0):
            raise APIError(f"'{f}' is not supported by this server", f)

    mt_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    mt = body.get(mt_key)
    if mt is not None:
        if not _is_int(mt):
            raise APIError(f"'{mt_key}' must be an integer, got {json.dumps(mt)}", mt_key)
        if mt <= 0:
            raise APIError(f"'{mt_key}' must be at least 1, got {mt}", mt_key)
        req.max_tokens, req.max_tokens_param = mt, mt_key

    t = _field(body, "temperature", _is_num, "a number", lambda v: 0 <= v <= 2, "between 0 and 2")
    if t is not None:
        req.temperature = float(t)
    p = _field(body, "top_p", _is_num, "a number", lambda v: 0 < v <= 1, "in (0, 1]")
    if p is not None:
        req.top_p = float(p)
    k = _field(body, "top_k", _is_int, "an integer", lambda v: -1 <= v <= MAX_TOP_K,
               f"between 0 and {MAX_TOP_K} (0 or -1: off)")
    if k is not None:
        req.top_k = max(k, 0)
    s = body.get("seed")
    if s is not None:
        if not _is_int(s):
            raise APIError(f"'seed' must be an integer, got {json.dumps(s)}", "seed")
        req.seed = s % (2 ** 32)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise APIError("'stop' must be a string or a list of strings", "stop")
        if len(stops) > MAX_STOP:
            raise APIError(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
        req.stop = tuple(x for x in stops if x)
    st = body.get("stream", False)
    if st is not None and not isinstance(st, bool):
        raise APIError("'stream' must be a boolean", "stream")
    req.stream = bool(st)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise APIError("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
        req.include_usage = bool(so.get("include_usage", False))
    return req


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict) -> GenRequest:
    req = _common(body, "chat")
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise APIError("'messages' must be a list of {\"role\", \"content\"} objects", "messages")
    if not msgs:
        raise APIError("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                           f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)})
    req.messages = out
    return req


def parse_completion(body: dict) -> GenRequest:
    req = _common(body, "completion")
    p = body.get("prompt")
    if p is None:
        raise APIError("'prompt' is required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise APIError("'prompt' must not be empty", "prompt")
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        pass  # token ids; range-checked by the server
    elif isinstance(p, list) and not p:
        raise APIError("'prompt' must not be empty", "prompt")
    elif isinstance(p, list):
        raise APIError("batched prompts are not supported: send one prompt per request", "prompt")
    else:
        raise APIError("'prompt' must be a string or a list of token ids", "prompt")
    req.prompt = p
    return req


# -- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(kind: str, rid: str, model: str, text: str, finish: str, use: dict, extra: dict) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "eagle_jax": extra}


def chunk(kind: str, rid: str, model: str, created: int, text: Optional[str] = None, finish: Optional[str] = None,
          role: bool = False, use: Optional[dict] = None) -> dict:
    """One streamed chunk: a text delta, the final finish_reason, or (choices=[]) the usage."""
    if use is not None:
        choices: list[dict[str, Any]] = []
    elif kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
