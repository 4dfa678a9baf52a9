"""Continuation legs: the client's request, resumed after the tokens it has already received.

How a continuation is expressed (the choice that keeps greedy output identical):

- ``/v1/completions``: the prompt plus the generated text (a string prompt), or the prompt's
  token ids plus the generated token ids (a token-id prompt, when every chunk carried
  ``token_ids``: the client asked for ``return_token_ids``);
- ``/v1/chat/completions``: the messages plus an assistant message holding the generated text,
  with ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's
  extension; the reference worker accepts the same). A client's own trailing assistant message
  under ``continue_final_message`` gets the text appended instead.

Text continuation is exact when the engine tokenizes ``prompt + generated`` into the prompt's
tokens followed by the generated ones: always with the reference worker's byte tokenizer, and for
BPE tokenizers unless a merge crosses the boundary (then greedy output may differ after the
migration point; token-id prompts avoid it). Sampling settings are sent unchanged;
``max_tokens``/``max_completion_tokens`` become what remains, ``min_tokens`` what is still owed.

Refused (the stream ends with an error event, as without failover): ``n``/``best_of`` > 1
(choices interleave), ``logprobs``/``top_logprobs``/``prompt_logprobs``/``echo`` (a
continuation would report the already generated tokens as prompt), tools, function calls and
structured output (``response_format`` other than text, ``guided_*``, ``structured_outputs``:
parser and grammar state cannot be resumed), ``suffix``, and a stream whose running token count
the consumer did not report. A stop string that straddles the migration point is not seen.
"""

from __future__ import annotations

from typing import Any

from pdproxy.stream_ledger import StreamLedger

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


def migration_refusal(route: str, data: dict[str, Any]) -> str | None:
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
    if route == "completions":
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


def first_leg(data: dict[str, Any]) -> dict[str, Any]:
    """The client's body, asking the consumer for its running token count (which the proxy
    strips again unless the client asked for it)."""
    out = dict(data)
    opts = data.get("stream_options")
    out["stream_options"] = {**(opts if isinstance(opts, dict) else {}), **CONTINUOUS_USAGE}
    return out


def continuation_body(
    route: str, data: dict[str, Any], ledger: StreamLedger
) -> dict[str, Any] | str:
    """The body of a continuation leg, or why there can be none."""
    if not ledger.counted and ledger.text:
        return "token count not reported"
    done = ledger.completion_tokens
    out = first_leg(data)
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
    if route == "completions":
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
    return out
