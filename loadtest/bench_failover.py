"""What following a stream for failover costs per chunk, against relaying its bytes as they are.

With ``failover.max_migrations`` > 0 the relay splits the consumer's stream into events, parses
each chunk, records it and re-encodes it (:mod:`pdproxy.request.continuation`); without failover it
passes the transport chunks on. This times both (and, as a floor for any follower, parsing
each event once) over the same vLLM-shaped stream (a 64-token
chat answer with continuous usage, cut into transport chunks of ``--cut`` bytes), interleaved
``--rounds`` times, and prints µs per chunk and the ratio to the plain relay in the same run::

    python -m loadtest.bench_failover [--rounds 5] [--streams 2000] [--cut 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson

from pdproxy.request.stream_ledger import ChunkShaper, EventSplitter, StreamLedger, event_data


def _stream(tokens: int) -> bytes:
    ident = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
             "created": 1_700_000_000, "model": "meta-llama/Llama-3.1-8B-Instruct"}  # fmt: skip
    out = [
        b"data: " + orjson.dumps({**ident, "choices": [{"index": 0, "delta": {"role": "assistant",
        "content": ""}, "logprobs": None, "finish_reason": None}]}) + b"\n\n"
    ]  # fmt: skip
    for i in range(tokens):
        choice = {"index": 0, "delta": {"content": " word"}, "logprobs": None,
                  "finish_reason": "length" if i == tokens - 1 else None}  # fmt: skip
        usage = {"prompt_tokens": 812, "completion_tokens": i + 1, "total_tokens": 813 + i}
        out.append(
            b"data: " + orjson.dumps({**ident, "choices": [choice], "usage": usage}) + b"\n\n"
        )
    usage = {"prompt_tokens": 812, "completion_tokens": tokens, "total_tokens": 812 + tokens}
    out.append(b"data: " + orjson.dumps({**ident, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _plain(pieces: list[bytes]) -> int:
    sent = 0
    for piece in pieces:
        sent += len(piece)  # the relay hands each transport chunk to the server as it is
    return sent


def _parsed(pieces: list[bytes]) -> int:
    """The least any follower does: parse each event's JSON once."""
    n = 0
    for piece in pieces:
        for event in piece.split(b"\n\n")[:-1]:
            if event != b"data: [DONE]":
                n += len(orjson.loads(event[6:]))
    return n


def _followed(pieces: list[bytes]) -> int:
    ledger = StreamLedger()
    shaper = ChunkShaper(ledger, continuation=False, client_usage=True, client_continuous=False)
    splitter = EventSplitter()
    sent = 0
    for piece in pieces:
        for event in splitter.feed(piece):
            data = event_data(event)
            if data is None or data == b"[DONE]":
                sent += len(event)
                continue
            out = shaper.shape(orjson.loads(data))
            if out:
                sent += len(out)
    return sent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cut", type=int, default=4096, help="transport chunk size (bytes)")
    args = parser.parse_args(argv)
    stream = _stream(args.tokens)
    events = stream.count(b"\n\n")
    # One SSE event per transport chunk, as engines flush them, unless --cut is smaller.
    pieces = [e + b"\n\n" for e in stream.split(b"\n\n")[:-1]]
    if args.cut < max(len(p) for p in pieces):
        pieces = [stream[i : i + args.cut] for i in range(0, len(stream), args.cut)]
    times: dict[str, list[float]] = {"plain": [], "parsed": [], "followed": []}
    for _ in range(args.rounds):
        for name, run in (("plain", _plain), ("parsed", _parsed), ("followed", _followed)):
            t0 = time.process_time()
            for _ in range(args.streams):
                run(pieces)
            times[name].append((time.process_time() - t0) / (args.streams * events) * 1e6)
    plain, parsed, followed = (statistics.median(times[k]) for k in ("plain", "parsed", "followed"))
    print(f"stream: {events} events, {len(stream)} bytes, {len(pieces)} transport chunks")
    print(f"plain relay      {plain:7.3f} us/event (median of {args.rounds})")
    print(f"parse only       {parsed:7.3f} us/event (orjson.loads per event)")
    print(f"failover follow  {followed:7.3f} us/event  (+{followed - plain:.3f} us/event)")
    print(f"ratio follow/parse-only: {followed / parsed:.2f}x")


if __name__ == "__main__":
    main()
