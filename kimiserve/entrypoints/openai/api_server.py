"""The OpenAI-compatible HTTP server: `build_app(engine, server_args)` and `run_server(...)`.

Routes: GET/HEAD /health, GET/POST /ping, GET /version, /metrics, /v1/models, /v1/models/{id}; POST
/v1/completions, /v1/chat/completions, /v1/responses (GET/DELETE /v1/responses/{id}), /v1/messages,
/v1/messages/count_tokens, /tokenize, /detokenize, /reset_prefix_cache. Every error is a
JSON body in the OpenAI shape (the Anthropic shape under /v1/messages); every response carries an
X-Request-Id header.
The engine thread starts with the app (lifespan) and stops after uvicorn's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from contextlib import asynccontextmanager
from importlib import metadata

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.async_engine import DEAD_MESSAGE, AsyncLLMEngine, EngineDeadError
from kimiserve.utils.gc_heap import freeze_startup_heap
from kimiserve.entrypoints.openai.errors import JSONResponse, OpenAIError, from_validation_error, from_value_error
from kimiserve.entrypoints.openai.http_limits import BodyLimitMiddleware, h11_protocol_with_timeouts
from kimiserve.entrypoints.openai.metrics import ServerMetrics
from kimiserve.entrypoints.openai.middleware import APIKeyMiddleware, RequestIdMiddleware
from kimiserve.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from kimiserve.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from kimiserve.entrypoints.openai.protocol_messages import CountTokensRequest, MessagesRequest
from kimiserve.entrypoints.openai.protocol_responses import ResponsesRequest
from kimiserve.entrypoints.openai.response_store import ResponseStore
from kimiserve.entrypoints.openai.rl_routes import add_rl_routes
from kimiserve.entrypoints.openai.serving_completion import create_completion
from kimiserve.entrypoints.openai.serving_messages import count_tokens, create_message
from kimiserve.entrypoints.openai.serving_responses import create_response
from kimiserve.entrypoints.openai.serving_utils import CutStreamLogFilter, ServingContext, internal_error, now, token_str
from kimiserve.entrypoints.openai.server_args import ServerArgs

logger = logging.getLogger("kimiserve.server")


def version() -> str:
    try:
        return metadata.version("kimiserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response(request.url.path)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError):
        return from_value_error(exc).response(request.url.path)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return OpenAIError(str(exc), 503, None, "engine_dead").response(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect):
        # the client left (or was timed out, a 408) before its body was complete: nobody to answer
        return Response(status_code=499)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError):
        return OpenAIError("the request is nested too deeply", 400).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                            str(exc.detail))
        response = OpenAIError(message, exc.status_code).response(request.url.path)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def unhandled_error(request: Request, exc: Exception):
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return internal_error().response(request.url.path)


RESET_TIMEOUT_S = 60.0
"""How long POST /reset_prefix_cache waits for the engine thread to get to it between steps."""


def build_app(engine: AsyncLLMEngine, args: ServerArgs | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread runs while the app does (lifespan)."""
    args = args or ServerArgs()
    args.validate()
    names = list(args.served_model_name or [engine.engine.args.model])
    metrics = ServerMetrics(names[0])
    engine.observer = metrics
    metrics.attach(engine)
    ctx = ServingContext(engine, names, args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice,
                         args.enforce_tool_call_grammar, args.max_queued_output_bytes, args.stream_send_timeout)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            ctx.executor.shutdown(wait=False, cancel_futures=True)

    template = args.chat_template_text()
    if template is not None:
        if engine.engine.tokenizer is None:
            raise ValueError("chat_template needs a model with a tokenizer")
        engine.engine.tokenizer.set_chat_template(template)

    app = FastAPI(title="kimiserve", version=version(), lifespan=lifespan)
    app.state.serving = ctx
    app.state.metrics = metrics
    _install_error_handlers(app)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    # outside the API-key check: an oversized body is refused (413) before anything else
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    # added last, so it runs first: browsers' preflight requests carry no API key
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, refusals included, carries the id

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.errored or not engine.is_running:
            message = DEAD_MESSAGE if engine.errored else "the engine is not running"
            return OpenAIError(message, 503, None, "engine_dead").response()
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health check, as vLLM serves it
        return await health()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            freed = await asyncio.wait_for(engine.reset_prefix_cache(), RESET_TIMEOUT_S)
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), 503, None, "engine_dead") from exc
        except asyncio.TimeoutError:
            raise OpenAIError(f"the engine did not answer within {RESET_TIMEOUT_S:g} s", 503) from None
        return JSONResponse({"status": "ok", "freed_pages": freed})

    @app.get("/version")
    async def get_version():
        return {"version": version()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": now(), "owned_by": "kimiserve",
                "root": engine.engine.args.model, "parent": None, "max_model_len": engine.max_model_len}

    def lora_card(name: str) -> dict:
        adapter = engine.engine.lora.by_name.get(name) if engine.engine.lora is not None else None
        return {**model_card(name), "root": (adapter.path if adapter is not None else None) or name, "parent": names[0]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in names]
                + [lora_card(name) for name in engine.engine.lora_names() if name not in names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        name = ctx.check_model(model)
        return lora_card(name) if ctx.lora_of(name) is not None else model_card(name)

    add_rl_routes(app, engine, names)

    # request bodies are parsed by ctx.parse (off the event loop when large), so the routes take the
    # raw Request; openapi_extra keeps each body's schema in /openapi.json
    def body_schema(model) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, await ctx.parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, await ctx.parse(raw, ChatCompletionRequest), raw)

    responses = ResponseStore(args.responses_store_mib * 2**20)
    app.state.responses = responses

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def create_responses(raw: Request) -> Response:
        return await create_response(ctx, responses, await ctx.parse(raw, ResponsesRequest), raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return JSONResponse(responses.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def messages(raw: Request) -> Response:
        return await create_message(ctx, await ctx.parse(raw, MessagesRequest), raw)

    @app.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
    async def messages_count_tokens(raw: Request) -> Response:
        return await count_tokens(ctx, await ctx.parse(raw, CountTokensRequest))

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(raw: Request):
        req = await ctx.parse(raw, TokenizeRequest)
        ctx.check_model(req.model)
        tokenizer = ctx.need_tokenizer("/tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400, "prompt")

        def run() -> dict:
            if req.messages is not None:
                text = render_chat(ctx, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs)
            else:
                text = req.prompt
            tokens = tokenizer.encode(text)
            return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                    "token_strs": [token_str(tokenizer, t) for t in tokens] if req.return_token_strs else None}

        size = len(req.prompt) if req.prompt is not None else sum(len(m.text() or "") for m in req.messages)
        return JSONResponse(await ctx.maybe_blocking(size, run))

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(raw: Request):
        req = await ctx.parse(raw, DetokenizeRequest)
        ctx.check_model(req.model)
        tokenizer = ctx.need_tokenizer("/detokenize")
        for i, t in enumerate(req.tokens):
            if t >= tokenizer.vocab_size:
                raise OpenAIError(f"token id {t} is outside the vocabulary [0, {tokenizer.vocab_size})", 400,
                                  f"tokens[{i}]")
        return JSONResponse({"prompt": await ctx.maybe_blocking(len(req.tokens) * 4, tokenizer.decode, req.tokens)})

    return app


SHUTDOWN_MARGIN_S = 3.0
"""After --shutdown-timeout the engine stops; uvicorn cancels what is left this much later."""


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGTERM/SIGINT ends with a clean exit (code 0) after the graceful
    shutdown instead of re-raising the signal, and requests still running `grace` seconds into it
    end in the OpenAI shape: the engine stops, so streams get an error event and `data: [DONE]` and
    other requests a 503, instead of uvicorn cancelling their tasks (a bare 500, a cut stream)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine | None = None, grace: float = 0.0):
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        timer = None
        if self.engine is not None:
            timer = asyncio.get_running_loop().call_later(self.grace, self.engine.stop)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Load the model, serve until SIGTERM/SIGINT, then finish in-flight requests (up to
    `shutdown_timeout` seconds) and stop the engine. Returns the exit code."""
    server_args.validate()
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    print(engine.engine.cache_summary(), file=sys.stderr, flush=True)
    app = build_app(engine, server_args)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, lifespan="on",
                            http=h11_protocol_with_timeouts(server_args.header_read_timeout,
                                                            server_args.body_read_timeout),
                            log_level=server_args.uvicorn_log_level,
                            access_log=not server_args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=server_args.shutdown_timeout + SHUTDOWN_MARGIN_S)
    logging.getLogger("uvicorn.error").addFilter(CutStreamLogFilter())  # after Config set up uvicorn's logging
    server = _Server(config, engine, server_args.shutdown_timeout)

    def engine_died() -> None:  # the streams already got their error: shut down and exit non-zero
        logger.critical("the engine is dead: the server stops with exit code 1 so that its supervisor restarts it")
        server.should_exit = True

    engine.add_dead_callback(engine_died)
    freeze_startup_heap()
    server.run()
    return 0 if server.started and not engine.errored else 1
