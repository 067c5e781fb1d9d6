"""What the proxy exchange's record asks its IO code to do: the effects of its events
(:mod:`pdactors.core.exchange`), and what a failure must tell the record (:class:`Cause`).

The record names engines by the caller's handles (the proxy's ``Backend``): an effect that
changes an engine's counts carries the engine it changes, so the effects of one event are
carried out in order whatever the record became meanwhile. The proxy carries every effect
out in one place (:mod:`pdactors.proxy._effects`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Admit",
    "CancelLegs",
    "Cause",
    "DGoesOn",
    "Effect",
    "Ended",
    "FellBack",
    "FirstChunk",
    "FreeAtP",
    "FreshLeg",
    "Hold",
    "Migrate",
    "PFirstPath",
    "Placed",
    "PromptCounted",
    "Release",
    "Retried",
    "SecondChunk",
    "Step",
    "Unhold",
]


class Cause(Protocol):
    """What a failure tells the record: the metric outcome it counts as, its HTTP status, its
    message (named when a later failure is told), why D's leg may be asked again (``retry``,
    "" when a second try cannot help) and why D may serve a P-first request alone after it
    (``fallback``, "" for ``prefill_failed``)."""

    @property
    def outcome(self) -> str: ...
    @property
    def status(self) -> int: ...
    @property
    def message(self) -> str: ...
    @property
    def retry(self) -> str: ...
    @property
    def fallback(self) -> str: ...


# ---------------------------------------------------------------- counts (exactly once)


@dataclass(frozen=True)
class Admit:
    """Raise ``d``'s outstanding count, ``p``'s when given, and the requests in flight."""

    p: object | None
    d: object


@dataclass(frozen=True)
class Hold:
    """The prompt (``tokens``) waits in ``engine``'s prefill queue; ``waiting``: the D that
    waits for its KV (one more request incoming there), None when ``engine`` serves it."""

    engine: object
    tokens: int
    waiting: object | None


@dataclass(frozen=True)
class Unhold:
    """The prompt left ``engine``'s prefill queue (the :class:`Hold` undone); when it came
    back with its first token, ``seconds`` after it was sent with ``tokens_ahead`` waiting
    (what the placer learns), else ``seconds`` is None."""

    engine: object
    tokens: int
    waiting: object | None
    tokens_ahead: int
    seconds: float | None


@dataclass(frozen=True)
class Release:
    """Lower ``engine``'s outstanding count."""

    engine: object


@dataclass(frozen=True)
class Migrate:
    """The request moves from ``frm`` (its decoding failed: ``cause``) to ``to``, which
    continues it after what the client already got: the outstanding count moves with it.
    ``number``: this hand-over's (1 for the first)."""

    frm: object
    to: object
    number: int
    cause: Cause


@dataclass(frozen=True)
class Ended:
    """Count the request as ``outcome`` (and no longer in flight); ``latency``: from its
    arrival to its end, for a successful one."""

    outcome: str
    latency: float | None


# ---------------------------------------------------------------- legs, the client's answer


@dataclass(frozen=True)
class CancelLegs:
    """Cancel P's leg and every part of D's: the request failed or ended unanswered."""


@dataclass(frozen=True)
class FreshLeg:
    """D's next leg begins (retry, migration, fall-back): the failed leg's scopes are done."""


@dataclass(frozen=True)
class Placed:
    """The answer's placement header says ``placement``; ``why``: the reason it is counted
    under at admission (None: not counted again, a fall-back's)."""

    placement: str
    why: str | None


# ---------------------------------------------------------------- what is counted, logged, learnt


@dataclass(frozen=True)
class FellBack:
    """One engine serves a request meant for two (counted as ``why``); ``cause``: P's
    failure before its token, when that is why (logged)."""

    why: str
    cause: Cause | None


@dataclass(frozen=True)
class FreeAtP:
    """P may hold the prompt's KV for a pull no D will make now (D's leg was given up: asked
    again computing the prompt, moved to another engine, the request ended without it):
    ask ``engine`` to free it now, not at its ``unclaimed_ttl``. Once per exchange."""

    engine: object


@dataclass(frozen=True)
class Retried:
    """D's leg is asked again computing the prompt itself after ``cause`` (counted as
    ``why``, logged)."""

    why: str
    cause: Cause


@dataclass(frozen=True)
class DGoesOn:
    """P failed beside D (the concurrent flow; the first such failure): logged, D goes on."""

    cause: Cause


@dataclass(frozen=True)
class PFirstPath:
    """P-first: the request ended at P's token, or continued on D (counted as ``path``)."""

    path: str


@dataclass(frozen=True)
class PromptCounted:
    """P said the prompt of ``chars`` characters is ``tokens`` tokens (the placer learns)."""

    chars: int
    tokens: int


@dataclass(frozen=True)
class FirstChunk:
    """The client's first chunk went out ``ttft`` seconds after the request arrived."""

    ttft: float


@dataclass(frozen=True)
class SecondChunk:
    """P-first: D's first chunk went out ``since_arrival`` seconds after the request arrived,
    ``caught_up`` seconds after D was asked (for ``tokens`` prompt tokens)."""

    since_arrival: float
    caught_up: float | None
    tokens: int


@dataclass(frozen=True)
class Step:
    """D's stream ended well after ``gaps`` gaps between its chunks, ``seconds`` each on
    average (D's decode step, as the client sees it); ``per_chunk``: the mean gap from the
    client's first chunk (P's token, where it went first) to the end, D's catch-up included
    (the time per output token the client got)."""

    seconds: float
    gaps: int
    per_chunk: float | None = None


Effect = (
    Admit
    | Hold
    | Unhold
    | Release
    | Migrate
    | Ended
    | CancelLegs
    | FreshLeg
    | Placed
    | FellBack
    | Retried
    | FreeAtP
    | DGoesOn
    | PFirstPath
    | PromptCounted
    | FirstChunk
    | SecondChunk
    | Step
)
