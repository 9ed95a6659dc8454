"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

`OpenAIError` is raised anywhere in request handling and turned into a JSON response at the
edge; `from_value_error` maps the library's ValueErrors (SamplingParams, the tokenizer's
message checks, the engine) to 400s, reading the field at fault from the message.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         422: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's error types by status (the Messages API's error shape)."""


def is_anthropic_path(path: str) -> bool:
    """Routes that answer errors in the Anthropic shape: /v1/messages and below."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def to_json(data: Any) -> str:
    """JSON text that can always go out as UTF-8: a lone surrogate (JSON input may carry one, e.g. an
    echoed prompt or a model name "\\ud800") cannot, so then non-ASCII characters are escaped."""
    text = json.dumps(data, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data)
    return text


class JSONResponse(_JSONResponse):
    """starlette's JSONResponse, but a body with a lone surrogate is sent escaped instead of raising."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | int | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = status if code is None else code
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The JSON response; in the Anthropic shape when `path` is one of its routes."""
        body = self.anthropic_body() if path is not None and is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status)

    def sse(self) -> str:
        """The error as one server-sent event (for errors after a stream has started)."""
        return f"data: {to_json(self.body())}\n\n"


# "top_p must be ...", "messages[0].role: unknown ...", "stop_token_ids must be ... at stop_token_ids[2]"
_FIELD_FIRST = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\]|\.[a-z_][a-z0-9_]*)*)(?::| must | is | has )")
_PROMPT_INDEX = re.compile(r"^prompt (\d+): ")


def from_value_error(exc: ValueError, rename: dict[str, str] | None = None) -> OpenAIError:
    """A 400 for a library ValueError; `param` is the field the message starts with (renamed by
    `rename`, e.g. the engine's max_tokens -> the request's max_completion_tokens)."""
    message = str(exc)
    match = _FIELD_FIRST.match(message)
    param = match.group(1) if match else None
    at = re.search(r" at ([a-z_]+(?:\[\d+\])+)$", message)
    if param is not None and at is not None and at.group(1).startswith(param + "["):
        param = at.group(1)  # "stop_token_ids must be ... at stop_token_ids[2]"
    if param is not None:
        head = re.split(r"[\[.]", param, maxsplit=1)[0]
        if rename and head in rename:
            param = rename[head] + param[len(head):]
    if param is None and message.startswith("prompt"):
        param = "prompt"
    return OpenAIError(message, 400, param)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|bytes|is-instance|function-.*|lax-.*|strict-.*|"
                       r".*\[.*\]|[A-Z].*)$")


def loc_to_param(loc: tuple) -> str | None:
    """pydantic's error location -> `messages[0].role`, dropping 'body' and union member tags."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _TYPE_TAG.match(str(part)):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body", 400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return OpenAIError(f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", 400)
    if tuple(first.get("loc", ())) in (("body",), ()):
        return OpenAIError("the request body must be a JSON object (sent with Content-Type: application/json)", 400)
    param = loc_to_param(tuple(first.get("loc", ())))
    seen, parts = set(), []
    for err in errors:
        p = loc_to_param(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if (p, msg) in seen:
            continue
        seen.add((p, msg))
        parts.append(f"{p}: {msg}" if p else msg)
    if len(parts) > 4:
        parts = parts[:4] + [f"... ({len(parts) - 4} more)"]
    return OpenAIError("; ".join(parts), 400, param)
