"""A submitted request's output to its client: one JSON answer, or an SSE stream of chunks.

The whole answer watches for the client leaving (it aborts the request then, and releases a
producer leg's supply that no one will ever be told about)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response

from kvtier.tasks import cancel_and_wait
from kvtier.worker.connector import ProducerOutcome
from kvtier.worker.request import EngineRequest, FinishReason, StepOutput
from kvtier.worker.server.openai_format import ResponseShape, error_response, sse, usage
from kvtier.worker.worker import Worker

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.05


async def collect(
    worker: Worker,
    req: EngineRequest,
    shape: ResponseShape,
    request: Request,
    *,
    outcome: ProducerOutcome,
    supply_id: str | None = None,
) -> Response:
    """The whole answer. A producer leg whose client left never delivers its
    ``kv_transfer_params``: its supply (``supply_id``) is released at once, not by lease."""
    engine = worker.engine
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
            await cancel_and_wait(task)
        if (
            supply_id is not None
            and outcome.answer is not None
            # A fast leg can finish before the first disconnect poll; a proxy's release
            # sent when its client left may then have come before the supply existed.
            and (client_gone or await request.is_disconnected())
        ):
            connector = worker.connector
            if connector is not None and connector.release(supply_id):
                logger.info(
                    "request %s: producer leg's client left; supply %s released",
                    req.request_id,
                    supply_id,
                )
    assert final is not None
    if final.finish is FinishReason.ERROR:
        return error_response(500, final.error or "engine error", err_type="InternalServerError")
    if final.finish is FinishReason.ABORT:
        return error_response(503, "request aborted", err_type="ServiceUnavailableError")
    body = shape.full("".join(texts), token_ids, final, outcome.answer)
    return Response(orjson.dumps(body), media_type="application/json")


async def stream(
    worker: Worker,
    req: EngineRequest,
    shape: ResponseShape,
    *,
    include_usage: bool,
    continuous: bool,
) -> AsyncIterator[bytes]:
    """The answer as SSE chunks, ``[DONE]`` last; an engine error or abort ends it early."""
    engine = worker.engine
    # vLLM sends the prompt's ids once (return_token_ids): chat on its role chunk, completions
    # in the first choice; a migrating stream's continuation starts from them.
    prompt_ids: list[int] | None = list(req.prompt_ids) if shape.return_token_ids else None
    if shape.chat:
        yield sse(shape.chunk(None, role=True, prompt_token_ids=prompt_ids))
        prompt_ids = None
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
        yield sse(shape.chunk(out, usage_body=live, prompt_token_ids=prompt_ids))
        prompt_ids = None
    if (
        final is not None
        and include_usage
        and final.finish not in (FinishReason.ERROR, FinishReason.ABORT)
    ):
        yield sse(shape.chunk(None, usage_body=usage(final)))
    yield sse("[DONE]")
