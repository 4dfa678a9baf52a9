"""Real vLLM serving a LoRA adapter behind pdproxy: the instances are started once for this
package (about a minute), apart from the shared stack of ``tests/vllm/conftest.py`` (whose
instances run without ``--enable-lora``, which changes vLLM's CPU compilation).

Three NIXL instances, the adapter made from a seed in the run directory
(:func:`pdproxy.stack.vllm_lora.make_adapter`): ``p0`` (producer) and ``d0`` (consumer) load it,
``d1`` (consumer) does not. One proxy in front (``pd``), always disaggregated, the backends
listing their models and the adapter served as a model of its own (as ``pdproxy up --engine
vllm --lora`` configures it). Reference outputs come from ``d0`` alone with a fresh
``cache_salt`` (no prefix-cache hit, no transfer).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdproxy.stack.process import ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import VllmInstance, VllmRole, proxy_backend, vllm_instance
from pdproxy.stack.vllm_lora import make_adapter
from pdproxy.stack.vllm_plan import proxy_config
from tests.conftest import free_port
from tests.vllm.conftest import MODEL, _need_vllm, prompt_ids

ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 600.0
ADAPTER = "tiny-sql"


@dataclass(frozen=True, slots=True)
class LoraStack:
    instances: dict[str, VllmInstance]
    pd_url: str
    """Proxy: producer p0; consumers d0 (with the adapter) and d1 (without)."""
    supervisor: Supervisor

    def url(self, name: str) -> str:
        return self.instances[name].url


@pytest.fixture(scope="package")
def lora_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    paths = _need_vllm()
    run_dir = tmp_path_factory.mktemp("vllm-lora")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    adapter = make_adapter(run_dir / "lora" / ADAPTER, ADAPTER, base_model=str(paths.model_dir))
    loads = {"p0": True, "d0": True, "d1": False}
    roles = {"p0": VllmRole.PRODUCER, "d0": VllmRole.CONSUMER, "d1": VllmRole.CONSUMER}
    instances = {
        name: vllm_instance(
            name,
            roles[name],
            paths,
            http_port=free_port(),
            side_channel_port=free_port(),
            socket_dir=sockets,
            lora_modules={ADAPTER: adapter} if loads[name] else None,
        )
        for name in roles
    }
    backends = [proxy_backend(i, list_models=True) for i in instances.values()]
    config = proxy_config(backends, paths, host="127.0.0.1", port=0, adapters=(ADAPTER,))
    # Always disaggregated, also once the TTFT model is warm (`ttft.bypass` unset follows this).
    config["router_options"]["local_prefill"] = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    started = time.monotonic()
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        supervisor.start([i.spec for i in instances.values()])
        supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        port = free_port()  # picked after vLLM bound its own ephemeral ports
        path = run_dir / "pd.yaml"
        config = {**config, "port": port, "debug_headers": True, "metrics_cache_s": 0}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        url = f"http://127.0.0.1:{port}"
        argv = (sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path))
        env = {"PYTHONPATH": str(ROOT)}
        supervisor.start([ProcessSpec("pd-proxy", argv, url + "/ready", env, "proxy")])
        supervisor.wait_healthy(60.0)
        _first_adapter_request(url)
        print(f"\nLoRA vLLM stack up in {time.monotonic() - started:.0f} s ({run_dir / 'logs'})")
        yield LoraStack(instances, url, supervisor)


def _first_adapter_request(url: str, attempts: int = 3) -> None:
    """Adapter requests until one is served over NIXL (p0 → d0): d0's first NIXL handshake
    with p0 is slow on shared cores and can fail outright (see ``_first_pd_request`` in
    ``tests/vllm/conftest.py``), and must not be charged to a test."""
    failures = []
    for attempt in range(attempts):
        resp = complete(url, ADAPTER, prompt_ids(9000 + attempt, 300), max_tokens=2)
        fallback = resp.headers.get("x-pdproxy-fallback")
        if fallback is None:
            return
        failures.append(fallback)
    pytest.fail(f"no adapter request served over NIXL in {attempts} tries: {failures}")


def complete(
    url: str, model: str, prompt: list[int], *, max_tokens: int = 12, **extra: Any
) -> httpx.Response:
    """A greedy completion of ``max_tokens`` token ids (asserts HTTP 200)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    resp = httpx.post(url + "/v1/completions", json=body, headers={"x-pdproxy-debug": "1"},
                      timeout=300)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp


def token_ids(resp: httpx.Response) -> list[int]:
    ids: list[int] = resp.json()["choices"][0]["token_ids"]
    return ids


__all__ = ["ADAPTER", "MODEL", "LoraStack", "complete", "token_ids"]
