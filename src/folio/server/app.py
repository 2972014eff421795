"""The OpenAI-compatible HTTP server: routes, errors, auth, /metrics, /health.

The model loads in a thread after the server starts listening, so /health
answers 503 until it is ready. A failed load, or an engine loop that dies
later, is fatal: ServerState reports it once through `on_fatal`, and the CLI
ends the process with a non-zero status (an orchestrator then sees the failure
instead of an unhealthy process). Bad input is always a 400 in OpenAI's error
shape; 500 is kept for real internal faults (a request the engine failed
alone), since clients retry 5xx. The loaded engine is wrapped once in an
AsyncLLMEngine, and from then on the server sees only its EngineClient
interface (`engine/protocol.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException

from folio import __version__
from folio.engine.async_engine import AsyncLLMEngine
from folio.engine.protocol import EngineDeadError, RequestFailedError, default_model
from folio.errors import is_expected_error
from folio.server import openapi
from folio.server.chat import chat_prompt_ids, create_chat_completion
from folio.server.completions import create_completion
from folio.server.accounting import Accounting
from folio.server.cost import CostMeter
from folio.server.error_shape import error_body
from folio.server.metrics import ServerMetrics
from folio.server.embeddings import create_embedding, create_rerank, create_score
from folio.server.responses_api import ResponsesRequest, create_response
from folio.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   EmbeddingRequest, RerankRequest, ScoreRequest,
                                   TokenizeRequest, now)
from folio.server.responses import (ChatCompletionResponse, ChatCompletionStreamResponse,
                                    CompletionResponse, CompletionStreamResponse,
                                    DetokenizeResponse, EmbeddingResponse, ModelList,
                                    RerankResponse, ResponseObject, ResponseStreamEvent,
                                    ScoreResponse, TokenizeResponse, UsageReport,
                                    VersionResponse)
from folio.server.lora_routes import add_lora_routes, model_cards, register
from folio.server.router_routes import add_router_routes
from folio.server.serving import HTTPError, ServedModel, off_loop
from folio.server.tenants import KeyBook
from folio.server.tools import HermesParser, template_renders_tools
from folio.server.usage_ledger import UsageLedger
from folio.usage_report import usage_rows

logger = logging.getLogger("folio")
OPEN_PATHS = ("/health", "/metrics", "/get_load")
@dataclass
class ServerConfig:
    served_model_name: str
    served_model_aliases: list[str] = field(default_factory=list)   # other names it answers to
    sampling_defaults: dict = field(default_factory=dict)   # --generation-config's
    api_key: Optional[str] = None
    allowed_origins: list[str] = field(default_factory=list)
    drain_timeout: float = 30.0
    trust_request_chat_template: bool = False
    tool_call_parser: Optional[str] = None      # tool_choice "auto": whose call format
    reasoning_parser: Optional[str] = None      # <think> to reasoning_content: whose format
    api_keys_file: Optional[str] = None          # tenants, their keys and limits
    usage_db: Optional[str] = None               # the SQLite usage ledger
    cost_per_hour: Optional[float] = None        # dollars an hour the machine costs
    prompt_token_weight: float = 0.25            # a prompt token's share of an output token's cost
    max_tokens_default: Optional[int] = None     # a request's max_tokens when it gives none
    max_tokens_limit: Optional[int] = None       # the most a request may generate
    request_timeout: Optional[float] = None      # seconds a request may generate for
    lora_modules: list[tuple[str, str]] = field(default_factory=list)   # (name, path)
    # POST /v1/load_lora_adapter: off unless --enable-runtime-lora; paths only
    # inside these folders; at most this many loaded beside lora_modules
    runtime_lora: bool = False
    lora_roots: list[str] = field(default_factory=list)
    max_runtime_loras: int = 1
    # the largest request body taken (a 413 past it, before it is parsed);
    # `folio serve` sizes it from max_model_len (request_bytes_for)
    max_request_bytes: Optional[int] = 8 << 20

    def __post_init__(self) -> None:
        if self.max_tokens_default is not None and self.max_tokens_limit is not None and \
                self.max_tokens_default > self.max_tokens_limit:
            raise ValueError(f"--max-tokens-default ({self.max_tokens_default}) is above "
                             f"--max-tokens-limit ({self.max_tokens_limit})")


class ServerState:
    """The engine, once loaded; the metrics registry from the start; and `fatal`, why
    the server must stop (a failed load, a dead engine), told once to `on_fatal`."""

    def __init__(self, config: ServerConfig, load_engine: Callable,
                 on_fatal: Optional[Callable[[str], None]] = None):
        self.config = config
        cost = (CostMeter(config.cost_per_hour, config.prompt_token_weight)
                if config.cost_per_hour else None)
        self.metrics = ServerMetrics(config.served_model_name, cost)
        # a bad keys file or ledger path is the user's error, before anything loads
        keys = KeyBook.from_config(config.api_key, config.api_keys_file)
        ledger = UsageLedger(config.usage_db) if config.usage_db else None
        self.accounting = Accounting(config.served_model_name, self.metrics, keys, ledger, cost)
        self.served: Optional[ServedModel] = None
        self.load_error: Optional[BaseException] = None
        self.fatal: Optional[str] = None          # why the server must stop, once it must
        self._load_engine = load_engine
        self._on_fatal = on_fatal or (lambda message: logger.error("%s", message))

    def load(self) -> None:
        try:
            loaded = self._load_engine()
            if isinstance(loaded, AsyncLLMEngine):  # a client of a core in its own process
                loaded.start(on_step=self.metrics.on_step, on_dead=self._engine_died)
                engine = loaded
            else:
                engine = AsyncLLMEngine(loaded, on_step=self.metrics.on_step,
                                        on_dead=self._engine_died)
            try:
                engine.check_kv_cache()
            except ValueError:
                engine.shutdown()                   # tensor-parallel workers go too
                raise
            parser = HermesParser() if self.config.tool_call_parser == "hermes" else None
            self.served = ServedModel(engine, self.config.served_model_name,
                                      self.config.trust_request_chat_template, parser,
                                      self.accounting,
                                      reasoning_parser=self.config.reasoning_parser,
                                      max_tokens_default=self.config.max_tokens_default,
                                      max_tokens_limit=self.config.max_tokens_limit,
                                      request_timeout=self.config.request_timeout,
                                      aliases=tuple(self.config.served_model_aliases),
                                      sampling_defaults=dict(self.config.sampling_defaults))
            if not template_renders_tools(engine.tokenizer, None):
                logger.info("the model's chat template does not write the tools a request "
                            "gives: Folio writes them into a system message of its own "
                            "(docs/serving.md: tools)")
            for name, path in self.config.lora_modules:
                register(self.served, name, path)
                logger.info("serving LoRA adapter %s (%s)", name, path)
            logger.info("serving %s", self.config.served_model_name)
        except BaseException as e:       # noqa: BLE001 - every failure ends the process
            self.load_error = e
            if not is_expected_error(e):
                logger.error("loading the model failed", exc_info=e)
            self._fail(f"the model failed to load: {e}")

    def _engine_died(self, error: BaseException) -> None:
        # Called in the engine thread, after every waiting client was told (503).
        self._fail(f"the engine stopped: {error!r}")

    def _fail(self, message: str) -> None:
        if self.fatal is None:
            self.fatal = message
            self._on_fatal(message)

    def ready(self) -> ServedModel:
        if self.served is None:
            raise HTTPError(503, "the model is still loading" if self.load_error is None
                            else f"the model failed to load: {self.load_error}")
        try:
            self.served.engine.check_health()
        except EngineDeadError as e:
            raise HTTPError(503, str(e)) from e
        return self.served


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    cause = (first.get("ctx") or {}).get("error")
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {cause} (at character {loc[0]})", None
    if not loc and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    if isinstance(cause, ValueError):       # one of the request models' own checks
        return str(cause), getattr(cause, "param", None) or (".".join(loc) or None)
    field_name = ".".join(loc) or None
    return (f"{field_name}: {first.get('msg')}" if field_name else str(first.get("msg"))), field_name


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="folio-load", daemon=True).start()
        yield
        if state.served is not None:
            await asyncio.to_thread(state.served.engine.shutdown)
        if state.accounting.ledger is not None:
            await asyncio.to_thread(state.accounting.ledger.close)

    app = FastAPI(title="Folio", version=__version__, lifespan=lifespan)
    app.state.folio = state
    if state.config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=state.config.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    _add_middleware(app, state)
    _add_error_handlers(app)
    _add_routes(app, state)
    openapi.install(app)
    return app


def request_bytes_for(max_model_len: int) -> int:
    """`--max-request-bytes`' default: 1 MiB and 64 bytes a token of the context
    (a prompt as JSON text, escapes included, or as ids, fits with room)."""
    return (1 << 20) + 64 * max_model_len


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(AuthAndRequestId, state=state)
    app.add_middleware(BodyLimit, limit=state.config.max_request_bytes)     # outermost


class BodyLimit:
    """A request body over `limit` bytes is answered 413 before anything
    parses it: by its Content-Length at once, or as its chunks arrive; the
    rest of an oversized body is read and dropped (up to 16 times the limit),
    so that the client, still sending, reads the answer. A body within the
    limit is handed on whole."""

    def __init__(self, app, limit: Optional[int]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.limit or scope["method"] in ("GET", "HEAD",
                                                                             "OPTIONS"):
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await self._refuse(int(length), receive, scope, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":       # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(None, receive, scope, send, more=message.get(
                    "more_body", False))
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()              # then the disconnect, when it comes
        await self.app(scope, replay, send)

    async def _refuse(self, length: Optional[int], receive, scope, send,
                      more: bool = True) -> None:
        drained = 0
        while more and drained <= 16 * self.limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        size = f"{length} bytes" if length is not None else "more"
        response = _error(f"the request body is {size}, over this server's limit of "
                          f"{self.limit} bytes (--max-request-bytes)", 413)
        await response(scope, receive, send)


class AuthAndRequestId:
    """Every HTTP request: its tenant from its key (a 401 before any route
    runs) and its X-Request-Id (the client's, or a new one) on the response.
    A plain ASGI middleware: starlette's BaseHTTPMiddleware relays a streamed
    body chunk by chunk through a memory stream of its own, which cost the
    event loop more than the rest of 256 streams' handling (issue 50)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        if scope["method"] != "OPTIONS" and scope["path"] not in OPEN_PATHS:
            try:
                tenant = self.state.accounting.authenticate(headers.get("authorization", ""))
            except HTTPError as e:
                response = e.response()
                response.headers["X-Request-Id"] = request_id
                return await response(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant    # request.state.tenant

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)
        await self.app(scope, receive, send_with_id)


def _error(message: str, status: int, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(message, 400, param)

    @app.exception_handler(HTTPError)
    async def http_error(_: Request, exc: HTTPError):
        return exc.response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError):
        return _error(str(exc), 400, getattr(exc, "param", None))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError):
        return _error(str(exc), 503)

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError):
        return _error(str(exc), 500)

    @app.exception_handler(HTTPException)
    async def starlette_error(request: Request, exc: HTTPException):
        return _error(_http_exception_message(request, exc), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        # A fault of ours, in OpenAI's shape; Starlette still logs the traceback.
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)


def _http_exception_message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no route {request.url.path}"
    if exc.status_code == 405:
        return f"{request.method} is not allowed on {request.url.path}"
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": e.g. nesting too deep,
        # an integer of more than 4300 digits, bytes that are not UTF-8.
        cause = exc.__cause__
        return f"the request body could not be parsed: {type(cause).__name__}: {cause}"
    return str(exc.detail)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    add_lora_routes(app, state)
    add_router_routes(app, state)
    _add_token_routes(app, state)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=Response, responses={
        200: {"description": "The model is loaded and the engine runs (empty body)."},
        **openapi.errors(503)})
    async def health():
        try:
            state.ready()
        except HTTPError as e:
            return e.response()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format."}})
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version", response_model=VersionResponse, responses=openapi.errors(401))
    async def version():
        return JSONResponse({"version": __version__})

    @app.get("/v1/usage", response_model=UsageReport, responses=openapi.errors(400, 401, 403,
                                                                               404))
    async def usage_report(raw: Request, since: Optional[str] = None, by: str = "tenant"):
        if not raw.state.tenant.admin:
            raise HTTPError(403, "GET /v1/usage needs an admin key (\"admin\": true in "
                                 "--api-keys-file)")
        if state.config.usage_db is None:
            raise HTTPError(404, "this server keeps no usage ledger: start it with --usage-db")
        try:
            rows = await asyncio.to_thread(usage_rows, state.config.usage_db, since, by)
        except ValueError as e:
            raise HTTPError(400, str(e), "since" if "date" in str(e) else "by") from None
        return JSONResponse({"object": "list", "by": by, "data": rows})

    @app.get("/v1/models", response_model=ModelList, responses=openapi.errors(401, 503))
    async def models(raw: Request):
        served = state.ready()
        root = served.engine.model_config.path
        return JSONResponse({"object": "list", "data": [
            *({"id": name, "object": "model", "created": now(), "owned_by": "folio",
               "root": root, "parent": None, "max_model_len": served.max_model_len}
              for name in served.names),
            *model_cards(served, now(), raw.state.tenant)]})


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    errors = openapi.errors(400, 401, 404, 429, 500, 503)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**openapi.streamed(CompletionStreamResponse), **errors})
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state.ready(), req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**openapi.streamed(ChatCompletionStreamResponse), **errors})
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state.ready(), req, raw)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def embeddings(req: EmbeddingRequest, raw: Request):
        return await create_embedding(state.ready(), req, raw)

    @app.post("/v1/responses", response_model=ResponseObject,
              responses={**openapi.streamed(ResponseStreamEvent), **errors})
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(state.ready(), req, raw)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=errors)
    @app.post("/rerank", response_model=RerankResponse, responses=errors,
              include_in_schema=False)
    async def rerank(req: RerankRequest, raw: Request):
        return await create_rerank(state.ready(), req, raw)

    @app.post("/score", response_model=ScoreResponse, responses=errors)
    @app.post("/v1/score", response_model=ScoreResponse, responses=errors,
              include_in_schema=False)
    async def score(req: ScoreRequest, raw: Request):
        return await create_score(state.ready(), req, raw)


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    errors = openapi.errors(400, 401, 404, 503)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(req: TokenizeRequest, raw: Request):
        served = state.ready()
        served.check_model(req.model, raw.state.tenant)
        if req.messages is not None:       # rendered as /v1/chat/completions renders them
            ids = await chat_prompt_ids(served, req)
        elif req.prompt is not None:
            ids = await off_loop(served.tokenizer.encode, req.prompt,
                                          req.add_special_tokens)
        else:
            raise HTTPError(400, "give 'prompt' or 'messages'", "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": served.max_model_len,
                             "tokens": ids})

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(req: DetokenizeRequest, raw: Request):
        served = state.ready()
        served.check_model(req.model, raw.state.tenant)
        vocab = served.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return JSONResponse({"prompt": served.tokenizer.decode(req.tokens,
                                                               skip_special_tokens=False)})


def served_name_for(model: Optional[str]) -> str:
    if model is None:
        return default_model()
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model

