"""What becomes of a failed decoding leg, as pure decisions (no IO, no clock: the caller gives
the time): whether D is asked again computing the prompt itself (:func:`retry_reason`), and
which engine continues the request after what the client got (:func:`migration_target`).
:meth:`~pdactors.proxy._legs.Legs.retry` and :meth:`~pdactors.proxy._legs.Legs.migrate` act on
them (counts, logs, the exchange's record).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from pdactors.proxy._exchange import Exchange
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._state import Backend
from pdactors.proxy_config import ProxyConfig

__all__ = ["migration_target", "retry_reason", "successor"]


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


def migration_target(
    ex: Exchange, config: ProxyConfig, watch: HealthWatch, now: float
) -> Backend | None:
    """The engine that continues ``ex`` now that its decoding leg failed, or None: the
    failure is the engine's (a 5xx, a broken answer, an error event; not the request's 4xx),
    the deadline is ahead, fewer than ``config.migration_limit`` migrations were made, and
    another engine can serve it (:func:`successor`)."""
    failure = ex.failure
    if failure is None or failure.status < 500 or now >= ex.deadline:
        return None
    if len(ex.state.migrated_after) >= config.migration_limit:
        return None
    tried = {*ex.failed_engines, ex.d.url}
    return successor(watch, ex.d, fall_back_to_p=config.fall_back_to_p, tried=tried)


def successor(
    watch: HealthWatch,
    failed: Backend,
    *,
    fall_back_to_p: bool,
    tried: AbstractSet[str] = frozenset(),
) -> Backend | None:
    """The engine that continues a request ``failed`` was decoding: another D in rotation,
    else (``fall_back_to_p``) a P in rotation that answers with the same model; never one of
    ``tried`` (the URLs of engines that failed this request already)."""
    d, _ = watch.decode.route((), lambda b: b is not failed and b.url not in tried)
    if d is not None or not fall_back_to_p:
        return d
    pairs = watch.pairs

    def usable(b: Backend) -> bool:
        if b is failed or b.url in tried:
            return False
        return failed.role != "decode" or pairs.refusal(b, failed) is None

    p, _ = watch.prefill.route((), usable)
    return p
