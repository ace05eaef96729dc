"""LoRA adapters loaded and unloaded while the server runs (`serve --allow-runtime-lora`), vLLM's endpoints:
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}.

A load reads and checks the adapter as `--lora` does at start (lora.serving.read_adapters: its files inside its
directory, strict JSON, finite tensors, a recorded base fingerprint against the served model), off the event
loop; then puts it on the model on the engine thread between two steps (EngineLoop.call), in a new slot, and
only then lists it (/v1/models) and lets requests name it as `model`. An unload of an adapter that requests
in flight use (running or waiting) is refused with 409 at once rather than waiting for them: a client can
retry, and a server that held the call would hold it for as long as a stream runs. Otherwise the name goes
at once (later requests naming it get 404) and its tensors are freed on the engine thread.

vLLM turns these endpoints on with an environment variable (VLLM_ALLOW_RUNTIME_LORA_UPDATING); here it is a
flag, which `serve --help` lists and the startup line reports. Errors are one line with a 4xx: 400 for a body,
name or adapter that will not do, a name already served, or --max-loras reached; 404 for unloading a name not
served; 409 for one in use. A successful call answers 200 with a line of text, as vLLM does.
Entry point: `add_routes(router, srv, served, max_loras)`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from moeswap.lora.serving import ServedAdapters, read_adapters
from moeswap.server import protocol as P


def add_routes(router: APIRouter, srv, served: ServedAdapters, max_loras: int) -> None:
    """The two endpoints on `router` (the /v1 routes, behind the API key). srv: the app's server state, whose
    `adapters` (name -> slot) the requests read; served: the model's adapters (lora.serving.serve_adapters)."""
    pending: set[str] = set()  # names being loaded: a second load of one waits for nothing, it is refused

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = P.parse_body(P.LoadLoRARequest, await _small_body(request))
        name = req.lora_name
        if name == srv.name or name in srv.aliases:
            raise P.APIError(400, f"'{name}' is the served model's name; give the adapter another", param="lora_name")
        if name in srv.adapters or name in pending:
            raise P.APIError(400, f"the LoRA adapter '{name}' is loaded already; unload it first to load another "
                                  f"under its name", param="lora_name")
        if len(srv.adapters) + len(pending) >= max_loras:
            raise P.APIError(400, f"the server serves --max-loras {max_loras} adapters already; unload one first",
                             param="lora_name")
        pending.add(name)
        try:
            try:  # the files read and checked off the event loop (a fingerprint reads the base model's samples)
                [(_, adapter)] = await asyncio.to_thread(read_adapters, [(name, req.lora_path)], served.base_dir)
            except (ValueError, OSError) as e:
                raise P.APIError(400, f"lora_path: {_one_line(e)}", param="lora_path") from None
            try:
                [slot] = await srv.engine.call(lambda: served.add([(name, adapter)]))
            except ValueError as e:
                raise P.APIError(400, _one_line(e), param="lora_path") from None
            srv.adapters[name] = slot
        finally:
            pending.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = P.parse_body(P.UnloadLoRARequest, await _small_body(request))
        name = req.lora_name
        slot = srv.adapters.get(name)
        if slot is None:
            raise P.APIError(404, f"the LoRA adapter '{name}' is not loaded", param="lora_name",
                             code="model_not_found")
        using = srv.engine.in_flight_with(slot)
        if using:
            raise P.APIError(409, f"the LoRA adapter '{name}' is in use by {using} request{'s' if using > 1 else ''}; "
                                  f"retry when they end", param="lora_name", code="adapter_in_use")
        # from here no request can name it (resolving a name and submitting happen in one event-loop turn), and
        # none in flight uses its slot: the engine thread frees it between two steps
        del srv.adapters[name]
        await srv.engine.call(lambda: served.remove(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


BODY_LIMIT = 1 << 16  # a name and a path


async def _small_body(request: Request) -> bytes:
    from moeswap.server.app import read_body  # (app imports this module when it adds these routes)

    return await read_body(request, BODY_LIMIT, "it holds a name and a path")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
