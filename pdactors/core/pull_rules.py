"""The pull table's rules as data: a pull's states, its events, and which event moves which.

:class:`~pdactors.core.pull_table.PullTable` consults :data:`PULL_TRANSITIONS` for every
change of a pull's state; a pair that is not in the table raises
:class:`~pdactors.errors.IllegalTransition` (:class:`~pdactors.errors.DuplicateTransfer` for
a second ``start``). The tests enumerate it. ``None`` is the state of a transfer id with no
pull in flight (never started, or ended: ended pulls are forgotten at once); a move to
``None`` ends the pull, with the :class:`PullDo` saying how.

An answer from a P worker the pull was not sent to, or that answered already, is no event of
the pull: the table ignores it before it gets here.
"""

from __future__ import annotations

import enum

from pdactors.errors import DuplicateTransfer, IllegalTransition

__all__ = [
    "PULL_TRANSITIONS",
    "PeerMismatch",
    "PullDo",
    "PullEvent",
    "PullState",
    "next_pull_state",
]


class PeerMismatch(IllegalTransition, ValueError):
    """The P workers named for a pull's step do not fit it (a bug in the caller)."""


class PullState(enum.Enum):
    """Where a pull in flight stands (see :mod:`pdactors.core.pull_table`)."""

    LOOKING_UP = "looking_up"
    SENT = "sent"
    ABORTING = "aborting"
    VERIFYING = "verifying"  # every P worker said its part landed; D checks the bytes


class PullEvent(enum.Enum):
    """What happened to a pull."""

    START = "start"  # D's engine asks for a transfer
    SENT = "sent"  # the request went out to its P workers
    ABORT = "abort"  # D's engine no longer wants it
    ANSWER = "answer"  # a P worker asked answered that its part landed
    REFUSED = "refused"  # a P worker asked answered that it will not deliver
    FAIL = "fail"  # D could not find or reach P (all of it, or one P worker)
    PEER_LOST = "peer_lost"  # a P worker asked is gone (side channel lost)
    SETTLED = "settled"  # no P worker asked may still write into D's blocks
    DEADLINE = "deadline"  # the pull deadline passed
    LANDED = "landed"  # every part landed, with checksums to verify
    VERIFIED = "verified"  # what landed matches P's checksums
    CORRUPT = "corrupt"  # what landed does not match them
    WRITING = "writing"  # a P worker asked says it writes into D's blocks now
    FENCED = "fenced"  # a lost P worker that was writing confirmed it stopped, or is dead
    FENCE_TIMEOUT = "fence_timeout"  # ... or neither within ``fence_timeout``


class PullDo(enum.Enum):
    """What a move does (the table's methods carry it out)."""

    NOTHING = "nothing"  # ignored, or no effect beyond the move
    CANCEL_UNSENT = "cancel_unsent"  # it ended before it went out: cancel it where it went
    CANCEL = "cancel"  # tell every P worker not answered yet that D gave up
    PART_FAILED = "part_failed"  # the first failure stands; stop the others, then settle
    SETTLE = "settle"  # end it if no P worker asked may still write
    END_ABORTED = "end_aborted"  # ends ABORTED (P was never asked)
    END_UNREACHABLE = "end_unreachable"  # ends UNREACHABLE
    END_DEADLINE = "end_deadline"  # ends DEADLINE (+ cancel those not answered)
    END_DELIVERED = "end_delivered"  # ends DELIVERED: D's blocks hold P's KV
    END_ABORTING = "end_aborting"  # ends as D's abort, or with its part's first failure
    VERIFY = "verify"  # recompute the checksums over D's blocks (off the trio thread)
    END_CORRUPT = "end_corrupt"  # ends CORRUPT: D's blocks do not hold what P sent
    NOTE_WRITING = "note_writing"  # remember it: should D lose that P worker, fence the pull


S, E, Do = PullState, PullEvent, PullDo

#: (state, event) -> (next state, what the move does). Absent pairs are illegal.
PULL_TRANSITIONS: dict[tuple[PullState | None, PullEvent], tuple[PullState | None, PullDo]] = {
    (None, E.START): (S.LOOKING_UP, Do.NOTHING),
    (None, E.SENT): (None, Do.CANCEL_UNSENT),
    (None, E.ABORT): (None, Do.NOTHING),  # ended already
    (None, E.ANSWER): (None, Do.NOTHING),  # a late answer
    (None, E.REFUSED): (None, Do.NOTHING),
    (None, E.FAIL): (None, Do.NOTHING),
    (S.LOOKING_UP, E.SENT): (S.SENT, Do.NOTHING),
    (S.LOOKING_UP, E.ABORT): (None, Do.END_ABORTED),
    (S.LOOKING_UP, E.ANSWER): (S.LOOKING_UP, Do.NOTHING),  # P was not asked: not its answer
    (S.LOOKING_UP, E.REFUSED): (S.LOOKING_UP, Do.NOTHING),
    (S.LOOKING_UP, E.FAIL): (None, Do.END_UNREACHABLE),
    (S.LOOKING_UP, E.DEADLINE): (None, Do.END_DEADLINE),
    (S.SENT, E.ABORT): (S.ABORTING, Do.CANCEL),
    (S.SENT, E.ANSWER): (S.SENT, Do.SETTLE),
    (S.SENT, E.REFUSED): (S.ABORTING, Do.PART_FAILED),
    (S.SENT, E.FAIL): (S.ABORTING, Do.PART_FAILED),
    (S.SENT, E.PEER_LOST): (S.ABORTING, Do.PART_FAILED),
    (S.SENT, E.SETTLED): (None, Do.END_DELIVERED),
    (S.SENT, E.DEADLINE): (None, Do.END_DEADLINE),
    (S.ABORTING, E.ABORT): (S.ABORTING, Do.NOTHING),  # the first abort or failure stands
    (S.ABORTING, E.ANSWER): (S.ABORTING, Do.SETTLE),  # whatever P says, it stopped
    (S.ABORTING, E.REFUSED): (S.ABORTING, Do.SETTLE),
    (S.ABORTING, E.FAIL): (S.ABORTING, Do.SETTLE),
    (S.ABORTING, E.PEER_LOST): (S.ABORTING, Do.SETTLE),
    (S.ABORTING, E.SETTLED): (None, Do.END_ABORTING),
    (S.ABORTING, E.DEADLINE): (None, Do.END_ABORTING),
    (S.SENT, E.LANDED): (S.VERIFYING, Do.VERIFY),
    # No P worker writes any more: an abort or the deadline ends it at once (the check's
    # result is then ignored); a late or repeated answer changes nothing.
    (S.VERIFYING, E.ABORT): (None, Do.END_ABORTED),
    (S.VERIFYING, E.ANSWER): (S.VERIFYING, Do.NOTHING),
    (S.VERIFYING, E.REFUSED): (S.VERIFYING, Do.NOTHING),
    (S.VERIFYING, E.FAIL): (S.VERIFYING, Do.NOTHING),
    (S.VERIFYING, E.DEADLINE): (None, Do.END_DEADLINE),
    (S.VERIFYING, E.VERIFIED): (None, Do.END_DELIVERED),
    (S.VERIFYING, E.CORRUPT): (None, Do.END_CORRUPT),
    (None, E.VERIFIED): (None, Do.NOTHING),  # the pull ended while being checked
    (None, E.CORRUPT): (None, Do.NOTHING),
    # A write that may land after D lost its writer: the pull keeps D's blocks (ABORTING)
    # until the writer confirms it stopped or is dead, or at the fence timeout. While a pull
    # is fenced, the table fires FENCE_TIMEOUT for it, never DEADLINE; FENCED and
    # FENCE_TIMEOUT only ever reach a fenced pull, which is ABORTING (a lost P worker's part
    # failed, or D had aborted).
    (None, E.WRITING): (None, Do.NOTHING),  # a late notice
    (S.LOOKING_UP, E.WRITING): (S.LOOKING_UP, Do.NOTHING),  # P was not asked
    (S.SENT, E.WRITING): (S.SENT, Do.NOTE_WRITING),
    (S.ABORTING, E.WRITING): (S.ABORTING, Do.NOTE_WRITING),  # D's cancel is on its way
    (S.VERIFYING, E.WRITING): (S.VERIFYING, Do.NOTHING),  # every part answered already
    (S.ABORTING, E.FENCED): (S.ABORTING, Do.SETTLE),
    (None, E.FENCED): (None, Do.NOTHING),
    (S.ABORTING, E.FENCE_TIMEOUT): (None, Do.END_ABORTING),
}


def next_pull_state(
    transfer_id: str, state: PullState | None, event: PullEvent
) -> tuple[PullState | None, PullDo]:
    """Where ``event`` leads a pull from ``state``. Raises :class:`DuplicateTransfer` for a
    second start, :class:`IllegalTransition` for any other pair the rules lack."""
    try:
        return PULL_TRANSITIONS[state, event]
    except KeyError:
        if event is PullEvent.START:
            raise DuplicateTransfer(transfer_id) from None
        where = state.value if state is not None else "not in flight"
        raise IllegalTransition(f"{transfer_id}: {event.value} while {where}") from None
