from __future__ import annotations

import pytest

from loadtest.model_discovery import NoModelServed, served_model


def test_first_served_model_is_found(fake_openai_url: str) -> None:
    assert served_model(fake_openai_url) == "fake-model"


def test_unreachable_server_is_a_typed_error() -> None:
    with pytest.raises(NoModelServed, match="cannot list models"):
        served_model("http://127.0.0.1:9", timeout_s=2)


def test_a_server_without_models_is_a_typed_error(fake_openai_url: str) -> None:
    with pytest.raises(NoModelServed):
        served_model(fake_openai_url + "/nothing-here")
