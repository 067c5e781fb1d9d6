"""The proxy's OpenTelemetry span per request, and the W3C ``traceparent`` it gives both engines.

On only with an OTLP endpoint (``ProxyConfig.otlp_traces_endpoint``, ``pdactors proxy
--otlp-traces-endpoint``); off, :func:`open_tracing` yields None, nothing of OpenTelemetry is
imported and a request costs one ``is None``. On, each completion request gets a SERVER span
from its arrival to its end (a child of the client's own ``traceparent`` when it sent one),
and P's and D's requests carry that span's context in ``traceparent``: vLLM (started with
``--otlp-traces-endpoint``) makes its ``llm_request`` span a child of it, and the connector's
transfer spans (``pdactors_vllm.tracing``) join the same trace. Spans are exported over
OTLP/HTTP (protobuf) by the SDK's batch processor, in its own thread: the proxy's Trio thread
never waits on the collector.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import trio

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = ["RequestSpan", "RequestTracing", "open_tracing"]

#: How long the proxy's exit may take to export the spans it holds (s).
_CLOSE_TIMEOUT: Final = 3.0


class RequestSpan:
    """One request's span: :attr:`traceparent` goes to the engines; :meth:`end` once."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Span, traceparent: bytes) -> None:
        self._span = span
        self.traceparent = traceparent

    def end(self, outcome: str, attributes: dict[str, str]) -> None:
        """The request ended with ``outcome`` (the proxy's ``requests_total`` label)."""
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attributes({"pdactors.outcome": outcome, **attributes})
        if outcome != "ok":
            self._span.set_status(Status(StatusCode.ERROR, outcome))
        self._span.end()


class RequestTracing:
    """The proxy's tracer: spans exported to ``endpoint`` (an OTLP/HTTP traces URL)."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": "pdactors-proxy"})
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer: Tracer = self.provider.get_tracer("pdactors.proxy")
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self,
        path: str,
        transfer_id: str,
        incoming: Iterable[tuple[bytes, bytes]],
        arrived: float,
        attributes: dict[str, str],
    ) -> RequestSpan:
        """A span for the request to ``path`` that arrived at ``arrived`` (trio clock), a
        child of the ``traceparent`` among its ``incoming`` headers if any."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in incoming
            if k in (b"traceparent", b"tracestate")
        }
        parent = self._propagator.extract(carrier) if carrier else None
        ago = trio.current_time() - arrived
        span = self._tracer.start_span(
            f"POST {path}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=time.time_ns() - int(ago * 1e9),
            attributes={"http.route": path, "pdactors.transfer_id": transfer_id, **attributes},
        )
        out: dict[str, Any] = {}
        self._propagator.inject(out, context=set_span_in_context(span))
        return RequestSpan(span, out["traceparent"].encode("latin-1"))


@asynccontextmanager
async def open_tracing(endpoint: str | None) -> AsyncIterator[RequestTracing | None]:
    """The proxy's tracer while the block runs (None, and no OpenTelemetry import, without
    ``endpoint``); on exit the spans it holds are exported, within :data:`_CLOSE_TIMEOUT`."""
    if endpoint is None:
        yield None
        return
    tracing = RequestTracing(endpoint)
    try:
        yield tracing
    finally:
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            # The SDK's shutdown joins its export thread: in a thread, not the Trio one.
            await trio.to_thread.run_sync(tracing.provider.shutdown, abandon_on_cancel=True)
