"""What /openapi.json says beyond FastAPI's defaults, so that tools reading it
(client generators, schemathesis) find the server as it answers:

- every route's response model, and the server-sent events a stream sends;
- the error statuses it really answers, each with ErrorResponse: validation
  errors are 400s here, so FastAPI's automatic 422 is dropped;
- /health's 200 has no body at all;
- the request models' schemas as pydantic writes them: FastAPI's document
  model stores bounds as floats, and float(2**63 - 1) is 2**63, one past the
  largest seed or priority the server accepts.
"""

from __future__ import annotations

from fastapi import FastAPI

from folio.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from folio.server.responses import (ChatCompletionStreamResponse, CompletionStreamResponse,
                                    ErrorResponse, ResponseStreamEvent)

_WHY = {400: "The request is invalid: the message says why, `param` names the field.",
        401: "The API key is missing or wrong (only when the server was started with keys).",
        403: "The key is not an admin key (GET /v1/usage).",
        404: "No such model (or, for /v1/usage, no usage ledger).",
        429: "The tenant is over a rate limit; Retry-After says in how many seconds to retry.",
        500: "The engine failed this request alone (other requests go on).",
        503: "The model is still loading, or the engine has stopped."}


def errors(*statuses: int) -> dict:
    """`responses=` entries for these error statuses."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


def streamed(chunk: type) -> dict:
    """`responses=` entry for a 200 that is JSON, or events of `chunk` with stream: true."""
    return {200: {"description": "The answer; with `stream: true`, server-sent events of "
                                 f"{chunk.__name__} objects ending with `data: [DONE]`.",
                  "content": {"text/event-stream": {
                      "schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}}}


def install(app: FastAPI) -> None:
    """Make app.openapi() return the finished document (built once, on first use)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            _finish(build())
        return app.openapi_schema

    app.openapi = openapi


def _finish(doc: dict) -> None:
    for path in doc["paths"].values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for model, mode in ((CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                        (TokenizeRequest, "validation"), (DetokenizeRequest, "validation"),
                        (CompletionStreamResponse, "serialization"),
                        (ChatCompletionStreamResponse, "serialization"),
                        (ResponseStreamEvent, "serialization")):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    doc["paths"]["/health"]["get"]["responses"]["200"].pop("content", None)
