"""The engine on its own: prefix caching, eviction, batching, stop conditions, sampling, abort."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from kvtier.keys import BlockHasher
from kvtier.worker.backends.base import StepInput
from kvtier.worker.build import build_engine
from kvtier.worker.engine import Engine, EngineConfig
from kvtier.worker.errors import ContextTooLong
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.kv_layout import KVGroupSpec
from kvtier.worker.page_pool import PagePool
from kvtier.worker.request import FinishReason, StepOutput
from kvtier.worker.sampling import SamplingParams

from .conftest import small_settings

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


async def started(**overrides: Any) -> Engine:
    engine = build_engine(small_settings(**overrides))
    await engine.start()
    return engine


def tokens(outs: Sequence[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def baseline(engine: Engine) -> None:
    for pool in engine.kv.pools:
        assert pool.refcounts() == [0] * pool.num_pages


@pytest.fixture(params=["tiny", "sim"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    eng = await started(model=request.param)
    try:
        yield eng
    finally:
        await eng.close()


PROMPT = list(b"A system prompt that is long enough to span several blocks of sixteen. " * 2)


async def test_second_request_hits_the_prefix_cache_and_agrees(engine: Engine) -> None:
    cold = await engine.generate("a", PROMPT, GREEDY)
    warm = await engine.generate("b", PROMPT, GREEDY)
    assert cold[-1].num_cached_tokens == 0
    bs = engine.kv.block_size
    assert warm[-1].num_cached_tokens == (len(PROMPT) - 1) // bs * bs
    assert tokens(warm) == tokens(cold)
    assert engine.stats.prefix_hit_tokens == warm[-1].num_cached_tokens
    baseline(engine)


async def test_shared_prefix_then_divergent_suffix(engine: Engine) -> None:
    await engine.generate("a", PROMPT + list(b"first question?"), GREEDY)
    out = await engine.generate("b", PROMPT + list(b"second one!"), GREEDY)
    assert out[-1].num_cached_tokens == len(PROMPT) // 16 * 16


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_chunked_prefill_and_cached_prefix_equal_one_pass(model: str) -> None:
    prompt = list(range(32, 127)) * 3  # 285 tokens: crosses the 64-token window
    one_pass = await started(model=model)
    chunked = await started(model=model, max_batched_tokens=40)
    prefixed = await started(model=model)
    try:
        ref = tokens(await one_pass.generate("r", prompt, GREEDY))
        assert tokens(await chunked.generate("c", prompt, GREEDY)) == ref
        await prefixed.generate("p", prompt[:150], GREEDY)  # leaves a cached 144-token prefix
        again = await prefixed.generate("c2", prompt, GREEDY)
        assert again[-1].num_cached_tokens == 144
        assert tokens(again) == ref
    finally:
        for eng in (one_pass, chunked, prefixed):
            await eng.close()


async def test_eviction_reuses_least_recently_freed_pages() -> None:
    engine = await started(model="sim", num_pages=20)
    try:
        a = list(b"a" * 100)
        b = list(b"b" * 100)
        await engine.generate("a", a, GREEDY)
        await engine.generate("b", b, GREEDY)  # 7 pages each, 6 of them cached afterwards
        await engine.generate("a2", a, GREEDY)  # a's pages become the most recently freed
        await engine.generate("c", list(b"c" * 150), GREEDY)  # 10 pages: evicts b's first
        assert engine.kv.pools[0].evictions > 0
        assert (await engine.generate("a3", a, GREEDY))[-1].num_cached_tokens == 96
        assert (await engine.generate("b2", b, GREEDY))[-1].num_cached_tokens < 96
        baseline(engine)
    finally:
        await engine.close()


async def test_decode_steps_are_batched_across_running_requests() -> None:
    engine = await started(model="sim", sim_decode_ms_per_step=2.0)
    try:
        prompts = [list(f"request number {i} asks something".encode()) for i in range(6)]
        params = SamplingParams(max_tokens=12, temperature=0.0)
        single = [tokens(await engine.generate(f"s{i}", p, params)) for i, p in enumerate(prompts)]
        steps_before = engine.steps
        together = await asyncio.gather(
            *(engine.generate(f"t{i}", p, params) for i, p in enumerate(prompts))
        )
        assert [tokens(o) for o in together] == single
        assert engine.max_batch_seen >= 4
        assert engine.steps - steps_before < 6 * 12  # far fewer steps than one per token
    finally:
        await engine.close()


async def test_stop_string_cuts_text_and_reports_it() -> None:
    engine = await started(model="sim")
    try:
        free = await engine.generate("f", PROMPT, SamplingParams(max_tokens=20, temperature=0))
        text = "".join(o.text for o in free)
        stop = text[5:7]
        cut = text.index(stop)
        params = SamplingParams(max_tokens=20, temperature=0, stop=(stop,))
        out = await engine.generate("s", PROMPT, params)
        assert "".join(o.text for o in out) == text[:cut]
        assert out[-1].finish is FinishReason.STOP and out[-1].stop_reason == stop
        assert free[-1].finish is FinishReason.LENGTH and free[-1].num_output_tokens == 20
    finally:
        await engine.close()


class _EosBackend:
    """A backend fake: writes nothing, emits ``A`` until it has seen ``n`` of them, then EOS."""

    name = "eos-fake"
    vocab_size = 257
    eos_token_id = 256
    block_size = 16

    def __init__(self, n: int) -> None:
        self.n = n
        self.groups = (KVGroupSpec(0, (0,), None, (1,), torch.uint8),)

    def modeled_latency_s(self, prefill_tokens: int, decode_sequences: int) -> float:
        return 0.0

    def forward(self, batch: Sequence[StepInput], pools: Sequence[PagePool]) -> torch.Tensor:
        logits = torch.zeros(len(batch), self.vocab_size)
        for i, seq in enumerate(batch):
            logits[i, 256 if seq.token_ids.count(65) >= self.n else 65] = 1.0
        return logits


async def test_eos_stops_unless_ignored() -> None:
    backend = _EosBackend(3)
    kv = KVCache(backend.groups, 16, 32, torch.device("cpu"))
    engine = Engine(backend, kv, BlockHasher("fake"), EngineConfig(max_model_len=256))
    await engine.start()
    try:
        out = await engine.generate("e", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0))
        assert "".join(o.text for o in out) == "AAA"
        assert out[-1].finish is FinishReason.STOP and out[-1].stop_reason is None
        ignoring = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        out = await engine.generate("i", [1, 2, 3], ignoring)
        assert out[-1].finish is FinishReason.LENGTH and out[-1].num_output_tokens == 6
        assert kv.pools[0].refcounts() == [0] * 32
    finally:
        await engine.close()


async def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    engine = await started(model="tiny")
    try:

        def params(seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed)

        a = tokens(await engine.generate("a", PROMPT, params(7)))
        b = tokens(await engine.generate("b", PROMPT, params(7)))
        c = tokens(await engine.generate("c", PROMPT, params(8)))
        assert a == b
        assert a != c
    finally:
        await engine.close()


async def test_abort_mid_generation_frees_pages_and_others_continue() -> None:
    engine = await started(model="sim", sim_decode_ms_per_step=5.0)
    try:
        long = engine.new_request("long", PROMPT, SamplingParams(max_tokens=200, temperature=0))
        engine.submit(long)
        stream = engine.stream(long)
        first = await anext(stream)
        assert first.finish is None
        other = asyncio.create_task(engine.generate("other", PROMPT[:40], GREEDY))
        await stream.aclose()  # the client went away
        done = await other
        assert done[-1].finish is FinishReason.LENGTH
        for _ in range(100):
            if engine.stats.aborted_requests:
                break
            await asyncio.sleep(0.01)
        assert engine.stats.aborted_requests == 1
        assert engine.num_running == 0
        baseline(engine)
    finally:
        await engine.close()


async def test_context_length_is_enforced() -> None:
    engine = await started(model="sim", max_model_len=128)
    try:
        with pytest.raises(ContextTooLong):
            engine.new_request("x", [65] * 120, SamplingParams(max_tokens=16))
        with pytest.raises(ContextTooLong):
            engine.new_request("y", [], SamplingParams(max_tokens=1))
    finally:
        await engine.close()


async def test_waiting_requests_are_admitted_as_pages_free_up() -> None:
    engine = await started(model="sim", num_pages=12, max_model_len=160)
    try:
        params = SamplingParams(max_tokens=16, temperature=0)
        prompts = [list(f"{i}".encode() * 100) for i in range(4)]  # 8 pages each: one at a time
        outs = await asyncio.gather(
            *(engine.generate(str(i), p, params) for i, p in enumerate(prompts))
        )
        assert all(o[-1].finish is FinishReason.LENGTH for o in outs)
        baseline(engine)
    finally:
        await engine.close()


async def test_random_mix_of_shared_prefixes_aborts_and_pressure_returns_to_baseline() -> None:
    """Scenario: many requests over few pages, shared prefixes, some clients leaving early.
    Finished requests equal their solo runs; every page is back at zero references."""
    import random

    rng = random.Random(5)
    roots = [list(f"root {r} says: ".encode()) * 4 for r in range(3)]
    jobs = [
        (rng.choice(roots) + list(f"tail {i}".encode()), rng.randint(1, 20), rng.random() < 0.3)
        for i in range(24)
    ]
    reference = await started(model="sim")
    engine = await started(model="sim", num_pages=40, max_running=6, sim_decode_ms_per_step=1.0)
    try:
        expected = [
            tokens(
                await reference.generate(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0))
            )
            for i, (p, n, _) in enumerate(jobs)
        ]

        async def job(i: int) -> list[int] | None:
            prompt, n, leave = jobs[i]
            req = engine.new_request(f"j{i}", prompt, SamplingParams(max_tokens=n, temperature=0))
            engine.submit(req)
            got: list[int] = []
            async with contextlib.aclosing(engine.stream(req)) as stream:
                async for out in stream:
                    got.extend(out.token_ids)
                    if leave and len(got) >= 1:
                        return None  # closing the stream early aborts the request
            return got

        results = await asyncio.gather(*(job(i) for i in range(len(jobs))))
        for got, want in zip(results, expected, strict=True):
            if got is not None:
                assert got == want
        for _ in range(100):
            if engine.num_running == 0 and engine.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        baseline(engine)
        assert engine.stats.prefix_hit_tokens > 0
    finally:
        await reference.close()
        await engine.close()
