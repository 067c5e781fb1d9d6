"""What the client got of one exchange's answer, and when: the part of the exchange's record
(:mod:`pdactors.core.exchange`) that follows the client's side — its stream opened, P's token
(P-first), D's chunks — and what the metrics and the placer learn from their times: the
client's time to first token, P-first's second chunk and D's catch-up, D's decode step. No IO,
no clock: times come from the caller; the record moves it, by its table, and nothing else.
"""

from __future__ import annotations

from pdactors.core.exchange_effects import FirstChunk, SecondChunk, Step
from pdactors.errors import IllegalTransition

__all__ = ["ClientAnswer"]


class ClientAnswer:
    """The client's answer so far (``arrived``: when the request came)."""

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.streaming = False  # the client's stream began: a failure is its last event
        self.first_sent: float | None = None  # when the client's first chunk went out
        self.d_sent: float | None = None  # P-first: when D was asked, after P's token
        self.d_chunks = 0  # D's chunks relayed
        self._d_first: float | None = None  # when D's first chunk went out

    def p_token(self, now: float) -> FirstChunk:
        """P-first: P's token went to the client at ``now``: its first chunk."""
        self.first_sent = now
        return FirstChunk(now - self.arrived)

    def d_chunk(self, now: float | None, tokens: int) -> FirstChunk | SecondChunk | None:
        """One chunk of D's went to the client; ``now`` is read for D's first only: the
        client's first chunk, or P-first's second (``tokens``: the prompt's, for D's
        catch-up). None for every later one (only counted: D's step is learnt at the end
        from the stream's span, so no clock is read per chunk)."""
        if self.d_chunks == 0 and now is None:
            raise IllegalTransition("exchange: D's first chunk needs its time")
        self.d_chunks += 1
        if self.d_chunks > 1 or now is None:
            return None
        self._d_first = now
        if self.first_sent is not None:  # P's token went first
            caught_up = None if self.d_sent is None else now - self.d_sent
            return SecondChunk(now - self.arrived, caught_up, tokens)
        self.first_sent = now
        return FirstChunk(now - self.arrived)

    def step(self, now: float) -> Step | None:
        """D's decode step as the client saw it, for a stream of one engine that ended well
        at ``now`` with two chunks of D's or more; else None. (A failed stream's last gap may
        be a stall: the caller asks only for a good one.)"""
        if self._d_first is None or self.d_chunks < 2:
            return None
        gaps = self.d_chunks - 1
        first = self._d_first if self.first_sent is None else self.first_sent
        client_gaps = gaps + (first < self._d_first)  # P's token first: one gap more
        per_chunk = (now - first) / client_gaps
        return Step((now - self._d_first) / gaps, gaps, per_chunk)
