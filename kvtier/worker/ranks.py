"""Several engines (data-parallel ranks) behind one HTTP endpoint, as vLLM runs DP.

Each rank is a whole :class:`~kvtier.worker.worker.Worker`: its own engine, KV cache and page
pools, its own P2P server on ``p2p_port`` + ``r`` (any free port when ``p2p_port`` is 0) and
its own event publisher on the events and replay endpoints' port + ``r``, stamping rank ``r``
on its batches. Only rank 0 announces itself to a proxy.

A request names its rank with ``X-data-parallel-rank`` (what the proxy sends), read as vLLM
0.32 reads it (``int(value)``): an integer outside ``[0, data_parallel_size)`` is refused (400,
vLLM's "data_parallel_rank ... is out of range"); a value that is not an integer is ignored,
as vLLM ignores it. Without a usable header the rank with the fewest requests running and
waiting serves it, ties broken round robin (vLLM's own API server also balances by load).

Who may send the header: any client the worker's API key admits; it only picks which of this
worker's own engines computes the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.events.ranks import offset_endpoint
from kvtier.worker.errors import InvalidRequest
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import ConnectorFactory, Worker

DP_RANK_HEADER = "x-data-parallel-rank"


def rank_settings(settings: WorkerSettings, rank: int) -> WorkerSettings:
    """The settings of rank ``rank``'s engine."""
    if rank == 0:
        return settings
    return settings.model_copy(
        update={
            "p2p_port": settings.p2p_port + rank if settings.p2p_port else 0,
            "events_endpoint": offset_endpoint(settings.events_endpoint, rank),
            "events_replay_endpoint": offset_endpoint(settings.events_replay_endpoint, rank),
            "engine_id": f"{settings.engine_id}-dp{rank}" if settings.engine_id else "",
            "announce_endpoint": None,
        }
    )


class WorkerRanks:
    """The ranks of one worker process; rank 0 is ``workers[0]``."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ValueError("a worker needs at least one rank")
        self.workers = list(workers)
        self._turn = 0

    @classmethod
    def build(
        cls, settings: WorkerSettings, connector_factory: ConnectorFactory | None
    ) -> WorkerRanks:
        size = settings.data_parallel_size
        if size == 1:  # tagged 0 all the same: vLLM stamps every batch with its rank
            return cls(
                [Worker(settings, connector_factory=connector_factory, data_parallel_rank=0)]
            )
        return cls(
            [
                Worker(rank_settings(settings, r), connector_factory=connector_factory,
                       data_parallel_rank=r)
                for r in range(size)
            ]
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.workers)

    def pick(self, header: str | None) -> int:
        """The rank that serves a request whose ``X-data-parallel-rank`` is ``header``."""
        n = len(self.workers)
        rank = _header_rank(header)
        if rank is not None:
            if not 0 <= rank < n:
                raise InvalidRequest(
                    f"{DP_RANK_HEADER} must be an integer in [0, {n})", param=DP_RANK_HEADER
                )
            return rank
        if n == 1:
            return 0
        start = self._turn
        self._turn = (start + 1) % n
        order = [(start + i) % n for i in range(n)]
        return min(order, key=self._load)

    def _load(self, rank: int) -> int:
        engine = self.workers[rank].engine
        return engine.num_running + engine.num_waiting

    async def start(self) -> None:
        started: list[Worker] = []
        try:
            for worker in self.workers:
                await worker.start()  # closes itself if it fails
                started.append(worker)
        except BaseException:
            for worker in reversed(started):
                await worker.close()
            raise

    def begin_shutdown(self) -> None:
        for worker in self.workers:
            worker.begin_shutdown()

    async def close(self) -> None:
        errors: list[BaseException] = []
        for worker in reversed(self.workers):
            try:
                await worker.close()
            except Exception as exc:  # close every rank, then report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]


def _header_rank(header: str | None) -> int | None:
    """The header's rank as vLLM parses it (``int()``, so `` 1``, ``+1``, ``-1`` are integers),
    None when absent or not an integer. Long values are not integers to vLLM either (Python's
    ``int`` refuses past 4300 digits); 16 characters bound the work here."""
    if header is None or len(header) > 16:
        return None
    try:
        return int(header)
    except ValueError:
        return None
