"""The OpenAI-compatible HTTP server: routes, errors, auth, /metrics, /health.

The model loads in a thread after the server starts listening, so /health
answers 503 until it is ready (and again if the engine dies). Bad input is
always a 400 in OpenAI's error shape; 500 is kept for real internal faults,
since clients retry 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from folio import __version__
from folio.engine.async_engine import AsyncLLMEngine, EngineDeadError
from folio.server.chat import create_chat_completion
from folio.server.completions import create_completion
from folio.server.metrics import ServerMetrics
from folio.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, error_body, now)
from folio.server.serving import HTTPError, ServedModel

logger = logging.getLogger("folio")
OPEN_PATHS = ("/health", "/metrics")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: Optional[str] = None
    allowed_origins: list[str] = field(default_factory=list)
    drain_timeout: float = 30.0


class ServerState:
    """The engine, once loaded; the metrics registry from the start."""

    def __init__(self, config: ServerConfig, load_engine: Callable):
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name)
        self.served: Optional[ServedModel] = None
        self.load_error: Optional[BaseException] = None
        self._load_engine = load_engine

    def load(self) -> None:
        try:
            llm_engine = self._load_engine()
            engine = AsyncLLMEngine(llm_engine, on_step=self.metrics.on_step)
            self.served = ServedModel(engine, self.config.served_model_name,
                                      llm_engine.config.max_model_len)
            logger.info("serving %s", self.config.served_model_name)
        except BaseException as e:       # noqa: BLE001 - /health reports it
            logger.exception("loading the model failed")
            self.load_error = e

    def ready(self) -> ServedModel:
        if self.served is None:
            raise HTTPError(503, "the model is still loading" if self.load_error is None
                            else f"the model failed to load: {self.load_error}")
        if self.served.engine.is_dead:
            raise HTTPError(503, "the engine has stopped")
        return self.served


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field_name = ".".join(loc) or None
    return (f"{field_name}: {first.get('msg')}" if field_name else str(first.get("msg"))), field_name


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="folio-load", daemon=True).start()
        yield
        if state.served is not None:
            await asyncio.to_thread(state.served.engine.shutdown)

    app = FastAPI(title="Folio", version=__version__, lifespan=lifespan)
    app.state.folio = state
    if state.config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=state.config.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    _add_middleware(app, state)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def auth_and_request_id(request: Request, call_next):
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        key = state.config.api_key
        if key and request.method != "OPTIONS" and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                response = JSONResponse(error_body("invalid or missing API key", 401), 401)
                response.headers["X-Request-Id"] = request_id
                return response
        response = await call_next(request)
        response.headers["X-Request-Id"] = request_id
        return response


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param), 400)

    @app.exception_handler(HTTPError)
    async def http_error(_: Request, exc: HTTPError):
        return exc.response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError):
        return JSONResponse(error_body(str(exc), 400), 400)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), 503), 503)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc):
        return JSONResponse(error_body(f"no route {request.url.path}", 404), 404)

    @app.exception_handler(405)
    async def bad_method(request: Request, _exc):
        return JSONResponse(error_body(f"{request.method} is not allowed here", 405), 405)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        try:
            state.ready()
        except HTTPError as e:
            return e.response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        served = state.ready()
        root = served.engine.engine.config.model.path
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": now(), "owned_by": "folio",
            "root": root, "parent": None, "max_model_len": served.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state.ready(), req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state.ready(), req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        served = state.ready()
        served.check_model(req.model)
        tok = served.tokenizer
        if req.messages is not None:
            ids = await asyncio.to_thread(tok.encode_chat, req.messages,
                                          add_generation_prompt=req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise HTTPError(400, "give 'prompt' or 'messages'", "prompt")
        return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        served = state.ready()
        served.check_model(req.model)
        vocab = served.engine.engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": served.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def served_name_for(model: Optional[str]) -> str:
    from folio.model.loader import DEFAULT_MODEL
    if model is None:
        return DEFAULT_MODEL
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model
