"""What follows a failed exchange, as pure decisions over its record: the proxy's policy after a
failure. No IO, no clock: the caller gives the time.

The record (:mod:`pdactors.core.exchange`) says what failed and what the client got; the
table (:mod:`pdactors.core.exchange_rules`) which rows may follow a failure; this module which
one does — a fall-back to D (P-first, P failed before its token), a retry (D asked again
computing the prompt itself), a migration (another engine continues), or the failure told to
the client (an HTTP status while nothing was sent, the stream's last event once it began).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdactors.core.exchange import ExchangeState
from pdactors.core.exchange_rules import PULLS_KV, Phase
from pdactors.errors import IllegalTransition

__all__ = ["Next", "Policy", "after_failure", "retry_reason"]


class Next(enum.Enum):
    """What becomes of a failed request: the row of the table to fire next, or none."""

    FALL_BACK = "fall_back"  # P-first: D serves it alone (ExchangeState.fall_back)
    RETRY = "retry"  # D asked again computing the prompt itself (ExchangeState.retry)
    MIGRATE = "migrate"  # another engine continues, if one is found (ExchangeState.migrate)
    TELL = "tell"  # the failure is the client's: an HTTP status, or a begun stream's last event


@dataclass(frozen=True)
class Policy:
    """The operator's say: ``fall_back_to_d`` (a P-first request whose P failed before its
    token is served by D alone) and ``migration_limit`` (how many times one request may be
    handed to another engine; 0: never)."""

    fall_back_to_d: bool = True
    migration_limit: int = 3


def after_failure(ex: ExchangeState[Any], now: float, policy: Policy) -> Next:
    """What becomes of ``ex`` now that it failed: P-first before P's token, a fall-back to D
    when P's own failure (a 5xx, broken, judged failed; not a 4xx, not a timeout) left time
    and the policy allows it; after D's leg failed, a retry (:func:`retry_reason`), else a
    migration when the failure is the engine's (not the request's 4xx), time is left and
    fewer than ``policy.migration_limit`` were made (the caller finds the engine, if any);
    else the failure is told. Raises :class:`~pdactors.errors.IllegalTransition` when
    nothing failed."""
    cause = ex.cause
    if ex.phase is Phase.FAILED_AT_P and cause is not None:
        ok = cause.outcome == "prefill_error" and cause.status >= 500
        return Next.FALL_BACK if policy.fall_back_to_d and ok and now < ex.deadline else Next.TELL
    if ex.phase is not Phase.FAILED or cause is None:
        raise IllegalTransition(f"exchange: nothing failed while {ex.phase.value}")
    if retry_reason(ex, now) is not None:
        return Next.RETRY
    room = len(ex.migrated_after) < policy.migration_limit
    if cause.status >= 500 and now < ex.deadline and room:
        return Next.MIGRATE
    return Next.TELL


def retry_reason(ex: ExchangeState[Any], now: float) -> str | None:
    """Why ``ex``'s failed D leg is asked again computing the prompt itself, or None: only a
    leg that pulled KV (the P-first and concurrent flows) whose failure was D's own
    (``Cause.retry``: a 5xx or an error event before D's first token, or its answer broken —
    not a refused connection, a timeout or a 4xx), with none of D's answer relayed (the
    stream then never repeats or skips a token), once per request, and while the deadline is
    ahead."""
    cause = ex.cause
    if ex.flow not in PULLS_KV or cause is None or not cause.retry:
        return None
    if not ex.may_retry or now >= ex.deadline:
        return None
    return cause.retry
