"""One trace per request: the proxy's span and the ``traceparent`` it gives both engines, the
actors' transfer spans, and the connector's OpenTelemetry export of them — received over
OTLP/HTTP by a real receiver (tests/otlp_receiver.py). Off, no header goes out and nothing of
OpenTelemetry is imported.

The end-to-end trace through real vLLM is tests/vllm/test_trace_e2e.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.proto")

from pdactors import timeline
from pdactors.testing import open_cluster, run_transfer
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, open_otlp_receiver
from tests.test_proxy import chat_body, completion_body, open_setup

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


def _ids(traceparent: str | None) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C ``traceparent``."""
    assert traceparent is not None
    version, trace_id, span_id, _flags = traceparent.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16, traceparent
    return trace_id, span_id


def _exported(receiver: OtlpReceiver) -> list[ReceivedSpan]:
    """The spans received once the proxy has stopped: its exit exports what it holds."""
    return receiver.received()


# --------------------------------------------------------------------------- the proxy


@pytest.mark.parametrize("first_token", ["d", "p"])
async def test_the_proxys_span_is_the_parent_both_engines_are_given(first_token: str) -> None:
    """Upstream's flow (P and D at once) and P-first: P's and D's requests carry one
    ``traceparent``, naming the proxy's span as their parent; the span reaches the receiver
    with the transfer id, the engines and the outcome."""
    with open_otlp_receiver() as receiver:
        config = {"first_token": first_token, "placement": "disaggregate"}  # both engines
        async with open_setup(otlp_traces_endpoint=receiver.url, **config) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200, resp.text
            (p,), (d,) = s.p, s.d
            tid = d.tids()[-1]
        (span,) = _exported(receiver)
        assert p.traceparents and d.traceparents
        assert {_ids(tp) for tp in p.traceparents + d.traceparents} == {
            (span.trace_id, span.span_id)
        }
    assert span.service == "pdactors-proxy"
    assert span.name == "POST /v1/completions"
    assert span.parent_span_id == ""  # the client sent no trace context: a new trace
    assert span.attributes["pdactors.transfer_id"] == tid
    assert span.attributes["pdactors.prefill"] == p.url
    assert span.attributes["pdactors.decode"] == d.url
    assert span.attributes["pdactors.outcome"] == "ok"
    assert span.start_ns <= span.end_ns


async def test_a_clients_trace_context_is_the_parent_of_the_proxys_span() -> None:
    with open_otlp_receiver() as receiver:
        async with open_setup(otlp_traces_endpoint=receiver.url) as s:
            headers = {"traceparent": CLIENT_PARENT}
            body = chat_body(stream=True)
            async with s.client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                assert resp.status_code == 200
                await resp.aread()
        (span,) = _exported(receiver)
        (d,) = s.d
    assert (span.trace_id, span.parent_span_id) == (CLIENT_TRACE, "b7ad6b7169203331")
    assert _ids(d.traceparents[-1]) == (CLIENT_TRACE, span.span_id)


async def test_a_failed_request_ends_its_span_with_the_failure() -> None:
    with open_otlp_receiver() as receiver:
        async with open_setup(otlp_traces_endpoint=receiver.url) as s:
            s.p[0].status = s.d[0].status = 500  # (D's alone: P would continue it)
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 502
        (span,) = _exported(receiver)
    assert span.attributes["pdactors.outcome"] != "ok"
    assert span.status_code == 2  # ERROR


async def test_off_no_header_goes_to_the_engines() -> None:
    async with open_setup(placement="disaggregate") as s:  # both engines asked
        resp = await s.client.post("/v1/completions", json=completion_body())
        assert resp.status_code == 200
        assert s.p[0].traceparents == [None] and s.d[0].traceparents == [None]


def test_off_the_proxy_imports_nothing_of_opentelemetry() -> None:
    """A whole request through the proxy without an endpoint, in a fresh interpreter: no
    ``opentelemetry`` module is loaded (zero cost when off)."""
    code = (
        "import sys, trio, httpx\n"
        "from tests.test_proxy import open_setup, completion_body\n"
        "async def main():\n"
        "    async with open_setup() as s:\n"
        "        r = await s.client.post('/v1/completions', json=completion_body())\n"
        "        assert r.status_code == 200, r.text\n"
        "trio.run(main)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]


def test_the_endpoint_must_be_an_http_url() -> None:
    from pdactors import PrefillBackend, ProxyConfig
    from pdactors.errors import ConfigError

    with pytest.raises(ConfigError, match="collector:4317"):
        ProxyConfig(
            prefill=(PrefillBackend("http://p", "http://p:8998"),),
            decode=("http://d",),
            otlp_traces_endpoint="collector:4317",
        )


# --------------------------------------------------------------------------- the actors


async def test_the_actors_report_each_write_and_pull_as_it_ends() -> None:
    """With a watcher, P's write and D's pull each end as a span (wall clock, the bytes that
    moved, the peer, the outcome); without one, the actors build none."""
    spans: list[timeline.TransferSpan] = []
    with trio.fail_after(30):
        async with open_cluster(layers=4, num_blocks=64, block_bytes=4096) as cluster:
            assert not timeline.watching()
            await run_transfer(cluster, "unwatched", 2)
            timeline.watch(spans.append)
            try:
                outcome = await run_transfer(cluster, "t1", 8)
                with trio.fail_after(5):
                    while len(spans) < 2:
                        await trio.sleep(0.01)
            finally:
                timeline.unwatch(spans.append)
            p, d = cluster.prefill[0], cluster.decode[0]
    assert outcome.ok, outcome
    write, pull = sorted(spans, key=lambda s: s.side, reverse=True)
    assert (write.side, pull.side) == ("write", "pull")
    assert {write.transfer_id, pull.transfer_id} == {"t1"}
    assert write.nbytes == pull.nbytes == outcome.nbytes
    assert write.outcome == pull.outcome == "ok"
    assert write.peer == d.dataplane.session and pull.peer == p.engine_id
    assert pull.start <= write.start <= write.end <= pull.end
    assert not timeline.watching()


# --------------------------------------------------------------------------- the connector


def test_the_connectors_spans_join_the_requests_trace() -> None:
    """The connector's tracer turns the actors' spans of the transfers it was told of into
    OpenTelemetry spans, children of the request's ``traceparent`` (a root span without
    one), with the transfer's attributes; others' spans are not its own."""
    tracing = pytest.importorskip("pdactors_vllm.tracing")
    from pdactors_vllm.settings import TraceExport

    parent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
    with open_otlp_receiver() as receiver:
        tracer = tracing.TransferTracer(TraceExport(receiver.url, "http/protobuf"), "prefill-7")
        try:
            tracer.expect("t1", parent)
            tracer.expect("t2", None)
            for tid, outcome in (("t1", "ok"), ("t2", "the write failed"), ("t3", "ok")):
                span = timeline.TransferSpan(
                    transfer_id=tid, side="write", start=100.0, end=100.25, nbytes=4096,
                    peer="127.0.0.1:1234", outcome=outcome,
                )  # fmt: skip
                timeline.span_ended(span)
            tracer.forget(["t1", "t2"])
        finally:
            tracer.close()
        assert not timeline.watching()
        spans = {s.attributes["pdactors.transfer_id"]: s for s in receiver.received()}
    assert set(spans) == {"t1", "t2"}  # t3 is no transfer of this worker
    one, two = spans["t1"], spans["t2"]
    assert (one.trace_id, one.parent_span_id) == (CLIENT_TRACE, "b7ad6b7169203331")
    assert one.name == "pdactors.kv_write" and one.service == "pdactors-connector"
    assert one.attributes == {
        "pdactors.transfer_id": "t1",
        "pdactors.bytes": 4096,
        "pdactors.peer": "127.0.0.1:1234",
        "pdactors.outcome": "ok",
        "pdactors.engine_id": "prefill-7",
    }
    assert (one.start_ns, one.end_ns) == (100_000_000_000, 100_250_000_000)
    assert two.parent_span_id == "" and two.trace_id != CLIENT_TRACE
    assert two.status_code == 2  # ERROR


def test_the_connector_traces_where_it_is_told_or_where_vllm_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = pytest.importorskip("pdactors_vllm.settings")
    own = settings.settings_from_extra_config({"otlp_traces_endpoint": "http://c:4318/v1/traces"})
    plain = settings.settings_from_extra_config({})
    monkeypatch.delenv(settings.OTLP_PROTOCOL_ENV, raising=False)
    assert settings.trace_export(plain, None) is None
    assert settings.trace_export(own, "http://vllm:4317") == settings.TraceExport(
        "http://c:4318/v1/traces", "http/protobuf"
    )
    assert settings.trace_export(plain, "http://vllm:4317") == settings.TraceExport(
        "http://vllm:4317", "grpc"
    )
    monkeypatch.setenv(settings.OTLP_PROTOCOL_ENV, "http/protobuf")
    assert settings.trace_export(plain, "http://v/v1/traces").protocol == "http/protobuf"
    monkeypatch.setenv(settings.OTLP_PROTOCOL_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        settings.trace_export(plain, "http://v/v1/traces")


def test_the_receiver_answers_an_empty_export() -> None:
    """The test receiver itself: a plain OTLP/HTTP POST is answered, nothing recorded."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    with open_otlp_receiver() as receiver:
        body = ExportTraceServiceRequest().SerializeToString()
        resp = httpx.post(receiver.url, content=body, trust_env=False, timeout=5)
        assert resp.status_code == 200
        assert receiver.received() == []
