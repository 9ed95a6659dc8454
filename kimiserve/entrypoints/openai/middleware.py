"""ASGI middleware of the server: the API-key check and the X-Request-Id header."""

from __future__ import annotations

import hmac
import re
import uuid

from kimiserve.entrypoints.openai.errors import OpenAIError

GUARDED_PATHS = ("/reset_prefix_cache",)
"""Routes outside /v1 that change the server's state: they need the API key too."""
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,256}")
"""A client's X-Request-Id is echoed when it is 1 to 256 visible ASCII characters; else one is made."""


class APIKeyMiddleware:
    """401 for /v1 routes (and GUARDED_PATHS) without the key, sent as `Authorization: Bearer <key>`
    (OpenAI clients, as vLLM checks it) or `x-api-key: <key>` (Anthropic clients); the error is in
    the Anthropic shape on /v1/messages, else in the OpenAI shape."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
        return bearer_ok or key_ok

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (
                scope["path"].startswith("/v1") or scope["path"] in GUARDED_PATHS):
            if not self._authorized(dict(scope["headers"])):
                error = OpenAIError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>' "
                                    "or 'x-api-key: <key>'", 401, None, "invalid_api_key")
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Every HTTP response carries `X-Request-Id`: the client's (when it sent a usable one), else a
    new uuid4 hex; the handlers find it in `scope["state"]["request_id"]`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER)
        request_id = given if given is not None and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode("ascii")

        def send_with_id(message):  # returns send's own awaitable: no coroutine of ours between a
            # handler's send and uvicorn's (the stream send timeout cancels that await; through a wrapping
            # coroutine the cut stream ended in uvicorn's "ASGI callable returned without completing response")
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": headers + [(REQUEST_ID_HEADER, request_id)]}
            return send(message)

        await self.app(scope, receive, send_with_id)
