"""The engine: an asyncio loop that admits prefills and batches decode steps.

All engine state (queues, pools, reservations) is touched only by coroutines on the event loop;
the backend's forward pass runs in one dedicated thread and only reads page tables handed to it
and writes the pages those tables name (which the step's requests hold), so the server stays
responsive while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.keys import BlockHasher
from kvtier.worker.backends.base import ComputeBackend, StepInput
from kvtier.worker.errors import ContextTooLong, EngineClosed
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.lora import LoraAdapter
from kvtier.worker.request import (
    EngineRequest,
    FinishReason,
    PromptKV,
    PromptKVHook,
    RequestState,
    StepOutput,
)
from kvtier.worker.sampling import SamplingParams, make_generator, sample
from kvtier.worker.stats import EngineStats

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduling limits of the engine."""

    max_model_len: int = 4096
    max_running: int = 64
    max_batched_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class _Planned:
    req: EngineRequest
    end: int
    samples: bool


class Engine:
    """Runs requests on a backend over a :class:`KVCache`."""

    def __init__(
        self,
        backend: ComputeBackend,
        kv: KVCache,
        hasher: BlockHasher,
        config: EngineConfig,
        stats: EngineStats | None = None,
    ) -> None:
        self.backend = backend
        self.kv = kv
        self.hasher = hasher
        self.config = config
        self.stats = stats if stats is not None else EngineStats()
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._hooks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._admitting = True
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-engine")
        self.steps = 0
        self.max_batch_seen = 0

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvtier-engine-loop")

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._hooks:
            await asyncio.gather(*self._hooks, return_exceptions=True)
        for req in [*self._waiting, *self._running]:
            self._finish(req, FinishReason.ABORT, "")
        self._waiting.clear()
        self._running.clear()
        self._executor.shutdown(wait=True)

    def stop_admitting(self) -> None:
        """Refuse new requests (:class:`EngineClosed`) from now on; those in flight run on."""
        self._admitting = False

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting, give the requests in flight up to ``timeout_s`` to finish, then
        abort the rest (their streams end with ``FinishReason.ABORT``)."""
        self.stop_admitting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._waiting or self._running:
            if loop.time() >= deadline:
                left = [*self._waiting, *self._running]
                logger.warning("shutdown: aborting %d requests still in flight", len(left))
                for req in left:
                    self.abort(req)
                return
            await asyncio.sleep(_DRAIN_POLL_S)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- requests ------------------------------------------------------------------------------
    def new_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        on_prompt_kv: PromptKVHook | None = None,
        lora: LoraAdapter | None = None,
    ) -> EngineRequest:
        """A request checked against the context length (raises :class:`ContextTooLong`)."""
        if self._closing or not self._admitting:
            raise EngineClosed("engine is shutting down")
        total = len(prompt_ids) + params.max_tokens
        if not prompt_ids:
            raise ContextTooLong("the prompt is empty", param="prompt")
        if total > self.config.max_model_len or not self.kv.fits_ever(total):
            raise ContextTooLong(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(prompt_ids)} in the messages, "
                f"{params.max_tokens} in the completion).",
                param="messages",
            )
        hashes = self.hasher.start(cache_salt, lora.name if lora is not None else None)
        hashes.extend(prompt_ids)
        return EngineRequest(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            hashes=hashes,
            num_groups=len(self.kv.pools),
            on_prompt_kv=on_prompt_kv,
            lora_key=lora.key if lora is not None else b"",
            generator=make_generator(params),
        )

    def submit(self, req: EngineRequest) -> None:
        if self._closing:
            self.kv.release_pinned(req)
            raise EngineClosed("engine is shutting down")
        self._waiting.append(req)
        self._wake.set()

    def abort(self, req: EngineRequest) -> None:
        if req.state is not RequestState.FINISHED:
            req.abort_requested = True
            self._wake.set()

    async def stream(self, req: EngineRequest) -> AsyncIterator[StepOutput]:
        """The request's outputs until it finishes; leaving early aborts it."""
        try:
            while True:
                out = await req.outputs.get()
                yield out
                if out.finish is not None:
                    return
        finally:
            self.abort(req)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> list[StepOutput]:
        """Convenience: run one request to completion and return all its outputs."""
        req = self.new_request(request_id, prompt_ids, params)
        self.submit(req)
        return [out async for out in self.stream(req)]

    # -- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            self._reap_aborts()
            self._admit()
            plan = self._schedule()
            if not plan:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [
                StepInput(
                    token_ids=p.req.all_ids[: p.end],
                    start=p.req.num_computed,
                    page_tables=tuple(tuple(t) for t in p.req.page_tables),
                    block_hashes=tuple(p.req.hashes.hashes),
                    lora_key=p.req.lora_key,
                )
                for p in plan
            ]
            try:
                logits = await loop.run_in_executor(
                    self._executor, self.backend.forward, batch, self.kv.pools
                )
            except Exception:
                logger.exception("forward pass failed; failing %d requests", len(plan))
                for p in plan:
                    self._finish(p.req, FinishReason.ERROR, "", error="forward pass failed")
                continue
            prefill = sum(
                s.end - s.start for s, p in zip(batch, plan, strict=True) if not p.req.prompt_done
            )
            decodes = sum(1 for p in plan if p.req.prompt_done)
            delay = self.backend.modeled_latency_s(prefill, decodes)
            if delay > 0:
                await asyncio.sleep(delay)
            self.steps += 1
            self.max_batch_seen = max(self.max_batch_seen, len(plan))
            self._apply(plan, logits)

    def _reap_aborts(self) -> None:
        for req in [r for r in self._waiting if r.abort_requested]:
            self._waiting.remove(req)
            self._finish(req, FinishReason.ABORT, "")
        for req in [r for r in self._running if r.abort_requested]:
            self._finish(req, FinishReason.ABORT, "")

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            req = self._waiting[0]
            if not self.kv.try_admit(req):
                if not self._running and not self._hooks:
                    self._waiting.popleft()
                    self._finish(req, FinishReason.ERROR, "", error="KV cache exhausted")
                    continue
                return
            self._waiting.popleft()
            req.state = RequestState.RUNNING
            self._running.append(req)
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.prefix_hit_tokens += req.num_cached_tokens
            bs = self.kv.block_size
            missing = req.expected_remote_blocks - req.num_cached_tokens // bs
            if missing > 0:
                self.stats.recomputed_tokens += missing * bs
                logger.info(
                    "request %s: %d blocks expected from the producer are recomputed",
                    req.request_id,
                    missing,
                )

    def _schedule(self) -> list[_Planned]:
        budget = self.config.max_batched_tokens
        plan: list[_Planned] = []
        for req in self._running:
            if req.prompt_done:
                plan.append(_Planned(req, req.num_tokens, True))
                budget -= 1
        for req in self._running:
            if req.prompt_done or budget <= 0:
                continue
            end = min(len(req.prompt_ids), req.num_computed + budget)
            budget -= end - req.num_computed
            plan.append(_Planned(req, end, end == len(req.prompt_ids)))
        for p in plan:
            self.kv.ensure_pages(p.req, p.end)
        return plan

    def _apply(self, plan: Sequence[_Planned], logits: torch.Tensor) -> None:
        bs = self.kv.block_size
        for i, p in enumerate(plan):
            req = p.req
            first_new_block = req.num_computed // bs
            req.num_computed = p.end
            self.kv.register_full_blocks(req, first_new_block)
            if not p.samples or req.state is RequestState.FINISHED:
                continue
            token = sample(logits[i], req.params, req.generator)
            self._append_token(req, token)

    def _append_token(self, req: EngineRequest, token: int) -> None:
        assert req.stop_matcher is not None
        self.stats.generated_tokens += 1
        self._time_token(req)
        eos = self.backend.eos_token_id
        if eos is not None and token == eos and not req.params.ignore_eos:
            req.output_ids.append(token)
            text = req.stop_matcher.push(req.detok.flush()) + req.stop_matcher.finish()
            self._finish(req, FinishReason.STOP, text, token=token)
            return
        req.output_ids.append(token)
        req.hashes.extend([token])
        text = req.stop_matcher.push(req.detok.push(token))
        if req.stop_matcher.matched is not None:
            self._finish(req, FinishReason.STOP, text, token=token, stop=req.stop_matcher.matched)
        elif len(req.output_ids) >= req.params.max_tokens:
            text += req.stop_matcher.push(req.detok.flush()) + req.stop_matcher.finish()
            matched = req.stop_matcher.matched  # a match that waited on a longer candidate
            reason = FinishReason.LENGTH if matched is None else FinishReason.STOP
            self._finish(req, reason, text, token=token, stop=matched)
        else:
            req.outputs.put_nowait(StepOutput(token_ids=(token,), text=text))

    def _time_token(self, req: EngineRequest) -> None:
        now = time.monotonic()
        latencies = self.stats.latencies
        if req.first_token_s is None:
            req.first_token_s = now
            latencies.time_to_first_token.observe(now - req.arrived_s)
        elif req.last_token_s is not None:
            latencies.inter_token.observe(now - req.last_token_s)
        req.last_token_s = now

    def _finish(
        self,
        req: EngineRequest,
        reason: FinishReason,
        text: str,
        *,
        token: int | None = None,
        stop: str | None = None,
        error: str | None = None,
    ) -> None:
        if req.state is RequestState.FINISHED:
            return
        if req in self._running:
            self._running.remove(req)
        req.state = RequestState.FINISHED
        if reason is FinishReason.ABORT:
            self.stats.aborted_requests += 1
        elif reason is FinishReason.ERROR:
            self.stats.failed_requests += 1
        else:
            self.stats.finished_requests += 1
            first, last, n = req.first_token_s, req.last_token_s, len(req.output_ids)
            if first is not None and last is not None and n > 1:
                self.stats.latencies.time_per_output_token.observe((last - first) / (n - 1))
        final = StepOutput(
            token_ids=() if token is None else (token,),
            text=text,
            finish=reason,
            stop_reason=stop,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_ids),
            error=error,
        )
        hook = req.on_prompt_kv
        if hook is None or reason in (FinishReason.ABORT, FinishReason.ERROR) or self._closing:
            self.kv.free(req)
            req.outputs.put_nowait(final)
            self._wake.set()
            return
        n_prompt_blocks = len(req.prompt_ids) // self.kv.block_size
        kv = PromptKV(
            request_id=req.request_id,
            num_prompt_tokens=len(req.prompt_ids),
            block_hashes=tuple(req.hashes.hashes[:n_prompt_blocks]),
            page_tables=tuple(tuple(t[:n_prompt_blocks]) for t in req.page_tables),
        )
        task = asyncio.create_task(self._run_hook(req, hook, kv, final))
        self._hooks.add(task)
        task.add_done_callback(self._hooks.discard)

    async def _run_hook(
        self, req: EngineRequest, hook: PromptKVHook, kv: PromptKV, final: StepOutput
    ) -> None:
        try:
            await hook(kv)
        except Exception:
            logger.exception("request %s: prompt KV hook failed", req.request_id)
        finally:
            self.kv.free(req)
            req.outputs.put_nowait(final)
            self._wake.set()
