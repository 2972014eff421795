"""What a router in front of several Folio servers asks of each one
(vllm-router 0.1.17, docs/deployment.md "Behind a router"; read in its
source, each answered with the meaning it has there):

- `POST /v1/completions/render`, `POST /v1/chat/completions/render` (vLLM's):
  the token ids the request would run on, without running it. cache_aware
  routing keys its prefix tree on them; the router falls back to /tokenize
  where a worker has no render.
- `GET /get_load`: `{"load": N}`, the requests this server holds now
  (running, waiting, or streaming back). power_of_two polls it.
- `GET /get_model_info`: the checkpoint's path, as SGLang's workers answer.
- `POST /flush_cache` (SGLang's name) and `POST /reset_prefix_cache`
  (vLLM's): the prefix cache emptied; 400 while requests hold blocks, as
  SGLang answers. With a keys file, an admin key.
- `GET /health_generate`: one greedy token through the engine; 200 once it
  comes, 503 if it does not within 30 s.

Not served: `/get_server_info` (SGLang's server arguments; Folio's are not
theirs, and the router only passes the answer through).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from folio.sampling_params import SamplingParams
from folio.server import openapi
from folio.server.chat import chat_prompt_ids
from folio.server.completions import prompt_ids
from folio.server.protocol import ChatCompletionRequest, CompletionRequest, random_id
from folio.server.responses import LoadResponse, ModelInfoResponse, RenderedPrompt
from folio.server.serving import HTTPError

HEALTH_GENERATE_TIMEOUT = 30.0


def add_router_routes(app: FastAPI, state) -> None:
    errors = openapi.errors(400, 401, 404, 503)

    @app.post("/v1/completions/render", response_model=list[RenderedPrompt], responses=errors)
    async def render_completion(req: CompletionRequest, raw: Request):
        served = state.ready()
        served.check_model(req.model, raw.state.tenant)
        name = served.model_name(req.model)
        return JSONResponse([{"model": name, "token_ids": ids, "features": None}
                             for _, ids in await prompt_ids(served, req.prompt)])

    @app.post("/v1/chat/completions/render", response_model=RenderedPrompt, responses=errors)
    async def render_chat(req: ChatCompletionRequest, raw: Request):
        served = state.ready()
        served.check_model(req.model, raw.state.tenant)
        return JSONResponse({"model": served.model_name(req.model),
                             "token_ids": await chat_prompt_ids(served, req), "features": None})

    @app.get("/get_load", response_model=LoadResponse, responses=openapi.errors(503))
    async def get_load():
        return JSONResponse({"load": state.ready().engine.num_in_flight})

    @app.get("/get_model_info", response_model=ModelInfoResponse,
             responses=openapi.errors(401, 503))
    async def get_model_info():
        path = state.ready().engine.model_config.path
        return JSONResponse({"model_path": path, "tokenizer_path": path, "is_generation": True})

    flush_errors = openapi.errors(400, 401, 403, 503)

    async def flush(raw: Request) -> PlainTextResponse:
        served = state.ready()
        if state.config.api_keys_file is not None and not raw.state.tenant.admin:
            raise HTTPError(403, "emptying the prefix cache needs an admin key (\"admin\": "
                                 "true in --api-keys-file)")
        if not await served.engine.reset_prefix_cache():
            raise HTTPError(400, "the prefix cache was not emptied: requests are running, try "
                                 "again when they have finished")
        return PlainTextResponse("Cache flushed.")

    app.post("/flush_cache", response_class=PlainTextResponse, responses=flush_errors)(flush)
    app.post("/reset_prefix_cache", response_class=PlainTextResponse,
             responses=flush_errors)(flush)

    @app.get("/health_generate", response_class=Response, responses={
        200: {"description": "The engine generated a token (empty body)."},
        **openapi.errors(401, 503)})
    async def health_generate():
        served = state.ready()
        ids = served.tokenizer.encode("Hello") or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def one_token() -> None:
            async for _ in served.engine.generate(random_id("health"), None, ids, params):
                pass
        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            raise HTTPError(503, f"the engine generated no token in "
                                 f"{HEALTH_GENERATE_TIMEOUT:.0f} s") from None
        return Response(status_code=200)
