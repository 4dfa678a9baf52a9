"""The two OpenAI generation endpoints (``/v1/completions``, ``/v1/chat/completions``) for one
rank's worker: a request's checks, its KV leg (``kv_transfer_params``), its engine request and
the KV it installs before it runs; :mod:`kvtier.worker.server.delivery` sends the output.

Ids a caller sends (``x-request-id``, ``kv_request_id``, hosts) are at most
:data:`kvtier.worker.kv_params.MAX_ID_CHARS` long (400 beyond); the producers a consumer leg
may name are :mod:`kvtier.worker.peers`'s.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvtier.worker.connector import ProducerOutcome
from kvtier.worker.errors import (
    EngineClosed,
    InvalidRequest,
    KVTransferParamsError,
    KVTransferRefused,
)
from kvtier.worker.kv_params import (
    MAX_ID_CHARS,
    ConsumerLeg,
    Leg,
    ProducerLeg,
    parse_leg,
    pull_source,
)
from kvtier.worker.peers import PeerAllowlist
from kvtier.worker.request import PromptKVHook
from kvtier.worker.sampling import SamplingParams
from kvtier.worker.server import delivery
from kvtier.worker.server.openai_format import ResponseShape, error_response
from kvtier.worker.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from kvtier.worker.worker import Worker

logger = logging.getLogger(__name__)


class CompletionHandler:
    """Request handling shared by both OpenAI generation endpoints, for one worker."""

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
        if body.continue_final_message:
            if body.add_generation_prompt:
                return error_response(
                    400,
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if body.messages[-1].role != "assistant":
                return error_response(
                    400,
                    "continue_final_message needs a final assistant message",
                    param="continue_final_message",
                )
        reused = _reused_prompt_ids(body)
        if isinstance(reused, str):
            return error_response(400, reused, param="kv_transfer_params.prompt_token_ids")
        vocab = self.worker.engine.backend.vocab_size
        if reused is not None and any(not 0 <= t < vocab for t in reused):
            return error_response(
                400,
                f"prompt token ids must be integers in [0, {vocab})",
                param="kv_transfer_params.prompt_token_ids",
            )
        if reused is not None:
            ids = reused
        else:
            text = self.worker.tokenizer.apply_chat_template(
                [(m.role, m.text()) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
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
        if body.cache_salt and req.hashes.hashes:  # likewise: block 0's event names its salt
            self.worker.events.mark_salted(req.hashes.hashes[0], body.cache_salt)
        try:
            source = pull_source(leg)
            if isinstance(leg, ConsumerLeg) and connector is not None:
                await connector.load_remote(req, leg)
            elif source is not None and connector is not None:
                await connector.pull_remote(req, source)
            engine.submit(req)
        except EngineClosed as exc:
            return error_response(503, str(exc), err_type="ServiceUnavailableError")
        except BaseException:
            engine.kv.release_pinned(req)  # never submitted: its installed pages go back
            raise
        if body.stream:
            opts = body.stream_options
            return StreamingResponse(
                delivery.stream(
                    self.worker,
                    req,
                    shape,
                    include_usage=opts.include_usage if opts else False,
                    continuous=opts.continuous_usage_stats if opts else False,
                ),
                media_type="text/event-stream",
            )
        supply_id = leg.kv_request_id if isinstance(leg, ProducerLeg) and hook else None
        return await delivery.collect(
            self.worker, req, shape, request, outcome=outcome, supply_id=supply_id
        )

    def _leg(self, body: _Sampling, response_id: str, request_id: str) -> Leg | None:
        params = body.kv_transfer_params
        if not params:
            return None
        try:
            leg = parse_leg(params, nixl_request_id=f"{response_id}-0")
            refused = self.peers.refused(leg)
            if refused is not None:
                raise KVTransferRefused(
                    f"kv_transfer_params: {refused} is not in this worker's p2p_allowed_peers",
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


def _reused_prompt_ids(body: ChatCompletionRequest) -> list[int] | str | None:
    """vLLM's decode-side token reuse: ``kv_transfer_params.prompt_token_ids`` replaces the
    rendered ``messages`` (popped, so the KV leg never sees it). None: render; a str: why the
    ids are malformed (vLLM answers 400 too)."""
    params = body.kv_transfer_params
    if not isinstance(params, dict) or "prompt_token_ids" not in params:
        return None
    ids = params.pop("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or any(type(t) is not int for t in ids):
        return "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids"
    return ids
