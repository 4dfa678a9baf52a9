"""The DP benchmark runs end to end, small: rank-aware routing hits the prefix cache more often
than rank-blind routing on the same workload in the same run."""

from __future__ import annotations

import pytest

from loadtest.bench_dp_ranks import compare, parse, report

pytestmark = pytest.mark.slow


async def test_rank_aware_routing_beats_rank_blind_on_prefix_hits() -> None:
    args = parse(["--groups", "8", "--rounds", "4", "--prefill-ms-per-token", "0.01",
                  "--time-limit-s", "60"])  # fmt: skip
    aware, blind = await compare(args)
    assert "rank-aware / rank-blind" in report(aware, blind, args)
    assert aware.failed == 0 and blind.failed == 0
    assert aware.ok == blind.ok == 32
    assert aware.hit_rate > blind.hit_rate
