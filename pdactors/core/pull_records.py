"""D side: a pull's record, its ends and the effects of the pull table's moves.

:class:`~pdactors.core.pull_table.PullTable` holds one :class:`Pull` per pull in flight and
returns these effects for the receiver actor to carry out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from pdactors.core.pull_rules import PullState
from pdactors.wire import BlockIds, PullRequest

__all__ = ["Completed", "Fence", "Pull", "PullEffect", "PullEnd", "SendCancel", "Verify"]


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
    #: Those of ``peers`` that said they write into D's blocks (``Writing``) and have not
    #: answered since.
    writing: set[str] = field(default_factory=set)
    #: Those of ``writing`` that D lost before their answer: a write of theirs may still
    #: land, so the pull (and D's blocks) waits for their word or their death, until
    #: ``fence_until`` at the latest (:class:`Fence`); meanwhile the pull deadline waits too.
    fencing: set[str] = field(default_factory=set)
    fence_until: float = float("inf")
    #: What the P workers said they wrote, over the parts that landed (``PullDone.nbytes``).
    nbytes: int = 0
    #: The engine's "it landed" callback (from a thread), for P's landed notice (issue 28);
    #: ``done_token``: the latch opened for it when the pull was sent, until the actor closed
    #: it (0: none); ``landed_early``: the notice had completed it (the pull was reported).
    on_landed: Callable[[], None] | None = None
    done_token: int = 0
    landed_early: bool = False

    @property
    def ends_at(self) -> float:
        """When time alone ends this pull: the fence timeout while it is fenced (a write may
        still land: the pull deadline does not free D's blocks under it), else the deadline."""
        return self.fence_until if self.fencing else self.deadline

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


@dataclass(frozen=True, slots=True)
class Fence:
    """D lost the P worker at ``peer`` while it may be writing ``transfer_ids``: ask it again,
    on a new connection, to confirm it stopped (``CancelPull``: P answers once no write of
    that transfer is in flight), then :meth:`PullTable.fenced`; or find it dead (nothing
    listens at its address any more: :meth:`PullTable.fenced` with no transfer id). The
    pulls end anyway at ``until`` (``fence_timeout``): :meth:`PullTable.tick` then ends them,
    their blocks reused at a risk their end names."""

    peer: str
    transfer_ids: tuple[str, ...]
    until: float


PullEffect = Completed | SendCancel | Verify | Fence
