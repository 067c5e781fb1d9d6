"""Whether D's failed leg is asked again with D computing the prompt itself: the pure decision
(no IO, no clock: the caller gives the time). :meth:`~pdactors.proxy._legs.Legs.retry` acts on
it (counts, logs, moves the exchange's record).
"""

from __future__ import annotations

from pdactors.proxy._exchange import Exchange

__all__ = ["retry_reason"]


def retry_reason(ex: Exchange, local: bytes | None, now: float) -> str | None:
    """Why ``ex``'s failed D leg is asked again with D computing the prompt itself, or None.

    Only a leg that pulled KV (``local``: the same request without ``kv_transfer_params``)
    whose failure was D's own (:attr:`Failure.retry`: a 5xx or an error event before D's
    first token, or its answer broken — not a refused connection, a timeout or a 4xx), with
    none of D's answer relayed (the stream then never repeats or skips a token), once per
    request, and while the request's deadline is ahead. Not a checkpoint, no IO."""
    failure = ex.failure
    if local is None or failure is None or not failure.retry:
        return None
    if not ex.state.may_retry or now >= ex.deadline:
        return None
    return failure.retry
