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

A write that may land after D lost its writer is fenced: a P worker says ``Writing``
(:meth:`PullTable.writing`) before it writes a pull's blocks; if D loses it before its answer
(:meth:`PullTable.peer_lost`), the pull stays ABORTING and keeps D's blocks (:class:`Fence`)
until that P worker confirms no write is in flight or is found dead (:meth:`PullTable.fenced`),
or ``fence_timeout`` passes (:meth:`PullTable.tick`: the end names the risk). Such a pull never
ends delivered, and the pull deadline does not end it while it is fenced.

A second ``start`` for a transfer id in flight raises
:class:`~pdactors.errors.DuplicateTransfer` and changes
nothing. Ended pulls are forgotten at once; a late answer from P, or one from a peer the pull
was not sent to (or that answered already), is ignored; so is one from another life of that
P worker than the one the pull was sent to (its epoch, :mod:`pdactors.core.epochs`), but its
refusal of a pull meant for another life (``lookup_again``): that P wrote nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdactors.core.pull_records import (
    Completed,
    Fence,
    Pull,
    PullEffect,
    PullEnd,
    SendCancel,
    Verify,
)
from pdactors.core.pull_rules import PeerMismatch, PullDo, PullEvent, PullState, next_pull_state
from pdactors.errors import IllegalTransition
from pdactors.wire import BlockIds, PullRequest

__all__ = [
    "Completed",
    "Fence",
    "PeerMismatch",
    "Pull",
    "PullEffect",
    "PullEnd",
    "PullState",
    "PullTable",
    "SendCancel",
    "Verify",
]


class PullTable:
    """The pulls of one D worker (see the module docstring for the rules).

    ``timeout`` is the pull deadline: the last resort for a P that stays alive and silent.
    ``fence_timeout``: the longest a pull keeps D's blocks for a P worker lost while it wrote
    them, which neither confirms it stopped nor is found dead (0: no fence, the pull ends
    when P is lost).
    """

    def __init__(self, *, timeout: float, fence_timeout: float = 0.0) -> None:
        self.timeout = timeout
        self.fence_timeout = fence_timeout
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

    def fencing(self, peer: str) -> set[str]:
        """The pulls that wait for the lost ``peer`` to confirm it stopped writing."""
        return {t for t, p in self._pulls.items() if peer in p.fencing}

    def fenced_pulls(self) -> list[str]:
        """The pulls fenced on any lost P worker (a write of theirs may still land)."""
        return [t for t, p in self._pulls.items() if p.fencing]

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
        on_landed: Callable[[], None] | None = None,
    ) -> Pull:
        """A new pull; it must end within ``timeout`` seconds from ``now``. ``waiter`` and
        ``on_landed`` are kept for the actor (:class:`Pull`).

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
            on_landed=on_landed,
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
        nbytes: int = 0,
    ) -> list[PullEffect]:
        """P answered (``PullDone`` → ok, ``PullFailed`` → not ok), from its life ``epoch``
        (0: not said). Late answers, answers from a ``peer`` that was not asked or answered
        already, and answers from another life of it (:meth:`Pull.from_other_life`) are
        ignored. ``peer`` may be left out for a pull sent to one P worker (else
        :class:`PeerMismatch`). ``sums``: the ``PullDone``'s checksums when D verifies (None:
        it does not); once every part has landed, a pull with any is checked
        (:class:`Verify`) before it is delivered. ``nbytes``: what the part wrote, added to
        the pull's :attr:`~pdactors.core.pull_records.Pull.nbytes`."""
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
        pull.writing.discard(peer)
        if ok and sums is not None:
            pull.sums.append((peer, sums))
        if ok:
            pull.nbytes += nbytes
        pull, do = self._fire(transfer_id, event)
        return self._carry_out(pull, do, reason, PullEnd.REFUSED, why="")

    def writing(self, transfer_id: str, peer: str, epoch: int = 0) -> list[PullEffect]:
        """The P worker at ``peer`` says it writes ``transfer_id`` into D's blocks now (from
        its life ``epoch``); should D lose it before its answer, the pull is fenced
        (:meth:`peer_lost`). Ignored as :meth:`answered` ignores a stray answer."""
        pull = self._pulls.get(transfer_id)
        if pull is None or peer not in pull.waiting or pull.from_other_life(peer, epoch):
            return []
        pull, do = self._fire(transfer_id, PullEvent.WRITING)
        if do is PullDo.NOTE_WRITING and pull is not None:
            pull.writing.add(peer)
        return []

    def fenced(self, peer: str, transfer_id: str | None, why: str) -> list[PullEffect]:
        """The lost P worker at ``peer`` no longer writes ``transfer_id`` (it answered D's
        cancel on a new connection) or anything (None: it is dead): each pull fenced on it
        ends, failed, once no other P worker may write (its end adds ``why``); ignored for a
        pull not fenced on ``peer``."""
        effects: list[PullEffect] = []
        tids = self.fencing(peer) if transfer_id is None else {transfer_id}
        for tid in sorted(tids):
            pull = self._pulls.get(tid)
            if pull is None or peer not in pull.fencing:
                continue
            pull.fencing.discard(peer)
            if not pull.fencing:
                pull.fence_until = float("inf")
            if pull.failure is not None:
                pull.failure = (pull.failure[0], f"{pull.failure[1]}; {why}")
            pull_, do = self._fire(tid, PullEvent.FENCED)
            effects += self._carry_out(pull_, do, why, PullEnd.P_GONE)
        return effects

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

    def peer_lost(self, peer: str, reason: str, now: float = 0.0) -> list[PullEffect]:
        """P's side channel at ``peer`` is gone (process died, heartbeats stopped): every pull
        waiting for it ends now (once the other P workers it went to are done with D's
        blocks), and an aborting one frees D's blocks as soon as nothing else may write.
        But a pull ``peer`` said it was writing (``Writing``, not answered since) is fenced
        when ``fence_timeout`` is on: it keeps D's blocks, ending only once P confirms it
        stopped or is found dead (:class:`Fence`, then :meth:`fenced`), or ``fence_timeout``
        after ``now`` (:meth:`tick`)."""
        effects: list[PullEffect] = []
        fenced: list[str] = []
        until = now + self.fence_timeout
        for tid in self.on_peer(peer):
            pull = self._pulls[tid]
            pull.waiting.discard(peer)
            if peer in pull.writing and self.fence_timeout > 0:
                pull.fencing.add(peer)
                pull.fence_until = min(pull.fence_until, until)
                fenced.append(tid)
            pull.writing.discard(peer)
            pull_, do = self._fire(tid, PullEvent.PEER_LOST)
            effects += self._carry_out(pull_, do, reason, PullEnd.P_GONE)
        if fenced:
            effects.append(Fence(peer, tuple(fenced), until))
        return effects

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[PullEffect]:
        """End every pull whose time is up: a fenced one at its fence timeout (its end names
        the risk of a late write), any other at its deadline."""
        effects: list[PullEffect] = []
        for tid in [t for t, p in self._pulls.items() if p.fencing and now >= p.fence_until]:
            held = self._pulls[tid]
            at_risk = (f"P worker {', '.join(sorted(held.fencing))}, lost while writing, "
                       f"neither confirmed it stopped nor was found dead within "
                       f"{self.fence_timeout:g} s: D's blocks are reused though a late write "
                       "may still land in them")  # fmt: skip
            held.fencing.clear()
            if held.failure is not None:
                held.failure = (held.failure[0], f"{held.failure[1]}; {at_risk}")
            _, do = self._fire(tid, PullEvent.FENCE_TIMEOUT)
            effects += self._carry_out(held, do, at_risk, PullEnd.P_GONE)
        for tid in [t for t, p in self._pulls.items() if not p.fencing and now >= p.deadline]:
            pull, do = self._fire(tid, PullEvent.DEADLINE)
            if do is PullDo.END_ABORTING:
                reason = f"P did not confirm within {self.timeout:g} s"
            else:
                reason = f"no answer from a live P within the pull deadline ({self.timeout:g} s)"
            effects += self._carry_out(pull, do, reason, PullEnd.DEADLINE)
        return effects

    def next_deadline(self) -> float:
        """When :meth:`tick` next ends a pull in flight (``inf`` when none may)."""
        return min((p.ends_at for p in self._pulls.values()), default=float("inf"))

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
        if pull.waiting or pull.fencing:
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
