"""P dies while D waits for its KV: D's requests end within a bounded time (policy ``fail``)
and D keeps serving. Its own module: it kills its P server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from integrations.vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import Server, completion, free_port, post_completion, servers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PULL_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def p_and_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, str]]:
    bootstrap_port = free_port()
    p_config = {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_producer",
        "engine_id": "prefill-doomed",
        "kv_connector_extra_config": {"bootstrap_port": bootstrap_port, "ready_timeout": 300},
    }
    d_config = {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"pull_timeout": PULL_TIMEOUT, "lookup_timeout": 2},
    }
    specs = {
        "prefill": {"core": 0, "kv_transfer_config": p_config},
        "decode": {"core": 1, "kv_transfer_config": d_config},
    }
    model: Path = ensure_tiny_model()
    with servers(specs, model, tmp_path_factory.mktemp("vllm-logs")) as s:
        yield s["prefill"], s["decode"], f"http://127.0.0.1:{bootstrap_port}"


def d_params(tid: str, bootstrap_url: str) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-doomed",
        "remote_bootstrap_addr": bootstrap_url,
        "transfer_id": tid,
    }


def test_p_killed_mid_run_ends_d_requests_and_d_keeps_serving(
    p_and_d: tuple[Server, Server, str],
) -> None:
    p, d, bootstrap_url = p_and_d
    prompt = "Tell me about the river and the mountains"
    with ThreadPoolExecutor(4) as pool:
        # A request P never gets: D's pull waits at P (ready_timeout is 300 s) ...
        waiting = [
            pool.submit(
                post_completion,
                d,
                prompt,
                max_tokens=4,
                kv_transfer_params=d_params(f"w{i}", bootstrap_url),
            )
            for i in range(3)
        ]
        time.sleep(2)  # ... long enough for the pulls to reach P
        assert not any(f.done() for f in waiting)
        start = time.monotonic()
        p.kill()
        answers = [f.result() for f in waiting]
    elapsed = time.monotonic() - start
    assert elapsed < PULL_TIMEOUT + 15  # upstream: timeout + 60 s, or never
    for answer in answers:
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["finish_reason"] not in ("length", "stop")
        else:
            assert answer.status_code >= 500
    # D keeps serving: a plain request, and a disaggregated one that fails fast (P is gone)
    assert completion(d, prompt, max_tokens=4)["choices"][0]["finish_reason"] == "length"
    start = time.monotonic()
    late = post_completion(
        d, prompt, max_tokens=4, kv_transfer_params=d_params("late", bootstrap_url)
    )
    assert time.monotonic() - start < PULL_TIMEOUT + 15
    assert late.status_code >= 500 or late.json()["choices"][0]["finish_reason"] not in (
        "length",
        "stop",
    )
