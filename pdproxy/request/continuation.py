"""Continuation legs: the client's request, resumed after the tokens it has already received.

How a continuation is expressed (the choice that keeps greedy output identical):

- exact by construction, from token ids: the first leg asks the consumer for them
  (``return_token_ids``, vLLM's extension; ``failover.token_ids``, on by default) and the ledger
  records the prompt's ids (``prompt_token_ids`` of the first chunk) and every delivered token's
  ids. ``/v1/completions`` then continues with the token-id prompt ``prompt ids + generated
  ids``, whatever the client's prompt was; ``/v1/chat/completions`` sends the same ids as
  ``kv_transfer_params.prompt_token_ids`` (vLLM >= 0.32 feeds them to the engine instead of
  rendering ``messages``: its decode-side token reuse), with the text form below alongside for
  an engine that ignores them. The ids are stripped from the client's chunks unless it asked
  for them itself;
- from text, when the consumer sent no ids: ``/v1/completions`` the prompt plus the generated
  text (or, for a token-id prompt, nothing: it cannot continue); ``/v1/chat/completions`` the
  messages plus an assistant message holding the generated text, with
  ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's extension; the
  reference worker accepts the same). A client's own trailing assistant message under
  ``continue_final_message`` gets the text appended instead.

Text continuation is exact when the engine tokenizes ``prompt + generated`` into the prompt's
tokens followed by the generated ones: always with the reference worker's byte tokenizer, and for
BPE tokenizers unless a merge crosses the boundary (then greedy output may differ after the
migration point), and for chat only if the template renders an open assistant message exactly as
the generation prompt plus the text. Token ids avoid both. What ids cannot make exact: the text
at a cut inside an unfinished UTF-8 character or a possible stop string: what the first consumer
held back is not re-sent, because the continuation's detokenizer treats those tokens as prompt
(and vLLM 0.32's once emitted prompt text there); sampling with
temperature > 0 restarts its random stream; and a stop string that straddles the migration point
is not seen. Sampling settings are sent unchanged; ``max_tokens``/``max_completion_tokens``
become what remains, ``min_tokens`` what is still owed.

Refused (the stream ends with an error event, as without failover): ``n``/``best_of`` > 1
(choices interleave), ``logprobs``/``top_logprobs``/``prompt_logprobs``/``echo`` (a
continuation would report the already generated tokens as prompt), tools, function calls and
structured output (``response_format`` other than text, ``guided_*``, ``structured_outputs``:
parser and grammar state cannot be resumed), ``suffix``, and a stream whose running token count
the consumer did not report.
"""

from __future__ import annotations

from typing import Any

from pdproxy.front.intake import Endpoint
from pdproxy.request.stream_ledger import StreamLedger

CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}

_STRUCTURED = (
    "tools",
    "functions",
    "function_call",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "prompt_logprobs",
    "suffix",
)


def _set(data: dict[str, Any], name: str) -> bool:
    """The client set ``name`` to something other than null/false/0/empty."""
    value = data.get(name)
    return value is not None and value is not False and value not in (0, [], {})


def migration_refusal(endpoint: Endpoint, data: dict[str, Any]) -> str | None:
    """Why a request's stream could not migrate exactly (None: it can)."""
    for name in ("n", "best_of"):
        value = data.get(name, 1)
        if value is not None and value != 1:
            return f"{name} > 1"
    for name in ("logprobs", "top_logprobs", "echo", *_STRUCTURED):
        if _set(data, name):
            return name
    choice = data.get("tool_choice")
    if choice is not None and choice != "none":
        return "tool_choice"
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    if endpoint == Endpoint.COMPLETIONS:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return None
        if isinstance(prompt, str) or _token_ids(prompt) is not None:
            return None
        return "prompt shape"
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages shape"
    return None


def _token_ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


def first_leg(data: dict[str, Any], token_ids: bool = False) -> dict[str, Any]:
    """The client's body, asking the consumer for its running token count and, with
    ``token_ids``, for the prompt's and every token's ids (the proxy strips both again unless
    the client asked for them)."""
    out = dict(data)
    opts = data.get("stream_options")
    out["stream_options"] = {**(opts if isinstance(opts, dict) else {}), **CONTINUOUS_USAGE}
    if token_ids:
        out["return_token_ids"] = True
    return out


def asked_token_ids(data: dict[str, Any]) -> bool:
    """The client itself asked for ``token_ids`` (and ``prompt_token_ids``) in its chunks."""
    return data.get("return_token_ids") is True


def continuation_body(
    endpoint: Endpoint, data: dict[str, Any], ledger: StreamLedger, token_ids: bool = False
) -> dict[str, Any] | str:
    """The body of a continuation leg, or why there can be none. ``token_ids``: ask this leg
    for ids too (see :func:`first_leg`), so that a second migration is exact as well."""
    if not ledger.counted and ledger.text:
        return "token count not reported"
    done = ledger.completion_tokens
    out = first_leg(data, token_ids)
    out.pop("kv_transfer_params", None)  # the continuation prefills on its own consumer
    for name in ("max_tokens", "max_completion_tokens"):
        limit = data.get(name)
        if type(limit) is int:
            if limit - done < 1:
                return "no tokens left"
            out[name] = limit - done
    for name in ("min_tokens", "min_completion_tokens"):
        floor = data.get(name)
        if type(floor) is int:
            out[name] = max(floor - done, 0)
    if not done and not ledger.text:
        return out  # nothing generated yet: the request itself, sent again
    text = ledger.generated_text
    exact = ledger.exact_ids(done)
    if endpoint == Endpoint.COMPLETIONS:
        if exact is not None:
            out["prompt"] = exact
            return out
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            out["prompt"] = prompt + text
            return out
        ids = _token_ids(prompt)
        if ids is None or not ledger.token_ids_complete or len(ledger.token_ids) != done:
            return "token ids of the generated text unknown"
        out["prompt"] = ids + ledger.token_ids
        return out
    messages = list(data["messages"])
    last = messages[-1]
    if (
        data.get("continue_final_message") is True
        and isinstance(last, dict)
        and last.get("role") == "assistant"
    ):
        content = last.get("content")
        if isinstance(content, str) or content is None:
            messages[-1] = {**last, "content": (content or "") + text}
        elif isinstance(content, list):
            messages[-1] = {**last, "content": [*content, {"type": "text", "text": text}]}
        else:
            return "assistant message shape"
    else:
        messages.append({"role": "assistant", "content": text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    if exact is not None:
        out["kv_transfer_params"] = {"prompt_token_ids": exact}
    return out
