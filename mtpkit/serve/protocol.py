"""OpenAI request validation and response shapes.

Bodies are checked by hand rather than through pydantic models: every refusal must be a 400
in OpenAI's error shape naming the parameter, with no silent coercion ("0.5" is not a
number, ``true`` is not an integer), and the checks read top to bottom like the docs.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from ..engine.sampling import SamplingError, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """A validated completion or chat request, before tokenization."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat
    params: SamplingParams
    max_tokens: int | None  # None: up to the context
    stream: bool
    include_usage: bool


def _no_constant(name: str):
    # Python's json reads NaN and Infinity, which JSON does not have.
    raise bad(f"the request body is not valid JSON: {name} is not a JSON number",
              code="invalid_json")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad("the request body is nested too deeply to read", code="invalid_json") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # Python's limit on integer-string conversion
        raise bad("the request body holds an integer too long to read (over 4300 digits)",
                  code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _number(body: dict, name: str, default: float | None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"invalid type for '{name}': expected a number, got {_kind(v)}", name)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):  # 1e400 reads as infinity
        raise bad(f"'{name}' must be a finite number, got {v}", name)
    return f


def _text(v: str, name: str) -> str:
    """``v``, or a 400 when it cannot be encoded (JSON's "\\ud800" gives a lone surrogate)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{name}' is not valid Unicode text: it holds a lone surrogate "
                  f"({v[e.start]!a}) at character {e.start}", name) from None
    return v


def _int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"invalid type for '{name}': expected an integer, got {_kind(v)}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"invalid type for '{name}': expected a boolean, got {_kind(v)}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("invalid type for 'stop': expected a string or an array of strings", "stop")
    return [_text(s, "stop") for s in v if s]


def _unsupported(body: dict, chat: bool) -> None:
    """Refuse options we would otherwise silently ignore (the client would get wrong output)."""
    n = _int(body, "n", 1)
    if n != 1:
        raise bad(f"'n' must be 1 (one choice per request is supported), got {n}", "n")
    if _int(body, "best_of", 1) != 1:
        raise bad("'best_of' is not supported; omit it or set it to 1", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise bad(f"'{name}' is not supported; omit it or set it to 0", name)
    if _number(body, "repetition_penalty", 1.0) != 1.0:
        raise bad("'repetition_penalty' is not supported; omit it or set it to 1",
                  "repetition_penalty")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    lp = body.get("logprobs")
    if lp not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad("log probabilities are not supported; omit 'logprobs'", "logprobs")
    if not chat:
        if _bool(body, "echo", False):
            raise bad("'echo' is not supported", "echo")
        if body.get("suffix"):
            raise bad("'suffix' is not supported", "suffix")
    else:
        for name in ("tools", "functions"):
            if body.get(name):
                raise bad(f"'{name}' (tool calling) is not supported", name)
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type", "text") != "text"):
            raise bad("only response_format {\"type\": \"text\"} is supported",
                      "response_format")


def _common(body: dict, chat: bool) -> tuple[SamplingParams, int | None, bool, bool]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"invalid type for 'model': expected a string, got {_kind(model)}", "model")
    if model is not None:
        _text(model, "model")
    _unsupported(body, chat)
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true",
                      "stream_options")
        if not isinstance(so, dict):
            raise bad(f"invalid type for 'stream_options': expected an object, got {_kind(so)}",
                      "stream_options")
        include_usage = _bool(so, "include_usage", False)
    max_tokens = _int(body, "max_tokens", None)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens)
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        raise bad(f"'{name}' must be at least 1, got {max_tokens}", name)
    top_k = _int(body, "top_k", 0)
    if top_k == -1:  # vLLM spells "no top-k" -1
        top_k = 0
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=top_k,
        max_tokens=max_tokens or 1,
        stop=_stop(body),
        seed=_int(body, "seed", None),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    try:
        params.validate()
    except SamplingError as e:
        param = str(e).split(" ", 1)[0]
        raise bad(str(e), param if param in body else None) from None
    return params, max_tokens, stream, include_usage


def parse_completion(body: dict) -> GenRequest:
    """Validate a /v1/completions body."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        if all(isinstance(t, list) for t in prompt) or all(isinstance(t, str) for t in prompt):
            raise bad("one prompt per request is supported; send a request for each", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string or an array of token ids (integers)", "prompt")
    elif not isinstance(prompt, str):
        raise bad(f"invalid type for 'prompt': expected a string or an array of token ids, "
                  f"got {_kind(prompt)}", "prompt")
    else:
        _text(prompt, "prompt")
    params, max_tokens, stream, usage = _common(body, chat=False)
    return GenRequest(False, body.get("model"), prompt, None, params, max_tokens, stream, usage)


def parse_chat(body: dict) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    params, max_tokens, stream, usage = _common(body, chat=True)
    return GenRequest(True, body.get("model"), None, clean, params, max_tokens, stream, usage)


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with 'role' and 'content', got {_kind(m)}",
                  where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                  f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}]: only text parts "
                          "({\"type\": \"text\", \"text\": ...}) are supported",
                          f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or an array of text parts, got "
                  f"{_kind(content)}", f"{where}.content")
    _text(content, f"{where}.content")
    if m.get("tool_calls"):
        raise bad(f"{where}: tool calls are not supported", f"{where}.tool_calls")
    out = {"role": role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = _text(m["name"], f"{where}.name")
    return out


# -- responses -------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    """A response id in OpenAI's style."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(chat: bool, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    """A non-streamed completion or chat completion."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": use}


def chunk(chat: bool, rid: str, created: int, model: str, text: str | None,
          finish: str | None = None, role: bool = False, with_usage: bool = False) -> dict:
    """One streamed chunk; ``text`` None gives the empty final delta."""
    if chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": created, "model": model, "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(chat: bool, rid: str, created: int, model: str, use: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use}


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
