"""Stop strings over streamed text: the split of the text into pieces never changes the result."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.worker.stop_check import StopStringMatcher


def run(pieces: list[str], stop: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stop)
    out = ""
    for piece in pieces:
        out += matcher.push(piece)
        if matcher.matched is not None:
            break
    out += matcher.finish()
    return out, matcher.matched


def reference(text: str, stop: list[str]) -> str:
    """The text up to the earliest occurrence of any stop string."""
    hits = [text.find(s) for s in stop if s in text]
    return text[: min(hits)] if hits else text


def test_simple_cases() -> None:
    assert run(["hel", "lo wor", "ld"], ["o w"]) == ("hell", "o w")
    assert run(["abc"], []) == ("abc", None)
    assert run(["ab", "c"], ["x"]) == ("abc", None)


def test_held_back_text_is_released_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == "go"  # " ST" could still become "STOP"
    assert matcher.push("X") == " "
    assert matcher.push("OP") == "ST"
    assert matcher.finish() == "XOP" and matcher.matched is None


def test_a_match_waits_for_a_longer_stop_string_that_starts_earlier() -> None:
    # Found by hypothesis: "a" completes inside "ba" but "baa" starts earlier and may complete.
    assert run(["ba", "a"], ["a", "baa"]) == ("", "baa")
    assert run(["ba", "c"], ["a", "baa"]) == ("b", "a")
    matcher = StopStringMatcher(["a", "baa"])
    assert matcher.push("ba") == "" and matcher.matched is None
    assert matcher.finish() == "b" and matcher.matched == "a"  # the request ended meanwhile


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_any_split_gives_the_reference_result(text: str, stop: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    got_text, got_stop = run(pieces, stop)
    assert got_text == reference(text, stop)
    assert (got_stop is None) == (not any(s in text for s in stop))
    assert got_stop is None or got_stop in text
