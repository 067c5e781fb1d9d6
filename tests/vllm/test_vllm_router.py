"""vllm-router (vllm-project/router, the PyPI wheel ``vllm-router``) in its Mooncake PD mode in
front of our P and D servers (PdActorsConnector, real vLLM on CPU, the tiny model), against a
single non-disaggregated server: greedy, so answers must be equal token for token, and D must
take every prompt token by KV instead of computing it.

The router mints each request's ``transfer_id`` and sends D only after P answered (docs/proxy.md,
"The routers people already run"). Four servers start once for the module: the single one, two
P (the second for the router's cache-aware prefill policy) and one D.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

import openai

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import Server, consumer_config, free_port, producer_config, servers, stop
from tests.vllm.test_e2e import prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

pytest.importorskip("vllm_router")  # .ci/setup installs it

# its console script, beside this interpreter (the venv need not be on PATH)
ROUTER = str(Path(sys.executable).with_name("vllm-router"))

ROUTER_READY_TIMEOUT = 60.0


@dataclass
class Setup:
    single: Server
    p: list[Server]
    d: Server
    bootstrap_ports: list[int]
    logs: Path
    http: httpx.Client

    def client(self, url: str) -> Any:
        """An ``openai`` client for the server or router at ``url``."""
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", http_client=self.http, max_retries=0,
            timeout=120,
        )  # fmt: skip

    def d_prompt_tokens(self) -> tuple[float, float]:
        """D's prompt tokens so far: (computed locally, received by KV transfer)."""
        m = "vllm:prompt_tokens_by_source_total"
        return (
            self.d.metric(m, source="local_compute"),
            self.d.metric(m, source="external_kv_transfer"),
        )

    def p_requests(self) -> list[float]:
        """Requests each P has finished so far."""
        return [p.metric("vllm:request_success_total") for p in self.p]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = ensure_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-router-logs")
    ports = [free_port(), free_port()]
    d_config = consumer_config("decode-router", pull_timeout=30)  # a failed pull fails loudly
    specs: dict[str, dict[str, Any]] = {"single": {"core": 0}}
    for i, port in enumerate(ports):  # P 0 beside the single server, P 1 beside D
        config = producer_config(f"prefill-router-{i}", port)
        specs[f"prefill-{i}"] = {"core": i, "kv_transfer_config": config}
    specs["decode"] = {"core": 1, "kv_transfer_config": d_config}
    with servers(specs, model, logs) as s, httpx.Client(trust_env=False) as http:
        yield Setup(s["single"], [s["prefill-0"], s["prefill-1"]], s["decode"], ports, logs, http)


@contextmanager
def vllm_router(setup: Setup, prefills: int, name: str, *extra: str) -> Iterator[str]:
    """``vllm-router`` in Mooncake PD mode in front of the first ``prefills`` P and the D, bound
    to 127.0.0.1 on a free port (its Prometheus exporter too); yields its URL once it answers
    ``/health`` (it queried every P's bootstrap first); stopped on exit."""
    port = free_port()
    args = [
        ROUTER, "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-timeout-secs", "30", "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    for p, bootstrap_port in list(zip(setup.p, setup.bootstrap_ports, strict=True))[:prefills]:
        args += ["--prefill", p.url, str(bootstrap_port)]
    args += ["--decode", setup.d.url, *extra]
    log = setup.logs / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT
        while True:
            assert proc.poll() is None, f"vllm-router exited:\n{log.read_text(errors='replace')}"
            try:
                if setup.http.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"vllm-router not ready in {ROUTER_READY_TIMEOUT:g} s:\n"
                + log.read_text(errors="replace")
            )
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        if os.environ.get("PDACTORS_SHOW_PROXY_LOG"):
            print(log.read_text(errors="replace"))


@pytest.fixture(scope="module")
def router(setup: Setup) -> Iterator[Any]:
    """An ``openai`` client for vllm-router in front of one P and the D, as docs/proxy.md says."""
    with vllm_router(setup, 1, "vllm-router") as url:
        yield setup.client(url)


class _MovedKV:
    """Around requests through the router: D took ``prompt_tokens`` prompt tokens from P and
    computed none of them."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.local, self.external = setup.d_prompt_tokens()

    def check(self, prompt_tokens: int) -> None:
        local, external = self.setup.d_prompt_tokens()
        assert local == self.local, "D computed prompt tokens itself"
        assert external - self.external == prompt_tokens


# Prompts no other test sends: D's prefix cache would serve part of a repeated one, and the
# checks count every prompt token D took from P.
PROMPTS = {"text": "The quick brown fox jumps over", "ids-300": prompt_ids(300, seed=3001)}
MESSAGES = [{"role": "user", "content": "Tell me about foxes and dogs, at length."}]


@pytest.mark.parametrize("prompt", list(PROMPTS.values()), ids=list(PROMPTS))
def test_completion_equals_single_server(
    setup: Setup, router: Any, prompt: str | list[int]
) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    want = setup.client(setup.single.url).completions.create(**kwargs)
    moved = _MovedKV(setup)
    got = router.completions.create(**kwargs)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (
        want.choices[0].text, want.choices[0].finish_reason,
    )  # fmt: skip
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens
    moved.check(want.usage.prompt_tokens)


def test_streamed_completion_equals_single_server(setup: Setup, router: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny", "prompt": prompt_ids(200, seed=3002), "max_tokens": 16, "temperature": 0,
    }  # fmt: skip
    want = setup.client(setup.single.url).completions.create(**kwargs)
    moved = _MovedKV(setup)
    stream = router.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len(chunks) > 1  # relayed as a stream
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert chunks[-1].usage is not None and want.usage is not None  # D got stream_options
    assert chunks[-1].usage.model_dump() == want.usage.model_dump()
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [want.choices[0].finish_reason]
    assert want.usage is not None
    moved.check(want.usage.prompt_tokens)


def test_chat_equals_single_server(setup: Setup, router: Any) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
    want = setup.client(setup.single.url).chat.completions.create(**kwargs, max_tokens=20)
    moved = _MovedKV(setup)
    got = router.chat.completions.create(**kwargs, max_tokens=20)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert want.usage is not None
    moved.check(want.usage.prompt_tokens)


def test_streamed_chat_equals_single_server(setup: Setup, router: Any) -> None:
    messages = [{"role": "user", "content": "Write a short poem about a sleepy cat."}]
    kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "temperature": 0}
    want = setup.client(setup.single.url).chat.completions.create(**kwargs, max_tokens=20)
    moved = _MovedKV(setup)
    chunks = list(router.chat.completions.create(**kwargs, max_tokens=20, stream=True))
    assert len(chunks) > 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [want.choices[0].finish_reason]
    assert want.usage is not None
    moved.check(want.usage.prompt_tokens)


def test_8_concurrent_requests_equal_single_server(setup: Setup, router: Any) -> None:
    prompts = [prompt_ids(20 + 53 * i, seed=3100 + i) for i in range(8)]
    single = setup.client(setup.single.url)

    def run(client: Any, prompt: list[int]) -> tuple[str, str | None]:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0
        )
        return answer.choices[0].text, answer.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda p: run(single, p), prompts))
        moved = _MovedKV(setup)
        got = list(pool.map(lambda p: run(router, p), prompts))
    assert got == want
    moved.check(sum(map(len, prompts)))


# --------------------------------------------------------------------------- two P, cache-aware

PREFIXES = [
    "The harbour master counted forty ships at dawn, each with a red sail and a tired crew. ",
    "In the mountain village the baker rose before the bells and lit three ovens of stone. ",
]


def test_cache_aware_prefill_policy_keeps_a_shared_prefix_on_one_p(setup: Setup) -> None:
    """``--prefill-policy cache_aware`` with two P: prompts with nothing in common spread over
    both P (the least loaded takes a prompt that matches nothing), and prompts sharing a long
    prefix all go to the P that took the first of them, which then serves that prefix from its
    prefix cache. Answers equal the single server's; D computes no prompt token."""
    single = setup.client(setup.single.url)
    with vllm_router(
        setup, 2, "vllm-router-cache-aware",
        "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
    ) as url:  # fmt: skip
        router = setup.client(url)

        def run(client: Any, prompt: str) -> tuple[str, str | None]:
            answer = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0
            )
            return answer.choices[0].text, answer.choices[0].finish_reason

        # distinct prompts at once: both P serve
        distinct = [
            f"Story {i}: " + " ".join(f"word{i * 97 + j}" for j in range(60)) for i in range(8)
        ]
        before = setup.p_requests()
        moved = _MovedKV(setup)
        with ThreadPoolExecutor(8) as pool:
            want = list(pool.map(lambda p: run(single, p), distinct))
            got = list(pool.map(lambda p: run(router, p), distinct))
        assert got == want
        served = [a - b for a, b in zip(setup.p_requests(), before, strict=True)]
        assert sum(served) == len(distinct) and all(n > 0 for n in served), served
        local, _ = setup.d_prompt_tokens()
        assert local == moved.local, "D computed prompt tokens itself"

        # one after another, four prompts sharing a long prefix: all on one P
        for prefix in PREFIXES:
            prompts = [prefix * 10 + f"Question {i}: what happened next?" for i in range(4)]
            before = setup.p_requests()
            hits_before = [p.metric("vllm:prefix_cache_hits_total") for p in setup.p]
            local_before, _ = setup.d_prompt_tokens()
            for prompt in prompts:
                assert run(router, prompt) == run(single, prompt)
            served = [a - b for a, b in zip(setup.p_requests(), before, strict=True)]
            assert sorted(served) == [0, 4], served
            chosen = served.index(4)
            hits = setup.p[chosen].metric("vllm:prefix_cache_hits_total") - hits_before[chosen]
            # the three later prompts found the prefix's first two blocks (~330 tokens;
            # vLLM's CPU blocks hold 128) in that P's prefix cache
            assert hits >= 3 * 256, hits
            assert setup.d_prompt_tokens()[0] == local_before, "D computed prompt tokens itself"
