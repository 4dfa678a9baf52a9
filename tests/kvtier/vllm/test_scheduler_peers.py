"""Every leg that names a peer is checked against the allowlist inside vLLM too (issue 30, 9).

A ``kv_transfer_params`` leg comes from whoever can send requests to vLLM. Before the fix only
``remote_kv_source`` was checked against ``kv_source_allowed_peers``: a consumer leg's
``remote_prefiller`` naming any address made the engine's P2P client connect there (to load its
blocks, or to release them when the request was aborted while queued): SSRF into the engine's
network, or a tarpit. Now the scheduler refuses every leg naming a peer outside the list, with
the reference worker's own check (:meth:`kvtier.worker.peers.PeerAllowlist.refused`), so no load
or release names it. The scheduler runs in vLLM's venv (:mod:`.scheduler_driver`), with requests
of the shape it reads; each refusal has a control that is let through.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import _need_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[3]
ATTACKER = ("10.9.8.7", 5600)
"""An address outside the default allowlist (loopback only)."""


def _consumer(host: str, port: int) -> dict[str, Any]:
    return {
        "remote_prefiller": {"kv_request_id": "k" * 32, "remote_host": host, "remote_port": port}
    }


def _nixl(host: str, port: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_request_id": "r" * 32,
        "remote_block_ids": [[0, 1, 2, 3]],
        "remote_host": host,
        "remote_port": port,
    }


FABRIC = {"kv_source_allowed_peers": ["10.0.0.0/8:5600"]}
CASES: dict[str, dict[str, Any]] = {
    "consumer-load": {"params": _consumer(*ATTACKER)},
    "consumer-release": {"params": _consumer(*ATTACKER), "abort": True},
    "nixl-load": {"params": _nixl(*ATTACKER)},
    "nixl-release": {"params": _nixl(*ATTACKER), "abort": True},
    "producer-with-source": {
        "params": {
            "remote_decoder": {"kv_request_id": "p" * 32},
            "remote_kv_source": {"remote_host": ATTACKER[0], "remote_port": ATTACKER[1]},
        }
    },
    # Controls: a listed producer is loaded from (or released); the list decides, not the shape.
    "listed-load": {"params": _consumer("127.0.0.1", 5600)},
    "listed-release": {"params": _consumer("127.0.0.1", 5600), "abort": True},
    "fabric-load": {"params": _consumer(*ATTACKER), "extra": FABRIC},
    "fabric-release": {"params": _nixl(*ATTACKER), "extra": FABRIC, "abort": True},
}


@pytest.fixture(scope="module")
def answers() -> dict[str, dict[str, Any]]:
    python = _need_vllm().python
    cases = [{"id": name, **case} for name, case in CASES.items()]
    done = subprocess.run(
        [str(python), "-m", "tests.kvtier.vllm.scheduler_driver"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(zip(CASES, json.loads(done.stdout.splitlines()[-1]), strict=True))


@pytest.mark.parametrize("case", ["consumer-load", "consumer-release", "nixl-load", "nixl-release"])
def test_a_consumer_leg_to_an_unlisted_producer_never_reaches_it(
    answers: dict[str, dict[str, Any]], case: str
) -> None:
    answer = answers[case]
    assert answer["peers"] == [], answer  # no load, no release: nothing connects there
    assert answer["matched"] == [0, False], answer  # vLLM computes the prompt itself


@pytest.mark.parametrize(
    ("case", "peer"),
    [
        ("listed-load", "127.0.0.1:5600"),
        ("listed-release", "127.0.0.1:5600"),
        ("fabric-load", "10.9.8.7:5600"),
        ("fabric-release", "10.9.8.7:5600"),
    ],
)
def test_a_listed_producer_is_still_reached(
    answers: dict[str, dict[str, Any]], case: str, peer: str
) -> None:
    assert answers[case]["peers"] == [peer], answers[case]


def test_a_producer_leg_keeps_its_supply_without_an_unlisted_source(
    answers: dict[str, dict[str, Any]],
) -> None:
    answer = answers["producer-with-source"]
    assert answer["peers"] == [] and answer["matched"] == [0, False], answer
    assert answer["saves"] == ["p" * 32], answer  # its own blocks are still supplied
