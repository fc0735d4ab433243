"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM, run by uvicorn.

Reliability rules (DESIGN.md section 4): every error answers OpenAI's error
body with the right status; a client that goes away aborts its request (a
stream is cancelled by Starlette, a plain request by `_until_disconnect`); a
dead engine core turns /health to 503 and fails requests at once, and the
supervisor (`supervisor.py`) starts a new one; SIGTERM stops accepting
connections, lets in-flight requests finish for up to `--shutdown-timeout`
seconds, then stops the engine core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.arg_utils import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    engine_args_from,
)
from jaxllm.entrypoints.openai.chat_tools import ToolSettings
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_engine import HTTPError, error_body
from jaxllm.entrypoints.openai.serving_info import add_info_routes, add_tokenizer_routes
from jaxllm.entrypoints.openai.serving_lora import LoRARegistry, add_lora_routes
from jaxllm.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    ResponseStore,
    add_responses_routes,
)
from jaxllm.entrypoints.openai.serving_score import OpenAIServingScore, add_pooling_routes
from jaxllm.entrypoints.openai.supervisor import DEFAULT_ENGINE_RESTARTS, EngineSupervisor
from jaxllm.errors import EngineDeadError, ParameterError
from jaxllm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

logger = logging.getLogger("jaxllm.api_server")



@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    chat_template: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_stats_interval: float = 10.0
    log_stats: bool = True
    shutdown_timeout: float = 30.0
    uvicorn_log_level: str = "info"
    access_log: bool = True
    enable_tokenizer_info_endpoint: bool = False
    engine_restarts: int = DEFAULT_ENGINE_RESTARTS  # 0: exit when the engine core dies
    tools: ToolSettings = field(default_factory=ToolSettings)
    lora_modules: list[str] = field(default_factory=list)  # vLLM's `name=path` entries
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE  # 0: /v1/responses keeps none


def error_response(status: int, message: str, param: str | None = None) -> Response:
    # ASCII-escaped: an error that quotes the client's text can always be sent.
    body = json.dumps(error_body(status, message, param).model_dump(), ensure_ascii=True)
    return Response(body, status_code=status, media_type="application/json")


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException, so that FastAPI's body reader passes it through untouched."""


class GuardMiddleware:
    """API-key check on the API's routes (vLLM's /v1, and the pooling routes outside it:
    compute is never open) and a cap on the request body size (pure ASGI)."""

    PROTECTED = ("/v1", "/v2", "/score", "/rerank", "/classify")

    def __init__(self, app: Any, api_key: str | None, max_bytes: int):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"].startswith(self.PROTECTED) \
                and scope.get("method") != "OPTIONS" \
                and not self._authorized(headers.get(b"authorization", b"")):
            resp = error_response(401, "Invalid or missing API key "
                                  "(send 'Authorization: Bearer <key>').")
            return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(413)
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, header: bytes) -> bool:
        """'Bearer KEY', the scheme in any case; the key compared in constant time."""
        scheme, _, key = header.strip().partition(b" ")
        assert self.expected is not None
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        resp = error_response(413, f"the request body is larger than {self.max_bytes} bytes")
        await resp(scope, receive, send)


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Runs `work`, cancelling it (and so aborting its requests) if the client leaves."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)  # nobody reads it; the client is gone


def _validation_param(err: dict) -> str | None:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union-member tags such as 'str' or 'list[int]'.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    return ".".join(loc) or None


def build_app(engine: AsyncLLM, options: ServerOptions,
              prometheus: PrometheusStatLogger) -> FastAPI:
    names = options.served_model_names or [engine.model_config.served_model_name]
    completion = OpenAIServingCompletion(engine, names, options.chat_template)
    chat = OpenAIServingChat(engine, names, options.chat_template, tool_settings=options.tools)
    responses = OpenAIServingResponses(engine, names, options.chat_template,
                                       tool_settings=options.tools,
                                       store=ResponseStore(options.responses_store_size)
                                       if options.responses_store_size > 0 else None)
    pooling = OpenAIServingScore(engine, names)
    loras = LoRARegistry(engine.config.lora_config, options.lora_modules)
    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _validation_param(first)
        msg = first.get("msg", "invalid request")
        return error_response(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(ParameterError)
    async def on_parameter_error(_: Request, exc: ParameterError) -> Response:
        return error_response(400, str(exc), exc.field)

    @app.exception_handler(HTTPError)
    async def on_http_error(_: Request, exc: HTTPError) -> Response:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(503, f"the engine is not running: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413:
            return error_response(413, f"the request body is larger than "
                                  f"{options.max_request_bytes} bytes")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(503, f"the engine is not running: {engine.dead_error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus.expose(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> ModelList:
        mc = engine.model_config
        return ModelList(data=[ModelCard(id=n, root=mc.model, max_model_len=mc.max_model_len)
                               for n in names] + loras.model_cards(names[0]))

    add_lora_routes(app, loras, [completion, chat, responses])
    add_info_routes(app, engine, completion.check_model, options.chat_template,
                    options.enable_tokenizer_info_endpoint)

    def respond(result: Any) -> Response:
        if isinstance(result, AsyncIterator):
            return StreamingResponse(result, media_type="text/event-stream")
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return Response(json.dumps(result), media_type="application/json")
        return Response(result.model_dump_json(), media_type="application/json")

    async def generate(api: str, body: Any, raw: Request, create: Any) -> Response:
        """A generation API's answer: a stream, or the whole answer unless the client
        leaves first."""
        if "generate" not in engine.model_config.supported_tasks:
            raise HTTPError(400, f"The model does not support {api} API (it is a pooling "
                            "model: use /v1/embeddings, /classify or /score)", "model")
        if body.stream:
            return respond(await create(body))
        return respond(await _until_disconnect(raw, create(body)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await generate("Completions", body, raw, completion.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await generate("Chat Completions", body, raw, chat.create_chat_completion)

    add_pooling_routes(app, pooling, respond, _until_disconnect)

    add_tokenizer_routes(app, engine, chat)
    add_responses_routes(app, responses, respond, generate)

    app.add_middleware(GuardMiddleware, api_key=options.api_key,  # type: ignore[arg-type]
                       max_bytes=options.max_request_bytes)
    return app


def load_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself."""
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError:
        if any(c in value for c in "{}%"):
            return value
        raise ParameterError("chat_template", f"no file at {value!r} and not a Jinja "
                             "template") from None


async def serve(engine: AsyncLLM, options: ServerOptions, ready: Any = None) -> int:
    """Runs uvicorn until SIGINT/SIGTERM; then drains and stops the engine core.

    Returns the exit status: 1 when the engine core died for good, else 0."""
    import uvicorn

    prometheus = PrometheusStatLogger(options.served_model_names[0]
                                      if options.served_model_names
                                      else engine.model_config.served_model_name,
                                      num_engines=engine.config.parallel_config
                                      .data_parallel_size)
    log_stats = LoggingStatLogger(options.log_stats_interval)
    engine.stat_loggers.append(prometheus)
    if options.log_stats:
        engine.stat_loggers.append(log_stats)
    app = build_app(engine, options, prometheus)

    async def log_periodically() -> None:
        while True:
            await asyncio.sleep(options.log_stats_interval)
            log_stats.log()

    config = uvicorn.Config(app, host=options.host, port=options.port,
                            log_level=options.uvicorn_log_level, access_log=options.access_log,
                            timeout_graceful_shutdown=options.shutdown_timeout, lifespan="off",
                            timeout_keep_alive=5)
    server = uvicorn.Server(config)
    stat_task = asyncio.ensure_future(log_periodically()) if options.log_stats else None
    status = 0

    def give_up() -> None:
        nonlocal status
        status = 1
        server.should_exit = True

    supervisor = asyncio.ensure_future(
        EngineSupervisor(engine, options.engine_restarts, give_up).run())
    engine.start()
    try:
        await server.serve()
    finally:
        supervisor.cancel()
        if stat_task is not None:
            stat_task.cancel()
        if engine.num_unfinished_requests:
            logger.info("failing %d unfinished requests", engine.num_unfinished_requests)
        engine.shutdown()
        logger.info("server stopped")
    return status


def _exit_on_sigterm(*_: Any) -> None:
    raise SystemExit(0)


def run_server(args: argparse.Namespace) -> int:
    """`jaxllm serve`: build the engine (in its own process) and serve until a signal."""
    engine_args = engine_args_from(args)
    options = ServerOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_names=[args.served_model_name] if args.served_model_name else [],
        chat_template=load_chat_template(args.chat_template),
        max_request_bytes=args.max_request_bytes, log_stats_interval=args.log_stats_interval,
        log_stats=not args.disable_log_stats, shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        engine_restarts=0 if args.exit_on_engine_death else args.engine_restarts,
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
        lora_modules=list(args.lora_modules or []),
        responses_store_size=args.responses_store_size)
    # SamplingParams reads the bound on n (and best_of) here, as vLLM reads
    # VLLM_MAX_N_SEQUENCES; the engine core's process inherits it.
    os.environ["JAXLLM_MAX_N_SEQUENCES"] = str(args.max_n_sequences)
    logger.info("jaxllm %s serving %s", jaxllm.__version__,
                json.dumps({k: v for k, v in vars(engine_args).items() if v is not None},
                           default=str))
    # uvicorn re-raises the SIGTERM it caught once its graceful stop is done: exit cleanly.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    async def main() -> int:
        engine = AsyncLLM.from_engine_args(engine_args)
        return await serve(engine, options)

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0
