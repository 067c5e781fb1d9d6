"""Real vLLM: D's connector loses its Trio thread with a pull in flight (an injected fault,
tests/vllm/crashing_connector.py). The request ends (policy ``fail``: an error) within seconds,
the server logs it, the actors restart, and D serves disaggregated requests again."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    completion,
    free_port,
    post_completion,
    producer_config,
    servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ENGINE = "prefill-steady"


@pytest.fixture(scope="module")
def p_and_d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, str]]:
    bootstrap_port = free_port()
    p_config = producer_config(ENGINE, bootstrap_port)
    d_config = {
        "kv_connector": "CrashingConnector",
        "kv_connector_module_path": "tests.vllm.crashing_connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"on_pull_failure": "fail"},
    }
    specs = {
        "prefill": {"core": 0, "kv_transfer_config": p_config},
        "decode": {"core": 1, "kv_transfer_config": d_config},
    }
    with servers(specs, ensure_tiny_model(), tmp_path_factory.mktemp("vllm-logs")) as s:
        yield s["prefill"], s["decode"], f"http://127.0.0.1:{bootstrap_port}"


def pd(p: Server, d: Server, bootstrap: str, prompt: list[int], tid: str) -> tuple[int, str]:
    """P and D at once, as the proxy does; D's status and text."""
    d_params = {
        "do_remote_prefill": True, "remote_engine_id": ENGINE,
        "remote_bootstrap_addr": bootstrap, "transfer_id": tid,
    }  # fmt: skip
    p_params = {"do_remote_decode": True, "transfer_id": tid}
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(post_completion, p, prompt, max_tokens=1, kv_transfer_params=p_params)
        fd = pool.submit(post_completion, d, prompt, max_tokens=8, kv_transfer_params=d_params)
        fp.result()
        answer = fd.result()
    text = answer.json()["choices"][0]["text"] if answer.status_code == 200 else ""
    return answer.status_code, text


def test_a_dead_trio_thread_ends_the_request_and_the_actors_come_back(
    p_and_d: tuple[Server, Server, str],
) -> None:
    p, d, bootstrap = p_and_d
    prompt = [int(i) for i in range(40, 140)]
    want = completion(d, prompt, max_tokens=8)["choices"][0]["text"]  # D computing it alone
    assert pd(p, d, bootstrap, prompt, uuid.uuid4().hex) == (200, want)
    # A request P never gets: the pull waits at P while D's Trio thread dies under it.
    start = time.monotonic()
    crashed = post_completion(
        d, prompt, max_tokens=8,
        kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": ENGINE,
            "remote_bootstrap_addr": bootstrap, "transfer_id": f"crash-{uuid.uuid4().hex}",
        },
    )  # fmt: skip
    assert time.monotonic() - start < 10  # the next get_finished reports it: no hang
    assert crashed.status_code >= 500 or crashed.json()["choices"][0]["finish_reason"] not in (
        "length",
        "stop",
    )
    log = d.log.read_text(errors="replace")
    assert "Trio thread" in log and "died" in log and "restarting" in log
    # The actors restart in the background: disaggregated requests work again.
    deadline = time.monotonic() + 30
    while True:
        status, text = pd(p, d, bootstrap, prompt, uuid.uuid4().hex)
        if status == 200 and text == want and "actors restarted" in d.log.read_text():
            break
        assert time.monotonic() < deadline, (status, d.tail())
        time.sleep(0.5)
