"""The send table's rules as data: its states, its events, and which event moves which state.

:class:`~pdactors.core.send_table.SendTable` consults :data:`TRANSITIONS` for every change of
a transfer's state and :data:`STREAM_TRANSITIONS` for every change of a streamed write; a pair
that is not in the table raises :class:`~pdactors.errors.IllegalTransition`. The tests
enumerate both tables. ``None`` is the state of a transfer id the table does not know (never
seen, or forgotten).

The table's methods name the event from what they are told and what the record holds (a
"ready" while a pull waits is :attr:`SendEvent.READY_PULLED`, without one
:attr:`SendEvent.READY`); the table says where it leads and what :class:`Do` — which effects
the move has.
"""

from __future__ import annotations

import enum

from pdactors.errors import IllegalTransition

__all__ = [
    "STREAM_TRANSITIONS",
    "TRANSITIONS",
    "Do",
    "SendEvent",
    "SendState",
    "StreamEvent",
    "StreamState",
    "next_state",
    "next_stream_state",
]


class SendState(enum.Enum):
    """Where one transfer stands on P (see :mod:`pdactors.core.send_table`)."""

    PENDING = "pending"
    READY = "ready"
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    EXPIRED = "expired"
    DROPPED = "dropped"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self not in _LIVE


_LIVE = frozenset({SendState.PENDING, SendState.READY, SendState.SENDING})
ENDED = tuple(s for s in SendState if s.ended)


class SendEvent(enum.Enum):
    """What happened to a transfer, as the table's methods name it."""

    STARTED = "started"  # P scheduled the prefill
    READY = "ready"  # P's KV is ready, no pull waits for it
    READY_PULLED = "ready_pulled"  # P's KV is ready and pulls wait for it
    READY_AGAIN = "ready_again"  # P said its KV is ready a second time (always illegal)
    STREAMING = "streaming"  # P streams its KV and the one pull it gets waits
    STREAM_UNPULLED = "stream_unpulled"  # P streams with nobody to stream to: nothing changes
    DROPPED = "dropped"  # P will not finish it
    CANCELLED = "cancelled"  # D gave up on it
    PEER_GONE = "peer_gone"  # the D worker whose pull waits is gone
    PULL = "pull"  # a pull arrived while P's KV is not here
    PULL_BLOCKS = "pull_blocks"  # a pull arrived while P's KV is (READY, or SENDING others)
    WRITE_ENDED = "write_ended"  # one write ended, others are still in flight
    WRITES_DONE = "writes_done"  # the last write ended; every expected pull was answered
    WRITES_FAILED = "writes_failed"  # the last write ended; one of them failed
    WRITES_PAUSED = "writes_paused"  # the last write ended; more pulls are expected
    WRITES_DROPPED = "writes_dropped"  # the last write ended; P dropped it meanwhile
    WRITES_CANCELLED = "writes_cancelled"  # the last write ended; D cancelled meanwhile
    NO_PULL_DUE = "no_pull_due"  # neither pull nor KV came within ready_timeout
    PULL_DUE = "pull_due"  # a pull waited ready_timeout for P's KV
    UNCLAIMED_DUE = "unclaimed_due"  # ready KV waited unclaimed_ttl for a pull
    UNREACHABLE = "unreachable"  # no D can find P now (its bootstrap rank is held by another)
    FORGET = "forget"  # an end's tombstone_ttl passed


class Do(enum.Enum):
    """The effects a move has (the table's methods carry them out)."""

    NOTHING = "nothing"  # no effect beyond the move (a new state starts its own deadline)
    WAIT = "wait"  # a pull waits for P's KV: the pull's deadline runs
    START = "start"  # write every pull that waits
    START_STREAM = "start_stream"  # write the waiting pull layer by layer
    DEFER = "defer"  # writes in flight cannot be stopped: end once they have
    END = "end"  # answer waiting pulls, release P's blocks
    REFUSE = "refuse"  # answer the pull that it failed (an end's reason)
    RELEASE = "release"  # P's blocks came after the end: release them at once
    FORGET = "forget"  # drop the tombstone


S, E = SendState, SendEvent

#: (state, event) -> (next state, effects). Absent pairs are illegal.
TRANSITIONS: dict[tuple[SendState | None, SendEvent], tuple[SendState | None, Do]] = {
    (None, E.STARTED): (S.PENDING, Do.NOTHING),
    (None, E.READY): (S.READY, Do.NOTHING),
    (None, E.STREAM_UNPULLED): (None, Do.NOTHING),
    (None, E.DROPPED): (S.DROPPED, Do.END),
    (None, E.CANCELLED): (S.CANCELLED, Do.END),
    (None, E.PULL): (S.PENDING, Do.WAIT),
    (S.PENDING, E.STARTED): (S.PENDING, Do.NOTHING),
    (S.PENDING, E.READY): (S.READY, Do.NOTHING),
    (S.PENDING, E.READY_PULLED): (S.SENDING, Do.START),
    (S.PENDING, E.STREAMING): (S.SENDING, Do.START_STREAM),
    (S.PENDING, E.STREAM_UNPULLED): (S.PENDING, Do.NOTHING),
    (S.PENDING, E.DROPPED): (S.DROPPED, Do.END),
    (S.PENDING, E.CANCELLED): (S.CANCELLED, Do.END),
    (S.PENDING, E.PEER_GONE): (S.CANCELLED, Do.END),
    (S.PENDING, E.PULL): (S.PENDING, Do.WAIT),
    (S.PENDING, E.NO_PULL_DUE): (S.EXPIRED, Do.END),
    (S.PENDING, E.PULL_DUE): (S.TIMED_OUT, Do.END),
    (S.READY, E.STREAM_UNPULLED): (S.READY, Do.NOTHING),
    (S.READY, E.DROPPED): (S.DROPPED, Do.END),
    (S.READY, E.CANCELLED): (S.CANCELLED, Do.END),
    (S.READY, E.PULL_BLOCKS): (S.SENDING, Do.START),
    (S.READY, E.UNCLAIMED_DUE): (S.EXPIRED, Do.END),
    (S.READY, E.UNREACHABLE): (S.EXPIRED, Do.END),
    (S.SENDING, E.STREAM_UNPULLED): (S.SENDING, Do.NOTHING),
    (S.SENDING, E.DROPPED): (S.SENDING, Do.DEFER),
    (S.SENDING, E.CANCELLED): (S.SENDING, Do.DEFER),
    (S.SENDING, E.PULL_BLOCKS): (S.SENDING, Do.START),
    (S.SENDING, E.WRITE_ENDED): (S.SENDING, Do.NOTHING),
    (S.SENDING, E.WRITES_DONE): (S.DONE, Do.END),
    (S.SENDING, E.WRITES_FAILED): (S.FAILED, Do.END),
    (S.SENDING, E.WRITES_PAUSED): (S.READY, Do.NOTHING),
    (S.SENDING, E.WRITES_DROPPED): (S.DROPPED, Do.END),
    (S.SENDING, E.WRITES_CANCELLED): (S.CANCELLED, Do.END),
}
# An end is a tombstone: it answers a late pull, releases late KV, and is forgotten in time.
for _end in ENDED:
    TRANSITIONS |= {
        (_end, E.STARTED): (_end, Do.NOTHING),
        (_end, E.READY): (_end, Do.RELEASE),
        (_end, E.STREAM_UNPULLED): (_end, Do.NOTHING),
        (_end, E.DROPPED): (_end, Do.NOTHING),
        (_end, E.CANCELLED): (_end, Do.NOTHING),
        (_end, E.PULL): (_end, Do.REFUSE),
        (_end, E.FORGET): (None, Do.FORGET),
    }


def next_state(
    transfer_id: str, state: SendState | None, event: SendEvent
) -> tuple[SendState | None, Do]:
    """Where ``event`` leads from ``state``; raises :class:`IllegalTransition` if nowhere."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        where = state.value if state is not None else "unknown"
        raise IllegalTransition(f"{transfer_id}: {event.value} while {where}") from None


class StreamState(enum.Enum):
    """Where a streamed write stands (the transfer itself is SENDING while it runs)."""

    COMPUTING = "computing"  # P computes the KV; each layer it reports is written
    FINISHING = "finishing"  # P's KV is complete: the write sends the rest and ends
    DROPPED = "dropped"  # P dropped it: the write ends with that failure
    ORPHANED = "orphaned"  # the write ended first (P's step hung): P's word only closes it


class StreamEvent(enum.Enum):
    """What happened to a streamed write."""

    LAYER = "layer"  # P reported layers complete
    P_READY = "p_ready"  # P's prefill ended: the KV is complete
    P_DROPPED = "p_dropped"  # P will not finish it
    WRITER_ENDED = "writer_ended"  # the write task ended


SS, SE = StreamState, StreamEvent

#: (stream state, event) -> next stream state (None: closed, the record is dropped). A word
#: from P after its KV is complete changes nothing: the blocks hold the KV either way (and
#: refusing it would make the vLLM adapter free blocks the write still reads).
STREAM_TRANSITIONS: dict[tuple[StreamState, StreamEvent], StreamState | None] = {
    (SS.COMPUTING, SE.LAYER): SS.COMPUTING,
    (SS.COMPUTING, SE.P_READY): SS.FINISHING,
    (SS.COMPUTING, SE.P_DROPPED): SS.DROPPED,
    (SS.COMPUTING, SE.WRITER_ENDED): SS.ORPHANED,
    (SS.FINISHING, SE.LAYER): SS.FINISHING,
    (SS.FINISHING, SE.P_READY): SS.FINISHING,
    (SS.FINISHING, SE.P_DROPPED): SS.FINISHING,
    (SS.FINISHING, SE.WRITER_ENDED): None,
    (SS.DROPPED, SE.LAYER): SS.DROPPED,
    (SS.DROPPED, SE.P_READY): SS.DROPPED,
    (SS.DROPPED, SE.P_DROPPED): SS.DROPPED,
    (SS.DROPPED, SE.WRITER_ENDED): None,
    (SS.ORPHANED, SE.LAYER): SS.ORPHANED,
    (SS.ORPHANED, SE.P_READY): None,
    (SS.ORPHANED, SE.P_DROPPED): None,
}


def next_stream_state(
    transfer_id: str, state: StreamState, event: StreamEvent
) -> StreamState | None:
    """Where ``event`` leads a streamed write; raises :class:`IllegalTransition` if nowhere."""
    try:
        return STREAM_TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(
            f"{transfer_id}: stream {event.value} while {state.value}"
        ) from None
