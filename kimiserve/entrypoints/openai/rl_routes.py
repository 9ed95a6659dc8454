"""Routes for RL and LoRA (vLLM's names where vLLM has them):

- POST /v1/load_lora_adapter {"lora_name", "lora_path"}: load a PEFT adapter folder; requests then pick
  it by `model` (and /v1/models lists it);
- POST /v1/unload_lora_adapter {"lora_name"}: unload it (409 while requests use it);
- POST /update_weights {"path"}: load the model weights the trainer wrote there
  (`kimiserve.rl.weight_sync.save_weights`) into the running engine and empty its prefix cache (409 while
  requests are running: update between rollout batches).

Each runs on the engine thread between two steps (`AsyncLLMEngine.call`).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from kimiserve.engine.async_engine import AsyncLLMEngine
from kimiserve.entrypoints.openai.errors import OpenAIError


async def _body(raw: Request, fields: tuple[str, ...]) -> dict:
    try:
        body = await raw.json()
    except Exception:  # noqa: BLE001 - any unreadable body is the client's error
        raise OpenAIError("the body must be a JSON object", 400) from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object", 400)
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            raise OpenAIError(f"{name} is required (a non-empty string)", 400, name)
    return body


async def _call(engine: AsyncLLMEngine, fn):
    try:
        return await engine.call(fn)
    except RuntimeError as exc:  # requests running / adapter in use
        raise OpenAIError(str(exc), 409, None, "conflict") from exc


def add_rl_routes(app: FastAPI, engine: AsyncLLMEngine, served_model_names: list[str]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        body = await _body(raw, ("lora_name", "lora_path"))
        name = body["lora_name"]
        if name in served_model_names:
            raise OpenAIError(f"lora_name {name!r} is the served model's name: choose another", 400, "lora_name")
        await _call(engine, lambda e: e.load_lora_adapter(name, body["lora_path"]))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        body = await _body(raw, ("lora_name",))
        name = body["lora_name"]

        def unload(e):
            if e._lora_in_use(name):
                raise RuntimeError(f"LoRA adapter {name!r} is in use by running requests")
            e.unload_lora_adapter(name)

        await _call(engine, unload)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/update_weights")
    async def update_weights(raw: Request):
        from kimiserve.rl.weight_sync import load_weights, sync_weights

        body = await _body(raw, ("path",))
        weights = load_weights(body["path"])  # ValueError -> 400
        count = await _call(engine, lambda e: sync_weights(e, weights))
        return JSONResponse({"status": "ok", "tensors": count,
                             "weight_version": getattr(engine.engine, "weight_version", 0)})
