"""LoRA adapters served under their own names (issue 31): `--lora-modules`
at start-up, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(vLLM's endpoints and answers) while serving. A request picks an adapter by
its `model` field (ServedModel.check_model); `/v1/models` lists each with
the base model as its `parent`. Unloading takes the name away: requests
already running keep their adapter until they finish.

Loading while serving reads a folder a client names, so it is closed unless
the server is started with `--enable-runtime-lora` and one or more
`--lora-root` folders (issue 52): a path must resolve, symlinks followed,
inside one of them (a refusal never repeats a path from outside), a name is
at most 128 characters of letters, digits and `._:/-`, an admin key is
needed when a keys file is given, and the adapters loaded so far are at
most `--max-cpu-loras` beside the ones the command line named."""

from __future__ import annotations

import asyncio
import json
import os
import re

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


_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


def check_adapter_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"an adapter name is 1 to 128 characters of letters, digits and "
                         f"'._:/-' ({len(name)} characters given)")


def under_roots(path: str, roots: list[str]) -> str:
    """`path` resolved (symlinks followed) inside one of `roots`: an absolute
    path as it is, a relative one against each root in turn. ValueError
    otherwise, without the path (it may name what a client may not see)."""
    candidates = [path] if os.path.isabs(path) else [os.path.join(r, path) for r in roots]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        for root in roots:
            top = os.path.realpath(root)
            if os.path.commonpath([real, top]) == top and os.path.isdir(real):
                return real
    raise ValueError("lora_path must be an adapter folder inside one of the server's "
                     "--lora-root folders")


def register(served: ServedModel, name: str, path: str) -> LoRARequest:
    """An adapter served as `name`: loaded and checked first (ValueError)."""
    if name in served.names or name in served.loras:
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
        if not state.config.runtime_lora:
            raise HTTPError(403, "loading and unloading LoRA adapters while serving is off: "
                                 "start the server with --enable-runtime-lora and "
                                 "--lora-root DIR")
        # with a keys file, only its admin keys change what is served
        if state.config.api_keys_file is not None and not raw.state.tenant.admin:
            raise HTTPError(403, "loading and unloading LoRA adapters needs an admin key "
                                 "(\"admin\": true in --api-keys-file)")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request):
        served = state.ready()
        check_admin(raw)
        try:
            check_adapter_name(req.lora_name)
        except ValueError as e:
            raise HTTPError(400, str(e), "lora_name") from None
        static = len(state.config.lora_modules)
        if len(served.loras) >= static + state.config.max_runtime_loras:
            raise HTTPError(400, f"this server holds at most {state.config.max_runtime_loras} "
                                 f"adapters loaded while serving (--max-cpu-loras) beside the "
                                 f"{static} of --lora-modules: unload one first", "lora_name")
        try:
            path = under_roots(req.lora_path, state.config.lora_roots)
            await asyncio.to_thread(register, served, req.lora_name, path)
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
