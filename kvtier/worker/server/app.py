"""``create_app(settings)``: the worker's FastAPI app (OpenAI endpoints, health, metrics).

Who may connect and what they can make it do: see :mod:`kvtier.worker.server.access` (the bearer
key and body limit in front of every route) and :mod:`kvtier.worker.peers` (the producers a
consumer leg may name). Ids a caller sends (``x-request-id``, ``kv_request_id``, hosts) are at
most :data:`kvtier.worker.kv_params.MAX_ID_CHARS` long (400 beyond).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.worker.connector import ProducerOutcome
from kvtier.worker.errors import (
    EngineClosed,
    InvalidRequest,
    KVTransferParamsError,
    KVTransferRefused,
)
from kvtier.worker.kv_params import MAX_ID_CHARS, ConsumerLeg, Leg, ProducerLeg, parse_leg
from kvtier.worker.p2p_connector import p2p_connector_factory
from kvtier.worker.peers import PeerAllowlist
from kvtier.worker.request import EngineRequest, FinishReason, PromptKVHook, StepOutput
from kvtier.worker.sampling import SamplingParams
from kvtier.worker.server.access import WorkerGate
from kvtier.worker.server.metrics import worker_registry
from kvtier.worker.server.openai_format import ResponseShape, error_response, sse, usage
from kvtier.worker.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ReleaseRequest,
    UnloadLoraRequest,
    _Sampling,
)
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import ConnectorFactory, Worker

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.05


def create_app(
    settings: WorkerSettings,
    *,
    worker: Worker | None = None,
    connector_factory: ConnectorFactory | None = None,
) -> FastAPI:
    """The app; its lifespan starts and stops the worker (``app.state.worker``)."""
    if worker is None:
        if connector_factory is None:
            connector_factory = p2p_connector_factory
        worker = Worker(settings, connector_factory=connector_factory)
    the_worker = worker

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await the_worker.start()
        try:
            yield
        finally:
            await the_worker.close()

    app = FastAPI(title="kvtier reference worker", lifespan=lifespan)
    app.add_middleware(
        WorkerGate,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        stats=the_worker.stats,
    )
    app.state.worker = the_worker
    registry = worker_registry(the_worker)
    api = _Api(the_worker)

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
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

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
        the_worker.loras.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        the_worker.loras.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/kv/release")
    async def release(body: ReleaseRequest) -> dict[str, object]:
        released = (
            the_worker.connector.release(body.kv_request_id) if the_worker.connector else False
        )
        return {"kv_request_id": body.kv_request_id, "released": released}

    return app


class _Api:
    """Request handling shared by both OpenAI endpoints."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.settings = worker.settings
        self.peers = PeerAllowlist.parse(worker.settings.p2p_allowed_peers)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompt: object = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return error_response(
                    400, "only one prompt per request is supported", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.worker.tokenizer.encode(prompt)
        else:
            assert isinstance(prompt, list)
            ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
            vocab = self.worker.engine.backend.vocab_size
            if len(ids) != len(prompt) or any(not 0 <= t < vocab for t in ids):
                return error_response(
                    400, f"prompt token ids must be integers in [0, {vocab})", param="prompt"
                )
        if body.echo or body.logprobs:
            return error_response(400, "echo and logprobs are not supported", param="echo")
        return await self._serve(body, ids, request, chat=False, max_tokens=body.max_tokens or 16)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        if body.logprobs:
            return error_response(400, "logprobs are not supported", param="logprobs")
        text = self.worker.tokenizer.apply_chat_template(
            [(m.role, m.text()) for m in body.messages]
        )
        ids = self.worker.tokenizer.encode(text)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            room = self.settings.max_model_len - len(ids)
            max_tokens = max(1, min(self.settings.default_max_tokens, room))
        return await self._serve(body, ids, request, chat=True, max_tokens=max_tokens)

    async def _serve(
        self, body: _Sampling, ids: list[int], request: Request, *, chat: bool, max_tokens: int
    ) -> Response:
        lora = None
        if body.model is not None and body.model != self.settings.model_name:
            lora = self.worker.loras.get(body.model)
            if lora is None:
                return error_response(
                    404,
                    f"The model `{body.model}` does not exist.",
                    err_type="NotFoundError",
                    param="model",
                )
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(request_id) > MAX_ID_CHARS:
            return error_response(
                400, f"x-request-id is longer than {MAX_ID_CHARS} characters", param="x-request-id"
            )
        shape = ResponseShape(
            chat=chat,
            request_id=request_id,
            model=lora.name if lora is not None else self.settings.model_name,
            return_token_ids=body.return_token_ids,
        )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )
        leg = self._leg(body, shape.id, request_id)
        outcome = ProducerOutcome()
        hook: PromptKVHook | None = None
        connector = self.worker.connector
        if isinstance(leg, ProducerLeg) and connector is not None:
            hook = connector.producer_hook(leg, request_id, outcome)
        engine = self.worker.engine
        try:
            req = engine.new_request(
                request_id, ids, params, cache_salt=body.cache_salt, on_prompt_kv=hook, lora=lora
            )
        except InvalidRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        except EngineClosed as exc:
            return error_response(503, str(exc), err_type="ServiceUnavailableError")
        if lora is not None:  # before any of its blocks can be stored (installed remote ones too)
            self.worker.events.mark_adapter(req.hashes.hashes, lora.lora_id, lora.name)
        try:
            if isinstance(leg, ConsumerLeg) and connector is not None:
                await connector.load_remote(req, leg)
            engine.submit(req)
        except EngineClosed as exc:
            return error_response(503, str(exc), err_type="ServiceUnavailableError")
        except BaseException:
            engine.kv.release_pinned(req)  # never submitted: its installed pages go back
            raise
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(
                self._stream(
                    req,
                    shape,
                    opts.include_usage if opts else False,
                    opts.continuous_usage_stats if opts else False,
                ),
                media_type="text/event-stream",
            )
        supply_id = leg.kv_request_id if isinstance(leg, ProducerLeg) and hook else None
        return await self._collect(req, shape, request, outcome, supply_id)

    def _leg(self, body: _Sampling, response_id: str, request_id: str) -> Leg | None:
        params = body.kv_transfer_params
        if not params:
            return None
        try:
            leg = parse_leg(params, nixl_request_id=f"{response_id}-0")
            if isinstance(leg, ConsumerLeg) and not self.peers.allows(
                leg.remote_host, leg.remote_port
            ):
                raise KVTransferRefused(
                    f"kv_transfer_params: producer {leg.remote_host}:{leg.remote_port} is not "
                    "in this worker's p2p_allowed_peers",
                    param="kv_transfer_params",
                )
        except KVTransferRefused as exc:
            self.worker.stats.kv_params_refused += 1
            logger.warning("request %s: refused: %s", request_id, exc)
            raise
        except KVTransferParamsError as exc:
            self.worker.stats.kv_params_fallbacks += 1
            logger.warning(
                "request %s: kv_transfer_params ignored, running locally: %s", request_id, exc
            )
            return None
        if leg is not None and self.worker.connector is None:
            self.worker.stats.kv_params_fallbacks += 1
            logger.warning(
                "request %s: no KV connector; the %s leg runs locally",
                request_id,
                type(leg).__name__,
            )
            return None
        return leg

    async def _collect(
        self,
        req: EngineRequest,
        shape: ResponseShape,
        request: Request,
        outcome: ProducerOutcome,
        supply_id: str | None = None,
    ) -> Response:
        """The whole answer. A producer leg whose client left never delivers its
        ``kv_transfer_params``: its supply (``supply_id``) is released at once, not by lease."""
        engine = self.worker.engine
        client_gone = False
        texts: list[str] = []
        token_ids: list[int] = []
        final: StepOutput | None = None

        async def drain() -> None:
            nonlocal final
            async for out in engine.stream(req):
                texts.append(out.text)
                token_ids.extend(out.token_ids)
                if out.finish is not None:
                    final = out

        task = asyncio.create_task(drain())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not done and not client_gone and await request.is_disconnected():
                    logger.info("request %s: client disconnected; aborting", req.request_id)
                    client_gone = True
                    engine.abort(req)
            await task
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if (
                supply_id is not None
                and outcome.answer is not None
                # A fast leg can finish before the first disconnect poll; a proxy's release
                # sent when its client left may then have come before the supply existed.
                and (client_gone or await request.is_disconnected())
            ):
                connector = self.worker.connector
                if connector is not None and connector.release(supply_id):
                    logger.info(
                        "request %s: producer leg's client left; supply %s released",
                        req.request_id,
                        supply_id,
                    )
        assert final is not None
        if final.finish is FinishReason.ERROR:
            return error_response(
                500, final.error or "engine error", err_type="InternalServerError"
            )
        if final.finish is FinishReason.ABORT:
            return error_response(503, "request aborted", err_type="ServiceUnavailableError")
        body = shape.full("".join(texts), token_ids, final, outcome.answer)
        return Response(orjson.dumps(body), media_type="application/json")

    async def _stream(
        self, req: EngineRequest, shape: ResponseShape, include_usage: bool, continuous: bool
    ) -> AsyncIterator[bytes]:
        engine = self.worker.engine
        if shape.chat:
            yield sse(shape.chunk(None, role=True))
        final: StepOutput | None = None
        count = 0
        async for out in engine.stream(req):
            count += len(out.token_ids)
            if out.finish is not None:
                final = out
            if out.finish in (FinishReason.ERROR, FinishReason.ABORT):
                err = {
                    "error": {
                        "message": out.error or "request aborted",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                yield sse(err)
                break
            live = None
            if continuous:
                live = {
                    "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": count,
                    "total_tokens": len(req.prompt_ids) + count,
                }
            yield sse(shape.chunk(out, usage_body=live))
        if (
            final is not None
            and include_usage
            and final.finish not in (FinishReason.ERROR, FinishReason.ABORT)
        ):
            yield sse(shape.chunk(None, usage_body=usage(final)))
        yield sse("[DONE]")
