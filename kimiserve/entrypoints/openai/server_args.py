"""Server arguments of `kimiserve serve`: one typed dataclass; the field docstrings are the CLI help.
Flags are named as `vllm serve` names them where the meaning is the same."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from kimiserve.entrypoints.openai.http_limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from kimiserve.utils.docs import field_docs

API_KEY_ENV = "KIMISERVE_API_KEY"
CHOICES = {
    "tool_call_parser": ("kimi_k2",),
    "reasoning_parser": ("kimi",),
    "uvicorn_log_level": ("critical", "error", "warning", "info", "debug", "trace"),
}


@dataclass
class ServerArgs:
    host: str = "0.0.0.0"
    """Address to listen on (0.0.0.0: every interface, as vLLM)."""
    port: int = 8000
    """Port to listen on."""
    served_model_name: list[str] | None = None
    """Model name(s) the API answers to (the first is reported in responses); default: --model."""
    api_key: str | None = None
    """If set, every /v1 route and POST /reset_prefix_cache need `Authorization: Bearer <key>` or
    `x-api-key: <key>` (default: the KIMISERVE_API_KEY environment variable)."""
    tool_call_parser: str | None = None
    """Parse tool calls out of chat output: kimi_k2."""
    reasoning_parser: str | None = None
    """Return <think> reasoning as reasoning_content: kimi."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice "auto" (the model decides whether to call tools); needs --tool-call-parser."""
    enforce_tool_call_grammar: bool = False
    """Under tool_choice "auto", once the model opens a tool-call section, constrain it with the grammar
    of the declared tools' JSON schemas (as "required" and named calls always are), so every call it
    makes parses and its arguments validate. Needs the llguidance package."""
    shutdown_timeout: float = 10.0
    """Seconds to let in-flight requests finish after SIGTERM/SIGINT; then the engine stops and they end
    with an error (an error event in a stream, else a 503)."""
    chat_template: str | None = None
    """A Jinja chat template to use instead of the tokenizer's: a file path, or the template text itself."""
    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    """Origins browsers may call the API from (CORS; "*": any, as vLLM's default)."""
    uvicorn_log_level: str = "info"
    """uvicorn's log level."""
    disable_uvicorn_access_log: bool = False
    """Do not log each HTTP request."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Largest request body accepted (bytes; 0: no limit); a larger one is answered 413 before it is
    read. 16 MiB holds a 1M-token context as JSON text or token ids."""
    header_read_timeout: float = 30.0
    """Seconds a connection may take to send a request's headers (0: no limit); then it is closed."""
    body_read_timeout: float = 30.0
    """Seconds a request body may go without a byte arriving (0: no limit); then 408 and close."""
    max_queued_output_bytes: int = 16 * 2**20
    """Output one request may have generated but not yet sent, because its client does not read
    (estimated bytes); past it the request is aborted, its pages freed, and its stream ends with an
    error, so an unread stream costs bounded memory."""
    stream_send_timeout: float = 60.0
    """Seconds a stream may wait on a client that does not read before its connection is closed."""
    responses_store_mib: int = 256
    """Memory for the Responses API's stored responses (`store: true`, for previous_response_id and
    GET /v1/responses/{id}), in MiB of their JSON; the least recently used go first (0: keep none)."""

    def validate(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.enforce_tool_call_grammar and not self.enable_auto_tool_choice:
            raise ValueError("enforce_tool_call_grammar applies under tool_choice auto: it needs "
                             "--enable-auto-tool-choice --tool-call-parser kimi_k2")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser kimi_k2)")
        if isinstance(self.max_queued_output_bytes, bool) or not isinstance(self.max_queued_output_bytes, int) \
                or self.max_queued_output_bytes < 2**16:
            raise ValueError(f"max_queued_output_bytes must be an int >= 65536, got {self.max_queued_output_bytes!r}")
        if isinstance(self.max_request_body_bytes, bool) or not isinstance(self.max_request_body_bytes, int) \
                or self.max_request_body_bytes < 0:
            raise ValueError(f"max_request_body_bytes must be an int >= 0, got {self.max_request_body_bytes!r}")
        for name in ("header_read_timeout", "body_read_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        if isinstance(self.responses_store_mib, bool) or not isinstance(self.responses_store_mib, int) \
                or self.responses_store_mib < 0:
            raise ValueError(f"responses_store_mib must be an int >= 0, got {self.responses_store_mib!r}")
        if not self.stream_send_timeout > 0:
            raise ValueError(f"stream_send_timeout must be > 0, got {self.stream_send_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.served_model_name is not None and (not self.served_model_name or not all(self.served_model_name)):
            raise ValueError("served_model_name must be one or more non-empty names")
        if not self.allowed_origins or not all(self.allowed_origins):
            raise ValueError("allowed_origins must be one or more non-empty origins (\"*\" for any)")
        self.chat_template_text()  # a missing file fails here, before the model loads

    def chat_template_text(self) -> str | None:
        """--chat-template as template text: a file's contents, or the value itself when it looks like a
        template; ValueError for a path that does not exist."""
        value = self.chat_template
        if value is None or "{{" in value or "{%" in value:
            return value
        if not os.path.isfile(value):
            raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
        with open(value, encoding="utf-8") as f:
            return f.read()

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One --flag per field, help from the field docstrings."""
        docs = field_docs(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            kwargs = {"default": default, "help": docs[f.name]}
            if str(f.type) == "bool":
                parser.add_argument(flag, action="store_true", **kwargs)
            elif str(f.type).startswith("list["):
                parser.add_argument(flag, nargs="+", **kwargs)
            else:
                kind = {"int": int, "float": float}.get(str(f.type), str)
                parser.add_argument(flag, type=kind, choices=CHOICES.get(f.name), **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        out = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
        if out.api_key is None:
            out.api_key = os.environ.get(API_KEY_ENV) or None
        return out
