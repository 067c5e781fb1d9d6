"""D side: the pulls one D worker has in flight, and how each one ends.

Sans-IO, like :mod:`pdactors.core.send_table`. Every pull ends exactly once — delivered,
failed, aborted or timed out — and that end is one :class:`Completed` effect. A pull that had
reached P when it was aborted or timed out also yields :class:`SendCancel`, so P frees its
blocks at once instead of waiting for its own expiry.

An abort of a pull that reached P does not end it at once: P may be writing into D's blocks, so
the pull ends (as failed) when P answers anything, or at its deadline. Only then may D reuse the
blocks.

============  ===========================  ===============================================
state         entered when                 leaves when
============  ===========================  ===============================================
LOOKING_UP    ``start``                    ``sent`` → SENT; ``fail`` / ``abort`` / the
                                           deadline → ended (Completed)
SENT          the pull went out to P       P answers, ``fail`` or the deadline → ended
                                           (Completed, + SendCancel on the deadline);
                                           ``abort`` → ABORTING (+ SendCancel)
ABORTING      D gave up on a pull P has    P answers (whatever it says), ``fail`` or the
                                           deadline → ended (Completed, failed)
============  ===========================  ===============================================

Ended pulls are forgotten at once; a late answer from P is ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdactors.errors import IllegalTransition

__all__ = ["Completed", "PullState", "PullTable", "SendCancel"]


class PullState(enum.Enum):
    LOOKING_UP = "looking_up"
    SENT = "sent"
    ABORTING = "aborting"


@dataclass(frozen=True, slots=True)
class Completed:
    """The pull of ``transfer_id`` ended: ``ok`` (KV landed) or failed with ``reason``."""

    transfer_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SendCancel:
    """Tell the P worker at ``peer`` that D gave up on ``transfer_id``."""

    peer: str
    transfer_id: str
    reason: str


PullEffect = Completed | SendCancel


@dataclass(slots=True)
class _Pull:
    state: PullState
    deadline: float
    peer: str = ""
    reason: str = ""  # why D aborted (ABORTING)


class PullTable:
    """The pulls of one D worker (see the module docstring for the rules)."""

    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self._pulls: dict[str, _Pull] = {}

    def __len__(self) -> int:
        return len(self._pulls)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._pulls

    def state(self, transfer_id: str) -> PullState | None:
        pull = self._pulls.get(transfer_id)
        return pull.state if pull else None

    def start(self, transfer_id: str, now: float) -> None:
        """A new pull; it must end within ``timeout`` seconds from ``now``."""
        if transfer_id in self._pulls:
            raise IllegalTransition(f"{transfer_id}: a pull is already in flight")
        self._pulls[transfer_id] = _Pull(PullState.LOOKING_UP, now + self.timeout)

    def sent(self, transfer_id: str, peer: str) -> list[PullEffect]:
        """The pull request went out to ``peer``. If it ended meanwhile, cancel it there."""
        pull = self._pulls.get(transfer_id)
        if pull is None:
            return [SendCancel(peer, transfer_id, "pull ended before it was sent")]
        if pull.state is not PullState.LOOKING_UP:
            raise IllegalTransition(f"{transfer_id}: sent while {pull.state.value}")
        pull.state, pull.peer = PullState.SENT, peer
        return []

    def answered(self, transfer_id: str, *, ok: bool, reason: str = "") -> list[PullEffect]:
        """P answered (``PullDone`` → ok, ``PullFailed`` → not ok). Late answers are ignored."""
        pull = self._pulls.get(transfer_id)
        if pull is None or pull.state is PullState.LOOKING_UP:
            return []
        del self._pulls[transfer_id]
        if pull.state is PullState.ABORTING:  # P is done with D's blocks; D gave up on them
            return [Completed(transfer_id, False, pull.reason)]
        return [Completed(transfer_id, ok, reason)]

    def fail(self, transfer_id: str, reason: str) -> list[PullEffect]:
        """The pull failed on D's side (look-up, socket); ignored if already ended."""
        pull = self._pulls.pop(transfer_id, None)
        return [] if pull is None else [Completed(transfer_id, False, reason)]

    def abort(self, transfer_id: str, reason: str = "aborted by D") -> list[PullEffect]:
        """D's engine no longer wants ``transfer_id``; ignored if already ended or aborting.

        Ends at once when P was not asked yet; otherwise P is told and the pull ends when P
        answers (or at the deadline), so D's blocks are not reused under a write.
        """
        pull = self._pulls.get(transfer_id)
        if pull is None or pull.state is PullState.ABORTING:
            return []
        if pull.state is PullState.LOOKING_UP:
            del self._pulls[transfer_id]
            return [Completed(transfer_id, False, reason)]
        pull.state, pull.reason = PullState.ABORTING, reason
        return [SendCancel(pull.peer, transfer_id, reason)]

    def tick(self, now: float) -> list[PullEffect]:
        """End every pull whose deadline has passed."""
        late = [tid for tid, pull in self._pulls.items() if now >= pull.deadline]
        effects: list[PullEffect] = []
        for tid in late:
            pull = self._pulls.pop(tid)
            if pull.state is PullState.ABORTING:
                reason = f"{pull.reason}; P did not confirm within {self.timeout:g} s"
                effects.append(Completed(tid, False, reason))
                continue
            reason = f"timed out after {self.timeout:g} s"
            effects.append(Completed(tid, False, reason))
            if pull.state is PullState.SENT:
                effects.append(SendCancel(pull.peer, tid, reason))
        return effects

    def next_deadline(self) -> float:
        """The earliest deadline of a pull in flight (``inf`` when none)."""
        return min((p.deadline for p in self._pulls.values()), default=float("inf"))
