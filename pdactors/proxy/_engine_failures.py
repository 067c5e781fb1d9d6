"""What the client is told when an engine's leg fails: a :class:`~pdactors.proxy._openai.Failure`
naming the engine and what it said, and whether a second try of D's leg may help.

A 4xx passes through (the request's own fault: vLLM's error body as it came), anything else is
a 502 naming the engine, no answer in time a 504. D's error event in a stream (vLLM's bare
"Internal server error") is replaced by one that names D. Each engine failure is counted in
the backend-error metric; a refused connection also takes the engine out of rotation.
"""

from __future__ import annotations

from typing import Final

import httpx
import msgspec

from pdactors.errors import describe
from pdactors.proxy._engine_http import ConnectFailed, EngineError
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._openai import Failure
from pdactors.proxy._state import Backend, Metrics
from pdactors.proxy_config import ProxyConfig

__all__ = ["EngineFailures", "error_event_at"]

#: The SSE events in which an engine reports a failure of a stream it already answered 200
#: to: a completion's or chat's, and the Responses API's (typed ``error``).
_ERROR_EVENTS: Final = (b'data: {"error"', b"event: error\n")


def error_event_at(chunk: bytes) -> int:
    """Where the first error event in ``chunk`` begins (an event's start), or -1."""
    found = [at for e in _ERROR_EVENTS if (at := chunk.find(e)) >= 0]
    return min(found, default=-1)


class EngineFailures:
    """The failures of engine calls, worded for the client (and counted)."""

    def __init__(self, config: ProxyConfig, metrics: Metrics, watch: HealthWatch) -> None:
        self.config = config
        self.metrics = metrics
        self.watch = watch

    def timeout_failure(self, what: str) -> Failure:
        message = f"{what} within the request timeout ({self.config.request_timeout:g} s)"
        return Failure.of(504, message, "timeout", "timeout")

    def judged_failed(self, b: Backend) -> Failure:
        """The request was cut from ``b``, judged failed while the request waited on it: P's
        token in the P-first flow (D may serve it alone: ``p_unhealthy``), or the answer of the
        engine decoding it (another engine may continue it)."""
        if b.draining and b.up:
            message = f"{b.role} engine {b.url} drained: its requests continue elsewhere"
        else:
            message = f"{b.role} engine {b.url} judged failed: {b.problem}"
        outcome = f"{b.role}_error"
        return Failure.of(502, message, "upstream_error", outcome, fallback="p_unhealthy")

    def transport_failure(self, b: Backend, exc: EngineError | httpx.HTTPError) -> Failure:
        """A broken call: a 502; a refused connection also takes the engine out of rotation."""
        self.metrics.backend_errors.labels(b.role, b.url).inc()
        if isinstance(exc, ConnectFailed | httpx.ConnectError):  # gone: out of rotation now
            self.watch.set(b, f"connection failed: {describe(exc)}", None, engine_failed=True)
        message = f"{b.role} engine {b.url} failed: {describe(exc)}"
        # A broken answer (not a refused connection) may be a D whose API server gave up on
        # a request whose KV did not come: worth a second try.
        why = "decode_broke" if b.role == "decode" and not isinstance(exc, ConnectFailed) else ""
        return Failure.of(502, message, "upstream_error", f"{b.role}_error", retry=why)

    def event_failure(self, b: Backend, event: bytes, *, before_token: bool = True) -> Failure:
        """D's error event (vLLM's streamed error: under ``kv_load_failure_policy: fail``
        what a pull that failed gives, as the bare "Internal server error") as a failure
        naming D and what it said."""
        self.metrics.backend_errors.labels(b.role, b.url).inc()
        said = event.split(b"data: ", 1)[-1].strip()
        try:
            said_json = msgspec.json.decode(said)
            error = said_json.get("error") or said_json  # (the Responses API's: flat)
            text = str(error.get("message") or said[:300].decode(errors="replace"))
        except (msgspec.DecodeError, AttributeError):
            text = said[:300].decode(errors="replace")
        when = "before its first token" if before_token else "mid-stream"
        message = f"{b.role} engine {b.url} failed {when}: {text}"
        return Failure.of(502, message, "upstream_error", f"{b.role}_error", retry="decode_failed")

    def status_failure(self, b: Backend, status: int, body: bytes) -> Failure:
        """A 4xx passes through (vLLM's own error body); anything else becomes a 502."""
        outcome = f"{b.role}_error"
        text = body[:500].decode(errors="replace")
        if 400 <= status < 500:  # the request's fault, not the engine's
            try:
                passed = msgspec.json.decode(body)
            except msgspec.DecodeError:
                passed = None
            if isinstance(passed, dict) and "error" in passed:
                return Failure(status, body, outcome)
            message = f"{b.role} engine {b.url}: {text}"
            return Failure.of(status, message, "invalid_request_error", outcome)
        self.metrics.backend_errors.labels(b.role, b.url).inc()
        message = f"{b.role} engine {b.url} answered HTTP {status}: {text}"
        why = "decode_failed" if b.role == "decode" else ""
        return Failure.of(502, message, "upstream_error", outcome, retry=why)
