"""What the send table hands out and keeps: its effects, and the record of one transfer.

The effects (:class:`Reply`, :class:`StartSend`, :class:`Release`, and the streamed write's
:class:`~pdactors.core.send_stream.Wake`) are what
:class:`~pdactors.core.send_table.SendTable`'s methods return for the actor to carry out; the
record of one transfer (``Entry``, with its :class:`~pdactors.core.send_stream.Stream`) holds
all its state, so the actor keeps none of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdactors.core.send_rules import SendEvent, SendState
from pdactors.core.send_stream import Complete, Stream, Wake
from pdactors.wire import BlockIds, Msg, PullRequest

__all__ = [
    "Effect",
    "Release",
    "Reply",
    "SendTableStats",
    "StartSend",
    "has_claim_from",
    "refusal",
    "same_pull",
    "writes_into",
]

END_REASONS = {
    SendState.DONE: "already delivered",
    SendState.FAILED: "the transfer failed",
    SendState.TIMED_OUT: "P's prefill was not ready in time",
    SendState.EXPIRED: "P's KV expired before the pull arrived",
    SendState.DROPPED: "P dropped the request (aborted or failed)",
    SendState.CANCELLED: "the transfer was cancelled by D",
}
WRITES_GIVEN_UP = {
    SendState.DROPPED: SendEvent.WRITES_DROPPED,
    SendState.CANCELLED: SendEvent.WRITES_CANCELLED,
}


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``msg`` to the D worker behind ROUTER identity ``identity``."""

    identity: bytes
    msg: Msg


@dataclass(frozen=True, slots=True)
class StartSend:
    """Write P's ``src_blocks`` into the blocks named by ``pull`` (from the D worker behind
    ``identity``); then call ``send_finished``.

    ``streamed``: P is still computing the KV; the actor writes it layer by layer as P reports
    each one complete (:meth:`SendTable.take_layers`), and the rest once P says it is done.
    ``before``: the wait for P's KV to be complete in memory, if P gave one.
    """

    transfer_id: str
    pull: PullRequest
    src_blocks: BlockIds
    streamed: bool = False
    identity: bytes = b""
    before: Complete | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Release:
    """P may free the blocks of ``transfer_id`` (reported as ``finished_sending``)."""

    transfer_id: str
    state: SendState


Effect = Reply | StartSend | Release | Wake


@dataclass(slots=True)
class Claim:
    """One D worker's pull of a transfer, not answered yet."""

    identity: bytes
    pull: PullRequest
    writing: bool = False


@dataclass(slots=True)
class Entry:
    state: SendState
    blocks: BlockIds | None = None
    complete: Complete | None = None  # P's wait for the KV in ``blocks``
    #: Pulls not answered yet: all waiting while PENDING, all being written while SENDING.
    claims: list[Claim] = field(default_factory=list)
    expected: int = 0  # pulls this transfer gets in all (0: none arrived yet)
    answered: int = 0  # pulls answered by a write
    pulled_by: set[int] = field(default_factory=set)  # D tp ranks whose pull arrived
    error: str = ""  # the first failed write's
    #: P dropped it or D cancelled while writes were in flight: how it ends after them.
    giving_up: SendState | None = None
    reason: str = ""
    had_blocks: bool = False
    stream: Stream | None = None  # written layer by layer while P computes it
    #: The deadline queue this entry is in (None: SENDING has no deadline).
    timer: OrderedDict[str, float] | None = None
    #: D connections whose cancel is answered once no write of this transfer into the D
    #: memory (data-plane session) they name is in flight: a D that lost P's connection
    #: mid-write asks so on a new one (its fence). ``(identity, session)``.
    fence_waiters: list[tuple[bytes, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SendTableStats:
    """What a send table holds (``live`` transfers, ``tombstones`` of ended ones) and how many
    transfers ended each way since it started."""

    live: int
    tombstones: int
    sent: int
    failed: int
    expired: int
    timed_out: int


def refusal(entry: Entry, pull: PullRequest, expected: int) -> str | None:
    """Why a live transfer refuses this new pull (None: it takes it)."""
    if entry.giving_up is not None:
        return entry.reason or END_REASONS[entry.giving_up]
    if entry.error:  # a write failed: it ends FAILED once the others are done
        return entry.error
    if pull.tp_rank in entry.pulled_by:
        return "duplicate pull for this transfer"
    if entry.expected and expected != entry.expected:
        return f"D's pulls disagree on its shape ({entry.expected} vs {expected} pullers)"
    return None


def same_pull(a: PullRequest, b: PullRequest) -> bool:
    """The same request, whether or not one of them carried D's layout."""
    return (a.session, a.block_ids, a.layout_id) == (b.session, b.block_ids, b.layout_id)


def has_claim_from(entry: Entry, identity: bytes) -> bool:
    """Whether a pull of the D worker behind ``identity`` waits in ``entry``."""
    return any(c.identity == identity for c in entry.claims)


def writes_into(claim: Claim, session: str) -> bool:
    """Whether ``claim``'s write into the D memory ``session`` is in flight."""
    return claim.writing and claim.pull.session == session
