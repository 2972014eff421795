"""LoRA adapters served under their own names (issue 31): `--lora-modules`
at start-up, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(vLLM's endpoints and answers) while serving. A request picks an adapter by
its `model` field (ServedModel.check_model); `/v1/models` lists each with
the base model as its `parent`. Unloading takes the name away: requests
already running keep their adapter until they finish."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from folio.lora_request import LoRARequest
from folio.server import openapi
from folio.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from folio.server.serving import HTTPError, ServedModel


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text}: not valid JSON: {e}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str):
            raise ValueError(f"--lora-modules {text}: give \"name\" and \"path\"")
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text}: give name=path")
    return name, path


def register(served: ServedModel, name: str, path: str) -> LoRARequest:
    """An adapter served as `name`: loaded and checked first (ValueError)."""
    if name == served.name or name in served.loras:
        raise ValueError(f"a model or adapter named {name!r} is already served")
    lora = LoRARequest(name, next(served.lora_ids), path)
    served.engine.check_lora(lora)
    served.loras[name] = lora
    return lora


def model_cards(served: ServedModel, created: int, tenant) -> list[dict]:
    """The adapters the caller's tenant may use (its key's "adapters")."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "folio",
             "root": lora.lora_path, "parent": served.name,
             "max_model_len": served.max_model_len} for name, lora in served.loras.items()
            if tenant.may_use(name)]


def add_lora_routes(app: FastAPI, state) -> None:
    errors = openapi.errors(400, 401, 403, 404, 503)

    def check_admin(raw: Request) -> None:
        # with a keys file, only its admin keys change what is served
        if state.config.api_keys_file is not None and not raw.state.tenant.admin:
            raise HTTPError(403, "loading and unloading LoRA adapters needs an admin key "
                                 "(\"admin\": true in --api-keys-file)")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request):
        served = state.ready()
        check_admin(raw)
        try:
            await asyncio.to_thread(register, served, req.lora_name, req.lora_path)
        except ValueError as e:
            raise HTTPError(400, str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request):
        served = state.ready()
        check_admin(raw)
        if served.loras.pop(req.lora_name, None) is None:
            raise HTTPError(404, f"The LoRA adapter `{req.lora_name}` is not loaded.",
                            "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")
