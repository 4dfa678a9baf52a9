from __future__ import annotations

import argparse
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from loadtest import workloads as wl


def _specs(config: wl.WorkloadConfig) -> list[wl.RequestSpec]:
    out = []
    for session in wl.sessions(config):
        while (spec := session.next_request()) is not None:
            out.append(spec)
            session.record_answer("answer")
    return out


def test_random_prompts_have_the_asked_length_and_count() -> None:
    config = wl.WorkloadConfig(kind=wl.WorkloadKind.RANDOM, num_prompts=5, input_len=40)
    specs = _specs(config)
    assert len(specs) == 5 == wl.total_requests(config)
    assert {len(s.body["prompt"]) for s in specs} == {40}
    assert len({s.body["prompt"] for s in specs}) == 5
    assert all(s.endpoint is wl.Endpoint.COMPLETIONS and s.stream for s in specs)
    assert specs[0].body["stream_options"] == {"include_usage": True}


def test_chars_per_token_scales_prompt_text() -> None:
    options = wl.RequestOptions(chars_per_token=4)
    config = wl.WorkloadConfig(num_prompts=2, input_len=10, options=options)
    specs = _specs(config)
    assert {len(s.body["prompt"]) for s in specs} == {40}
    assert {s.prompt_len for s in specs} == {10}


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    config = wl.WorkloadConfig(
        kind=wl.WorkloadKind.SHARED_PREFIX,
        groups=3,
        prompts_per_group=4,
        system_prompt_len=64,
        question_len=16,
    )
    specs = _specs(config)
    assert len(specs) == 12 == wl.total_requests(config)
    by_group: dict[str, list[str]] = {}
    for s in specs:
        by_group.setdefault(s.tag.split("/")[0], []).append(s.body["prompt"])
    assert len(by_group) == 3
    prefixes = set()
    for prompts in by_group.values():
        assert len(prompts) == 4
        assert {p[:65] for p in prompts} == {prompts[0][:65]}  # 64 chars + separator
        assert len({p[65:] for p in prompts}) == 4
        assert {len(p) for p in prompts} == {64 + 1 + 16}
        prefixes.add(prompts[0][:64])
    assert len(prefixes) == 3
    # Shuffled: not all of one group first.
    tags = [s.tag.split("/")[0] for s in specs]
    assert tags != sorted(tags)


def test_shared_prefix_chat_puts_the_system_prompt_in_a_system_message() -> None:
    options = wl.RequestOptions(endpoint=wl.Endpoint.CHAT, stream=False)
    config = wl.WorkloadConfig(
        kind=wl.WorkloadKind.SHARED_PREFIX, groups=1, prompts_per_group=2, options=options
    )
    specs = _specs(config)
    assert [m["role"] for m in specs[0].body["messages"]] == ["system", "user"]
    assert specs[0].body["messages"][0] == specs[1].body["messages"][0]
    assert "stream_options" not in specs[0].body and specs[0].body["stream"] is False


def test_workloads_are_deterministic_per_seed() -> None:
    a = _specs(wl.WorkloadConfig(kind=wl.WorkloadKind.SHARED_PREFIX))
    b = _specs(wl.WorkloadConfig(kind=wl.WorkloadKind.SHARED_PREFIX))
    c = _specs(
        wl.WorkloadConfig(kind=wl.WorkloadKind.SHARED_PREFIX, options=wl.RequestOptions(seed=1))
    )
    assert [s.body for s in a] == [s.body for s in b]
    assert [s.body for s in a] != [s.body for s in c]


def test_multi_turn_conversation_grows_with_the_answers() -> None:
    config = wl.WorkloadConfig(
        kind=wl.WorkloadKind.MULTI_TURN,
        conversations=1,
        turns=3,
        system_prompt_len=10,
        question_len=5,
    )
    session = next(iter(wl.sessions(config)))
    first = session.next_request()
    assert first is not None and first.endpoint is wl.Endpoint.CHAT
    assert [m["role"] for m in first.body["messages"]] == ["system", "user"]
    session.record_answer("hello there")
    second = session.next_request()
    assert second is not None
    roles = [m["role"] for m in second.body["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert second.body["messages"][2]["content"] == "hello there"
    assert second.body["messages"][:2] == first.body["messages"]
    assert second.prompt_len == first.prompt_len + len("hello there") + 5
    # A turn whose answer never came still leaves an alternating history.
    third = session.next_request()
    assert third is not None
    assert [m["role"] for m in third.body["messages"]][-3:] == ["user", "assistant", "user"]
    assert session.next_request() is None
    assert third.tag == "conv-0/turn-2"


class RecordingParser:
    """Stands in for Locust's configargparse parser: records add_argument calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def add_argument(self, flag: str, **kwargs: Any) -> None:
        self.calls.append((flag, kwargs))


def test_arguments_round_trip_and_env_names() -> None:
    parser = argparse.ArgumentParser()
    wl.add_workload_arguments(parser)
    ns = parser.parse_args(
        [
            "--workload",
            "multi-turn",
            "--turns",
            "2",
            "--no-stream",
            "--endpoint",
            "completions",
            "--model",
            "m",
        ]
    )
    config = wl.config_from_arguments(ns)
    assert config.kind is wl.WorkloadKind.MULTI_TURN and config.turns == 2
    assert config.options.endpoint is wl.Endpoint.CHAT  # multi-turn is always chat
    assert config.options.stream is False and config.options.model == "m"
    recording = RecordingParser()
    wl.add_workload_arguments(recording, env_prefix="LOCUST_")
    envs = {flag: kw["env_var"] for flag, kw in recording.calls}
    assert envs["--prompts-per-group"] == "LOCUST_PROMPTS_PER_GROUP"
    assert envs["--workload"] == "LOCUST_WORKLOAD"


@given(st.integers(min_value=0, max_value=300), st.integers(min_value=0, max_value=5))
def test_random_text_has_exact_length(n: int, seed: int) -> None:
    assert len(wl.random_text(random.Random(seed), n)) == n
