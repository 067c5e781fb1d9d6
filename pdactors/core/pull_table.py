"""D side: the pulls one D worker has in flight, and how each one ends.

Sans-IO, like :mod:`pdactors.core.send_table`. A pull's whole life is one :class:`Pull` record
here — where P is looked up, which blocks it fills, the request sent, when it started, who
waits for it — so the receiver actor keeps no per-transfer map of its own. Every pull ends
exactly once, as one :class:`Completed` effect with a typed :class:`PullEnd`. A pull that had
reached P when D gave up (abort, deadline) also yields :class:`SendCancel`, so P frees its
blocks at once instead of waiting for its own expiry.

A pull may go to several P workers (heterogeneous tensor parallelism: a D rank takes its heads
from several P ranks); it is delivered once every one of them has answered that its part
landed. An abort of a pull that reached P does not end it at once: P may be writing into D's
blocks, so the pull ends (as aborted) when every P worker asked has answered anything or is
known to be gone (no write can land any more), or at the deadline. Only then may D reuse the
blocks. When one of several P workers refuses or is lost, the others are told to stop
(:class:`SendCancel`) and the pull ends, with the first failure, once they have all answered
or are gone.

============  ===========================  ===============================================
state         entered when                 leaves when
============  ===========================  ===============================================
LOOKING_UP    ``start``                    ``sent`` → SENT; ``fail`` / ``abort`` / the
                                           deadline → ended
SENT          the pull went out to P       every P worker answered → ended; one refuses or
              (one or more workers)        is lost → ended when it was the last one asked,
                                           else ABORTING (+ SendCancel to the others);
                                           ``fail`` or the deadline → ended (+ SendCancel
                                           to those not answered); ``abort`` → ABORTING
                                           (+ SendCancel)
ABORTING      D gave up on a pull P has,   every P worker asked answered (whatever it
              or a part of it failed       says) or is lost, ``fail``, or the deadline →
                                           ended (ABORTED, or the part's failure)
============  ===========================  ===============================================

A second ``start`` for a transfer id in flight raises :class:`DuplicateTransfer` and changes
nothing. Ended pulls are forgotten at once; a late answer from P, or one from a peer the pull
was not sent to (or that answered already), is ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdactors.errors import DuplicateTransfer, IllegalTransition
from pdactors.messages import BlockIds, PullRequest

__all__ = ["Completed", "Pull", "PullEnd", "PullState", "PullTable", "SendCancel"]


class PullState(enum.Enum):
    LOOKING_UP = "looking_up"
    SENT = "sent"
    ABORTING = "aborting"


class PullEnd(enum.Enum):
    """How a pull ended. Only ``DELIVERED`` means D's blocks hold P's KV."""

    DELIVERED = "delivered"
    #: P answered that it will not deliver (dropped, failed write, bad request, ...).
    REFUSED = "refused"
    #: P's side channel was lost: its process died or it stopped answering heartbeats.
    P_GONE = "p_gone"
    #: D could not find or reach P (bootstrap look-up, bad address, socket error).
    UNREACHABLE = "unreachable"
    #: D gave up (engine abort, cancelled caller).
    ABORTED = "aborted"
    #: The last resort: P stayed alive but never answered within the pull deadline.
    DEADLINE = "deadline"

    @property
    def ok(self) -> bool:
        return self is PullEnd.DELIVERED

    @property
    def p_may_have_moved(self) -> bool:
        """After this end, D should look P up again rather than trust its cached address."""
        return self in (PullEnd.P_GONE, PullEnd.UNREACHABLE, PullEnd.DEADLINE)


@dataclass(slots=True, eq=False)
class Pull:
    """One pull in flight. ``waiter`` is opaque here: the actor's wake-up for an awaiting
    caller, handed back with the :class:`Completed` effect."""

    transfer_id: str
    bootstrap_url: str
    engine_id: str
    block_ids: BlockIds
    started: float
    deadline: float
    state: PullState = PullState.LOOKING_UP
    #: The P workers asked (side-channel addresses), and the request each was sent.
    peers: tuple[str, ...] = ()
    request: PullRequest | None = None
    #: Those of ``peers`` that have not answered and are not known gone.
    waiting: set[str] = field(default_factory=set)
    abort_reason: str = ""
    #: ABORTING because a part failed (not D's abort): how the pull ends.
    failure: tuple[PullEnd, str] | None = None
    waiter: object = field(default=None)


@dataclass(frozen=True, slots=True)
class Completed:
    """The pull of ``transfer_id`` ended with ``end``; ``reason`` says why when not delivered."""

    transfer_id: str
    end: PullEnd
    reason: str = ""
    pull: Pull | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.end.ok


@dataclass(frozen=True, slots=True)
class SendCancel:
    """Tell the P worker at ``peer`` that D gave up on ``transfer_id``."""

    peer: str
    transfer_id: str
    reason: str


PullEffect = Completed | SendCancel


class PullTable:
    """The pulls of one D worker (see the module docstring for the rules).

    ``timeout`` is the pull deadline: the last resort for a P that stays alive and silent.
    """

    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self._pulls: dict[str, Pull] = {}

    def __len__(self) -> int:
        return len(self._pulls)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._pulls

    def get(self, transfer_id: str) -> Pull | None:
        return self._pulls.get(transfer_id)

    def state(self, transfer_id: str) -> PullState | None:
        pull = self._pulls.get(transfer_id)
        return pull.state if pull else None

    def on_peer(self, peer: str) -> list[str]:
        """The pulls in flight that wait for an answer from ``peer``."""
        return [t for t, p in self._pulls.items() if peer in p.waiting]

    # ------------------------------------------------------------------ D's engine

    def start(
        self,
        transfer_id: str,
        now: float,
        *,
        bootstrap_url: str = "",
        engine_id: str = "",
        block_ids: BlockIds = (),
        waiter: object = None,
    ) -> Pull:
        """A new pull; it must end within ``timeout`` seconds from ``now``.

        Raises :class:`DuplicateTransfer` (and changes nothing) when ``transfer_id`` is in flight.
        """
        if transfer_id in self._pulls:
            raise DuplicateTransfer(transfer_id)
        pull = Pull(
            transfer_id, bootstrap_url, engine_id, block_ids, now, now + self.timeout, waiter=waiter
        )
        self._pulls[transfer_id] = pull
        return pull

    def abort(self, transfer_id: str, reason: str = "aborted by D") -> list[PullEffect]:
        """D's engine no longer wants ``transfer_id``; ignored if already ended or aborting.

        Ends at once when P was not asked yet; otherwise P is told and the pull ends when P
        answers (or is gone, or at the deadline), so D's blocks are not reused under a write.
        """
        pull = self._pulls.get(transfer_id)
        if pull is None or pull.state is PullState.ABORTING:
            return []
        if pull.state is PullState.LOOKING_UP:
            return [self._end(pull, PullEnd.ABORTED, reason)]
        pull.state, pull.abort_reason = PullState.ABORTING, reason
        return self._cancels(pull, reason)

    # ------------------------------------------------------------------ the actor's work

    def sent(
        self, transfer_id: str, peers: str | Sequence[str], request: PullRequest | None = None
    ) -> list[PullEffect]:
        """The pull ``request`` went out to ``peers`` (one P worker's address, or several).
        If the pull ended meanwhile, cancel it there."""
        peers = (peers,) if isinstance(peers, str) else tuple(peers)
        if not peers or len(set(peers)) != len(peers):
            raise ValueError(f"{transfer_id}: a pull goes to distinct P workers, got {peers}")
        pull = self._pulls.get(transfer_id)
        if pull is None:
            return [SendCancel(p, transfer_id, "pull ended before it was sent") for p in peers]
        if pull.state is not PullState.LOOKING_UP:
            raise IllegalTransition(f"{transfer_id}: sent while {pull.state.value}")
        pull.state, pull.peers, pull.request = PullState.SENT, peers, request
        pull.waiting = set(peers)
        return []

    def answered(
        self, transfer_id: str, *, ok: bool, reason: str = "", peer: str | None = None
    ) -> list[PullEffect]:
        """P answered (``PullDone`` → ok, ``PullFailed`` → not ok). Late answers, and answers
        from a ``peer`` that was not asked or answered already, are ignored. ``peer`` may be
        left out for a pull sent to one P worker."""
        pull = self._pulls.get(transfer_id)
        if pull is None or pull.state is PullState.LOOKING_UP:
            return []
        if peer is None:
            if len(pull.peers) != 1:
                raise ValueError(f"{transfer_id}: went to {len(pull.peers)} P workers; say which")
            peer = pull.peers[0]
        if peer not in pull.waiting:
            return []
        pull.waiting.discard(peer)
        if not ok and pull.state is not PullState.ABORTING:
            return self._part_failed(pull, PullEnd.REFUSED, reason)
        return self._settled(pull)  # aborting: P's answer, whatever it says, is its "stopped"

    def fail(self, transfer_id: str, reason: str, peer: str | None = None) -> list[PullEffect]:
        """D could not find or reach P for this pull (``peer``: one of the P workers it was
        sent to; None: all of them); ignored if already ended."""
        pull = self._pulls.get(transfer_id)
        if pull is None:
            return []
        if pull.state is PullState.LOOKING_UP:
            return [self._end(pull, PullEnd.UNREACHABLE, reason)]
        if peer is not None:
            if peer not in pull.waiting:
                return []
            pull.waiting.discard(peer)
        # The P workers still waiting may be writing: stop them, end once they are done.
        return self._part_failed(pull, PullEnd.UNREACHABLE, reason)

    def peer_lost(self, peer: str, reason: str) -> list[PullEffect]:
        """P's side channel at ``peer`` is gone (process died, heartbeats stopped): every pull
        waiting for it ends now (once the other P workers it went to are done with D's
        blocks), and an aborting one frees D's blocks as soon as nothing else may write."""
        effects: list[PullEffect] = []
        for tid in self.on_peer(peer):
            pull = self._pulls[tid]
            pull.waiting.discard(peer)
            effects += self._part_failed(pull, PullEnd.P_GONE, reason)
        return effects

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[PullEffect]:
        """End every pull whose deadline has passed."""
        effects: list[PullEffect] = []
        for pull in [p for p in self._pulls.values() if now >= p.deadline]:
            if pull.state is PullState.ABORTING:
                unconfirmed = f"P did not confirm within {self.timeout:g} s"
                effects.append(self._end(pull, *self._abort_end(pull, unconfirmed)))
                continue
            reason = f"no answer from a live P within the pull deadline ({self.timeout:g} s)"
            effects.append(self._end(pull, PullEnd.DEADLINE, reason))
            effects += self._cancels(pull, reason)
        return effects

    def next_deadline(self) -> float:
        """The earliest deadline of a pull in flight (``inf`` when none)."""
        return min((p.deadline for p in self._pulls.values()), default=float("inf"))

    # ------------------------------------------------------------------ internals

    def _part_failed(self, pull: Pull, end: PullEnd, reason: str) -> list[PullEffect]:
        """One P worker of ``pull`` refused or is gone: the pull fails, once the others are
        done with D's blocks (they are asked to stop)."""
        if pull.state is PullState.ABORTING:  # the first failure, or D's abort, stands
            return self._settled(pull, reason)
        pull.state, pull.failure = PullState.ABORTING, (end, reason)
        return [*self._cancels(pull, reason), *self._settled(pull)]

    def _settled(self, pull: Pull, why: str = "") -> list[PullEffect]:
        """End ``pull`` if no P worker may still write into its blocks."""
        if pull.waiting:
            return []
        if pull.state is PullState.ABORTING:
            return [self._end(pull, *self._abort_end(pull, why))]
        return [self._end(pull, PullEnd.DELIVERED, "")]

    @staticmethod
    def _abort_end(pull: Pull, why: str) -> tuple[PullEnd, str]:
        """How an ABORTING pull ends: as D's abort, or with the failure of one of its parts."""
        if pull.failure is not None:
            return pull.failure
        return PullEnd.ABORTED, f"{pull.abort_reason}; {why}" if why else pull.abort_reason

    def _cancels(self, pull: Pull, reason: str) -> list[PullEffect]:
        """Tell every P worker of ``pull`` that has not answered that D gave up on it."""
        return [SendCancel(p, pull.transfer_id, reason) for p in pull.peers if p in pull.waiting]

    def _end(self, pull: Pull, end: PullEnd, reason: str) -> Completed:
        del self._pulls[pull.transfer_id]
        return Completed(pull.transfer_id, end, "" if end.ok else reason, pull)
