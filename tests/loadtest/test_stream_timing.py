from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from loadtest.stream_timing import (
    ErrorKind,
    SSEDecoder,
    StreamTimer,
    classify_status,
    record_from_json,
)


def _event(text: str, usage: dict[str, object] | None = None) -> str:
    doc: dict[str, object] = {"choices": [{"index": 0, "text": text}] if text else []}
    if usage:
        doc["usage"] = usage
    return json.dumps(doc)


STREAM = (
    b": keep-alive\r\n\r\n"
    + b"data: " + _event(" a").encode() + b"\r\n\r\n"
    + b"event: message\ndata: " + _event(" b").encode() + b"\n\n"
    + b"data: [DONE]\n\n"
)  # fmt: skip


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8))
def test_sse_decoding_does_not_depend_on_chunk_boundaries(cuts: list[int]) -> None:
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    decoder = SSEDecoder()
    events = []
    for lo, hi in itertools.pairwise(bounds):
        events += decoder.feed(STREAM[lo:hi])
    events += decoder.flush()
    assert events == [_event(" a"), _event(" b"), "[DONE]"]


def test_multi_line_data_is_joined_and_unterminated_event_flushed() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: one\ndata: two\n\ndata: tail") == ["one\ntwo"]
    assert decoder.flush() == ["tail"]


def test_timer_measures_ttft_itl_tpot_from_chunk_arrival_times() -> None:
    timer = StreamTimer("t", start=10.0, expected_prompt_tokens=7)
    timer.on_payload(_event(""), 10.05)  # role-only chunk: not a token
    timer.on_payload(_event(" a"), 10.1)
    timer.on_payload(_event(" b"), 10.3)
    timer.on_payload(_event(" c"), 10.4)
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    timer.on_payload(_event("", usage), 10.41)
    timer.on_payload("[DONE]", 10.42)
    record = timer.finish(10.5)
    assert record.ok and record.text == " a b c"
    assert record.ttft_s is not None and abs(record.ttft_s - 0.1) < 1e-9
    assert [round(x, 9) for x in record.itl_s] == [0.2, 0.1]
    assert record.prompt_tokens == 9 and record.output_tokens == 3 and record.cached_tokens == 8
    assert record.tpot_s is not None and abs(record.tpot_s - 0.2) < 1e-9  # (0.5 - 0.1) / 2


def test_timer_counts_chunks_when_usage_is_absent_and_reads_chat_deltas() -> None:
    timer = StreamTimer("t", start=0.0, expected_prompt_tokens=7)
    for i, t in enumerate((0.1, 0.2)):
        doc = {"choices": [{"index": 0, "delta": {"content": f"x{i}"}}]}
        timer.on_payload(json.dumps(doc), t)
    timer.on_payload("[DONE]", 0.3)
    record = timer.finish(0.3)
    assert record.ok and record.output_tokens == 2 and record.prompt_tokens == 7
    assert record.text == "x0x1"


def test_timer_classifies_stream_failures() -> None:
    cut = StreamTimer("t", 0.0)
    cut.on_payload(_event(" a"), 0.1)
    assert cut.finish(0.2).error is ErrorKind.TRUNCATED
    err = StreamTimer("t", 0.0)
    err.on_payload(json.dumps({"error": {"message": "boom"}}), 0.1)
    err.on_payload("[DONE]", 0.1)
    bad = err.finish(0.2)
    assert bad.error is ErrorKind.STREAM_ERROR and "boom" in bad.error_detail and not bad.ok
    empty = StreamTimer("t", 0.0)
    empty.on_payload("[DONE]", 0.1)
    assert empty.finish(0.1).error is ErrorKind.EMPTY
    junk = StreamTimer("t", 0.0)
    junk.on_payload("not json", 0.1)
    junk.on_payload("[DONE]", 0.1)
    assert junk.finish(0.1).error is ErrorKind.BAD_RESPONSE


def test_status_classes() -> None:
    assert classify_status(200) is None
    assert classify_status(429) is ErrorKind.RATE_LIMITED
    assert classify_status(400) is ErrorKind.CLIENT_ERROR
    assert classify_status(503) is ErrorKind.SERVER_ERROR


def test_non_streaming_record() -> None:
    body = json.dumps({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 2}},
    }).encode()  # fmt: skip
    record = record_from_json("t", 1.0, 1.5, body)
    assert record.ok and record.text == "hi" and record.output_tokens == 5
    assert record.cached_tokens == 2
    assert record.ttft_s == 0.5 and record.tpot_s is None and not record.streamed
    assert record_from_json("t", 0, 1, b"<html>").error is ErrorKind.BAD_RESPONSE
    assert record_from_json("t", 0, 1, b'{"x": 1}').error is ErrorKind.BAD_RESPONSE
