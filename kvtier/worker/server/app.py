"""``create_app(settings)``: the worker's FastAPI app (OpenAI endpoints, health, metrics).

This module wires the app: its lifespan, gate, error shapes and routes. Who may connect and
what they can make it do: see :mod:`kvtier.worker.server.access` (the bearer key and body limit
in front of every route) and :mod:`kvtier.worker.server.completions` (the generation endpoints:
the ids a caller may send, the producers a consumer leg may name); their output is
:mod:`kvtier.worker.server.delivery`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.worker.errors import InvalidRequest
from kvtier.worker.p2p_connector import p2p_connector_factory
from kvtier.worker.ranks import DP_RANK_HEADER, WorkerRanks
from kvtier.worker.server.access import WorkerGate
from kvtier.worker.server.completions import CompletionHandler
from kvtier.worker.server.metrics import worker_registry
from kvtier.worker.server.openai_format import error_response
from kvtier.worker.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ReleaseRequest,
    UnloadLoraRequest,
)
from kvtier.worker.server.rank_metrics import ranks_registry
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import ConnectorFactory, Worker


def create_app(
    settings: WorkerSettings,
    *,
    worker: Worker | None = None,
    connector_factory: ConnectorFactory | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the worker's ranks (``app.state.ranks``; rank 0
    is ``app.state.worker``). ``worker`` given: that one engine (no ranks)."""
    if worker is None:
        if connector_factory is None:
            connector_factory = p2p_connector_factory
        ranks = WorkerRanks.build(settings, connector_factory)
    else:
        ranks = WorkerRanks([worker])
    the_worker = ranks.workers[0]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ranks.start()
        try:
            yield
        finally:
            await ranks.close()

    app = FastAPI(title="kvtier reference worker", lifespan=lifespan)
    app.add_middleware(
        WorkerGate,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        stats=the_worker.stats,
    )
    app.state.worker = the_worker
    app.state.ranks = ranks
    registry = worker_registry(the_worker) if len(ranks) == 1 else ranks_registry(ranks.workers)
    handlers = [CompletionHandler(w) for w in ranks.workers]

    def handler_for(request: Request) -> CompletionHandler:
        return handlers[ranks.pick(request.headers.get(DP_RANK_HEADER))]

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(
            400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc or None
        )

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        kind = kinds.get(exc.status_code, "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), err_type=kind)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handler_for(request).completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await handler_for(request).chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        base = {
            "id": settings.model_name,
            "object": "model",
            "owned_by": "kvtier",
            "root": settings.model_name,
            "parent": None,
            "max_model_len": settings.max_model_len,
        }
        adapters = [
            {**base, "id": a.name, "root": a.path, "parent": settings.model_name}
            for a in the_worker.loras.all()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        for w in ranks.workers:
            w.loras.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        for w in ranks.workers:
            w.loras.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/kv/release")
    async def release(body: ReleaseRequest, request: Request) -> dict[str, object]:
        # Without a rank, whichever rank holds the supply (its id is random) releases it.
        header = request.headers.get(DP_RANK_HEADER)
        holders = [ranks.workers[ranks.pick(header)]] if header is not None else ranks.workers
        released = False
        for w in holders:
            if w.connector is not None and w.connector.release(body.kv_request_id):
                released = True
        return {"kv_request_id": body.kv_request_id, "released": released}

    return app
