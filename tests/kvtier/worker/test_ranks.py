"""A worker with several data-parallel ranks: each rank's settings (vLLM's port layout), the
rank a request goes to, and each rank's events tagged with its rank."""

from __future__ import annotations

import pytest

from kvtier.worker.errors import InvalidRequest
from kvtier.worker.ranks import WorkerRanks, rank_settings
from kvtier.worker.settings import WorkerSettings


def settings(**extra: object) -> WorkerSettings:
    return WorkerSettings(model="sim", num_pages=16, host_pages=16, **extra)  # type: ignore[arg-type]


def test_rank_r_offsets_p2p_and_event_ports_and_only_rank_0_announces() -> None:
    base = settings(
        p2p_port=7000,
        events_endpoint="tcp://127.0.0.1:5557",
        events_replay_endpoint="tcp://127.0.0.1:5600",
        engine_id="w",
        data_parallel_size=3,
    )
    assert rank_settings(base, 0) is base
    r2 = rank_settings(base, 2)
    assert r2.p2p_port == 7002
    assert r2.events_endpoint == "tcp://127.0.0.1:5559"
    assert r2.events_replay_endpoint == "tcp://127.0.0.1:5602"
    assert r2.engine_id == "w-dp2" and r2.announce_endpoint is None
    assert r2.num_pages == base.num_pages  # every rank has a whole KV cache of its own
    free = rank_settings(settings(p2p_port=0, events_endpoint="tcp://127.0.0.1:*"), 1)
    assert free.p2p_port == 0 and free.events_endpoint == "tcp://127.0.0.1:*"


def test_each_rank_is_its_own_engine_publishing_its_rank() -> None:
    ranks = WorkerRanks.build(
        settings(events_endpoint="tcp://127.0.0.1:*", data_parallel_size=2), None
    )
    assert len(ranks) == 2
    a, b = ranks.workers
    assert a.engine is not b.engine and a.engine.kv is not b.engine.kv
    assert (a.data_parallel_rank, b.data_parallel_rank) == (0, 1)
    assert a.events.publisher is not None and b.events.publisher is not None
    assert a.events.publisher._rank == 0 and b.events.publisher._rank == 1
    single = WorkerRanks.build(settings(events_endpoint="tcp://127.0.0.1:*"), None)
    # DP=1: tagged 0, as vLLM 0.32 tags every batch with its publisher's rank.
    assert single.workers[0].data_parallel_rank == 0


def test_the_header_picks_the_rank_and_bad_values_are_refused() -> None:
    """vLLM 0.32's reading: ``int(value)``; out of range refused, not an integer ignored."""
    ranks = WorkerRanks.build(settings(data_parallel_size=3), None)
    assert [ranks.pick(v) for v in ("0", "2", " 1 ", "+1")] == [0, 2, 1, 1]
    for bad in ("3", "-1"):
        with pytest.raises(InvalidRequest):
            ranks.pick(bad)
    ignored = ("", "one", "1e0", "²", "1" * 40)
    assert [ranks.pick(v) for v in ignored] == [0, 1, 2, 0, 1]  # idle: round robin
    assert [ranks.pick(None) for _ in range(3)] == [2, 0, 1]
