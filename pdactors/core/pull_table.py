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

The rules are data: :data:`~pdactors.core.pull_rules.PULL_TRANSITIONS`. In short: LOOKING_UP
(``start``) → SENT (the pull went out to its P workers) → ended once every P worker answered
(→ VERIFYING first when their answers carried checksums: :class:`Verify`, then
:meth:`PullTable.verified` ends it delivered or ``CORRUPT``);
a refusal, a lost P worker or D's abort → ABORTING (the others are told to stop) → ended once
no P worker may still write; the deadline ends any of them.

A second ``start`` for a transfer id in flight raises
:class:`~pdactors.errors.DuplicateTransfer` and changes
nothing. Ended pulls are forgotten at once; a late answer from P, or one from a peer the pull
was not sent to (or that answered already), is ignored; so is one from another life of that
P worker than the one the pull was sent to (its epoch, :mod:`pdactors.core.epochs`), but its
refusal of a pull meant for another life (``lookup_again``): that P wrote nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdactors.core.pull_rules import PeerMismatch, PullDo, PullEvent, PullState, next_pull_state
from pdactors.errors import IllegalTransition
from pdactors.wire import BlockIds, PullRequest

__all__ = [
    "Completed",
    "PeerMismatch",
    "Pull",
    "PullEnd",
    "PullState",
    "PullTable",
    "SendCancel",
    "Verify",
]


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
    #: What landed in D's blocks does not match P's checksums (a torn or misplaced write).
    CORRUPT = "corrupt"

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
    #: The epoch of the P worker at each of ``peers`` the pull was meant for (0: not known).
    p_epochs: dict[str, int] = field(default_factory=dict)
    abort_reason: str = ""
    #: ABORTING because a part failed (not D's abort): how the pull ends.
    failure: tuple[PullEnd, str] | None = None
    waiter: object = field(default=None)
    #: ``(P worker, PullDone.sums)`` of each part that landed, when D verifies.
    sums: list[tuple[str, bytes]] = field(default_factory=list)

    def from_other_life(self, peer: str, epoch: int, *, lookup_again: bool = False) -> bool:
        """Whether an answer from ``peer`` at P epoch ``epoch`` comes from another life of
        that P worker than the one this pull was sent to, and is to be ignored: never taken as
        D's KV. Either side not saying (0) is not another life; a refusal that says D should
        look P up again (a pull meant for another life) is taken: that P wrote nothing."""
        sent_to = self.p_epochs.get(peer, 0)
        return bool(sent_to and epoch and epoch != sent_to and not lookup_again)


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


@dataclass(frozen=True, slots=True)
class Verify:
    """Every part of ``transfer_id`` landed: recompute their checksums over D's blocks, then
    :meth:`PullTable.verified`. ``parts``: ``(P worker, sums)``; ``b""``: it sent none."""

    transfer_id: str
    parts: tuple[tuple[str, bytes], ...]
    block_ids: BlockIds


PullEffect = Completed | SendCancel | Verify


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

        Raises :class:`~pdactors.errors.DuplicateTransfer` (and changes nothing) when
        ``transfer_id`` is in flight.
        """
        state, _ = self._rule(transfer_id, PullEvent.START)
        assert state is not None
        pull = Pull(
            transfer_id,
            bootstrap_url,
            engine_id,
            block_ids,
            now,
            now + self.timeout,
            state,
            waiter=waiter,
        )
        self._pulls[transfer_id] = pull
        return pull

    def abort(self, transfer_id: str, reason: str = "aborted by D") -> list[PullEffect]:
        """D's engine no longer wants ``transfer_id``; ignored if already ended or aborting.

        Ends at once when P was not asked yet; otherwise P is told and the pull ends when P
        answers (or is gone, or at the deadline), so D's blocks are not reused under a write.
        """
        pull, do = self._fire(transfer_id, PullEvent.ABORT)
        if do is PullDo.CANCEL:
            assert pull is not None
            pull.abort_reason = reason
        return self._carry_out(pull, do, reason, PullEnd.ABORTED)

    # ------------------------------------------------------------------ the actor's work

    def sent(
        self,
        transfer_id: str,
        peers: str | Sequence[str],
        request: PullRequest | None = None,
        epochs: Sequence[int] = (),
    ) -> list[PullEffect]:
        """The pull ``request`` went out to ``peers`` (one P worker's address, or several),
        meant for the P epochs ``epochs`` (one per peer; none: not known). If the pull ended
        meanwhile, cancel it there. Raises :class:`PeerMismatch` (a ``ValueError``) unless
        ``peers`` are distinct and at least one."""
        peers = (peers,) if isinstance(peers, str) else tuple(peers)
        if not peers or len(set(peers)) != len(peers):
            raise PeerMismatch(f"{transfer_id}: a pull goes to distinct P workers, got {peers}")
        pull, do = self._fire(transfer_id, PullEvent.SENT)
        if do is PullDo.CANCEL_UNSENT:
            return [SendCancel(p, transfer_id, "pull ended before it was sent") for p in peers]
        assert pull is not None
        pull.peers, pull.request, pull.waiting = peers, request, set(peers)
        pull.p_epochs = dict(zip(peers, epochs, strict=False))
        return []

    def answered(
        self,
        transfer_id: str,
        *,
        ok: bool,
        reason: str = "",
        peer: str | None = None,
        epoch: int = 0,
        lookup_again: bool = False,
        sums: bytes | None = None,
    ) -> list[PullEffect]:
        """P answered (``PullDone`` → ok, ``PullFailed`` → not ok), from its life ``epoch``
        (0: not said). Late answers, answers from a ``peer`` that was not asked or answered
        already, and answers from another life of it (:meth:`Pull.from_other_life`) are
        ignored. ``peer`` may be left out for a pull sent to one P worker (else
        :class:`PeerMismatch`). ``sums``: the ``PullDone``'s checksums when D verifies (None:
        it does not); once every part has landed, a pull with any is checked
        (:class:`Verify`) before it is delivered."""
        event = PullEvent.ANSWER if ok else PullEvent.REFUSED
        pull = self._pulls.get(transfer_id)
        if self._rule(transfer_id, event)[1] is PullDo.NOTHING or pull is None:
            return []  # not in flight, or P was not asked yet: a late or stray answer
        if peer is None:
            if len(pull.peers) != 1:
                raise PeerMismatch(f"{transfer_id}: went to {len(pull.peers)} P workers; say which")
            peer = pull.peers[0]
        if peer not in pull.waiting or pull.from_other_life(peer, epoch, lookup_again=lookup_again):
            return []
        pull.waiting.discard(peer)
        if ok and sums is not None:
            pull.sums.append((peer, sums))
        pull, do = self._fire(transfer_id, event)
        return self._carry_out(pull, do, reason, PullEnd.REFUSED, why="")

    def verified(self, transfer_id: str, error: str | None) -> list[PullEffect]:
        """The check asked for by :class:`Verify` ended: None, what landed is P's KV (the pull
        is delivered); else ``error`` says where it differs (the pull ends ``CORRUPT``).
        Ignored when the pull ended meanwhile."""
        event = PullEvent.VERIFIED if error is None else PullEvent.CORRUPT
        pull, do = self._fire(transfer_id, event)
        return self._carry_out(pull, do, error or "", PullEnd.CORRUPT)

    def fail(self, transfer_id: str, reason: str, peer: str | None = None) -> list[PullEffect]:
        """D could not find or reach P for this pull (``peer``: one of the P workers it was
        sent to; None: all of them); ignored if already ended."""
        pull = self._pulls.get(transfer_id)
        if pull is not None and pull.state is not PullState.LOOKING_UP and peer is not None:
            if peer not in pull.waiting:
                return []
            pull.waiting.discard(peer)
        # The P workers still waiting may be writing: stop them, end once they are done.
        pull, do = self._fire(transfer_id, PullEvent.FAIL)
        return self._carry_out(pull, do, reason, PullEnd.UNREACHABLE)

    def peer_lost(self, peer: str, reason: str) -> list[PullEffect]:
        """P's side channel at ``peer`` is gone (process died, heartbeats stopped): every pull
        waiting for it ends now (once the other P workers it went to are done with D's
        blocks), and an aborting one frees D's blocks as soon as nothing else may write."""
        effects: list[PullEffect] = []
        for tid in self.on_peer(peer):
            self._pulls[tid].waiting.discard(peer)
            pull, do = self._fire(tid, PullEvent.PEER_LOST)
            effects += self._carry_out(pull, do, reason, PullEnd.P_GONE)
        return effects

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[PullEffect]:
        """End every pull whose deadline has passed."""
        effects: list[PullEffect] = []
        for tid in [t for t, p in self._pulls.items() if now >= p.deadline]:
            pull, do = self._fire(tid, PullEvent.DEADLINE)
            if do is PullDo.END_ABORTING:
                reason = f"P did not confirm within {self.timeout:g} s"
            else:
                reason = f"no answer from a live P within the pull deadline ({self.timeout:g} s)"
            effects += self._carry_out(pull, do, reason, PullEnd.DEADLINE)
        return effects

    def next_deadline(self) -> float:
        """The earliest deadline of a pull in flight (``inf`` when none)."""
        return min((p.deadline for p in self._pulls.values()), default=float("inf"))

    # ------------------------------------------------------------------ internals

    def _rule(self, transfer_id: str, event: PullEvent) -> tuple[PullState | None, PullDo]:
        """What :data:`~pdactors.core.pull_rules.PULL_TRANSITIONS` says ``event`` does."""
        pull = self._pulls.get(transfer_id)
        return next_pull_state(transfer_id, pull.state if pull else None, event)

    def _fire(self, transfer_id: str, event: PullEvent) -> tuple[Pull | None, PullDo]:
        """Move the pull as the rules say (a move to None is ended by :meth:`_carry_out`)."""
        state, do = self._rule(transfer_id, event)
        pull = self._pulls.get(transfer_id)
        if pull is not None and state is not None:
            pull.state = state
        return pull, do

    def _carry_out(
        self, pull: Pull | None, do: PullDo, reason: str, end: PullEnd, *, why: str | None = None
    ) -> list[PullEffect]:
        """The effects of a move: ``end`` and ``reason`` are how a part failed (or the pull
        ended); ``why`` what an aborting pull's end adds (default ``reason``)."""
        if do is PullDo.NOTHING or pull is None:
            return []
        why = reason if why is None else why
        match do:
            case PullDo.CANCEL:
                return self._cancels(pull, reason)
            case PullDo.PART_FAILED:
                pull.failure = (end, reason)
                return [*self._cancels(pull, reason), *self._settled(pull)]
            case PullDo.SETTLE:
                return self._settled(pull, why)
            case PullDo.END_DEADLINE:
                return [self._end(pull, PullEnd.DEADLINE, reason), *self._cancels(pull, reason)]
            case PullDo.END_ABORTING:
                return [self._end(pull, *self._abort_end(pull, why))]
            case PullDo.END_ABORTED | PullDo.END_UNREACHABLE | PullDo.END_CORRUPT:
                return [self._end(pull, end, reason)]
            case PullDo.END_DELIVERED:
                return [self._end(pull, PullEnd.DELIVERED, "")]
        raise IllegalTransition(f"{pull.transfer_id}: {do.value} is not carried out here")

    def _settled(self, pull: Pull, why: str = "") -> list[PullEffect]:
        """End ``pull`` if no P worker may still write into its blocks."""
        if pull.waiting:
            return []
        if pull.state is PullState.SENT and pull.sums:
            _, do = self._fire(pull.transfer_id, PullEvent.LANDED)
            assert do is PullDo.VERIFY
            return [Verify(pull.transfer_id, tuple(pull.sums), pull.block_ids)]
        _, do = self._fire(pull.transfer_id, PullEvent.SETTLED)
        if do is PullDo.END_DELIVERED:
            return [self._end(pull, PullEnd.DELIVERED, "")]
        return [self._end(pull, *self._abort_end(pull, why))]

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
