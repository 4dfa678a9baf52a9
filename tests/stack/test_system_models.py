"""System test: ``pdproxy up --models alpha,beta --lora style@alpha`` (sim workers, PD over
P2P) serves both models and the adapter, each from its own workers, lists each once, and
answers an unknown model with OpenAI's 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.stack.test_system import Stack, _run_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = ["--model", "sim", "--models", "alpha,beta", "--lora", "style@alpha"]
    with _run_stack(tmp_path_factory.mktemp("models"), *args) as running:
        yield running


def test_up_with_two_models_routes_each_to_its_workers(stack: Stack) -> None:
    assert set(stack.pids) == {"alpha-p0", "alpha-c0", "beta-p0", "beta-c0", "proxy"}
    config = yaml.safe_load(Path(stack.run_dir / "proxy.yaml").read_text())
    assert set(config["models"]["served"]) == {"alpha", "beta", "style"}
    with httpx.Client(base_url=stack.endpoint, timeout=60) as client:
        listed = sorted(m["id"] for m in client.get("/v1/models").json()["data"])
        assert listed == ["alpha", "beta", "style"]
        texts = {}
        for model in ("alpha", "beta", "style", "alpha", "beta", "style"):
            body = {"model": model, "prompt": "Tell me about blocks. " * 4, "max_tokens": 6,
                    "temperature": 0}  # fmt: skip
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, (resp.text, stack.log_tails())
            assert resp.json()["model"] == model
            text = resp.json()["choices"][0]["text"]
            assert texts.setdefault(model, text) == text  # PD output is deterministic
        unknown = client.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
    assert len(set(texts.values())) == 3
