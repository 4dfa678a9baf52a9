"""OpenAI-shaped response bodies, stream chunks and errors (the shapes vLLM's server emits)."""

from __future__ import annotations

import json
import time
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from kvtier.worker.request import FinishReason, StepOutput


class ErrorJSONResponse(JSONResponse):
    """Error messages echo client text, which may hold lone surrogates (not encodable as
    UTF-8, and rejected by strict JSON parsers even when escaped): they become ``?``."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", errors="replace")


def error_response(
    status: int, message: str, *, err_type: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return ErrorJSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": param, "code": status}},
    )


def usage(final: StepOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": final.num_prompt_tokens,
        "completion_tokens": final.num_output_tokens,
        "total_tokens": final.num_prompt_tokens + final.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens},
    }


def finish_reason(out: StepOutput) -> str | None:
    if out.finish is None:
        return None
    return "length" if out.finish is FinishReason.LENGTH else "stop"


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


class ResponseShape:
    """Builds the bodies of one request, for ``/v1/completions`` or ``/v1/chat/completions``."""

    def __init__(self, *, chat: bool, request_id: str, model: str, return_token_ids: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids

    def full(
        self,
        text: str,
        token_ids: list[int],
        final: StepOutput,
        kv_transfer_params: dict[str, object] | None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
            choice["prompt_logprobs"] = None
        choice["finish_reason"] = finish_reason(final)
        choice["stop_reason"] = final.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(final),
            "kv_transfer_params": kv_transfer_params,
        }

    def chunk(
        self,
        out: StepOutput | None,
        *,
        role: bool = False,
        usage_body: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk: the assistant role (chat), a delta, or (``out`` None) usage only.
        ``prompt_token_ids`` where vLLM puts them: chat at the top, completions in the choice."""
        choices: list[dict[str, Any]] = []
        if out is not None or role:
            choice: dict[str, Any] = {"index": 0, "logprobs": None}
            text = out.text if out is not None else ""
            if self.chat:
                delta: dict[str, Any] = {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                choice["delta"] = delta
            else:
                choice["text"] = text
            choice["finish_reason"] = finish_reason(out) if out is not None else None
            if out is not None and out.finish is not None:
                choice["stop_reason"] = out.stop_reason
            if self.return_token_ids and out is not None:
                choice["token_ids"] = list(out.token_ids)
            if prompt_token_ids is not None and not self.chat:
                choice["prompt_token_ids"] = prompt_token_ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_body,
        }
        if prompt_token_ids is not None and self.chat:
            body["prompt_token_ids"] = prompt_token_ids
        return body
