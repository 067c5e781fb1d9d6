"""The connector's OpenTelemetry spans: P's write into D's blocks and D's pull, one span each,
in the trace of the request they serve.

On only where an OTLP endpoint is configured (:func:`~pdactors_vllm.settings.trace_export`:
the ``otlp_traces_endpoint`` setting, else vLLM's own ``--otlp-traces-endpoint``); off, nothing
here is imported or built and the actors build no spans. The OpenTelemetry SDK is imported
when a :class:`TransferTracer` is made.

The parent: vLLM keeps a request's W3C trace headers (``traceparent``) on the request in its
engine core when its own tracing is on (it drops them otherwise); the scheduler side copies
the ``traceparent`` into the step's metadata (:class:`~pdactors_vllm.metadata.SendSpec`,
:class:`~pdactors_vllm.metadata.PullSpec`), and the worker's actors announce each transfer
with it here (:meth:`TransferTracer.expect`). A span whose request came without one is a root
span; every span names its transfer id (``pdactors.transfer_id``), the proxy's span too.

The spans come from the actors (:func:`pdactors.timeline.watch`) in the worker's Trio thread;
the SDK's batch processor exports them from its own thread, so nothing here waits on the
network.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from pdactors import timeline
from pdactors_vllm.settings import TraceExport

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

__all__ = ["SPAN_NAMES", "TransferTracer"]

log = logging.getLogger("pdactors.vllm")

#: The span of each side of a transfer.
SPAN_NAMES: Final = {"write": "pdactors.kv_write", "pull": "pdactors.kv_pull"}
#: How long closing the tracer may take to export what it holds (s).
_SHUTDOWN_TIMEOUT_MS: Final = 2000


class TransferTracer:
    """Turns the actors' :class:`~pdactors.timeline.TransferSpan` of the transfers it was told
    of into OpenTelemetry spans, exported to ``export``'s endpoint. Its methods run in the
    worker's Trio thread (:meth:`close` in any)."""

    def __init__(self, export: TraceExport, engine_id: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if export.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            exporter: object = GrpcExporter(endpoint=export.endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            exporter = HttpExporter(endpoint=export.endpoint)
        resource = Resource.create(
            {"service.name": "pdactors-connector", "pdactors.engine_id": engine_id}
        )
        self._provider: TracerProvider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
        self._tracer: Tracer = self._provider.get_tracer("pdactors_vllm")
        self.engine_id = engine_id
        #: transfer id -> its request's traceparent (None: none came), until it is released
        self._parents: dict[str, str | None] = {}
        self._failed = False
        timeline.watch(self._ended)
        log.info("PdActorsConnector %s: transfer spans go to %s (%s)", engine_id,
                 export.endpoint, export.protocol)  # fmt: skip

    def expect(self, transfer_id: str, traceparent: str | None) -> None:
        """``transfer_id`` is this worker's: its spans go in ``traceparent``'s trace."""
        self._parents[transfer_id] = traceparent

    def forget(self, transfer_ids: Iterable[str]) -> None:
        """These transfers ended here: no more spans of theirs."""
        for tid in transfer_ids:
            self._parents.pop(tid, None)

    def _ended(self, span: timeline.TransferSpan) -> None:
        if span.transfer_id not in self._parents:
            return  # another worker's in this process, or a notice nobody waits for
        try:
            self._export(span, self._parents[span.transfer_id])
        except Exception as exc:  # a tracing bug must not fail the transfer: said once
            if not self._failed:
                self._failed = True
                log.error("PdActorsConnector: a transfer span failed: %s", exc, exc_info=exc)

    def _export(self, span: timeline.TransferSpan, traceparent: str | None) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = None
        if traceparent is not None:
            parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        attributes: dict[str, str | int] = {
            "pdactors.transfer_id": span.transfer_id,
            "pdactors.bytes": span.nbytes,
            "pdactors.peer": span.peer,
            "pdactors.outcome": span.outcome,
            "pdactors.engine_id": self.engine_id,
        }
        otel = self._tracer.start_span(
            SPAN_NAMES[span.side],
            context=parent,
            kind=SpanKind.CLIENT if span.side == "pull" else SpanKind.PRODUCER,
            attributes=attributes,
            start_time=int(span.start * 1e9),
        )
        if span.outcome != "ok":
            otel.set_status(Status(StatusCode.ERROR, span.outcome[:500]))
        otel.end(end_time=int(span.end * 1e9))

    def close(self) -> None:
        """Stop taking spans; export what is held (bounded)."""
        timeline.unwatch(self._ended)
        self._provider.force_flush(_SHUTDOWN_TIMEOUT_MS)
        self._provider.shutdown()
